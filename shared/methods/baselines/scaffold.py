"""SCAFFOLD (Karimireddy et al., ICML 2020, Algorithm 1 with option II) on a two-tier
hierarchy, for DDPM training.

What travels
    Global and edge state: the model ``x`` plus the server control variate ``c`` under
    ``scaffold.c.<name>`` (one per floating-point model tensor), so a download is 2x the
    model bytes. A device uploads its local model ``y_i`` plus ``delta c_i`` under
    ``scaffold.dc.<name>``: 2x the model again. Edge -> cloud carries the edge state (2x).

Device (``c_i`` lives in ``DeviceContext.state``, zeros until the first upload)
    Every local step uses the corrected gradient ``g - c_i + c`` (a ``grad_hook``, so the
    correction precedes gradient clipping). After K local steps since the state was loaded
    (K summed over rounds when ``r_e > 1`` keeps the device training its own model),
    option II: ``c_i+ = c_i - c + (x - y_i) / (K * eta)``; upload ``y_i`` and
    ``delta c_i = c_i+ - c_i``; keep ``c_i <- c_i+``. The variates stay on the CPU; the
    correction ``c - c_i`` of the trainable parameters is copied once per round to the
    device that trains (``compute.device``).

Edge e, serving devices S_e in an aggregation
    ``x_e = sum_i n_i y_i / sum_i n_i`` (sample-weighted, as FedAvg; the paper's plain mean
    of ``y_i`` with eta_g = 1 is the equal-sample case) and
    ``c_e = c_e + (|S_e| / N) * mean_{S_e} delta c_i = c_e + (1/N) * sum_{S_e} delta c_i``,
    with ``N = cfg.federation.num_devices`` (all devices, not only those at e).

Cloud, from the edges E that report
    ``x = sum_e n_e x_e / sum_e n_e`` and ``c = c + sum_e (c_e - c)``: each edge started
    the period from the cloud's ``c``, so ``c_e - c`` is exactly that edge's accumulated
    increment, and the cloud adds the increments rather than averaging them. With one edge
    and ``r_e = r_g = 1`` this is the paper's server rule ``c <- c + (|S|/N) mean_S delta c``;
    in general it keeps the invariant ``c = (1/N) sum_{i=1..N} c_i`` over every device,
    which is what makes ``c`` the paper's estimate of the average client direction. Between
    cloud aggregations devices at edge e already see ``c_e`` (their edge's increments only).
    An update lost on the way (deadline, rejected blob) leaves its device's ``c_i`` changed
    without the matching change in ``c``, as in the flat algorithm.

Caveat: SCAFFOLD is defined for SGD with local step size eta. We take ``eta =
cfg.train.lr`` whatever the optimizer; with the configs' Adam (FedPhD's setup) the local
step is not ``eta * g``, so ``(x - y_i) / (K eta)`` estimates Adam's normalized update
direction rather than the raw gradient, and the correction mixes the two scales: on
``configs/scaffold_2class_tiny.toml`` ``||c||_2`` is ~190 (mean |c| ~0.17 per weight)
while ``grad_clip = 1`` then scales the corrected gradient to norm 1, so the correction
dominates the DDPM gradient. This is the baseline as commonly run (FedPhD reports it
underperforming FedAvg for DMs). ``train.optimizer = "sgd"`` with ``train.momentum = 0``
gives the algorithm as defined: option II assumes ``x - y_i = eta * sum_k (g_k - c_i + c)``,
so ``c_i+`` is then exactly the mean raw gradient over the K steps. SGD's default momentum
(0.9) moves ``y_i`` up to ``1 / (1 - 0.9)`` times further, and ``c_i+`` overestimates the
gradient by that factor (4.1x after 10 steps of a constant gradient); the algorithm logs a
warning for that combination.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TypeVar

import torch
from torch import nn

from shared.config import RunConfig
from shared.diffusion.hooks import GradHook
from shared.errors import EstuaryError
from shared.methods.aggregation import WeightedSum
from shared.methods.base import (
    Algorithm,
    DeviceContext,
    Fold,
    LocalResult,
    TensorDict,
    Update,
    fold_all,
    model_state,
)
from shared.methods.baselines.config import ScaffoldConfig
from shared.wire.codec import TensorSpec

C_PREFIX = "scaffold.c."  # server / edge control variate in the state
DC_PREFIX = "scaffold.dc."  # a device's delta c_i in its upload
# DeviceContext.state keys
C_LOCAL = "scaffold.c_i"  # the device's control variate c_i (persists)
C_SERVER = "scaffold.c"  # c received with the last loaded state
X_START = "scaffold.x"  # the model received with the last loaded state
STEPS = "scaffold.steps"  # local steps taken since that state was loaded

V = TypeVar("V")
log = logging.getLogger(__name__)


def split_state(state: Mapping[str, torch.Tensor]) -> tuple[TensorDict, TensorDict]:
    """(model tensors, control variate keyed by model tensor name) of a SCAFFOLD state."""
    model = {k: v for k, v in state.items() if not k.startswith(C_PREFIX)}
    c = {k[len(C_PREFIX) :]: v for k, v in state.items() if k.startswith(C_PREFIX)}
    return model, c


def control_update(
    c_i: Mapping[str, torch.Tensor],
    c: Mapping[str, torch.Tensor],
    x: Mapping[str, torch.Tensor],
    y: Mapping[str, torch.Tensor],
    steps: int,
    lr: float,
) -> TensorDict:
    """Option II: ``c_i+ = c_i - c + (x - y) / (steps * lr)``, tensor by tensor."""
    if steps < 1:
        raise EstuaryError(f"SCAFFOLD control update needs >= 1 local step, got {steps}")
    scale = 1.0 / (steps * lr)
    return {k: c_i[k] - c[k] + (x[k] - y[k]) * scale for k in c}


def correction_hook(correction: Mapping[str, torch.Tensor]) -> GradHook:
    """A grad hook adding ``correction[name]`` (= c - c_i) to each parameter's gradient."""

    def hook(model: nn.Module) -> None:
        for name, p in model.named_parameters():
            if p.grad is not None and name in correction:
                p.grad.add_(correction[name])

    return hook


