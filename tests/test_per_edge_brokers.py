"""A broker per edge site on real Mosquitto: provisioned cloud and site brokers, each site
bridged to the cloud with the bridge's own account. What a device may send the cloud crosses,
its updates and blob chunks never leave the site, its credentials work on its own site's
broker only, and ``estuary status`` reads each bridge's state."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from estuary.provision import BRIDGE_CONF, provision
from estuary.status import BrokerView, bridge_state, broker_views, format_brokers
from shared.config import RunConfig, config_from_dict
from shared.federation.topology import sites
from shared.transport.local_broker import LocalBroker, find_mosquitto, free_port
from shared.wire.messages import Topics, home_of
from tests.mqtt_probe import close, connect, login

needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
SHA = "cd" * 32
BRIDGE_UP_S = 20.0


def _cfg() -> RunConfig:
    fed = {"num_devices": 4, "num_edges": 2, "brokers": "per-edge"}
    return config_from_dict({"run": {"name": "sites"}, "federation": fed}, source="test")


@dataclass
class Sites:
    """Provisioned cloud broker and one bridged broker per edge site."""

    cfg: RunConfig
    out: Path
    cloud: LocalBroker
    edges: dict[str, LocalBroker]

    def password(self, user: str) -> str:
        return (self.out / "credentials" / f"{user}.password").read_text()

    def login(self, broker: LocalBroker, user: str) -> mqtt.Client:
        return login(broker.host, broker.port, user, self.password(user))

    def observer_cfg(self, broker: LocalBroker) -> RunConfig:
        section = self.cfg.broker.model_copy(update={
            "host": broker.host, "port": broker.port, "username": "observer",
            "password_file": str(self.out / "credentials" / "observer.password"),
        })  # fmt: skip
        return self.cfg.model_copy(update={"broker": section})


def bridge_lines(out: Path, edge: str) -> list[str]:
    """The bridge stanza ``estuary provision`` wrote for site ``edge``."""
    return (out / "sites" / edge / "mosquitto" / BRIDGE_CONF).read_text().splitlines()


def wait_bridge(s: Sites, edge: str, up: bool = True, timeout_s: float = BRIDGE_UP_S) -> None:
    """Wait until the site broker of ``edge`` says its bridge is ``up``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if bridge_state(s.observer_cfg(s.edges[edge]), edge, 1.0) is up:
            return
        time.sleep(0.2)
    raise AssertionError(f"bridge of {edge} not {'up' if up else 'down'} in {timeout_s:.0f} s")


@pytest.fixture
def bridged(tmp_path: Path) -> Iterator[Sites]:
    cfg = _cfg()
    port = free_port()
    out = tmp_path / "prov"
    provision(cfg, out, broker_user=None, cloud_broker=f"127.0.0.1:{port}")
    cloud = LocalBroker(port=port, kind="mosquitto", workdir=tmp_path / "cloud",
                        password_file=out / "mosquitto" / "passwd",
                        acl_file=out / "mosquitto" / "acl")  # fmt: skip
    edges: dict[str, LocalBroker] = {}
    try:
        cloud.start()
        for site in sites(cfg)[1:]:
            mq = out / "sites" / site.name / "mosquitto"
            edges[site.name] = LocalBroker(
                kind="mosquitto", workdir=tmp_path / site.name, password_file=mq / "passwd",
                acl_file=mq / "acl", extra_conf=bridge_lines(out, site.name),
            ).start()  # fmt: skip
        s = Sites(cfg, out, cloud, edges)
        for e in edges:
            wait_bridge(s, e)
        yield s
    finally:
        for b in edges.values():
            b.stop()
        cloud.stop()


def _collect(c: mqtt.Client, *patterns: str) -> queue.Queue[tuple[str, bytes]]:
    box: queue.Queue[tuple[str, bytes]] = queue.Queue()
    c.on_message = lambda cl, ud, msg: box.put((msg.topic, bytes(msg.payload)))
    for p in patterns:
        c.subscribe(p, qos=1)
    time.sleep(0.3)
    return box


