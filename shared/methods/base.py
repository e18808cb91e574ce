"""The algorithm interface: device, edge and cloud parts of one algorithm in one class.

Services own the rounds and the wire; algorithms own the maths. A subclass lives in its
method's package (``shared/methods/<name>/``) and is named in the registry
(:mod:`shared.methods.registry`).

What travels is a *state*: the model's tensors plus whatever extra tensors the algorithm
keeps beside them (SCAFFOLD's server control variate, under its own prefix). The cloud
starts from :meth:`Algorithm.init_global`; every role derives the state's names and shapes
from the model spec with :meth:`Algorithm.global_spec`, so validation needs no trust in the
sender. A device loads the state into its module with :meth:`Algorithm.device_load` and
keeps anything that must survive between rounds (local model parts, control variates, the
previous local model) in ``DeviceContext.state``, which the device agent owns.
"""

from __future__ import annotations

import copy
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from shared.config import RunConfig, TrainSection
from shared.diffusion.schedule import make_train_scheduler
from shared.diffusion.training import (
    TrainResult,
    make_optimizer,
    placed,
    resolve_device,
    train_classifier,
    train_local,
)
from shared.errors import ConfigError
from shared.methods.aggregation import TensorDict, WeightedSum
from shared.models.classifier import accuracy, is_classifier
from shared.models.oneshot import FeatureMatch, is_oneshot, latent_dim
from shared.models.plan import ChannelPlan
from shared.settings import AlgorithmConfig
from shared.wire.codec import TensorSpec

log = logging.getLogger(__name__)


#: ``DeviceContext.state`` key of the kept optimizer state (``train.optimizer_state = "keep"``):
#: (trainable parameter shapes, the optimizer's state dict on the CPU)
OPTIMIZER_STATE = "optimizer.state"


@dataclass(frozen=True)
class Update:
    """One contribution to an aggregation: tensors plus the weights' ingredients."""

    source: str
    tensors: TensorDict
    n_samples: int
    label_counts: tuple[int, ...]
    #: samples behind each model part (:meth:`Algorithm.upload_parts`); None: ``n_samples``
    #: for every part
    part_samples: Mapping[str, int] | None = None


class Fold(ABC):
    """One aggregation fed an update at a time (:meth:`Algorithm.edge_fold`,
    :meth:`Algorithm.cloud_fold`): an aggregator adds each verified update as it arrives
    and asks for the result when its round closes. The result must not depend on the order
    of the updates (the same seed gives the same model on every bus)."""

    #: updates are folded as they come and dropped; False: every update is held until
    #: :meth:`result` (an aggregation that cannot stream)
    streams: ClassVar[bool] = True

    def __init__(self) -> None:
        self.sources: list[str] = []

    def add(self, update: Update) -> None:
        """Fold ``update`` in."""
        self._add(update)
        self.sources.append(update.source)

    @abstractmethod
    def _add(self, update: Update) -> None: ...

    @abstractmethod
    def result(self) -> TensorDict:
        """The aggregate of the updates added (at least one)."""

    def __len__(self) -> int:
        return len(self.sources)


class HeldFold(Fold):
    """An aggregation that cannot stream: it holds every update and hands them, sorted by
    source (an order independent of arrival), to ``combine``."""

    streams = False

    def __init__(self, combine: Callable[[Sequence[Update]], TensorDict]) -> None:
        super().__init__()
        self.combine = combine
        self.updates: list[Update] = []

    def _add(self, update: Update) -> None:
        self.updates.append(update)

    def result(self) -> TensorDict:
        return self.combine(sorted(self.updates, key=lambda u: u.source))


class MeanFold(Fold):
    """FedAvg's aggregation streamed: the sample-weighted mean of the updates' tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.sum = WeightedSum()

    def _add(self, update: Update) -> None:
        self.sum.add(update.tensors, float(update.n_samples), key=update.source)

    def result(self) -> TensorDict:
        out = self.sum.mean()
        self.sum.recycle()  # its buffers serve the next round's sum
        return out


def fold_all(fold: Fold, updates: Sequence[Update]) -> TensorDict:
    """``fold`` fed every update of ``updates``: its result."""
    for u in updates:
        fold.add(u)
    return fold.result()


@dataclass
class DeviceContext:
    """Everything a device's local step may use: its private data, its own RNG, the round's
    placement and the algorithm's per-device state (kept by the device across rounds)."""

    device: str
    data: torch.Tensor
    labels: torch.Tensor
    generator: torch.Generator
    round: int = 0
    edge: str = ""
    peers: list[str] = field(default_factory=list)  # devices training at this edge (sorted)
    seed: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    #: the device's own test split (classifiers report their accuracy on it); None: none
    test_data: torch.Tensor | None = None
    test_labels: torch.Tensor | None = None


