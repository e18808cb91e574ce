"""Structured pruning of the U-Net presets, JSON channel plans, and FedPhD's group penalty.

FedPhD (seed 000, section III-A) prunes the diffusion U-Net with DepGraph: channels coupled by
residual additions, skip concatenations, GroupNorms and attention projections form one
*dependency group* and are removed together. Three parts live here:

* :func:`prune_unet` removes a fraction ``sp`` of the **parameters** (the paper's ``s_p``).
* :func:`channel_plan` / :func:`build_from_plan` carry a pruned architecture as JSON: every
  role rebuilds the module from the dense preset plus the plan, then loads safetensors weights
  into it. No pickled modules, and no Torch-Pruning needed to rebuild.
* :class:`SparsityPenalty` is the sparse-training regularizer of eqs. 16-17.

Pruning recipe
--------------
This follows Diff-Pruning's ``ddpm_prune.py`` (VainF/Diff-Pruning, the DepGraph script that
FedPhD builds on): Torch-Pruning's dependency groups of the whole U-Net except ``conv_out``
(its output channels are the image channels), ranked by **local** importance, with the
GroupNorm groups (and the attention heads) as channel groups.

1. Each dependency group of ``C`` channels whose members include GroupNorms with ``G`` groups
   (or attention projections with ``h`` heads) is split into ``C / lcm(G, h)`` *units*; a unit
   holds the same position of every GroupNorm group / head, so removing units keeps every
   ``num_channels`` divisible by ``num_groups`` and every head the same width.
2. Units are scored by group L2 norm (``tp.importance.GroupMagnitudeImportance(p=2)``, averaged
   over the channel groups as Torch-Pruning does) or at random, with the draws of
   ``tp.importance.RandomImportance`` taken from a generator seeded with ``seed``.
3. Torch-Pruning's local pruner at channel ratio ``r`` removes, in each group of ``U`` units,
   the ``j``-th least important unit iff ``r > j / U``. We order all units by that critical
   ratio ``j / U`` (ties: lower importance relative to the unit's group mean first, then group
   order) and walk the order, removing every unit that keeps the parameter count at or above
   ``(1 - sp) * dense``. The parameter count of a candidate is computed from the channel
   counts alone, so no trial prunes a module; only the final selection is applied, on a
   deep copy. Where the walk stops exactly at a ratio step this *is* Torch-Pruning's local
   pruning (a whole ``r`` at once); in between it adds the next units in the same order, so
   any ``sp`` is met within the smallest remaining unit (well under 1 %).
4. Every GroupNorm group keeps at least :data:`MIN_GROUP_CHANNELS` (2) channels: the walk
   skips the last units of a group that would leave one channel per GroupNorm group, an
   instance norm that erases each channel's mean over the image. Torch-Pruning has no such
   floor, and on ``ddpm-cifar10`` at Table III's ratios it never binds (the four rows
   below are the same with it); on the Fashion-MNIST presets it does, where the first
   level has two channels per group (16 in 8 groups, 64 in 32), so one unit is half the
   level. Without the floor ``s_p`` = 0.44 halved that level of ``fmnist-tiny`` (16 -> 8
   channels, 8 groups of 1) and the pruned model, trained centrally for 8000 steps, reached
   FID 201.8 against the dense model's 29.4
   (``configs/compare/compare_ablation_cpu_tiny_xlong.toml``); with it the level stays whole
   and the deeper ones give the parameters.

FedPhD's Table III is Torch-Pruning's local pruning of ``ddpm-cifar10`` at channel ratios
0.1 / 0.25 / 0.3 / 0.4 (26.98 M / 4.21 G, 20.13 M / 3.41 G, 13.95 M / 2.09 G,
9.34 M / 1.55 G against the printed 26.9 / 4.2, 20.3 / 3.4, 13.9 / 2.1, 9.3 / 1.5): the
GroupNorm units are coarse (32 channels of a 128- or 256-channel layer), so per-layer ratios
are uneven and MACs do not shrink in step with parameters. The walk gives, at exactly
``s_p`` = 0.25 / 0.44 / 0.61 / 0.74: 26.81 M / 4.193 G, 20.02 M / 3.344 G, 13.94 M / 2.086 G,
9.29 M / 1.546 G; the last is 3.05 % above the printed 1.5 G, as Torch-Pruning's own figure
is (the rest are within 1.7 %). ``estuary model-info --prune-sp`` prints these figures.
They use Torch-Pruning's counter (:func:`shared.models.presets.count_macs`), the one Diff-Pruning
reports with, which also counts bias additions and two operations per GroupNorm element.
Counting only the weight multiply-accumulates of convolutions and linear layers gives
6.054 G dense and 4.185 / 3.336 / 2.081 / 1.541 G for the four ratios (1.541 is 2.7 % above
1.5; :func:`shared.models.presets.count_weight_macs`, ``weight_gmacs`` in ``model-info``); the
primary figure keeps Torch-Pruning's convention because it is the paper's tool.

The printed 1.5 G may not be just 1.546 G rounded: Table III's CelebA column (the same model on
64x64 inputs) is 4x the CIFAR-10 figure in every other row (24.3, 16.8, 13.6, 8.3 against
6.06, 4.2, 3.42, 2.1), and its 5.9 G puts the paper's 74 % model at about 1.475 G, where
this recipe counts 6.18 G at 64x64. Matching 9.3 M and 1.475 G together needs more pruning
at 32x32 and less below than any local ratio gives (every ``s_p`` from 0.73 to 0.75 lies
on one smooth curve, 9.29 M / 1.546 G at 0.74), so the paper's last row came from a
different channel allocation, which its text does not describe and which cannot be
recovered without its code (the paper's text, below, points the other way).

Nor does another Torch-Pruning version give it (Diff-Pruning's recipe, ``conv_out`` ignored,
magnitude importance, counted with each version's own counter). Versions 1.2.2 and 1.3.7
round GroupNorm units down: ratio 0.3 gives Diff-Pruning's published 19.85 M / 3.39 G, but
13.9 M comes with 2.70 G there, not Table III's 2.1. Versions 1.4.3 and 1.5.2 round up, as
1.6.1 does, and reproduce the first three rows at one ratio each: 0.11 gives 26.91 M /
4.20 G, 0.22 gives 20.29 M / 3.43 G (Table IV prints 20.3 M / 3.42 G) and 0.31 gives
13.90 M / 2.08 G. But every ratio from 0.38 to 0.49 gives 9.41-9.00 M with 1.555-1.523 G
(9.30 M / 1.547 G at 0.41). Pruning twice with 1.6.1, at any two of eleven ratios from 0.05
to 0.5, lands on the same line (9.28 M / 1.545 G) or far below it (8.8 M / 1.13 G).
Torch-Pruning's *global* pruning (``global_pruning=True``, group L2 norm, ``conv_out`` kept)
does allocate differently, with fewer MACs per parameter (19.60 M / 3.045 G at ratio 0.45),
but it ranks the groups of the whole network by their weights, so the architecture it leaves
depends on the trained model and not on the ratio alone. On the seed-0 initial model it is not
even monotone in the ratio (0.45, 0.5, 0.55, 0.6 leave 19.60, 7.78, 2.93, 14.85 M), so a row
made with it could only be checked against the paper's own weights.
The paper's text, though, fits 1.546 G: "parameter and MACs reductions of up to 74% and 75%"
(section V-D) puts the last row, as a whole-percent reduction of the dense 6.064 G, at
1.486-1.546 G; 1.546 G is a 74.51 % reduction, whereas the CelebA column's 5.9 / 24.3 is
75.7 %, so the text was computed from the CIFAR-10 column.

After pruning, the attributes diffusers keeps beside the weights are re-derived from the
weights (:func:`sync_attributes`): ``Downsample2D``/``Upsample2D`` ``channels``/``out_channels``,
``ResnetBlock2D`` ``in_channels``/``out_channels``, ``Attention`` ``inner_dim``, ``query_dim``,
``scale`` (``dim_head ** -0.5``, the value ``AttnProcessor2_0``'s scaled-dot-product uses
anyway), and the Conv2d/Linear/GroupNorm size attributes.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch_pruning as tp
from diffusers import UNet2DModel
from diffusers.models.attention_processor import Attention
from torch import nn

from shared.errors import ConfigError
from shared.models.plan import SIZED_MODULES, channel_dims, sync_attributes

log = logging.getLogger(__name__)

PruneMethod = Literal["l2", "random"]
#: how far (relative) the pruned parameter count may miss (1 - sp) * dense
TARGET_TOLERANCE = 0.01
#: channels every GroupNorm group keeps: one channel per group is an instance norm, which
#: erases each channel's mean over the image (recipe step 4 in the module docstring)
MIN_GROUP_CHANNELS = 2
#: names the pruning recipe in records of finished runs (``estuary compare``): a run pruned
#: by an earlier recipe is not reused. Earlier: no MIN_GROUP_CHANNELS floor
PRUNING_RECIPE = "tp-local-units/min-group-channels-2"

LAYER_TYPES = (nn.Conv2d, nn.Linear)


# -- dependency groups ------------------------------------------------------------------


@dataclass(frozen=True)
class GroupMember:
    """One module dimension in a group: its channel indices, and how many go with each unit."""

    module: str
    kind: Literal["in", "out"]
    idxs: tuple[int, ...]
    per_unit: tuple[int, ...]  # how many of ``idxs`` each unit of the group removes


@dataclass(frozen=True)
class DependencyGroup:
    """A Torch-Pruning dependency group of the dense model, described by module names."""

    root: str
    channels: int
    ch_groups: int
    members: tuple[GroupMember, ...]
    tp_group: Any  # the tp.Group (kept for importance scoring and for pruning)
    keep: int = 1  # units that always stay (MIN_GROUP_CHANNELS per GroupNorm group)


def example_inputs(model: UNet2DModel) -> dict[str, torch.Tensor]:
    cfg = model.config
    size = cfg.sample_size
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    p = next(model.parameters())
    inputs = {
        "sample": torch.zeros(1, cfg.in_channels, h, w, device=p.device, dtype=p.dtype),
        "timestep": torch.ones(1, dtype=torch.long, device=p.device),
    }
    if cfg.num_class_embeds:
        inputs["class_labels"] = torch.zeros(1, dtype=torch.long, device=p.device)
    return inputs


def dependency_groups(model: UNet2DModel) -> tuple[Any, list[DependencyGroup]]:
    """Trace ``model`` (in place; pass a copy) and return its graph and prunable groups."""
    names = {m: n for n, m in model.named_modules()}
    heads = {
        proj: m.heads
        for m in model.modules()
        if isinstance(m, Attention)
        for proj in (m.to_q, m.to_k, m.to_v)
    }
    # Tracing needs autograd even when the caller runs under no_grad.
    with torch.enable_grad(), contextlib.redirect_stdout(io.StringIO()):
        dg = tp.DependencyGraph().build_dependency(model, example_inputs=example_inputs(model))
        tp_groups = list(
            dg.get_all_groups(ignored_layers=[model.conv_out], root_module_types=list(LAYER_TYPES))
        )
    groups = []
    for g in tp_groups:
        members: dict[tuple[str, str], dict[int, int]] = {}
        ch_groups = 1
        norm_groups = 0  # the most groups of any GroupNorm in the group
        for item in g:
            module = item.dep.target.module
            if not isinstance(module, SIZED_MODULES):
                continue  # Torch-Pruning's own op nodes (add, concat, reshape) hold no weights
            out = isinstance(module, nn.GroupNorm) or dg.is_out_channel_pruning_fn(item.dep.handler)
            kind = "out" if out else "in"
            if isinstance(module, nn.GroupNorm):
                ch_groups = math.lcm(ch_groups, module.num_groups)
                norm_groups = max(norm_groups, module.num_groups)
            elif out and module in heads:
                ch_groups = math.lcm(ch_groups, heads[module])
            members.setdefault((names[module], kind), {}).update(
                zip(item.idxs, item.root_idxs, strict=True)
            )
        root = names[g[0].dep.target.module]
        channels = len(g[0].idxs)
        if channels % ch_groups or channels // ch_groups < 2:
            log.debug("group at %s cannot be pruned evenly; left dense", root)
            continue
        size = channels // ch_groups
        parts = []
        for (name, kind), mapping in members.items():
            units = torch.tensor(list(mapping.values()), dtype=torch.long) % size
            per_unit = tuple(torch.bincount(units, minlength=size).tolist())
            parts.append(GroupMember(name, kind, tuple(mapping), per_unit))  # type: ignore[arg-type]
        # a unit gives each GroupNorm group ch_groups / norm_groups channels
        keep = max(1, math.ceil(MIN_GROUP_CHANNELS * norm_groups / ch_groups))
        groups.append(DependencyGroup(root, channels, ch_groups, tuple(parts), g, keep))
    return dg, groups


# -- parameter counting from channel counts ----------------------------------------------


class _Shapes:
    """Parameter count of a U-Net as channels are removed, from the channel counts alone."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = {n: m for n, m in model.named_modules() if isinstance(m, SIZED_MODULES)}
        self.dims = {n: channel_dims(m) for n, m in self.modules.items()}
        self.total = sum(p.numel() for p in model.parameters())

    def _params(self, name: str, out: int, inp: int) -> int:
        m = self.modules[name]
        bias = out if getattr(m, "bias", None) is not None else 0
        if isinstance(m, nn.Conv2d):
            return out * (inp // m.groups) * math.prod(m.kernel_size) + bias
        if isinstance(m, nn.Linear):
            return out * inp + bias
        if isinstance(m, nn.Embedding):
            return out * inp  # embedding_dim x num_embeddings
        return 2 * out if m.affine else 0  # GroupNorm

    def removal(self, cuts: Iterable[tuple[str, str, int]]) -> tuple[int, dict[str, list[int]]]:
        """Parameters left and new dims after cutting ``(module, kind, n)`` channels."""
        new: dict[str, list[int]] = {}
        for name, kind, n in cuts:
            d = new.setdefault(name, list(self.dims[name]))
            if kind == "out" or isinstance(self.modules[name], nn.GroupNorm):
                d[0] -= n
                if isinstance(self.modules[name], nn.GroupNorm):
                    d[1] = d[0]
            else:
                d[1] -= n
        total = self.total
        for name, d in new.items():
            total += self._params(name, *d) - self._params(name, *self.dims[name])
        return total, new

    def commit(self, total: int, new: Mapping[str, list[int]]) -> None:
        self.total = total
        self.dims.update({k: list(v) for k, v in new.items()})


# -- pruning -----------------------------------------------------------------------------


def prune_unet(
    model: UNet2DModel, sp: float, *, method: PruneMethod = "l2", seed: int = 0
) -> UNet2DModel:
    """A copy of ``model`` with a fraction ``sp`` of its parameters removed (0 <= sp < 1).

    Structured (whole channels), dependency-aware, ``conv_out`` kept; ``method`` ranks the
    channels by group L2 norm (``"l2"``) or at random from ``seed`` (``"random"``). The
    module docstring gives the recipe. The parameter count lands within
    :data:`TARGET_TOLERANCE` of ``(1 - sp)`` times the dense count, or ConfigError says
    why not. ``model`` and the global RNG are left untouched.
    """
    _check_prune_args(sp, method)
    work = copy.deepcopy(model)
    if sp == 0:
        return work
    dg, groups = dependency_groups(work)
    shapes = _Shapes(work)
    dense = shapes.total
    target = math.ceil((1 - sp) * dense)
    order = _unit_order(groups, method, seed)
    chosen: dict[int, list[int]] = {}
    for gi, unit in order:
        g = groups[gi]
        cuts = [(m.module, m.kind, m.per_unit[unit]) for m in g.members]
        total, new = shapes.removal(cuts)
        if total >= target:
            shapes.commit(total, new)
            chosen.setdefault(gi, []).append(unit)
    if abs(shapes.total - target) > TARGET_TOLERANCE * target:
        raise ConfigError(
            f"cannot remove {sp:.3f} of the parameters: structured pruning of this model "
            f"removes at most {1 - shapes.total / dense:.3f}; choose a smaller prune ratio"
        )
    with torch.no_grad():
        for gi, units in chosen.items():
            g = groups[gi]
            size = g.channels // g.ch_groups
            idxs = sorted(u + k * size for u in units for k in range(g.ch_groups))
            root = g.tp_group[0].dep
            dg.get_pruning_group(root.target.module, root.handler, idxs).prune()
    sync_attributes(work)
    work.train(model.training)  # tracing switches the copy to eval mode
    after = sum(p.numel() for p in work.parameters())
    log.info(
        "pruned by %s: %.3f M -> %.3f M params (%.1f %% removed, target %.1f %%)",
        method, dense / 1e6, after / 1e6, 100 * (1 - after / dense), 100 * sp,
    )  # fmt: skip
    return work


def _check_prune_args(sp: float, method: str) -> None:
    if isinstance(sp, bool) or not isinstance(sp, (int, float)) or not 0 <= sp < 1:
        raise ConfigError(f"prune ratio sp={sp!r} must be a number in [0, 1)")
    if method not in get_args(PruneMethod):
        raise ConfigError(f"prune method {method!r}: choose one of {list(get_args(PruneMethod))}")


def _unit_order(groups: Sequence[DependencyGroup], method: str, seed: int) -> list[tuple[int, int]]:
    """Every removable (group, unit), in the order the pruning walk considers them."""
    l2 = tp.importance.GroupMagnitudeImportance(p=2)
    # random scores are tp.importance.RandomImportance's draws (torch.rand per group), taken
    # from a generator of our own instead of the global RNG
    gen = torch.Generator().manual_seed(seed)
    keys = []
    for gi, g in enumerate(groups):
        if method == "l2":
            imp = l2(g.tp_group)
            scores = torch.zeros(g.channels) if imp is None else imp.detach().double().cpu()
        else:
            scores = torch.rand(len(g.tp_group[0].idxs), generator=gen).double()
        unit_imp = scores.view(g.ch_groups, -1).mean(0)
        mean = float(unit_imp.mean())
        rel = unit_imp / mean if mean > 0 else unit_imp
        ranked = torch.argsort(unit_imp, stable=True).tolist()
        n_units = len(ranked)
        # the best g.keep units of a group always stay
        for j, unit in enumerate(ranked[: n_units - g.keep]):
            keys.append((j / n_units, float(rel[unit]), gi, unit))
    keys.sort()
    return [(gi, unit) for _, _, gi, unit in keys]


# -- channel plans -----------------------------------------------------------------------


# -- sparse training (eqs. 16-17) ---------------------------------------------------------
