"""A swarm of lightweight simulated devices in one process, for large-federation tests and
benchmarks (``tests/test_large_federation.py``).

A :class:`Swarm` holds one paho MQTT client per device, all driven by a single thread with
:mod:`selectors` over their sockets (paho's external-loop interface: ``socket()``,
``loop_read()``, ``loop_write()``, ``loop_misc()``, ``want_write()``); no
:class:`~device_agent.service.DeviceAgent`, no torch training, one file descriptor per device.
Each device speaks to the broker as a real one does (see :mod:`device_agent.service` and
:func:`shared.runtime.process.connect_bus`):

* client id ``<run>-<device>`` (``device`` = :func:`shared.naming.device_name`: ``dev000``,
  ``dev1999``), MQTT v5, QoS 1 everywhere, its retained offline
  :class:`~shared.wire.messages.Presence` as the last will;
* on connect it subscribes to what a device on a static assignment hears (the edges' round
  announcements, the cloud's state and presence, and blob requests addressed to its own
  subtree), then publishes its retained online presence and its retained
  :class:`~shared.wire.messages.DeviceHello` (home edge round-robin, as
  :func:`shared.naming.home_edge`);
* when an edge's retained :class:`~shared.wire.messages.EdgeRound` names it, it "trains": it
  takes the model the edge announced (fetched once per model over the chunked blob protocol
  of :mod:`shared.transport.blob_transfer`, verified by sha256, then shared by every device
  of the swarm), adds a small device-specific offset to its first floating tensor, keeps the
  safetensors bytes of the algorithm's upload spec as a blob served under its own subtree
  (``device/<name>``), and publishes a :class:`~shared.wire.messages.DeviceUpdate` pointing
  at it; it answers the edge's chunk requests for that blob.

Only ``federation.assignment = "static"`` is supported (no edge selection), and algorithms
whose device upload is a subset of the announced state (FedAvg, FedProx, ...). The swarm
never reconnects a dropped client: drops are counted (:attr:`SwarmStats.disconnects`) for
the caller to assert on.

Use as a context manager, or :meth:`Swarm.start` / :meth:`Swarm.stop`::

    with Swarm(cfg, broker.host, broker.port) as swarm:
        assert swarm.wait_registered(120)
        ...  # start the cloud and the edges

:func:`run_federation` is the whole scenario: the swarm registers, then the real edges and
cloud (in this process, each on its own MqttBus) start and run the config's rounds; it
returns what it measured (:class:`FederationRun`). From a shell, for other sizes::

    python -m tests.swarm --devices 5000 --max-queue 20000

Every device costs one file descriptor here and one in the broker (see
:func:`raise_fd_limit`). A paho client with its own network thread (``loop_start``, as
MqttBus uses) select()s on its socket and cannot work with a descriptor >= 1024: connect
such clients in this process *before* starting a swarm (:func:`run_federation` does).
"""

from __future__ import annotations

import contextlib
import logging
import resource
import selectors
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from pydantic import ValidationError

from cloud import CloudServer, RoundSummary
from edge_node import EdgeServer
from shared.config import RunConfig
from shared.data.datasets import NUM_CLASSES
from shared.errors import CodecError, MessageError
from shared.methods.registry import make_algorithm
from shared.models.init import initial_model
from shared.naming import device_name, edge_ids, home_edge
from shared.transport.blob_transfer import chunk_count
from shared.transport.local_broker import LocalBroker
from shared.transport.mqtt import MqttBus
from shared.transport.paho_lean import client_class
from shared.wire.codec import decode_tensors, encode_tensors, sha256_hex, spec_of
from shared.wire.messages import (
    BlobRef,
    BlobWant,
    DeviceHello,
    DeviceUpdate,
    EdgeRound,
    Presence,
    Topics,
    decode,
    encode,
    home_of,
)

log = logging.getLogger(__name__)

QOS = 1
#: file descriptors the swarm's process needs besides one per device (torch, logs, the
#: roles of an in-process test)
FD_MARGIN = 512
_MISC_EVERY_S = 1.0  # keep-alive bookkeeping over all clients
_FETCH_SILENCE_S = 2.0  # re-ask for the missing chunks of the model after this much silence
_SELECT_S = 0.05