@dataclass(frozen=True)
class Accuracy:
    """A classifier's accuracy on its device's test split before and after a local round
    (``before`` is None when the round started from no model worth measuring)."""

    before: float | None
    after: float


@dataclass(frozen=True)
class LocalResult:
    """Outcome of a device round; ``tensors`` is None when the round uploads nothing."""

    tensors: TensorDict | None
    train: TrainResult
    #: a classifier's accuracy on the device's test split (None for generators)
    accuracy: Accuracy | None = None


@dataclass
class FinalResult:
    """What a one-shot algorithm's cloud makes after its last round
    (:meth:`Algorithm.finalize`): the model it deploys (a classifier's state for FedDEO),
    that model's preset, and a report (accuracy per domain, ...)."""

    model: TensorDict
    preset: str
    report: dict[str, Any] = field(default_factory=dict)


def optimizer_state_on_cpu(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with every tensor copied to the CPU."""
    return {
        "state": {
            i: {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                for k, v in entry.items()}
            for i, entry in state["state"].items()
        },
        "param_groups": copy.deepcopy(state["param_groups"]),
    }  # fmt: skip


def _shapes(opt: torch.optim.Optimizer) -> tuple[tuple[int, ...], ...]:
    """The shapes of the parameters ``opt`` updates, in order."""
    return tuple(tuple(p.shape) for group in opt.param_groups for p in group["params"])


def _resumed_optimizer(
    ctx: DeviceContext, model: nn.Module, cfg: TrainSection
) -> torch.optim.Optimizer:
    """A new optimizer on ``model``'s trainable parameters, starting from the state the
    device's last round kept when it was for the same parameter shapes."""
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
    kept = ctx.state.get(OPTIMIZER_STATE)
    if kept is not None and kept[0] == _shapes(opt):
        # a copy: loading on the same device aliases the tensors, and the entry must stay
        # as it was if this round diverges (the agent restores ctx.state)
        opt.load_state_dict(copy.deepcopy(kept[1]))
    elif kept is not None:
        log.info("%s: model shapes changed; optimizer state starts afresh", ctx.device)
    return opt


def model_state(module: nn.Module) -> TensorDict:
    """Detached copies of a module's state dict (what a device uploads by default)."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class Algorithm(ABC):
    """A federated algorithm: ``device_round`` on devices, ``edge_aggregate`` on edges,
    ``cloud_aggregate`` on the cloud. Instances hold only their own role's state."""

    name: ClassVar[str]
    #: the class of this algorithm's settings (its keys under ``[algorithm]``), the one the
    #: registry names for :attr:`name`
    config_class: ClassVar[type[AlgorithmConfig]]
    #: devices may upload a subset of the upload spec (FedDiffuse USPLIT)
    partial_uploads: ClassVar[bool] = False
    #: entries of a device's ``ctx.state`` that are caches, rebuilt when missing: a device
    #: agent's state file (``--state-dir``) leaves them out; every other entry is stored
    device_cache_keys: ClassVar[frozenset[str]] = frozenset()
    #: local training may run on a GPU (``compute.device``). Every registered algorithm
    #: does: one whose hooks hold tensors of their own (control variates, anchors, twin
    #: models) moves them to :attr:`training_device` before it trains. A subclass that
    #: cannot sets False and trains on the CPU (with a warning) whatever the setting.
    supports_cuda: ClassVar[bool] = True

    #: devices upload their model each aggregation round; False (Local-only): nothing
    #: travels up, and edges accept reports without a model
    uploads: ClassVar[bool] = True
    #: the blob kind of a device's upload (accounting counts bytes per kind)
    upload_kind: ClassVar[str] = "device_update"
    #: the cloud needs every device's own upload, not only the edges' averages (pFedGPA):
    #: edges forward each one (``EdgeUpdate.forwarded``) and the cloud hands them to
    #: :meth:`personalize`
    per_device_updates: ClassVar[bool] = False
    #: how :meth:`personalize` made the devices' models (``PersonalModel.mode``)
    personal_mode: Literal["inversion", "generation", "guidance"] = "inversion"

    #: this algorithm's settings, as the run config holds them
    settings: AlgorithmConfig

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.settings = self.config_class.of(cfg)
        self.scheduler = make_train_scheduler(cfg.diffusion)
        self._device: torch.device | None = None  # resolved at the first local round

    def train(self, ctx: DeviceContext, model: nn.Module, **hooks: Any) -> TrainResult:
        """:func:`~shared.diffusion.training.train_local` on the device's images and labels with
        this algorithm's schedule and generator, on :attr:`training_device`; ``hooks``:
        ``extra_loss``, ``loss_fn``, ``grad_hook``. Tensors the hooks hold must already be on
        that device; the model is on the CPU again on return.

        With ``train.optimizer_state = "keep"`` the optimizer starts from the state this
        device's last round left in ``ctx.state`` (a copy, on the CPU) and leaves its own
        there; a state for other parameter shapes (before pruning) is dropped."""
        device = self.training_device
        if is_classifier(model):
            return self._train_classifier(ctx, model, device, **hooks)
        match = self.objective(ctx, model, device)
        if match is not None:
            if hooks.get("loss_fn") is not None:
                raise ConfigError(f"{self.name} has its own loss; it trains U-Nets only")
            hooks["loss_fn"] = match
        keep = self.cfg.train.optimizer_state == "keep"
        # a kept state is loaded where the model trains (train_local's own move is then a no-op)
        with placed(model, device if keep and device.type != "cpu" else None):
            opt = _resumed_optimizer(ctx, model, self.cfg.train) if keep else None
            result = train_local(
                model, ctx.data, self.cfg.train, self.scheduler, ctx.generator,
                labels=ctx.labels, device=device, optimizer=opt, **hooks,
            )  # fmt: skip
            if opt is not None:
                kept = optimizer_state_on_cpu(opt.state_dict())
                ctx.state[OPTIMIZER_STATE] = (_shapes(opt), kept)
        if match is not None:
            match.keep(ctx.state)
        return result

    def _train_classifier(
        self, ctx: DeviceContext, model: nn.Module, device: torch.device, **hooks: Any
    ) -> TrainResult:
        """Cross-entropy LocalUpdate of a classifier (no DDPM hooks apply to it)."""
        if any(h is not None for h in hooks.values()):
            raise ConfigError(f"{self.name}: a classifier trains with cross-entropy only")
        keep = self.cfg.train.optimizer_state == "keep"
        with placed(model, device if keep and device.type != "cpu" else None):
            opt = _resumed_optimizer(ctx, model, self.cfg.train) if keep else None
            loss, steps, seconds = train_classifier(
                model, ctx.data, ctx.labels, self.cfg.train, ctx.generator,
                device=device, optimizer=opt,
            )  # fmt: skip
            if opt is not None:
                kept = optimizer_state_on_cpu(opt.state_dict())
                ctx.state[OPTIMIZER_STATE] = (_shapes(opt), kept)
        return TrainResult(loss, steps, seconds)

    def test_accuracy(self, ctx: DeviceContext, model: nn.Module) -> float | None:
        """``model``'s accuracy on the device's own test split (None for a generator or a
        device without one)."""
        if not is_classifier(model) or ctx.test_data is None or ctx.test_labels is None:
            return None
        return accuracy(model, ctx.test_data, ctx.test_labels)

    def measures_accuracy(self, round_: int) -> bool:
        """Whether devices measure their classifier's accuracy in ``round_``: every
        ``eval.every`` rounds and in the last one (only the last with ``eval.every = 0``)."""
        every = self.cfg.eval.every
        return round_ + 1 >= self.cfg.run.rounds or bool(every and (round_ + 1) % every == 0)

    def classify_round(self, ctx: DeviceContext, model: nn.Module, *, upload: bool) -> LocalResult:
        """A classifier's round: accuracy of the model received, the LocalUpdate, accuracy
        after it; the model's tensors when ``upload``."""
        measure = self.measures_accuracy(ctx.round)
        before = self.test_accuracy(ctx, model) if measure else None
        result = self.train(ctx, model)
        after = self.test_accuracy(ctx, model) if measure else None
        acc = None if after is None else Accuracy(before, after)
        return LocalResult(model_state(model) if upload else None, result, acc)

    def objective(
        self, ctx: DeviceContext, model: nn.Module, device: torch.device
    ) -> FeatureMatch | None:
        """The loss a one-shot generator trains with (the feature-matching objective, its
        state kept in ``ctx.state``; on ``device``); None for a U-Net (the DDPM loss)."""
        if not is_oneshot(model):
            return None
        nz = latent_dim(model)
        return FeatureMatch.for_device(ctx.state, ctx.data, nz, self.cfg.train.ama_lr, device)

    @property
    def training_device(self) -> torch.device:
        """The device :meth:`train` runs local training on: ``compute.device`` resolved
        once, at the first use (the CPU for an algorithm without :attr:`supports_cuda`)."""
        if self._device is None:
            self._device = self._training_device()
        return self._device

    def _training_device(self) -> torch.device:
        """``compute.device`` for this algorithm (said once in the log)."""
        device = resolve_device(self.cfg.compute.device)
        if device.type != "cpu" and not self.supports_cuda:
            log.warning("%s trains on the CPU: its local terms do not run on %s yet",
                        self.name, device)  # fmt: skip
            return torch.device("cpu")
        if device.type == "cuda":
            log.info("local training on %s (%s)", device, torch.cuda.get_device_name(device))
        return device

    # -- shapes of what travels -------------------------------------------------------------
    def init_global(self, model: TensorDict) -> TensorDict:
        """The cloud's first global state from the initial model's tensors."""
        return dict(model)

    def global_spec(self, model_spec: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        """Names/shapes of the global (and edge) state for a model of ``model_spec``."""
        return dict(model_spec)

    def upload_spec(self, global_spec: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        """Names/shapes a device may upload (all of them when ``partial_uploads``)."""
        return dict(global_spec)

    #: part of the model stays on each device and is never federated (FedDiffuse
    #: ULATDEC/UDEC): only :meth:`shared_spec` travels once a role holds the rest, and a
    #: device's model (:meth:`client_state`) differs from the global one
    local_parts: bool = False

    def shared_spec(self, global_spec: Mapping[str, TensorSpec]) -> dict[str, TensorSpec] | None:
        """The tensors federation changes, when that is a strict subset of the state: the
        rest keeps its initial value on the cloud and the edges and lives on each device
        (:attr:`local_parts`). Roles that already hold the rest download and upload only
        these. None (without local parts): the whole state travels."""
        return None

    def device_holds_rest(self, ctx: DeviceContext, global_spec: Mapping[str, TensorSpec]) -> bool:
        """Whether the device holds every tensor outside :meth:`shared_spec` for a state of
        ``global_spec`` (it may then download only the shared tensors)."""
        return False

    def client_state(
        self, global_state: TensorDict, device_state: Mapping[str, Any]
    ) -> TensorDict | None:
        """The model a device generates with, from the global state and the device's own
        :attr:`DeviceContext.state`; None (the default) when that is the global model."""
        return None

    #: the model parts whose samples the edges count (``EdgeUpdate.part_samples``), when
    #: devices upload parts of the state; empty: every upload covers the whole state
    part_names: tuple[str, ...] = ()

    def upload_parts(self, tensors: Mapping[str, Any]) -> frozenset[str]:
        """The parts (of :attr:`part_names`) a device's upload covers. The edge sums each
        part's samples over a cloud period so the cloud weights every part by its reporters."""
        return frozenset(self.part_names)

    # -- device -----------------------------------------------------------------------------
    def needs_download(self, ctx: DeviceContext) -> bool:
        """Whether the device downloads the edge's model this round (Local-only: only
        until it holds its own)."""
        return True

    def device_load(self, ctx: DeviceContext, model: nn.Module, state: TensorDict) -> None:
        """Put the edge's state into the device's module (default: the whole model; only
        the :meth:`shared_spec` tensors when :meth:`device_holds_rest` said so)."""
        model.load_state_dict(state)

    @abstractmethod
    def device_round(
        self, ctx: DeviceContext, model: nn.Module, round_: int, *, upload: bool
    ) -> LocalResult:
        """Train ``model`` (already holding the edge model) on the device's data."""

    # -- edge and cloud -----------------------------------------------------------------------
    @abstractmethod
    def edge_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        """Combine device updates into the edge state (``current`` is the edge's state)."""

    @abstractmethod
    def cloud_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        """Combine edge states into the global state."""

    #: the aggregation is a plain weighted mean that never reads or writes the roles' own
    #: state: the edge and the cloud then read their model in place from the blob they
    #: serve it from (one copy of it in memory, not two)
    aggregation_stateless: ClassVar[bool] = False

    def edge_fold(self, current: TensorDict) -> Fold:
        """The edge's aggregation of one round, fed an update at a time (``current`` is the
        edge's state). By default it holds every update for :meth:`edge_aggregate`; an
        algorithm whose aggregation streams returns a fold that keeps a running sum."""
        return HeldFold(lambda updates: self.edge_aggregate(updates, current))

    def cloud_fold(self, current: TensorDict) -> Fold:
        """:meth:`edge_fold` for the cloud's aggregation of the edges' states."""
        return HeldFold(lambda updates: self.cloud_aggregate(updates, current))

    def materialize(self, state: TensorDict) -> TensorDict:
        """The model's tensors a state stands for, as the roles and export build a module
        from it (the cloud's global module, evaluation, ONNX export, deployment). The
        default: the state itself (it holds the model's tensors; extra ones are ignored)."""
        return state

    def origin(self) -> str | None:
        """What the first global state derives from besides ``model.init`` (PRISM: its
        key, by fingerprint), recorded in checkpoints: a resume under another origin is
        refused. None: nothing else."""
        return None

    def card_entry(self, module: nn.Module) -> dict[str, Any]:
        """What this algorithm records about a model it produced in the model card, under
        its name (PRISM: bits per weight, mask density, the key's fingerprint); nothing by
        default."""
        return {}

    def round_report(self, round_: int, state: TensorDict) -> dict[str, float]:
        """Figures of the cloud's state at the end of round ``round_``, recorded per round
        (the run's metrics, its summary and Prometheus); none by default."""
        return {}

    def round_limit(self, rounds: int) -> int:
        """How many of the configured ``rounds`` the run may train: an algorithm with a
        budget (a privacy budget) ends the run earlier; all of them by default."""
        return rounds

    def personalize(
        self, round_: int, uploads: Mapping[str, TensorDict], state: TensorDict
    ) -> Mapping[str, TensorDict] | None:
        """With :attr:`per_device_updates`: each device's own model for the next round from
        the devices' uploads of round ``round_`` (sorted by device) and the new global
        ``state``, sent to each device privately (``Topics.device_down``); None: the
        devices train the global model. Called on the cloud after :meth:`cloud_aggregate`;
        it may take long (a worker runs it off the cloud's message loop)."""
        return None

    def mode_of(self, device: str) -> Literal["inversion", "generation", "guidance"]:
        """How :meth:`personalize` made ``device``'s last model (``PersonalModel.mode``)."""
        return self.personal_mode

    def save_cloud_state(self, directory: Path, round_: int) -> None:  # noqa: B027
        """Write what the cloud's part of this algorithm keeps besides the global state (an
        algorithm's own files in ``directory``, beside the checkpoint of ``round_``),
        atomically; nothing by default. Never exported or published."""

    def load_cloud_state(self, directory: Path, round_: int) -> None:  # noqa: B027
        """Take back what :meth:`save_cloud_state` wrote with the checkpoint of ``round_``
        (a resumed cloud); nothing by default."""

    def device_personal(self, ctx: DeviceContext, model: nn.Module, tensors: TensorDict) -> None:
        """Load the personal model the cloud sent this device (instead of the edge's)."""
        model.load_state_dict(tensors)

    #: the cloud calls :meth:`finalize` after the last round, before it deploys
    one_shot: ClassVar[bool] = False

    def finalize(
        self,
        state: TensorDict,
        out_dir: Path | None,
        *,
        on_progress: Callable[[str, int, int], None] | None = None,
    ) -> FinalResult | None:
        """With :attr:`one_shot`: the model the run deploys, made on the cloud from the
        final ``state`` (FedDEO: a classifier trained on images generated from the devices'
        descriptions); files for people in ``out_dir``; ``on_progress(phase, done, total)``
        as it goes. Runs in a worker thread, off the cloud's message loop. None by default."""
        return None

    def after_cloud_aggregate(
        self, round_: int, state: TensorDict, plan: ChannelPlan | None
    ) -> tuple[TensorDict, ChannelPlan | None]:
        """Hook after the cloud aggregated round ``round_`` (FedPhD prunes here); also
        called with ``round_ = -1`` on the initial state before round 0. Returns the state
        and the architecture plan (None = the dense preset)."""
        return state, plan
