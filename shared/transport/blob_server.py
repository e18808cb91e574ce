"""The serving side of a blob transfer (:mod:`shared.transport.blob_transfer`):
:class:`BlobServer` answers the chunk requests for the blobs this process holds, within the
limits below."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

from pydantic import ValidationError

from shared.logs import LogLimiter
from shared.transport.blob_transfer import (
    BlobContext,
    chunk_count,
)
from shared.transport.blobs import BlobStore
from shared.wire.codec import Blob
from shared.wire.messages import (
    CLOUD_RECIPIENT,
    MODEL_BLOB_KIND,
    SHARED_BLOB_KIND,
    BlobWant,
    cloud_only_home,
    private_home,
)

# the bus's logger, as for every part of the blob transfer
log = logging.getLogger("shared.transport.mqtt")

MAX_PENDING_CHUNKS: Final = 1 << 18
"""Most chunk indices a blob server keeps queued for sending, over all blobs and requesters
(an entry costs ~100 bytes; a 1 GiB blob in 4 KiB chunks is 2**18 of them). Beyond it the
request's remaining chunks are dropped and counted; the requester asks again for whatever
it still lacks after ``chunk_timeout_s`` of silence."""

MAX_QUEUED_WANTS: Final = 1024
MAX_QUEUED_WANT_BYTES: Final = 16 << 20
"""Blob requests waiting for the I/O worker (count and payload bytes); more are dropped."""

MAX_PRIVATE_BLOBS: Final = 1 << 16
"""Most private blobs a server remembers the recipients of (the newest); an older one is then
served to nobody. A recipient is also forgotten once its blob has left the private store."""

DEVICE_KINDS: Final[dict[str, frozenset[str]]] = {
    "cloud": frozenset({MODEL_BLOB_KIND, SHARED_BLOB_KIND}),  # the current deployment
    "edge": frozenset({"edge_model", "global_model"}),  # the edge's current model
    "device": frozenset(),  # a device's uploads are its edge's and the cloud's
}
"""The kinds of blob a device has a reason to fetch, by the role of the server it asks."""

CURRENT_PER_KIND: Final = 4
"""How many of the newest blobs of each device-fetchable kind a server answers devices for
(a model and its shared part, this round's and the one before)."""

MAX_RECENT_CHUNKS: Final = 1 << 18
"""Most (requester, blob, chunk) sends a server remembers for ``serve_repeat_s`` (the
oldest are forgotten first)."""

MAX_REQUESTERS: Final = 1 << 14
"""Most requesters whose byte budget of the minute a server keeps (the least recent is
forgotten first)."""

BUDGET_WINDOW_S: Final = 60.0
"""The window of ``serve_budget_bytes_per_min``."""


class BlobServer:
    """Serves chunks of the blobs in ``store`` to whoever asks, under ``home``'s topics.

    Requests are admitted in paho's thread (:meth:`admit_want`, bounded by
    ``max_queued_wants`` / ``max_queued_want_bytes``); everything else runs on the bus's I/O
    worker: :meth:`handle_want` queues the chunks asked for (at most ``max_pending_chunks``),
    :meth:`send_next` sends one while fewer than ``max_inflight_bytes`` are unacknowledged,
    :meth:`acked` frees the window. ``on_served(sha256)`` is called for each request of a
    blob held, ``publish`` sends a chunk (or the ``missing`` answer).

    Private blobs (:meth:`put_private`) live in ``private_store`` (by default in memory
    only, within ``memory_limit_bytes``; an MQTT role with a disk cache gives it
    ``<cache>/private``, where large ones are served from disk), apart from ``store``: the
    shared path never finds them there, and a recipient forgotten (restart,
    :data:`MAX_PRIVATE_BLOBS`) leaves its blob served to nobody, never to everybody. A
    request for a private blob on the shared path, or on another device's downlink, gets the
    ``missing`` answer and is counted (``blob_server`` rejections).
    """

    def __init__(
        self,
        ctx: BlobContext,
        *,
        on_served: Callable[[str], None],
        private_store: BlobStore | None = None,
    ) -> None:
        self.ctx = ctx
        self._on_served = on_served
        if private_store is None:
            private_store = BlobStore(None, memory_limit_bytes=ctx.settings.memory_limit_bytes)
        self.private_store = private_store
        self.max_private_blobs = MAX_PRIVATE_BLOBS
        self._recipients: OrderedDict[str, frozenset[str]] = OrderedDict()  # sha -> device ids
        self._private_lock = threading.Lock()  # put_private runs on the role's thread
        self.max_pending_chunks = MAX_PENDING_CHUNKS
        self.max_queued_wants = MAX_QUEUED_WANTS
        self.max_queued_want_bytes = MAX_QUEUED_WANT_BYTES
        self.pending_chunks = 0  # chunk indices queued for sending (I/O worker only)
        self._wants_queued = 0  # admitted requests not yet handled, and their bytes
        self._want_bytes_queued = 0
        self._wants_lock = threading.Lock()
        # I/O worker only: chunks to send per (home served under, sha256, chunk_bytes), and
        # the unacked window
        self._pending: OrderedDict[tuple[str, str, int], OrderedDict[int, None]] = OrderedDict()
        self._inflight: dict[int, int] = {}
        self._inflight_bytes = 0
        role = ctx.home.split("/", 1)[0]
        # a server that is no edge and no device (the cloud, or a tool publishing a
        # deployment) serves devices what the cloud does: the current deployment
        self._device_kinds = DEVICE_KINDS.get(role, DEVICE_KINDS["cloud"])
        #: the newest blobs of each device-fetchable kind (put or kept on the role's thread)
        self._current: dict[str, OrderedDict[str, None]] = {
            k: OrderedDict() for k in self._device_kinds
        }
        self._current_lock = threading.Lock()
        # I/O worker only: when a chunk was last queued for a requester, and each
        # requester's (window start, bytes queued) of the budget's minute
        self._recent: OrderedDict[tuple[str, str, str, int, int], float] = OrderedDict()
        self._spent: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self.max_recent_chunks = MAX_RECENT_CHUNKS
        self.max_requesters = MAX_REQUESTERS
        self._refusals = LogLimiter()
        self.clock: Callable[[], float] = time.monotonic

    # -- the role's thread ----------------------------------------------------------------
    def offer(self, sha256: str, kind: str) -> None:
        """Blob ``sha256`` (put or kept here) is of ``kind``: the newest few of a kind that
        devices fetch from this role are served to devices (:data:`DEVICE_KINDS`)."""
        if kind not in self._device_kinds:
            return
        with self._current_lock:
            newest = self._current[kind]
            newest.pop(sha256, None)
            newest[sha256] = None
            while len(newest) > CURRENT_PER_KIND:
                newest.popitem(last=False)

    def for_devices(self, sha256: str) -> bool:
        """Whether devices have a reason to fetch blob ``sha256`` from this role."""
        with self._current_lock:
            return any(sha256 in newest for newest in self._current.values())

    def put_private(self, data: Blob, device: str) -> str:
        """Keep ``data`` for device ``device`` alone (served on its private downlink only;
        with ``device`` :data:`~shared.wire.messages.CLOUD_RECIPIENT`, for the cloud alone,
        under :func:`~shared.wire.messages.cloud_only_home`); returns its sha256. The same
        bytes may be private to several recipients."""
        sha = self.private_store.put(data)
        with self._private_lock:
            devices = self._recipients.pop(sha, frozenset())
            self._recipients[sha] = devices | {device}
            while len(self._recipients) > self.max_private_blobs:
                self._recipients.popitem(last=False)
        return sha

    def recipients(self, sha256: str) -> frozenset[str]:
        """The devices private blob ``sha256`` is served to (empty: not a private blob)."""
        with self._private_lock:
            return self._recipients.get(sha256, frozenset())

    # -- paho's thread -------------------------------------------------------------------
    def admit_want(self, payload: bytes) -> bool:
        """Reserve room for one more request waiting for the I/O worker; False when full
        (the caller drops it). Every admitted request is handed to :meth:`handle_want`, or
        given back with :meth:`release_want`."""
        with self._wants_lock:
            full = (
                self._wants_queued >= self.max_queued_wants
                or self._want_bytes_queued + len(payload) > self.max_queued_want_bytes
            )
            if not full:
                self._wants_queued += 1
                self._want_bytes_queued += len(payload)
        return not full

    def release_want(self, payload: bytes) -> None:
        """Give back the room :meth:`admit_want` reserved for ``payload``."""
        with self._wants_lock:
            self._wants_queued -= 1
            self._want_bytes_queued -= len(payload)

    # -- the I/O worker ------------------------------------------------------------------
    def handle_want(self, payload: bytes, requester: str, device: str | None = None) -> None:
        """Queue the chunks an admitted request from ``requester`` (the subtree it was
        published under) asks for: on this role's shared path, or with ``device`` on that
        recipient's private path (a device's downlink asked from its own subtree, or
        :data:`~shared.wire.messages.CLOUD_RECIPIENT`'s asked from the cloud's)."""
        self.release_want(payload)
        if device is None:
            self._queue_want(payload, requester)
        else:
            self._queue_private_want(payload, device, requester)

    def acked(self, mid: int) -> None:
        """The broker acknowledged message ``mid``: its bytes leave the window."""
        self._inflight_bytes -= self._inflight.pop(mid, 0)

    def ready(self) -> bool:
        """Whether a chunk is queued and the unacknowledged window has room for it."""
        settings = self.ctx.settings
        return bool(self._pending) and (
            self._inflight_bytes + settings.chunk_bytes <= settings.max_inflight_bytes
        )

    def send_next(self) -> None:
        """Send the next queued chunk, round-robin between the blobs being served."""
        sent = self._send_next_chunk()
        if sent is not None:
            mid, nbytes = sent
            self._inflight[mid] = nbytes
            self._inflight_bytes += nbytes

    def _parse(self, payload: bytes) -> BlobWant | None:
        try:
            return BlobWant.model_validate_json(payload)
        except ValidationError as err:
            self.ctx.traffic.reject("blob_server", "bad_request")
            log.warning("%s: bad blob request: %s", self.ctx.name, err.errors()[0]["msg"])
            return None

    def _refuse(self, sha256: str, reason: str, asker: str) -> None:
        """Count a request refused (``reason``), logging at most a few lines a minute each."""
        self.ctx.traffic.reject("blob_server", reason)
        self._refusals.warn(
            reason,
            f"{self.ctx.name}: refused a request for blob {sha256[:12]}… {asker} ({reason})",
            log,
        )

    def _queue_want(self, payload: bytes, requester: str) -> None:
        want = self._parse(payload)
        if want is None:
            return
        role = requester.split("/", 1)[0]
        if role not in DEVICE_KINDS:  # no role of the run publishes there
            self._refuse(want.sha256, "unknown_requester", f"from {requester[:80]!r}")
            return
        if self.recipients(want.sha256) and self.ctx.store.size(want.sha256) is None:
            self._refuse(want.sha256, "private_blob_public_path",
                         f"on {self.ctx.home}'s shared path by {requester}")  # fmt: skip
        elif (
            role == "device"
            and not self.for_devices(want.sha256)
            and self.ctx.store.size(want.sha256) is not None
        ):
            # held, but not the model of its edge nor the deployment: not answered at all (a
            # "missing" on the shared path would end the fetch of whoever is entitled to it);
            # a blob not held is answered "missing" as always, so a device asking for an
            # earlier run's model gives up at once
            self._refuse(want.sha256, "not_for_requester", f"by {requester}")
            return
        self._queue_chunks(want, self.ctx.store, self.ctx.home, requester)

    def _private_home(self, recipient: str) -> str:
        if recipient == CLOUD_RECIPIENT:
            return cloud_only_home(self.ctx.home)
        return private_home(recipient)

    def _queue_private_want(self, payload: bytes, recipient: str, requester: str) -> None:
        want = self._parse(payload)
        if want is None:
            return
        home = self._private_home(recipient)
        recipients = self.recipients(want.sha256)
        if recipient not in recipients:
            if recipients:
                self._refuse(want.sha256, "private_blob_other_device", f"by {requester}")
            # the missing answer, on the asker's own path
            self._queue_chunks(want, None, home, requester)
            return
        if self.private_store.size(want.sha256) is None:  # evicted: forget its recipients
            with self._private_lock:
                self._recipients.pop(want.sha256, None)
        self._queue_chunks(want, self.private_store, home, requester)

    def _admit_chunks(
        self, want: BlobWant, home: str, requester: str, runs: list[tuple[int, int]], size: int
    ) -> tuple[list[int], int, int]:
        """The chunks of ``runs`` to queue for ``requester``: none sent to it within
        ``serve_repeat_s``, and within its budget of the minute. Returns them with the
        number left out as repeated and as over the budget."""
        settings, now = self.ctx.settings, self.clock()
        start, spent = self._spent.pop(requester, (now, 0))
        if now - start >= BUDGET_WINDOW_S:
            start, spent = now, 0
        recent, window, cb = self._recent, settings.serve_repeat_s, want.chunk_bytes
        admitted: list[int] = []
        repeated = over = 0
        for first, last in runs:
            for i in range(first, last + 1):
                key = (requester, home, want.sha256, cb, i)
                sent = recent.get(key)
                if sent is not None and now - sent < window:
                    repeated += 1
                    continue
                nbytes = max(0, min(cb, size - i * cb))
                if spent + nbytes > settings.serve_budget_bytes_per_min:
                    over += 1
                    continue
                spent += nbytes
                recent.pop(key, None)
                recent[key] = now
                admitted.append(i)
        while len(recent) > self.max_recent_chunks:
            recent.popitem(last=False)
        while recent:  # forget what is past the window (the oldest first)
            oldest = next(iter(recent.items()))
            if now - oldest[1] < window:
                break
            recent.popitem(last=False)
        self._spent[requester] = (start, spent)
        while len(self._spent) > self.max_requesters:
            self._spent.popitem(last=False)
        return admitted, repeated, over

    def _queue_chunks(
        self, want: BlobWant, store: BlobStore | None, home: str, requester: str
    ) -> None:
        """Queue the chunks ``want`` asks for of the blob in ``store``, to send under
        ``home`` (within ``requester``'s repeat window and budget); answer ``missing`` when
        ``store`` (None: nothing here) lacks it."""
        size = None if store is None else store.size(want.sha256)
        if size is None:
            self.ctx.traffic.note("blob_requests_missing")
            self._answer(home, want.sha256, want.chunk_bytes, "missing", b"")
            return
        self._on_served(want.sha256)
        # the chunk count comes from the blob held, never from the requester's claim
        n = chunk_count(size, want.chunk_bytes)
        if want.size != size:
            # Serve no further than both sizes allow: enough for an honest requester with a
            # wrong BlobRef to see a chunk of the wrong length at once and give up.
            n = min(n, chunk_count(want.size, want.chunk_bytes))
            self.ctx.traffic.reject("blob_server", "size_mismatch")
            log.warning(
                "%s: blob request for %s… claims %d bytes, it has %d",
                self.ctx.name,
                want.sha256[:12],
                want.size,
                size,
            )
        runs: list[tuple[int, int]] = []  # clamped to [0, n) and merged: each index once
        for first, last in sorted((max(0, f), min(last, n - 1)) for f, last in want.chunks):
            if first > last:
                continue
            if runs and first <= runs[-1][1] + 1:
                runs[-1] = (runs[-1][0], max(runs[-1][1], last))
            else:
                runs.append((first, last))
        # each requester's repeats and budget first: only what it may have is queued
        indices, repeated, over = self._admit_chunks(want, home, requester, runs, size)
        if repeated:
            self.ctx.traffic.note("chunks_repeated", repeated)
            if not indices and not over:
                self._refuse(want.sha256, "repeated_request", f"by {requester}")
        if over:
            self.ctx.traffic.note("chunks_over_budget", over)
            self._refuse(want.sha256, "over_budget", f"by {requester}")
        key = (home, want.sha256, want.chunk_bytes)
        pending = self._pending
        queued = pending.get(key)
        if queued is None:
            queued = OrderedDict()
        room = self.max_pending_chunks - self.pending_chunks
        dropped = 0
        for k, i in enumerate(indices):
            if i in queued:
                continue
            if room <= 0:
                dropped = len(indices) - k
                for j in indices[k:]:  # not sent: asking again for them is no repeat
                    self._recent.pop((requester, home, want.sha256, want.chunk_bytes, j), None)
                break
            queued[i] = None
            room -= 1
            self.pending_chunks += 1
        if queued:
            pending[key] = queued
        if dropped:
            self.ctx.traffic.reject("blob_server", "serve_queue_full")
            self.ctx.traffic.note("chunks_not_queued", dropped)
        if indices:
            self.ctx.traffic.note("blob_requests_served")

    def _send_next_chunk(self) -> tuple[int, int] | None:
        pending = self._pending
        key, indices = next(iter(pending.items()))
        index, _ = indices.popitem(last=False)
        self.pending_chunks -= 1
        if indices:
            pending.move_to_end(key)  # round-robin between blobs being served
        else:
            del pending[key]
        home, sha, chunk_bytes = key
        store = self.ctx.store if home == self.ctx.home else self.private_store
        data = store.chunk(sha, index, chunk_bytes)
        if data is None:
            self.pending_chunks -= len(pending.pop(key, ()))
            self._answer(home, sha, chunk_bytes, "missing", b"")
            return None
        mid = self._answer(home, sha, chunk_bytes, index, data)
        self.ctx.traffic.note("chunks_sent")
        return mid, len(data)

    def _answer(
        self, home: str, sha256: str, chunk_bytes: int, index: int | str, data: bytes
    ) -> int:
        """Publish chunk ``index`` (or the empty ``missing`` answer) under ``home``: this
        role's, or the private downlink the request came for."""
        return self.ctx.publish(self.ctx.topics.blob_chunk(home, sha256, chunk_bytes, index), data)
