"""A large federation over a real mosquitto: 2,000 simulated devices (:mod:`tests.swarm`, one
process, one thread) register before the cloud starts, so the cloud meets all of them as
retained registrations, as after a cloud restart; the real cloud and two real edges (on
their own MqttBus each) then run a round with participation 0.01.

The same swarm spread over four edge sites, each edge and its 500 devices on the site's own
mosquitto bridged to a cloud broker (``federation.brokers = "per-edge"``, as ``estuary demo``
starts them), registers every device with the cloud across the bridges and completes a round.

The last test shows why the broker configs carry
:func:`~shared.transport.local_broker.mosquitto_limits`: with mosquitto's default per-client
queue (``max_queued_messages 1000``) a subscriber gets only about 1,000 of the 2,000 retained
registrations, and mosquitto logs that it dropped the rest.
"""

from __future__ import annotations

import math
import resource
import time
from pathlib import Path

import pytest

from cloud.service import check_round_start_fits, largest_round_start
from estuary.launcher import site_brokers
from estuary.status import bridge_state
from shared.config import RunConfig
from shared.naming import edge_ids
from shared.transport import local_broker
from shared.transport.local_broker import LocalBroker, find_mosquitto
from shared.wire.messages import MAX_MESSAGE_BYTES
from tests.conftest import tiny_config
from tests.swarm import FD_MARGIN, raise_fd_limit, run_federation, run_sites_federation

pytestmark = pytest.mark.skipif(
    find_mosquitto() is None,
    reason="mosquitto not installed (apt-get install mosquitto): these tests need a real broker",
)

DEVICES = 2000
PARTICIPATION = 0.01
TIMEOUT_S = 240.0
#: mosquitto's own per-client defaults (what a stock mosquitto.conf runs with)
MOSQUITTO_DEFAULT_QUEUE = 1000
MOSQUITTO_DEFAULT_INFLIGHT = 20
SITES = 4
BRIDGE_UP_S = 20.0


def large_config(name: str, edges: int = 2, brokers: str = "one") -> RunConfig:
    """The tiny test config with 2,000 devices on ``edges`` edges (two by default), one round
    at 1 % participation, the brokers as ``federation.brokers`` says."""
    return tiny_config(
        run={"name": name, "rounds": 1},
        federation={
            "num_devices": DEVICES,
            "num_edges": edges,
            "participation": PARTICIPATION,
            "round_deadline_s": 60,
            "brokers": brokers,
        },
    )


@pytest.fixture(autouse=True)
def enough_file_descriptors() -> None:
    """One descriptor per device in this process (the swarm) and in mosquitto, which
    inherits this process's limit: raise the soft limit, or skip where the hard limit is
    too low for the test to run at all."""
    needed = DEVICES + FD_MARGIN
    if raise_fd_limit(needed) < needed:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {needed} descriptors for {DEVICES} "
                    "devices (raise it: ulimit -Hn)")  # fmt: skip


def test_two_thousand_devices_register_and_a_round_completes() -> None:
    cfg = large_config("large")
    check_round_start_fits(cfg)  # the cloud's own start-up check
    with LocalBroker(kind="mosquitto") as broker:
        run = run_federation(cfg, broker, timeout_s=TIMEOUT_S)
    swarm = run.swarm
    assert swarm.errors == [], swarm.errors[:5]
    assert (swarm.connected, swarm.registered, swarm.refused, swarm.disconnects) == (
        DEVICES, DEVICES, 0, 0)  # fmt: skip
    # the cloud registered every device from the broker's retained hellos
    assert run.cloud_registered == DEVICES
    assert run.broker_dropped == []
    # ... selected ceil(0.01 * 2000) of them, and closed the round with their updates
    expected = math.ceil(PARTICIPATION * DEVICES)
    assert run.participants == expected == 20
    assert run.cloud_failed is None and run.cloud_done, run.cloud_failed
    assert swarm.selected == swarm.updates_sent == expected
    assert swarm.blob_requests >= expected  # every update was fetched from its device
    assert len(run.rounds) == 1
    summary = run.rounds[0]
    assert summary.participants == expected and summary.cloud_aggregated
    assert run.contributions == summary.updates == expected
    assert sum(summary.edges.values()) == expected and summary.rejected == 0
    # nothing was dropped or refused by the cloud or an edge (queue_full, too_large, ...)
    assert run.rejected and all(not counts for counts in run.rejected.values()), run.rejected
    # one round announcement, within the limit the cloud checks it against
    assert len(run.round_start_bytes) == 1
    assert run.round_start_bytes[0] <= largest_round_start(cfg) <= MAX_MESSAGE_BYTES


