"""Fault tolerance with every role as its own process on a real mosquitto, in three
scenarios, each launching its hierarchies once and checking several claims:

- the cloud killed with SIGKILL resumes to the same final model as an uninterrupted run, for
  FedAvg and for PRISM (its probabilities, mask counts and MADA step), two hierarchies side by
  side on one broker;
- a cloud with ``--stay`` deploys to training and sampling-only devices, stays up and ends on
  SIGTERM, beside a run in which a device killed mid-round does not stall the round;
- an edge restart, a device restart that takes up its saved state and a broker restart are
  survived, in one SCAFFOLD run.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from device_agent.state import read_state
from estuary.launcher import Hierarchy
from shared.config import RunConfig
from shared.deploy.signing import generate_keys
from shared.evaluation.report import read_metrics
from shared.transport.local_broker import LocalBroker
from tests.conftest import needs_mosquitto, shared_broker, tiny_config

pytestmark = [needs_mosquitto, pytest.mark.process]

Launch = Callable[..., Hierarchy]

broker = pytest.fixture(scope="module")(shared_broker)


def _setup(folder: Path, name: str, **over: dict[str, Any]) -> tuple[RunConfig, Path]:
    sections: dict[str, dict[str, Any]] = {
        "run": {"name": name, "rounds": 4},
        "federation": {"num_devices": 2, "num_edges": 2, "round_deadline_s": 60},
        "train": {"local_steps": 4, "batch_size": 8, "threads": 1},
    }
    for k, v in over.items():
        sections.setdefault(k, {}).update(v)
    cfg = tiny_config(**sections)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(cfg.to_json())
    return cfg, path


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launch]:
    """Builds a Hierarchy of a config on ``broker`` (a fresh mosquitto of its own when None);
    stops every process and every broker it started after the test."""
    made: list[Hierarchy] = []
    brokers: list[LocalBroker] = []

    def make(cfg: RunConfig, path: Path, broker: LocalBroker | None = None) -> Hierarchy:
        if broker is None:
            broker = LocalBroker(kind="mosquitto", workdir=path.parent / "broker").start()
            brokers.append(broker)
        hier = Hierarchy(cfg, path, path.parent / "run", broker, evaluate=False)
        made.append(hier)
        return hier

    yield make
    for hier in made:
        hier.stop_all(timeout_s=10)
    for broker in brokers:
        broker.stop()
    for hier in made:
        assert not [p.name for p in hier.procs.values() if p.alive], "orphan processes"


def _wait(pred: Callable[[], bool], timeout_s: float, what: str, *hiers: Hierarchy) -> None:
    """Wait until ``pred()``; fail at once when a process of ``hiers`` died of an error, and
    with every process's log tail on timeout."""
    end = time.monotonic() + timeout_s
    while not pred():
        for hier in hiers:
            failed = hier.failed()
            if failed:
                pytest.fail(f"{failed[0].name} ({hier.cfg.run.name}) died: {failed[0].log_tail()}")
        if time.monotonic() > end:
            tails = "\n".join(f"--- {h.cfg.run.name}/{p.name}\n{p.log_tail(8)}"
                              for h in hiers for p in h.procs.values())  # fmt: skip
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}\n{tails}")
        time.sleep(0.05)


def _checkpoint_round(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "checkpoints" / "latest.json").read_text())["round"])
    except (OSError, ValueError, KeyError):
        return -1


def _finish(hier: Hierarchy, timeout_s: float = 150) -> dict[str, Any]:
    code = hier.wait("cloud", timeout_s)
    assert code == 0, hier.procs["cloud"].log_tail(30)
    return dict(json.loads((hier.run_dir / "summary.json").read_text()))


