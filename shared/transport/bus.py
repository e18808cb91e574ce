"""The Bus interface every role talks through, and MemoryBus, its in-process twin.

A role gets an :class:`Endpoint` (``bus.endpoint(name)``): publish/subscribe JSON messages on
topics, put/get content-addressed blobs, and schedule timers. Every byte through an endpoint
is counted in the bus's :class:`~shared.transport.telemetry.Traffic` by message kind.

:class:`MemoryBus` runs everything on the caller's thread with a virtual clock: ``run``
delivers queued messages in order and, when nothing is queued, jumps the clock to the next
timer. Runs are therefore deterministic and deadlines cost no wall time. Payloads are still
real bytes, so codec bugs surface here first.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import re
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from shared.errors import CodecError, TransportError
from shared.transport.telemetry import Traffic
from shared.wire.codec import (
    Blob,
    encode_tensors,
    encode_tensors_to_file,
    encoded_size,
    sha256_hex,
)
from shared.wire.messages import CLOUD_RECIPIENT, home_of

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Handler = Callable[[str, bytes], None]


def topic_matches(pattern: str, topic: str) -> bool:
    """MQTT wildcard matching (``+`` one level, ``#`` the rest)."""
    pp, tp = pattern.split("/"), topic.split("/")
    for i, p in enumerate(pp):
        if p == "#":
            return True
        if i >= len(tp) or (p != "+" and p != tp[i]):
            return False
    return len(pp) == len(tp)


class Timer(ABC):
    """Handle of a scheduled callback."""

    @abstractmethod
    def cancel(self) -> None:
        """Stop the callback from firing (no-op if it already fired)."""


#: blobs put but not yet fetched that a bus remembers to count as sent (oldest dropped)
MAX_UNSERVED_BLOBS = 4096

#: a private blob's recipient: a device id (:data:`shared.wire.messages.Id`), spelled into topics
_RECIPIENT = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class Bus(ABC):
    """Transport shared by the roles of a federation (MemoryBus, MqttBus).

    A blob counts as ``sent`` once, when it is first fetched from the role that put it,
    not when it is put: a blob nobody fetches (the whole model beside its shared part,
    when every receiver holds the rest) moved nothing over the network."""

    traffic: Traffic
    max_blob_bytes: int
    raise_errors: bool
    #: blobs are in this process, got at once (MemoryBus): a role fetches them inline, in
    #: the bus's deterministic order, rather than in a worker thread
    blobs_local: ClassVar[bool] = False
    _log: ClassVar[logging.Logger] = log  # where handler failures are logged
    _log_prefix = ""  # put before those log lines (the client id, on a real bus)
    _unserved: OrderedDict[str, tuple[str, int]] | None = None
    _unserved_lock = threading.Lock()

    def _await_fetch(self, sha256: str, kind: str, size: int) -> None:
        """Count blob ``sha256`` as sent when someone first fetches it."""
        with self._unserved_lock:
            if self._unserved is None:
                self._unserved = OrderedDict()
            self._unserved[sha256] = (kind, size)
            self._unserved.move_to_end(sha256)
            while len(self._unserved) > MAX_UNSERVED_BLOBS:
                self._unserved.popitem(last=False)

    def _fetched(self, sha256: str) -> None:
        """Blob ``sha256`` is being served: count it as sent if it was waiting for that."""
        with self._unserved_lock:
            entry = None if self._unserved is None else self._unserved.pop(sha256, None)
        if entry is not None:
            self.traffic.count("sent", *entry)

    def _call(self, fn: Callable[[], None]) -> None:
        """Run a handler or timer callback: its exception propagates with ``raise_errors``,
        else it is logged and counted and the bus goes on."""
        try:
            fn()
        except Exception:
            if self.raise_errors:
                raise
            self._log.exception("%shandler failed", self._log_prefix)
            self.traffic.reject("bus", "handler_error")

    @abstractmethod
    def _publish(self, topic: str, payload: bytes, retain: bool) -> None: ...

    @abstractmethod
    def _subscribe(self, pattern: str, handler: Handler) -> None: ...

    @abstractmethod
    def _put_blob(self, data: Blob) -> str: ...

    @abstractmethod
    def _put_private_blob(self, data: Blob, recipient: str, owner: str) -> str:
        """Store a blob that only device ``recipient`` (and ``owner``, the home that puts it)
        may get; anyone else is answered as for a blob never put. Returns its sha256."""

    @abstractmethod
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
        """Bytes of blob ``sha256`` for the role at home ``requester``, verified against the
        hash (raise CodecError if not). With ``cache`` False a fetched blob is not kept in
        the role's blob store (its caller validates it first, then :meth:`Endpoint.keep_blob`).
        With ``stall_s`` a download that receives nothing for that long gives up (a
        ``timeout``) before ``timeout_s``."""

    def _keep_blob(self, data: Blob, sha256: str) -> None:  # noqa: B027 - optional hook
        """Store a validated blob fetched uncached (no-op where blobs live on the bus)."""

    def _offer_blob(self, sha256: str, kind: str) -> None:  # noqa: B027 - optional hook
        """Blob ``sha256``, put or kept here, is of ``kind``: what a server uses to answer
        each requester only for blobs it has a reason to fetch (no-op in process)."""

    def _release_blob(self, sha256: str) -> None:  # noqa: B027 - optional hook
        """Drop a blob from memory where a disk copy keeps it (no-op on an in-process bus)."""

    def _retire_blob(self, sha256: str) -> None:  # noqa: B027 - optional hook
        """Forget a blob no one will ask for again, its disk copy too (no-op on an
        in-process bus)."""

    def _staging(self, size: int) -> Path | None:
        """Where a blob of ``size`` bytes about to be put is encoded, when not in memory
        (:meth:`BlobStore.staging <shared.transport.blobs.BlobStore.staging>`); in memory
        on an in-process bus."""
        return None

    @abstractmethod
    def call_later(self, delay_s: float, fn: Callable[[], None]) -> Timer:
        """Run ``fn`` on the bus's thread after ``delay_s`` seconds."""

    @abstractmethod
    def now(self) -> float:
        """Seconds on the bus's clock (virtual for MemoryBus)."""

    def endpoint(self, name: str, home: str = "") -> Endpoint:
        """A counted view of this bus for one role instance writing under ``home``."""
        return Endpoint(self, name, home or name)

    def close(self, timeout_s: float = 5.0) -> None:  # noqa: B027 - optional hook
        """Release connections and threads (no-op for in-process buses)."""


@dataclass
class Endpoint:
    """One role's door to the bus: every call is counted by kind in ``bus.traffic``."""

    bus: Bus
    name: str
    home: str

    def publish(self, topic: str, payload: bytes, *, kind: str, retain: bool = False) -> None:
        """Publish ``payload`` on ``topic``; counted as ``sent:kind``."""
        self.bus.traffic.count("sent", kind, len(payload))
        self.bus._publish(topic, payload, retain)

    def subscribe(self, pattern: str, handler: Handler, *, kind: str = "message") -> None:
        """Call ``handler(topic, payload)`` for each matching message; counted as received."""

        def counted(topic: str, payload: bytes) -> None:
            self.bus.traffic.count("received", kind, len(payload))
            handler(topic, payload)

        self.bus._subscribe(pattern, counted)

    def encode_tensors(self, tensors: Mapping[str, torch.Tensor]) -> Blob:
        """:func:`~shared.wire.codec.encode_tensors`, for :meth:`put_blob`: a blob of the
        size the role's store keeps on disk is written straight to a staged file there
        (:func:`~shared.wire.codec.encode_tensors_to_file`), which the store then adopts as
        its disk copy, so the role holds no copy of its bytes in memory."""
        path = self.bus._staging(encoded_size(tensors))
        if path is not None:
            try:
                return encode_tensors_to_file(tensors, path)
            except OSError as err:  # the disk is full or gone: encoded in memory
                log.warning("%s: encoding a blob in memory: %s", self.name, err)
        return encode_tensors(tensors)

    def put_blob(self, data: Blob, *, kind: str, recipient: str | None = None) -> str:
        """Upload a blob once; returns its sha256.

        With ``recipient`` (a device id) the blob is private: it is served to that device
        alone, on its private downlink (:func:`~shared.wire.messages.private_home`, the
        ``src`` of its BlobRef), and never under this role's shared blob path; with
        :data:`~shared.wire.messages.CLOUD_RECIPIENT`, to the cloud alone, under
        :func:`~shared.wire.messages.cloud_only_home` of this role."""
        if len(data) > self.bus.max_blob_bytes:
            raise TransportError(
                f"blob of {len(data)} bytes exceeds {self.bus.max_blob_bytes}",
                reason="blob_too_large",
            )
        if recipient is None:
            sha = self.bus._put_blob(data)
            self.bus._offer_blob(sha, kind)
        elif _RECIPIENT.match(recipient):
            sha = self.bus._put_private_blob(data, recipient, self.home)
        else:
            raise TransportError(f"private blob recipient {recipient[:80]!r} is no device id")
        self.bus._await_fetch(sha, kind, len(data))  # counted as sent when first fetched
        return sha

    def get_blob(
        self,
        sha256: str,
        size: int,
        *,
        kind: str,
        src: str | None = None,
        timeout_s: float = 600.0,
        cache: bool = True,
        stall_s: float | None = None,
    ) -> Blob:
        """Download a blob served by ``src`` and verify its hash and size. With ``cache``
        False a downloaded blob is not stored: the caller validates it and keeps it
        (:meth:`keep_blob`) only if it passes, so nothing refused stays in a cache. With
        ``stall_s`` a download silent for that long gives up early (``timeout``)."""
        if size > self.bus.max_blob_bytes:
            raise TransportError(
                f"blob of {size} bytes exceeds {self.bus.max_blob_bytes}", reason="blob_too_large"
            )
        data = self.bus._get_blob(
            sha256, size, timeout_s, src, self.home, cache=cache, stall_s=stall_s
        )
        # _get_blob returns verified bytes (MemoryBus keys by the hash it computed, MqttBus
        # hashes while receiving, BlobStore re-hashes disk reads); the size is checked here.
        if len(data) != size:
            raise CodecError(
                f"blob {sha256[:12]}… has {len(data)} bytes, expected {size}",
                reason="blob_size_mismatch",
            )
        self.bus.traffic.count("received", kind, len(data))
        return data

    def keep_blob(self, data: Blob, sha256: str, *, kind: str = "") -> None:
        """Keep a blob fetched with ``cache=False`` (and then validated) in the blob store,
        where this role serves it from (as a blob of ``kind``) and finds it again."""
        self.bus._keep_blob(data, sha256)
        self.bus._offer_blob(sha256, kind)

    def release_blob(self, sha256: str) -> None:
        """Free the memory of a blob this role put or kept and expects no one to ask for
        again (the previous round's model): its disk copy, if any, still serves it."""
        self.bus._release_blob(sha256)

    def retire_blob(self, sha256: str) -> None:
        """Forget a blob this role put and no one will ask for again (a device's upload of
        a round that is over), its disk copy too: the file is written over by the next
        blob this role receives or encodes (:meth:`BlobStore.retire
        <shared.transport.blobs.BlobStore.retire>`)."""
        self.bus._retire_blob(sha256)

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> Timer:
        """Schedule ``fn`` on the bus thread."""
        return self.bus.call_later(delay_s, fn)

    def now(self) -> float:
        """The bus clock."""
        return self.bus.now()


@dataclass(order=True)
class HeapTimer(Timer):
    """A timer kept in a heap ordered by (due time, sequence number)."""

    due: float
    seq: int
    fn: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class MemoryBus(Bus):
    """In-process bus with a virtual clock; deterministic delivery order.

    ``store_limit_bytes`` bounds the blob store (oldest blobs are evicted first);
    ``max_queue`` bounds queued deliveries. Handler exceptions propagate when
    ``raise_errors`` is true (simulation, tests) and are logged and counted otherwise.
    There is no ACL in-process, but a private blob is refused, as if never put, to every
    endpoint but its recipient's and its owner's.
    """

    blobs_local = True

    def __init__(
        self,
        *,
        max_blob_bytes: int = 1 << 30,
        store_limit_bytes: int = 4 << 30,
        max_queue: int = 1_000_000,
        raise_errors: bool = True,
        traffic: Traffic | None = None,
    ) -> None:
        self.traffic = traffic or Traffic()
        self.max_blob_bytes = max_blob_bytes
        self.store_limit_bytes = store_limit_bytes
        self.max_queue = max_queue
        self.raise_errors = raise_errors
        self._subs: list[tuple[str, Handler]] = []
        self._retained: dict[str, bytes] = {}
        self._queue: deque[tuple[Handler, str, bytes]] = deque()
        self._blobs: OrderedDict[str, Blob] = OrderedDict()
        self._blob_bytes = 0
        #: private blobs (each lives as long as it is in ``_blobs``): the homes that may get it
        self._readers: dict[str, frozenset[str]] = {}
        self._timers: list[HeapTimer] = []
        self._seq = itertools.count()
        self._clock = 0.0

    def _enqueue(self, handler: Handler, topic: str, payload: bytes) -> None:
        if len(self._queue) >= self.max_queue:
            raise TransportError(f"MemoryBus queue full ({self.max_queue} deliveries)")
        self._queue.append((handler, topic, payload))

    def _publish(self, topic: str, payload: bytes, retain: bool) -> None:
        if retain:
            if payload:
                self._retained[topic] = payload
            else:
                self._retained.pop(topic, None)
        for pattern, handler in self._subs:
            if topic_matches(pattern, topic):
                self._enqueue(handler, topic, payload)

    def _subscribe(self, pattern: str, handler: Handler) -> None:
        self._subs.append((pattern, handler))
        for topic, payload in self._retained.items():
            if topic_matches(pattern, topic):
                self._enqueue(handler, topic, payload)

    def _put_blob(self, data: Blob) -> str:
        digest = self._store(data)
        self._readers.pop(digest, None)  # the same bytes put in the open are no secret
        return digest

    def _put_private_blob(self, data: Blob, recipient: str, owner: str) -> str:
        digest = sha256_hex(data)
        if digest in self._blobs and digest not in self._readers:  # already public
            return self._store(data)
        readers = self._readers.get(digest, frozenset())
        self._store(data)  # the newest blob is never the one evicted
        reader = "cloud" if recipient == CLOUD_RECIPIENT else home_of("device", recipient)
        self._readers[digest] = readers | {reader, owner}
        return digest

    def _store(self, data: Blob) -> str:
        digest = sha256_hex(data)
        if digest in self._blobs:
            self._blobs.move_to_end(digest)
            return digest
        self._blobs[digest] = data
        self._blob_bytes += len(data)
        while self._blob_bytes > self.store_limit_bytes and len(self._blobs) > 1:
            old_digest, old = self._blobs.popitem(last=False)
            self._blob_bytes -= len(old)
            self._readers.pop(old_digest, None)
        return digest

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
        data = self._blobs.get(sha256)
        readers = self._readers.get(sha256)
        if readers is not None and requester not in readers:
            self.traffic.reject("blob_server", "private_blob_other_device")
            log.warning("%s asked for blob %s…, private to %s", requester, sha256[:12],
                        sorted(readers))  # fmt: skip
            data = None  # answered as for a blob never put
        if data is None:
            raise TransportError(f"blob {sha256[:12]}… is not on the bus (evicted or never put)")
        self._fetched(sha256)
        return data

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> Timer:
        timer = HeapTimer(self._clock + max(0.0, delay_s), next(self._seq), fn)
        heapq.heappush(self._timers, timer)
        return timer

    def now(self) -> float:
        return self._clock

    def _fire_next_timer(self) -> bool:
        while self._timers:
            timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._clock = max(self._clock, timer.due)
            self._call(timer.fn)
            return True
        return False

    def run(self, until: Callable[[], bool], *, max_events: int = 10_000_000) -> bool:
        """Deliver messages and fire timers until ``until()`` or nothing is left.

        Returns whether ``until()`` became true; raises TransportError past ``max_events``.
        """
        for _ in range(max_events):
            if until():
                return True
            if self._queue:
                handler, topic, payload = self._queue.popleft()
                self._call(functools.partial(handler, topic, payload))
            elif not self._fire_next_timer():
                return until()
        raise TransportError(f"MemoryBus.run exceeded {max_events} events")
