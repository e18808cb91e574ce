"""The edge and its devices' last wills: a participant that is offline when a round opens is
dropped at once (and said so), one that dies mid-round releases the round when its will
arrives. Driven over a MemoryBus by a bare cloud-role endpoint, so the order is exact."""

from __future__ import annotations

import logging

import pytest

from edge_node import EdgeServer
from shared.methods.registry import make_algorithm
from shared.transport.bus import MemoryBus
from shared.wire.messages import EdgeRound, Presence, decode, home_of
from tests.conftest import tiny_config
from tests.hand_roles import Cloud


def _hierarchy() -> tuple[MemoryBus, EdgeServer, Cloud, list[EdgeRound]]:
    cfg = tiny_config(federation={"num_devices": 2, "num_edges": 1})
    bus = MemoryBus()
    edge = EdgeServer(cfg, bus, make_algorithm(cfg), edge_id="edge0")
    edge.start()
    cloud = Cloud("cloud", cfg, bus)
    rounds: list[EdgeRound] = []
    watcher = bus.endpoint("watcher")
    topic = cloud.topics.edge_round("edge0")
    watcher.subscribe(topic, lambda _t, p: rounds.append(decode(p, EdgeRound)), kind="edge_round")
    return bus, edge, cloud, rounds


def _will(cloud: Cloud, device: str) -> None:
    """What the broker publishes for a device whose connection died: its retained LWT."""
    msg = Presence(name=device, role="device", online=False)
    cloud.send(cloud.topics.status(home_of("device", device)), msg, retain=True)


def test_a_device_offline_before_the_round_is_not_waited_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bus, edge, cloud, rounds = _hierarchy()
    _will(cloud, "dev001")
    bus.run(lambda: False)
    with caplog.at_level(logging.WARNING, logger="edge_node.service"):
        cloud.open_round(1, ["dev000", "dev001"])  # index 1: the second round
        bus.run(lambda: bool(rounds))
    assert edge.dropped == {"dev001"} and not edge.closed
    assert "edge0: dev001 offline at the start of round 2; not waiting for them" in caplog.text
    assert "went offline" not in caplog.text


def test_a_device_dying_mid_round_releases_it(caplog: pytest.LogCaptureFixture) -> None:
    bus, edge, cloud, rounds = _hierarchy()
    cloud.open_round(1, ["dev000", "dev001"])
    bus.run(lambda: bool(rounds))
    assert edge.dropped == set()
    with caplog.at_level(logging.WARNING, logger="edge_node.service"):
        _will(cloud, "dev001")
        bus.run(lambda: "dev001" in edge.dropped)
    assert "edge0: dev001 went offline in round 2" in caplog.text
    assert "offline at the start" not in caplog.text
