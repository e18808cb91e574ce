"""Output paths checked before any work starts.

A command that trains for minutes and then fails to write its result has wasted those
minutes; so every ``--out`` is checked first, by trying what the command will do (create
the folder's missing parents, write a file there), and an unusable one is one sentence that
names the path, says what is wrong and how to fix it. Nothing is left behind by the check:
folders it had to create for the probe are removed again.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from shared.errors import ConfigError

#: what to do about each errno a probe can meet
_FIXES: dict[int, str] = {
    errno.EACCES: "no permission to write there; choose a folder you own",
    errno.EPERM: "no permission to write there; choose a folder you own",
    errno.EROFS: "it is on a read-only file system; choose a writable folder",
    errno.ENOSPC: "the disk is full; free space or choose another disk",
    errno.EDQUOT: "the disk quota is exhausted; free space or choose another disk",
    errno.ENOTDIR: "a part of the path is a file, not a folder; choose another path",
    errno.ENAMETOOLONG: "the name is too long; choose a shorter path",
}


def describe_os_error(err: OSError) -> str:
    """One sentence for an OS error: the path, what is wrong, and the fix where one is known."""
    what = err.strerror or str(err) or type(err).__name__
    fix = _FIXES.get(err.errno or 0)
    text = f"{err.filename}: {what}" if err.filename is not None else what
    return text + (f" ({fix})" if fix else "")


def _nearest_existing(path: Path) -> Path:
    p = path
    while not os.path.exists(p) and p != p.parent:  # False, not an error, where unreadable
        p = p.parent
    return p


def _probe(folder: Path, flag: str, target: Path) -> None:
    """Create ``folder`` (and its missing parents), write and delete a file in it, then
    remove the folders the probe created; raise ConfigError naming ``flag`` and ``target``."""
    existing = _nearest_existing(folder)
    if not existing.is_dir():
        raise ConfigError(
            f"{flag} {target}: {existing} is a file, not a folder; choose another path"
        )
    created: list[Path] = []
    try:
        missing = []
        p = folder
        while p != existing:
            missing.append(p)
            p = p.parent
        for m in reversed(missing):
            m.mkdir()
            created.append(m)
        fd, name = tempfile.mkstemp(prefix=".estuary-probe-", dir=folder)
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        raise ConfigError(f"{flag} {target}: cannot write {describe_os_error(err)}") from err
    finally:
        for m in reversed(created):
            try:
                m.rmdir()
            except OSError:
                pass


def check_out_dir(path: Path, flag: str = "--out") -> Path:
    """Refuse an output folder the command could not create or write (a file, a file among
    its parents, no permission, a read-only file system); return ``path`` unchanged."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path}: this is a file; give a folder (new or existing)")
    _probe(path, flag, path)
    return path


def check_out_file(path: Path, flag: str = "--out") -> Path:
    """Refuse an output file the command could not write (a folder of that name, a file
    among its parents, no permission); return ``path`` unchanged."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: this is a folder; give a file name (e.g. grid.png)")
    _probe(path.parent if str(path.parent) else Path("."), flag, path)
    return path
