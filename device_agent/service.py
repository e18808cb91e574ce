"""The device agent service: register, (pick an edge,) train on the edge's model when
assigned, upload.

Raw data never leaves this object; only model tensors (through blobs), the label histogram
in the registration message and, with device-selected edges, the chosen edge do. With
``federation.assignment = "select"`` the device draws its edge from FedPhD eq. 25 with its
own seeded RNG (``"random"``: uniformly), skipping edges it has seen go offline.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from device_agent.state import DeviceState, read_state, save_state, set_aside, state_path
from shared import seeds
from shared.config import RunConfig
from shared.data.datasets import NUM_CLASSES, histogram_problem
from shared.errors import CodecError, ConfigError, StateError
from shared.federation.selection import (
    choose_edge,
    selection_probs,
    selection_rng,
    selection_settings,
)
from shared.methods.api import DeviceContext, LocalResult, Method
from shared.models.plan import (
    ChannelPlan,
    Plan,
    build_model,
    model_spec,
    parse_plan,
    plan_digest,
    plan_doc,
)
from shared.runtime.service import RoleService
from shared.transport.bus import Bus, Timer
from shared.wire.codec import check_spec
from shared.wire.messages import (
    CloudState,
    DeviceHello,
    DeviceJoin,
    DeviceUpdate,
    EdgeRound,
    PersonalModel,
    Presence,
    RoundStart,
)

log = logging.getLogger(__name__)

MAX_PENDING_ROUNDS = 64  # edge announcements kept while the device has not chosen yet
MAX_KEPT_JOINS = 100_000  # other participants' choices kept (this and the next rounds)
#: seconds after a device sees a cloud session waiting for registrations before it sends its
#: registration again (then each time twice as long, at most REANNOUNCE_MAX_S apart), for as
#: long as that session still waits: a cloud whose broker dropped the retained registration
#: (its queue full of other retained messages when it subscribed) gets it live. A cloud that
#: has everyone starts its first round after SETTLE_S (1 s), before the first repeat.
REANNOUNCE_FIRST_S, REANNOUNCE_MAX_S = 1.5, 30.0


def device_seed(seed: int, index: int, round_: int) -> int:
    """Per-device, per-round seed for the device's torch.Generator."""
    return seeds.integer("device.round", seed, device=index, round=round_)


