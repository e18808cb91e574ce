"""Atomic file writes (torch-free): a temp file in the same directory, fsync, rename."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory and ``os.replace``."""
    atomic_write_with(path, lambda fh: fh.write(data))


def atomic_write_with(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """:func:`atomic_write` of what ``write`` writes to the file it is given (piece by
    piece: the caller need not hold the whole content in memory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
