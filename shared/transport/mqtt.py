"""MqttBus: the :class:`~shared.transport.bus.Bus` interface over a real MQTT broker
(paho-mqtt 2.x).

Threads and who does what:

* paho's network thread runs the callbacks, which **only enqueue**: application messages go
  to the role's inbound queue, blob chunks to the queue of the fetch waiting for them, blob
  requests, publish acknowledgements and (re)connect events to the I/O worker's queue. The
  client is :class:`~shared.transport.paho_lean.LeanClient`, paho's own with a PUBLISH decode that
  copies each payload once (paho's copies a 1 MiB chunk three times, holding the GIL).
* the I/O worker thread (one per bus) re-subscribes and re-publishes retained state after a
  reconnect, and serves blob chunks to whoever asked, never more than ``max_inflight_bytes``
  unacknowledged at a time.
* the role's own thread calls :meth:`MqttBus.run`, which dispatches inbound messages to the
  handlers and fires timers; a handler that needs a blob blocks in ``get_blob`` while the
  chunks arrive on their own queue.

This module holds the connection, the callbacks, dispatch and timers. Blob transfer (DESIGN
section 2: content-addressed blobs moved in resumable, hash-verified chunks) is in
:mod:`shared.transport.blob_transfer`: the bus owns one
:class:`~shared.transport.blob_server.BlobServer`, driven by its I/O worker, and one
:class:`~shared.transport.blob_fetcher.BlobFetcher`, which ``get_blob`` runs on the calling
thread. Received and published blobs live in a :class:`~shared.transport.blobs.BlobStore`
(memory LRU + optional disk cache), so an edge fetches each global model once and serves it
to all its devices. Private blobs (``put_blob(..., recipient=d)``, the cloud's personal model
for device ``d``) are kept apart and served only on ``d``'s private downlink; the first one
put subscribes the bus to the requests made there (:attr:`Topics.all_private_want`).

Every publish and subscription uses :data:`QOS` (1: at least once; receivers are idempotent).
MQTT v5 sessions start clean when the process starts and are resumed on reconnects, so
messages sent to a role during a short disconnect are queued by the broker.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Final, cast

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from shared.config import BrokerSection
from shared.errors import TransportError
from shared.logs import LogLimiter
from shared.transport.blob_fetcher import BlobFetcher
from shared.transport.blob_server import BlobServer
from shared.transport.blob_transfer import BlobContext
from shared.transport.blobs import BlobStore
from shared.transport.bus import Bus, Handler, HeapTimer, Timer, topic_matches
from shared.transport.connection import (
    PASSWORD_ENV,
    _is_loopback,
    _set_nodelay,
    max_packet_bytes,
    read_password,
)
from shared.transport.paho_lean import client_class
from shared.transport.telemetry import Traffic
from shared.wire.codec import Blob
from shared.wire.messages import CLOUD_RECIPIENT, DEPLOYER_HOME, MAX_MESSAGE_BYTES, Topics

__all__ = ["PASSWORD_ENV", "QOS", "MqttBus", "max_packet_bytes", "read_password"]

log = logging.getLogger(__name__)

QOS: Final = 1
"""The one QoS used for every publish and subscription: at-least-once delivery. Duplicates
are harmless because every receiver is idempotent (rounds, sessions and hashes)."""


_CONTROL_QUEUE: Final = 100_000
_CONTROL_PUT_TIMEOUT_S: Final = 5.0
_WANT_MAX_BYTES: Final = 256 << 10  # a blob request asks for at most 4,096 runs of chunks
_DEPLOYER_LEVELS: Final = DEPLOYER_HOME.split("/")  # its subtree: two topic levels
#: the role whose bus clears retained blob chunks (``broker.retained_sweep_s``): the cloud,
#: which reads the whole run and, under ``estuary provision``'s ACL, may clear them
SWEEPER_HOME: Final = "cloud"


class MqttBus(Bus):
    """One MQTT connection for one role instance (``home`` is its topic subtree)."""

    _log: ClassVar[logging.Logger] = log

    def __init__(
        self,
        settings: BrokerSection,
        *,
        run: str,
        client_id: str,
        home: str,
        will: bytes | None = None,
        traffic: Traffic | None = None,
        store: BlobStore | None = None,
        raise_errors: bool = False,
    ) -> None:
        self.settings = settings
        self.traffic = traffic or Traffic()
        self.max_blob_bytes = settings.max_blob_bytes
        self.topics = Topics(run)
        self.home = home
        self.client_id = client_id
        self._log_prefix = f"{client_id}: "
        self.raise_errors = raise_errors
        self.store = store or BlobStore(
            Path(settings.cache_dir) if settings.cache_dir else None,
            memory_limit_bytes=settings.memory_limit_bytes,
            disk_limit_bytes=settings.cache_limit_bytes,
        )
        self._status_topic = self.topics.status(home)
        self._subs: list[tuple[str, Handler]] = []
        self._subs_lock = threading.Lock()
        # (topic, payload, arrival time): bounded in count and, with _inbound_bytes, in bytes
        self._inbound: queue.Queue[tuple[str, bytes, float]] = queue.Queue(
            maxsize=settings.max_queue
        )
        self._inbound_bytes = 0
        self._inbound_lock = threading.Lock()
        self._drop_log = LogLimiter()  # paho's thread only
        self._control: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=_CONTROL_QUEUE)
        self._retained: dict[str, bytes] = {}
        self._timers: list[HeapTimer] = []
        self._timer_lock = threading.Lock()
        self._seq = itertools.count()
        self._suback: dict[int, threading.Event] = {}
        self._early_subacks: set[int] = set()
        self._suback_lock = threading.Lock()
        self._connected = threading.Event()
        self._ever_connected = False
        self._closing = threading.Event()
        self._last_info: mqtt.MQTTMessageInfo | None = None
        self._last_error = ""
        self._want_prefix = f"{self.topics.base}/"
        self._want_suffix = f"/want/{home}"
        self._serves_private = False  # a private blob was put: requests for them are heard
        self._serves_cloud_only = False  # a blob for the cloud alone was put: likewise
        self._cloud_only_want = self.topics.cloud_only_want(home)
        # the cloud clears retained blob chunks (no role publishes a chunk retained)
        self._sweep_s = settings.retained_sweep_s if home == SWEEPER_HOME else 0.0
        self._next_sweep = time.monotonic()
        self._sweep_mids: set[int] = set()  # under _suback_lock
        self.client = self._make_client(will)
        self._io = threading.Thread(target=self._io_loop, name=f"mqtt-io-{client_id}", daemon=True)
        ctx = BlobContext(
            settings, self.store, self.topics, home, self.traffic, self._publish_qos, client_id
        )
        private = None
        if self.store.directory is not None:  # large private blobs served from disk too
            private = BlobStore(
                self.store.directory / "private",
                memory_limit_bytes=settings.memory_limit_bytes,
                disk_limit_bytes=settings.cache_limit_bytes,
                staged_with=self.store,  # blobs put privately are staged in the store's
            )
        self._blob_server = BlobServer(ctx, on_served=self._fetched,  # driven by _io
                                       private_store=private)  # fmt: skip
        self._blob_fetcher = BlobFetcher(  # runs on the thread calling get_blob
            ctx,
            subscribe=self._subscribe_wait,
            unsubscribe=self.client.unsubscribe,
            closing=self._closing,
        )

    # -- connection ----------------------------------------------------------------------
    def _make_client(self, will: bytes | None) -> mqtt.Client:
        s = self.settings
        v5 = s.protocol == "5"
        client = client_class()(
            callback_api_version=CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
            clean_session=None if v5 else True,
        )
        client.reconnect_delay_set(s.reconnect_min_s, s.reconnect_max_s)
        client.max_inflight_messages_set(64)
        client.max_queued_messages_set(0)  # our own byte budget bounds what we queue
        if s.username:
            client.username_pw_set(s.username, read_password(s))
        if s.tls:
            client.tls_set(
                ca_certs=s.ca_file or None,
                certfile=s.cert_file or None,
                keyfile=s.key_file or None,
            )
        if will is not None:
            client.will_set(self._status_topic, will, qos=QOS, retain=True)
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        client.on_socket_open = _set_nodelay
        return client

    def connect(self) -> MqttBus:
        """Connect (waiting up to ``connect_timeout_s``) and start the network and I/O threads.

        Raises TransportError when the broker does not accept the connection in time.
        """
        s = self.settings
        props = None
        clean: Any = True
        if s.protocol == "5":
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = s.session_expiry_s
            # the broker drops what we would refuse anyway instead of sending it: an oversize
            # message costs us nothing, not a read of megabytes into memory
            props.MaximumPacketSize = max_packet_bytes(s)
            clean = mqtt.MQTT_CLEAN_START_FIRST_ONLY
        self.client.connect_async(
            s.host, s.port, keepalive=s.keepalive_s, clean_start=clean, properties=props
        )
        self.client.loop_start()
        self._io.start()
        if not self._connected.wait(s.connect_timeout_s):
            self.close(timeout_s=1.0)
            detail = f" ({self._last_error})" if self._last_error else ""
            raise TransportError(
                f"no connection to MQTT broker {s.host}:{s.port} within "
                f"{s.connect_timeout_s:g}s{detail}",
                reason="timeout",
            )
        if not s.username and not _is_loopback(s.host):
            log.warning(
                "%s: connected to %s:%d without an account. On an open broker anyone who "
                "reaches it can publish as any role, end the run or take a role's session; "
                "across machines use the broker `estuary provision` configures "
                "(docs/reliability.md#open-broker)", self.client_id, s.host, s.port,
            )  # fmt: skip
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush what was published (bounded), disconnect and stop the threads."""
        if self._closing.is_set():
            return
        info = self._last_info
        if info is not None and self._connected.is_set():
            try:
                info.wait_for_publish(timeout_s)
            except (RuntimeError, ValueError):
                pass
        self._closing.set()
        self.client.disconnect()
        self.client.loop_stop()
        if self._io.is_alive():
            self._io.join(timeout_s)

    @property
    def connected(self) -> bool:
        """Whether the broker connection is up right now."""
        return self._connected.is_set()

    def _on_connect(self, client: mqtt.Client, _u: Any, flags: Any, rc: Any, _p: Any) -> None:
        if rc.is_failure:
            self._last_error = str(rc)
            self.traffic.note("connect_refused")
            return
        try:  # must not be lost (it re-subscribes), but never blocks paho's thread for long
            self._control.put(
                ("connected", bool(getattr(flags, "session_present", False))),
                timeout=_CONTROL_PUT_TIMEOUT_S,
            )
        except queue.Full:
            self.traffic.reject("bus", "control_queue_full")
            log.error("%s: I/O worker stuck; connect event dropped", self.client_id)

    def _on_connect_fail(self, client: mqtt.Client, _u: Any) -> None:
        self._last_error = "connection refused or unreachable"
        self.traffic.note("connect_failures")

    def _on_disconnect(self, client: mqtt.Client, _u: Any, _f: Any, rc: Any, _p: Any) -> None:
        self._connected.clear()
        if not self._closing.is_set():
            self._last_error = str(rc)
            self.traffic.note("disconnects")

    def _on_subscribe(self, client: mqtt.Client, _u: Any, mid: int, _rc: Any, _p: Any) -> None:
        with self._suback_lock:
            if mid in self._sweep_mids:
                self._sweep_mids.discard(mid)
                return
            event = self._suback.pop(mid, None)
            if event is None:
                self._early_subacks.add(mid)  # raced ahead of _subscribe_wait
                if len(self._early_subacks) > 10_000:
                    self._early_subacks.clear()
        if event is not None:
            event.set()

    def _on_publish(self, client: mqtt.Client, _u: Any, mid: int, _rc: Any, _p: Any) -> None:
        try:
            self._control.put_nowait(("ack", mid))
        except queue.Full:
            self.traffic.reject("bus", "control_queue_full")

    def _on_message(self, client: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        # paho re-raises callback exceptions, which ends its network thread while the bus
        # still looks connected: nothing may escape from here
        try:
            self._handle_message(msg)
        except Exception:
            self.traffic.reject("bus", "callback_error")
            log.exception("%s: error handling a message on %.200r", self.client_id, msg.topic)

    def _handle_message(self, msg: mqtt.MQTTMessage) -> None:
        topic, payload = msg.topic, cast(bytes, msg.payload)  # paho hands us bytes
        self.traffic.note("wire_bytes_received", len(payload))
        ours = topic.startswith(self._want_prefix)
        rel = topic[len(self._want_prefix) :].split("/", 4)  # relative to the run's base
        # a subtree is "cloud", the deployer's "cloud/deployer", "edge/<id>", "device/<id>",
        # a device's private downlink "device/<id>/down" or an edge's path to the cloud alone
        # "edge/<id>/cloud", then the verb
        private = (rel[0], rel[2:3]) in (("device", ["down"]), ("edge", ["cloud"]))
        if rel[0] == "cloud":
            depth = 2 if rel[:2] == _DEPLOYER_LEVELS else 1
        else:
            depth = 3 if private else 2
        verb = rel[depth] if len(rel) > depth else ""
        if verb == "blob" and ours and msg.retain and payload and self._sweep_s:
            self._clear_retained_chunk(topic, len(payload))
        elif verb == "blob" and ours:
            self._blob_fetcher.route_chunk(topic, payload)
        elif verb == "want" and len(payload) > _WANT_MAX_BYTES:
            self.traffic.reject("blob_server", "too_large")
        elif verb == "want" and ours and topic.endswith(self._want_suffix):
            self._enqueue_want(payload, "/".join(rel[:depth]))
        elif verb == "want" and ours and topic == self._cloud_only_want:
            self._enqueue_want(payload, "cloud", CLOUD_RECIPIENT)
        elif verb == "want" and ours and rel[0] == "device" and topic.endswith("/down"):
            self._enqueue_private_want(topic, rel[1], payload)
        elif len(payload) > MAX_MESSAGE_BYTES:
            # refused here, before it is queued: a flood of them cannot fill memory (the
            # broker already drops what exceeds our Maximum Packet Size)
            self.traffic.reject("bus", "too_large")
            self._drop_log.warn(
                "too_large",
                f"{self.client_id}: dropped a message of {len(payload)} bytes on {topic[:200]!r}"
                f" (the limit is {MAX_MESSAGE_BYTES})",
                log,
            )
        else:
            self._enqueue_inbound(topic, payload)

    def _clear_retained_chunk(self, topic: str, nbytes: int) -> None:
        """Clear the retained message on blob-chunk ``topic`` (an empty retained publish;
        paho's thread, never blocks): no role publishes a chunk retained, so one that
        arrives with the retain flag is held by the broker, not sent live (a live chunk
        arrives without it: the sweep's subscription keeps the flag as published, and every
        other subscription clears it on live messages). Counted and logged (rate-limited)."""
        info = self.client.publish(topic, b"", qos=QOS, retain=True)
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            self.traffic.reject("bus", "retained_chunk_not_cleared")
            return
        self.traffic.note("retained_chunks_cleared")
        self.traffic.note("retained_chunk_bytes_cleared", nbytes)
        self._drop_log.warn(
            "retained_chunk",
            f"{self.client_id}: cleared a retained blob chunk of {nbytes} bytes on "
            f"{topic[:200]!r} (no role publishes chunks retained: its account left it there)",
            log,
        )

    def _sweep_retained_chunks(self) -> None:
        """Ask the broker for the retained messages on every blob-chunk topic of the run
        (subscribe with "send retained at subscribe" and retain-as-published, unsubscribe
        at once): each one arrives flagged retained and :meth:`_clear_retained_chunk`
        clears it. I/O thread, every ``retained_sweep_s``."""
        self._next_sweep = time.monotonic() + self._sweep_s
        patterns = self.topics.blob_chunk_sweep
        if self.settings.protocol == "5":
            opts = SubscribeOptions(
                qos=0,
                retainAsPublished=True,
                retainHandling=SubscribeOptions.RETAIN_SEND_ON_SUBSCRIBE,
            )
            rc, mid = self.client.subscribe([(p, opts) for p in patterns])
        else:  # 3.1.1: retained messages are sent at subscribe, flagged; live ones are not
            rc, mid = self.client.subscribe([(p, 0) for p in patterns])
        if rc != mqtt.MQTT_ERR_SUCCESS or mid is None:
            return  # not connected: the next sweep tries again
        with self._suback_lock:
            if mid in self._early_subacks:
                self._early_subacks.discard(mid)
            else:
                self._sweep_mids.add(mid)
                if len(self._sweep_mids) > 1_000:  # SUBACKs lost to a reconnect
                    self._sweep_mids.clear()
        # the broker handles a client's packets in order: the retained messages are queued
        # for us before this unsubscribe takes effect
        self.client.unsubscribe(patterns)
        self.traffic.note("retained_sweeps")

    def _enqueue_inbound(self, topic: str, payload: bytes) -> None:
        """Queue an application message for the role's thread, within ``max_queue`` messages
        and ``max_queue_bytes`` bytes; beyond either it is dropped and counted."""
        with self._inbound_lock:
            full = self._inbound_bytes + len(payload) > self.settings.max_queue_bytes
            if not full:
                self._inbound_bytes += len(payload)
        queued = False
        if not full:
            try:
                self._inbound.put_nowait((topic, payload, time.monotonic()))
                queued = True
            except queue.Full:
                pass
            finally:
                if not queued:  # not queued (full, or raised): its bytes are not held
                    with self._inbound_lock:
                        self._inbound_bytes -= len(payload)
        if queued:
            return
        self.traffic.reject("bus", "queue_full")
        self._drop_log.warn(
            "queue_full",
            f"{self.client_id}: inbound queue full ({self.settings.max_queue} messages, "
            f"{self.settings.max_queue_bytes} bytes); dropped a message on {topic[:200]!r}",
            log,
        )

    def _enqueue_want(self, payload: bytes, requester: str, device: str | None = None) -> None:
        """Hand a blob request from ``requester`` (the subtree it is published under; with
        ``device``: one on that recipient's private path) to the I/O worker, or drop it
        (counted) when too many wait."""
        if self._blob_server.admit_want(payload):
            try:
                self._control.put_nowait(("want", (payload, requester, device)))
                return
            except queue.Full:
                self._blob_server.release_want(payload)
        self.traffic.reject("blob_server", "want_queue_full")

    def _enqueue_private_want(self, topic: str, requester: str, payload: bytes) -> None:
        """A request on a private downlink: served only when the device asks for its own
        (the broker lets ``device/<id>/#`` be written by that device's credentials alone)."""
        if topic != self.topics.private_want(requester):
            self.traffic.reject("blob_server", "private_want_mismatch")
            log.warning("%s: dropped a request for another device's downlink on %.200r",
                        self.client_id, topic)  # fmt: skip
            return
        self._enqueue_want(payload, f"device/{requester}", requester)

    # -- I/O worker: reconnects and blob serving -----------------------------------------
    def _io_loop(self) -> None:
        server = self._blob_server
        while not self._closing.is_set():
            try:  # one bad request or a racing cache eviction must not end blob serving
                if (
                    self._sweep_s
                    and self._connected.is_set()
                    and time.monotonic() >= self._next_sweep
                ):
                    self._sweep_retained_chunks()
                can_send = server.ready()
                try:
                    item = self._control.get(timeout=0 if can_send else 0.5)
                except queue.Empty:
                    item = None
                if item is not None:
                    what, arg = item
                    if what == "ack":
                        server.acked(arg)
                    elif what == "want":
                        server.handle_want(*arg)
                    elif what == "connected":
                        self._after_connect(session_present=arg)
                    continue
                if can_send:
                    server.send_next()
            except Exception:
                self.traffic.reject("bus", "io_error")
                log.exception("%s: I/O worker error (continuing)", self.client_id)
                self._closing.wait(0.05)  # no hot loop if the error repeats

    def _after_connect(self, *, session_present: bool) -> None:
        first = not self._ever_connected
        self._ever_connected = True
        if not first:
            self.traffic.note("reconnects")
        if not session_present:
            with self._subs_lock:
                patterns = {p for p, _ in self._subs}
            patterns.update(self.topics.blob_want_patterns(self.home))
            if self._serves_private:
                patterns.add(self.topics.all_private_want)
            if self._serves_cloud_only:
                patterns.add(self._cloud_only_want)
            patterns.update(self._blob_fetcher.chunk_patterns())
            # acknowledged before the bus says it is connected: a request published to it
            # right after connect() returns is not lost to a subscription still in flight
            self._subscribe_all(sorted(patterns))
        for topic, payload in list(self._retained.items()):
            if not first and (topic == self._status_topic or not session_present):
                self._raw_publish(topic, payload, retain=True)
        self._connected.set()
        log.info("%s connected to %s:%d", self.client_id, self.settings.host, self.settings.port)

    # -- publish / subscribe -------------------------------------------------------------
    def _raw_publish(
        self, topic: str, payload: bytes, retain: bool = False
    ) -> mqtt.MQTTMessageInfo:
        info = self.client.publish(topic, payload, qos=QOS, retain=retain)
        self.traffic.note("wire_bytes_sent", len(payload))
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            raise TransportError(f"publish to {topic} failed: {mqtt.error_string(info.rc)}")
        return info

    def _publish_qos(self, topic: str, payload: bytes) -> int:
        """Publish a blob chunk or request (not retained); returns the message id."""
        return self._raw_publish(topic, payload).mid

    def _publish(self, topic: str, payload: bytes, retain: bool) -> None:
        if len(payload) > MAX_MESSAGE_BYTES:
            raise TransportError(f"message of {len(payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
        if retain:
            if payload:
                self._retained[topic] = payload
            else:
                self._retained.pop(topic, None)
        self._last_info = self._raw_publish(topic, payload, retain)

    def _subscribe(self, pattern: str, handler: Handler) -> None:
        with self._subs_lock:
            self._subs.append((pattern, handler))
        if self._connected.is_set():
            self._subscribe_wait(pattern)

    def _subscribe_wait(self, pattern: str, timeout_s: float = 10.0) -> None:
        self._subscribe_all([pattern], timeout_s)

    def _subscribe_all(self, patterns: list[str], timeout_s: float = 10.0) -> None:
        """Subscribe to ``patterns`` at once and wait (``timeout_s`` in all) for their
        SUBACKs; a missing one is logged (the reconnect path subscribes again)."""
        waits: list[tuple[str, int, threading.Event]] = []
        for pattern in patterns:
            rc, mid = self.client.subscribe(pattern, qos=QOS)
            if rc != mqtt.MQTT_ERR_SUCCESS or mid is None:
                return  # not connected: the reconnect path subscribes again
            event = threading.Event()
            with self._suback_lock:
                if mid in self._early_subacks:
                    self._early_subacks.discard(mid)
                    continue
                self._suback[mid] = event
            waits.append((pattern, mid, event))
        deadline = time.monotonic() + timeout_s
        for pattern, mid, event in waits:
            if not event.wait(max(0.0, deadline - time.monotonic())):
                with self._suback_lock:
                    self._suback.pop(mid, None)
                log.warning("%s: no SUBACK for %s within %.0fs", self.client_id, pattern,
                            timeout_s)  # fmt: skip

    # -- blobs ---------------------------------------------------------------------------
    def _put_blob(self, data: Blob) -> str:
        return self.store.put(data)

    def _staging(self, size: int) -> Path | None:
        return self.store.staging(size)

    def _offer_blob(self, sha256: str, kind: str) -> None:
        self._blob_server.offer(sha256, kind)

    def _put_private_blob(self, data: Blob, recipient: str, owner: str) -> str:
        sha = self._blob_server.put_private(data, recipient)
        if recipient == CLOUD_RECIPIENT:
            if not self._serves_cloud_only:
                self._serves_cloud_only = True  # as for private blobs, below
                self._subscribe_wait(self._cloud_only_want)
            return sha
        if not self._serves_private:
            self._serves_private = True  # subscribed again by every reconnect from now on
            # waits for the SUBACK, so the recipient's first request is heard; unconnected,
            # it returns at once and the connect path subscribes
            self._subscribe_wait(self.topics.all_private_want)
        return sha

    def _get_blob(
        self,
        sha256: str,
        size: int,
        timeout_s: float,
        src: str | None,
        requester: str,
        *,
        cache: bool = True,
        stall_s: float | None = None,
    ) -> Blob:
        if self._serves_private or self._serves_cloud_only:  # a private blob put here
            own = self._blob_server.private_store.get(sha256)
            if own is not None:
                return own
        return self._blob_fetcher.get(sha256, size, timeout_s, src, cache=cache, stall_s=stall_s)

    def _keep_blob(self, data: Blob, sha256: str) -> None:
        self.store.put(data, sha256)

    def _release_blob(self, sha256: str) -> None:
        self.store.release(sha256)

    def _retire_blob(self, sha256: str) -> None:
        self.store.retire(sha256)
        self._blob_server.private_store.retire(sha256)

    # -- timers and the role loop --------------------------------------------------------
    def call_later(self, delay_s: float, fn: Callable[[], None]) -> Timer:
        timer = HeapTimer(time.monotonic() + max(0.0, delay_s), next(self._seq), fn)
        with self._timer_lock:
            heapq.heappush(self._timers, timer)
        return timer

    def now(self) -> float:
        return time.monotonic()

    def _due_timer(self) -> tuple[HeapTimer | None, float]:
        """Pop a due timer, or return the seconds until the next one. A timer is not due
        while a message that arrived before its due time is still queued: what reached us
        before a deadline is handled before the deadline fires."""
        with self._timer_lock:
            while self._timers and self._timers[0].cancelled:
                heapq.heappop(self._timers)
            if not self._timers:
                return None, math.inf
            due = self._timers[0].due
            wait = due - time.monotonic()
            if wait > 0:
                return None, wait
            if self._oldest_arrival() <= due:
                return None, 0.0
            return heapq.heappop(self._timers), 0.0

    def _oldest_arrival(self) -> float:
        """When the oldest queued inbound message arrived (inf: none queued)."""
        with self._inbound.mutex:
            return self._inbound.queue[0][2] if self._inbound.queue else math.inf

    def _next_inbound(self, timeout_s: float) -> tuple[str, bytes] | None:
        """The next queued message, waiting at most ``timeout_s`` (None: none came)."""
        try:
            topic, payload, _ = self._inbound.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            return None
        with self._inbound_lock:
            self._inbound_bytes -= len(payload)
        return topic, payload

    def _dispatch(self, topic: str, payload: bytes) -> None:
        with self._subs_lock:
            handlers = [h for p, h in self._subs if topic_matches(p, topic)]
        for handler in handlers:
            self._call(lambda h=handler: h(topic, payload))  # type: ignore[misc]

    def run(
        self,
        until: Callable[[], bool],
        *,
        timeout_s: float | None = None,
        stop: threading.Event | None = None,
    ) -> bool:
        """Dispatch messages and timers on this thread until ``until()``; returns whether it
        became true (False on ``timeout_s``, on ``stop`` being set, or when the bus closes)."""
        end = math.inf if timeout_s is None else time.monotonic() + timeout_s
        while not until():
            if self._closing.is_set() or (stop is not None and stop.is_set()):
                return False
            timer, wait = self._due_timer()
            if timer is not None:
                self._call(timer.fn)
                continue
            left = end - time.monotonic()
            if left <= 0:
                return False
            item = self._next_inbound(min(wait, left, 0.25))
            if item is not None:
                self._dispatch(*item)
        return True

    def pump(self, seconds: float) -> None:
        """Dispatch for ``seconds`` (tests and shutdown paths)."""
        self.run(lambda: False, timeout_s=seconds)