def raise_fd_limit(needed: int) -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to at least ``needed`` (up to the hard
    limit) and return the soft limit now in force. Child processes started afterwards (a
    :class:`~shared.transport.local_broker.LocalBroker`'s mosquitto) inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return int(soft)


def label_counts_of(index: int) -> list[int]:
    """The label histogram device ``index`` registers with (and reports in its update): a
    few samples of each class, different from device to device."""
    return [1 + (index + k) % 4 for k in range(NUM_CLASSES)]


@dataclass
class SwarmStats:
    """What the swarm did so far (written by its thread; read them once it is quiet)."""

    connected: int = 0  #: CONNACKs received
    registered: int = 0  #: devices whose retained hello the broker acknowledged
    refused: int = 0  #: connections refused or failed (socket errors, CONNACK failures)
    disconnects: int = 0  #: connections lost after connecting
    announcements: int = 0  #: EdgeRound messages received (all devices together)
    selected: int = 0  #: (device, round) pairs an EdgeRound named
    updates_sent: int = 0  #: DeviceUpdates published
    models_fetched: int = 0  #: announced models fetched from an edge
    blob_requests: int = 0  #: chunk requests answered (for the devices' update blobs)
    chunks_sent: int = 0  #: update chunks published
    messages: int = 0  #: application messages received (all devices together)
    errors: list[str] = field(default_factory=list)  #: what went wrong, in words
    connect_s: float = 0.0  #: seconds from the first connect to the last CONNACK
    register_s: float = 0.0  #: seconds from the first connect to the last hello PUBACK


@dataclass(eq=False)
class _Device:
    """One simulated device and its client."""

    index: int
    name: str
    home: str  # topic subtree: device/<name>
    edge: str  # home edge
    client: mqtt.Client
    label_counts: list[int]
    events: int = 0  # selector events registered for its socket (0: not registered)
    fd: int = -1  # its socket's descriptor, while registered
    connected: bool = False
    lost: bool = False  # its connection closed (the swarm never reconnects)
    hello_mid: int | None = None
    registered: bool = False
    served: dict[str, bytes] = field(default_factory=dict)  # its update blobs, by sha256
    trained: set[tuple[str, int]] = field(default_factory=set)  # (session, round)


@dataclass(eq=False)
class _Fetch:
    """The announced model being fetched, through one device's client."""

    ref: BlobRef
    via: _Device
    chunk_bytes: int
    n: int
    pattern: str  # its chunk topics (the ``+`` index level)
    chunks: dict[int, bytes] = field(default_factory=dict)
    asked: bool = False
    last_heard: float = 0.0
    waiting: list[tuple[_Device, EdgeRound]] = field(default_factory=list)


class Swarm:
    """``count`` simulated devices of ``cfg`` (``dev000``...) on the broker at
    ``host:port``, all on one thread; see the module docstring.

    Args:
        cfg: the run's config (run name, rounds, edges, algorithm, static assignment).
        host: broker address.
        port: broker port.
        count: how many devices (default ``federation.num_devices``); they are devices
            ``first`` .. ``first + count - 1``.
        first: index of the first device.
        chunk_bytes: chunk size the swarm asks the edge's model in (and serves its updates
            in, when the edge asks for that size).
        keepalive_s: MQTT keep-alive of each client.
        connect_batch: connections opened before waiting for their CONNACKs (mosquitto
            accepts a burst of connections through a listen backlog of 100).
        connect_timeout_s: how long one batch may take to be acknowledged.

    Raises:
        ValueError: the config selects edges per device (``assignment`` not ``static``),
            or ``count`` is out of range.
    """

    def __init__(
        self,
        cfg: RunConfig,
        host: str,
        port: int,
        *,
        count: int | None = None,
        first: int = 0,
        chunk_bytes: int = 1 << 20,
        keepalive_s: int = 60,
        connect_batch: int = 100,
        connect_timeout_s: float = 30.0,
    ) -> None:
        if cfg.federation.assignment != "static":
            raise ValueError(
                f"the swarm simulates devices of a static assignment only, not "
                f"{cfg.federation.assignment!r}"
            )
        n = cfg.federation.num_devices - first if count is None else count
        if n < 1 or first < 0:
            raise ValueError(f"a swarm needs at least one device (count {n}, first {first})")
        self.cfg = cfg
        self.host, self.port = host, port
        self.topics = Topics(cfg.run.name)
        self.chunk_bytes = chunk_bytes
        self.keepalive_s = keepalive_s
        self.connect_batch = max(1, connect_batch)
        self.connect_timeout_s = connect_timeout_s
        self.stats = SwarmStats()
        self.algorithm = make_algorithm(cfg)
        self._indices = range(first, first + n)
        self._devices: list[_Device] = []
        self._sel = selectors.DefaultSelector()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._registered = threading.Event()
        self._finished = threading.Event()
        self._connect_done = threading.Event()  # every device was tried
        self._models: dict[str, dict[str, Any]] = {}  # announced models, by sha256
        self._fetches: dict[str, _Fetch] = {}  # by sha256
        self._sub_mids: dict[tuple[int, int], _Fetch] = {}  # (device index, mid) -> fetch
        self._rounds: dict[bytes, EdgeRound | None] = {}  # parsed announcements, by payload
        self._dirty: set[_Device] = set()  # clients that queued packets inside a callback
        self._t0 = 0.0
        base = self.topics.base
        self._round_prefix, self._round_suffix = f"{base}/edge/", "/round"

    # -- the caller's side ------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Number of devices in the swarm."""
        return len(self._indices)

    def start(self) -> Swarm:
        """Start the swarm's thread: it connects every device and then serves them."""
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._main, name="swarm", daemon=True)
        self._thread.start()
        return self

    def wait_registered(self, timeout_s: float) -> bool:
        """Wait until every device's retained hello is acknowledged by the broker; False on
        timeout, when the broker turned a device away, or when the swarm's thread stopped."""
        end = time.monotonic() + timeout_s
        while not self._registered.is_set():
            given_up = self._finished.is_set() or (
                self._connect_done.is_set() and self.stats.refused
            )
            if given_up or time.monotonic() >= end:
                return self._registered.is_set()
            self._registered.wait(0.1)
        return True

    def wait(self, predicate: Callable[[SwarmStats], bool], timeout_s: float) -> bool:
        """Poll ``predicate(stats)`` until it holds (True) or ``timeout_s`` passes (False)."""
        end = time.monotonic() + timeout_s
        while not predicate(self.stats):
            if time.monotonic() >= end or self._finished.is_set():
                return predicate(self.stats)
            time.sleep(0.05)
        return True

    def stop(self, timeout_s: float = 30.0) -> None:
        """Disconnect every device (cleanly: no last will) and stop the thread; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("swarm thread still running %.0f s after stop", timeout_s)

    def __enter__(self) -> Swarm:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- the swarm's thread -----------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._connect_all()
            last_misc = time.monotonic()
            while not self._stop.is_set():
                self._pump(_SELECT_S)
                now = time.monotonic()
                if now - last_misc >= _MISC_EVERY_S:
                    last_misc = now
                    self._misc(now)
        except Exception as err:  # the caller sees it in stats.errors and waits no longer
            log.exception("swarm thread failed")
            self.stats.errors.append(f"swarm thread: {type(err).__name__}: {err}")
        finally:
            self._disconnect_all()
            self._sel.close()
            self._finished.set()

    def _connect_all(self) -> None:
        self._t0 = time.monotonic()
        for start in range(0, len(self._indices), self.connect_batch):
            batch = [self._connect(i) for i in self._indices[start : start + self.connect_batch]]
            end = time.monotonic() + self.connect_timeout_s
            pending = [d for d in batch if d is not None]
            while pending and not self._stop.is_set():
                if time.monotonic() >= end:
                    self.stats.errors.append(
                        f"{len(pending)} device(s) got no CONNACK within "
                        f"{self.connect_timeout_s:g} s, e.g. {pending[0].name}"
                    )
                    break
                self._pump(_SELECT_S)
                pending = [d for d in pending if not d.connected and d.events]
            if self._stop.is_set():
                return
        self.stats.connect_s = time.monotonic() - self._t0
        self._connect_done.set()

    def _connect(self, index: int) -> _Device | None:
        name = device_name(index)
        home = home_of("device", name)
        client = client_class()(
            callback_api_version=CallbackAPIVersion.VERSION2,
            client_id=f"{self.cfg.run.name}-{name}",
            protocol=mqtt.MQTTv5,
        )
        dev = _Device(index, name, home, home_edge(index, self.cfg), client, label_counts_of(index))
        client.user_data_set(dev)
        client.max_queued_messages_set(0)
        will = encode(Presence(name=name, role="device", online=False))
        client.will_set(self.topics.status(home), will, qos=QOS, retain=True)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 0  # nothing kept for a swarm device after it leaves
        try:
            client.connect(
                self.host, self.port, keepalive=self.keepalive_s, clean_start=True,
                properties=props,
            )  # fmt: skip
        except OSError as err:
            self.stats.refused += 1
            self.stats.errors.append(f"{name}: connect: {type(err).__name__}: {err}")
            return None
        self._devices.append(dev)
        self._sync(dev)
        return dev

    def _sync(self, dev: _Device) -> None:
        """Make the selector watch ``dev``'s socket for what its client needs now."""
        sock = dev.client.socket()
        if sock is None:  # paho closed it
            if dev.events:
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self._sel.unregister(dev.fd)  # by number: the socket is closed
                dev.events = 0
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if dev.client.want_write() else 0)
        if want == dev.events:
            return
        if dev.events:
            self._sel.modify(sock, want, dev)
        else:
            self._sel.register(sock, want, dev)
            dev.fd = sock.fileno()
        dev.events = want

    def _pump(self, timeout_s: float) -> None:
        """One round of the event loop: read and write whatever sockets are ready."""
        for key, mask in self._sel.select(timeout_s):
            dev: _Device = key.data
            client = dev.client
            if mask & selectors.EVENT_READ:
                rc = client.loop_read(max_packets=100)
                if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                    self._lost(dev, f"read: {mqtt.error_string(rc)}")
            if mask & selectors.EVENT_WRITE and client.socket() is not None:
                rc = client.loop_write()
                if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                    self._lost(dev, f"write: {mqtt.error_string(rc)}")
            self._sync(dev)
        self._flush()

    def _flush(self) -> None:
        """Register write interest for clients that queued packets in a callback of another
        client (paho writes at once outside its own callbacks, queues inside them)."""
        for dev in self._dirty:
            self._sync(dev)
        self._dirty.clear()

    def _touch(self, dev: _Device) -> None:
        """``dev``'s client queued a packet: have the selector watch it for writing."""
        self._dirty.add(dev)

    def _lost(self, dev: _Device, why: str) -> None:
        if dev.lost:
            return  # paho's on_disconnect and the failed read both say so
        dev.lost = True
        if dev.connected:
            self.stats.disconnects += 1
            self.stats.errors.append(f"{dev.name} lost its connection ({why})")
        else:  # closed before its CONNACK, or refused by it: the broker turned it away
            self.stats.refused += 1
            self.stats.errors.append(f"{dev.name}: connection closed before CONNACK ({why})")
        dev.connected = False

    def _misc(self, now: float) -> None:
        """Keep-alives of every client, and a fetch that went silent asks again."""
        for dev in self._devices:
            if dev.events:
                dev.client.loop_misc()
                self._sync(dev)
        for fetch in list(self._fetches.values()):
            if fetch.asked and now - fetch.last_heard > _FETCH_SILENCE_S:
                self._ask(fetch)

    def _disconnect_all(self) -> None:
        """Say DISCONNECT on every connection (the broker then drops its will) and close it."""
        for dev in self._devices:
            if dev.client.socket() is not None:
                with contextlib.suppress(Exception):
                    dev.client.disconnect()  # written at once (outside a callback)
            sock = dev.client.socket()
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        self._devices.clear()

    # -- paho callbacks (on the swarm's thread, inside loop_read / loop_write) ---------------
    def _on_connect(
        self, client: mqtt.Client, dev: _Device, _flags: Any, rc: Any, _props: Any
    ) -> None:
        if rc.is_failure:
            self._lost(dev, f"CONNACK {rc}")
            return
        dev.connected = True
        self.stats.connected += 1
        t = self.topics
        patterns = [
            f"{t.base}/edge/+/round",
            t.cloud_state,
            t.status(home_of("cloud", "cloud")),
            *t.blob_want_patterns(dev.home),
        ]
        client.subscribe([(p, QOS) for p in patterns])
        client.publish(t.status(dev.home), encode(Presence(name=dev.name, role="device",
                       online=True)), qos=QOS, retain=True)  # fmt: skip
        hello = DeviceHello(
            device=dev.name,
            home_edge=dev.edge,
            n_samples=sum(dev.label_counts),
            label_counts=dev.label_counts,
        )
        info = client.publish(t.device_hello(dev.name), encode(hello), qos=QOS, retain=True)
        dev.hello_mid = info.mid

    def _on_disconnect(
        self, _client: mqtt.Client, dev: _Device, _flags: Any, rc: Any, _props: Any
    ) -> None:
        if not self._stop.is_set():
            self._lost(dev, f"disconnected: {rc}")

    def _on_publish(
        self, _client: mqtt.Client, dev: _Device, mid: int, _rc: Any, _props: Any
    ) -> None:
        if mid == dev.hello_mid and not dev.registered:
            dev.registered = True
            self.stats.registered += 1
            if self.stats.registered == self.size:
                self.stats.register_s = time.monotonic() - self._t0
                self._registered.set()

    def _on_subscribe(
        self, _client: mqtt.Client, dev: _Device, mid: int, _rc: Any, _props: Any
    ) -> None:
        fetch = self._sub_mids.pop((dev.index, mid), None)
        if fetch is not None:
            self._ask(fetch)

    def _on_message(self, _client: mqtt.Client, dev: _Device, msg: mqtt.MQTTMessage) -> None:
        self.stats.messages += 1
        try:
            self._route(dev, msg.topic, bytes(msg.payload))
        except Exception as err:  # never into paho's read loop
            log.exception("swarm: %s: error handling %.200r", dev.name, msg.topic)
            self.stats.errors.append(f"{dev.name}: {msg.topic}: {type(err).__name__}: {err}")

    # -- what a device does --------------------------------------------------------------
    def _route(self, dev: _Device, topic: str, payload: bytes) -> None:
        if topic.endswith(f"/want/{dev.home}"):
            self._serve(dev, payload)
        elif topic.startswith(self._round_prefix) and topic.endswith(self._round_suffix):
            self._on_edge_round(dev, topic, payload)
        elif "/blob/" in topic:
            self._on_chunk(topic, payload)
        # the cloud's state and presence: heard, as a real device hears them; nothing to do

    def _parsed_round(self, payload: bytes) -> EdgeRound | None:
        """An announcement decoded once for the whole swarm (every device hears it)."""
        if payload not in self._rounds:
            if len(self._rounds) > 64:
                self._rounds.clear()
            try:
                self._rounds[payload] = decode(payload, EdgeRound) if payload else None
            except MessageError as err:
                self.stats.errors.append(f"bad EdgeRound: {err}")
                self._rounds[payload] = None
        return self._rounds[payload]

    def _on_edge_round(self, dev: _Device, topic: str, payload: bytes) -> None:
        self.stats.announcements += 1
        msg = self._parsed_round(payload)
        if msg is None or dev.name not in msg.devices:
            return
        if topic != self.topics.edge_round(msg.edge) or msg.edge != dev.edge:
            self.stats.errors.append(f"{dev.name}: announcement of {msg.edge} on {topic}")
            return
        key = (msg.session, msg.round)
        if msg.round >= self.cfg.run.rounds or key in dev.trained:
            return
        dev.trained.add(key)
        self.stats.selected += 1
        model = self._models.get(msg.model_ref.sha256)
        if model is not None:
            self._report(dev, msg, model)
            return
        fetch = self._fetches.get(msg.model_ref.sha256)
        if fetch is None:
            fetch = self._start_fetch(dev, msg.model_ref)
        fetch.waiting.append((dev, msg))

    def _start_fetch(self, dev: _Device, ref: BlobRef) -> _Fetch:
        if ref.src is None:
            raise ValueError(f"announced model {ref.sha256[:12]}… names no source")
        cb = self.chunk_bytes
        pattern = self.topics.blob_chunk(ref.src, ref.sha256, cb, "+")
        fetch = _Fetch(ref, dev, cb, chunk_count(ref.size, cb), pattern)
        self._fetches[ref.sha256] = fetch
        rc, mid = dev.client.subscribe(pattern, qos=QOS)
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or mid is None:
            raise RuntimeError(f"{dev.name}: subscribe to {pattern}: {mqtt.error_string(rc)}")
        self._sub_mids[(dev.index, mid)] = fetch
        self._touch(dev)
        return fetch

    def _ask(self, fetch: _Fetch) -> None:
        """Ask the edge for the chunks of the model still missing (the SUBACK is in)."""
        missing = [i for i in range(fetch.n) if i not in fetch.chunks]
        runs: list[tuple[int, int]] = []
        for i in missing:
            if runs and runs[-1][1] == i - 1:
                runs[-1] = (runs[-1][0], i)
            else:
                runs.append((i, i))
        want = BlobWant(sha256=fetch.ref.sha256, size=fetch.ref.size,
                        chunk_bytes=fetch.chunk_bytes, chunks=runs[:4096])  # fmt: skip
        assert fetch.ref.src is not None
        topic = self.topics.blob_want(fetch.via.home, fetch.ref.src)
        fetch.via.client.publish(topic, encode(want), qos=QOS)
        fetch.asked, fetch.last_heard = True, time.monotonic()
        self._touch(fetch.via)

    def _on_chunk(self, topic: str, payload: bytes) -> None:
        parts = topic.rsplit("/", 4)  # [..., "blob", sha, chunk_bytes, index]
        fetch = self._fetches.get(parts[2]) if len(parts) == 5 else None
        if fetch is None or parts[1] != "blob" or parts[3] != str(fetch.chunk_bytes):
            return  # another device's chunk stream, or a fetch already complete
        fetch.last_heard = time.monotonic()
        if parts[4] == "missing":
            raise RuntimeError(f"{fetch.ref.src} does not have model {fetch.ref.sha256[:12]}…")
        index = int(parts[4])
        if 0 <= index < fetch.n:
            fetch.chunks[index] = payload
        if len(fetch.chunks) < fetch.n:
            return
        data = b"".join(fetch.chunks[i] for i in range(fetch.n))
        del self._fetches[fetch.ref.sha256]
        fetch.via.client.unsubscribe(fetch.pattern)
        self._touch(fetch.via)
        try:
            model = decode_tensors(data, sha256=fetch.ref.sha256)
        except CodecError as err:
            raise RuntimeError(f"model {fetch.ref.sha256[:12]}…: {err}") from None
        self._models[fetch.ref.sha256] = model
        self.stats.models_fetched += 1
        for dev, msg in fetch.waiting:
            self._report(dev, msg, model)

    def _report(self, dev: _Device, msg: EdgeRound, model: Mapping[str, Any]) -> None:
        """Train (offset the model a little) and send the device's update for ``msg``."""
        ref = None
        if msg.upload and self.algorithm.traffic.uplink != "none":
            data = encode_tensors(self._update_tensors(dev, model))
            sha = sha256_hex(data)
            dev.served = {sha: data}  # the latest update only
            ref = BlobRef(sha256=sha, size=len(data), kind="device_update", src=dev.home)
        update = DeviceUpdate(
            round=msg.round,
            session=msg.session,
            device=dev.name,
            edge=msg.edge,
            update_ref=ref,
            n_samples=sum(dev.label_counts),
            label_counts=dev.label_counts,
            train_loss=0.5,
            steps=max(1, self.cfg.train.local_steps),
            train_seconds=0.0,
        )
        dev.client.publish(self.topics.device_up(dev.name), encode(update), qos=QOS)
        self._touch(dev)
        self.stats.updates_sent += 1

    def _update_tensors(self, dev: _Device, model: Mapping[str, Any]) -> dict[str, Any]:
        """The algorithm's upload of ``model``, its first floating tensor offset by a
        device-specific amount (every update a different blob)."""
        names = self.algorithm.format.upload_spec(spec_of(model))
        out = {k: model[k] for k in sorted(names)}
        for k, t in out.items():
            if t.is_floating_point():
                out[k] = t + 1e-4 * (dev.index + 1)
                break
        return out

    def _serve(self, dev: _Device, payload: bytes) -> None:
        """Answer a chunk request for one of ``dev``'s update blobs."""
        try:
            want = BlobWant.model_validate_json(payload)
        except ValidationError as err:
            self.stats.errors.append(f"{dev.name}: bad blob request: {err.errors()[0]['msg']}")
            return
        self.stats.blob_requests += 1
        data = dev.served.get(want.sha256)
        cb = want.chunk_bytes
        if data is None:
            dev.client.publish(self.topics.blob_chunk(dev.home, want.sha256, cb, "missing"),
                               b"", qos=QOS)  # fmt: skip
            self._touch(dev)
            return
        n = chunk_count(len(data), cb)
        for first, last in want.chunks:
            for i in range(max(0, first), min(last, n - 1) + 1):
                chunk = data[i * cb : (i + 1) * cb]
                dev.client.publish(self.topics.blob_chunk(dev.home, want.sha256, cb, i), chunk,
                                   qos=QOS)  # fmt: skip
                self.stats.chunks_sent += 1
        self._touch(dev)


