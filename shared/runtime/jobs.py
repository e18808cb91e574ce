"""Work a role runs in a worker thread, off its message loop, and takes back on the loop.

The loop polls the worker on the bus clock (:meth:`WorkerJob.poll` through ``call_later``)
and, once it is done, calls ``done(result, error)`` on the loop's own thread: the role's
state is only ever touched there. Used by the cloud's personalization and the device's
deployment fetch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

log = logging.getLogger(__name__)

T = TypeVar("T")


def _nothing() -> None:
    """The work of a job whose work has run."""


def _ignore(_result: object, _error: BaseException | None) -> None:
    """The callback of a job whose result has been handed over."""


class WorkerJob(Generic[T]):
    """``work()`` in a daemon thread named ``name``; :meth:`poll`, on the role's thread,
    calls ``done(result, error)`` once the worker is done, where ``error`` is what ``work``
    raised (then ``result`` is None). The loop looks every ``poll_s`` seconds (bus clock),
    waiting at most ``join_s`` for the worker each time (``first_join_s`` the first time, so
    quick work is handed over at once). Every wait inside ``work`` needs its own timeout."""

    def __init__(
        self,
        work: Callable[[], T],
        call_later: Callable[[float, Callable[[], None]], Any],
        done: Callable[[T | None, BaseException | None], None],
        *,
        name: str,
        poll_s: float,
        join_s: float = 0.05,
        first_join_s: float | None = None,
    ) -> None:
        self.name = name
        self._work: Callable[[], object] = work
        self._done, self._call_later = done, call_later
        self.poll_s, self.join_s = poll_s, join_s
        self.first_join_s = join_s if first_join_s is None else first_join_s
        self._result: T | None = None
        self._error: BaseException | None = None
        self.started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the worker and the polling."""
        self._thread.start()
        self.poll(self.first_join_s)

    def _run(self) -> None:
        try:
            self._result = cast(T, self._work())
        except BaseException as err:  # handed to the role's thread, never lost in the worker
            self._error = err
        finally:
            self._work = _nothing  # its closure (often the job's own) is not kept alive

    def poll(self, join_s: float | None = None) -> None:
        """Hand the result over when the worker is done, else look again in ``poll_s``."""
        self._thread.join(timeout=self.join_s if join_s is None else join_s)
        if self._thread.is_alive():
            self._call_later(self.poll_s, self.poll)
            return
        log.debug("%s took %.2fs", self.name, time.perf_counter() - self.started)
        # handed over once, and then no longer held: a callback that refers back to its job
        # (a reference cycle) must not keep a model's worth of tensors alive until the
        # garbage collector's next full pass
        result, error, done = self._result, self._error, self._done
        self._result, self._error, self._done = None, None, _ignore
        done(result, error)
