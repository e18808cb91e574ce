"""MqttBus against hostile or unlucky input over a real mosquitto broker.

Each test drives one defect that used to take a bus down or let one small message cost
unbounded memory and time, and checks the bus rejects it with a counted reason and keeps
serving:

* a blob request whose claimed size, not the blob held, set how many chunks were queued;
* a full control queue that blocked paho's network thread;
* chunk topics whose index level made ``int()`` raise inside paho's callback (which ends
  paho's network thread while the bus still looks connected);
* exceptions in the I/O worker (a cache eviction racing a read) that silently ended blob
  serving and re-subscribing.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from shared.config import BrokerSection
from shared.errors import EstuaryError
from shared.transport.blobs import BlobStore
from shared.transport.local_broker import LocalBroker, find_mosquitto
from shared.transport.mqtt import MqttBus
from shared.wire.codec import sha256_hex
from shared.wire.messages import BlobWant, Topics, encode
from tests.conftest import shared_broker

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")

WAIT_S = 5.0
SERVER, CLIENT = "device/dev001", "edge/edge0"
_runs = itertools.count()


#: the session's open mosquitto (this module's runs have names of their own)
broker = pytest.fixture(scope="module")(shared_broker)


class Net:
    """Buses and raw clients on one broker, under a run name of their own; closes them all."""

    def __init__(self, broker: LocalBroker) -> None:
        self.broker = broker
        self.run = f"robust{next(_runs)}"
        self.topics = Topics(self.run)
        self.buses: list[MqttBus] = []
        self.raws: list[mqtt.Client] = []

    def bus(self, home: str, store: BlobStore | None = None, **settings: Any) -> MqttBus:
        s = BrokerSection(
            port=self.broker.port,
            connect_timeout_s=10,
            chunk_bytes=4096,
            max_inflight_bytes=1 << 20,
            **settings,
        )
        name = home.replace("/", "-")
        bus = MqttBus(s, run=self.run, client_id=f"{self.run}-{name}", home=home, store=store)
        self.buses.append(bus)
        return bus.connect()

    def raw(self, name: str) -> Raw:
        raw = Raw(self.broker.port, f"{self.run}-{name}")
        self.raws.append(raw.client)
        return raw

    def close(self) -> None:
        for client in self.raws:
            client.disconnect()
            client.loop_stop()
        for bus in self.buses:
            bus.close(timeout_s=1.0)


class Raw:
    """A plain paho client: publishes anything, records what it receives."""

    def __init__(self, port: int, client_id: str) -> None:
        self.got: list[tuple[str, bytes]] = []
        self.on: Callable[[str, bytes], None] | None = None
        self._subacks: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self.client = mqtt.Client(
            callback_api_version=CallbackAPIVersion.VERSION2, client_id=client_id
        )
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_message(self, _c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.got.append((msg.topic, bytes(msg.payload)))
        if self.on is not None:
            self.on(msg.topic, bytes(msg.payload))

    def _on_subscribe(self, _c: Any, _u: Any, mid: int, _rc: Any, _p: Any) -> None:
        with self._lock:
            event = self._subacks.setdefault(mid, threading.Event())
        event.set()

    def subscribe(self, pattern: str) -> None:
        _rc, mid = self.client.subscribe(pattern, qos=1)
        assert mid is not None
        with self._lock:
            event = self._subacks.setdefault(mid, threading.Event())
        assert event.wait(WAIT_S), f"no SUBACK for {pattern}"

    def publish(self, topic: str, payload: bytes) -> None:
        self.client.publish(topic, payload, qos=1).wait_for_publish(WAIT_S)

    def received(self) -> list[tuple[str, bytes]]:
        with self._lock:
            return list(self.got)


@pytest.fixture
def net(broker: LocalBroker) -> Iterator[Net]:
    n = Net(broker)
    try:
        yield n
    finally:
        n.close()


def wait_for(pred: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def rejected(bus: MqttBus, key: str) -> int:
    return bus.traffic.snapshot()["rejected"].get(key, 0)


def still_delivers(net: Net, bus: MqttBus, sender: Raw, timeout_s: float = 3.0) -> bool:
    """Whether an ordinary message to one of ``bus``'s subscriptions still reaches it."""
    topic = f"{net.topics.base}/cloud/round"
    got: list[bytes] = []
    if not any(p == topic for p, _ in bus._subs):
        bus.endpoint("probe", bus.home).subscribe(topic, lambda _t, p: got.append(p))
    else:
        bus._subs.append((topic, lambda _t, p: got.append(p)))
    sender.publish(topic, b"{}")
    return bus.run(lambda: bool(got), timeout_s=timeout_s)


# -- 1. blob requests: chunk counts from the blob held, bounded queue ---------------------


