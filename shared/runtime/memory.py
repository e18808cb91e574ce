"""Keeping an aggregator's resident memory near what it holds, on glibc.

An edge or the cloud allocates and frees model-sized sets of tensors every round (a fetched
upload, the running sum, the result, its encoding), from several threads. glibc's malloc
serves tensors below its mmap threshold (which rises to the largest block freed, up to
32 MiB: after the first round nearly every tensor of a model) from per-thread arenas, one
per thread up to eight per core, and keeps what they free: the process grows round after
round by free pages no other thread's arena can reuse. :func:`tune_allocator` caps the
arenas at :data:`ARENA_MAX`, and :func:`release_memory` returns their free pages to the
system after each round. (A fixed low mmap threshold returns even more, but maps and
unmaps every tensor: it made the aggregations of a 136 MiB model about twice as slow.)
Elsewhere than glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import cache

log = logging.getLogger(__name__)

#: mallopt parameter (malloc.h)
M_ARENA_MAX = -8
#: malloc arenas at most (the role thread, the bus's threads and the workers share them)
ARENA_MAX = 2


@cache
def _libc() -> ctypes.CDLL | None:
    """glibc, when this process runs on it (None elsewhere: musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - present on glibc only
    except (OSError, AttributeError):
        return None
    return libc


def tune_allocator() -> bool:
    """Cap malloc's arenas (see the module docstring); whether it was done (glibc only).
    Call it once, early, before the process starts its threads."""
    libc = _libc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(M_ARENA_MAX, ARENA_MAX))
    log.debug("malloc: at most %d arenas (%s)", ARENA_MAX, "set" if ok else "refused")
    return ok


def release_memory() -> None:
    """Return the free pages of malloc's arenas to the system (``malloc_trim(0)``)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
