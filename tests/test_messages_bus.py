from __future__ import annotations

import json

import pytest

from shared.errors import CodecError, MessageError, TransportError
from shared.transport.bus import MemoryBus, topic_matches
from shared.wire.messages import DeviceHello, EdgeRound, decode, encode

HELLO = DeviceHello(device="dev000", home_edge="edge0", n_samples=3, label_counts=[1, 2])


def test_message_round_trip() -> None:
    assert decode(encode(HELLO), DeviceHello) == HELLO


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"{not json", "bad_json"),
        (b"[1, 2]", "bad_json"),
        (json.dumps({"v": 9, "kind": "hello"}).encode(), "bad_version"),
        (json.dumps({"v": 1, "kind": "hello", "device": "d"}).encode(), "missing_field"),
        (
            json.dumps(
                {
                    "v": 1,
                    "kind": "hello",
                    "device": "d/../x",
                    "home_edge": "e",
                    "n_samples": 1,
                    "label_counts": [],
                }
            ).encode(),
            "bad_field",
        ),
        (
            json.dumps(
                {
                    "v": 1,
                    "kind": "hello",
                    "device": "d",
                    "home_edge": "e",
                    "n_samples": -1,
                    "label_counts": [],
                }
            ).encode(),
            "bad_field",
        ),
        (b"x" * 300_000, "too_large"),
        # under the size cap, but past json's recursion limit / Python's integer digit limit
        pytest.param(
            b'{"v":1,"kind":"hello","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "bad_json",
            id="deep_nesting",
        ),
        pytest.param(
            b'{"v":1,"kind":"hello","n_samples":' + b"9" * 5000 + b"}", "bad_json", id="huge_int"
        ),
    ],
)
def test_bad_messages_have_reasons(payload: bytes, reason: str) -> None:
    with pytest.raises(MessageError) as err:
        decode(payload)
    assert err.value.reason == reason


def test_wrong_kind() -> None:
    with pytest.raises(MessageError) as err:
        decode(encode(HELLO), EdgeRound)
    assert err.value.reason == "wrong_kind"


def test_topic_matching() -> None:
    assert topic_matches("a/+/c", "a/b/c")
    assert not topic_matches("a/+/c", "a/b/d")
    assert topic_matches("a/#", "a/b/c/d")
    assert not topic_matches("a/b", "a/b/c")


def test_retained_reaches_late_subscribers_and_traffic_counts() -> None:
    bus = MemoryBus()
    pub, sub = bus.endpoint("p"), bus.endpoint("s")
    got: list[tuple[str, bytes]] = []
    pub.publish("x/state", b"hello", kind="state", retain=True)
    sub.subscribe("x/+", lambda t, p: got.append((t, p)), kind="state")
    bus.run(lambda: False)
    assert got == [("x/state", b"hello")]
    snap = bus.traffic.snapshot()
    assert snap["bytes"] == {"received:state": 5, "sent:state": 5}


def test_virtual_timers_fire_in_order() -> None:
    bus = MemoryBus()
    fired: list[tuple[str, float]] = []
    bus.call_later(5, lambda: fired.append(("b", bus.now())))
    bus.call_later(1, lambda: fired.append(("a", bus.now())))
    t = bus.call_later(3, lambda: fired.append(("cancelled", bus.now())))
    t.cancel()
    bus.run(lambda: False)
    assert fired == [("a", 1.0), ("b", 5.0)]


def test_blobs_verified_bounded_and_counted() -> None:
    bus = MemoryBus(max_blob_bytes=10)
    ep = bus.endpoint("e")
    sha = ep.put_blob(b"12345", kind="model")
    assert ep.get_blob(sha, 5, kind="model") == b"12345"
    assert bus.traffic.total("received", "model") == 5
    with pytest.raises(CodecError):
        ep.get_blob(sha, 4, kind="model")
    with pytest.raises(TransportError):
        ep.put_blob(b"x" * 11, kind="model")
    with pytest.raises(TransportError):
        ep.get_blob("0" * 64, 3, kind="model")
