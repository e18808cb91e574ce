"""The base a method's class builds on: the method interface (:mod:`shared.methods.api`)
implemented by one class holding the method's device, edge and cloud parts, with defaults
for every part a method leaves alone, and the device's local training.

A subclass lives in its method's package (``shared/methods/<name>/``) and is named in the
registry (:mod:`shared.methods.registry`). It is its own :attr:`Algorithm.format`,
:attr:`Algorithm.device` and :attr:`Algorithm.aggregation`; it sets a capability
(``personalization``, ``finalizer``, ``state_view``, ``preparation``, ``central``) to the
object that provides it (itself, or a helper of its package) where it has one.

A device loads the state into its module with :meth:`Algorithm.device_load` and keeps
anything that must survive between rounds (local model parts, control variates, the previous
local model) in ``DeviceContext.state``, which the device agent owns.
"""

from __future__ import annotations

import copy
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

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
from shared.methods.aggregation import HeldFold, MeanFold, TensorDict, fold_all
from shared.methods.api import (
    Accuracy,
    Aggregation,
    CentralTraining,
    DeviceContext,
    DeviceStep,
    Finalizer,
    FinalResult,
    Fold,
    LocalResult,
    Method,
    Personalization,
    Preparation,
    StateFormat,
    StateView,
    Update,
)
from shared.models.classifier import accuracy, is_classifier
from shared.models.oneshot import FeatureMatch, is_oneshot, latent_dim
from shared.models.plan import ChannelPlan
from shared.settings import AlgorithmConfig, Traffic
from shared.wire.codec import TensorSpec

__all__ = [  # what a method's module takes from here (the interface's types included)
    "Accuracy",
    "Algorithm",
    "DeviceContext",
    "FinalResult",
    "Fold",
    "HeldFold",
    "LocalResult",
    "MeanFold",
    "TensorDict",
    "Update",
    "fold_all",
    "model_state",
    "optimizer_state_on_cpu",
]

log = logging.getLogger(__name__)


#: ``DeviceContext.state`` key of the kept optimizer state (``train.optimizer_state = "keep"``):
#: (trainable parameter shapes, the optimizer's state dict on the CPU)
OPTIMIZER_STATE = "optimizer.state"


def optimizer_state_on_cpu(state: dict[str, Any]) -> dict[str, Any]:
    """The state dict of an optimizer its caller is done with, every tensor on the CPU: one
    elsewhere is copied there, one already there is taken as it is (no second copy of the
    moments at the end of a round; the optimizer that held them is dropped)."""
    return {
        "state": {
            i: {k: v.detach().to("cpu") if isinstance(v, torch.Tensor) else v
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
    #: entries of a device's ``ctx.state`` that are caches, rebuilt when missing: a device
    #: agent's state file (``--state-dir``) leaves them out; every other entry is stored
    device_cache_keys: ClassVar[frozenset[str]] = frozenset()
    #: local training may run on a GPU (``compute.device``). Every registered algorithm
    #: does: one whose hooks hold tensors of their own (control variates, anchors, twin
    #: models) moves them to :attr:`training_device` before it trains. A subclass that
    #: cannot sets False and trains on the CPU (with a warning) whatever the setting.
    supports_cuda: ClassVar[bool] = True

    #: this algorithm's settings, as the run config holds them
    settings: AlgorithmConfig
    #: what its rounds move, as its settings declare it
    traffic: Traffic
    #: the optional capabilities (None: the method has none)
    personalization: Personalization | None = None
    finalizer: Finalizer | None = None
    state_view: StateView | None = None
    preparation: Preparation | None = None
    central: CentralTraining | None = None

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.settings = self.config_class.of(cfg)
        self.traffic = self.settings.traffic()
        self.scheduler = make_train_scheduler(cfg.diffusion)
        self._device: torch.device | None = None  # resolved at the first local round

    @property
    def format(self) -> StateFormat:
        """The names and shapes of what travels (this object)."""
        return self

    @property
    def device(self) -> DeviceStep:
        """The device's round (this object)."""
        return self

    @property
    def aggregation(self) -> Aggregation:
        """The edges' and the cloud's aggregation (this object)."""
        return self

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
        """Names/shapes a device may upload (a subset of them with uplink "parts")."""
        return dict(global_spec)

    def shared_spec(self, global_spec: Mapping[str, TensorSpec]) -> dict[str, TensorSpec] | None:
        """The tensors federation changes, when that is a strict subset of the state: the
        rest keeps its initial value on the cloud and the edges and lives on each device
        (``traffic.device_keeps = "local_parts"``). Roles that already hold the rest
        download and upload only these. None (without local parts): the whole state
        travels."""
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

    def part_uplink(self, model_spec: Mapping[str, TensorSpec], per_edge: Sequence[int]) -> float:
        """Parameters a round's uploads carry with uplink "parts"; the whole upload spec of
        every device by default."""
        spec = self.upload_spec(self.global_spec(model_spec))
        return float(sum(per_edge) * sum(math.prod(s.shape) for s in spec.values()))

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

    def round_report(self, round_: int, state: TensorDict) -> dict[str, float]:
        """Figures of the cloud's state at the end of round ``round_``, recorded per round
        (the run's metrics, its summary and Prometheus); none by default."""
        return {}

    def round_limit(self, rounds: int) -> int:
        """How many of the configured ``rounds`` the run may train: an algorithm with a
        budget (a privacy budget) ends the run earlier; all of them by default."""
        return rounds

    def device_personal(self, ctx: DeviceContext, model: nn.Module, tensors: TensorDict) -> None:
        """Load the personal model the cloud sent this device (instead of the edge's)."""
        model.load_state_dict(tensors)

    def after_cloud_aggregate(
        self, round_: int, state: TensorDict, plan: ChannelPlan | None
    ) -> tuple[TensorDict, ChannelPlan | None]:
        """Hook after the cloud aggregated round ``round_`` (FedPhD prunes here); also
        called with ``round_ = -1`` on the initial state before round 0. Returns the state
        and the architecture plan (None = the dense preset)."""
        return state, plan


def _implements(method: Algorithm) -> Method:
    """The base implements the method interface (checked by the type checker)."""
    return method


def build_algorithm(cfg: RunConfig) -> Algorithm:
    """The method ``cfg`` names as its implementation class, for code that exercises a
    method's own steps (tests, benchmarks) rather than the roles' view of it
    (:func:`shared.methods.registry.make_algorithm`)."""
    from shared.methods.registry import make_algorithm

    method = make_algorithm(cfg)
    if not isinstance(method, Algorithm):
        raise TypeError(f"{cfg.algorithm.name} is not built on shared.methods.base.Algorithm")
    return method
