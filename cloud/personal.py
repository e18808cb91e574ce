"""The cloud's personalization step (algorithms with per-device models, pFedGPA): the
algorithm's :meth:`~shared.algorithms.base.Algorithm.personalize` runs in a worker thread,
off the cloud's message loop, so presence, registrations and deadlines keep flowing while a
diffusion model trains; the loop polls it and, once it is done, sends each device its own
model privately (``Topics.device_down``) and opens the next round.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from shared.algorithms import Algorithm
from shared.algorithms.aggregation import TensorDict

log = logging.getLogger(__name__)

#: seconds between two looks at the worker (on the bus clock)
POLL_S = 1.0


class PersonalizeJob:
    """One run of ``algorithm.personalize`` in a daemon thread; :meth:`poll` on the bus
    thread calls ``done(result, error)`` once, where the result is the algorithm's
    per-device models (None: none this round) and ``error`` what it raised."""

    def __init__(
        self,
        algorithm: Algorithm,
        round_: int,
        uploads: Mapping[str, TensorDict],
        state: TensorDict,
        call_later: Callable[[float, Callable[[], None]], Any],
        done: Callable[[Mapping[str, TensorDict] | None, BaseException | None], None],
    ) -> None:
        self.round = round_
        self._done = done
        self._call_later = call_later
        self._result: Mapping[str, TensorDict] | None = None
        self._error: BaseException | None = None
        self.started = time.perf_counter()
        self._thread = threading.Thread(
            target=self._work, args=(algorithm, round_, uploads, state),
            name=f"personalize-{round_}", daemon=True,
        )  # fmt: skip

    def start(self) -> None:
        """Start the worker and the polling."""
        self._thread.start()
        self.poll()

    def _work(
        self, algorithm: Algorithm, round_: int, uploads: Mapping[str, TensorDict],
        state: TensorDict,
    ) -> None:  # fmt: skip
        try:
            self._result = algorithm.personalize(round_, uploads, state)
        except BaseException as err:  # reported on the bus thread, never lost in the worker
            self._error = err

    def poll(self) -> None:
        """Hand the result over when the worker is done, else look again in :data:`POLL_S`."""
        self._thread.join(timeout=0.05)
        if self._thread.is_alive():
            self._call_later(POLL_S, self.poll)
            return
        log.debug("personalization of round %d took %.1fs", self.round + 1,
                  time.perf_counter() - self.started)  # fmt: skip
        self._done(self._result, self._error)