@dataclass
class FederationRun:
    """What :func:`run_federation` measured."""

    devices: int  #: devices in the swarm (= federation.num_devices)
    swarm: SwarmStats  #: the swarm's own counters
    cloud_registered: int = 0  #: devices the cloud registered
    #: seconds from the cloud's start to its last registration (the retained hellos)
    cloud_register_s: float = 0.0
    participants: int = 0  #: devices the cloud selected for the first round
    contributions: int = 0  #: device contributions the edges reported to the cloud
    rounds: list[RoundSummary] = field(default_factory=list)  #: the cloud's round summaries
    cloud_done: bool = False
    cloud_failed: str | None = None
    round_start_bytes: list[int] = field(default_factory=list)  #: sizes of its RoundStarts
    #: rejected-input counters (``who:reason``) of the cloud's and each edge's bus
    rejected: dict[str, dict[str, int]] = field(default_factory=dict)
    run_s: float = 0.0  #: seconds from the cloud's start to the run's end (or giving up)
    harness_rss_bytes: int = 0  #: the swarm's memory: this process's RSS growth while it connected
    process_peak_rss_bytes: int = 0  #: peak RSS of this whole process (swarm, cloud, edges)
    broker_peak_rss_bytes: int = 0  #: peak RSS of the mosquitto process
    broker_dropped: list[str] = field(default_factory=list)  #: its "dropped" log lines

    def round_s(self) -> float:
        """Seconds the first round took, by the cloud's clock (0 before it closed)."""
        return self.rounds[0].round_seconds if self.rounds else 0.0


