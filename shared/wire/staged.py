"""Staged files: the files a large blob is written to while it is received or encoded
(:meth:`BlobStore.staging <shared.transport.blobs.BlobStore.staging>`), kept once the blob
read from one is gone and handed out again, so that the next blob is written over pages the
page cache already holds.

A staged file that no store adopts as its disk copy (a model a device loads, an update an
edge folds into its sum) lives as long as its :class:`~shared.wire.codec.MappedBlob`. Removing
it then and writing the next blob to a new file takes fresh pages for the page cache every
round, and on a virtual machine whose host takes free pages back (free page reporting, a
balloon) a fresh page is dear: while a federation ran, the kernel's copy of 136 MiB into a
new file cost 0.03 to 0.31 s of CPU, against a steady 0.014 s over a file whose pages were
still cached (``benchmarks/round_phases.py``, docs/results.md). So a finished file is kept
in its folder, at most :data:`MAX_KEPT_FILES` of them and :data:`MAX_KEPT_BYTES` together
per folder (beyond that it is removed), and :meth:`StagedFiles.take` hands out the one kept
last. A writer opens a staged path with :func:`open_staged` (it may hold an earlier blob's
bytes) and truncates the file to what it wrote.

Nothing reads a staged file but the map it was written for, and that map is being collected
when its file is given back, so no reader ever sees a kept file change. A kept file is named
like any staged file (by the process that made it): a later process's store removes it once
that process has gone.
"""

from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path
from typing import Final

MAX_KEPT_FILES: Final = 4
"""Most finished staged files a folder keeps to write over."""

MAX_KEPT_BYTES: Final = 1 << 30
"""Most bytes of finished staged files a folder keeps (beyond it they are removed)."""

_FOLDERS: weakref.WeakValueDictionary[Path, StagedFiles] = weakref.WeakValueDictionary()
_FOLDERS_LOCK = threading.Lock()


class StagedFiles:
    """The finished staged files kept in ``folder``, newest last (thread-safe: files are
    given back from a map's finalizer, on whatever thread collects it)."""

    def __init__(
        self, folder: Path, *, max_files: int = MAX_KEPT_FILES, max_bytes: int = MAX_KEPT_BYTES
    ) -> None:
        self.folder = folder
        self.max_files = max_files
        self.max_bytes = max_bytes
        self._kept: list[tuple[Path, int]] = []
        self._lock = threading.RLock()  # a finalizer may run while this thread holds it

    @classmethod
    def of(cls, folder: Path) -> StagedFiles:
        """The kept files of ``folder`` (one object per folder in a process, shared by every
        store there); the caller holds on to it for as long as files should be kept."""
        with _FOLDERS_LOCK:
            staged = _FOLDERS.get(folder)
            if staged is None:
                staged = cls(folder)
                _FOLDERS[folder] = staged
            return staged

    @property
    def kept_bytes(self) -> int:
        """Bytes of the files kept now."""
        with self._lock:
            return sum(size for _, size in self._kept)

    def take(self) -> Path | None:
        """A kept file to write the next blob over (the one kept last: its pages are the
        likeliest still cached), or None when none is kept."""
        with self._lock:
            return self._kept.pop()[0] if self._kept else None

    def give_back(self, path: Path) -> None:
        """The blob read from staged file ``path`` is gone: keep the file to write over, or
        remove it when the folder keeps enough already. A path that no longer names a file
        (a store adopted it, renaming it) is ignored."""
        try:
            size = os.stat(path, follow_symlinks=False).st_size
        except OSError:
            return
        with self._lock:
            kept = sum(s for _, s in self._kept)
            if len(self._kept) < self.max_files and kept + size <= self.max_bytes:
                self._kept.append((path, size))
                return
        remove_quietly(path)


def finished(path: Path) -> None:
    """The blob read from staged file ``path`` is gone (its map's finalizer): the file is
    kept by its folder's :class:`StagedFiles` when a store there keeps them, else removed."""
    with _FOLDERS_LOCK:
        staged = _FOLDERS.get(path.parent)
    if staged is None:
        remove_quietly(path)
    else:
        staged.give_back(path)


def open_staged(path: Path) -> int:
    """A descriptor to write a blob into staged file ``path`` from its start: a new file, or
    a kept one whose bytes the writer writes over and then truncates to its own length."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def remove_quietly(path: Path) -> None:
    """Remove ``path`` if it is there (a file already gone, or one that cannot be removed,
    is left to the next sweep of the folder)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass
