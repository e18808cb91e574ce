"""Content-addressed blob store: a bounded in-memory LRU in front of an optional disk cache.

Blobs are keyed by their sha256. ``put`` keeps the bytes in memory and, when a directory is
configured, writes them atomically to ``<dir>/<sha[:2]>/<sha>`` on a writer thread (a role
serves a blob from memory while its disk copy is written; at most
:data:`MAX_PENDING_WRITE_BYTES` wait to be written, beyond that ``put`` writes itself);
``get`` reads memory first, then disk, and verifies the hash of anything read back from
disk (a corrupt cache file is deleted, never served). Both tiers evict least-recently-used
blobs above their byte limits. A blob of at least ``spill_bytes`` leaves memory once its
disk copy is written: its chunks are then read from that file, range by range (a role does
not hold a second copy of a model it serves; the file is verified again whenever it changed
since this store wrote or verified it). Such a blob need not pass through memory at all: a
fetch or an encoder writes it to a staged file (:meth:`BlobStore.staging`) and hands on a
:class:`~shared.wire.codec.MappedBlob`, which ``put`` adopts as the disk copy by renaming the
file, and ``get`` returns a spilled blob mapped from its file, not read whole.
Thread-safe: the bus's I/O thread serves chunks while a role thread stores new blobs.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import mmap
import os
import stat
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path

from shared.wire.codec import Blob, MappedBlob, sha256_hex
from shared.wire.staged import StagedFiles, remove_quietly

log = logging.getLogger(__name__)

#: bytes of blobs put but not yet on disk; a put beyond this writes its copy itself
MAX_PENDING_WRITE_BYTES = 1 << 30
#: blobs at least this large are served from their disk copy once it is written
SPILL_BYTES = 16 << 20
#: disk copies whose identity (inode, size, mtime) this store remembers as verified
MAX_TRUSTED_FILES = 4096
#: bytes read at a time when a disk copy is verified
VERIFY_BLOCK_BYTES = 8 << 20
#: where blobs being received or encoded are written, under the store's directory
STAGING_DIR = ".staging"
_STAGED = itertools.count()


class BlobStore:
    """Blobs by sha256: memory LRU (``memory_limit_bytes``) plus disk (``disk_limit_bytes``)."""

    def __init__(
        self,
        directory: Path | None = None,
        *,
        memory_limit_bytes: int = 2 << 30,
        disk_limit_bytes: int = 8 << 30,
        spill_bytes: int | None = SPILL_BYTES,
        staged_with: BlobStore | None = None,
    ) -> None:
        self.directory = directory
        self.memory_limit_bytes = memory_limit_bytes
        self.disk_limit_bytes = disk_limit_bytes
        #: blobs this large leave memory once on disk (None: never; no effect without disk)
        self.spill_bytes = spill_bytes if directory is not None else None
        #: sha256 -> (inode, size, mtime_ns) of a disk copy written or verified here
        self._trusted: OrderedDict[str, tuple[int, int, int]] = OrderedDict()
        self._mem: OrderedDict[str, Blob] = OrderedDict()
        self._mem_bytes = 0
        self._lock = threading.RLock()
        #: blobs whose disk copy the writer thread has yet to write, by sha256
        self._pending: OrderedDict[str, Blob] = OrderedDict()
        self._pending_bytes = 0
        self._wake = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        #: finished staged files kept to write the next blobs over (None without a disk)
        self._staged: StagedFiles | None = None
        #: maps of disk copies handed out (:meth:`get`), alive while someone reads them
        self._maps: weakref.WeakSet[MappedBlob] = weakref.WeakSet()
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            _sweep_staging(directory / STAGING_DIR)
            # the staged files of ``staged_with`` (a store on the same file system whose
            # blobs are staged for this one too, as a role's private blobs are) or its own
            if staged_with is not None and staged_with._staged is not None:
                self._staged = staged_with._staged
            else:
                self._staged = StagedFiles.of(directory / STAGING_DIR)

    def _path(self, sha256: str) -> Path | None:
        """Where the blob's disk copy lives, or None without a disk cache."""
        if self.directory is None:
            return None
        return self.directory / sha256[:2] / sha256

    def put(self, data: Blob, sha256: str | None = None) -> str:
        """Store ``data`` (hashing it unless the verified ``sha256`` is given); returns the hash.

        A mapped blob (:meth:`receiving`) is held as its map, not copied: its disk copy is
        written from the map, and then it leaves the store's memory as any spilled blob."""
        if isinstance(data, MappedBlob):
            digest = data.sha256
            if sha256 is not None and sha256 != digest:
                raise ValueError(f"blob {digest[:12]}… put as {sha256[:12]}…")
            if self._adopt(data):
                return digest
        else:
            digest = sha256 or sha256_hex(data)
        if not isinstance(data, (bytes, mmap.mmap)):
            data = bytes(data)  # a caller's bytearray or memoryview could still change
        with self._lock:
            self._remember(digest, data)
        path = self._path(digest)
        if path is None or digest in self._pending or path.exists():
            return digest
        with self._lock:
            queued = self._pending_bytes + len(data) <= MAX_PENDING_WRITE_BYTES
            if queued:
                self._pending[digest] = data
                self._pending_bytes += len(data)
                self._start_writer()
                self._wake.notify()
        if not queued and self._write(path, data):
            self._drop_spilled(digest, len(data))
        return digest

    def _adopt(self, blob: MappedBlob) -> bool:
        """Make a mapped blob's file the disk copy by renaming it (no second copy written,
        none held in memory); whether this store now has it on disk. Not for a blob below
        the spilled size (kept in memory as any other) or one already on disk here."""
        path = self._path(blob.sha256)
        if path is None or not self._spills(len(blob)):
            return False
        if path.exists():  # a copy is here already: the staged file goes with the map
            return False
        if blob.path is None:
            return self._link(blob, path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(blob.path, path)
        except OSError as err:  # another file system, gone: written from the map instead
            log.warning("cannot adopt blob %s: %s", blob.sha256[:12], err)
            return False
        blob.path = None
        with self._lock:
            self._maps.add(blob)  # its reader's map: not retired into a staged file in use
        self._trust(blob.sha256, path)
        self._evict_disk()
        return path.is_file()

    def _link(self, blob: MappedBlob, path: Path) -> bool:
        """Make another store's disk copy that ``blob`` maps (its ``origin``) this store's
        too, by a hard link (no second copy written); whether this store now has it."""
        if blob.origin is None:
            return False
        origin, identity = blob.origin
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.link(origin, path)
            st = path.stat()
        except OSError:  # another file system, gone: written from the map instead
            return False
        if (st.st_ino, st.st_size, st.st_mtime_ns) != identity:
            path.unlink(missing_ok=True)  # not the file mapped any more
            return False
        self._trust_identity(blob.sha256, st)  # the bytes its store verified
        self._evict_disk()
        return path.is_file()

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every blob put so far is on disk; whether that happened in time."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(min(left, 0.5))
        return True

    def _start_writer(self) -> None:
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_loop, name="blob-writer",
                                            daemon=True)  # fmt: skip
            self._writer.start()

    def _write_loop(self) -> None:
        """Write pending disk copies, oldest first; ends when none is left."""
        while True:
            with self._lock:
                if not self._pending:
                    self._writer = None
                    self._wake.notify_all()
                    return
                digest, data = next(iter(self._pending.items()))
            path = self._path(digest)
            written = path is not None and not path.exists() and self._write(path, data)
            with self._lock:
                self._pending.pop(digest, None)
                self._pending_bytes -= len(data)
                if written:
                    self._drop_spilled(digest, len(data))
                self._wake.notify_all()

    def get(self, sha256: str) -> Blob | None:
        """The blob's bytes, or None when neither tier holds a valid copy."""
        with self._lock:
            data = self._mem.get(sha256)
            if data is not None:
                self._mem.move_to_end(sha256)
                return data
            data = self._pending.get(sha256)
            if data is not None:  # evicted from memory before its disk copy was written
                self._remember(sha256, data)
                return data
        path = self._path(sha256)
        if path is None:
            return None
        if self.spill_bytes is not None:  # a spilled blob comes back mapped, not read whole
            mapped = self._map_spilled(sha256)
            if mapped is not None:
                try:
                    os.utime(path)  # LRU on disk follows access time we set ourselves
                except OSError:
                    pass
                self._trust(sha256, path)  # its new time is ours
                with self._lock:
                    known = self._trusted.get(sha256)
                if known is not None:  # another store here links it (_link)
                    mapped.origin = (path, known)
                return mapped
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:  # unreadable (permissions, a directory in its place, I/O)
            log.warning("cannot read cached blob %s: %s", sha256[:12], err)
            return None
        if sha256_hex(data) != sha256:
            log.warning("blob cache file %s is corrupt; deleting it", path)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # LRU on disk follows access time we set ourselves
        except OSError:
            pass  # evicted (or replaced) since we read it: the verified bytes are still good
        with self._lock:
            if self._spills(len(data)):
                self._trust(sha256, path)  # the caller holds these bytes; chunks read the file
            else:
                self._remember(sha256, data)
        return data

    def has(self, sha256: str) -> bool:
        """Whether the blob is in memory or on disk (not verified)."""
        with self._lock:
            if sha256 in self._mem or sha256 in self._pending:
                return True
        path = self._path(sha256)
        return path is not None and path.is_file()

    def size(self, sha256: str) -> int | None:
        """Length in bytes of the blob held in memory or on disk (not verified), else None."""
        with self._lock:
            data = self._mem.get(sha256) or self._pending.get(sha256)
            if data is not None:
                return len(data)
        path = self._path(sha256)
        if path is None:
            return None
        try:
            st = path.stat()
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def chunk(self, sha256: str, index: int, chunk_bytes: int) -> bytes | None:
        """Bytes of chunk ``index`` (``chunk_bytes`` per chunk), or None if the blob is gone."""
        start = index * chunk_bytes
        with self._lock:
            data = self._mem.get(sha256)
            if data is None:
                data = self._pending.get(sha256)
            else:
                self._mem.move_to_end(sha256)
        if data is None and self.spill_bytes is not None:
            part = self._read_range(sha256, start, chunk_bytes)
            if part is not None:
                return part
        if data is None:
            data = self.get(sha256)
        if data is None:
            return None
        return data[start : start + chunk_bytes] if start < max(1, len(data)) else None

    def staging(self, size: int) -> Path | None:
        """A new file name for a blob of ``size`` bytes that is being received or encoded
        (:class:`~shared.wire.codec.MappedBlob`), or None to build it in memory: a blob of
        a spilled size when this store has a disk cache. The file lies beside the disk
        copies (so :meth:`put` adopts it by renaming it), where eviction never looks, and
        is named by this process, whose files a later store removes once it has gone. It
        may be a file kept from a finished blob (:mod:`shared.wire.staged`), whose pages
        the page cache still holds: the writer writes over it and truncates it."""
        if self.directory is None or self._staged is None or not self._spills(size):
            return None
        kept = self._staged.take()
        if kept is not None:
            return kept
        return self._staged_name()

    def _staged_name(self) -> Path | None:
        """A new name in the staging folder (made if need be), or None when it cannot be."""
        assert self._staged is not None
        folder = self._staged.folder
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            log.warning("cannot stage a blob on disk: %s", err)
            return None
        return folder / f"{os.getpid()}.{next(_STAGED)}.part"

    def retire(self, sha256: str) -> bool:
        """Forget a blob no one will ask for again (a device's upload of a round that is
        over): out of memory, and its disk copy's file kept among the staged files to write
        the next blob over (:mod:`shared.wire.staged`), or removed while a map of it is in
        use, linked by another store or smaller than a spilled blob. A chunk read from the
        file as it goes is never served (:meth:`_read_range`); an asker gets the
        ``missing`` answer. Whether a disk copy went."""
        path = self._path(sha256)
        with self._lock:
            if sha256 in self._pending:
                return False  # its disk copy is still to be written: left as it is
            data = self._mem.pop(sha256, None)
            if data is not None:
                self._mem_bytes -= len(data)
            self._trusted.pop(sha256, None)
        if path is None or self._staged is None:
            return False
        target = self._staged_name()
        if target is None:
            return False
        with self._lock:  # no map of it is made as it goes (_map_spilled)
            try:
                os.replace(path, target)
            except OSError:  # not on disk (never written, evicted)
                return False
            in_use = any(m.sha256 == sha256 and not m.closed for m in list(self._maps))
        try:
            st = os.stat(target)
        except OSError:  # gone already (a sweep)
            return True
        if in_use or st.st_nlink > 1 or not self._spills(st.st_size):
            # read through a map, another store's copy of the same file, or too small to
            # be worth keeping (blobs that small are built in memory)
            remove_quietly(target)
        else:
            self._staged.give_back(target)
        return True

    def _spills(self, size: int) -> bool:
        return self.spill_bytes is not None and size >= self.spill_bytes

    def _drop_spilled(self, digest: str, size: int) -> None:
        """A blob of a spilled size whose disk copy was just written leaves memory: its
        chunks are read from the file from now on."""
        if self._spills(size):
            with self._lock:
                if digest in self._mem:
                    self._mem_bytes -= len(self._mem.pop(digest))

    def _trust(self, sha256: str, path: Path) -> None:
        """Remember ``path`` (holding ``sha256``'s verified bytes) by its identity now."""
        try:
            st = path.stat()
        except OSError:
            return
        self._trust_identity(sha256, st)

    def _trust_identity(self, sha256: str, st: os.stat_result) -> None:
        with self._lock:
            self._trusted[sha256] = (st.st_ino, st.st_size, st.st_mtime_ns)
            self._trusted.move_to_end(sha256)
            while len(self._trusted) > MAX_TRUSTED_FILES:
                self._trusted.popitem(last=False)

    def _read_range(self, sha256: str, start: int, length: int) -> bytes | None:
        """``length`` bytes at ``start`` of a spilled blob's disk copy, or None (not on disk,
        not a spilled size, or failing verification: then deleted)."""
        opened = self._open_spilled(sha256)
        if opened is None:
            return None
        fd, st = opened
        size = st.st_size
        try:
            if start >= max(1, size):
                return None
            part = os.pread(fd, min(length, size - start), start)
            # a file retired while it was read may be being written over: a write changes
            # its time before its bytes, so bytes read before the same time are the blob's
            after = os.fstat(fd)
            if (after.st_mtime_ns, after.st_size) != (st.st_mtime_ns, st.st_size):
                return None
            return part
        except OSError as err:
            log.warning("cannot read cached blob %s: %s", sha256[:12], err)
            return None
        finally:
            os.close(fd)

    def _map_spilled(self, sha256: str) -> MappedBlob | None:
        """A spilled blob's disk copy, mapped (:meth:`_open_spilled`), or None."""
        opened = self._open_spilled(sha256)
        if opened is None:
            return None
        fd, st = opened
        try:
            if not st.st_size:
                return None
            blob = MappedBlob.of_file(fd, sha256)
            path = self._path(sha256)
            with self._lock:  # retire() moves files under this lock
                if path is None or _inode(path) != st.st_ino:  # retired as it was mapped
                    blob.close()
                    return None
                self._maps.add(blob)  # not retired into a staged file while in use
            return blob
        except OSError as err:
            log.warning("cannot map cached blob %s: %s", sha256[:12], err)
            return None
        finally:
            os.close(fd)

    def _open_spilled(self, sha256: str) -> tuple[int, os.stat_result] | None:
        """An open descriptor and the status of a spilled blob's disk copy, or None (not on
        disk, not a spilled size, or failing verification: then deleted). The file is
        hashed again whenever its identity is not the one this store wrote or verified."""
        path = self._path(sha256)
        if path is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not self._spills(st.st_size):
                os.close(fd)
                return None
            with self._lock:
                known = self._trusted.get(sha256)
            if known != (st.st_ino, st.st_size, st.st_mtime_ns):
                if not _file_hashes_to(fd, st.st_size, sha256):
                    log.warning("blob cache file %s is corrupt; deleting it", path)
                    path.unlink(missing_ok=True)
                    os.close(fd)
                    return None
                self._trust_identity(sha256, st)
            return fd, st
        except OSError as err:
            log.warning("cannot read cached blob %s: %s", sha256[:12], err)
            os.close(fd)
            return None

    def release(self, sha256: str) -> bool:
        """Drop the blob from memory where a disk copy keeps it (written, or queued to be):
        a blob no one is expected to ask for again, read back from disk if someone does.
        Whether it was dropped (never without a disk copy)."""
        path = self._path(sha256)
        with self._lock:
            if sha256 not in self._mem or path is None:
                return False
            if sha256 not in self._pending and not path.is_file():
                return False
            self._mem_bytes -= len(self._mem.pop(sha256))
        return True

    def _remember(self, digest: str, data: Blob) -> None:
        if digest in self._mem:
            self._mem.move_to_end(digest)
            return
        self._mem[digest] = data
        self._mem_bytes += len(data)
        while self._mem_bytes > self.memory_limit_bytes and len(self._mem) > 1:
            _, old = self._mem.popitem(last=False)
            self._mem_bytes -= len(old)

    def _write(self, path: Path, data: Blob) -> bool:
        """Write a blob's disk copy to ``path`` atomically, then evict the oldest copies;
        whether it was written."""
        digest = path.name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{digest}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with tmp.open("wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
            if isinstance(data, MappedBlob):  # what writing it read in goes back to its file
                data.drop_pages()
        except OSError as err:
            tmp.unlink(missing_ok=True)
            log.warning("cannot cache blob %s on disk: %s", digest[:12], err)
            return False
        self._trust(digest, path)
        self._evict_disk()
        return path.is_file()

    def _evict_disk(self) -> None:
        if self.directory is None:  # memory only: no disk copies to evict
            return
        sizes: dict[Path, os.stat_result] = {}
        for p in self.directory.glob("??/*"):
            if p.name.startswith("."):
                continue
            try:  # another process sharing the cache may remove files under our feet
                st = p.stat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                sizes[p] = st
        total = sum(st.st_size for st in sizes.values())
        for p in sorted(sizes, key=lambda q: sizes[q].st_mtime):
            if total <= self.disk_limit_bytes:
                break
            total -= sizes[p].st_size
            p.unlink(missing_ok=True)


def _inode(path: Path) -> int | None:
    """The inode ``path`` names, or None when it names nothing."""
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _file_hashes_to(fd: int, size: int, sha256: str) -> bool:
    """Whether the ``size`` bytes of open file ``fd`` hash to ``sha256`` (read in blocks of
    :data:`VERIFY_BLOCK_BYTES`)."""
    h = hashlib.sha256()
    at = 0
    while at < size:
        block = os.pread(fd, min(VERIFY_BLOCK_BYTES, size - at), at)
        if not block:
            return False
        h.update(block)
        at += len(block)
    return h.hexdigest() == sha256


def _sweep_staging(folder: Path) -> None:
    """Remove staged files (:meth:`BlobStore.staging`) whose process has gone."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        pid = name.split(".", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            (folder / name).unlink()
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's process: alive
        return True
    return True