@pytest.mark.slow
def test_a_sigkilled_cloud_resumes_to_the_uninterrupted_model_for_fedavg_and_prism(
    tmp_path: Path,
    launch: Launch,
    broker: LocalBroker,
    reference_sha: Callable[[RunConfig], str],
) -> None:
    """SIGKILL each cloud after its second checkpoint; the restarted cloud resumes at the
    next round and ends with the same global model as an uninterrupted run of the same seed
    (PRISM: its probabilities, mask counts and MADA step come back from the checkpoint, and
    MADA's draws are seeded by the step). FedAvg and PRISM run side by side."""
    algorithms: dict[str, dict[str, Any]] = {
        "fedavg": {"name": "fedavg"},
        "prism": {"name": "prism", "prism_local_iters": 12},
    }
    runs: dict[str, tuple[RunConfig, Hierarchy]] = {}
    for name, algorithm in algorithms.items():
        cfg, path = _setup(tmp_path / name, f"killcloud-{name}", run={"rounds": 5},
                           train={"local_steps": 12}, algorithm=algorithm)  # fmt: skip
        runs[name] = (cfg, launch(cfg, path, broker))
    references = {name: reference_sha(cfg) for name, (cfg, _) in runs.items()}
    hiers = [hier for _, hier in runs.values()]
    for hier in hiers:
        hier.start_all()

    killed_after: dict[str, int] = {}
    while len(killed_after) < len(runs):
        _wait(lambda: any(_checkpoint_round(h.run_dir) >= 2 for n, (_, h) in runs.items()
                          if n not in killed_after), 120, "two checkpoints", *hiers)  # fmt: skip
        for name, (cfg, hier) in runs.items():
            if name in killed_after or _checkpoint_round(hier.run_dir) < 2:
                continue
            scraped = hier.scrape_all()["cloud"]
            assert any(k.startswith("estuary_bytes_total{") for k in scraped), name
            hier.kill("cloud")
            killed_after[name] = _checkpoint_round(hier.run_dir)
            assert killed_after[name] < cfg.run.rounds, f"{name} finished before the kill"
            hier.start("cloud", "cloud")

    for name, (cfg, hier) in runs.items():
        summary = _finish(hier)
        assert summary["resumed_after_round"] == killed_after[name], name
        assert summary["final_model_sha256"] == references[name], name
        rounds = [r["round"] for r in read_metrics(hier.run_dir / "metrics.jsonl")]
        assert rounds == list(range(1, cfg.run.rounds + 1)), name
        assert "resuming after round" in hier.procs["cloud"].log_path.read_text(), name