def test_want_claiming_a_huge_size_queues_only_the_real_chunks(net: Net) -> None:
    """A 170-byte request claiming a 2**28-chunk blob for a 2-chunk one: the server sends
    the 2 real chunks at once (walking the claim would take minutes), counts the size
    mismatch and queues nothing more."""
    server = net.bus(SERVER)
    sha = server.store.put(b"x" * 5000)
    raw = net.raw("evil")
    raw.subscribe(net.topics.blob_chunk(SERVER, sha, 4096, "+"))
    want = BlobWant(sha256=sha, size=2**40, chunk_bytes=4096, chunks=[(0, 2**40)])
    started = time.monotonic()
    raw.publish(net.topics.blob_want(CLIENT, SERVER), encode(want))
    wait_for(lambda: len(raw.received()) >= 2, "the two real chunks")
    assert time.monotonic() - started < 10.0  # generous for loaded CI hosts
    time.sleep(0.3)  # anything else the server would send after them
    indices = [t.rsplit("/", 1)[1] for t, _ in raw.received()]
    assert indices == ["0", "1"]  # no "missing" from walking a million absent chunks
    assert [len(p) for _, p in raw.received()] == [4096, 904]
    assert rejected(server, "blob_server:size_mismatch") == 1
    assert server._blob_server.pending_chunks == 0


def test_want_ranges_overlapping_and_out_of_bounds_queue_each_chunk_once(net: Net) -> None:
    """4096 overlapping ranges reaching far past the blob: each real chunk is sent once."""
    server = net.bus(SERVER)
    data = os.urandom(3 * 4096)
    sha = server.store.put(data)
    raw = net.raw("evil")
    raw.subscribe(net.topics.blob_chunk(SERVER, sha, 4096, "+"))
    ranges = [(i % 3, 2**40 - i) for i in range(4096)]
    want = BlobWant(sha256=sha, size=len(data), chunk_bytes=4096, chunks=ranges)
    started = time.monotonic()
    raw.publish(net.topics.blob_want(CLIENT, SERVER), encode(want))
    wait_for(lambda: len(raw.received()) >= 3, "the three chunks")
    assert time.monotonic() - started < 10.0
    time.sleep(0.3)
    assert sorted(t.rsplit("/", 1)[1] for t, _ in raw.received()) == ["0", "1", "2"]
    assert b"".join(p for _, p in sorted(raw.received())) == data
    assert rejected(server, "blob_server:size_mismatch") == 0


def test_serve_queue_is_capped_and_requesters_get_the_rest_by_asking_again(net: Net) -> None:
    """With room for 3 queued chunks, a 10-chunk request queues 3 and drops 7 (counted);
    the fetch still completes through the receiver's re-requests."""
    server = net.bus(SERVER)
    server._blob_server.max_pending_chunks = 3
    data = os.urandom(10 * 4096)
    sha = server.store.put(data)
    client = net.bus(CLIENT, chunk_timeout_s=0.2, fetch_timeout_s=8)
    got = client.endpoint("edge0", CLIENT).get_blob(
        sha, len(data), kind="blob", src=SERVER, timeout_s=8
    )
    assert got == data
    assert rejected(server, "blob_server:serve_queue_full") >= 1
    assert server.traffic.transport().get("chunks_not_queued", 0) >= 7
    assert server._blob_server.pending_chunks == 0


# -- 2. callbacks never block on a full queue ----------------------------------------------


@pytest.mark.parametrize("limit", ["control_queue", "want_count"])
def test_request_flood_while_io_worker_is_busy_never_blocks_delivery(
    net: Net, monkeypatch: pytest.MonkeyPatch, limit: str
) -> None:
    """The I/O worker is stuck on one request; 20 more arrive. They are dropped and counted,
    and paho's thread goes on delivering ordinary messages."""
    server = net.bus(SERVER)
    gate = threading.Event()
    busy = threading.Event()

    def stuck(_payload: bytes, _requester: str = "") -> None:
        busy.set()
        gate.wait(10.0)

    monkeypatch.setattr(server._blob_server, "_queue_want", stuck)
    if limit == "control_queue":
        server._control = queue.Queue(maxsize=3)
    else:
        server._blob_server.max_queued_wants = 3
    raw = net.raw("evil")
    try:
        want_topic = net.topics.blob_want(CLIENT, SERVER)
        raw.publish(want_topic, b"{}")
        assert busy.wait(WAIT_S)
        for _ in range(20):
            raw.client.publish(want_topic, b"{}", qos=1)
        assert still_delivers(net, server, raw)
        assert rejected(server, "blob_server:want_queue_full") >= 1
    finally:
        gate.set()


# -- 3. chunk topics and callback exceptions -----------------------------------------------


