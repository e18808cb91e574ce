"""LocalBroker against a real mosquitto (and the embedded amqtt fallback), over real sockets."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from shared.errors import ConfigError, TransportError
from shared.transport.local_broker import LocalBroker, amqtt_available, find_mosquitto, free_port

WAIT_S = 5.0

needs_mosquitto = pytest.mark.skipif(
    find_mosquitto() is None, reason="mosquitto not installed: apt-get install mosquitto"
)
needs_amqtt = pytest.mark.skipif(
    not amqtt_available(), reason="amqtt not installed: pip install amqtt==0.12.1"
)


KINDS = [
    pytest.param("mosquitto", marks=needs_mosquitto),
    pytest.param("amqtt", marks=needs_amqtt),
]


@contextmanager
def mqtt_client(
    broker: LocalBroker,
    *,
    protocol: mqtt.MQTTProtocolVersion | None = None,
    client_id: str = "",
    durable: bool = False,
    credentials: tuple[str, str] | None = None,
    expect_refusal: bool = False,
) -> Iterator[tuple[mqtt.Client, queue.Queue[mqtt.MQTTMessage]]]:
    """A connected paho client (network loop on its thread) and the queue of its messages.

    The protocol defaults to what the bus uses with this broker: v5 for mosquitto, v3.1.1
    for amqtt. ``durable`` asks for a session that outlives the connection.
    """
    if protocol is None:
        protocol = mqtt.MQTTv5 if broker.kind == "mosquitto" else mqtt.MQTTv311
    v5 = protocol == mqtt.MQTTv5
    client = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=protocol,
        clean_session=None if v5 else not durable,
    )
    inbox: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
    connacks: queue.Queue[Any] = queue.Queue()
    client.on_connect = lambda _c, _u, _f, reason, _p: connacks.put(reason)
    client.on_message = lambda _c, _u, msg: inbox.put(msg)
    if credentials is not None:
        client.username_pw_set(*credentials)
    if v5:
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 60 if durable else 0
        client.connect(broker.host, broker.port, 10, clean_start=not durable, properties=props)
    else:
        client.connect(broker.host, broker.port, keepalive=10)
    client.loop_start()
    try:
        reason = connacks.get(timeout=WAIT_S)
        if reason.is_failure != expect_refusal:
            raise AssertionError(f"CONNACK {reason} (expect_refusal={expect_refusal})")
        yield client, inbox
    finally:
        client.disconnect()
        client.loop_stop()


def subscribe(client: mqtt.Client, topic: str) -> None:
    """Subscribe at QoS 1 and wait for the SUBACK."""
    subacked = threading.Event()
    client.on_subscribe = lambda *_: subacked.set()
    client.subscribe(topic, qos=1)
    assert subacked.wait(WAIT_S), f"no SUBACK for {topic}"


def publish(broker: LocalBroker, topic: str, payload: bytes, retain: bool = False) -> None:
    """Publish one QoS 1 message from a short-lived client and wait for its PUBACK."""
    with mqtt_client(broker) as (client, _):
        client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(WAIT_S)


def retained(broker: LocalBroker, topic: str, wait_s: float = WAIT_S) -> bytes | None:
    """The retained payload a new subscriber gets on ``topic``, or None within ``wait_s``."""
    with mqtt_client(broker) as (client, inbox):
        subscribe(client, topic)
        try:
            msg = inbox.get(timeout=wait_s)
        except queue.Empty:
            return None
        assert msg.retain
        return bytes(msg.payload)


def assert_reaped(proc: subprocess.Popen[bytes] | None) -> None:
    """The broker process has exited and been waited for (no zombie, no orphan)."""
    assert proc is not None
    assert proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)


@pytest.fixture(params=KINDS)
def broker(request: pytest.FixtureRequest) -> Iterator[LocalBroker]:
    """A started broker of each kind on a free port, stopped after the test."""
    with LocalBroker(kind=request.param) as started:
        yield started


@pytest.fixture
def mosquitto() -> Iterator[LocalBroker]:
    """A started mosquitto on a free port, stopped after the test."""
    with LocalBroker(kind="mosquitto") as broker:
        yield broker


@needs_mosquitto
def test_bus_connections_turn_nagle_off(mosquitto: LocalBroker) -> None:
    """MqttBus sockets have TCP_NODELAY (with Nagle on, a blob request after a SUBSCRIBE waited
    for a 40 ms delayed ACK about half the time); the broker's side is set_tcp_nodelay."""
    from shared.config import BrokerSection
    from shared.transport.mqtt import MqttBus

    bus = MqttBus(
        BrokerSection(port=mosquitto.port, connect_timeout_s=10),
        run="nodelay",
        client_id="nodelay-cloud",
        home="cloud",
    ).connect()
    try:
        sock = bus.client.socket()
        assert isinstance(sock, socket.socket)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        bus.close()
    plain = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2)
    plain.connect("127.0.0.1", mosquitto.port)
    try:  # the control: paho on its own leaves Nagle on
        raw = plain.socket()
        assert isinstance(raw, socket.socket)
        assert raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
    finally:
        plain.disconnect()