def test_a_staying_cloud_deploys_to_every_device_beside_a_run_that_loses_a_device(
    tmp_path: Path, launch: Launch, broker: LocalBroker
) -> None:
    """Two hierarchies side by side on one broker.

    Deployment and ``--stay`` (what the Kubernetes StatefulSet runs, since it restarts a cloud
    that exits): after the last round the cloud exports, signs and publishes the model; both
    training devices and a sampling-only device (no torch) verify it and write a grid; the
    cloud waits for the training devices' reports before declaring the run done, writes its
    summary, stays up with phase ``done`` on /metrics, and ends on SIGTERM after its goodbye.

    A device killed mid-round: the edge sees its last will and closes the round without
    waiting for the deadline; later rounds go on without the dead device."""
    priv, pub = generate_keys(tmp_path / "keys")
    devices_out = tmp_path / "devices"
    deploy = {"signing_key": str(priv), "verify_key": str(pub), "out_dir": str(devices_out),
              "grid_size": 4, "sample_steps": 3, "parity_steps": 5, "threads": 1}  # fmt: skip
    cfg, path = _setup(tmp_path / "deploy", "stay-deploy", run={"rounds": 2}, deploy=deploy)
    stay = launch(cfg, path, broker)
    stay.cloud_args = ["--stay"]
    lossy_cfg, lossy_path = _setup(
        tmp_path / "killdev", "killdev", run={"rounds": 3},
        federation={"num_devices": 4, "round_deadline_s": 600}, train={"local_steps": 20},
    )  # fmt: skip
    lossy = launch(lossy_cfg, lossy_path, broker)
    stay.start_all()
    lossy.start_all()
    viewer = subprocess.Popen(
        [sys.executable, "-m", "device_agent", str(path), "--id", "dev900", "--sample-only",
         "--broker", f"127.0.0.1:{broker.port}", "--metrics-port", "-1", "--stay"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        _wait(lambda: _checkpoint_round(lossy.run_dir) >= 1, 150, "round 1", stay, lossy)
        lossy.kill("dev001")
        killed = time.monotonic()

        # the lost device does not stall the run
        summary = _finish(lossy, timeout_s=300)
        assert time.monotonic() - killed < lossy_cfg.federation.round_deadline_s / 3
        assert summary["rounds"] == lossy_cfg.run.rounds
        rows = read_metrics(lossy.run_dir / "metrics.jsonl")
        assert rows[-1]["participants"] == 3  # the offline device is no longer drawn
        assert sum(r["updates"] for r in rows[1:]) < sum(r["participants"] for r in rows[1:]) + 1
        # the last will reaches the edge mid-round, or before the round starts if the kill was
        # quick; either way the edge says why it does not wait
        log = lossy.procs["edge1"].log_path.read_text()
        assert re.search(r"dev001 (went offline in round|offline at the start of round) \d", log)

        # the staying cloud deployed to every device, then stays
        _wait(lambda: (stay.run_dir / "summary.json").is_file(), 150, "the summary", stay)
        _wait(lambda: all(not stay.procs[d].alive for d in ("dev000", "dev001")), 60,
              "the devices to leave", stay)  # fmt: skip
        summary = json.loads((stay.run_dir / "summary.json").read_text())
        assert summary["rounds"] == 2
        reports = json.loads((stay.run_dir / "deploy" / "reports.json").read_text())
        card = json.loads((stay.run_dir / "deploy" / "card.json").read_text())
        assert card["parity"]["passed"] and card["source"]["round"] == 2
        for d in ("dev000", "dev001"):
            assert reports[d]["event"] == "sampled" and reports[d]["images_per_s"] > 0
            assert list((devices_out / d / "samples").glob("deploy-*.png"))
        end = time.monotonic() + 60
        while not list((devices_out / "dev900" / "samples").glob("deploy-*.png")):
            assert viewer.poll() is None and time.monotonic() < end, "sampling-only device"
            time.sleep(0.2)
        cloud = stay.procs["cloud"]
        assert cloud.alive, cloud.log_tail(20)
        assert stay.scrape_all()["cloud"]['estuary_phase{estuary_phase="done"}'] == 1
        stay.kill("cloud", signal.SIGTERM)
        assert stay.wait("cloud", 60) == 130, cloud.log_tail(20)
        text = cloud.log_path.read_text()
        assert "staying up (--stay)" in text and "cloud: disconnected" in text
    finally:
        viewer.terminate()
        viewer.wait(timeout=20)


def test_edge_device_and_broker_restarts_are_survived(tmp_path: Path, launch: Launch) -> None:
    """One SCAFFOLD run on a broker of its own, disturbed three times, one after the other:
    SIGKILL a device after round 0 and start it again (it reads back the control variate and
    optimizer state it saved, ``--state-dir``, and trains the later rounds from them); once it
    trains again, SIGKILL and restart an edge; then kill and restart the broker. The run
    completes, every role reconnected, and both devices report in the last round."""
    cfg, path = _setup(
        tmp_path,
        "restarts",
        run={"rounds": 10},
        algorithm={"name": "scaffold"},
        train={"local_steps": 10, "optimizer_state": "keep"},
        federation={"round_deadline_s": 30},
    )
    hier = launch(cfg, path)
    hier.start_all()
    state = hier.run_dir / "state" / "dev001.safetensors"
    _wait(lambda: _checkpoint_round(hier.run_dir) >= 1 and state.is_file(), 120, "round 1", hier)
    hier.kill("dev001")
    killed_at = _checkpoint_round(hier.run_dir)
    hier.start("device", "dev001")
    device_log = hier.procs["dev001"].log_path
    _wait(lambda: "restored its state" in device_log.read_text()
          and _checkpoint_round(hier.run_dir) >= killed_at + 2, 150,
          "the restarted device to train again", hier)  # fmt: skip
    hier.kill("edge0")
    edge_killed_at = _checkpoint_round(hier.run_dir)
    hier.start("edge", "edge0")
    _wait(lambda: _checkpoint_round(hier.run_dir) >= edge_killed_at + 2, 150,
          "two rounds after the edge restart", hier)  # fmt: skip
    assert _checkpoint_round(hier.run_dir) < cfg.run.rounds - 2, "no rounds left; slow it down"
    hier.broker.kill()
    time.sleep(1.0)
    hier.broker.start()
    summary = _finish(hier, timeout_s=240)

    assert summary["rounds"] == cfg.run.rounds
    assert summary["transport"].get("reconnects", 0) >= 1
    assert hier.procs["edge0"].restarts == 1
    log = device_log.read_text()
    restored = re.search(r"dev001: restored its state from \S+ \(round (\d+) of session", log)
    assert restored, log[-2000:]
    assert "optimizer.state, scaffold.c_i" in log
    rows = read_metrics(hier.run_dir / "metrics.jsonl")
    # the cloud draws the device again once it is back online, and it trains and reports
    assert rows[-1]["updates"] == 2, [(r["round"], r["updates"]) for r in rows]
    saved = read_state(state)
    assert saved is not None and saved.round == cfg.run.rounds - 1
    assert int(restored.group(1)) < saved.round