class DeviceAgent(RoleService):
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
        self.current: tuple[str, int] | None = None  # (session, round) of the last RoundStart
        self.choices: OrderedDict[tuple[str, int], str] = OrderedDict()  # (session, round)
        self.announced: OrderedDict[tuple[str, int, str], EdgeRound] = OrderedDict()
        #: the session of the last round trained (the first round of another one: a new run)
        self.state_session: str | None = None
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

    def start(self) -> None:
        """Read the saved state (``--state-dir``), subscribe to round announcements and
        publish the retained registration."""
        self.restore_state()
        self.on(f"{self.topics.base}/edge/+/round", EdgeRound, self.on_edge_round, "msg_edge_round")
        if self.algorithm.traffic.downlink == "per_device":
            self.on(self.topics.device_down(self.name), PersonalModel, self.on_personal,
                    "msg_personal_model")  # fmt: skip
        if self.selecting:
            self.on(self.topics.cloud_round, RoundStart, self.on_round_start, "msg_round_start")
            self.on(self.topics.all_device_join, DeviceJoin, self.on_join, "msg_join")
            for pattern in (self.topics.all_edge_status, self.topics.all_device_status):
                self.on(pattern, Presence, self.on_presence, "msg_presence")
        self.on(self.topics.cloud_state, CloudState, self.on_cloud_state, "msg_cloud_state")
        self.announce_presence(True)
        self.send(self.topics.device_hello(self.name), self.hello(), retain=True)

    def hello(self) -> DeviceHello:
        """This device's registration."""
        return DeviceHello(
            device=self.name,
            home_edge=self.home_edge,
            n_samples=len(self.labels),
            label_counts=self.label_counts,
        )

    def on_cloud_state(self, msg: CloudState) -> None:
        """A cloud session of this config waiting for registrations: send the registration
        again while it waits (:data:`REANNOUNCE_FIRST_S`), so that retained messages ahead
        of it on the broker (thousands of made-up registrations on an open broker) cannot
        keep this device from a cloud that (re)started after it registered."""
        if msg.config_digest != self.config_digest or msg.phase != "waiting":
            self.cloud_waiting = None
            return
        self.cloud_waiting = msg.session
        if msg.session == self.reannounced:
            return
        self.reannounced = msg.session
        self._reannounce_later(msg.session, REANNOUNCE_FIRST_S, 0.0)

    def _reannounce_later(self, session: str, delay_s: float, waited_s: float) -> None:
        """Repeat the registration after ``delay_s`` while ``session`` waits, for at most
        ``federation.registration_timeout_s`` in all (after it the cloud stops waiting)."""
        waited_s += delay_s
        if waited_s > self.cfg.federation.registration_timeout_s:
            return

        def again() -> None:
            if self.cloud_waiting != session:
                return  # the cloud has its devices (or another session began)
            self.reannounces += 1
            log.info("%s: cloud session %s still waiting for registrations: registering "
                     "again", self.name, session)  # fmt: skip
            self.send(self.topics.device_hello(self.name), self.hello(), retain=True)
            self._reannounce_later(session, min(delay_s * 2, REANNOUNCE_MAX_S), waited_s)

        self.ep.call_later(delay_s, again)

    # -- edge selection (assignment "select" / "random") ----------------------------------
    def on_presence(self, msg: Presence) -> None:
        """Remember which edges and devices are offline (their last will): an offline edge
        is not chosen, an offline earlier participant is not waited for."""
        target = self.offline_edges if msg.role == "edge" else self.offline_devices
        if msg.online:
            target.discard(msg.name)
        else:
            target.add(msg.name)
            if msg.role == "device" and self.selection is not None:
                self._decide()

    def on_join(self, msg: DeviceJoin) -> None:
        """Another participant's choice; the choice this device waits for may be complete."""
        if msg.device == self.name:
            return
        reason = histogram_problem(msg.label_counts)
        if reason:
            self.reject("bad_join", f"{msg.device} round {msg.round + 1}: {reason}")
            return
        if self._stale(msg.session, msg.round):
            log.debug("%s: dropped %s's join for past round %d", self.name, msg.device,
                      msg.round + 1)  # fmt: skip
            return
        self.joins[(msg.session, msg.round, msg.device)] = (msg.edge, tuple(msg.label_counts))
        while len(self.joins) > MAX_KEPT_JOINS:
            self.joins.popitem(last=False)
        if self.selection is not None and self.selection.session == msg.session:
            self._decide()

    def _stale(self, session: str, round_: int) -> bool:
        """Whether ``(session, round_)`` is before the current round of the current session."""
        return self.current is not None and session == self.current[0] and round_ < self.current[1]

    def _advance(self, session: str, round_: int) -> None:
        """Make ``(session, round_)`` current (unless it is in the past) and drop the joins
        that are not for it or a later round of its session."""
        if self._stale(session, round_):
            return
        self.current = (session, round_)
        for key in [k for k in self.joins if k[0] != session or k[1] < round_]:
            del self.joins[key]

    def on_round_start(self, msg: RoundStart) -> None:
        """A participant picks its edge once every earlier participant (sorted order) has
        picked or is offline, or after ``join_timeout_s``; then it tells everyone and trains
        when that edge's announcement is here (it may already be)."""
        if not msg.edge_counts:
            return
        for edge, counts in msg.edge_counts.items():
            reason = histogram_problem(counts)
            if reason:
                self.reject("bad_edge_counts", f"round {msg.round + 1}, edge {edge}: {reason}")
                return
        self._advance(msg.session, msg.round)
        if self.name not in msg.participants:
            return
        key = (msg.session, msg.round)
        if key in self.choices:  # a replay (reconnect, restarted edge): repeat the choice
            self._joined(msg, self.choices[key])
            return
        if self.selection is not None and self.sel_timer is not None:
            self.sel_timer.cancel()
        self.selection = msg
        self.sel_timer = self.ep.call_later(
            self.cfg.federation.join_timeout_s, lambda: self._decide(force=True)
        )
        self._decide()

    def _decide(self, force: bool = False) -> None:
        msg = self.selection
        if msg is None:
            return
        order = sorted(msg.participants)
        before = order[: order.index(self.name)]
        known = {d: self.joins.get((msg.session, msg.round, d)) for d in before}
        waiting = [d for d, j in known.items() if j is None and d not in self.offline_devices]
        if waiting and not force:
            return
        if waiting:
            log.warning(
                "%s: round %d: choosing without %d earlier choices", self.name, msg.round,
                len(waiting),
            )  # fmt: skip
        self.selection = None
        if self.sel_timer is not None:
            self.sel_timer.cancel()
            self.sel_timer = None
        counts = {e: list(c) for e, c in msg.edge_counts.items()}
        for j in known.values():
            if j is not None and j[0] in counts:  # lengths were checked on receipt
                counts[j[0]] = [a + b for a, b in zip(counts[j[0]], j[1], strict=True)]
        try:
            edge = self.choose(msg.round, counts)
        except ValueError:
            self.reject("no_edge_online", f"round {msg.round + 1}")
            return
        self.choices[(msg.session, msg.round)] = edge
        while len(self.choices) > MAX_PENDING_ROUNDS:
            self.choices.popitem(last=False)
        log.debug("%s round %d picked %s", self.name, msg.round + 1, edge)
        self._joined(msg, edge)

    def choose(self, round_: int, edge_counts: dict[str, list[int]]) -> str:
        """This device's edge for ``round_`` (eq. 25 or uniform) among the online edges."""
        edges = sorted(edge_counts)
        rng = selection_rng(self.cfg.run.seed, self.index, round_)
        if self.cfg.federation.assignment == "random":
            probs = {e: 1.0 / len(edges) for e in edges}
        else:
            a, b, target = selection_settings(self.cfg)
            probs = selection_probs(edge_counts, self.label_counts, a, b, target)
        online = {e for e in edges if e not in self.offline_edges}
        return choose_edge(probs, online, rng)

    def _joined(self, msg: RoundStart, edge: str) -> None:
        join = DeviceJoin(
            round=msg.round,
            session=msg.session,
            device=self.name,
            edge=edge,
            label_counts=self.label_counts,
        )
        self.send(self.topics.device_join(self.name), join)
        pending = self.announced.pop((msg.session, msg.round, edge), None)
        if pending is not None:
            self.train_round(pending)

    # -- state across restarts (--state-dir, device_agent.state) ----------------------------
    def restore_state(self, path: Path | None = None) -> bool:
        """Take up the state saved by this device's last run of this config (in ``path``,
        by default its ``--state-dir`` file), if there is one; an unusable file is moved
        aside (never deleted) and the device starts afresh. Returns whether a state was
        restored."""
        path = path or self.state_file
        if path is None:
            return False
        try:
            saved = read_state(path)
        except (StateError, CodecError, OSError) as err:
            self._set_aside(path, "unreadable", f"{type(err).__name__}: {err}")
            return False
        if saved is None:
            return False
        plan, why = self._check_saved(saved)
        last = None  # the update to resend if its round is announced again
        if not why and saved.last_update is not None:
            try:
                last = DeviceUpdate.model_validate(saved.last_update)
            except ValueError as err:  # pydantic's ValidationError
                why = "bad-update", str(err).splitlines()[0]
        if why:
            self._set_aside(path, *why)
            return False
        self._adopt_arch(plan)
        self.algo_state.clear()
        self.algo_state.update(saved.algo_state)
        if saved.model is not None:
            self.model.load_state_dict(saved.model)
        self.kept_local = saved.kept_local
        self.last_update = last
        self.state_session = saved.session
        self.choices = OrderedDict(((s, r), e) for s, r, e in saved.choices)
        self.metrics.device_state.labels(event="restored").inc()
        log.info(
            "%s: restored its state from %s (round %d of session %s: %s)", self.name, path,
            saved.round, saved.session, ", ".join(sorted(saved.algo_state)) or "no entries",
        )  # fmt: skip
        return True

    def _check_saved(self, saved: DeviceState) -> tuple[ChannelPlan | None, tuple[str, str] | None]:
        """``saved``'s architecture, checked once, and (reason slug, detail) when ``saved``
        is not this device's state for this run (None when it is)."""
        if saved.device != self.name:
            return None, ("other-device", f"it is {saved.device}'s")
        if saved.config_digest != self.config_digest:
            return None, ("other-config", (
                f"saved under config {saved.config_digest}, this run is {self.config_digest}"
            ))  # fmt: skip
        if saved.round >= self.cfg.run.rounds:  # no real round of this run can be that late
            return None, ("bad-round", f"round {saved.round + 1} of a "
                          f"{self.cfg.run.rounds}-round run")  # fmt: skip
        try:
            plan = parse_plan(self.cfg.model.preset, saved.plan)
        except ConfigError as err:
            return None, ("bad-plan", f"bad architecture plan: {err}")
        if saved.model is not None:
            try:
                check_spec(saved.model, model_spec(self.cfg.model.preset, plan))
            except CodecError as err:
                return plan, ("bad-model", str(err))
        return plan, None

    def _set_aside(self, path: Path, reason: str, detail: str) -> None:
        """Move the unusable state file ``path`` aside (never deleted), counted and said."""
        try:
            moved = str(set_aside(path, reason))
        except OSError as err:
            moved = f"not moved ({err})"
        self.metrics.device_state.labels(event="set_aside").inc()
        log.warning("%s: state file %s not used (%s): %s; starting afresh", self.name,
                    path, detail, moved)  # fmt: skip

    def kept_state(self, round_: int, session: str) -> DeviceState:
        """What this device keeps between rounds, as of ``round_`` of ``session``."""
        return DeviceState(
            device=self.name,
            config_digest=self.config_digest,
            plan=plan_doc(self.plan),
            algo_state=self.algo_state,
            round=round_,
            session=session,
            kept_local=self.kept_local,
            model=dict(self.model.state_dict()) if self.kept_local is not None else None,
            last_update=self.last_update.model_dump(mode="json") if self.last_update else None,
            choices=[(s, r, e) for (s, r), e in self.choices.items()],
        )

    def write_state(self, path: Path, round_: int, session: str) -> int:
        """Write :meth:`kept_state` to ``path`` atomically (the ``--state-dir`` format);
        returns the bytes written. StateError or OSError when it cannot be written."""
        state = self.kept_state(round_, session)
        return save_state(path, state, self.algorithm.device.device_cache_keys)

    def save_state(self, round_: int, session: str) -> None:
        """Write what this device keeps between rounds (after a round it trained)."""
        self.state_session = session
        if self.state_file is None:
            return
        try:
            size = self.write_state(self.state_file, round_, session)
        except (StateError, OSError) as err:
            # the round still counts: only a restart would lose what is not on disk
            self.metrics.device_state.labels(event="save_failed").inc()
            log.error("%s: state not saved to %s: %s", self.name, self.state_file, err)
            return
        self.metrics.device_state.labels(event="saved").inc()
        log.debug("%s: state saved (%d bytes)", self.name, size)

    def _start_over(self, session: str) -> None:
        """The first round (index 0) from another session than the kept state's: the cloud
        started the run over (a resumed cloud starts at a later round), so nothing kept applies."""
        log.info("%s: the first round of session %s after session %s: the run started over; "
                 "dropping the state kept from before", self.name, session,
                 self.state_session)  # fmt: skip
        self.algo_state.clear()
        self.kept_local = None
        self.last_update = None
        self.state_session = None

    # -- training ------------------------------------------------------------------------
    def on_edge_round(self, msg: EdgeRound) -> None:
        """Train on the announced model if this device is assigned to (or chose) it: under a
        static assignment only its home edge's, under selection only the chosen edge's, and
        never a round past the run's last (a forged far-future round would otherwise make
        every real round look late, also after a restart from the state it saved)."""
        if self.name not in msg.devices:
            return
        self.trace.event("round_seen", msg.round)
        if msg.round >= self.cfg.run.rounds:
            self.reject("round_out_of_range", f"{msg.edge} announced round {msg.round + 1} of "
                        f"a {self.cfg.run.rounds}-round run")  # fmt: skip
            return
        if not msg.select and msg.edge != self.home_edge:
            self.reject("not_my_edge", f"{msg.edge} announced round {msg.round + 1}; this "
                        f"device's edge is {self.home_edge}")  # fmt: skip
            return
        if msg.select:
            if self.choices.get((msg.session, msg.round)) != msg.edge:
                # not (yet) this device's choice: keep it in case the choice comes later
                self.announced[(msg.session, msg.round, msg.edge)] = msg
                while len(self.announced) > MAX_PENDING_ROUNDS:
                    self.announced.popitem(last=False)
                return
        self.train_round(msg)

    def on_personal(self, msg: PersonalModel) -> None:
        """Keep the personal model the cloud sent; train the round waiting for it."""
        if msg.device != self.name:
            self.reject("not_mine", f"personal model for {msg.device}")
            return
        self.personal[(msg.session, msg.round)] = msg
        while len(self.personal) > MAX_PENDING_ROUNDS:
            self.personal.popitem(last=False)
        if self.awaiting is not None:
            pending, timer = self.awaiting
            if (pending.session, pending.round) == (msg.session, msg.round):
                timer.cancel()
                self.awaiting = None
                self.train_round(pending)

    def _await_personal(self, msg: EdgeRound) -> bool:
        """Whether round ``msg`` must wait for its personal model (then it is parked, with a
        timer of ``join_timeout_s`` after which the device trains the edge's model)."""
        if not msg.personal or (msg.session, msg.round) in self.personal:
            return False
        if self.awaiting is not None:
            self.awaiting[1].cancel()

        def give_up() -> None:
            if self.awaiting is not None and self.awaiting[0] is msg:
                self.awaiting = None
                self.reject("no_personal_model", f"round {msg.round + 1}: training the edge model")
                self.train_round(msg, waited=True)

        self.awaiting = (msg, self.ep.call_later(self.cfg.federation.join_timeout_s, give_up))
        return True

    def _load_round_model(self, ctx: DeviceContext, msg: EdgeRound) -> bool:
        """Load what round ``msg`` trains: this device's personal model when the cloud sent
        one, else the edge's (only its shared tensors when the device holds the rest);
        False when the download failed (rejected and counted)."""
        personal = self.personal.pop((msg.session, msg.round), None)
        if personal is not None:
            tensors = self.fetch_tensors(personal.model_ref, model_spec(self.cfg.model.preset,
                                                                         self.plan))  # fmt: skip
            if tensors is not None:
                self.algorithm.device.device_personal(ctx, self.model, tensors)
                return True
        if not self.algorithm.device.needs_download(ctx):
            self.algorithm.device.device_load(ctx, self.model, {})
            return True
        shared = self.algorithm.format.shared_spec(self.spec)
        if (
            msg.shared_ref is not None
            and shared is not None
            and self.algorithm.device.device_holds_rest(ctx, self.spec)
        ):  # the device has the rest (its local parts): only the shared tensors travel
            state = self.fetch_tensors(msg.shared_ref, shared, keep=False)
        else:
            state = self.fetch_tensors(msg.model_ref, self.spec, keep=False)
        # not kept: no one fetches the round's model from a device, and its bytes would sit
        # beside the training's activations (the device holds its own copy in the model)
        if state is None:
            return False  # the edge's deadline covers the missing update
        self.algorithm.device.device_load(ctx, self.model, state)
        return True

    def _adopt_announced(self, doc: Plan | None) -> bool:
        """Adopt the architecture a round announcement carries (``doc``, its plan's JSON),
        checked once when it is new; False (rejected, counted) when it cannot be used."""
        if plan_digest(doc) == plan_digest(self.plan):
            return True
        try:
            plan = parse_plan(self.cfg.model.preset, doc)
        except ConfigError as err:
            self.reject("bad_plan", f"bad architecture plan: {err}")
            return False
        self._adopt_arch(plan)
        return True

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

    def _divergence(self, result: LocalResult) -> str:
        """Why local training diverged (non-finite mean loss or model weights), or ``""``.

        The uploaded tensors are derived from the model; the edge validates them again on
        receipt (``bad_tensors``)."""
        if not math.isfinite(result.train.mean_loss):
            return f"mean loss {result.train.mean_loss}"
        for name, t in self.model.state_dict().items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return f"non-finite weights in {name}"
        return ""

    def train_round(self, msg: EdgeRound, *, waited: bool = False) -> None:
        """Train on the edge's model (or this device's personal one) for ``msg.round`` and
        report (upload when asked)."""
        if msg.round == 0 and self.state_session not in (None, msg.session):
            self._start_over(msg.session)
        last = self.last_update
        if last is not None and (last.session, last.round) == (msg.session, msg.round):
            # Announced again (the edge restarted, or a retained replay after a reconnect):
            # send the same update again; the edge ignores it if it already has it.
            log.info(
                "%s: round %d announced again by %s; resending", self.name, msg.round, msg.edge
            )
            self.send(self.topics.device_up(self.name), last)
            return
        if last is not None and last.session == msg.session and msg.round < last.round:
            self.reject("late", f"round {msg.round + 1} announced after round {last.round + 1}")
            return
        # a device of a static assignment hears no RoundStart: its edge's announcement is
        # how it joins the session (its deployment reports name it)
        self._advance(msg.session, msg.round)
        if not self._adopt_announced(msg.arch):
            return
        if not waited and self._await_personal(msg):
            return
        ctx = DeviceContext(
            self.name,
            self.data,
            self.labels,
            torch.Generator().manual_seed(device_seed(self.cfg.run.seed, self.index, msg.round)),
            round=msg.round,
            edge=msg.edge,
            peers=sorted(msg.devices),
            seed=self.cfg.run.seed,
            state=self.algo_state,
            test_data=self.test_data,
            test_labels=self.test_labels,
        )
        # Algorithms replace their state's entries (never mutate them), so this shallow copy
        # is the state as it was before the round, to go back to if training diverges.
        before = dict(self.algo_state)
        # Between edge aggregations (r_e > 1) the device keeps training its own model.
        # (the same edge, too: it counts the rounds behind an upload, see EdgeServer)
        continuing = self.kept_local == (msg.session, msg.round - 1, msg.edge, msg.model_ref.sha256)
        if not continuing and not self._load_round_model(ctx, msg):
            return
        self.kept_local = None  # set again below once this round's training is known good
        self.trace.event("downloaded", msg.round, bytes=0 if continuing else msg.model_ref.size)
        result = self.algorithm.device.device_round(ctx, self.model, msg.round, upload=msg.upload)
        self.trace.event("trained", msg.round, train_s=result.train.seconds)
        reason = self._divergence(result)
        if reason:
            # Nothing is uploaded or reported (the edge's deadline covers the missing
            # update); the next round starts again from the edge's model, with the state the
            # device had before this round (SCAFFOLD's c_i, which the server's c includes;
            # FedDiffuse's local parts; MOON's previous model), not with none.
            self.algo_state.clear()
            self.algo_state.update(before)
            self.reject("diverged", f"round {msg.round + 1} at {msg.edge}: {reason}")
            return
        if not msg.upload:
            self.kept_local = (msg.session, msg.round, msg.edge, msg.model_ref.sha256)
        ref = None
        if result.tensors is not None:
            ref = self.put_tensors(result.tensors, self.algorithm.traffic.blob_kind)
        update = DeviceUpdate(
            round=msg.round,
            session=msg.session,
            device=self.name,
            edge=msg.edge,
            update_ref=ref,
            n_samples=len(self.labels),
            label_counts=self.label_counts,
            train_loss=result.train.mean_loss,
            steps=result.train.steps,
            train_seconds=result.train.seconds,
            acc_before=None if result.accuracy is None else result.accuracy.before,
            acc_after=None if result.accuracy is None else result.accuracy.after,
        )
        self.last_update = update
        self.metrics.round.set(msg.round + 1)  # rounds completed
        self.metrics.training_seconds.observe(result.train.seconds)
        self.save_state(msg.round, msg.session)  # before the report: a restart resends it
        self.send(self.topics.device_up(self.name), update)
        self.trace.event("uploaded", msg.round)
        log.info(
            "%s: round %d/%d at %s: %d steps in %.1f s, loss %.4f%s", self.name, msg.round + 1,
            self.cfg.run.rounds, msg.edge, result.train.steps, result.train.seconds,
            result.train.mean_loss,
            f", uploaded {ref.size / 1024:.1f} KiB" if ref is not None else ", kept local",
        )  # fmt: skip
        if self.after_last_round is not None and msg.round + 1 >= self.cfg.run.rounds:
            self.after_last_round(msg.round + 1)
