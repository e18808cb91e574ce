"""The receiving side of a blob transfer (:mod:`shared.transport.blob_transfer`):
:class:`BlobFetcher` receives blobs from the roles that serve them, resumable, bounded
and verified."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import CodecError, TransportError
from shared.transport.blob_transfer import (
    MISSING_INDEX,
    BlobContext,
    chunk_count,
    index_ranges,
    parse_index,
)
from shared.wire.codec import Blob, MappedBlob
from shared.wire.messages import (
    BlobWant,
    encode,
)
from shared.wire.staged import open_staged

# the bus's logger, as for every part of the blob transfer
log = logging.getLogger("shared.transport.mqtt")


class FileSink:
    """The in-order bytes of a large blob being received, written to a staged file instead
    of memory (:meth:`BlobStore.staging <shared.transport.blobs.BlobStore.staging>`): a
    fetch holds none of them in memory, and its reader gets a
    :class:`~shared.wire.codec.MappedBlob` of the file, whose pages are read in as they
    are used; a store that keeps the blob adopts the file as its disk copy."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # a new file, or a kept one written over (shared.wire.staged); closed by finish or
        # close
        self._fh = os.fdopen(open_staged(path), "r+b")

    def write(self, chunk: bytes) -> None:
        """Append ``chunk``."""
        self._fh.write(chunk)

    def finish(self, sha256: str) -> MappedBlob:
        """The map of everything written, which hashes to ``sha256`` (the file now goes
        with the map: kept to write over or removed when the map is collected, unless a
        store adopted it)."""
        self._fh.truncate()  # the end of a longer blob written there before (flushes)
        try:
            blob = MappedBlob.of_file(self._fh.fileno(), sha256, self.path)
        except BaseException:
            self.close()
            raise
        self._fh.close()
        return blob

    def close(self) -> None:
        """Close and remove the file of a fetch that did not finish (idempotent)."""
        if not self._fh.closed:
            self._fh.close()
            self.path.unlink(missing_ok=True)


def open_sink(ctx: BlobContext, sha256: str, size: int) -> io.BytesIO | FileSink:
    """Where a fetch of ``sha256`` puts its bytes: a staged file for a blob the store
    would spill (memory when the file cannot be made)."""
    path = ctx.store.staging(size)
    if path is not None:
        try:
            return FileSink(path)
        except OSError as err:
            log.warning("%s: receiving blob %s in memory: %s", ctx.name, sha256[:12], err)
    return io.BytesIO()


@dataclass
class Fetch:
    """One blob being received."""

    sha256: str
    src: str
    size: int
    chunk_bytes: int
    n: int
    chunks: queue.Queue[tuple[int, bytes]]
    have: bytearray
    parked: dict[int, bytes] = field(default_factory=dict)  # arrived ahead of order
    received: int = 0
    hashed: int = 0
    hasher: Any = field(default_factory=hashlib.sha256)
    out: io.BytesIO | FileSink = field(default_factory=io.BytesIO)  # in-order, no zero-fill
    done: threading.Event = field(default_factory=threading.Event)
    #: the verified bytes, for fetches of the same blob that waited on this one (set
    #: before ``done``; the fetch of an uncached blob leaves no copy in the store)
    result: Blob | None = None

    def received_bytes(self) -> Blob:
        """Everything received, in order (verified as :attr:`sha256`): bytes, or the map of
        the file it went to."""
        if isinstance(self.out, FileSink):
            return self.out.finish(self.sha256)
        data = self.out.getvalue()  # sequential writes: CPython hands over its buffer
        self.out = io.BytesIO()
        return data

    def close(self) -> None:
        """Let go of what was received (a file is removed; its map, if made, lives on)."""
        if isinstance(self.out, FileSink):
            self.out.close()

    def expected_len(self, index: int) -> int:
        start = index * self.chunk_bytes
        return max(0, min(self.chunk_bytes, self.size - start))

    def missing(self) -> list[int]:
        return [i for i in range(self.n) if not self.have[i]]