def run_federation(
    cfg: RunConfig,
    broker: LocalBroker,
    *,
    timeout_s: float = 300.0,
    train: bool = True,
    quiet_s: float = 3.0,
) -> FederationRun:
    """A swarm of ``federation.num_devices`` devices, then the real edges and cloud
    (:class:`~edge_node.EdgeServer`, :class:`~cloud.CloudServer`, each on its own
    :class:`~shared.transport.mqtt.MqttBus`) over ``broker``: the devices register first,
    so the cloud meets every registration as retained messages, as after a cloud restart.

    Waits until the cloud has registered every device, or has heard no new registration for
    ``quiet_s`` (counting what it got); with ``train`` it then runs the federation until the
    cloud is done or failed. Everything is bounded by ``timeout_s``; everything started is
    stopped before returning.
    """
    n = cfg.federation.num_devices
    t = Topics(cfg.run.name)
    settings = cfg.broker.model_copy(update={"host": broker.host, "port": broker.port})
    proc = broker.process
    buses: list[MqttBus] = []
    stop = threading.Event()
    threads: list[threading.Thread] = []
    end = time.monotonic() + timeout_s
    swarm = Swarm(cfg, broker.host, broker.port)
    out = FederationRun(n, swarm.stats)

    def bus(role: str, name: str) -> MqttBus:
        will = encode(Presence(name=name, role=role, online=False))  # type: ignore[arg-type]
        b = MqttBus(settings, run=cfg.run.name, client_id=f"{cfg.run.name}-{name}",
                    home=home_of(role, name), will=will)  # fmt: skip
        buses.append(b)
        return b.connect()

    try:
        # The roles connect before the swarm opens its thousands of sockets: paho's own
        # network thread select()s on its socket, which fails for a descriptor >= 1024
        # (FD_SETSIZE), so a client connected later in this process would never get
        # through. They subscribe (start) only once the devices are registered.
        edges = []
        for edge_id in edge_ids(cfg):
            ebus = bus("edge", edge_id)
            edges.append(EdgeServer(cfg, ebus, make_algorithm(cfg), edge_id=edge_id))
            threads.append(threading.Thread(target=ebus.run, args=(stop.is_set,),
                                            name=f"swarm-{edge_id}", daemon=True))  # fmt: skip
        cbus = bus("cloud", "cloud")
        state = initial_model(cfg.model.preset, cfg.model.init, seed=cfg.run.seed).state_dict()
        cloud = CloudServer(cfg, cbus, make_algorithm(cfg), initial_model=dict(state),
                            on_round_end=out.rounds.append)  # fmt: skip
        rss0 = process_rss_bytes()
        swarm.start()
        if not swarm.wait_registered(timeout_s):
            return out
        out.harness_rss_bytes = process_rss_bytes() - rss0
        for edge in edges:
            edge.start()
        for th in threads:
            th.start()
        cbus.endpoint("observer", "cloud").subscribe(
            t.cloud_round, lambda _t, p: out.round_start_bytes.append(len(p)), kind="observer"
        )
        t0 = time.monotonic()
        cloud.start()  # subscribes: the broker hands over the retained registrations
        last, last_at = 0, time.monotonic()

        def registered() -> bool:
            nonlocal last, last_at
            now = time.monotonic()
            if len(cloud.devices) != last:
                last, last_at = len(cloud.devices), now
            return last >= n or now - last_at >= quiet_s or cloud.started

        cbus.run(registered, timeout_s=max(0.0, end - time.monotonic()))
        out.cloud_registered = len(cloud.devices)
        out.cloud_register_s = last_at - t0
        if train:
            cbus.run(lambda: cloud.done or cloud.failed is not None,
                     timeout_s=max(0.0, end - time.monotonic()))  # fmt: skip
        out.run_s = time.monotonic() - t0
        out.participants = len(cloud.participants)
        out.contributions = cloud.contributions
        out.cloud_done, out.cloud_failed = cloud.done, cloud.failed
        out.rejected = {b.client_id: b.traffic.snapshot()["rejected"] for b in buses}
    finally:
        stop.set()
        for th in threads:
            th.join(10)
        for b in buses:
            b.close(timeout_s=2.0)
        swarm.stop()
        out.process_peak_rss_bytes = process_peak_rss_bytes()
        if proc is not None:
            out.broker_peak_rss_bytes = process_peak_rss_bytes(proc.pid)
        if broker.log_path is not None:
            with contextlib.suppress(OSError):
                out.broker_dropped = dropped_lines(broker.log_path.read_text(errors="replace"))
    return out