def edge_control(
    c: Mapping[str, torch.Tensor], deltas: Sequence[Mapping[str, torch.Tensor]], num_devices: int
) -> TensorDict:
    """``c + (1/N) * sum_i delta_i`` (= ``c + (|S|/N) * mean_S delta_i``), in float64."""
    out: TensorDict = {}
    for k, ck in c.items():
        acc = ck.to(torch.float64)
        for d in deltas:
            acc = acc + d[k].to(torch.float64) / num_devices
        out[k] = acc.to(ck.dtype)
    return out


def cloud_control(
    c: Mapping[str, torch.Tensor], edge_cs: Sequence[Mapping[str, torch.Tensor]]
) -> TensorDict:
    """``c + sum_e (c_e - c)``: add every edge's increment since the last cloud round."""
    out: TensorDict = {}
    for k, ck in c.items():
        base = ck.to(torch.float64)
        acc = base.clone()
        for ce in edge_cs:
            acc = acc + (ce[k].to(torch.float64) - base)
        out[k] = acc.to(ck.dtype)
    return out


def _prefixed(prefix: str, items: Mapping[str, V]) -> dict[str, V]:
    return {prefix + k: v for k, v in items.items()}


class _ScaffoldFold(Fold):
    """SCAFFOLD's aggregation streamed: a :class:`WeightedSum` of the models (by samples)
    and one of the control increments (each weight 1): at an edge the devices' ``delta_i``
    (:func:`edge_control`), at the cloud the edges' ``c_e - c`` (:func:`cloud_control`);
    the new control variate is ``c + increments / divisor``."""

    def __init__(self, c: Mapping[str, torch.Tensor], divisor: int, *, edge: bool) -> None:
        super().__init__()
        self.c, self.divisor, self.edge = c, divisor, edge
        self.models, self.increments = WeightedSum(), WeightedSum()

    def _add(self, update: Update) -> None:
        if self.edge:
            y = {k: v for k, v in update.tensors.items() if not k.startswith(DC_PREFIX)}
            inc = {k[len(DC_PREFIX) :]: v for k, v in update.tensors.items()
                   if k.startswith(DC_PREFIX)}  # fmt: skip
        else:
            y, ce = split_state(update.tensors)
            inc = {k: ce[k].to(torch.float64) - v.to(torch.float64) for k, v in self.c.items()}
        if set(inc) != set(self.c):
            raise EstuaryError(f"{update.source}: control variates do not match the state's")
        self.models.add(y, float(update.n_samples), key=update.source)
        self.increments.add(inc, 1.0, key=update.source)

    def result(self) -> TensorDict:
        x = self.models.mean()
        self.models.recycle()
        total = self.increments.sum()
        c_new = {
            k: (ck.to(torch.float64) + total[k] / self.divisor).to(ck.dtype)
            for k, ck in self.c.items()
        }
        return {**x, **_prefixed(C_PREFIX, c_new)}


