"""The cloud aggregator service (DESIGN section 2).

Waits for device registrations, then runs synchronous rounds: samples participants with
ratio kappa from its own seeded RNG, assigns each to its edge, sends the global model when
there is a new one, collects one report per edge (deadline-bounded), aggregates every
``r_g`` rounds with the algorithm's cloud step and checkpoints atomically. Flat FL is the
one-edge case. No algorithm maths here.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import nn

from cloud.personal import PersonalizeJob
from shared.config import RunConfig
from shared.data.datasets import NUM_CLASSES, histogram_problem
from shared.errors import ConfigError
from shared.evaluation.evaluator import model_from_state
from shared.methods.api import Finalizer, FinalResult, Fold, Method, Update, origin_of
from shared.models.checkpoint import CheckpointWriter, model_digest, save_checkpoint
from shared.models.init import init_fingerprint
from shared.models.plan import ChannelPlan, build_model, dense_plan, plan_digest, plan_doc
from shared.naming import device_name, edge_ids, is_device_of
from shared.runtime.jobs import WorkerJob
from shared.runtime.memory import release_memory
from shared.runtime.service import RoleService, TensorDict
from shared.transport.bus import Bus, Timer
from shared.wire.codec import decode_tensors, encode_tensors, spec_of
from shared.wire.messages import (
    MAX_MESSAGE_BYTES,
    BlobRef,
    CloudState,
    DeviceHello,
    EdgeUpdate,
    PersonalModel,
    Presence,
    RoundStart,
    encode,
)

log = logging.getLogger(__name__)

#: seconds after subscribing before the cloud judges who has registered (retained
#: registrations and presence arrive within it)
SETTLE_S = 1.0

#: :class:`CloudServer`'s default ``init``: fingerprint the config's ``model.init`` file
INIT_FROM_CONFIG = "from model.init"


def new_session() -> str:
    """A fresh cloud session id (16 hex chars); a restarted cloud gets a new one so edges and
    devices re-run the round it resumes at. An identifier, not a source of randomness for
    the experiment."""
    return secrets.token_hex(8)


def sample_participants(devices: list[str], kappa: float, seed: int, round_: int) -> list[str]:
    """ceil(kappa * N) devices drawn without replacement by a per-round seeded RNG
    (derived from (seed, round) so a resumed run draws the same devices)."""
    rng = np.random.default_rng([seed, round_, 0xC10D])
    k = max(1, math.ceil(kappa * len(devices) - 1e-9))
    chosen = rng.choice(len(devices), size=min(k, len(devices)), replace=False)
    return sorted(devices[i] for i in chosen)


def largest_round_start(cfg: RunConfig) -> int:
    """Encoded bytes of the largest round announcement ``cfg`` can produce: the most
    participants a round can have, with the longest names, listed in the assignment (or, when
    devices pick their edge, as participants); every edge's label counts at 12 digits; and,
    when the cloud prunes, the dense channel plan (a pruned plan has the same entries with
    smaller numbers)."""
    fed = cfg.federation
    k = max(1, math.ceil(fed.participation * fed.num_devices - 1e-9))
    names = [device_name(i) for i in range(fed.num_devices - k, fed.num_devices)]
    edges = edge_ids(cfg)
    selecting = fed.assignment != "static"
    prunes = cfg.algorithm.config().prunes
    msg = RoundStart(
        round=cfg.run.rounds - 1,
        session="f" * 16,
        assignment={e: ([] if selecting or i else names) for i, e in enumerate(edges)},
        global_ref=BlobRef(sha256="f" * 64, size=2**40, kind="global_model", src="cloud"),
        shared_ref=BlobRef(sha256="f" * 64, size=2**40, kind="global_model", src="cloud"),
        new_global=True,
        deadline_s=fed.round_deadline_s,
        config_digest=cfg.digest(),
        participants=names if selecting else [],
        edge_counts={e: [10**12 - 1] * NUM_CLASSES for e in edges},
        arch=dense_plan(cfg.model.preset) if prunes else None,
    )
    return len(encode(msg))


def check_round_start_fits(cfg: RunConfig) -> None:
    """ConfigError when a round announcement of ``cfg`` could exceed the transport's message
    limit (it lists every participant), before any process connects."""
    size = largest_round_start(cfg)
    if size > MAX_MESSAGE_BYTES:
        fed = cfg.federation
        raise ConfigError(
            f"a round announcement for {fed.num_devices} devices (participation "
            f"{fed.participation:g}, assignment {fed.assignment!r}) can take {size} bytes, over "
            f"the {MAX_MESSAGE_BYTES}-byte message limit; use fewer devices per round "
            "(federation.participation or num_devices)"
        )


@dataclass
class RoundSummary:
    """What the cloud saw of one round."""

    round: int
    participants: int
    updates: int
    mean_loss: float | None
    cloud_aggregated: bool
    model_sha256: str
    round_seconds: float
    aggregation_seconds: float
    train_seconds: float
    rejected: int
    edges: dict[str, int] = field(default_factory=dict)
    model_params: int = 0  # parameters of the global model after this round
    arch: str = "dense"  # plan digest of the global model's architecture
    trained_arch: str = "dense"  # plan digest of the architecture this round trained on
    #: the run's last round (``run.rounds``, or earlier where the algorithm's budget ends it)
    final: bool = False
    #: the method's figures of the global state (``aggregation.round_report``)
    algorithm: dict[str, float] = field(default_factory=dict)
    #: classifier runs: each reporting device's (before, after) test accuracy
    accuracy: dict[str, tuple[float | None, float]] = field(default_factory=dict)


class CloudServer(RoleService):
    """The cloud: owns the global model and the round counter."""

    role = "cloud"

    def __init__(
        self,
        cfg: RunConfig,
        bus: Bus,
        algorithm: Method,
        *,
        initial_model: TensorDict,
        plan: ChannelPlan | None = None,
        start_round: int = 0,
        checkpoint_dir: Path | None = None,
        on_round_end: Callable[[RoundSummary], None] | None = None,
        session: str | None = None,
        init: str | None = INIT_FROM_CONFIG,
    ) -> None:
        super().__init__("cloud", cfg, bus)
        #: what the run started from, by content (:func:`~shared.models.init.init_fingerprint`),
        #: recorded in every checkpoint: ``init`` as given (a resumed run passes its
        #: checkpoint's, None where that has none), or by default ``model.init`` as it is now
        if init == INIT_FROM_CONFIG:
            init = init_fingerprint(cfg.model.preset, cfg.model.init)
            origin = origin_of(algorithm)
            init = f"{init}+{origin}" if origin is not None else init
        self.init = None if init is None or init.startswith("unreadable") else init
        self.session = session or new_session()
        self.offline: set[str] = set()
        self.algorithm = algorithm
        #: the rounds this run trains: ``run.rounds``, or fewer where the algorithm's budget
        #: (a privacy budget) ends it earlier
        self.rounds = algorithm.aggregation.round_limit(cfg.run.rounds)
        if start_round == 0 and plan is None:
            # a fresh run: the algorithm's initial state (and FedPhD-OS prunes it here)
            state, plan = algorithm.aggregation.after_cloud_aggregate(
                -1, algorithm.format.init_global(initial_model), None
            )
        else:
            state = initial_model  # resumed: already the global state of ``plan``
        self.model: TensorDict = state
        self.plan: ChannelPlan | None = plan
        self.spec = spec_of(self.model)
        self.model_sha = model_digest(self.model)
        self.edge_counts: dict[str, list[int]] = {}  # per edge since the last aggregation
        self._params: dict[str, int] = {}
        self.edges = edge_ids(cfg)
        self.edge_counts = {e: [0] * NUM_CLASSES for e in self.edges}
        self.devices: dict[str, DeviceHello] = {}
        self.round = start_round
        self.fresh_global = True  # the edges have not received the current global yet
        self.global_ref: BlobRef | None = None
        self.opened_wall = 0  # the open round's start, Unix time in whole seconds
        self.shared_ref: BlobRef | None = None  # the shared tensors of global_ref's state
        self.assignment: dict[str, list[str]] = {}
        self.participants: list[str] = []
        #: the open round's edge reports, each with whether it carried a model
        self.reports: dict[str, tuple[EdgeUpdate, bool]] = {}
        #: the open round's aggregation, fed each edge's model as it arrives (None in a
        #: round without a cloud aggregation)
        self.fold: Fold | None = None
        #: the global state's blob is :attr:`global_ref` (False: put it before announcing)
        self.global_put = False
        #: writes each checkpoint while the next round runs (inline on an in-process bus)
        self.checkpoints = CheckpointWriter(background=not bus.blobs_local)
        #: the devices' own uploads of the open round (per-device algorithms), by device
        self.uploads: dict[str, TensorDict] = {}
        self.personal_job: PersonalizeJob | None = None
        self.personal = False  # the next round start says devices have personal models
        self.timer: Timer | None = None
        self.started = False
        #: whether the retained registrations and presence have had time to arrive
        self.settled = False
        self.done = False
        #: why a round transition failed; the process then stops (exit 2) instead of waiting
        #: with no deadline armed, and a restart resumes from the last checkpoint
        self.failed: str | None = None
        self.opened_at = 0.0
        self.aggregations = 0
        #: the first round this process runs (a resumed cloud starts after its checkpoint)
        self.start_round = start_round
        #: device contributions the edges reported in this process's rounds: none after
        #: all of them means nothing trained the model, a failure, not a finished run
        self.contributions = 0
        self.checkpoint_dir = checkpoint_dir
        self.on_round_end = on_round_end
        #: called once the last round is aggregated; it deploys and then calls
        #: :meth:`complete` (the run is "deploying" until then). None: complete at once.
        self.on_trained: Callable[[], None] | None = None
        #: a one-shot algorithm's product (FedDEO's classifier), made after the last round
        #: by :meth:`~shared.methods.api.Finalizer.finalize` in :attr:`final_job`
        self.final: FinalResult | None = None
        self.final_job: WorkerJob[FinalResult | None] | None = None

    def start(self) -> None:
        """Subscribe to registrations and edge reports; wait for devices."""
        t = self.topics
        self.on(t.all_device_hello, DeviceHello, self.on_hello, "msg_hello")
        self.on(t.all_edge_up, EdgeUpdate, self.on_edge_update, "msg_edge_update")
        for pattern in (t.all_device_status, t.all_edge_status):
            self.on(pattern, Presence, self.on_presence, "msg_presence")
        self.metrics.model_params.set(self.model_params())
        # the new session's state first: a role that sees this cloud online must not find a
        # finished run's retained "done" still in place (see follow_cloud)
        self._publish_state("waiting")
        self.announce_presence(True)
        self.ep.call_later(self.cfg.federation.registration_timeout_s, self._registration_timeout)
        # the broker hands over retained registrations before retained presence: judge who is
        # here only once both had time to arrive, so that the registrations a finished run
        # left behind (their devices offline) cannot start a round before this run's devices
        self.ep.call_later(SETTLE_S, self._settled)

    def global_module(self) -> nn.Module:
        """The current global model as a module in eval mode (its architecture rebuilt from
        the plan; see :func:`~shared.evaluation.evaluator.model_from_state`)."""
        return model_from_state(self.cfg, self.model, self.plan, algorithm=self.algorithm)

    def model_params(self) -> int:
        """Parameters of the global model (the algorithm's extra state not counted)."""
        key = plan_digest(self.plan)
        if key not in self._params:
            with torch.device("meta"):
                module = build_model(self.cfg.model.preset, self.plan, seed=0)
            self._params[key] = sum(p.numel() for p in module.parameters())
        return self._params[key]

    def _publish_state(self, phase: Literal["waiting", "training", "deploying", "done"]) -> None:
        self.metrics.phase.state(phase)
        self.metrics.round.set(self.round)
        training = phase == "training"
        state = CloudState(
            round=self.round,
            session=self.session,
            phase=phase,
            model_ref=self.global_ref,
            config_digest=self.cfg.digest(),
            opened_at=self.opened_wall if training else None,
            deadline_s=self.cloud_deadline_s if training else None,
        )
        self.send(self.topics.cloud_state, state, retain=True)

    # -- registration ------------------------------------------------------------------
    def _configured_device(self, name: str) -> bool:
        """Whether ``name`` is one of the federation's devices (``dev000`` up to
        ``federation.num_devices``): registrations, and the offline set, hold no others."""
        return is_device_of(name, self.cfg)

    def on_hello(self, msg: DeviceHello) -> None:
        """Record a device; start the first round once every configured device is in."""
        if not self._configured_device(msg.device):
            # thousands of made-up ids would otherwise grow every round announcement past
            # the message limit (and the cloud with it)
            self.reject("unknown_device", f"{msg.device} is not among the federation's "
                        f"{self.cfg.federation.num_devices} devices")  # fmt: skip
            return
        if msg.home_edge not in self.edges:
            self.reject("unknown_edge", f"{msg.device} names edge {msg.home_edge!r}")
            return
        if len(msg.label_counts) and sum(msg.label_counts) != msg.n_samples:
            self.reject("bad_label_counts", msg.device)
            return
        self.devices[msg.device] = msg
        self.offline.discard(msg.device)
        self._maybe_begin()

    def _present(self) -> list[str]:
        """The registered devices not known to be offline."""
        return [d for d in self.devices if d not in self.offline]

    def _settled(self) -> None:
        self.settled = True
        self._maybe_begin()

    def _maybe_begin(self) -> None:
        """Start the first round once every configured device is registered and present."""
        if self.settled and not self.started:
            # cheap checks first: this runs on every registration and presence message
            n = self.cfg.federation.num_devices
            if len(self.devices) >= n and self.offline.isdisjoint(self.devices):
                self._begin()

    def on_presence(self, msg: Presence) -> None:
        """Track who is online; an edge going offline no longer holds up the round."""
        if msg.online:
            self.offline.discard(msg.name)
            self._maybe_begin()
            return
        if msg.name not in self.edges and not self._configured_device(msg.name):
            return  # bounded: only the federation's own instances are tracked
        self.offline.add(msg.name)
        if msg.role == "edge" and self.started and not self.done and self.timer is not None:
            log.warning("edge %s went offline during round %d", msg.name, self.round + 1)
            self._maybe_close()

    def _registration_timeout(self) -> None:
        present = self._present()
        if not self.started and present:
            wanted = self.cfg.federation.num_devices
            log.warning("starting with %d/%d devices", len(present), wanted)
            self._begin()
        elif not self.started:
            log.error("no device registered within the registration timeout; stopping")
            self.done = True
            self._publish_state("done")

    @contextlib.contextmanager
    def _transition(self, what: str) -> Iterator[None]:
        """Run a round transition. If it raises (a full disk under the checkpoint, a round
        announcement too large for the transport), no round would be open and no deadline
        armed, so the cloud would wait forever: record the failure in :attr:`failed`, which
        stops the process, and re-raise for the bus to count."""
        try:
            yield
        except Exception as err:
            self.failed = f"round {self.round + 1}: {what}: {type(err).__name__}: {err}"
            log.error("%s; stopping (a restart resumes from the last checkpoint)", self.failed)
            raise

    def _begin(self) -> None:
        self.started = True
        with self._transition("starting"):
            if self.round >= self.rounds:
                self._finish()
            else:
                self._open_round()

    # -- rounds ------------------------------------------------------------------------
    def _open_round(self) -> None:
        r = self.round
        online = sorted(d for d in self.devices if d not in self.offline)
        participants = sample_participants(
            online or sorted(self.devices), self.cfg.federation.participation, self.cfg.run.seed, r
        )
        self.participants = participants
        self.assignment = {e: [] for e in self.edges}
        selecting = self.cfg.federation.assignment != "static"
        if not selecting:
            for dev in participants:
                self.assignment[self.devices[dev].home_edge].append(dev)
        self._put_global()
        msg = RoundStart(
            round=r,
            session=self.session,
            assignment=self.assignment,
            global_ref=self.global_ref,
            shared_ref=self.shared_ref,
            new_global=self.fresh_global,
            deadline_s=self.cfg.federation.round_deadline_s,
            config_digest=self.cfg.digest(),
            participants=participants if selecting else [],
            edge_counts=dict(self.edge_counts),
            arch=plan_doc(self.plan),
            personal=self.personal,
        )
        self.personal = False
        self.fresh_global = False
        self.reports = {}
        aggregates = (r + 1) % self.cfg.federation.cloud_every == 0
        self.fold = self.algorithm.aggregation.cloud_fold(self.model) if aggregates else None
        self.opened_at = time.perf_counter()
        opened = time.time()
        self.opened_wall = int(opened)
        # retained: an edge that (re)starts mid-round learns the round from the broker
        self.send(self.topics.cloud_round, msg, retain=True)
        self.trace.event("announce", r)
        self._publish_state("training")
        self.metrics.round_started.set(opened)
        self.metrics.round_deadline.set(self.cloud_deadline_s)
        self.timer = self.ep.call_later(self.cloud_deadline_s, self._on_deadline)

    @property
    def cloud_deadline_s(self) -> float:
        """Seconds after which the cloud closes a round: the edges close theirs at the
        configured deadline, and get time to aggregate and report."""
        return self.cfg.federation.round_deadline_s * 1.5 + 10

    def on_edge_update(self, msg: EdgeUpdate) -> None:
        """Collect one report per edge for the open round."""
        self.trace.event("edge_report", msg.round, edge=msg.edge)
        if msg.session != self.session:
            self.reject("stale_session", f"{msg.edge} round {msg.round + 1}")
            return
        if msg.round != self.round or not self.started or self.done:
            self.reject("late" if msg.round < self.round else "unexpected_round", msg.edge)
            return
        if msg.edge not in self.assignment:
            self.reject("unknown_edge", msg.edge)
            return
        if msg.edge in self.reports:
            self.reject("duplicate", f"{msg.edge} round {msg.round + 1}")
            return
        problem = histogram_problem(msg.label_counts, msg.n_samples)
        if problem:
            self.reject("bad_label_counts", f"{msg.edge} round {msg.round + 1}: {problem}")
            return
        parts_problem = self._part_samples_problem(msg)
        if parts_problem:
            self.reject("bad_part_samples", f"{msg.edge} round {msg.round + 1}: {parts_problem}")
            return
        forwarded = self._forwarded(msg)
        if forwarded is None:
            return
        tensors = None
        if msg.model_ref is not None:
            # an edge sends the shared tensors only, where the algorithm has them; folded
            # into the round's aggregation and dropped (not kept in the blob store)
            tensors = self.fetch_tensors(
                msg.model_ref,
                self.algorithm.format.shared_spec(self.spec) or self.spec,
                keep=False,
                views=self.fold is not None and self.fold.streams,
            )
            if tensors is None:
                return
            self.trace.event("edge_fetched", msg.round, edge=msg.edge, bytes=msg.model_ref.size)
            if self.fold is not None and msg.n_samples > 0:
                update = Update(msg.edge, tensors, msg.n_samples, tuple(msg.label_counts),
                                msg.part_samples)  # fmt: skip
                try:
                    self.fold.add(update)
                except Exception as err:  # the spec was checked: a bug, or the algorithm's
                    log.exception("folding the model of %s failed", msg.edge)
                    self.reject("bad_update", f"{msg.edge} round {msg.round + 1}: "
                                f"{type(err).__name__}: {err}")  # fmt: skip
                    return
                del update
        self.reports[msg.edge] = (msg, tensors is not None)
        self.uploads.update(forwarded)
        del tensors  # folded: its bytes are not kept through the close
        self._maybe_close()

    def _forwarded(self, msg: EdgeUpdate) -> dict[str, TensorDict] | None:
        """The devices' own uploads an edge forwarded (algorithms with per-device updates;
        empty otherwise), each checked against the model's spec; None (rejected) when one is
        not a device of that edge's report or cannot be used."""
        if self.algorithm.traffic.cloud_sees != "every_upload" or not msg.forwarded:
            return {}
        out: dict[str, TensorDict] = {}
        for f in msg.forwarded:
            if f.device not in msg.devices or f.device in out:
                self.reject("bad_forward", f"{msg.edge} round {msg.round + 1}: {f.device}")
                return None
            tensors = self.fetch_tensors(f.update_ref, self.algorithm.format.upload_spec(self.spec))
            if tensors is None:
                return None
            out[f.device] = tensors
        return out

    def _part_samples_problem(self, msg: EdgeUpdate) -> str | None:
        """Why ``msg.part_samples`` cannot weight this algorithm's parts (None when it can)."""
        if msg.part_samples is None:
            return None
        unknown = set(msg.part_samples) - set(self.algorithm.format.part_names)
        if unknown:
            names = self.algorithm.format.part_names
            return f"unknown parts {sorted(unknown)}; this run's are {names}"
        over = {p: n for p, n in msg.part_samples.items() if n > msg.n_samples}
        if over:
            return f"part samples {over} exceed the update's n_samples {msg.n_samples}"
        return None

    def _maybe_close(self) -> None:
        waiting = [e for e in self.assignment if e not in self.reports and e not in self.offline]
        if not waiting:
            self._close_round()

    def _on_deadline(self) -> None:
        if not self.done:
            log.warning(
                "cloud round %d deadline: %d/%d edges",
                self.round,
                len(self.reports),
                len(self.assignment),
            )
            self._close_round()

    def _close_round(self) -> None:
        with self._transition("closing the round"):
            self._close_open_round()

    def _close_open_round(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        r = self.round
        agg_seconds = 0.0
        aggregated = False
        trained_arch = plan_digest(self.plan)  # before pruning at this aggregation
        for edge, (m, _) in self.reports.items():
            if edge in self.edge_counts and len(m.label_counts) == NUM_CLASSES:
                self.edge_counts[edge] = list(m.label_counts)
            self.contributions += len(m.devices)
        fold, self.fold = self.fold, None
        if fold is not None:
            if len(fold):
                self.metrics.phase.state("aggregating")
                t0 = time.perf_counter()
                self.checkpoints.wait()  # the last checkpoint precedes any state after it
                self.model = fold.result()  # independent of the order the edges reported in
                del fold
                aggregation = self.algorithm.aggregation
                self.model, plan = aggregation.after_cloud_aggregate(r, self.model, self.plan)
                if plan_digest(plan) != plan_digest(self.plan):
                    self.plan, self.spec = plan, spec_of(self.model)
                    self.metrics.model_params.set(self.model_params())
                    log.info("global architecture is now %s", plan_digest(plan))
                agg_seconds = time.perf_counter() - t0
                self.metrics.aggregation_seconds.observe(agg_seconds)
                self.global_put = False
                self._put_global()  # the blob's hash is the model's digest
                assert self.global_ref is not None
                self.model_sha = self.global_ref.sha256
                self.trace.event("aggregated", r)
                self.fresh_global, aggregated = True, True
                self.edge_counts = {e: [0] * NUM_CLASSES for e in self.edges}  # reset (r_g)
                self.aggregations += 1
                self._collect(r)
                self._checkpoint(r)
                self.trace.event("checkpointed", r)
        summary = self._summarize(r, aggregated, agg_seconds, trained_arch)
        if aggregated:
            for figure, value in summary.algorithm.items():
                self.metrics.algorithm_figure.labels(figure=figure).set(value)
        self.metrics.round_seconds.observe(summary.round_seconds)
        self.trace.event("closed", r)
        release_memory()  # the round's buffers are freed: give their pages back
        self.round = r + 1
        if self.on_round_end is not None:
            self.on_round_end(summary)
        if self.round >= self.rounds:
            self._finish()
        elif self.algorithm.personalization is not None and self.uploads:
            self._personalize(r)
        else:
            self._open_round()

    def _collect(self, r: int) -> None:
        """Hand round ``r``'s forwarded uploads to the final step that needs them (before
        the checkpoint, which its files join); they are its alone unless a personalization
        uses them too."""
        finalizer = self.algorithm.finalizer
        if finalizer is None or not self.uploads:
            return
        finalizer.collect(r, dict(sorted(self.uploads.items())))
        if self.algorithm.personalization is None:
            self.uploads = {}

    def _personalize(self, r: int) -> None:
        """Run the algorithm's personalization of round ``r``'s uploads off the loop; then
        send each device its model and open the next round."""
        uploads = dict(sorted(self.uploads.items()))
        self.uploads = {}

        def done(result: Mapping[str, TensorDict] | None, error: BaseException | None) -> None:
            self.personal_job = None
            if error is not None:  # the devices train the global model instead
                log.error("personalization of round %d failed: %s: %s", r + 1,
                          type(error).__name__, error)  # fmt: skip
                self.reject("personalize_failed", f"round {r + 1}: {type(error).__name__}")
                result = None
            self.personal = self._send_personal(result or {})
            with self._transition("opening the round"):
                self._open_round()

        personalization = self.algorithm.personalization
        if personalization is None:  # the caller checked; a narrowing for the type checker
            return
        self.personal_job = PersonalizeJob(
            personalization, r, uploads, self.model, self.ep.call_later, done
        )
        self.personal_job.start()

    def _send_personal(self, models: Mapping[str, TensorDict]) -> bool:
        """Send each device its own model for the round about to open, on the path only
        that device reads; whether any was sent."""
        personalization = self.algorithm.personalization
        for device, tensors in sorted(models.items()):
            ref = self.put_private_tensors(tensors, "personal_model", device)
            mode = personalization.mode_of(device) if personalization is not None else "inversion"
            msg = PersonalModel(
                round=self.round, session=self.session, device=device, model_ref=ref, mode=mode
            )
            self.send(self.topics.device_down(device), msg)
        return bool(models)

    def _checkpoint(self, r: int) -> None:
        every = self.cfg.eval.checkpoint_every
        last = r + 1 >= self.rounds
        if self.checkpoint_dir is not None and every and (self.aggregations % every == 0 or last):
            directory, model, plan, init, sha = (
                self.checkpoint_dir,
                self.model,
                self.plan,
                self.init,
                self.model_sha,
            )
            view = self.algorithm.state_view
            own_state = view is not None and view.keeps_files

            def write() -> None:
                save_checkpoint(directory, r, model, self.cfg, plan=plan, init=init,
                                model_sha256=sha)  # fmt: skip
                release_memory()  # the writer's buffers: freed after the round's own trim

            # inline where the algorithm writes files of its own beside it (they must match)
            # and at the end of the run (what follows reads it)
            self.checkpoints.write(write, inline=own_state or last)
            if view is not None:
                view.save_cloud_state(self.checkpoint_dir, r)

    def _summarize(
        self, r: int, aggregated: bool, agg_seconds: float, trained_arch: str
    ) -> RoundSummary:
        reports = [m for m, _ in self.reports.values()]
        losses = [(m.mean_loss, len(m.devices)) for m in reports if m.mean_loss is not None]
        n_up = sum(len(m.devices) for m in reports)
        return RoundSummary(
            round=r,
            participants=len(self.participants),
            updates=n_up,
            mean_loss=sum(lo * k for lo, k in losses) / n_up if n_up else None,
            cloud_aggregated=aggregated,
            model_sha256=self.model_sha,
            round_seconds=time.perf_counter() - self.opened_at,
            aggregation_seconds=agg_seconds,
            train_seconds=sum(m.train_seconds for m in reports),
            rejected=sum(m.rejected for m in reports),
            edges={m.edge: len(m.devices) for m in reports},
            accuracy={
                d: (a.before, a.after) for m in reports for d, a in (m.accuracy or {}).items()
            },
            model_params=self.model_params(),
            arch=plan_digest(self.plan),
            trained_arch=trained_arch,
            final=r + 1 >= self.rounds,
            algorithm=self.algorithm.aggregation.round_report(r, self.model),
        )

    def _put_global(self) -> None:
        """Put the global model as a blob (:attr:`global_ref`) when it changed since."""
        if not self.global_put or self.global_ref is None:
            old = self.global_ref
            shared = self.algorithm.format.shared_spec(self.spec)
            if shared is None and self.algorithm.aggregation.aggregation_stateless:
                # a plain mean is never written to: the model is read in place from its
                # blob (one copy of the global in memory, not two)
                data = encode_tensors(self.model)
                self.global_ref, self.shared_ref = self.put_encoded(data, "global_model"), None
                self.model = decode_tensors(data, copy=False)
                del data
            else:
                self.global_ref, self.shared_ref = self.put_state(
                    self.model, shared, "global_model"
                )
            self.global_put = True
            if old is not None and old.sha256 != self.global_ref.sha256:
                self.ep.release_blob(old.sha256)  # a late asker reads it from disk
            self.metrics.model_bytes.set(self.global_ref.size)

    def _finish(self) -> None:
        self.checkpoints.wait()  # the run's last checkpoint is on disk before anything ends
        ran = self.round - self.start_round
        if ran > 0 and self.contributions == 0:
            # every round closed without a single device's work: the model is the one this
            # process started from, and a "finished" run would deploy it as trained
            self.failed = (
                f"none of the {ran} round(s) this cloud ran received a device's update (each "
                f"closed with fewer than federation.min_updates = "
                f"{self.cfg.federation.min_updates}); the model is untrained: not deploying. "
                "Check that the edges and devices run this config on this broker (`estuary "
                "status`) and the edges' logs for rejected updates"
            )
            log.error("%s", self.failed)
            return
        # the retained state of a finished run names the final model (fetchable from a cloud
        # that stays), not the last one the edges were sent
        self._put_global()
        finalizer = self.algorithm.finalizer
        if finalizer is not None and self.final is None:
            self._finalize(finalizer)
            return
        self._trained()

    def _finalize(self, finalizer: Finalizer) -> None:
        """Run the method's final step (:meth:`~shared.methods.api.Finalizer.finalize`) off
        the loop, then deploy; a failure fails the run (nothing is deployed)."""
        run_dir = self.checkpoint_dir.parent if self.checkpoint_dir is not None else None
        last: dict[str, float] = {}

        def progress(phase: str, done: int, total: int) -> None:  # the worker's thread
            share = done / max(1, total)
            if share - last.get(phase, -1.0) >= 0.1 or done == total:
                last[phase] = share
                log.info("%s: %s %d/%d", self.cfg.algorithm.name, phase, done, total)

        def done(result: FinalResult | None, error: BaseException | None) -> None:
            self.final_job = None
            if error is not None:
                self.failed = (f"{self.cfg.algorithm.name}'s final step failed: "
                               f"{type(error).__name__}: {error}")  # fmt: skip
                log.error("%s", self.failed)
                return
            self.final = result
            self._trained()

        self.metrics.phase.state("aggregating")
        log.info("%s: the round is in; making the model to deploy", self.cfg.algorithm.name)
        state = self.model
        self.final_job = WorkerJob(
            lambda: finalizer.finalize(state, run_dir, on_progress=progress),
            self.ep.call_later, done, name="finalize", poll_s=1.0,
        )  # fmt: skip
        self.final_job.start()

    def _trained(self) -> None:
        """Deploy (when armed) or declare the run done."""
        if self.on_trained is not None:
            self._publish_state("deploying")
            self.on_trained()
            return
        self.complete()

    def complete(self) -> None:
        """Declare the run done (edges and devices then leave)."""
        if self.done:
            return
        self.done = True
        self._publish_state("done")
        log.info("run finished after %d rounds; global model %s", self.round, self.model_sha[:12])