class SiteSwarm(Swarm):
    """The simulated devices of one edge site (:func:`shared.federation.topology.sites`:
    device ``i`` at edge ``i % num_edges``), on that site's broker at ``host:port``.

    Args:
        cfg: the run's config.
        host: the site broker's address.
        port: its port.
        edge: the site's edge (one of :func:`shared.naming.edge_ids`).
        **kwargs: the other :class:`Swarm` arguments (``chunk_bytes``, ``keepalive_s``...).

    Raises:
        ValueError: ``edge`` is no edge of ``cfg``, or the site has no devices.
    """

    def __init__(self, cfg: RunConfig, host: str, port: int, *, edge: str, **kwargs: Any):
        edges = edge_ids(cfg)
        if edge not in edges:
            raise ValueError(f"{edge!r} is not an edge of run {cfg.run.name!r} ({edges})")
        super().__init__(cfg, host, port, **kwargs)
        self._indices = range(edges.index(edge), cfg.federation.num_devices, len(edges))
        if not self._indices:
            raise ValueError(f"edge site {edge!r} has no devices")


def merged_stats(parts: list[SwarmStats]) -> SwarmStats:
    """Several swarms' counters as one: counts summed, errors joined, the slowest swarm's
    connect and register times."""
    out = SwarmStats()
    for s in parts:
        for name in ("connected", "registered", "refused", "disconnects", "announcements",
                     "selected", "updates_sent", "models_fetched", "blob_requests",
                     "chunks_sent", "messages"):  # fmt: skip
            setattr(out, name, getattr(out, name) + getattr(s, name))
        out.errors += s.errors
        out.connect_s = max(out.connect_s, s.connect_s)
        out.register_s = max(out.register_s, s.register_s)
    return out


