"""Fault tolerance with every role as its own process on a real mosquitto: the cloud killed
with SIGKILL resumes to the same final model as an uninterrupted run; a device killed
mid-round does not stall the round; an edge restart and a broker restart are survived."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from device_agent.state import read_state
from estuary.launcher import Hierarchy
from estuary.simulate import simulate
from shared.config import RunConfig
from shared.evaluation.report import read_metrics
from shared.transport.local_broker import LocalBroker, find_mosquitto
from tests.conftest import tiny_config

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")


def _setup(tmp_path: Path, name: str, **over: dict[str, Any]) -> tuple[RunConfig, Path]:
    sections: dict[str, dict[str, Any]] = {
        "run": {"name": name, "rounds": 4},
        "federation": {"num_devices": 2, "num_edges": 2, "round_deadline_s": 60},
        "train": {"local_steps": 4, "batch_size": 8, "threads": 1},
    }
    for k, v in over.items():
        sections.setdefault(k, {}).update(v)
    cfg = tiny_config(**sections)
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    return cfg, path


@pytest.fixture
def hierarchy(tmp_path: Path) -> Iterator[Callable[[RunConfig, Path], Hierarchy]]:
    """Builds a Hierarchy on a fresh mosquitto; stops every process and the broker after."""
    made: list[tuple[Hierarchy, LocalBroker]] = []

    def make(cfg: RunConfig, path: Path) -> Hierarchy:
        broker = LocalBroker(kind="mosquitto", workdir=tmp_path / "broker").start()
        hier = Hierarchy(cfg, path, tmp_path / "run", broker, evaluate=False)
        made.append((hier, broker))
        return hier

    yield make
    for hier, broker in made:
        hier.stop_all(timeout_s=10)
        broker.stop()
        assert not [p.name for p in hier.procs.values() if p.alive], "orphan processes"


def _wait(pred: Callable[[], bool], timeout_s: float, what: str, hier: Hierarchy) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        failed = hier.failed()
        if failed:
            pytest.fail(f"{failed[0].name} died: {failed[0].log_tail()}")
        if time.monotonic() > end:
            tails = "\n".join(f"--- {p.name}\n{p.log_tail(8)}" for p in hier.procs.values())
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


@pytest.mark.parametrize(
    "algorithm",
    [{"name": "fedavg"}, {"name": "prism", "prism_local_iters": 12}],
    ids=["fedavg", "prism"],
)
def test_cloud_sigkill_resumes_to_the_uninterrupted_model(
    tmp_path: Path, hierarchy: Callable[[RunConfig, Path], Hierarchy], algorithm: dict[str, Any]
) -> None:
    """SIGKILL the cloud after its second checkpoint; the restarted cloud resumes at the next
    round and ends with the same global model as an uninterrupted run of the same seed
    (PRISM: its probabilities, mask counts and MADA step come back from the checkpoint, and
    MADA's draws are seeded by the step)."""
    cfg, path = _setup(
        tmp_path, "killcloud", run={"rounds": 5}, train={"local_steps": 12}, algorithm=algorithm
    )
    reference = simulate(cfg, tmp_path / "reference", progress=False, evaluate=False)

    hier = hierarchy(cfg, path)
    hier.start_all()
    _wait(lambda: _checkpoint_round(hier.run_dir) >= 2, 120, "two checkpoints", hier)
    scraped = hier.scrape_all()["cloud"]
    assert any(k.startswith("estuary_bytes_total{") for k in scraped)
    hier.kill("cloud")
    killed_after = _checkpoint_round(hier.run_dir)
    assert killed_after < cfg.run.rounds, "the run finished before the kill; slow it down"
    hier.start("cloud", "cloud")
    summary = _finish(hier)

    assert summary["resumed_after_round"] == killed_after
    assert summary["final_model_sha256"] == reference.final_model_sha256
    rounds = [r["round"] for r in read_metrics(hier.run_dir / "metrics.jsonl")]
    assert rounds == list(range(1, cfg.run.rounds + 1))
    assert "resuming after round" in hier.procs["cloud"].log_path.read_text()


def test_a_cloud_with_stay_serves_after_the_run_until_stopped(
    tmp_path: Path, hierarchy: Callable[[RunConfig, Path], Hierarchy]
) -> None:
    """``--stay`` (what the Kubernetes StatefulSet runs, since it restarts a cloud that
    exits): the finished cloud writes its summary at once, stays up with phase ``done`` on
    /metrics, and ends on SIGTERM after its goodbye."""
    cfg, path = _setup(tmp_path, "stay", run={"rounds": 2})
    hier = hierarchy(cfg, path)
    hier.cloud_args = ["--stay"]
    hier.start_all()
    _wait(lambda: (hier.run_dir / "summary.json").is_file(), 150, "the summary", hier)
    _wait(lambda: all(not hier.procs[d].alive for d in ("dev000", "dev001")), 60,
          "the devices to leave", hier)  # fmt: skip
    cloud = hier.procs["cloud"]
    assert cloud.alive, cloud.log_tail(20)
    assert json.loads((hier.run_dir / "summary.json").read_text())["rounds"] == 2
    assert hier.scrape_all()["cloud"]['estuary_phase{estuary_phase="done"}'] == 1
    hier.kill("cloud", signal.SIGTERM)
    assert cloud.returncode == 130, cloud.log_tail(20)
    text = cloud.log_path.read_text()
    assert "staying up (--stay)" in text and "cloud: disconnected" in text


def test_device_killed_mid_round_does_not_stall(
    tmp_path: Path, hierarchy: Callable[[RunConfig, Path], Hierarchy]
) -> None:
    """The edge sees the device's last will and closes the round without waiting for the
    deadline; later rounds go on without the dead device."""
    cfg, path = _setup(
        tmp_path,
        "killdev",
        run={"rounds": 3},
        federation={"num_devices": 4, "round_deadline_s": 300},
        train={"local_steps": 40},
    )
    hier = hierarchy(cfg, path)
    hier.start_all()
    _wait(lambda: _checkpoint_round(hier.run_dir) >= 1, 120, "round 1", hier)
    hier.kill("dev001")
    killed = time.monotonic()
    summary = _finish(hier)
    assert time.monotonic() - killed < cfg.federation.round_deadline_s / 3
    assert summary["rounds"] == cfg.run.rounds
    rows = read_metrics(hier.run_dir / "metrics.jsonl")
    assert rows[-1]["participants"] == 3  # the offline device is no longer drawn
    assert sum(r["updates"] for r in rows[1:]) < sum(r["participants"] for r in rows[1:]) + 1
    # the last will reaches the edge mid-round, or before the round starts if the kill was
    # quick; either way the edge says why it does not wait
    log = hier.procs["edge1"].log_path.read_text()
    assert re.search(r"dev001 (went offline in round|offline at the start of round) \d", log)


def test_edge_restart_and_broker_restart_are_survived(
    tmp_path: Path, hierarchy: Callable[[RunConfig, Path], Hierarchy]
) -> None:
    """SIGKILL and restart an edge, then kill and restart the broker: the run completes and
    every role reconnected."""
    cfg, path = _setup(
        tmp_path,
        "restarts",
        run={"rounds": 6},
        federation={"round_deadline_s": 20},
        train={"local_steps": 8},
    )
    hier = hierarchy(cfg, path)
    hier.start_all()
    _wait(lambda: _checkpoint_round(hier.run_dir) >= 1, 120, "round 1", hier)
    hier.kill("edge0")
    hier.start("edge", "edge0")
    _wait(lambda: _checkpoint_round(hier.run_dir) >= 3, 150, "round 3 after the edge restart", hier)
    hier.broker.kill()
    time.sleep(1.0)
    hier.broker.start()
    summary = _finish(hier, timeout_s=240)
    assert summary["rounds"] == cfg.run.rounds
    assert summary["transport"].get("reconnects", 0) >= 1
    assert hier.procs["edge0"].restarts == 1


def test_a_restarted_device_takes_up_its_saved_state(
    tmp_path: Path, hierarchy: Callable[[RunConfig, Path], Hierarchy]
) -> None:
    """SIGKILL a SCAFFOLD device after round 0 and start it again: it reads back the control
    variate and optimizer state it saved (``--state-dir``), trains the later rounds from
    them, and the run completes with both devices reporting."""
    cfg, path = _setup(
        tmp_path,
        "restartdev",
        run={"rounds": 10},
        algorithm={"name": "scaffold"},
        train={"local_steps": 12, "optimizer_state": "keep"},
        federation={"round_deadline_s": 30},
    )
    hier = hierarchy(cfg, path)
    hier.start_all()
    state = hier.run_dir / "state" / "dev001.safetensors"
    _wait(lambda: _checkpoint_round(hier.run_dir) >= 1 and state.is_file(), 120, "round 1", hier)
    hier.kill("dev001")
    hier.start("device", "dev001")
    summary = _finish(hier, timeout_s=180)
    assert summary["rounds"] == cfg.run.rounds
    log = hier.procs["dev001"].log_path.read_text()
    restored = re.search(r"dev001: restored its state from \S+ \(round (\d+) of session", log)
    assert restored, log[-2000:]
    assert "optimizer.state, scaffold.c_i" in log
    rows = read_metrics(hier.run_dir / "metrics.jsonl")
    # the cloud draws it again once it is back online, and it trains and reports
    assert rows[-1]["updates"] == 2, [(r["round"], r["updates"]) for r in rows]
    saved = read_state(state)
    assert saved is not None and saved.round == cfg.run.rounds - 1
    assert int(restored.group(1)) < saved.round


def test_deployment_reaches_training_and_sampling_only_devices(
    tmp_path: Path, hierarchy: Callable[[RunConfig, Path], Hierarchy]
) -> None:
    """After the last round the cloud exports, signs and publishes the model; both training
    devices and a sampling-only device (no torch) verify it and write a grid; the cloud
    waits for the training devices' reports before declaring the run done."""
    import subprocess
    import sys

    from shared.deploy.signing import generate_keys

    priv, pub = generate_keys(tmp_path / "keys")
    devices_out = tmp_path / "devices"
    deploy = {"signing_key": str(priv), "verify_key": str(pub), "out_dir": str(devices_out),
              "grid_size": 4, "sample_steps": 3, "parity_steps": 5, "threads": 1}  # fmt: skip
    cfg, path = _setup(tmp_path, "deploy", run={"rounds": 2}, deploy=deploy)
    hier = hierarchy(cfg, path)
    hier.start_all()
    viewer = subprocess.Popen(
        [sys.executable, "-m", "device_agent", str(path), "--id", "dev900", "--sample-only",
         "--broker", f"127.0.0.1:{hier.broker.port}", "--metrics-port", "-1", "--stay"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        summary = _finish(hier)
        reports = json.loads((hier.run_dir / "deploy" / "reports.json").read_text())
        card = json.loads((hier.run_dir / "deploy" / "card.json").read_text())
        assert card["parity"]["passed"] and card["source"]["round"] == 2
        assert summary["rounds"] == 2
        for d in ("dev000", "dev001"):
            assert reports[d]["event"] == "sampled" and reports[d]["images_per_s"] > 0
            assert list((devices_out / d / "samples").glob("deploy-*.png"))
        end = time.monotonic() + 60
        while not list((devices_out / "dev900" / "samples").glob("deploy-*.png")):
            assert viewer.poll() is None and time.monotonic() < end, "sampling-only device"
            time.sleep(0.2)
    finally:
        viewer.terminate()
        viewer.wait(timeout=20)
