"""FedPhD (seed 000, Algorithm 1; DESIGN section 4): homogeneity-aware hierarchical
aggregation, homogeneity-aware edge selection, sparse training and structured pruning.

The maths are pure functions over label counts (the SH score is
:func:`~shared.federation.selection.sh_score`):

* SH score (eqs. 18, 20): ``mu = 2 - ||q - q_u||_2`` with ``q`` the label distribution
  (counts / n) and ``q_u`` the target (uniform unless ``federation.sh_target``).
* Edge weights on the cloud (eq. 22) and device weights on an edge (eq. 24):
  ``rho_i ∝ ReLU(n_i + a * mu_i + b)``. The cloud's ``n_e`` and ``q_e`` are the label counts
  the edge accumulated from the devices it served since the last cloud aggregation (eq. 19
  with count weighting), which the edge reports with its model.
* Edge selection (eq. 25) is a feature of the federation every method may use
  (:mod:`shared.federation.selection`): with ``federation.assignment = "select"`` each
  participant samples its edge from ``P(e) ∝ ReLU(a * mu_e - n_e + b)`` with the device
  tentatively added, one after another in sorted order (the device agent implements the
  round).

Rounds here are 0-based: devices add the group penalty (eqs. 16-17, :class:`SparsityPenalty`)
in rounds ``r < R_s``, and the cloud prunes (L2 group norm, ``s_p`` = fraction of parameters
removed) at its first aggregation ending a round ``r`` with ``r + 1 >= R_s``: the paper's
prose ("after R_s sparse training rounds"). Its 1-based pseudocode adds the penalty in
rounds 1 .. R_s - 1 only, one round fewer. FedPhD-OS (``prune_at = "init"``) prunes the
initial model before round 0 (random or L2).
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import UNet2DModel
from torch import nn

from shared.diffusion.hooks import ExtraLoss
from shared.errors import ConfigError
from shared.federation.selection import sh_score
from shared.methods.aggregation import weighted_average
from shared.methods.base import (
    Algorithm,
    DeviceContext,
    LocalResult,
    TensorDict,
    Update,
    model_state,
)
from shared.methods.fedphd.config import FedPhDConfig
from shared.models.plan import ChannelPlan
from shared.models.presets import build_unet
from shared.models.pruning import (
    LAYER_TYPES,
    GroupMember,
    dependency_groups,
    example_inputs,
    prune_unet,
)

log = logging.getLogger(__name__)

#: the device's group penalty (a cache: rebuilt from the module when missing)
PENALTY_KEY = "fedphd.penalty"


def sh_weights(
    updates: Sequence[tuple[int, Sequence[int]]],
    a: float,
    b: float,
    target: Sequence[float] | None = None,
) -> list[float]:
    """Eqs. 22/24: normalized ``ReLU(n_i + a * mu_i + b)`` for (n_i, label counts) pairs.

    When every term is zero (possible only with a negative ``b``) the weights fall back to
    sample counts, so an aggregation never divides by zero."""
    raw = [max(0.0, n + a * sh_score(c, target) + b) for n, c in updates]
    total = sum(raw)
    if total <= 0:
        raw = [float(n) for n, _ in updates]
        total = sum(raw) or float(len(raw))
        if not any(raw):
            raw = [1.0] * len(raw)
    return [r / total for r in raw]


# -- sparse training (eqs. 16-17) --------------------------------------------------------

#: lower bound of Q(θ_g) in λ_g = λ_0 / max(Q, Q_FLOOR): a group centred on the middle layer
#: has Q = 0 (and with an even number of layers l_mid is a half-integer, so Q can be 0.5);
#: the floor keeps λ_g <= λ_0. No group of the shipped presets has Q < 1 (fmnist-tiny has 65
#: layers, ddpm-cifar10 113), so it never changes their λ_g
Q_FLOOR = 1.0


@dataclass(frozen=True)
class PenaltyGroup:
    """One dependency group as the penalty sees it.

    ``layers`` are its Conv2d/Linear members and ``layer_index`` their positions among all
    Conv2d/Linear modules of the model in the order the forward pass runs them
    (:func:`forward_order`); ``q`` is FedPhD's
    ``Q(θ_g) = mean |l - l_mid|`` and ``weight`` is ``λ_g = λ_0 / max(q, q_floor)``.
    ``slices`` are the group's prunable slices ``(parameter name, dim, channel indices)``.
    """

    root: str
    channels: int
    layers: tuple[str, ...]
    layer_index: tuple[int, ...]
    q: float
    weight: float
    slices: tuple[tuple[str, int, tuple[int, ...]], ...]


def forward_order(model: nn.Module) -> list[str]:
    """Names of ``model``'s Conv2d/Linear modules in the order one forward pass runs them:
    FedPhD's layer index ``l`` (eq. 17's ``Q``). Registration order is not depth order in
    diffusers: ``UNet2DModel`` registers ``mid_block`` after ``up_blocks``, and a block its
    resnets before its attentions although they alternate. Layers the pass never runs (none
    in the shipped presets) follow in registration order."""
    names: dict[nn.Module, str] = {
        m: n for n, m in model.named_modules() if isinstance(m, LAYER_TYPES)
    }
    order: dict[str, None] = {}

    def record(module: nn.Module, args: object) -> None:
        order.setdefault(names[module], None)

    handles = [m.register_forward_pre_hook(record) for m in names]
    try:
        with torch.no_grad():
            model(**example_inputs(model))  # type: ignore[arg-type]
    finally:
        for h in handles:
            h.remove()
    return [*order, *(n for n in names.values() if n not in order)]


class SparsityPenalty:
    """FedPhD's group regularizer ``Ω(G) = Σ_g λ_g Σ_k ‖θ_g[k]‖²`` (eq. 17, added in eq. 16).

    Groups are Torch-Pruning dependency groups of the model it is built for (``conv_out``'s
    own output channels excluded); ``θ_g[k]`` gathers channel ``k``'s slice of every member
    (weights, biases, GroupNorm affines), so the penalty acts per channel group, not per
    tensor. A weight element that belongs to two groups (its output channel to one, its
    input channel to another) is penalized by both. ``λ_g = λ_0 / max(Q(θ_g), q_floor)``
    with ``Q`` the mean distance of the group's layers to the middle layer index, so the
    middle of the U-Net, where redundancy is largest, is pushed hardest. Layers are numbered
    in forward order (:func:`forward_order`), so the middle is the lowest resolution.

    λ_g acts through training only: it pulls a group's little-used channels towards zero,
    and so shapes which units the L2 ranking of :func:`prune_unet` removes. How many units
    each group loses is set by the local-ratio walk: the same for any λ_g up to the units
    of the last, partly taken ratio step, which go by importance relative to the group's
    mean (so a few channels, here a few hundred parameters, can move between groups).

    Calling the penalty costs one square and a few reductions per parameter: the per-channel
    weights are precomputed into one coefficient vector per (parameter, dim).
    """

    def __init__(
        self,
        groups: Sequence[PenaltyGroup],
        shapes: Mapping[str, tuple[int, ...]],
        *,
        lambda0: float,
        q_floor: float = Q_FLOOR,
    ) -> None:
        self.groups = tuple(groups)
        self.lambda0 = float(lambda0)
        self.q_floor = float(q_floor)
        coef: dict[str, dict[int, torch.Tensor]] = {}
        for g in self.groups:
            for name, dim, idxs in g.slices:
                vec = coef.setdefault(name, {}).setdefault(
                    dim, torch.zeros(shapes[name][dim], dtype=torch.float32)
                )
                index = torch.tensor(idxs, dtype=torch.long)
                vec.index_add_(0, index, torch.full((len(idxs),), g.weight, dtype=torch.float32))
        self._coef = coef
        #: the coefficients copied to another device / dtype once (not at every step: a
        #: host-to-device copy of pageable memory waits for the GPU)
        self._moved: dict[tuple[torch.device, torch.dtype], dict[str, dict[int, torch.Tensor]]] = {}

    def _coef_on(
        self, device: torch.device, dtype: torch.dtype
    ) -> dict[str, dict[int, torch.Tensor]]:
        if device.type == "cpu" and dtype == torch.float32:
            return self._coef
        key = (device, dtype)
        if key not in self._moved:
            self._moved[key] = {
                name: {dim: vec.to(device, dtype) for dim, vec in dims.items()}
                for name, dims in self._coef.items()
            }
        return self._moved[key]

    @classmethod
    def from_model(
        cls, model: UNet2DModel, lambda0: float, *, q_floor: float = Q_FLOOR
    ) -> SparsityPenalty:
        """The penalty for ``model``'s architecture (``model`` itself is not modified)."""
        if not (math.isfinite(lambda0) and lambda0 >= 0):
            raise ConfigError(f"lambda0={lambda0!r} must be a finite number >= 0")
        if not q_floor > 0:
            raise ConfigError(f"q_floor={q_floor!r} must be > 0")
        work = copy.deepcopy(model)
        layers = forward_order(work)
        _, groups = dependency_groups(work)
        index = {n: i for i, n in enumerate(layers)}
        l_mid = (len(layers) - 1) / 2  # the mean of 0..L-1
        modules = dict(work.named_modules())
        out = []
        for g in groups:
            names = tuple(dict.fromkeys(m.module for m in g.members if m.module in index))
            idx = tuple(index[n] for n in names)
            q = sum(abs(i - l_mid) for i in idx) / len(idx)
            slices = tuple(s for m in g.members for s in _slices(modules[m.module], m))
            out.append(
                PenaltyGroup(g.root, g.channels, names, idx, q, lambda0 / max(q, q_floor), slices)
            )
        shapes = {n: tuple(p.shape) for n, p in work.named_parameters()}
        return cls(out, shapes, lambda0=lambda0, q_floor=q_floor)

    def __call__(self, model: nn.Module) -> torch.Tensor:
        """``Ω`` for ``model``'s current parameters (differentiable)."""
        params = dict(model.named_parameters())
        total: torch.Tensor | None = None
        for name in self._coef:
            p = params.get(name)
            if p is None:
                raise ConfigError(f"penalty built for another architecture: no parameter {name!r}")
            sq = p.square()
            for dim, vec in self._coef_on(p.device, p.dtype)[name].items():
                if p.shape[dim] != vec.numel():
                    raise ConfigError(f"penalty built for another architecture: {name!r} differs")
                rest = [d for d in range(p.ndim) if d != dim]
                per_channel = sq.sum(dim=rest) if rest else sq
                term = torch.dot(per_channel, vec)
                total = term if total is None else total + term
        if total is None:
            return torch.zeros(())
        return total

    def describe(self) -> list[dict[str, Any]]:
        """JSON-able summary per group (root, channels, layers, Q, λ) for logs and reports."""
        return [
            {"root": g.root, "channels": g.channels, "layers": list(g.layers),
             "q": round(g.q, 4), "lambda": g.weight}
            for g in self.groups
        ]  # fmt: skip