@dataclass
class SitesRun(FederationRun):
    """What :func:`run_sites_federation` measured, besides :class:`FederationRun`'s figures
    (whose ``swarm`` sums every site's swarm, and whose broker figures are the cloud
    broker's)."""

    #: each site swarm's own counters, by edge
    site_swarms: dict[str, SwarmStats] = field(default_factory=dict)
    #: peak RSS of each site's mosquitto, by edge
    site_broker_peak_rss_bytes: dict[str, int] = field(default_factory=dict)
    #: each site broker's "dropped" log lines, by edge
    site_broker_dropped: dict[str, list[str]] = field(default_factory=dict)


def run_sites_federation(
    cfg: RunConfig,
    cloud_broker: LocalBroker,
    site_brokers: Mapping[str, LocalBroker],
    *,
    timeout_s: float = 300.0,
    quiet_s: float = 3.0,
) -> SitesRun:
    """:func:`run_federation` with a broker per edge site (``federation.brokers =
    "per-edge"``): each edge's :class:`SiteSwarm` and its real :class:`~edge_node.EdgeServer`
    on the site's broker (``site_brokers``, by edge, running and bridged to
    ``cloud_broker``), the real :class:`~cloud.CloudServer` on ``cloud_broker``. Every
    swarm registers first (each site's hellos cross its bridge as retained messages), then
    the edges and the cloud start and run the config's rounds. Everything is bounded by
    ``timeout_s``; everything started here is stopped before returning (not the brokers).

    Raises:
        ValueError: ``site_brokers`` does not hold exactly one broker per edge of ``cfg``.
    """
    edges_of = edge_ids(cfg)
    if sorted(site_brokers) != sorted(edges_of):
        raise ValueError(f"one site broker per edge {edges_of}, got {sorted(site_brokers)}")
    n = cfg.federation.num_devices
    t = Topics(cfg.run.name)
    buses: list[MqttBus] = []
    stop = threading.Event()
    threads: list[threading.Thread] = []
    end = time.monotonic() + timeout_s
    swarms = {e: SiteSwarm(cfg, b.host, b.port, edge=e) for e, b in site_brokers.items()}
    out = SitesRun(n, SwarmStats())

    def bus(role: str, name: str, broker: LocalBroker) -> MqttBus:
        settings = cfg.broker.model_copy(update={"host": broker.host, "port": broker.port})
        will = encode(Presence(name=name, role=role, online=False))  # type: ignore[arg-type]
        b = MqttBus(settings, run=cfg.run.name, client_id=f"{cfg.run.name}-{name}",
                    home=home_of(role, name), will=will)  # fmt: skip
        buses.append(b)
        return b.connect()

    try:
        # as in run_federation: the roles' buses connect before the swarms' sockets
        edges = []
        for edge_id in edges_of:
            ebus = bus("edge", edge_id, site_brokers[edge_id])
            edges.append(EdgeServer(cfg, ebus, make_algorithm(cfg), edge_id=edge_id))
            threads.append(threading.Thread(target=ebus.run, args=(stop.is_set,),
                                            name=f"swarm-{edge_id}", daemon=True))  # fmt: skip
        cbus = bus("cloud", "cloud", cloud_broker)
        state = initial_model(cfg.model.preset, cfg.model.init, seed=cfg.run.seed).state_dict()
        cloud = CloudServer(cfg, cbus, make_algorithm(cfg), initial_model=dict(state),
                            on_round_end=out.rounds.append)  # fmt: skip
        rss0 = process_rss_bytes()
        for s in swarms.values():
            s.start()
        for s in swarms.values():
            if not s.wait_registered(max(0.0, end - time.monotonic())):
                return out
        out.harness_rss_bytes = process_rss_bytes() - rss0
        for edge in edges:
            edge.start()
        for th in threads:
            th.start()
        cbus.endpoint("observer", "cloud").subscribe(
            t.cloud_round, lambda _t, p: out.round_start_bytes.append(len(p)), kind="observer"
        )
        t0 = time.monotonic()
        cloud.start()
        last, last_at = 0, time.monotonic()

        def registered() -> bool:
            nonlocal last, last_at
            now = time.monotonic()
            if len(cloud.devices) != last:
                last, last_at = len(cloud.devices), now
            return last >= n or now - last_at >= quiet_s or cloud.started

        cbus.run(registered, timeout_s=max(0.0, end - time.monotonic()))
        out.cloud_registered = len(cloud.devices)
        out.cloud_register_s = last_at - t0
        cbus.run(lambda: cloud.done or cloud.failed is not None,
                 timeout_s=max(0.0, end - time.monotonic()))  # fmt: skip
        out.run_s = time.monotonic() - t0
        out.participants = len(cloud.participants)
        out.contributions = cloud.contributions
        out.cloud_done, out.cloud_failed = cloud.done, cloud.failed
        out.rejected = {b.client_id: b.traffic.snapshot()["rejected"] for b in buses}
    finally:
        stop.set()
        for th in threads:
            th.join(10)
        for b in buses:
            b.close(timeout_s=2.0)
        for s in swarms.values():
            s.stop()
        out.site_swarms = {e: s.stats for e, s in swarms.items()}
        out.swarm = merged_stats(list(out.site_swarms.values()))
        out.process_peak_rss_bytes = process_peak_rss_bytes()
        for e, broker in [("cloud", cloud_broker), *site_brokers.items()]:
            peak = process_peak_rss_bytes(broker.process.pid) if broker.process else 0
            dropped: list[str] = []
            if broker.log_path is not None:
                with contextlib.suppress(OSError):
                    dropped = dropped_lines(broker.log_path.read_text(errors="replace"))
            if e == "cloud":
                out.broker_peak_rss_bytes, out.broker_dropped = peak, dropped
            else:
                out.site_broker_peak_rss_bytes[e] = peak
                out.site_broker_dropped[e] = dropped
    return out


