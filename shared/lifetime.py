"""Child processes that do not outlive their parent.

Linux's ``prctl(PR_SET_PDEATHSIG)`` sends a signal to a process when the thread that forked
it exits, so a crashed or SIGKILLed parent (a launcher, ``estuary compare --jobs``) leaves no
orphans behind. Off Linux both helpers do nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


@functools.cache
def _libc_prctl() -> Callable[..., int] | None:
    """libc's prctl, loaded in the parent (dlopen after fork is unsafe); None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (no orphans after a crash)."""
    prctl = _libc_prctl()
    if prctl is not None:
        with contextlib.suppress(Exception):
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def die_with_parent_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen` asking Linux to SIGTERM the child when
    this process dies, for children that cannot call :func:`die_with_parent` themselves.

    Linux ties the signal to the parent *thread* that forked, so start the child from a
    thread that outlives it (normally the main thread). Fails soft: no prctl, no signal.
    """
    prctl = _libc_prctl()
    if prctl is None:
        return None
    parent_pid = os.getpid()

    def preexec() -> None:
        with contextlib.suppress(Exception):
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
            if os.getppid() != parent_pid:  # the parent died before prctl took effect
                os.kill(os.getpid(), signal.SIGTERM)

    return preexec
