"""MQTT clients for probing a broker's authentication and ACL from tests (paho, MQTT v5)."""

from __future__ import annotations

import queue
import time

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion


def connect(
    host: str, port: int, user: str | None, password: str | None, timeout_s: float = 10.0
) -> tuple[mqtt.Client, int]:
    """A started client and its CONNACK reason code (0 = accepted, -1 = no answer)."""
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"t-{user}-{time.monotonic_ns()}",
                    protocol=mqtt.MQTTv5)  # fmt: skip
    if user is not None:
        c.username_pw_set(user, password)
    result: queue.Queue[int] = queue.Queue()
    c.on_connect = lambda cl, ud, flags, rc, props: result.put(rc.value)
    c.connect(host, port)
    c.loop_start()
    try:
        code = result.get(timeout=timeout_s)
    except queue.Empty:
        code = -1
    return c, code


def login(host: str, port: int, user: str, password: str) -> mqtt.Client:
    """A client logged in as ``user``; fails the test if the broker refuses."""
    c, code = connect(host, port, user, password)
    assert code == 0, f"{user} could not log in: {code}"
    return c


def inbox(c: mqtt.Client, *patterns: str) -> queue.Queue[str]:
    """Subscribe ``c`` to ``patterns`` (QoS 1); the topics of the messages it receives land in
    the queue, except retained ones (state published before the subscription)."""
    box: queue.Queue[str] = queue.Queue()
    c.on_message = lambda cl, ud, msg: None if msg.retain else box.put(msg.topic)
    for p in patterns:
        c.subscribe(p, qos=1)
    time.sleep(0.3)
    return box


def received(box: queue.Queue[str], wait_s: float = 0.8) -> set[str]:
    """The topics that arrive in ``box`` within ``wait_s``."""
    end, got = time.monotonic() + wait_s, set()
    while time.monotonic() < end:
        try:
            got.add(box.get(timeout=0.05))
        except queue.Empty:
            pass
    return got


def close(*clients: mqtt.Client) -> None:
    """Stop and disconnect ``clients``."""
    for c in clients:
        c.loop_stop()
        c.disconnect()


def clear_retained(
    host: str, port: int, user: str | None = None, password: str | None = None
) -> int:
    """Remove every retained message a client (anonymous, or logged in as ``user``) can read
    on the broker by publishing an empty retained payload to its topic, so that the next test
    on a shared broker starts from none; the number removed. Retained messages arrive right
    after the SUBACK, so a short quiet spell after the last one means all have come."""
    c = login(host, port, user, password or "") if user else connect(host, port, None, None)[0]
    topics: queue.Queue[str] = queue.Queue()
    c.on_message = lambda cl, ud, msg: topics.put(msg.topic) if msg.retain and msg.payload else None
    c.subscribe("#", qos=1)
    seen: set[str] = set()
    end = time.monotonic() + 10.0
    while time.monotonic() < end:
        try:
            seen.add(topics.get(timeout=0.3))
        except queue.Empty:
            break
    for topic in sorted(seen):
        c.publish(topic, b"", qos=1, retain=True).wait_for_publish(5.0)
    close(c)
    return len(seen)
