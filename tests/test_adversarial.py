"""Attacks and leftovers that must not end, stall or fake a federation.

- A finished run's retained "done" on the broker (left by an earlier run of the same config,
  or forged on an open broker while no cloud is online) does not make edges and devices of
  a new run leave: they wait for the new cloud, and the rerun ends at the same model as the
  first run.
- A run in which no round received a single device's update fails (exit 2, no deployment)
  instead of deploying its untrained model as a success.
- Registrations (and the presence the cloud tracks) are bounded by the configured
  federation: thousands of made-up device ids are refused and counted, and the round
  announcement stays the federation's size.

The bad-message classes (malformed, oversize, pickle, NaN, wrong shapes, hash and size
mismatch, replay, impersonation) are in ``test_mqtt_bad_input.py`` and
``test_mqtt_robustness.py``; a flood of bad messages is counted whole and logged in a few
lines (``test_mqtt_bad_input.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from cloud import CloudServer
from device_agent import DeviceAgent
from edge_node import EdgeServer
from estuary.launcher import Hierarchy
from shared.evaluation.report import read_metrics
from shared.methods.registry import make_algorithm
from shared.models.init import initial_model
from shared.runtime.process import follow_cloud
from shared.transport.bus import MemoryBus
from shared.transport.local_broker import LocalBroker, find_mosquitto
from shared.wire.messages import (
    BlobRef,
    CloudState,
    DeviceHello,
    EdgeRound,
    EdgeUpdate,
    Presence,
    Topics,
    encode,
)
from tests.conftest import tiny_config
from tests.hand_roles import registered_cloud

OLD, NEW = "01d5e55101d5e551", "fe55e551fe55e551"


def _state(cfg: Any, session: str, phase: str) -> CloudState:
    return CloudState(round=3, session=session, phase=phase,  # type: ignore[arg-type]
                      config_digest=cfg.digest())  # fmt: skip


def test_a_stale_done_does_not_end_a_new_run_but_the_new_clouds_does() -> None:
    """The retained "done" of a finished run whose cloud is offline is ignored; the new
    cloud's own state replaces it before it says it is online, and its "done" ends the run;
    an edge that took part in a session leaves on its "done" even with the cloud gone."""
    cfg = tiny_config()
    bus = MemoryBus()
    topics = Topics(cfg.run.name)
    edge = EdgeServer(cfg, bus, make_algorithm(cfg), edge_id="edge0")
    ended: list[str] = []
    follow_cloud(edge, lambda: ended.append("done"))
    cloud = bus.endpoint("cloud", "cloud")

    def say(msg: Any, topic: str) -> None:
        cloud.publish(topic, encode(msg), kind="m", retain=True)
        bus.run(lambda: False)  # deliver everything queued

    offline = Presence(name="cloud", role="cloud", online=False)
    say(_state(cfg, OLD, "done"), topics.cloud_state)
    say(offline, topics.status("cloud"))
    assert ended == []  # a finished run's leftover: wait for this run's cloud
    say(_state(cfg, NEW, "waiting"), topics.cloud_state)  # the new cloud: state, then online
    say(Presence(name="cloud", role="cloud", online=True), topics.status("cloud"))
    assert ended == []
    say(_state(cfg, NEW, "done"), topics.cloud_state)
    assert ended == ["done"]

    # an edge that took part in session NEW leaves on its "done", whoever is online
    edge2 = EdgeServer(cfg, bus, make_algorithm(cfg), edge_id="edge1")
    edge2.session = NEW
    left: list[str] = []
    follow_cloud(edge2, lambda: left.append("done"))
    say(offline, topics.status("cloud"))
    say(_state(cfg, NEW, "done"), topics.cloud_state)
    assert left == ["done"]


def test_a_finished_runs_retained_round_does_not_make_a_device_leave_with_it() -> None:
    """A device of a new run that finds a finished run's retained "done" and its edge's
    retained round announcement (whose model no one serves any more) tries that round,
    fails to get the model, and still waits for the new cloud: the old session is not one it
    worked in, so neither the old "done" nor the new cloud coming online ends it."""
    cfg = tiny_config(federation={"num_devices": 1, "num_edges": 1})
    bus = MemoryBus(raise_errors=False)
    topics = Topics(cfg.run.name)
    dev = DeviceAgent(cfg, bus, make_algorithm(cfg), device_id="dev000", index=0,
                      home_edge="edge0", data=torch.zeros(4, 1, 28, 28),
                      labels=torch.arange(4))  # fmt: skip
    ended: list[str] = []
    follow_cloud(dev, lambda: ended.append("done"))
    dev.start()
    cloud, edge = bus.endpoint("cloud", "cloud"), bus.endpoint("edge0", "edge/edge0")

    def say(ep: Any, msg: Any, topic: str) -> None:
        ep.publish(topic, encode(msg), kind="m", retain=True)
        bus.run(lambda: False)  # deliver everything queued

    gone = BlobRef(sha256="1f" * 32, size=1000, kind="edge_model", src="edge/edge0")
    stale = EdgeRound(round=1, session=OLD, edge="edge0", devices=["dev000"], model_ref=gone,
                      deadline_s=60.0)  # fmt: skip
    # in the order a broker may hand the retained messages over: the presence comes last
    say(cloud, _state(cfg, OLD, "done"), topics.cloud_state)
    say(edge, stale, topics.edge_round("edge0"))
    assert dev.joined_session() == OLD and dev.worked_in_session() is None
    assert bus.traffic.snapshot()["rejected"].get("device:blob_unavailable") == 1
    say(cloud, Presence(name="cloud", role="cloud", online=False), topics.status("cloud"))
    assert ended == []  # the old "done", but not of a session this device worked in
    say(cloud, _state(cfg, NEW, "waiting"), topics.cloud_state)  # the new cloud
    say(cloud, Presence(name="cloud", role="cloud", online=True), topics.status("cloud"))
    assert ended == []
    say(cloud, _state(cfg, NEW, "done"), topics.cloud_state)
    assert ended == ["done"]


def test_a_run_no_device_ever_contributed_to_fails_instead_of_deploying() -> None:
    """Every round closes with edge reports that list no device: the cloud does not call
    the deployment or publish "done"; it records why it failed (the process exits 2)."""
    cfg = tiny_config(federation={"num_devices": 2, "num_edges": 2})
    bus, cloud, ep, topics = registered_cloud(cfg)
    deployed: list[bool] = []
    cloud.on_trained = lambda: deployed.append(True)
    for _ in range(cfg.run.rounds):
        r = cloud.round
        for edge in ("edge0", "edge1"):
            empty = EdgeUpdate(round=r, session=cloud.session, edge=edge, model_ref=None,
                               n_samples=0, label_counts=[0] * 10, devices=[],
                               train_seconds=0.0)  # fmt: skip
            ep.publish(topics.edge_up(edge), encode(empty), kind="m")
        assert bus.run(lambda: cloud.round > r or cloud.failed is not None)  # noqa: B023
    assert cloud.failed is not None and "received a device's update" in cloud.failed
    assert not cloud.done and deployed == []


@pytest.mark.process
@pytest.mark.slow  # 48 s: CI's slow stage runs it
@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
def test_a_rerun_on_a_broker_holding_a_finished_run_trains_to_the_same_model(
    tmp_path: Path,
) -> None:
    """Run a config to the end on a broker, then run it again (a new run directory) on the
    same broker, which still holds the first run's retained "done": every process of the
    second run stays, every round gets its updates, and the model is the first run's. The
    first run's roles are forked from the launcher's fork server, the second's started as
    ``python -m <role>``: both ways train the same model."""
    cfg = tiny_config(
        run={"name": "rerun", "rounds": 2},
        federation={"num_devices": 2, "num_edges": 1, "round_deadline_s": 60},
        train={"local_steps": 2, "batch_size": 8, "threads": 1},
    )
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    summaries = []
    with LocalBroker(kind="mosquitto", workdir=tmp_path / "broker") as broker:
        for run in ("first", "second"):
            launch = "fork" if run == "first" else "exec"
            hier = Hierarchy(cfg, path, tmp_path / run, broker, evaluate=False, launch=launch)
            try:
                hier.start_all()
                code = hier.wait("cloud", 150)
                assert code == 0, hier.procs["cloud"].log_tail(30)
                for p in hier.procs.values():
                    assert hier.wait(p.name, 30) == 0, p.log_tail(20)
            finally:
                hier.stop_all(timeout_s=10)
            rows = read_metrics(hier.run_dir / "metrics.jsonl")
            assert [r["updates"] for r in rows] == [2, 2], rows
            summaries.append(json.loads((hier.run_dir / "summary.json").read_text()))
    assert summaries[0]["final_model_sha256"] == summaries[1]["final_model_sha256"]


def test_made_up_device_ids_are_refused_and_the_registrations_stay_bounded() -> None:
    """5,000 hellos (and offline presences) under made-up ids and ids past
    ``federation.num_devices``: each refused and counted, none stored; the configured
    devices then register and the first round is announced to them alone."""
    cfg = tiny_config(federation={"num_devices": 2, "num_edges": 1})
    bus = MemoryBus(raise_errors=False)
    state = dict(initial_model(cfg.model.preset, cfg.model.init, seed=0).state_dict())
    cloud = CloudServer(cfg, bus, make_algorithm(cfg), initial_model=state)
    cloud.start()
    topics, ep = Topics(cfg.run.name), bus.endpoint("tester")
    fakes = [f"x{i}" for i in range(4000)] + [f"dev{i:03d}" for i in range(2, 1002)]
    for name in fakes:
        hello = DeviceHello(device=name, home_edge="edge0", n_samples=10, label_counts=[1] * 10)
        ep.publish(topics.device_hello(name), encode(hello), kind="m")
        gone = Presence(name=name, role="device", online=False)
        ep.publish(topics.status(f"device/{name}"), encode(gone), kind="m")
    bus.run(lambda: False)
    assert bus.traffic.snapshot()["rejected"] == {"cloud:unknown_device": len(fakes)}
    assert cloud.devices == {} and cloud.offline == set() and not cloud.started
    for name in ("dev000", "dev001"):
        hello = DeviceHello(device=name, home_edge="edge0", n_samples=10, label_counts=[1] * 10)
        ep.publish(topics.device_hello(name), encode(hello), kind="m")
    assert bus.run(lambda: cloud.started)
    assert cloud.participants == ["dev000", "dev001"]
