"""The cloud on a MemoryBus that, like MqttBus, counts handler errors instead of raising: an
edge report with a malformed label histogram is rejected with a reason and the round still
closes, and a round transition that fails stops the cloud (``failed``) instead of leaving
it waiting with no deadline armed. A federation whose round announcement cannot fit a
transport message is refused before anything connects."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cloud import CloudServer
from cloud.service import check_round_start_fits, largest_round_start
from shared.errors import ConfigError
from shared.metrics.prometheus import parse_exposition
from shared.transport.bus import MemoryBus
from shared.transport.local_broker import LocalBroker, find_mosquitto
from shared.wire.messages import EdgeUpdate, Topics, cloud_only_home, encode, home_of
from tests.conftest import tiny_config
from tests.hand_roles import registered_cloud

REPO = Path(__file__).resolve().parents[1]


def _cloud(**algorithm: Any) -> tuple[MemoryBus, CloudServer, Any, Topics]:
    """A FedPhD cloud with two edges, one device each, its first round open."""
    cfg = tiny_config(
        algorithm={"name": "fedphd", **algorithm}, federation={"num_devices": 2, "num_edges": 2}
    )
    return registered_cloud(cfg)


def _report(
    cloud: CloudServer,
    ep: Any,
    topics: Topics,
    edge: str,
    counts: list[int],
    part_samples: dict[str, int] | None = None,
) -> None:
    ref = cloud.put_tensors(cloud.model, "edge_model")  # in-process: found by its hash
    ref = ref.model_copy(update={"src": cloud_only_home(home_of("edge", edge))})
    msg = EdgeUpdate(
        round=cloud.round, session=cloud.session, edge=edge, model_ref=ref, n_samples=10,
        label_counts=counts, devices=[], train_seconds=0.0, part_samples=part_samples,
    )  # fmt: skip
    ep.publish(topics.edge_up(edge), encode(msg), kind="m")


def test_an_open_round_exposes_when_it_opened_and_its_deadline() -> None:
    """What the EstuaryRoundStalled alert reads (docker/estuary-rules.yml): the cloud's round
    start as Unix time and how long the round may stay open (1.5 x the edges' deadline +
    10 s); both move on with the next round."""
    before = time.time()
    bus, cloud, ep, topics = _cloud()
    samples = parse_exposition(cloud.metrics.render().decode())
    started = samples["estuary_round_start_time_seconds"]
    assert before <= started <= time.time()
    assert samples["estuary_round_deadline_seconds"] == 60 * 1.5 + 10
    assert samples['estuary_phase{estuary_phase="training"}'] == 1
    for edge in ("edge0", "edge1"):
        _report(cloud, ep, topics, edge, [1] * 10)
    assert bus.run(lambda: cloud.round == 1)
    assert (
        parse_exposition(cloud.metrics.render().decode())["estuary_round_start_time_seconds"]
        >= started
    )


@pytest.mark.parametrize("counts", [[], [1] * 9, [2] * 10], ids=["empty", "nine", "bad_sum"])
def test_edge_report_with_a_bad_histogram_is_rejected_and_the_round_closes(
    counts: list[int],
) -> None:
    bus, cloud, ep, topics = _cloud()
    _report(cloud, ep, topics, "edge0", [1] * 10)
    _report(cloud, ep, topics, "edge1", counts)
    assert bus.run(lambda: cloud.round == 1)  # closed at the deadline, with edge0's report
    rejected = bus.traffic.snapshot()["rejected"]
    assert rejected.get("cloud:bad_label_counts") == 1, rejected
    assert "bus:handler_error" not in rejected
    assert cloud.failed is None and cloud.timer is not None  # the next round is open


@pytest.mark.parametrize(
    ("algorithm", "part_samples"),
    [
        ({"name": "fedphd"}, {"encoder": 10}),  # FedPhD uploads whole models: no parts
        ({"name": "feddiffuse", "split": "usplit"}, {"encoder": 10, "middle": 1}),
        ({"name": "feddiffuse", "split": "usplit"}, {"encoder": 11}),  # > n_samples
    ],
    ids=["no_parts", "unknown_part", "too_many"],
)
def test_edge_report_with_bad_part_samples_is_rejected(
    algorithm: dict[str, str], part_samples: dict[str, int]
) -> None:
    bus, cloud, ep, topics = _cloud(**algorithm)
    _report(cloud, ep, topics, "edge0", [1] * 10, {"encoder": 10, "decoder": 0})
    _report(cloud, ep, topics, "edge1", [1] * 10, part_samples)
    assert bus.run(lambda: cloud.round == 1)
    rejected = bus.traffic.snapshot()["rejected"]
    expected = {"cloud:bad_part_samples": 2 if algorithm["name"] == "fedphd" else 1}
    assert {k: v for k, v in rejected.items() if k.startswith("cloud:")} == expected, rejected
    assert cloud.failed is None


def test_a_failing_round_transition_stops_the_cloud(monkeypatch: pytest.MonkeyPatch) -> None:
    bus, cloud, ep, topics = _cloud()

    def broken(*_: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cloud.algorithm, "cloud_aggregate", broken)
    for edge in ("edge0", "edge1"):
        _report(cloud, ep, topics, edge, [1] * 10)
    assert bus.run(lambda: cloud.failed is not None)
    assert cloud.failed is not None and "No space left on device" in cloud.failed
    assert "closing the round" in cloud.failed and not cloud.done
    assert bus.traffic.snapshot()["rejected"].get("bus:handler_error") == 1


def test_largest_round_start_bounds_the_real_one() -> None:
    bus, cloud, _ep, topics = _cloud()
    sent = len(bus._retained[topics.cloud_round])
    assert 0 < sent <= largest_round_start(cloud.cfg)


@pytest.mark.parametrize("assignment", ["static", "select"])
def test_a_federation_too_large_to_announce_is_refused_up_front(assignment: str) -> None:
    """30 000 devices in one round do not fit a 256 KiB round announcement; 10 000 do, and
    so do 30 000 at a participation of 0.2."""
    fed = {"num_edges": 2, "assignment": assignment}
    with pytest.raises(ConfigError, match="over the 262144-byte message limit"):
        check_round_start_fits(tiny_config(federation={**fed, "num_devices": 30_000}))
    check_round_start_fits(tiny_config(federation={**fed, "num_devices": 10_000}))
    check_round_start_fits(
        tiny_config(federation={**fed, "num_devices": 30_000, "participation": 0.2})
    )


@pytest.mark.skipif(find_mosquitto() is None, reason="needs the mosquitto binary")
def test_cloud_process_fails_when_no_device_registers(tmp_path: Path) -> None:
    """The registration timeout with no device is a failed run (exit 2), not a success: it
    used to exit 0 with no summary.json, and the demo then failed on the missing file."""
    cfg = tmp_path / "run.toml"
    cfg.write_text('[run]\nname = "lonely"\nrounds = 1\n[federation]\nnum_devices = 1\n'
                   "num_edges = 1\nregistration_timeout_s = 1.0\n")  # fmt: skip
    with LocalBroker(kind="mosquitto") as broker:
        proc = subprocess.run(
            [sys.executable, "-m", "cloud", str(cfg), "--out", str(tmp_path / "out"),
             "--broker", f"127.0.0.1:{broker.port}", "--metrics-port", "-1"],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log[-2000:]
    assert "no device registered" in log and "stopped after round 0 of 1" in log
    assert not (tmp_path / "out" / "summary.json").exists()


def _one_edge_run(
    monkeypatch: pytest.MonkeyPatch, *, shortcut: bool
) -> tuple[Any, list[Any], list[int]]:
    """A 1-edge, 2-device, 3-round federation in process; with ``shortcut`` False the cloud
    never treats an aggregate as the edge's own bytes. The cloud, the round starts and edge
    reports it saw, and the size of every blob the cloud encoded."""
    from shared.methods.aggregation import MeanFold
    from shared.wire.messages import RoundStart, decode
    from tests.conftest import synthetic_federation

    if not shortcut:
        monkeypatch.setattr(MeanFold, "exact_source", lambda self: None)
    cfg = tiny_config(run={"rounds": 3}, federation={"num_devices": 2, "num_edges": 1})
    fed, bus, _ = synthetic_federation(cfg)
    topics, seen = Topics(cfg.run.name), []
    spy = bus.endpoint("spy")
    for topic in (topics.cloud_round, topics.edge_up("edge0")):
        spy.subscribe(topic, lambda t, p: seen.append(p))
    encoded: list[int] = []
    encode = fed.cloud.ep.encode_tensors

    def counted(tensors: Any) -> Any:
        data = encode(tensors)
        encoded.append(len(data))
        return data

    monkeypatch.setattr(fed.cloud.ep, "encode_tensors", counted)
    fed.start()
    assert bus.run(lambda: fed.cloud.done)
    msgs = [decode(p, RoundStart) if b'"round_start"' in p else decode(p, EdgeUpdate)
            for p in seen]  # fmt: skip
    return fed.cloud, msgs, encoded


def test_a_one_edge_aggregate_is_served_as_the_edges_own_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With one edge, each round's new global is the edge's model blob itself (the same
    sha256: no encoding or hashing again, and the edge finds it in its own store), the
    bytes are the canonical encoding of the cloud's model, and the run ends at the model of
    a cloud that encodes and hashes the aggregate itself."""
    from shared.wire.codec import encode_tensors
    from shared.wire.messages import RoundStart

    cloud, msgs, encoded = _one_edge_run(monkeypatch, shortcut=True)
    assert len(encoded) == 1  # the initial global alone
    reports = [m.model_ref.sha256 for m in msgs if isinstance(m, EdgeUpdate) and m.model_ref]
    globals_ = [m.global_ref.sha256 for m in msgs if isinstance(m, RoundStart)]
    assert len(reports) == 3 and globals_[1:] == reports[:2]
    assert cloud.global_ref.sha256 == reports[2]
    assert cloud.global_ref.sha256 == hashlib.sha256(encode_tensors(cloud.model)).hexdigest()
    plain, plain_msgs, plain_encoded = _one_edge_run(monkeypatch, shortcut=False)
    assert len(plain_encoded) == 4  # and one per aggregation
    assert plain.global_ref.sha256 == cloud.global_ref.sha256
    assert [m.global_ref.sha256 for m in plain_msgs if isinstance(m, RoundStart)] == globals_
