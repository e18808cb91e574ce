"""What a connection to the broker needs besides paho's client: the largest packet a client
accepts, the password, TCP without Nagle's delay, and whether a host is this machine."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path
from typing import Any, Final

import paho.mqtt.client as mqtt

from shared.config import BrokerSection
from shared.errors import TransportError
from shared.wire.messages import MAX_MESSAGE_BYTES

PASSWORD_ENV = "ESTUARY_MQTT_PASSWORD"


#: what an MQTT 5 packet may add to its payload (fixed header, topic of up to 64 KiB,
#: packet id, properties) in the Maximum Packet Size this client announces
PACKET_OVERHEAD: Final = 70 << 10


def max_packet_bytes(settings: BrokerSection) -> int:
    """The largest packet an MQTT 5 client of ours accepts (announced on CONNECT as its
    Maximum Packet Size, so the broker drops bigger ones instead of sending them): a blob
    chunk or the largest message, plus headers."""
    return max(settings.chunk_bytes, MAX_MESSAGE_BYTES) + PACKET_OVERHEAD


def read_password(settings: BrokerSection) -> str | None:
    """The broker password from ``password_file`` or ``$ESTUARY_MQTT_PASSWORD`` (else None)."""
    if settings.password_file:
        try:
            return Path(settings.password_file).read_text(encoding="utf-8").strip()
        except OSError as err:
            raise TransportError(f"cannot read broker password file: {err}") from None
    return os.environ.get(PASSWORD_ENV)


def _set_nodelay(_client: mqtt.Client, _userdata: Any, sock: Any) -> None:
    """Turn Nagle's algorithm off on a TCP connection (paho leaves it on).

    With it on, a small packet sent while an earlier one is unacknowledged waits for the
    peer's delayed ACK (40 ms on Linux): a SUBACK-then-request exchange before every blob
    fetch stalled that long about half the time. Not every socket is TCP (paho also speaks
    over websockets and unix sockets), so a failure is ignored."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):
        pass


def _is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface (a name is resolved)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
        return bool(infos) and all(
            ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos
        )
    except (OSError, ValueError):
        return False
