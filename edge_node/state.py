"""An edge's round state (DESIGN section 2): what it knows of the round it serves."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

from shared.config import RunConfig
from shared.data.datasets import NUM_CLASSES, histogram_problem
from shared.methods.api import Fold, Method, Update
from shared.models.plan import ChannelPlan, model_spec
from shared.runtime.jobs import WorkerJob
from shared.runtime.service import RoleService, TensorDict
from shared.transport.bus import Bus, Timer
from shared.wire.codec import TensorSpec
from shared.wire.messages import (
    MAX_COUNT,
    BlobRef,
    DeviceUpdate,
)

log = logging.getLogger(__name__)

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


class EdgeRoundState(RoleService):
    """What an edge knows of the round it serves: the architecture and specs, the devices
    it expects, what they reported, the running aggregation and the label counts it
    accumulates for the cloud. :class:`~edge_node.updates.UpdateFetching` takes the
    devices' uploads into it and :class:`~edge_node.report.EdgeReporting` closes the round
    from it; :class:`~edge_node.service.EdgeServer` opens rounds."""

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
        #: the report before :attr:`report_sha`, released: retired at the next round start
        self.released_report: str | None = None
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

    def _global_spec(self, plan: ChannelPlan | None) -> dict[str, TensorSpec]:
        return self.algorithm.format.global_spec(model_spec(self.cfg.model.preset, plan))

    def _set_arch(
        self, plan: ChannelPlan | None, spec: dict[str, TensorSpec] | None = None
    ) -> None:
        self.plan = plan
        self.spec = spec if spec is not None else self._global_spec(plan)
        self.update_spec = self.algorithm.format.upload_spec(self.spec)

    def _update_device_gauge(self) -> None:
        online = len(self.my_devices - self.offline)
        self.metrics.devices.labels(edge=self.name).set(online)

    @property
    def assigned(self) -> list[str]:
        """Devices training here this round (those that joined, when devices choose)."""
        if self.selecting:
            return sorted(self.joined)
        return self.candidates

    @staticmethod
    def _check_counts(counts: list[int]) -> str:
        """Why the cloud's record of this edge's label counts cannot be taken back ("" if fine)."""
        problem = histogram_problem(counts)
        if problem:
            return problem
        if sum(counts) > MAX_COUNT:
            return f"{sum(counts)} samples > {MAX_COUNT}"
        return ""

    def _maybe_close(self) -> None:
        """Close the round once every expected device settled (the server's)."""
        raise NotImplementedError

    def _close(self) -> None:
        """Aggregate and report the open round (:class:`~edge_node.report.EdgeReporting`)."""
        raise NotImplementedError