@needs_mosquitto
def test_start_and_stop_leave_nothing_behind() -> None:
    broker = LocalBroker(kind="mosquitto").start()
    try:
        assert broker.running and broker.kind == "mosquitto"
        assert broker.url == f"mqtt://127.0.0.1:{broker.port}"
        log_path = broker.log_path
        assert log_path is not None and "listen socket on port" in log_path.read_text()
        conf = (log_path.parent / "mosquitto.conf").read_text()
        assert f"listener {broker.port} 127.0.0.1" in conf
        assert "max_queued_messages 50000" in conf and "persistence false" in conf
    finally:
        broker.stop()
    assert not broker.running
    assert_reaped(broker.process)
    assert not log_path.parent.exists()
    broker.stop()  # idempotent


# -- what the bus relies on, on both kinds of broker -------------------------------------------


def test_retained_message_reaches_late_subscriber(broker: LocalBroker) -> None:
    publish(broker, "estuary/test/retained", b"hello", retain=True)
    assert retained(broker, "estuary/test/retained") == b"hello"


def test_burst_of_one_mib_messages_arrives_in_order(broker: LocalBroker) -> None:
    blob = os.urandom(1 << 20)
    count = 50
    with mqtt_client(broker) as (sub, inbox), mqtt_client(broker) as (pub, _):
        subscribe(sub, "estuary/test/blob")
        sent = [pub.publish("estuary/test/blob", bytes([i]) + blob, qos=1) for i in range(count)]
        for info in sent:
            info.wait_for_publish(30.0)
        got = [inbox.get(timeout=30.0).payload for _ in range(count)]
    assert [p[0] for p in got] == list(range(count))
    assert all(p[1:] == blob for p in got)


def test_last_will_is_published_when_a_socket_drops(broker: LocalBroker) -> None:
    with mqtt_client(broker) as (watcher, inbox):
        subscribe(watcher, "estuary/test/will")
        protocol = mqtt.MQTTv5 if broker.kind == "mosquitto" else mqtt.MQTTv311
        doomed = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=protocol)
        doomed.will_set("estuary/test/will", b"offline", qos=1)
        connected = threading.Event()
        doomed.on_connect = lambda *_: connected.set()
        doomed.connect(broker.host, broker.port, keepalive=10)
        deadline = time.monotonic() + WAIT_S
        while not connected.is_set() and time.monotonic() < deadline:
            doomed.loop(timeout=0.05)  # this thread runs its network loop: nothing to stop
        assert connected.is_set()
        sock = doomed.socket()
        assert isinstance(sock, socket.socket)
        sock.shutdown(socket.SHUT_RDWR)  # no DISCONNECT packet: an abnormal close
        sock.close()
        assert inbox.get(timeout=WAIT_S).payload == b"offline"


def test_durable_session_queues_messages_while_offline(broker: LocalBroker) -> None:
    with mqtt_client(broker, client_id="estuary-test-durable", durable=True) as (client, _):
        subscribe(client, "estuary/test/queued")
    publish(broker, "estuary/test/queued", b"while away")
    with mqtt_client(broker, client_id="estuary-test-durable", durable=True) as (_, inbox):
        assert inbox.get(timeout=WAIT_S).payload == b"while away"


# -- mosquitto lifecycle ------------------------------------------------------------------------


@needs_mosquitto
def test_restart_keeps_port_and_drops_retained_without_persistence(
    mosquitto: LocalBroker,
) -> None:
    port, first = mosquitto.port, mosquitto.process
    publish(mosquitto, "estuary/test/volatile", b"x", retain=True)
    mosquitto.restart()
    assert mosquitto.running and mosquitto.port == port
    assert mosquitto.process is not first
    assert_reaped(first)
    assert retained(mosquitto, "estuary/test/volatile", wait_s=0.5) is None


@needs_mosquitto
def test_persistence_keeps_retained_across_restart(tmp_path: Path) -> None:
    with LocalBroker(kind="mosquitto", workdir=tmp_path, persistence=True) as broker:
        publish(broker, "estuary/test/durable", b"kept", retain=True)
        broker.restart()
        assert (tmp_path / "mosquitto.db").is_file()
        assert retained(broker, "estuary/test/durable") == b"kept"
    assert tmp_path.is_dir()  # a caller's workdir is never removed


@needs_mosquitto
def test_kill_then_start_on_same_port(mosquitto: LocalBroker) -> None:
    port, victim = mosquitto.port, mosquitto.process
    assert victim is not None
    mosquitto.kill()
    assert not mosquitto.running
    assert victim.returncode == -signal.SIGKILL
    assert_reaped(victim)
    mosquitto.start()
    assert mosquitto.running and mosquitto.port == port
    publish(mosquitto, "estuary/test/after-crash", b"up", retain=True)
    assert retained(mosquitto, "estuary/test/after-crash") == b"up"


