"""Client ids bound to user names on a secured broker: a device's credentials presenting the
edge's client id neither disconnect the edge nor receive what the edge's persistent session
queued.

The roles' client ids are predictable (``<run>-<name>``, :func:`shared.runtime.process.
connect_bus`), and a broker keys connections and sessions by client id. Every config Estuary
writes for a secured Mosquitto (``estuary provision``'s ``mosquitto/mosquitto.conf``, the local
broker with a password file) and every one it ships (compose, Kubernetes: checked statically in
test_docker_files.py and test_k8s.py) makes each client's id its user name instead
(``use_username_as_clientid``). These tests attack a real Mosquitto running each of the two
written configs, with the accounts ``estuary provision`` made.
"""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from estuary.provision import BROKER_CONF, MQTT_PORT, provision
from shared.config import BrokerSection
from shared.transport.local_broker import BIND_CLIENT_ID, LocalBroker, find_mosquitto, free_port
from shared.transport.mqtt import MqttBus
from tests.conftest import tiny_config
from tests.mqtt_probe import close, login

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")

RUN = "bind"
BASE = f"estuary/v1/{RUN}"
EDGE_ID = f"{RUN}-edge0"  # the id edge0's process asks for (connect_bus: "<run>-<name>")
SESSION_EXPIRY_S = 300  # the roles' default ([broker] session_expiry_s)
QUIET_S = 2.0  # how long the edge must stay connected after the attack


@dataclass
class Secured:
    """A running Mosquitto that requires the accounts provisioned in ``out``."""

    host: str
    port: int
    out: Path

    def password(self, user: str) -> str:
        return (self.out / "credentials" / f"{user}.password").read_text()


def _wait_listening(host: str, port: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"mosquitto exited:\n{proc.communicate()[0]}"
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"mosquitto did not listen on {host}:{port}")