def _wait_bridge_up(cfg: RunConfig, edge: str, site: LocalBroker) -> None:
    """Wait (bounded) until ``edge``'s site broker says its bridge to the cloud is up."""
    at_site = cfg.model_copy(update={"broker": cfg.broker.model_copy(
        update={"host": site.host, "port": site.port})})  # fmt: skip
    deadline = time.monotonic() + BRIDGE_UP_S
    while bridge_state(at_site, edge, 1.0) is not True:
        if time.monotonic() > deadline:
            raise AssertionError(f"bridge of {edge} not up in {BRIDGE_UP_S:.0f} s")
        time.sleep(0.2)


def test_two_thousand_devices_across_four_site_brokers_register_and_a_round_completes(
    tmp_path: Path,
) -> None:
    """Four edge sites of 500 devices, each on its own mosquitto bridged to the cloud's: the
    cloud registers all 2,000 from the hellos that crossed the bridges, and the round's 20
    participants train with their own edge through their site's broker."""
    cfg = large_config("sites", edges=SITES, brokers="per-edge")
    check_round_start_fits(cfg)
    with LocalBroker(kind="mosquitto", workdir=tmp_path / "cloud") as cloud:
        sites = site_brokers(cfg, cloud, tmp_path / "sites")
        try:
            for site in sites.values():
                site.start()
            for edge, site in sites.items():
                _wait_bridge_up(cfg, edge, site)
            run = run_sites_federation(cfg, cloud, sites, timeout_s=TIMEOUT_S)
        finally:
            for site in sites.values():
                site.stop()
    swarm = run.swarm
    assert swarm.errors == [], swarm.errors[:5]
    assert (swarm.connected, swarm.registered, swarm.refused, swarm.disconnects) == (
        DEVICES, DEVICES, 0, 0)  # fmt: skip
    # each site's 500 devices connected and registered on their own site's broker ...
    assert sorted(run.site_swarms) == edge_ids(cfg)
    per_site = DEVICES // SITES
    assert all(s.registered == per_site for s in run.site_swarms.values())
    # ... and the cloud, on its own broker, registered every one across the bridges
    assert run.cloud_registered == DEVICES
    assert run.broker_dropped == [] and all(not d for d in run.site_broker_dropped.values())
    expected = math.ceil(PARTICIPATION * DEVICES)
    assert run.participants == expected == 20
    assert run.cloud_failed is None and run.cloud_done, run.cloud_failed
    assert swarm.selected == swarm.updates_sent == expected
    assert len(run.rounds) == 1
    summary = run.rounds[0]
    assert summary.participants == expected and summary.cloud_aggregated
    assert run.contributions == summary.updates == expected
    # every edge's updates came from its own site's devices
    assert summary.edges == {e: s.updates_sent for e, s in run.site_swarms.items()
                             if s.updates_sent}  # fmt: skip
    assert summary.rejected == 0
    assert run.rejected and all(not counts for counts in run.rejected.values()), run.rejected


def test_mosquitto_defaults_lose_registrations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the shipped limits (a stock mosquitto: 1000 queued + 20 in flight per client)
    the broker drops the retained hellos past its queue: the cloud registers about 1,020 of
    the 2,000 devices, and would wait ``registration_timeout_s`` to start without the rest."""
    monkeypatch.setattr(local_broker, "mosquitto_limits", lambda **_: [
        f"max_queued_messages {MOSQUITTO_DEFAULT_QUEUE}",
        f"max_inflight_messages {MOSQUITTO_DEFAULT_INFLIGHT}",
    ])  # fmt: skip
    cfg = large_config("large-defaults")
    with LocalBroker(kind="mosquitto") as broker:
        run = run_federation(cfg, broker, timeout_s=TIMEOUT_S, train=False)
    assert run.swarm.registered == DEVICES  # every hello reached the broker ...
    assert run.cloud_registered < DEVICES  # ... but not the cloud
    assert run.cloud_registered <= MOSQUITTO_DEFAULT_QUEUE + MOSQUITTO_DEFAULT_INFLIGHT
    assert any("large-defaults-cloud" in ln for ln in run.broker_dropped), run.broker_dropped