@pytest.mark.parametrize(
    "index",
    ["\u00b2", "\u0663", "1" * 5000, "", "-1"],
    ids=["super2", "arabic3", "5000dig", "empty", "neg"],
)
def test_bad_chunk_index_ends_the_fetch_and_the_bus_keeps_receiving(net: Net, index: str) -> None:
    """The source answers a request with a chunk whose index level ``int()`` refuses (or
    that is no index at all): the fetch fails at once and the bus still receives."""
    client = net.bus(CLIENT, chunk_timeout_s=1, fetch_timeout_s=12)
    sha = "ab" * 32
    evil = net.raw("evil")
    bad_chunk = net.topics.blob_chunk(SERVER, sha, 4096, index)

    def answer_with_a_bad_chunk(_topic: str, _payload: bytes) -> None:
        evil.client.publish(bad_chunk, b"x", qos=1)

    evil.on = answer_with_a_bad_chunk
    evil.subscribe(net.topics.blob_want(CLIENT, SERVER))
    started = time.monotonic()
    with pytest.raises(EstuaryError):
        client.endpoint("edge0", CLIENT).get_blob(sha, 10, kind="blob", src=SERVER, timeout_s=12)
    assert time.monotonic() - started < 6.0  # refused on arrival, not by the fetch timeout
    assert client.traffic.transport().get("chunks_invalid", 0) == 1
    assert still_delivers(net, client, evil)
    assert client.connected


def test_exception_in_message_callback_is_counted_and_paho_keeps_running(net: Net) -> None:
    """Whatever raises while a message is handed over is caught, counted and logged; paho's
    network thread survives and the next message is delivered."""
    bus = net.bus(CLIENT)
    real = bus._inbound
    calls = itertools.count()

    class Flaky(queue.Queue[tuple[str, bytes, float]]):
        def put_nowait(self, item: tuple[str, bytes, float]) -> None:
            if next(calls) == 0:
                raise RuntimeError("boom")
            real.put_nowait(item)

        def get(self, block: bool = True, timeout: float | None = None) -> tuple[str, bytes, float]:
            return real.get(block, timeout)

    bus._inbound = Flaky()
    raw = net.raw("other")
    topic = f"{net.topics.base}/cloud/x"
    got: list[bytes] = []
    bus.endpoint("edge0", CLIENT).subscribe(topic, lambda _t, p: got.append(p))
    raw.publish(topic, b"first")  # raises inside the callback
    raw.publish(topic, b"second")
    assert bus.run(lambda: bool(got), timeout_s=3.0)
    assert got == [b"second"]
    assert rejected(bus, "bus:callback_error") == 1
    assert bus.client._thread is not None and bus.client._thread.is_alive()


# -- 4. the I/O worker survives errors -----------------------------------------------------


def test_cache_eviction_racing_a_read_does_not_stop_blob_serving(
    net: Net, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk copy is evicted between reading and touching it: the verified bytes are
    served anyway, and the server goes on serving."""
    store = BlobStore(tmp_path / "cache")
    server = net.bus(SERVER, store=store)
    data = os.urandom(2 * 4096 + 7)
    sha = store.put(data)
    store._mem.clear()  # only the disk copy is left
    store._mem_bytes = 0
    real_utime = os.utime

    def evicted_first(path: Any, *args: Any, **kwargs: Any) -> None:
        Path(path).unlink(missing_ok=True)  # another process evicts it just now
        real_utime(path, *args, **kwargs)

    monkeypatch.setattr(os, "utime", evicted_first)
    client = net.bus(CLIENT, chunk_timeout_s=0.3, fetch_timeout_s=4)
    ep = client.endpoint("edge0", CLIENT)
    assert ep.get_blob(sha, len(data), kind="blob", src=SERVER, timeout_s=4) == data
    other = os.urandom(5000)
    assert ep.get_blob(server.store.put(other), 5000, kind="blob", src=SERVER) == other
    assert sha256_hex(data) == sha


def test_io_worker_error_is_counted_and_serving_continues(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading one chunk raises: the I/O worker logs and counts it, goes on with the other
    chunks, and serves the lost one when the receiver asks again."""
    server = net.bus(SERVER)
    data = os.urandom(3 * 4096)
    sha = server.store.put(data)
    real_chunk = server.store.chunk
    calls = itertools.count()

    def flaky(sha256: str, index: int, chunk_bytes: int) -> bytes | None:
        if next(calls) == 1:
            raise RuntimeError("disk on fire")
        return real_chunk(sha256, index, chunk_bytes)

    monkeypatch.setattr(server.store, "chunk", flaky)
    client = net.bus(CLIENT, chunk_timeout_s=0.3, fetch_timeout_s=5)
    got = client.endpoint("edge0", CLIENT).get_blob(
        sha, len(data), kind="blob", src=SERVER, timeout_s=5
    )
    assert got == data
    assert rejected(server, "bus:io_error") == 1
    assert client.traffic.transport().get("chunks_rerequested", 0) >= 1
