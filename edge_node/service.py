"""The edge-server aggregator service (DESIGN section 2).

Per round: adopt the global model when the cloud sends one, announce the edge model to the
devices the cloud assigned here, collect their updates until all arrived or the deadline
passed (with at least ``min_updates``), aggregate every ``r_e`` rounds with the algorithm's
edge step, and report to the cloud (with the edge model every ``r_g`` rounds). Duplicate
and late updates are dropped and counted; aggregation happens at most once per round.
It also keeps the label counts of the devices it served since the last cloud aggregation.

With device-selected edges (``federation.assignment`` "select"/"random") the cloud names the
round's participants instead of assigning them; each participant announces its choice with a
``DeviceJoin`` and the edge trains with whoever joined it, closing once every participant
has joined elsewhere, reported here, or dropped out (or at the deadline).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

from shared.config import RunConfig
from shared.data.datasets import NUM_CLASSES, histogram_problem
from shared.errors import CodecError, ConfigError, TransportError
from shared.methods.api import Fold, Method, Update
from shared.models.plan import ChannelPlan, model_spec, parse_plan, plan_digest, plan_doc
from shared.naming import is_device_of
from shared.runtime.jobs import WorkerJob
from shared.runtime.memory import release_memory
from shared.runtime.service import RoleService, TensorDict
from shared.transport.bus import Bus, Timer
from shared.wire.codec import TensorSpec, encode_tensors, sha256_hex
from shared.wire.messages import (
    MAX_COUNT,
    BlobRef,
    DeviceAccuracy,
    DeviceHello,
    DeviceJoin,
    DeviceUpdate,
    EdgeRound,
    EdgeState,
    EdgeUpdate,
    Forwarded,
    Presence,
    RoundStart,
    home_of,
)

log = logging.getLogger(__name__)

MAX_EARLY_JOINS = 100_000  # joins kept for rounds this edge has not opened yet
FETCH_POLL_S = 0.01  # how often the role thread looks for update downloads that finished

#: a device's work not yet in the edge model: (samples, label counts) summed over rounds
Pending = tuple[int, list[int]]


def _no_work() -> Pending:
    """No samples, no label counts."""
    return 0, [0] * NUM_CLASSES


def _plus(work: Pending, n: int, counts: Sequence[int]) -> Pending:
    """``work`` with ``n`` more samples of label counts ``counts``."""
    return work[0] + n, [a + b for a, b in zip(work[1], counts, strict=True)]


def _shown(round_: int | None) -> str:
    """A round index as people count rounds (from 1), or "-" before the first."""
    return "-" if round_ is None else str(round_ + 1)


class _Closed(NamedTuple):
    """What closing a round computes; the edge takes it on only once all of it is known."""

    model: TensorDict
    model_ref: BlobRef | None
    report: EdgeUpdate
    acc_n: int
    acc_counts: list[int]
    acc_parts: dict[str, int] | None
    pending: dict[str, Pending]
    cloud_round: bool


class EdgeServer(RoleService):
    """One edge aggregator, named ``edge_id``."""

    role = "edge"

    def __init__(self, cfg: RunConfig, bus: Bus, algorithm: Method, *, edge_id: str) -> None:
        super().__init__(edge_id, cfg, bus)
        self.algorithm = algorithm
        self.plan: ChannelPlan | None = None
        self.spec: dict[str, TensorSpec] = {}
        self.update_spec: dict[str, TensorSpec] = {}
        self._set_arch(None)
        self.selecting = cfg.federation.assignment != "static"
        self.joined: set[str] = set()
        self.elsewhere: set[str] = set()
        self.early_joins: OrderedDict[tuple[str, int, str], str] = OrderedDict()
        self.model: TensorDict | None = None
        self.model_ref: BlobRef | None = None
        self.shared_ref: BlobRef | None = None  # model's shared tensors; put with model_ref
        self.global_sha: str | None = None
        self.session: str | None = None
        self.round: int | None = None
        self.closed = True
        self.candidates: list[str] = []
        self.upload = True
        #: the open round's aggregation, fed each update as it is accepted (None in a round
        #: without uploads); a streaming fold keeps a running sum, not the updates
        self.fold: Fold | None = None
        #: each accepted upload of the round: its Update, whose tensors are kept only where
        #: the edge still needs them (forwarding to the cloud); the parts it covers
        self.updates: dict[str, Update] = {}
        self.upload_parts: dict[str, frozenset[str]] = {}
        self.reported: dict[str, DeviceUpdate] = {}
        #: the open round's update downloads under way, by device (worker threads: the
        #: message thread keeps handling everyone else while a blob source is slow or silent)
        self.fetching: dict[str, WorkerJob[TensorDict]] = {}
        #: turns to download an upload: each download holds one until its update is folded
        #: (or refused), so at most this many uploads are in memory at once
        self.fetch_slots = threading.BoundedSemaphore(cfg.broker.max_update_fetches)
        #: a download silent this long gives up its turn
        self.stall_s = 3 * cfg.broker.chunk_timeout_s
        self.dropped: set[str] = set()
        self.offline: set[str] = set()
        self.my_devices: set[str] = set()
        #: the label counts each device registered with (its retained hello), at most one
        #: entry per configured device; its updates must carry the same counts
        self.registered: dict[str, tuple[int, ...]] = {}
        self.timer: Timer | None = None
        #: the blob of the last report's model (the cloud has it once the next round opens)
        self.report_sha: str | None = None
        self.deadline_at = 0.0
        self.rejected_this_round = 0
        # running sums over ``reported``, checked against what the EdgeUpdate may carry
        self.reported_n, self.reported_loss, self.reported_seconds = 0, 0.0, 0.0
        self.acc_counts = [0] * NUM_CLASSES
        self.acc_n = 0
        #: samples behind each model part since the last cloud aggregation (algorithms whose
        #: devices upload parts); None when not tracked
        self.acc_parts = self._zero_parts()
        #: per device that trained here without uploading (rounds between edge aggregations,
        #: r_e > 1) in the rounds up to :attr:`pending_round`: the samples and label counts
        #: of those rounds, added to the accumulated counts once its upload is aggregated
        #: (its model holds that work then)
        self.pending: dict[str, Pending] = {}
        self.pending_round: int | None = None
        #: what a restarted edge served before its restart in the current cloud period,
        #: taken back from the cloud's record: load that edge selection (eq. 25) still sees,
        #: but not work its model holds (the restart lost the edge model: it starts again
        #: from the global), so not part of the eq. 22 weight. Dropped with the period
        self.carried = _no_work()

    def _zero_parts(self) -> dict[str, int] | None:
        names = self.algorithm.format.part_names
        return dict.fromkeys(names, 0) if names else None

    def joined_session(self) -> str | None:
        """The session of the last round this edge opened."""
        return self.session

    def start(self) -> None:
        """Subscribe to round starts and device updates."""
        self.on(self.topics.cloud_round, RoundStart, self.on_round_start, "msg_round_start")
        t = self.topics
        self.on(t.all_device_up, DeviceUpdate, self.on_device_update, "msg_device_update")
        self.on(t.all_device_status, Presence, self.on_presence, "msg_presence")
        self.on(t.all_device_hello, DeviceHello, self.on_hello, "msg_hello")
        if self.selecting:
            self.on(t.all_device_join, DeviceJoin, self.on_join, "msg_join")
        self.announce_presence(True)
        self._publish_state()

    def on_hello(self, msg: DeviceHello) -> None:
        """Record the label counts a device registered with; count the devices whose home is
        this edge (for the connected-devices gauge). Only the federation's own devices
        count: made-up ids are refused and counted."""
        if not is_device_of(msg.device, self.cfg):
            self.reject("unknown_device", f"{msg.device} is not among the federation's "
                        f"{self.cfg.federation.num_devices} devices")  # fmt: skip
            return
        room = msg.device in self.registered or (
            len(self.registered) < self.cfg.federation.num_devices
        )
        if room and not histogram_problem(msg.label_counts, msg.n_samples):
            self.registered[msg.device] = tuple(msg.label_counts)
        if msg.home_edge == self.name:
            self.my_devices.add(msg.device)
            self.offline.discard(msg.device)
            self._update_device_gauge()

    def on_presence(self, msg: Presence) -> None:
        """A device that goes offline mid-round (LWT) no longer holds the round open."""
        if not is_device_of(msg.name, self.cfg):
            return  # not a device of this federation: never assigned, nothing to track
        if msg.online:
            self.offline.discard(msg.name)
        else:
            self.offline.add(msg.name)
            if not self.closed and msg.name in self.candidates and msg.name not in self.reported:
                log.warning("%s: %s went offline in round %s", self.name, msg.name,
                            _shown(self.round))  # fmt: skip
                self.dropped.add(msg.name)
                self._maybe_close()
        self._update_device_gauge()

    def _global_spec(self, plan: ChannelPlan | None) -> dict[str, TensorSpec]:
        return self.algorithm.format.global_spec(model_spec(self.cfg.model.preset, plan))

    def _set_arch(
        self, plan: ChannelPlan | None, spec: dict[str, TensorSpec] | None = None
    ) -> None:
        self.plan = plan
        self.spec = spec if spec is not None else self._global_spec(plan)
        self.update_spec = self.algorithm.format.upload_spec(self.spec)

    def on_join(self, msg: DeviceJoin) -> None:
        """A participant's edge choice: ours joins the round, another's releases it."""
        if msg.session != self.session or msg.round != self.round:
            if self.round is None or msg.session != self.session or msg.round > self.round:
                # the join outran the round start: keep it for when the round opens
                self.early_joins[(msg.session, msg.round, msg.device)] = msg.edge
                while len(self.early_joins) > MAX_EARLY_JOINS:
                    self.early_joins.popitem(last=False)
            return
        self._apply_join(msg.device, msg.edge)

    def _apply_join(self, device: str, edge: str) -> None:
        if self.closed or device not in self.candidates:
            return
        if edge == self.name:
            self.joined.add(device)
            self.elsewhere.discard(device)
        else:
            self.elsewhere.add(device)
            self.joined.discard(device)
        self._maybe_close()

    def _merge_shared(self, msg: RoundStart) -> tuple[TensorDict | None, bool]:
        """``(state, ok)``: the new global state from its shared tensors (``msg.shared_ref``)
        and the rest of the edge's own state, when that reproduces ``msg.global_ref`` byte
        for byte (the rest never changes in federation); state None when the edge has to
        fetch the whole state. ``ok`` is False when the shared download itself failed
        (rejected and counted): the round start is then dropped like a failed whole fetch,
        rather than waiting out a second download from the same source."""
        shared = self.algorithm.format.shared_spec(self.spec)
        if msg.shared_ref is None or shared is None or self.model is None:
            return None, True
        part = self.fetch_tensors(msg.shared_ref, shared)
        if part is None:
            return None, False
        merged = {**self.model, **part}
        if sha256_hex(encode_tensors(merged)) != msg.global_ref.sha256:
            self.reject(
                "shared_mismatch",
                f"round {msg.round + 1}: the global's shared tensors over this edge's state do "
                "not give the global state; fetching all of it",
            )
            return None, True
        return merged, True

    def _update_device_gauge(self) -> None:
        online = len(self.my_devices - self.offline)
        self.metrics.devices.labels(edge=self.name).set(online)

    # -- round start -------------------------------------------------------------------
    def on_round_start(self, msg: RoundStart) -> None:
        """Open round ``msg.round`` for the devices the cloud assigned to this edge.

        A round from a new cloud session (the cloud restarted) is opened even if this edge
        already saw that round number; a replay within the session is a duplicate.
        """
        self.trace.event("round_seen", msg.round)
        same_session = msg.session == self.session
        if same_session and self.round is not None and msg.round <= self.round:
            self.reject("duplicate", f"round {msg.round + 1} already opened")
            return
        new_arch = plan_digest(msg.arch) != plan_digest(self.plan)
        spec, plan = self.spec, self.plan
        if new_arch:
            try:  # the one check of the plan this round start carries
                plan = parse_plan(self.cfg.model.preset, msg.arch)
            except ConfigError as err:
                self.reject("bad_plan", f"bad architecture plan: {err}")
                return
            spec = self._global_spec(plan)
        model = self.model
        kept = not (new_arch or msg.new_global or msg.global_ref.sha256 != self.global_sha)
        if model is None or not kept:  # a new architecture's state replaces the old one's
            # fetched before anything changes: a failed fetch leaves the open round intact
            state, fetched, whole = None, True, False
            if not new_arch:
                state, fetched = self._merge_shared(msg)
            if fetched and state is None:
                # a plain mean never writes to the edge's model: it is read in place from
                # the blob the store keeps (and serves), not copied
                views = self.algorithm.aggregation.aggregation_stateless
                state, whole = self.fetch_tensors(msg.global_ref, spec, views=views), True
                if state is not None:
                    self.trace.event("global_fetched", msg.round, bytes=msg.global_ref.size)
            if state is None:
                return
            if new_arch:
                self._set_arch(plan, spec)
            model = state
            self.model, self.model_ref, self.global_sha = model, None, msg.global_ref.sha256
            if whole and self.algorithm.format.shared_spec(self.spec) is None:
                # the edge serves the global's own bytes (kept in its store by the fetch)
                # instead of encoding the same tensors again
                self.model_ref = msg.global_ref.model_copy(
                    update={"kind": "edge_model", "src": self.home}
                )
            if msg.new_global:
                self.acc_counts, self.acc_n = [0] * NUM_CLASSES, 0  # reset every r_g (eq. 19)
                self.acc_parts = self._zero_parts()
                self.carried = _no_work()
            self.pending = {}  # devices start again from the new state: their work is gone
        counts = msg.edge_counts.get(self.name)
        if self.round is None and not msg.new_global and not self.acc_n and counts:
            # a restarted edge takes back the load it had served from the cloud's record;
            # its model is the global again, so none of that is aggregated work
            reason = self._check_counts(counts)
            if reason:
                self.reject("bad_edge_counts", f"round {msg.round + 1}: {reason}; ignored")
            else:
                self.carried = (sum(counts), list(counts))
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.report_sha is not None:  # the cloud took it: only disk keeps it now
            self.ep.release_blob(self.report_sha)
            self.report_sha = None
        self.session, self.round, self.closed = msg.session, msg.round, False
        if self.selecting:
            self.candidates = list(msg.participants)
        else:
            self.candidates = list(msg.assignment.get(self.name, []))
        self.joined, self.elsewhere = set(), set()
        self.upload = (msg.round + 1) % self.cfg.federation.edge_every == 0
        self.updates, self.reported, self.rejected_this_round = {}, {}, 0
        self.upload_parts = {}
        self.fold = self.algorithm.aggregation.edge_fold(model) if self.upload else None
        self.fetching = {}  # downloads of an earlier round finish and are dropped
        self.reported_n, self.reported_loss, self.reported_seconds = 0, 0.0, 0.0
        self.dropped = {d for d in self.candidates if d in self.offline}
        if self.dropped:
            log.warning("%s: %s offline at the start of round %d; not waiting for them",
                        self.name, ", ".join(sorted(self.dropped)), msg.round + 1)  # fmt: skip
        if not self.candidates:
            self._close()
            return
        if self.model_ref is None:
            self.model_ref, self.shared_ref = self.put_state(
                model, self.algorithm.format.shared_spec(self.spec), "edge_model"
            )
        announce = EdgeRound(
            round=msg.round,
            session=msg.session,
            edge=self.name,
            devices=self.candidates,
            model_ref=self.model_ref,
            shared_ref=self.shared_ref,
            upload=self.upload,
            deadline_s=self.cfg.federation.round_deadline_s,
            select=self.selecting,
            arch=plan_doc(self.plan),
            personal=msg.personal,
        )
        # retained: a device that (re)starts mid-round still learns what to train
        self.send(self.topics.edge_round(self.name), announce, retain=True)
        self.trace.event("announce", msg.round)
        self.deadline_at = self.ep.now() + self.cfg.federation.round_deadline_s
        self.timer = self.ep.call_later(self.cfg.federation.round_deadline_s, self._on_deadline)
        if self.selecting:
            for device in list(self.candidates):
                edge = self.early_joins.pop((msg.session, msg.round, device), None)
                if edge is not None:
                    self._apply_join(device, edge)
            for key in [k for k in self.early_joins if k[0] != msg.session or k[1] < msg.round]:
                del self.early_joins[key]
        self._maybe_close()

    # -- device updates ----------------------------------------------------------------
    def on_device_update(self, msg: DeviceUpdate) -> None:
        """Accept one update per assigned device for the open round.

        The update's blob is downloaded off the message thread (inline on an in-process
        bus) and only from the sender's own subtree, within the round's deadline: one
        device whose blob source is slow or silent holds up nobody else's update."""
        if msg.edge != self.name:
            return  # addressed to another edge
        self.trace.event("update_seen", msg.round, device=msg.device)
        reason = self._check_update(msg)
        if reason:
            self._refuse(msg, reason, f"{msg.device} round {msg.round + 1}")
            return
        if not (self.upload and self.algorithm.traffic.uplink != "none"):
            self._accept(msg)
            return
        ref = msg.update_ref
        if ref is None:
            self._refuse(msg, "missing_update", f"{msg.device} round {msg.round + 1}")
            return
        if ref.src != home_of("device", msg.device):
            self._refuse(
                msg,
                "foreign_source",
                f"{msg.device} round {msg.round + 1}: its update is served by "
                f"{ref.src!r}, not by the device itself",
            )
            return
        # never wait on one device's blob past the round's own deadline
        left = max(1.0, self.deadline_at - self.ep.now())
        spec, partial = self.update_spec, self.algorithm.traffic.uplink == "parts"

        # folded and dropped: the blob is not kept, and a streaming fold reads it in place
        views = self.fold is not None and self.fold.streams
        slot = [False]  # whether this download holds a turn (given back once it is handled)

        def fetch() -> TensorDict:
            start = time.monotonic()
            if not self.fetch_slots.acquire(timeout=left):
                raise TransportError(f"no download turn within {left:.0f} s", reason="timeout")
            slot[0] = True
            return self.load_tensors(
                ref, spec, timeout_s=max(1.0, left - (time.monotonic() - start)),
                partial=partial, keep=False, views=views, stall_s=self.stall_s,
            )  # fmt: skip

        def fetched(tensors: TensorDict | None, err: BaseException | None) -> None:
            try:
                self._update_fetched(msg, tensors, err, job)
            finally:
                if slot[0]:
                    slot[0] = False
                    self.fetch_slots.release()

        if self.ep.bus.blobs_local:  # in-process: no download to wait for, no turn taken
            tensors, error = None, None
            try:
                tensors = self.load_tensors(ref, spec, timeout_s=left, partial=partial,
                                            keep=False, views=views)  # fmt: skip
            except (CodecError, TransportError) as err:
                error = err
            self._update_fetched(msg, tensors, error)
            return
        job = WorkerJob(
            fetch,
            self.ep.call_later,
            fetched,
            name=f"{self.name}-fetch-{msg.device}",
            poll_s=FETCH_POLL_S,
            join_s=0.0,
            first_join_s=0.0,
        )
        self.fetching[msg.device] = job
        job.start()

    def _refuse(
        self, msg: DeviceUpdate, reason: str, detail: str, *, this_round: bool = True
    ) -> None:
        """Reject a device's update, counted by its outcome and (``this_round``) in the
        report of the round now open or last closed."""
        if this_round:
            self.rejected_this_round += 1
        self.reject(reason, detail)
        self.metrics.updates.labels(
            outcome=reason if reason in ("late", "duplicate") else "rejected"
        ).inc()

    def _update_fetched(
        self,
        msg: DeviceUpdate,
        tensors: TensorDict | None,
        error: BaseException | None,
        job: WorkerJob[TensorDict] | None = None,
    ) -> None:
        """An update's blob arrived, validated (``tensors``), or could not be had
        (``error``): take the update into the round it came for, if that is still open."""
        if job is not None and self.fetching.get(msg.device) is job:
            del self.fetching[msg.device]
        where = f"{msg.device} round {msg.round + 1}"
        current = msg.session == self.session and msg.round == self.round
        if error is not None or tensors is None:
            if isinstance(error, (CodecError, TransportError)):
                self._refuse(msg, error.reason, f"{where}: {error}", this_round=current)
            else:  # a bug, not the device's input: say so, and the edge carries on
                log.error("%s: fetching the update of %s failed", self.name, where,
                          exc_info=error)  # fmt: skip
                self._refuse(msg, "fetch_failed", f"{where}: {type(error).__name__}: {error}",
                             this_round=current)  # fmt: skip
            return
        if not current or self.closed:
            self._refuse(msg, "late", f"{where}: its blob arrived after the round closed",
                         this_round=current)  # fmt: skip
            return
        reason = self._check_update(msg)  # again: the round's sums moved while it downloaded
        if reason:
            self._refuse(msg, reason, where)
            return
        size = msg.update_ref.size if msg.update_ref is not None else 0
        self.trace.event("update_fetched", msg.round, device=msg.device, bytes=size)
        update = Update(msg.device, tensors, msg.n_samples, tuple(msg.label_counts))
        if self.fold is not None:
            try:
                self.fold.add(update)
            except Exception as err:  # the spec was checked: a bug, or an algorithm's refusal
                log.exception("%s: folding the update of %s failed", self.name, where)
                self._refuse(msg, "bad_update", f"{where}: {type(err).__name__}: {err}")
                return
        # forwarded to the cloud at the close where the cloud sees every upload
        keep = self.algorithm.traffic.cloud_sees == "every_upload"
        self.updates[msg.device] = update if keep else replace(update, tensors={})
        self.upload_parts[msg.device] = self.algorithm.format.upload_parts(tensors)
        # from a worker, the close (which may follow) runs once this callback has returned:
        # nothing up the stack then keeps the folded upload's bytes alive through it
        self._accept(msg, defer_close=job is not None)

    def _accept(self, msg: DeviceUpdate, *, defer_close: bool = False) -> None:
        """Count a device's update (its blob, if any, already folded); close the round if
        it was the last one expected (on the next turn of the loop with ``defer_close``)."""
        self.reported[msg.device] = msg
        self.reported_n += msg.n_samples
        self.reported_loss += msg.train_loss
        self.reported_seconds += msg.train_seconds
        self.dropped.discard(msg.device)
        self.metrics.updates.labels(outcome="accepted").inc()
        self.metrics.training_seconds.observe(msg.train_seconds)
        if defer_close:
            self.ep.call_later(0.0, self._maybe_close)
        else:
            self._maybe_close()

    @property
    def assigned(self) -> list[str]:
        """Devices training here this round (those that joined, when devices choose)."""
        if self.selecting:
            return sorted(self.joined)
        return self.candidates

    def _maybe_close(self) -> None:
        if self.closed:
            return
        settled = set(self.reported) | self.dropped | self.elsewhere
        if all(d in settled for d in self.candidates):
            self._close()

    @staticmethod
    def _check_counts(counts: list[int]) -> str:
        """Why the cloud's record of this edge's label counts cannot be taken back ("" if fine)."""
        problem = histogram_problem(counts)
        if problem:
            return problem
        if sum(counts) > MAX_COUNT:
            return f"{sum(counts)} samples > {MAX_COUNT}"
        return ""

    def _check_update(self, msg: DeviceUpdate) -> str:
        if msg.session != self.session:
            return "stale_session"
        if msg.round == self.round and (msg.device in self.reported or msg.device in self.fetching):
            return "duplicate"
        if self.round is None or msg.round != self.round or self.closed:
            return (
                "late" if self.round is not None and msg.round <= self.round else "unexpected_round"
            )
        if msg.device not in self.assigned:
            return "unexpected_device"
        if histogram_problem(msg.label_counts, msg.n_samples):
            return "bad_label_counts"
        registered = self.registered.get(msg.device)
        if registered is not None and tuple(msg.label_counts) != registered:
            return "counts_not_registered"  # a device's data does not change between rounds
        if msg.n_samples == 0:
            return "zero_samples"  # nothing to weight it by; all-zero weights cannot aggregate
        # what the round's EdgeUpdate sums must stay within its schema (a sum that overflows
        # would otherwise only fail when the round closes)
        pending = sum(n for n, _ in self.pending.values()) + self.carried[0]
        if self.acc_n + pending + self.reported_n + msg.n_samples > MAX_COUNT:
            return "too_many_samples"
        if not math.isfinite(self.reported_loss + msg.train_loss):
            return "bad_loss"
        if not math.isfinite(self.reported_seconds + msg.train_seconds):
            return "bad_train_seconds"
        return ""

    def _on_deadline(self) -> None:
        if self.closed:
            return
        log.warning(
            "%s round %s deadline: %d/%d updates",
            self.name,
            self.round,
            len(self.reported),
            len(self.assigned),
        )
        self._close()

    # -- close and report --------------------------------------------------------------
    def _close(self) -> None:
        """Aggregate and report the open round; on any failure the round is closed without
        a report (logged and counted as ``close_failed``) and the edge's state is unchanged,
        so it takes the next round as usual."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.closed = True
        try:
            closed = self._close_report()
        except Exception as err:  # one bad round must not stop the edge
            log.exception("%s could not close round %s", self.name, _shown(self.round))
            self.reject("close_failed", f"round {_shown(self.round)}: {type(err).__name__}: {err}")
            self.pending = {}  # this round's work is not recorded: no chain continues
            return
        # everything is computed: only now does the edge's state change
        self.model, self.model_ref = closed.model, closed.model_ref
        self.acc_n, self.acc_counts = closed.acc_n, closed.acc_counts
        self.acc_parts = closed.acc_parts
        self.pending, self.pending_round = closed.pending, self.round
        if closed.cloud_round:
            self.carried = _no_work()  # the period it was served in has ended
        self.send(self.topics.edge_up(self.name), closed.report)
        self.trace.event("reported", closed.report.round)
        if closed.report.model_ref is not None:
            self.report_sha = closed.report.model_ref.sha256
        self.metrics.round.set(closed.report.round + 1)  # rounds completed
        self._publish_state()
        del closed
        release_memory()  # the round's buffers are freed: give their pages back

    def _close_report(self) -> _Closed:
        """The round's edge model, its blob ref, the EdgeUpdate to send, the accumulated
        counts and the devices' pending work after it; changes no state of the edge (raises
        when the round cannot be closed).

        The accumulated counts (the cloud's n_e and q_e of eq. 22) grow by the work
        aggregated into the edge model: in an aggregation round, each aggregated device's
        samples for this round and for the rounds just before in which it trained here
        without uploading (a device continues its own model only from the round before, at
        the same edge); a round without uploads only extends those devices' pending work.
        Work that never reaches the edge model (a device not asked again, or whose upload is
        discarded) is never counted, so an edge that aggregated nothing since the cloud's
        last aggregation sends no model. The report's counts add the pending work, and what
        a restarted edge served before its restart (:attr:`carried`), to the accumulated
        counts: the load edge selection (eq. 25) sees. At a cloud round, which is an
        aggregation round (r_e divides r_g), nothing is pending and nothing carried is
        added: the counts are then eq. 22's n_e and q_e, the work the edge model holds."""
        if self.round is None or self.model is None or self.session is None:
            raise RuntimeError("edge closed a round it never opened")
        agg_start = time.perf_counter()
        model, model_ref = self.model, self.model_ref
        enough = len(self.reported) >= min(self.cfg.federation.min_updates, len(self.assigned))
        contributors = self.reported
        discarded = 0
        if self.upload and self.fold is not None and len(self.fold) and enough:
            model = self.fold.result()  # independent of the order the updates came in
            self.fold = None  # its running sum is not needed past the result
            model_ref = None
            self.trace.event("aggregated", self.round)
            self.metrics.aggregation_seconds.observe(time.perf_counter() - agg_start)
        elif self.upload and not enough and self.reported:
            # their updates are discarded, so neither are their samples counted nor are
            # they reported as contributors
            contributors, discarded = {}, len(self.reported)
            self.reject(
                "too_few_updates",
                f"round {self.round + 1}: {discarded} update(s) < min_updates "
                f"{self.cfg.federation.min_updates}; discarded",
            )
        # pending work left by the round just before (a chain of rounds without upload)
        before = self.pending if self.pending_round == self.round - 1 else {}
        none = _no_work()
        work = {  # each contributor's, pending included
            device: _plus(before.get(device, none), msg.n_samples, msg.label_counts)
            for device, msg in contributors.items()
        }
        pending = {} if self.upload else work
        acc: Pending = (self.acc_n, list(self.acc_counts))
        acc_parts = None if self.acc_parts is None else dict(self.acc_parts)
        if self.upload:
            for device, (n, counts) in work.items():
                acc = _plus(acc, n, counts)
                parts = self.upload_parts.get(device)
                if acc_parts is not None and parts is not None:
                    for part in parts:
                        acc_parts[part] += n
        cloud_round = (self.round + 1) % self.cfg.federation.cloud_every == 0
        ref = None
        if cloud_round and acc[0] and self.algorithm.traffic.uplink != "none":
            shared = self.algorithm.format.shared_spec(self.spec)  # the rest is the global's
            ref = self.put_tensors(
                model if shared is None else {k: model[k] for k in shared}, "edge_update"
            )
        losses = [(m.train_loss, m.n_samples) for m in contributors.values()]
        served = acc if cloud_round else _plus(acc, *self.carried)
        for n, counts in pending.values():
            served = _plus(served, n, counts)
        report = EdgeUpdate(
            round=self.round,
            session=self.session,
            edge=self.name,
            model_ref=ref,
            n_samples=served[0],
            label_counts=served[1],
            devices=sorted(contributors),
            mean_loss=sum(lo for lo, _ in losses) / len(losses) if losses else None,
            train_seconds=sum(m.train_seconds for m in contributors.values()),
            rejected=self.rejected_this_round + discarded,
            part_samples=acc_parts,
            accuracy=_accuracies(contributors),
            forwarded=self._forward(contributors) if cloud_round else None,
        )
        log.info(
            "%s: round %d/%d closed in %.2f s: %d update(s), %d rejected, loss %s%s",
            self.name, self.round + 1, self.cfg.run.rounds, time.perf_counter() - agg_start,
            len(contributors), report.rejected,
            "-" if report.mean_loss is None else f"{report.mean_loss:.4f}",
            f", {ref.size / 1024:.1f} KiB to the cloud" if ref is not None else "",
        )  # fmt: skip
        return _Closed(model, model_ref, report, *acc, acc_parts, pending, cloud_round)

    def _forward(self, contributors: dict[str, DeviceUpdate]) -> list[Forwarded] | None:
        """Each contributor's own upload, served by this edge, for an algorithm whose cloud
        sees every device's upload (``traffic.cloud_sees = "every_upload"``)."""
        if self.algorithm.traffic.cloud_sees != "every_upload":
            return None
        return [
            Forwarded(
                device=d,
                update_ref=self.put_tensors(self.updates[d].tensors, "forwarded_update"),
                n_samples=contributors[d].n_samples,
            )
            for d in sorted(contributors)
            if d in self.updates
        ]

    def _publish_state(self) -> None:
        state = EdgeState(
            edge=self.name,
            round=self.round,
            n_samples=self.acc_n,
            label_counts=self.acc_counts,
            devices_last_round=len(self.reported),
        )
        self.send(self.topics.edge_state(self.name), state, retain=True)


def _accuracies(contributors: dict[str, DeviceUpdate]) -> dict[str, DeviceAccuracy] | None:
    """The contributors' classifier accuracies (None when none reported one)."""
    out = {
        d: DeviceAccuracy(before=m.acc_before, after=m.acc_after)
        for d, m in sorted(contributors.items())
        if m.acc_after is not None
    }
    return out or None
