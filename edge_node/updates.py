"""An edge's uploads: each device's update checked, its blob fetched off the message thread
(a worker per download, a bounded number at once), verified and folded into the round."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace

from edge_node.state import EdgeRoundState
from shared.data.datasets import histogram_problem
from shared.errors import CodecError, MessageError, TransportError
from shared.methods.api import Update
from shared.runtime.jobs import WorkerJob
from shared.runtime.service import TensorDict
from shared.wire.messages import (
    MAX_COUNT,
    DeviceUpdate,
    home_of,
)

log = logging.getLogger(__name__)

FETCH_POLL_S = 0.01  # how often the role thread looks for update downloads that finished


class UpdateFetching(EdgeRoundState):
    """The edge's intake of device updates."""

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
            except MessageError as err:  # the method refused what the upload holds
                self._refuse(msg, err.reason, f"{where}: {err.detail}")
                return
            except Exception as err:  # the spec was checked: a bug
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