def _drain(box: queue.Queue[tuple[str, bytes]], wait_s: float) -> list[tuple[str, bytes]]:
    end, got = time.monotonic() + wait_s, []
    while time.monotonic() < end:
        try:
            got.append(box.get(timeout=0.05))
        except queue.Empty:
            pass
    return got


@needs_mosquitto
def test_device_traffic_stays_at_its_site_and_what_the_cloud_needs_crosses(
    bridged: Sites,
) -> None:
    t = Topics(bridged.cfg.run.name)
    site0 = bridged.edges["edge0"]
    dev = "dev000"  # at edge0
    cloud = bridged.login(bridged.cloud, "cloud")
    edge = bridged.login(site0, "edge0")
    device = bridged.login(site0, dev)
    try:
        at_cloud = _collect(cloud, f"{t.base}/#")
        at_edge = _collect(edge, t.all_device_up, f"{t.base}/device/+/blob/#")
        chunk = t.blob_chunk(home_of("device", dev), SHA, 1 << 20, 0)
        for topic, payload in ((t.device_hello(dev), b"hello"), (t.device_up(dev), b"update"),
                               (chunk, b"x" * 4096)):  # fmt: skip
            device.publish(topic, payload, qos=1).wait_for_publish(5)
        got_edge = {topic for topic, _ in _drain(at_edge, 1.5)}
        got_cloud = _drain(at_cloud, 1.5)
        # the site's edge got the update and the chunk: they were published
        assert got_edge == {t.device_up(dev), chunk}
        # the cloud got the registration across the bridge, and nothing else of the device
        assert [topic for topic, _ in got_cloud] == [t.device_hello(dev)]
        # the cloud's round reaches the site's device
        at_device = _collect(device, t.cloud_round)
        cloud.publish(t.cloud_round, b"round", qos=1).wait_for_publish(5)
        assert [topic for topic, _ in _drain(at_device, 1.5)] == [t.cloud_round]
    finally:
        close(cloud, edge, device)


@needs_mosquitto
def test_a_devices_credentials_work_on_its_own_sites_broker_only(bridged: Sites) -> None:
    password = bridged.password("dev000")  # a device of edge0
    for broker, accepted in ((bridged.edges["edge0"], True), (bridged.edges["edge1"], False),
                             (bridged.cloud, False)):  # fmt: skip
        c, code = connect(broker.host, broker.port, "dev000", password)
        close(c)
        assert (code == 0) is accepted, (broker.url, code)
    # nor an edge's elsewhere, nor the bridge's own account on a site broker
    c, code = connect(bridged.cloud.host, bridged.cloud.port, "edge0", bridged.password("edge0"))
    close(c)
    assert code != 0
    site1 = bridged.edges["edge1"]
    c, code = connect(site1.host, site1.port, "bridge-edge1", bridged.password("bridge-edge1"))
    close(c)
    assert code != 0


@needs_mosquitto
def test_status_shows_each_broker_and_whether_its_bridge_is_up(bridged: Sites) -> None:
    where = {"cloud": {"host": bridged.cloud.host, "port": bridged.cloud.port}}
    where |= {e: {"host": b.host, "port": b.port} for e, b in bridged.edges.items()}
    views = broker_views(bridged.observer_cfg(bridged.cloud), where, 2.0)
    assert [(v.site, v.reachable, v.bridge_up) for v in views] == [
        ("cloud", True, None), ("edge0", True, True), ("edge1", True, True)]  # fmt: skip
    # the cloud broker stops: each site broker says its bridge is down
    bridged.cloud.stop()
    wait_bridge(bridged, "edge0", up=False)
    views = broker_views(bridged.observer_cfg(bridged.cloud), where, 2.0)
    assert [(v.site, v.reachable, v.bridge_up) for v in views] == [
        ("cloud", False, None), ("edge0", True, False), ("edge1", True, False)]  # fmt: skip
    text = format_brokers(views)
    assert "brokers 2 of 3 reachable" in text and "bridge DOWN" in text
    assert isinstance(views[0], BrokerView) and views[0].url.startswith("mqtt://127.0.0.1:")
