"""A device agent's state in memory (:class:`DeviceBase`): what it was given, what it keeps
between rounds and what it knows of the rounds under way. The agent's parts build on it:
its choice of an edge (:mod:`device_agent.choosing`), its state across restarts
(:mod:`device_agent.keeping`) and its rounds (:mod:`device_agent.service`)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from device_agent.state import state_path
from shared.config import RunConfig
from shared.data.datasets import NUM_CLASSES
from shared.methods.api import Method
from shared.models.plan import ChannelPlan, build_model, model_spec, plan_digest
from shared.runtime.service import RoleService
from shared.transport.bus import Bus, Timer
from shared.wire.messages import DeviceUpdate, EdgeRound, PersonalModel, RoundStart

log = logging.getLogger(__name__)

MAX_PENDING_ROUNDS = 64  # edge announcements kept while the device has not chosen yet


class DeviceBase(RoleService):
    """One device: private ``data`` (float images in [-1, 1]) and ``labels``."""

    role = "device"

    def __init__(
        self,
        cfg: RunConfig,
        bus: Bus,
        algorithm: Method,
        *,
        device_id: str,
        index: int,
        home_edge: str,
        data: torch.Tensor,
        labels: torch.Tensor,
        state_dir: Path | None = None,
        test_data: torch.Tensor | None = None,
        test_labels: torch.Tensor | None = None,
    ) -> None:
        super().__init__(device_id, cfg, bus)
        #: the device's own test split (a classifier reports its accuracy on it)
        self.test_data, self.test_labels = test_data, test_labels
        #: personal models the cloud sent for (session, round), newest last (at most
        #: MAX_PENDING_ROUNDS); a round announced as personal waits for its own
        self.personal: OrderedDict[tuple[str, int], PersonalModel] = OrderedDict()
        #: the personal round waiting for its model, and the timer that gives up on it
        self.awaiting: tuple[EdgeRound, Timer] | None = None
        #: called with the round after the device trained the run's last round (a
        #: classifier exports and serves its own model: device_agent.own_classifier)
        #: called with the 1-based number of the last round once it is trained
        self.after_last_round: Callable[[int], None] | None = None
        self.index = index
        self.home_edge = home_edge
        self.algorithm = algorithm
        self.data = data
        self.labels = labels
        self.plan: ChannelPlan | None = None
        self.model = build_model(cfg.model.preset, None, seed=cfg.run.seed)
        self.spec = algorithm.format.global_spec(model_spec(cfg.model.preset, None))
        self.algo_state: dict[str, Any] = {}  # the algorithm's per-device state, kept here
        self.label_counts = np.bincount(labels.numpy(), minlength=NUM_CLASSES).tolist()
        self.last_update: DeviceUpdate | None = None
        #: (session, round, edge, edge model sha) of a round trained without upload: the
        #: next round continues this model when it matches (the edge model is the same)
        self.kept_local: tuple[str, int, str, str] | None = None
        self.selecting = cfg.federation.assignment != "static"
        self.offline_edges: set[str] = set()
        self.offline_devices: set[str] = set()
        self.selection: RoundStart | None = None  # the round whose choice is pending
        self.sel_timer: Timer | None = None
        # other participants' choices as (edge, label counts), keyed (session, round, device);
        # only the current session's current and later rounds, at most MAX_KEPT_JOINS
        self.joins: OrderedDict[tuple[str, int, str], tuple[str, tuple[int, ...]]] = OrderedDict()
        #: (session, round) of the last RoundStart, or of the last round trained
        self.current: tuple[str, int] | None = None
        self.choices: OrderedDict[tuple[str, int], str] = OrderedDict()  # (session, round)
        self.announced: OrderedDict[tuple[str, int, str], EdgeRound] = OrderedDict()
        #: the session of the last round trained (the first round of another one: a new run)
        self.state_session: str | None = None
        #: the session of the last round whose model reached this device (a finished run's
        #: retained announcement, whose model no one serves any more, does not count)
        self.worked_session: str | None = None
        #: where the state is kept across restarts (``--state-dir``); None: memory only
        self.state_file = state_path(state_dir, device_id) if state_dir is not None else None
        self.config_digest = cfg.digest()
        #: the cloud session now waiting for registrations (None: the cloud is past that, or
        #: unknown) and the one this device last repeated its registration for
        self.cloud_waiting: str | None = None
        self.reannounced: str | None = None
        self.reannounces = 0  # registrations sent again, over the process's life

    def joined_session(self) -> str | None:
        """The session of the last round the cloud announced to this device or it trained in
        (restored state does not count: it may be a finished run's)."""
        return self.current[0] if self.current is not None else None

    def worked_in_session(self) -> str | None:
        """The session of the last round this device got the model of (and so trained in):
        a round announcement of a finished run, left retained on the broker, makes the
        device :meth:`joined_session` that run until the model's download fails, which must
        not let that run's "done" end this process."""
        return self.worked_session

    def _adopt_arch(self, plan: ChannelPlan | None) -> None:
        """Rebuild the module when the architecture changed (pruning)."""
        if plan_digest(plan) == plan_digest(self.plan):
            return
        self.plan = plan
        self.model = build_model(self.cfg.model.preset, plan, seed=self.cfg.run.seed)
        self.spec = self.algorithm.format.global_spec(model_spec(self.cfg.model.preset, plan))
        self.algo_state.clear()  # per-device state of the old architecture no longer fits
        self.kept_local = None
        log.info("%s: architecture %s", self.name, plan_digest(plan))

    def train_round(self, msg: EdgeRound, *, waited: bool = False) -> None:
        """Train round ``msg`` and report it (:class:`~device_agent.service.DeviceAgent`)."""
        raise NotImplementedError