class BlobFetcher:
    """Fetches blobs into ``store`` from the roles that serve them: resumable (what is still
    missing after ``chunk_timeout_s`` of silence is asked for again), bounded (at most
    ``max_fetch_bytes`` being received at once, each fetch within ``fetch_timeout_s``) and
    verified (the bytes must hash to the sha256 asked for).

    ``publish`` sends a request, ``subscribe`` subscribes to a chunk topic and waits for the
    broker's acknowledgement, ``unsubscribe`` drops it; a fetch gives up when ``closing``
    is set. Chunks reach a fetch through :meth:`route_chunk`, from paho's thread.
    """

    def __init__(
        self,
        ctx: BlobContext,
        *,
        subscribe: Callable[[str], None],
        unsubscribe: Callable[[str], object],
        closing: threading.Event,
    ) -> None:
        self.ctx = ctx
        self._subscribe = subscribe
        self._unsubscribe = unsubscribe
        self._closing = closing
        self._fetches: dict[str, Fetch] = {}
        self._fetch_lock = threading.Lock()
        self._fetch_bytes = 0

    def chunk_patterns(self) -> list[str]:
        """The chunk topics of the fetches under way (subscribed again after a reconnect)."""
        return [self._chunk_pattern(f) for f in list(self._fetches.values())]

    def route_chunk(self, topic: str, payload: bytes) -> None:
        """Hand a chunk to the fetch waiting for it (paho's thread: never blocks)."""
        parts = topic.rsplit("/", 4)  # [..., "blob", sha, chunk_bytes, index]
        if len(parts) != 5 or parts[1] != "blob":
            self.ctx.traffic.note("chunks_unsolicited")
            return
        fetch = self._fetches.get(parts[2])
        if fetch is None or parts[3] != str(fetch.chunk_bytes):
            self.ctx.traffic.note("chunks_unsolicited")
            return
        if len(payload) > fetch.chunk_bytes:  # never queue more than a chunk's worth
            self.ctx.traffic.note("chunks_invalid")
            return
        try:
            fetch.chunks.put_nowait((parse_index(parts[4]), payload))
        except queue.Full:
            self.ctx.traffic.note("chunks_dropped")

    def _chunk_pattern(self, f: Fetch) -> str:
        return self.ctx.topics.blob_chunk(f.src, f.sha256, f.chunk_bytes, "+")

    def get(
        self,
        sha256: str,
        size: int,
        timeout_s: float,
        src: str | None,
        *,
        cache: bool = True,
        stall_s: float | None = None,
    ) -> Blob:
        """Bytes of blob ``sha256`` from the store, else fetched from ``src`` and stored
        (with ``cache`` False not stored: the caller validates it first and stores it only
        if it passes, so a refused blob stays in no cache).

        Raises TransportError when it cannot be had in time or within limits, CodecError
        when what arrives is not the blob asked for. With ``stall_s`` a fetch that
        receives no chunk for that long gives up (``timeout``) before ``timeout_s``.
        A blob the store would keep on disk is received into a file and returned as a
        private map of it (:func:`open_sink`)."""
        data = self.ctx.store.get(sha256)
        if data is not None:
            self.ctx.traffic.note("blob_cache_hits")
            return data
        if src is None or src == self.ctx.home:
            raise TransportError(f"blob {sha256[:12]}… is not here and names no source")
        deadline = time.monotonic() + min(timeout_s, self.ctx.settings.fetch_timeout_s)
        with self._fetch_lock:
            existing = self._fetches.get(sha256)
        if existing is not None:  # someone on another thread is already fetching it
            existing.done.wait(max(0.0, deadline - time.monotonic()))
            data = existing.result if existing.result is not None else self.ctx.store.get(sha256)
            if data is None:
                raise TransportError(f"blob {sha256[:12]}… could not be fetched", reason="timeout")
            return data
        fetch = self._start_fetch(sha256, size, src)
        try:
            self._receive(fetch, deadline, stall_s)
            if fetch.hasher.hexdigest() != sha256:
                raise CodecError(
                    f"blob {sha256[:12]}… from {src}: received bytes hash to "
                    f"{fetch.hasher.hexdigest()[:12]}…",
                    reason="blob_hash_mismatch",
                )
            data = fetch.received_bytes()
            if cache:
                self.ctx.store.put(data, sha256)
            fetch.result = data
        finally:
            with self._fetch_lock:
                self._fetches.pop(sha256, None)
                self._fetch_bytes -= size
            fetch.close()
            self._unsubscribe(self._chunk_pattern(fetch))
            fetch.done.set()
        self.ctx.traffic.note("blobs_fetched")
        return data

    def _start_fetch(self, sha256: str, size: int, src: str) -> Fetch:
        cs = self.ctx.settings.chunk_bytes
        n = chunk_count(size, cs)
        with self._fetch_lock:
            if self._fetch_bytes + size > self.ctx.settings.max_fetch_bytes:
                raise TransportError(
                    f"fetching {size} more bytes would exceed max_fetch_bytes "
                    f"({self.ctx.settings.max_fetch_bytes})",
                    reason="blob_too_large",
                )
            chunks: queue.Queue[tuple[int, bytes]]
            chunks = queue.Queue(maxsize=max(64, 4 * self.ctx.settings.max_inflight_bytes // cs))
            fetch = Fetch(sha256, src, size, cs, n, chunks, bytearray(n))
            self._fetches[sha256] = fetch
            self._fetch_bytes += size
        try:
            fetch.out = open_sink(self.ctx, sha256, size)
        except BaseException:
            with self._fetch_lock:
                self._fetches.pop(sha256, None)
                self._fetch_bytes -= size
            raise
        self._subscribe(self._chunk_pattern(fetch))
        return fetch

    def _ask(self, fetch: Fetch, indices: list[int]) -> None:
        runs = index_ranges(indices)
        for k in range(0, len(runs), 4096):
            want = BlobWant(
                sha256=fetch.sha256,
                size=fetch.size,
                chunk_bytes=fetch.chunk_bytes,
                chunks=runs[k : k + 4096],
            )
            self.ctx.publish(self.ctx.topics.blob_want(self.ctx.home, fetch.src), encode(want))

    def _receive(self, fetch: Fetch, deadline: float, stall_s: float | None = None) -> None:
        self._ask(fetch, list(range(fetch.n)))
        silence = self.ctx.settings.chunk_timeout_s
        heard = time.monotonic()
        while fetch.received < fetch.n:
            now = time.monotonic()
            if stall_s is not None and now - heard >= stall_s:
                raise TransportError(
                    f"blob {fetch.sha256[:12]}… from {fetch.src}: nothing for {stall_s:.0f} s "
                    f"({fetch.received}/{fetch.n} chunks)",
                    reason="timeout",
                )
            left = deadline - now
            if stall_s is not None:
                left = min(left, heard + stall_s - now)
            if left <= 0 or self._closing.is_set():
                raise TransportError(
                    f"blob {fetch.sha256[:12]}… from {fetch.src}: {fetch.received}/{fetch.n} "
                    "chunks before the fetch timeout",
                    reason="timeout",
                )
            try:
                index, payload = fetch.chunks.get(timeout=min(silence, left))
            except queue.Empty:
                missing = fetch.missing()
                self.ctx.traffic.note("chunks_rerequested", len(missing))
                log.info("%s: re-asking %s for %d chunks", self.ctx.name, fetch.src, len(missing))
                self._ask(fetch, missing)
                continue
            if index == MISSING_INDEX:
                raise TransportError(f"{fetch.src} does not have blob {fetch.sha256[:12]}…")
            if not 0 <= index < fetch.n or len(payload) != fetch.expected_len(index):
                # the sender's blob is not the advertised size: no point waiting for more
                self.ctx.traffic.note("chunks_invalid")
                raise CodecError(
                    f"blob {fetch.sha256[:12]}… from {fetch.src}: chunk {index} has {len(payload)} "
                    f"bytes, expected {fetch.expected_len(index) if 0 <= index < fetch.n else 0}",
                    reason="blob_size_mismatch",
                )
            if fetch.have[index]:
                self.ctx.traffic.note("chunks_duplicate")
                continue
            heard = time.monotonic()
            fetch.have[index] = 1
            fetch.received += 1
            fetch.parked[index] = payload
            while fetch.hashed in fetch.parked:  # hash and append in order as chunks arrive
                chunk = fetch.parked.pop(fetch.hashed)
                fetch.hasher.update(chunk)
                try:
                    fetch.out.write(chunk)
                except OSError as err:  # the disk is full or gone: this fetch cannot finish
                    raise TransportError(
                        f"blob {fetch.sha256[:12]}… from {fetch.src}: cannot keep what "
                        f"arrives: {err}",
                        reason="blob_unavailable",
                    ) from None
                fetch.hashed += 1
