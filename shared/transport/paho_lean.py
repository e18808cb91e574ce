"""A paho-mqtt client whose PUBLISH decode copies the payload once instead of three times.

paho 2.2 decodes an incoming PUBLISH (``paho.mqtt._packet.decode_publish``) with one
``struct.unpack`` per header field, and each of them copies everything after the field it
reads: the topic length, the topic and the packet id each cost a copy of the whole
payload, and MQTT v5 adds a fourth for the properties. For a 1 MiB blob chunk that is
3-4 MiB of memcpy on paho's network thread, with the GIL held, for every chunk: measured
on the 136 MiB benchmark blob, 0.13 s of decode against 0.015 s for one copy.

:class:`LeanClient` overrides only ``_handle_publish`` for QoS 0 and 1 (QoS 2 keeps
paho's code): it reads the header fields through a ``memoryview`` and copies the payload
once, then does what paho does with the message (debug log, ``on_message`` dispatch,
PUBACK unless manual acks are on). Malformed packets raise paho's ``MalformedPacket``
just as paho's decoder does, so paho's read loop drops the connection the same way.

The override leans on paho internals (``_in_packet``, ``_handle_on_message``,
``_send_puback``), so it is used only where they are the ones it was written against:
:data:`LEAN_DECODE` is false on any paho without ``paho.mqtt._packet.decode_publish`` and
the other hooks, and :func:`client_class` then hands out paho's own client. The tests
check this decoder against paho's on every field, QoS, flag and malformed case.
"""

from __future__ import annotations

from typing import NamedTuple

import paho.mqtt.client as mqtt
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties, VariableByteIntegers

try:  # paho >= 2.2: a decoder module and one exception for every decode error
    from paho.mqtt import _packet as _paho_packet
    from paho.mqtt.exception import MalformedPacket
except ImportError:  # pragma: no cover - older paho: use its own client unchanged
    _paho_packet = None  # type: ignore[assignment]
    MalformedPacket = None  # type: ignore[assignment,misc]

_CLIENT_HOOKS = ("_handle_publish", "_handle_on_message", "_send_puback", "_easy_log")

LEAN_DECODE: bool = (
    _paho_packet is not None
    and callable(getattr(_paho_packet, "decode_publish", None))
    and isinstance(getattr(_paho_packet, "DECODE_ERRORS", None), tuple)
    and all(callable(getattr(mqtt.Client, name, None)) for name in _CLIENT_HOOKS)
    and callable(getattr(mqtt, "time_func", None))
)
"""Whether this paho has the internals :class:`LeanClient` was written against."""


class Publish(NamedTuple):
    """The fields of one decoded PUBLISH packet."""

    dup: bool
    qos: int
    retain: bool
    topic: bytes
    mid: int
    properties: Properties | None
    payload: bytes


def publish_qos(header: int) -> int:
    """The QoS bits of a PUBLISH packet's first byte."""
    return (header & 0x06) >> 1


def decode_publish(header: int, packet: bytes | bytearray, v5: bool) -> Publish:
    """Decode a PUBLISH: ``header`` is its first byte, ``packet`` everything after the length.

    Same result as paho's ``decode_publish``, with the payload copied once. Raises
    ``MalformedPacket`` when a field runs past the end of the packet, an MQTT 3.1.1 topic is
    empty or the v5 properties do not parse.
    """
    qos = publish_qos(header)
    with memoryview(packet) as view:
        n = len(view)
        if n < 2:
            raise MalformedPacket("PUBLISH shorter than its topic length")
        pos = 2 + int.from_bytes(view[:2], "big")
        if pos > n:
            raise MalformedPacket("PUBLISH topic runs past the packet")
        topic = bytes(view[2:pos])
        if not v5 and not topic:
            raise MalformedPacket("topic can't be empty in MQTTv3")
        mid = 0
        if qos > 0:
            if pos + 2 > n:
                raise MalformedPacket("PUBLISH packet id runs past the packet")
            mid = int.from_bytes(view[pos : pos + 2], "big")
            pos += 2
        properties = None
        if v5:  # the properties' length is a variable byte integer of at most 4 bytes
            length, used = VariableByteIntegers.decode(view[pos : pos + 4])
            end = pos + used + length
            if end > n:
                raise MalformedPacket("PUBLISH properties run past the packet")
            properties = Properties(PacketTypes.PUBLISH)
            try:
                properties.unpack(bytes(view[pos:end]))
            except _paho_packet.DECODE_ERRORS as err:  # paho's decoder converts the same ones
                raise MalformedPacket(f"PUBLISH properties: {err}") from err
            pos = end
        payload = bytes(view[pos:])
    return Publish(
        dup=bool(header & 0x08),
        qos=qos,
        retain=bool(header & 0x01),
        topic=topic,
        mid=mid,
        properties=properties,
        payload=payload,
    )


class LeanClient(mqtt.Client):
    """paho's client with :func:`decode_publish` for incoming QoS 0 and 1 PUBLISH packets."""

    def _handle_publish(self) -> MQTTErrorCode:
        header: int = self._in_packet["command"]
        if publish_qos(header) == 2:  # exactly-once needs paho's PUBREC bookkeeping
            return super()._handle_publish()
        p = decode_publish(header, self._in_packet["packet"], self._protocol == mqtt.MQTTv5)
        message = mqtt.MQTTMessage(mid=p.mid, topic=p.topic)
        message.dup, message.qos, message.retain = p.dup, p.qos, p.retain
        message.properties = p.properties
        message.payload = p.payload
        self._easy_log(
            mqtt.MQTT_LOG_DEBUG,
            "Received PUBLISH (d%d, q%d, r%d, m%d), %r, ...  (%d bytes)",
            p.dup,
            p.qos,
            p.retain,
            p.mid,
            p.topic,
            len(p.payload),
        )
        message.timestamp = mqtt.time_func()
        self._handle_on_message(message)
        if p.qos == 0 or self._manual_ack:
            return MQTTErrorCode.MQTT_ERR_SUCCESS
        return self._send_puback(p.mid)


def client_class() -> type[mqtt.Client]:
    """:class:`LeanClient` where this paho has the internals it needs, else paho's client."""
    return LeanClient if LEAN_DECODE else mqtt.Client