def _slices(module: nn.Module, member: GroupMember) -> list[tuple[str, int, tuple[int, ...]]]:
    if isinstance(module, nn.GroupNorm):
        dims = [("weight", 0), ("bias", 0)]
    elif isinstance(module, nn.Embedding):
        dims = [("weight", 1)]  # its width: one column per channel
    elif member.kind == "out":
        dims = [("weight", 0), ("bias", 0)]
    else:
        dims = [("weight", 1)]
    return [
        (f"{member.module}.{attr}", dim, member.idxs)
        for attr, dim in dims
        if getattr(module, attr, None) is not None
    ]


class FedPhD(Algorithm):
    """SH-weighted aggregation at both tiers, sparse training, pruning on the cloud."""

    name = "fedphd"
    config_class = FedPhDConfig
    settings: FedPhDConfig
    device_cache_keys = frozenset({PENALTY_KEY})

    def _target(self) -> list[float] | None:
        return list(self.cfg.federation.sh_target) or None

    # -- device ------------------------------------------------------------------------
    def device_round(
        self, ctx: DeviceContext, model: nn.Module, round_: int, *, upload: bool
    ) -> LocalResult:
        algo = self.settings
        extra = None
        if round_ < algo.sparse_rounds and algo.lambda0 > 0:
            extra = self._penalty(ctx, model)
        result = self.train(ctx, model, extra_loss=extra)
        return LocalResult(model_state(model) if upload else None, result)

    def _penalty(self, ctx: DeviceContext, model: nn.Module) -> ExtraLoss:
        """The group penalty for this module's architecture, built once per device."""
        shapes = tuple((k, tuple(v.shape)) for k, v in model.state_dict().items())
        cached = ctx.state.get(PENALTY_KEY)
        if cached is None or cached[0] != shapes:
            cached = (shapes, SparsityPenalty.from_model(model, self.settings.lambda0))
            ctx.state[PENALTY_KEY] = cached
        return cached[1]

    # -- aggregation ---------------------------------------------------------------------
    def _aggregate(self, updates: Sequence[Update]) -> TensorDict:
        fed = self.cfg.federation  # the SH weights' a, b (and target) are the federation's
        weights = sh_weights(
            [(u.n_samples, u.label_counts) for u in updates], fed.sh_a, fed.sh_b, self._target()
        )
        return weighted_average([u.tensors for u in updates], weights)

    def edge_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        """Eqs. 23-24 over the devices that reported to this edge."""
        return self._aggregate(updates)

    def cloud_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        """Eqs. 21-22 over the edges, with their accumulated label counts."""
        return self._aggregate(updates)

    # -- pruning -------------------------------------------------------------------------
    def after_cloud_aggregate(
        self, round_: int, state: TensorDict, plan: ChannelPlan | None
    ) -> tuple[TensorDict, ChannelPlan | None]:
        algo = self.settings
        if algo.prune_ratio <= 0 or plan is not None:
            return state, plan
        due = round_ == -1 if algo.prune_at == "init" else round_ + 1 >= algo.sparse_rounds
        if not due or (algo.prune_at == "sparse" and round_ < 0):
            return state, plan
        return prune_state(self.cfg.model.preset, state, algo.prune_ratio,
                           method=algo.prune_method, seed=self.cfg.run.seed)  # fmt: skip


def prune_state(
    preset: str, state: TensorDict, sp: float, *, method: str, seed: int
) -> tuple[TensorDict, ChannelPlan]:
    """Prune a dense ``state`` of ``preset`` so ``sp`` of its parameters are removed;
    returns the pruned state and its channel plan."""
    module = build_unet(preset, seed=seed)
    module.load_state_dict(state)
    before = sum(p.numel() for p in module.parameters())
    with torch.no_grad():
        pruned = prune_unet(module, sp, method=method, seed=seed)  # type: ignore[arg-type]
    after = sum(p.numel() for p in pruned.parameters())
    log.info(
        "pruned %s by %s: %.2f M -> %.2f M params (%.1f %% removed)",
        preset, method, before / 1e6, after / 1e6, 100 * (1 - after / before),
    )  # fmt: skip
    plan = ChannelPlan.of_module(pruned, preset=preset)
    return {k: v.detach().clone() for k, v in pruned.state_dict().items()}, plan
