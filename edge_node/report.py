"""An edge's round close and report to the cloud: the aggregate, the label counts it served,
the devices' own uploads forwarded where the cloud sees every one, and its retained state."""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from edge_node.state import EdgeRoundState, Pending, _no_work, _plus, _shown
from shared.runtime.memory import release_memory
from shared.runtime.service import TensorDict
from shared.wire.messages import (
    BlobRef,
    DeviceAccuracy,
    DeviceUpdate,
    EdgeState,
    EdgeUpdate,
    Forwarded,
)

log = logging.getLogger(__name__)


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


def _accuracies(contributors: dict[str, DeviceUpdate]) -> dict[str, DeviceAccuracy] | None:
    """The contributors' classifier accuracies (None when none reported one)."""
    out = {
        d: DeviceAccuracy(before=m.acc_before, after=m.acc_after)
        for d, m in sorted(contributors.items())
        if m.acc_after is not None
    }
    return out or None


class EdgeReporting(EdgeRoundState):
    """The edge's close of a round and its report."""

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
            ref = self.put_cloud_only_tensors(
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
        """Each contributor's own upload, served by this edge to the cloud alone (under
        :func:`~shared.wire.messages.cloud_only_home`, which no device reads), for an
        algorithm whose cloud sees every device's upload (``traffic.cloud_sees =
        "every_upload"``)."""
        if self.algorithm.traffic.cloud_sees != "every_upload":
            return None
        return [
            Forwarded(
                device=d,
                update_ref=self.put_cloud_only_tensors(self.updates[d].tensors, "forwarded_update"),
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
