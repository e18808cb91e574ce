"""LeanClient: paho's client with a one-copy PUBLISH decode, checked against paho's own decoder
field by field and against a real mosquitto next to a stock paho client."""

from __future__ import annotations

import itertools
import os
import queue
import random
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt import _packet
from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from shared.transport.local_broker import LocalBroker, find_mosquitto
from shared.transport.paho_lean import LEAN_DECODE, LeanClient, client_class, decode_publish

WAIT_S = 10.0

pytestmark = pytest.mark.skipif(not LEAN_DECODE, reason="this paho lacks the decoder hooks")


def publish_body(
    topic: bytes, payload: bytes, *, qos: int, mid: int = 0, props: Properties | None = None
) -> bytes:
    """A PUBLISH packet after its fixed header, as it comes off the wire."""
    body = struct.pack("!H", len(topic)) + topic
    if qos > 0:
        body += struct.pack("!H", mid)
    if props is not None:
        body += props.pack()
    return body + payload


def rich_properties() -> Properties:
    props = Properties(PacketTypes.PUBLISH)
    props.MessageExpiryInterval = 30
    props.ContentType = "application/octet-stream"
    props.UserProperty = [("sha256", "ab" * 32), ("chunk", "7")]
    return props


def paho_decode(header: int, body: bytes | bytearray, v5: bool) -> _packet.PublishPacket:
    version = MQTTProtocolVersion.MQTTv5 if v5 else MQTTProtocolVersion.MQTTv311
    return _packet.decode_publish(header, body, version)


#: payloads: empty, one byte, and 1 MiB of seeded random bytes (the same in every pytest
#: worker, which must collect the same parameters)
PAYLOADS = {"empty": b"", "one": b"x", "1MiB": random.Random(0).randbytes(1 << 20)}
CASES = [
    pytest.param(v5, qos, flags, payload, id=f"v5={v5}-qos{qos}-flags{flags:#x}-{name}")
    for v5, qos, flags, (name, payload) in itertools.product(
        (False, True),  # v5
        (0, 1, 2),  # qos
        (0x00, 0x08, 0x01, 0x09),  # dup / retain flags
        PAYLOADS.items(),
    )
]


@pytest.mark.parametrize(("v5", "qos", "flags", "payload"), CASES)
def test_decode_matches_paho(v5: bool, qos: int, flags: int, payload: bytes) -> None:
    header = 0x30 | flags | (qos << 1)
    props = rich_properties() if v5 else None
    body = bytearray(publish_body("estuary/v1/r/é/blob".encode(), payload, qos=qos, mid=513,
                                  props=props))  # fmt: skip
    ours, theirs = decode_publish(header, body, v5), paho_decode(header, body, v5)
    assert isinstance(ours.payload, bytes) and ours.payload == theirs.payload
    assert (ours.topic, ours.mid, ours.qos) == (theirs.topic, theirs.mid, theirs.qos)
    assert (ours.dup, ours.retain) == (theirs.dup, theirs.retain)
    if v5:
        assert ours.properties is not None and theirs.properties is not None
        assert ours.properties.json() == theirs.properties.json()
        props = cast(Any, ours.properties)  # paho's Properties sets its attributes dynamically
        assert props.UserProperty == [("sha256", "ab" * 32), ("chunk", "7")]
    else:
        assert ours.properties is None and theirs.properties is None
    body[-1:] = b"!"  # the payload is a copy, not a view of paho's receive buffer
    assert ours.payload == theirs.payload


def test_v5_publish_without_properties_and_empty_topic() -> None:
    body = publish_body(b"", b"payload", qos=1, mid=9) + b""
    body = body[:4] + b"\x00" + body[4:]  # properties length 0
    ours, theirs = decode_publish(0x32, body, True), paho_decode(0x32, body, True)
    assert (ours.topic, ours.mid, ours.payload) == (b"", 9, b"payload")
    assert (theirs.topic, theirs.mid, theirs.payload) == (b"", 9, b"payload")


MALFORMED = {
    "empty packet": (0x30, b"", False),
    "one byte": (0x30, b"\x00", False),
    "topic past the end": (0x30, b"\x00\x09abc", False),
    "empty 3.1.1 topic": (0x30, b"\x00\x00payload", False),
    "packet id cut short": (0x32, b"\x00\x01a\x07", False),
    "properties length past the end": (0x30, b"\x00\x01a\x05\x01", True),
    "properties length of five bytes": (0x30, b"\x00\x01a\xff\xff\xff\xff\x01", True),
    "unknown property id": (0x30, b"\x00\x01a\x02\x7f\x00payload", True),
    "no properties byte": (0x30, b"\x00\x01a", True),
}


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_malformed_packets_raise_malformed_packet(case: str) -> None:
    """Every malformed case raises paho's MalformedPacket, which paho's read loop turns into
    a protocol error and a dropped connection (never a crashed network thread)."""
    header, body, v5 = MALFORMED[case]
    with pytest.raises(MalformedPacket):
        decode_publish(header, body, v5)