@needs_mosquitto
def test_taken_port_raises_transport_error() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        broker = LocalBroker(kind="mosquitto", port=port)
        with pytest.raises(TransportError, match=f"127.0.0.1:{port} is already in use"):
            broker.start(timeout_s=2.0)
    assert not broker.running
    broker.stop()


@needs_mosquitto
def test_broker_dying_at_startup_reports_log_tail(tmp_path: Path) -> None:
    broker = LocalBroker(kind="mosquitto", workdir=tmp_path, acl_file=tmp_path / "missing.acl")
    with pytest.raises(TransportError, match="exited during start-up") as excinfo:
        broker.start(timeout_s=5.0)
    assert "Unable to open acl_file" in str(excinfo.value)
    assert_reaped(broker.process)


@needs_mosquitto
@pytest.mark.skipif(shutil.which("mosquitto_passwd") is None, reason="mosquitto_passwd missing")
def test_password_file_refuses_anonymous(tmp_path: Path) -> None:
    passwords = tmp_path / "passwd"
    subprocess.run(
        ["mosquitto_passwd", "-b", "-c", str(passwords), "edge0", "s3cret"],
        check=True,
        capture_output=True,
        timeout=WAIT_S,
    )
    with LocalBroker(kind="mosquitto", workdir=tmp_path, password_file=passwords) as broker:
        with mqtt_client(broker, expect_refusal=True):
            pass
        with mqtt_client(broker, credentials=("edge0", "s3cret")):
            pass


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie awaiting its reaper counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


PARENT_SCRIPT = """
import sys, time
from pathlib import Path
from shared.transport.local_broker import LocalBroker
broker = LocalBroker(kind="mosquitto", workdir=Path(sys.argv[1])).start()
sys.stdout.write(f"{broker.process.pid}\\n")
sys.stdout.flush()
time.sleep(60)
"""


@needs_mosquitto
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_mosquitto_dies_with_its_parent(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", PARENT_SCRIPT, str(tmp_path)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as parent:
        try:
            assert parent.stdout is not None
            broker_pid = int(parent.stdout.readline())  # a failed parent exits: EOF, no hang
            assert process_alive(broker_pid)
        finally:
            parent.kill()
            parent.wait(WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while process_alive(broker_pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not process_alive(broker_pid)


@needs_amqtt
def test_amqtt_pub_sub_and_clean_stop() -> None:
    with LocalBroker(kind="amqtt") as broker:
        assert broker.kind == "amqtt" and broker.running and broker.process is None
        with mqtt_client(broker, protocol=mqtt.MQTTv311) as (client, inbox):
            subscribe(client, "estuary/test/amqtt")
            client.publish("estuary/test/amqtt", b"hi", qos=1).wait_for_publish(WAIT_S)
            assert inbox.get(timeout=WAIT_S).payload == b"hi"
            big = os.urandom(2 << 20)
            client.publish("estuary/test/amqtt", big, qos=1).wait_for_publish(WAIT_S)
            assert inbox.get(timeout=WAIT_S).payload == big
        # amqtt implements MQTT 3.1.1 only: a v5 CONNECT is refused (CONNACK "unsupported
        # protocol version", or a closed socket when the refusal loses a race with the close).
        v5 = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        outcome: queue.Queue[Any] = queue.Queue()
        v5.on_connect = lambda _c, _u, _f, reason, _p: outcome.put(reason)
        v5.on_disconnect = lambda _c, _u, _f, reason, _p: outcome.put(reason)
        v5.connect(broker.host, broker.port, keepalive=10)
        v5.loop_start()
        try:
            assert outcome.get(timeout=WAIT_S).is_failure
        finally:
            v5.disconnect()
            v5.loop_stop()
        broker.kill()
        assert not broker.running
        broker.start()
        publish(broker, "estuary/test/amqtt", b"back", retain=True)
        assert retained(broker, "estuary/test/amqtt") == b"back"
    assert not broker.running
    assert not [t for t in threading.enumerate() if t.name.startswith("amqtt-")]


@needs_mosquitto
def test_auto_prefers_mosquitto() -> None:
    broker = LocalBroker()
    assert broker.kind == "mosquitto" and not broker.running and broker.port > 0


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_free_ports_avoid_the_ephemeral_range_and_repeats() -> None:
    """Ports for processes started later come from below the kernel's range for outgoing
    connections (a broker connection could otherwise take one before its listener binds
    it: CI once saw a cloud die on "address already in use"), and never twice."""
    lo, _ = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    if lo > 1024 + 1024:
        assert all(1024 <= p < lo for p in ports)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "rabbit"}, "kind 'rabbit' is unknown"),
        ({"port": 70000}, "port 70000 is out of range"),
        ({"workdir": Path("a\nb")}, "line break"),
    ],
)
def test_bad_arguments_raise_config_error(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LocalBroker(**kwargs)


@needs_amqtt
def test_amqtt_rejects_mosquitto_only_options() -> None:
    with pytest.raises(ConfigError, match="need mosquitto"):
        LocalBroker(kind="amqtt", persistence=True)