@pytest.fixture(params=["provisioned-conf", "local-broker"])
def secured(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Secured]:
    """Mosquitto with the accounts and ACL of ``estuary provision``: run on the broker config
    it writes (only the listener moved to a free local port), or by the local broker launcher
    given its password file and ACL (what the federation tests run)."""
    cfg = tiny_config(run={"name": RUN}, federation={"num_devices": 3, "num_edges": 2})
    out = tmp_path / "prov"
    provision(cfg, out)
    if request.param == "local-broker":
        broker = LocalBroker(kind="mosquitto", workdir=tmp_path / "broker",
                             password_file=out / "mosquitto" / "passwd",
                             acl_file=out / "mosquitto" / "acl").start()  # fmt: skip
        try:
            yield Secured(broker.host, broker.port, out)
        finally:
            broker.stop()
        return
    conf = (out / "mosquitto" / BROKER_CONF).read_text()
    port = free_port()
    listener = f"listener {MQTT_PORT}\n"
    assert conf.count(listener) == 1
    conf = conf.replace(listener, f"listener {port} 127.0.0.1\n")
    if os.geteuid() == 0:
        conf += "user root\n"  # as root mosquitto would switch to a user that cannot read tmp
    path = tmp_path / "mosquitto.conf"
    path.write_text(conf)
    binary = find_mosquitto()
    assert binary is not None
    proc = subprocess.Popen([binary, "-c", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        _wait_listening("127.0.0.1", port, proc)
        yield Secured("127.0.0.1", port, out)
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


class Client:
    """A paho MQTT v5 client that connects as the roles do (clean start on the first connect
    only, a persistent session) and records its connects, disconnects and messages."""

    def __init__(self, b: Secured, user: str, client_id: str, *, resume: bool = False) -> None:
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        c.username_pw_set(user, b.password(user))
        c.on_connect = lambda cl, ud, flags, rc, p: self.events.put(
            ("connect", (rc.value, bool(flags.session_present)))
        )
        c.on_disconnect = lambda cl, ud, flags, rc, p: self.events.put(("disconnect", rc.value))
        c.on_message = lambda cl, ud, msg: self.events.put(("message", msg.topic))
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = SESSION_EXPIRY_S
        clean = False if resume else mqtt.MQTT_CLEAN_START_FIRST_ONLY
        c.connect(b.host, b.port, clean_start=clean, properties=props)
        c.loop_start()
        self.client = c

    def connack(self) -> tuple[int, bool]:
        """The next CONNACK's (reason code, session present)."""
        what, arg = self.events.get(timeout=10)
        assert what == "connect", (what, arg)
        return arg  # type: ignore[no-any-return]

    def seen(self, wait_s: float) -> list[tuple[str, Any]]:
        """Every event within ``wait_s``."""
        end, got = time.monotonic() + wait_s, []
        while time.monotonic() < end:
            try:
                got.append(self.events.get(timeout=0.05))
            except queue.Empty:
                pass
        return got

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _edge_bus(b: Secured) -> MqttBus:
    """edge0's connection exactly as its process makes it: its account and its usual id."""
    settings = BrokerSection(
        host=b.host, port=b.port, username="edge0", connect_timeout_s=10,
        password_file=str(b.out / "credentials" / "edge0.password"),
    )  # fmt: skip
    return MqttBus(settings, run=RUN, client_id=EDGE_ID, home="edge/edge0").connect()


def test_a_device_cannot_disconnect_the_edge_by_claiming_its_client_id(secured: Secured) -> None:
    """dev000's credentials with the edge's client id log in (as dev000), and the edge's bus
    stays connected and keeps receiving the cloud's messages."""
    bus = _edge_bus(secured)
    got: list[str] = []
    bus.endpoint("edge0", "edge/edge0").subscribe(f"{BASE}/cloud/#", lambda t, p: got.append(t))
    hostile = Client(secured, "dev000", EDGE_ID)
    cloud = login(secured.host, secured.port, "cloud", secured.password("cloud"))
    try:
        assert hostile.connack()[0] == 0  # it logs in: with its own identity, not the edge's
        bus.pump(QUIET_S)
        transport = bus.traffic.transport()
        assert bus.connected and transport.get("disconnects", 0) == 0, transport
        assert transport.get("reconnects", 0) == 0, transport
        cloud.publish(f"{BASE}/cloud/round", b"{}", qos=1).wait_for_publish(5)
        bus.run(lambda: bool(got), timeout_s=5)
        assert got == [f"{BASE}/cloud/round"]  # the edge's subscriptions are its own still
    finally:
        hostile.close()
        close(cloud)
        bus.close(timeout_s=2)


def test_a_device_cannot_take_over_the_edges_persistent_session(secured: Secured) -> None:
    """While the edge is away its session queues the cloud's round; dev001's credentials with
    the edge's client id, resuming a session, find none and receive nothing (dev001 may read
    the cloud's topics, so only the session binding keeps the message from it). The edge,
    reconnecting, resumes its session and gets the queued round."""
    edge = Client(secured, "edge0", EDGE_ID)
    assert edge.connack() == (0, False)
    edge.client.subscribe(f"{BASE}/cloud/#", qos=1)
    time.sleep(0.3)
    edge.close()  # a clean DISCONNECT: the session stays for SESSION_EXPIRY_S
    assert ("disconnect", 0) in edge.seen(0.3)
    cloud = login(secured.host, secured.port, "cloud", secured.password("cloud"))
    cloud.publish(f"{BASE}/cloud/round", b"{}", qos=1).wait_for_publish(5)
    close(cloud)

    hostile = Client(secured, "dev001", EDGE_ID, resume=True)
    try:
        assert hostile.connack() == (0, False), "dev001 resumed the edge's session"
        assert hostile.seen(1.5) == [], "dev001 received what was queued for the edge"
    finally:
        hostile.close()

    edge.client.reconnect()  # as paho reconnects a role: no clean start after the first
    edge.client.loop_start()
    try:
        assert edge.connack() == (0, True), "the edge's session did not survive"
        assert ("message", f"{BASE}/cloud/round") in edge.seen(1.5)
    finally:
        edge.close()


def test_the_local_broker_binds_ids_only_when_secured(tmp_path: Path) -> None:
    """The launcher writes the binding right after its listener line (mosquitto applies it to
    that listener only) whenever it has a password file or an ACL; an open broker has no
    accounts to bind to."""

    def conf(**kw: Any) -> list[str]:
        broker = LocalBroker(kind="mosquitto", workdir=tmp_path, **kw)
        return broker._mosquitto_conf(tmp_path).splitlines()

    passwd = tmp_path / "passwd"
    for kw in ({"password_file": passwd}, {"acl_file": tmp_path / "acl"}):
        lines = conf(**kw)
        at = next(i for i, ln in enumerate(lines) if ln.startswith("listener "))
        assert lines[at + 1] == BIND_CLIENT_ID and lines.count(BIND_CLIENT_ID) == 1
        assert "allow_anonymous false" in lines
    assert BIND_CLIENT_ID not in conf()
    assert "allow_anonymous true" in conf()
    assert BIND_CLIENT_ID not in conf(password_file=passwd, bind_client_ids=False)