def process_rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process now, from /proc (0 where unreadable)."""
    return _status_kib(pid, "VmRSS:") * 1024


def process_peak_rss_bytes(pid: int | str = "self") -> int:
    """Peak resident set size of a process so far, from /proc (0 where unreadable)."""
    return _status_kib(pid, "VmHWM:") * 1024


def _status_kib(pid: int | str, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def dropped_lines(log_text: str) -> list[str]:
    """mosquitto log lines saying it dropped messages for a client whose queue was full."""
    return [ln for ln in log_text.splitlines() if "dropped" in ln.lower()]


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.swarm``: :func:`run_federation` on a private mosquitto at the size
    given, printing its figures as JSON; exit 0 when every device registered with the cloud
    and (with rounds) the run finished with device contributions."""
    import argparse
    import json
    import math

    from shared.transport import local_broker
    from tests.conftest import tiny_config

    p = argparse.ArgumentParser(prog="python -m tests.swarm", description=main.__doc__)
    p.add_argument("--devices", type=int, default=2000)
    p.add_argument("--edges", type=int, default=2)
    p.add_argument("--participation", type=float, default=0.01)
    p.add_argument("--rounds", type=int, default=1, help="0: only register with the cloud")
    p.add_argument("--max-queue", type=int, default=10_000, help="the roles' broker.max_queue")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument(
        "--mosquitto-defaults",
        action="store_true",
        help="run mosquitto without the shipped limits (max_queued_messages 1000)",
    )
    p.add_argument(
        "--max-queued-messages",
        type=int,
        default=0,
        help="mosquitto's max_queued_messages instead of the shipped one",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    limits = [] if args.mosquitto_defaults else local_broker.mosquitto_limits()
    if args.max_queued_messages:
        limits = [ln for ln in limits if not ln.startswith("max_queued_messages ")]
        limits.append(f"max_queued_messages {args.max_queued_messages}")
    local_broker.mosquitto_limits = lambda **_: limits  # type: ignore[assignment]
    raise_fd_limit(args.devices + FD_MARGIN)
    cfg = tiny_config(
        run={"name": "swarm", "rounds": max(1, args.rounds)},
        federation={"num_devices": args.devices, "num_edges": args.edges,
                    "participation": args.participation, "round_deadline_s": 120},
        broker={"max_queue": args.max_queue},
    )  # fmt: skip
    with LocalBroker(kind="mosquitto") as broker:
        run = run_federation(cfg, broker, timeout_s=args.timeout, train=args.rounds > 0)
    figures = {
        "devices": run.devices,
        "swarm_connect_s": round(run.swarm.connect_s, 2),
        "swarm_register_s": round(run.swarm.register_s, 2),
        "swarm_refused": run.swarm.refused,
        "swarm_disconnects": run.swarm.disconnects,
        "cloud_registered": run.cloud_registered,
        "cloud_register_s": round(run.cloud_register_s, 2),
        "participants": run.participants,
        "expected_participants": math.ceil(args.participation * args.devices - 1e-9),
        "contributions": run.contributions,
        "round_s": [round(r.round_seconds, 2) for r in run.rounds],
        "run_s": round(run.run_s, 2),
        "cloud_done": run.cloud_done,
        "cloud_failed": run.cloud_failed,
        "round_start_bytes": run.round_start_bytes,
        "rejected": {k: v for k, v in run.rejected.items() if v},
        "swarm_rss_mib": round(run.harness_rss_bytes / 2**20, 1),
        "process_peak_rss_mib": round(run.process_peak_rss_bytes / 2**20, 1),
        "broker_peak_rss_mib": round(run.broker_peak_rss_bytes / 2**20, 1),
        "broker_dropped": run.broker_dropped[:5],
        "swarm_errors": run.swarm.errors[:5],
    }
    print(json.dumps(figures, indent=1))
    ok = run.cloud_registered == args.devices and (
        args.rounds == 0 or (run.cloud_done and run.contributions > 0)
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
