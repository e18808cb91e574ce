"""The cloud aggregator service (DESIGN section 2).

Waits for device registrations, then runs synchronous rounds: samples participants with
ratio kappa from its own seeded RNG, assigns each to its edge, sends the global model when
there is a new one, collects one report per edge (deadline-bounded), aggregates every
``r_g`` rounds with the algorithm's cloud step and checkpoints atomically. Flat FL is the
one-edge case. No algorithm maths here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from cloud.checkpoints import CloudCheckpoints
from cloud.products import CloudProducts
from cloud.rounds import (
    RoundSummary,
    check_round_start_fits,
    largest_round_start,
    sample_participants,
)
from cloud.state import INIT_FROM_CONFIG, ReportBlobs, new_session
from shared.data.datasets import NUM_CLASSES, histogram_problem
from shared.errors import CodecError, TransportError
from shared.methods.api import Update
from shared.models.plan import plan_digest, plan_doc
from shared.naming import is_device_of
from shared.runtime.jobs import WorkerJob
from shared.runtime.memory import release_memory
from shared.runtime.service import TensorDict
from shared.wire.codec import TensorSpec, decode_tensors, spec_of
from shared.wire.messages import (
    DeviceHello,
    EdgeUpdate,
    Presence,
    RoundStart,
    cloud_only_home,
    home_of,
)

__all__ = [  # the round's helpers live in cloud.rounds and cloud.state; named here too
    "INIT_FROM_CONFIG",
    "CloudServer",
    "RoundSummary",
    "check_round_start_fits",
    "largest_round_start",
    "new_session",
    "sample_participants",
]

log = logging.getLogger(__name__)

#: seconds after subscribing before the cloud judges who has registered (retained
#: registrations and presence arrive within it)
SETTLE_S = 1.0

FETCH_POLL_S = 0.01  # how often the message thread looks for edge downloads that finished


class CloudServer(CloudProducts, CloudCheckpoints):
    """The cloud: owns the global model and the round counter."""

    def clear_deployment(self) -> None:
        """Clear the retained deployment (an empty retained publish on ``cloud/deploy``): a
        fresh run starts without one, so that its devices do not fetch an earlier run's
        deployment under the same run name, and neither this cloud nor ``estuary status``
        reads the reports about it as this run's. A resumed run keeps it."""
        self.ep.publish(self.topics.cloud_deploy, b"", kind="msg_deployment", retain=True)

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

    def _begin(self) -> None:
        self.started = True
        with self._transition("starting"):
            if self.round >= self.rounds:
                self._finish()
            elif self.algorithm.personalization is not None and self.uploads:
                # resumed with the uploads of the round before (an in-process resume)
                self._personalize(self.round - 1)
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
        self.fetching = {}  # downloads of an earlier round finish and are dropped
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
        self.deadline_at = self.ep.now() + self.cloud_deadline_s
        self.timer = self.ep.call_later(self.cloud_deadline_s, self._on_deadline)

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
        if msg.edge in self.reports or msg.edge in self.fetching:
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
        if not self._forwards_ok(msg):
            return
        home = cloud_only_home(home_of("edge", msg.edge))
        if msg.model_ref is not None and msg.model_ref.src != home:
            # an edge serves its model to the cloud alone: any other source is not its own
            # (asking it would make the cloud fetch from whoever the report names)
            self.reject("foreign_source", f"{msg.edge} round {msg.round + 1}: its model is "
                        f"served by {msg.model_ref.src!r}, not by {home!r}")  # fmt: skip
            return
        if self.ep.bus.blobs_local:  # in-process: nothing to wait for
            try:
                fetched, error = self._report_fetcher(msg, self.cloud_deadline_s, None)(), None
            except (CodecError, TransportError) as err:
                fetched, error = None, err
            self._report_fetched(msg, fetched, error)
            return
        # downloaded off the message thread, within the round's deadline and a stall limit:
        # an edge that reports and then dies (or never serves) holds up nothing else
        left = max(1.0, self.deadline_at - self.ep.now())
        job: WorkerJob[ReportBlobs] = WorkerJob(
            self._report_fetcher(msg, left, self.stall_s),
            self.ep.call_later,
            lambda fetched, err: self._report_fetched(msg, fetched, err, job),
            name=f"cloud-fetch-{msg.edge}",
            poll_s=FETCH_POLL_S,
            join_s=0.0,
            first_join_s=0.0,
        )
        self.fetching[msg.edge] = job
        job.start()

    def _report_fetcher(
        self, msg: EdgeUpdate, timeout_s: float, stall_s: float | None
    ) -> Callable[[], ReportBlobs]:
        """What downloads an edge report's blobs, validated: its model (None when it sent
        none) and the devices' uploads it forwarded, within ``timeout_s`` in all. It raises
        CodecError or TransportError and touches no state of the cloud (it runs in a
        worker): what it needs of that state is read here, on the message thread."""
        forwards = self.algorithm.traffic.cloud_sees == "every_upload"
        upload_spec = self.algorithm.format.upload_spec(self.spec) if forwards else {}
        model_spec = self.algorithm.format.shared_spec(self.spec) or self.spec
        views = self.fold is not None and self.fold.streams
        return lambda: self._fetch_report(msg, timeout_s, stall_s, upload_spec, model_spec,
                                          forwards=forwards, views=views)  # fmt: skip

    def _fetch_report(
        self,
        msg: EdgeUpdate,
        timeout_s: float,
        stall_s: float | None,
        upload_spec: Mapping[str, TensorSpec],
        model_spec: Mapping[str, TensorSpec],
        *,
        forwards: bool,
        views: bool,
    ) -> ReportBlobs:
        end = time.monotonic() + timeout_s

        def left() -> float:
            left_s = end - time.monotonic()
            if left_s <= 0:
                raise TransportError(f"{msg.edge}'s report: past the round's deadline",
                                     reason="timeout")  # fmt: skip
            return left_s

        forwarded: dict[str, TensorDict] = {}
        if forwards:
            for f in msg.forwarded or []:
                forwarded[f.device] = self.load_tensors(
                    f.update_ref, upload_spec, timeout_s=left(), stall_s=stall_s
                )
        tensors, data = None, None
        if msg.model_ref is not None:
            # an edge sends the shared tensors only, where the algorithm has them; folded
            # into the round's aggregation and dropped (not kept in the blob store)
            tensors, data = self.load_blob_tensors(
                msg.model_ref, model_spec, timeout_s=left(), keep=False, views=views,
                stall_s=stall_s,
            )  # fmt: skip
        return tensors, data, forwarded

    def _report_fetched(
        self,
        msg: EdgeUpdate,
        fetched: ReportBlobs | None,
        error: BaseException | None,
        job: WorkerJob[ReportBlobs] | None = None,
    ) -> None:
        """An edge report's blobs arrived (``fetched``) or could not be had (``error``,
        counted by its reason): take the report into the round it came for, if still open."""
        current = job is None or self.fetching.get(msg.edge) is job
        if job is not None and current:
            del self.fetching[msg.edge]
        where = f"{msg.edge} round {msg.round + 1}"
        if error is not None or fetched is None:
            if isinstance(error, (CodecError, TransportError)):
                self.reject(error.reason, f"{where}: {error}")
            else:  # a bug, not the edge's input: say so, and the cloud carries on
                log.error("fetching the report of %s failed", where, exc_info=error)
                self.reject("fetch_failed", f"{where}: {type(error).__name__}: {error}")
            return
        if not current or msg.session != self.session or msg.round != self.round or self.done:
            self.reject("late", f"{where}: its blobs arrived after the round closed")
            return
        if msg.edge in self.reports:
            self.reject("duplicate", where)
            return
        tensors, data, forwarded = fetched
        if tensors is not None:
            size = msg.model_ref.size if msg.model_ref is not None else 0
            self.trace.event("edge_fetched", msg.round, edge=msg.edge, bytes=size)
            if self.fold is not None and msg.n_samples > 0:
                update = Update(msg.edge, tensors, msg.n_samples, tuple(msg.label_counts),
                                msg.part_samples)  # fmt: skip
                try:
                    self.fold.add(update)
                except Exception as err:  # the spec was checked: a bug, or the algorithm's
                    log.exception("folding the model of %s failed", msg.edge)
                    self.reject("bad_update", f"{where}: {type(err).__name__}: {err}")
                    return
                del update
                # the only model so far: its bytes may become the global's (_put_global_as)
                ref = msg.model_ref
                self.first_report = (
                    (ref, data) if len(self.fold) == 1 and ref is not None and data is not None
                    else None
                )  # fmt: skip
        self.reports[msg.edge] = (msg, tensors is not None)
        self.uploads.update(forwarded)
        del tensors, data, fetched  # folded: its bytes are not kept through the close
        self._maybe_close()

    def _forwards_ok(self, msg: EdgeUpdate) -> bool:
        """Whether the devices' uploads an edge forwarded (algorithms with per-device
        updates) can be fetched: each of a device of that edge's report, once, and served
        to the cloud alone; rejected (``bad_forward``) otherwise."""
        if self.algorithm.traffic.cloud_sees != "every_upload" or not msg.forwarded:
            return True
        seen: set[str] = set()
        for f in msg.forwarded:
            if f.device not in msg.devices or f.device in seen:
                self.reject("bad_forward", f"{msg.edge} round {msg.round + 1}: {f.device}")
                return False
            if f.update_ref.src != cloud_only_home(home_of("edge", msg.edge)):
                # served anywhere else, a device of that edge could read another's upload
                self.reject(
                    "bad_forward",
                    f"{msg.edge} round {msg.round + 1}: {f.device}'s "
                    f"upload is served by {f.update_ref.src!r}, not for the cloud alone",
                )
                return False
            seen.add(f.device)
        return True

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
        self.fetching = {}  # a download still under way is for a closed round: dropped
        r = self.round
        agg_seconds = 0.0
        aggregated = False
        trained_arch = plan_digest(self.plan)  # before pruning at this aggregation
        for edge, (m, _) in self.reports.items():
            if edge in self.edge_counts and len(m.label_counts) == NUM_CLASSES:
                self.edge_counts[edge] = list(m.label_counts)
            self.contributions += len(m.devices)
        fold, self.fold = self.fold, None
        first, self.first_report = self.first_report, None
        if fold is not None:
            if len(fold):
                self.metrics.phase.state("aggregating")
                t0 = time.perf_counter()
                self.checkpoints.wait()  # the last checkpoint precedes any state after it
                # the mean of one edge's model is that model: read in place from the bytes
                # it came in (checked then), not copied
                if fold.exact_source() is None or not self._serves_whole_global():
                    first = None  # the aggregate is not one model as it came
                if first is not None:
                    result = decode_tensors(first[1], copy=False, allow_nonfinite=True)
                else:
                    result = fold.result()  # independent of the order the edges reported in
                del fold
                aggregation = self.algorithm.aggregation
                self.model, plan = aggregation.after_cloud_aggregate(r, result, self.plan)
                same_arch = plan_digest(plan) == plan_digest(self.plan)
                if self.model is not result or not same_arch:
                    first = None  # the method changed it: encoded and hashed as any global
                if not same_arch:
                    self.plan, self.spec = plan, spec_of(self.model)
                    self.metrics.model_params.set(self.model_params())
                    log.info("global architecture is now %s", plan_digest(plan))
                agg_seconds = time.perf_counter() - t0
                self.metrics.aggregation_seconds.observe(agg_seconds)
                if first is not None:  # its bytes are the global
                    self._put_global_as(*first, model=result)
                else:
                    self.global_put = False
                    self._put_global()  # the blob's hash is the model's digest
                del first, result
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