class Scaffold(Algorithm):
    """SCAFFOLD with control variates on both sides; see the module docstring for the
    two-tier rule for ``c``."""

    name = "scaffold"
    config_class = ScaffoldConfig

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        if cfg.train.optimizer == "sgd" and cfg.train.momentum > 0:
            log.warning(
                "SCAFFOLD with SGD momentum %g: option II's (x - y) / (K lr) then overestimates "
                "the gradient up to %.0fx; set train.momentum = 0 for the algorithm as defined",
                cfg.train.momentum, 1 / (1 - cfg.train.momentum),
            )  # fmt: skip

    # -- shapes of what travels -------------------------------------------------------------
    def init_global(self, model: TensorDict) -> TensorDict:
        zeros = {k: torch.zeros_like(v) for k, v in model.items() if v.is_floating_point()}
        return {**model, **_prefixed(C_PREFIX, zeros)}

    def global_spec(self, model_spec: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        floats = {k: s for k, s in model_spec.items() if s.dtype.is_floating_point}
        return {**model_spec, **_prefixed(C_PREFIX, floats)}

    def upload_spec(self, global_spec: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        model = {k: s for k, s in global_spec.items() if not k.startswith(C_PREFIX)}
        cs = {k[len(C_PREFIX) :]: s for k, s in global_spec.items() if k.startswith(C_PREFIX)}
        return {**model, **_prefixed(DC_PREFIX, cs)}

    # -- device -----------------------------------------------------------------------------
    def device_load(self, ctx: DeviceContext, model: nn.Module, state: TensorDict) -> None:
        weights, c = split_state(state)
        model.load_state_dict(weights)
        ctx.state[C_SERVER] = {k: v.detach().clone() for k, v in c.items()}
        ctx.state[X_START] = {k: weights[k].detach().clone() for k in c}
        ctx.state[STEPS] = 0

    def device_round(
        self, ctx: DeviceContext, model: nn.Module, round_: int, *, upload: bool
    ) -> LocalResult:
        if C_SERVER not in ctx.state:
            raise EstuaryError("SCAFFOLD: device_round before device_load (no control variate)")
        c: TensorDict = ctx.state[C_SERVER]
        c_i: TensorDict = ctx.state.get(C_LOCAL) or {k: torch.zeros_like(v) for k, v in c.items()}
        # c - c_i where the gradients are: moved to the training device once per round (no
        # copy on the CPU); c, c_i and the option II update stay on the CPU
        device = self.training_device
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        correction = {k: (c[k] - c_i[k]).to(device) for k in c if k in trainable}
        result = self.train(ctx, model, grad_hook=correction_hook(correction))
        ctx.state[STEPS] += result.steps
        if not upload:
            return LocalResult(None, result)
        y = model_state(model)
        c_new = control_update(c_i, c, ctx.state[X_START], y, ctx.state[STEPS], self.cfg.train.lr)
        ctx.state[C_LOCAL] = c_new
        for key in (C_SERVER, X_START, STEPS):  # the next round loads a fresh state
            del ctx.state[key]
        delta = {k: c_new[k] - c_i[k] for k in c}
        return LocalResult({**y, **_prefixed(DC_PREFIX, delta)}, result)

    # -- edge and cloud -----------------------------------------------------------------------
    def edge_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        return fold_all(self.edge_fold(current), updates)

    def cloud_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        return fold_all(self.cloud_fold(current), updates)

    def edge_fold(self, current: TensorDict) -> Fold:
        """The models' sample-weighted mean and ``c + (1/N) * sum_i delta_i``, both streamed."""
        return _ScaffoldFold(split_state(current)[1], self.cfg.federation.num_devices, edge=True)

    def cloud_fold(self, current: TensorDict) -> Fold:
        """The edges' sample-weighted mean and ``c + sum_e (c_e - c)``, both streamed."""
        return _ScaffoldFold(split_state(current)[1], 1, edge=False)
