"""The cloud's state (DESIGN section 2): the global model and its architecture, the round
counter, the registered devices and the open round, with what the rest of the cloud builds
on (its announcement, its blob, its deadline)."""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from cloud.personal import PersonalizeJob
from cloud.rounds import RoundSummary
from shared.config import RunConfig
from shared.data.datasets import NUM_CLASSES
from shared.errors import EstuaryError
from shared.evaluation.evaluator import model_from_state
from shared.methods.api import FinalResult, Fold, Method, origin_of
from shared.models.checkpoint import CheckpointWriter, model_digest
from shared.models.init import init_fingerprint
from shared.models.plan import ChannelPlan, build_model, plan_digest
from shared.naming import edge_ids
from shared.runtime.jobs import WorkerJob
from shared.runtime.service import RoleService, TensorDict
from shared.transport.bus import Bus, Timer
from shared.wire.codec import Blob, decode_tensors, spec_of
from shared.wire.messages import (
    BlobRef,
    CloudState,
    DeviceHello,
    EdgeUpdate,
)

log = logging.getLogger(__name__)

#: what the download of an edge report gives: the edge's model (None: it sent none) and the
#: bytes it was decoded from, and the devices' uploads it forwarded
ReportBlobs = tuple[TensorDict | None, Blob | None, dict[str, TensorDict]]

#: :class:`CloudServer`'s default ``init``: fingerprint the config's ``model.init`` file
INIT_FROM_CONFIG = "from model.init"


def new_session() -> str:
    """A fresh cloud session id (16 hex chars); a restarted cloud gets a new one so edges and
    devices re-run the round it resumes at. An identifier, not a source of randomness for
    the experiment."""
    return secrets.token_hex(8)


class CloudBase(RoleService):
    """The cloud's state and what every part of it reads: the global model, the round, the
    registered devices. :class:`~cloud.service.CloudServer` runs the rounds on it,
    :class:`~cloud.checkpoints.CloudCheckpoints` keeps it on disk and
    :class:`~cloud.products.CloudProducts` makes what the devices get besides the global
    model."""

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
        #: the global before :attr:`global_ref`, released (a late asker reads it from disk);
        #: the one before that is retired when the next global is put
        self.released_global: str | None = None
        self.opened_wall = 0  # the open round's start, Unix time in whole seconds
        self.shared_ref: BlobRef | None = None  # the shared tensors of global_ref's state
        self.assignment: dict[str, list[str]] = {}
        self.participants: list[str] = []
        #: the open round's edge reports, each with whether it carried a model
        self.reports: dict[str, tuple[EdgeUpdate, bool]] = {}
        #: the open round's aggregation, fed each edge's model as it arrives (None in a
        #: round without a cloud aggregation)
        self.fold: Fold | None = None
        #: the fold's first model's ref and bytes while it is the fold's only one: when the
        #: aggregate is that model exactly, its bytes are the new global's
        #: (:meth:`_put_global_as`)
        self.first_report: tuple[BlobRef, Blob] | None = None
        #: the global state's blob is :attr:`global_ref` (False: put it before announcing)
        self.global_put = False
        #: writes each checkpoint while the next round runs (inline on an in-process bus)
        self.checkpoints = CheckpointWriter(background=not bus.blobs_local)
        #: the devices' own uploads of the open round (per-device algorithms), by device
        self.uploads: dict[str, TensorDict] = {}
        self.personal_job: PersonalizeJob | None = None
        #: the open round's edge downloads under way (each in a worker), by edge
        self.fetching: dict[str, WorkerJob[ReportBlobs]] = {}
        #: when the open round's deadline fires (bus clock): no download waits past it
        self.deadline_at = 0.0
        #: a download that receives nothing for this long gives up (as the edges' do)
        self.stall_s = 3 * cfg.broker.chunk_timeout_s
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
        #: called with the round of each checkpoint just before it is written (an in-process
        #: run saves its devices' kept state here, so the checkpoint never precedes them)
        self.on_checkpoint: Callable[[int], None] | None = None
        self.on_round_end = on_round_end
        #: called once the last round is aggregated; it deploys and then calls
        #: :meth:`complete` (the run is "deploying" until then). None: complete at once.
        self.on_trained: Callable[[], None] | None = None
        #: a one-shot algorithm's product (FedDEO's classifier), made after the last round
        #: by :meth:`~shared.methods.api.Finalizer.finalize` in :attr:`final_job`
        self.final: FinalResult | None = None
        self.final_job: WorkerJob[FinalResult | None] | None = None

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

    @property
    def cloud_deadline_s(self) -> float:
        """Seconds after which the cloud closes a round: the edges close theirs at the
        configured deadline, and get time to aggregate and report."""
        return self.cfg.federation.round_deadline_s * 1.5 + 10

    def _put_global(self) -> None:
        """Put the global model as a blob (:attr:`global_ref`) when it changed since."""
        if not self.global_put or self.global_ref is None:
            old = self.global_ref
            shared = self.algorithm.format.shared_spec(self.spec)
            if self._serves_whole_global():
                # a plain mean is never written to: the model is read in place from its
                # blob (one copy of the global in memory, not two)
                data = self.ep.encode_tensors(self.model)
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
                self._retire_global_before(old.sha256)
            self.metrics.model_bytes.set(self.global_ref.size)

    def _serves_whole_global(self) -> bool:
        """Whether the global travels as one blob of the whole model that the cloud reads in
        place (a plain mean, no shared subset): the case :meth:`_put_global_as` serves."""
        return (
            self.algorithm.format.shared_spec(self.spec) is None
            and self.algorithm.aggregation.aggregation_stateless
        )

    def _put_global_as(self, ref: BlobRef, data: Blob, *, model: TensorDict) -> None:
        """Make the blob ``data`` (``ref``: an edge's model the round's aggregate equals bit
        for bit, canonically encoded as every blob is) the global: its bytes are kept and
        served as they are and the model is read in place from them, with no encoding and
        no hashing of the same tensors again (``model``: its tensors, views of ``data``,
        checked when it arrived). The edge that sent it already holds it."""
        old = self.global_ref
        # put in the open (the edge's copy is served to the cloud alone): a blob received
        # into a file is adopted with the hash it was verified against while arriving
        self.global_ref, self.shared_ref = self.put_encoded(data, "global_model"), None
        if self.global_ref.sha256 != ref.sha256:  # a bus that hashes what it stores
            raise EstuaryError(f"the global put as {ref.sha256[:12]}… hashes to "
                               f"{self.global_ref.sha256[:12]}…")  # fmt: skip
        self.model = model
        self.global_put = True
        if old is not None and old.sha256 != self.global_ref.sha256:
            self.ep.release_blob(old.sha256)
            self._retire_global_before(old.sha256)
        self.metrics.model_bytes.set(self.global_ref.size)

    def _retire_global_before(self, released: str) -> None:
        """The global ``released`` was just released: the one released before it is two
        rounds old, and no edge asks for it again; its file takes the next blob the cloud
        receives (:meth:`~shared.transport.bus.Endpoint.retire_blob`)."""
        before, self.released_global = self.released_global, released
        current = None if self.global_ref is None else self.global_ref.sha256
        if before is not None and before not in (released, current):
            self.ep.retire_blob(before)

    def _open_round(self) -> None:
        """Announce the next round (the server's)."""
        raise NotImplementedError
