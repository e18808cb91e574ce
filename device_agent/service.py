"""The device agent service: register, (pick an edge,) train on the edge's model when
assigned, upload.

Raw data never leaves this object; only model tensors (through blobs), the label histogram
in the registration message and, with device-selected edges, the chosen edge do. With
``federation.assignment = "select"`` the device draws its edge from FedPhD eq. 25 with its
own seeded RNG (``"random"``: uniformly), skipping edges it has seen go offline
(:mod:`device_agent.choosing`). With ``--state-dir`` it keeps its state across restarts
(:mod:`device_agent.keeping`); what it holds in memory is :class:`~device_agent.base.DeviceBase`'s.
"""

from __future__ import annotations

import logging
import math

import torch

from device_agent.base import MAX_PENDING_ROUNDS
from device_agent.choosing import EdgeChoosing
from device_agent.keeping import StateKeeping
from shared import seeds
from shared.errors import ConfigError
from shared.methods.api import DeviceContext, LocalResult
from shared.models.plan import Plan, model_spec, parse_plan, plan_digest
from shared.wire.codec import all_finite
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

#: seconds after a device sees a cloud session waiting for registrations before it sends its
#: registration again (then each time twice as long, at most REANNOUNCE_MAX_S apart), for as
#: long as that session still waits: a cloud whose broker dropped the retained registration
#: (its queue full of other retained messages when it subscribed) gets it live. A cloud that
#: has everyone starts its first round after SETTLE_S (1 s), before the first repeat.
REANNOUNCE_FIRST_S, REANNOUNCE_MAX_S = 1.5, 30.0


def device_seed(seed: int, index: int, round_: int) -> int:
    """Per-device, per-round seed for the device's torch.Generator."""
    return seeds.integer("device.round", seed, device=index, round=round_)


class DeviceAgent(EdgeChoosing, StateKeeping):
    """One device: private ``data`` (float images in [-1, 1]) and ``labels``
    (:class:`~device_agent.base.DeviceBase`): registers, (chooses an edge,) trains the
    rounds it is given and uploads."""

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
        # Every download is read as views of the received bytes (``views=True``): the
        # method copies them into the model (``device_load`` keeps no view), so the device
        # holds no second copy of the model beside its own.
        personal = self.personal.pop((msg.session, msg.round), None)
        if personal is not None:
            tensors = self.fetch_tensors(personal.model_ref, model_spec(self.cfg.model.preset,
                                                                         self.plan),
                                         views=True)  # fmt: skip
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
            state = self.fetch_tensors(msg.shared_ref, shared, keep=False, views=True)
        else:
            state = self.fetch_tensors(msg.model_ref, self.spec, keep=False, views=True)
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

    def _divergence(self, result: LocalResult) -> str:
        """Why local training diverged (non-finite mean loss or model weights), or ``""``.

        The uploaded tensors are derived from the model; the edge validates them again on
        receipt (``bad_tensors``)."""
        if not math.isfinite(result.train.mean_loss):
            return f"mean loss {result.train.mean_loss}"
        for name, t in self.model.state_dict().items():
            if t.is_floating_point() and not all_finite(t):  # on this thread: see all_finite
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
        if last is not None and last.update_ref is not None:
            # a later round is announced: no one asks for the last upload again (a resend
            # is of the round announced again, above), and its file takes this round's model
            self.ep.retire_blob(last.update_ref.sha256)
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
        self.worked_session = msg.session
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
