"""The cloud's personalization step (methods with per-device models, pFedGPA): the
method's :meth:`~shared.methods.api.Personalization.personalize` runs in a worker thread,
off the cloud's message loop, so presence, registrations and deadlines keep flowing while a
diffusion model trains; the loop polls it and, once it is done, sends each device its own
model privately (``Topics.device_down``) and opens the next round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shared.methods.api import Personalization, TensorDict
from shared.runtime.jobs import WorkerJob

#: seconds between two looks at the worker (on the bus clock)
POLL_S = 1.0


class PersonalizeJob(WorkerJob[Mapping[str, TensorDict] | None]):
    """One run of ``personalization.personalize`` in a daemon thread; :meth:`poll` on the bus
    thread calls ``done(result, error)`` once, where the result is the algorithm's
    per-device models (None: none this round) and ``error`` what it raised."""

    def __init__(
        self,
        personalization: Personalization,
        round_: int,
        uploads: Mapping[str, TensorDict],
        state: TensorDict,
        call_later: Callable[[float, Callable[[], None]], Any],
        done: Callable[[Mapping[str, TensorDict] | None, BaseException | None], None],
    ) -> None:
        self.round = round_
        super().__init__(
            lambda: personalization.personalize(round_, uploads, state), call_later, done,
            name=f"personalize-{round_ + 1}", poll_s=POLL_S,
        )  # fmt: skip