def test_paho_agrees_on_what_is_malformed() -> None:
    """Control: paho's own decoder rejects the same packets (except the ones it lets through
    by reading a short field as empty, which ours refuses as well)."""
    for case, (header, body, v5) in MALFORMED.items():
        try:
            paho_decode(header, body, v5)
        except MalformedPacket:
            continue
        assert case in {"no properties byte"}, f"paho accepted {case!r}"


def test_client_class_is_the_lean_one_here() -> None:
    assert client_class() is LeanClient
    assert issubclass(LeanClient, mqtt.Client)


# -- against a real broker ---------------------------------------------------------------------

needs_mosquitto = pytest.mark.skipif(
    find_mosquitto() is None, reason="mosquitto not installed: apt-get install mosquitto"
)


@contextmanager
def subscriber(
    cls: type[mqtt.Client], broker: LocalBroker, topic: str, v5: bool
) -> Iterator[queue.Queue[mqtt.MQTTMessage]]:
    """A connected ``cls`` client subscribed to ``topic`` (QoS 2) and the queue it fills."""
    client = cls(
        mqtt.CallbackAPIVersion.VERSION2,
        protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
    )
    inbox: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
    subacked = threading.Event()
    client.on_message = lambda _c, _u, msg: inbox.put(msg)
    client.on_subscribe = lambda *_: subacked.set()
    client.connect(broker.host, broker.port, keepalive=10)
    client.loop_start()
    try:
        client.subscribe(topic, qos=2)
        assert subacked.wait(WAIT_S), "no SUBACK"
        yield inbox
    finally:
        client.disconnect()
        client.loop_stop()


def drain(inbox: queue.Queue[mqtt.MQTTMessage], count: int) -> list[mqtt.MQTTMessage]:
    return [inbox.get(timeout=WAIT_S) for _ in range(count)]


def fields(msg: mqtt.MQTTMessage) -> tuple[object, ...]:
    """What a client saw of ``msg``. The broker counts a message's expiry interval down while
    it waits in that subscriber's queue, so two subscribers may see 30 and 29: that field
    is kept only as "still within the 30 s the publisher set"."""
    props = msg.properties.json() if msg.properties is not None else None
    if props is not None and "MessageExpiryInterval" in props:
        props["MessageExpiryInterval"] = 0 < props["MessageExpiryInterval"] <= 30
    return (msg.topic, msg.payload, msg.qos, msg.retain, props)


@needs_mosquitto
@pytest.mark.parametrize("v5", [True, False], ids=["v5", "v3.1.1"])
def test_lean_and_stock_clients_receive_the_same_messages(v5: bool) -> None:
    """Through mosquitto: QoS 0, 1 and 2 (paho's path), with properties and a retained one,
    reach a LeanClient exactly as they reach paho's client. 200 QoS 1 messages arriving at
    all proves the lean client acknowledges them: mosquitto stops at 20 unacknowledged."""
    with LocalBroker(kind="mosquitto") as broker:
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        pub.connect(broker.host, broker.port, keepalive=10)
        pub.loop_start()
        try:
            retained = os.urandom(1000)
            pub.publish("lean/retained", retained, qos=1, retain=True).wait_for_publish(WAIT_S)
            with (
                subscriber(LeanClient, broker, "lean/#", v5) as lean,
                subscriber(mqtt.Client, broker, "lean/#", v5) as stock,
            ):
                got_lean, got_stock = drain(lean, 1), drain(stock, 1)
                assert got_lean[0].retain and got_lean[0].payload == retained
                sent = []
                for i in range(200):
                    qos = 1 if i >= 3 else i
                    body = os.urandom(1 << 16) if i % 50 == 0 else i.to_bytes(4, "big")
                    props = rich_properties() if i % 2 else None
                    sent.append(body)
                    pub.publish(f"lean/m/{i}", body, qos=qos, properties=props)
                got_lean += drain(lean, 200)
                got_stock += drain(stock, 200)
        finally:
            pub.disconnect()
            pub.loop_stop()
    # MQTT orders messages per QoS level only, so the QoS 2 one may overtake or lag
    assert sorted(map(fields, got_lean)) == sorted(map(fields, got_stock))
    by_topic = {m.topic: m.payload for m in got_lean[1:]}
    assert [by_topic[f"lean/m/{i}"] for i in range(200)] == sent
    assert all(isinstance(m.payload, bytes) for m in got_lean)
    assert all(m.mid > 0 for m in got_lean[1:] if m.qos > 0)
    if v5:
        odd = next(m for m in got_lean if m.topic == "lean/m/1")
        odd_props = cast(Any, odd.properties)
        assert odd_props.UserProperty == [("sha256", "ab" * 32), ("chunk", "7")]


@needs_mosquitto
def test_bus_uses_the_lean_client() -> None:
    from shared.config import BrokerSection
    from shared.transport.mqtt import MqttBus

    with LocalBroker(kind="mosquitto") as broker:
        bus = MqttBus(BrokerSection(port=broker.port), run="lean", client_id="lean", home="cloud")
        try:
            assert type(bus.client) is LeanClient
        finally:
            bus.close()
