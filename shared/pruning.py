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
   FID 201.8 against the dense model's 29.4 (``configs/compare_ablation_cpu_tiny_xlong.toml``);
   with it the level stays whole and the deeper ones give the parameters.

FedPhD's Table III is Torch-Pruning's local pruning of ``ddpm-cifar10`` at channel ratios
0.1 / 0.25 / 0.3 / 0.4 (26.98 M / 4.21 G, 20.13 M / 3.41 G, 13.95 M / 2.09 G,
9.34 M / 1.55 G against the printed 26.9 / 4.2, 20.3 / 3.4, 13.9 / 2.1, 9.3 / 1.5): the
GroupNorm units are coarse (32 channels of a 128- or 256-channel layer), so per-layer ratios
are uneven and MACs do not shrink in step with parameters. The walk gives, at exactly
``s_p`` = 0.25 / 0.44 / 0.61 / 0.74: 26.81 M / 4.193 G, 20.02 M / 3.344 G, 13.94 M / 2.086 G,
9.29 M / 1.546 G; the last is 3.05 % above the printed 1.5 G, as Torch-Pruning's own figure
is (the rest are within 1.7 %). ``estuary model-info --prune-sp`` prints these figures.
They use Torch-Pruning's counter (:func:`shared.models.count_macs`), the one Diff-Pruning
reports with, which also counts bias additions and two operations per GroupNorm element.
Counting only the weight multiply-accumulates of convolutions and linear layers gives
6.054 G dense and 4.185 / 3.336 / 2.081 / 1.541 G for the four ratios (1.541 is 2.7 % above
1.5; :func:`shared.models.count_weight_macs`, ``weight_gmacs`` in ``model-info``); the
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
import functools
import io
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch_pruning as tp
from diffusers import UNet2DModel
from diffusers.models.attention_processor import Attention
from diffusers.models.downsampling import Downsample2D
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.upsampling import Upsample2D
from torch import nn

from shared.codec import TensorSpec, spec_of
from shared.errors import ConfigError
from shared.models import PRESETS, build_unet, image_shape

log = logging.getLogger(__name__)

PruneMethod = Literal["l2", "random"]
#: version tag of the JSON channel plan; a plan with another tag is refused
PLAN_FORMAT = "estuary.channel-plan/1"
#: lower bound of Q(θ_g) in λ_g = λ_0 / max(Q, Q_FLOOR): a group centred on the middle layer
#: has Q = 0 (and with an even number of layers l_mid is a half-integer, so Q can be 0.5);
#: the floor keeps λ_g <= λ_0. No group of the shipped presets has Q < 1 (fmnist-tiny has 65
#: layers, ddpm-cifar10 113), so it never changes their λ_g
Q_FLOOR = 1.0
#: how far (relative) the pruned parameter count may miss (1 - sp) * dense
TARGET_TOLERANCE = 0.01
#: channels every GroupNorm group keeps: one channel per group is an instance norm, which
#: erases each channel's mean over the image (recipe step 4 in the module docstring)
MIN_GROUP_CHANNELS = 2
#: names the pruning recipe in records of finished runs (``estuary compare``): a run pruned
#: by an earlier recipe is not reused. Earlier: no MIN_GROUP_CHANNELS floor
PRUNING_RECIPE = "tp-local-units/min-group-channels-2"

_LAYERS = (nn.Conv2d, nn.Linear)
_SIZED = (nn.Conv2d, nn.Linear, nn.GroupNorm, nn.Embedding)
_PLANNED = (*_SIZED, Attention)
#: plan entry sizes that pruning never changes: GroupNorm groups, attention heads (a head
#: count change with the same tensor shapes would silently change the model's function),
#: the class embedding's number of classes
_FIXED = {"GroupNorm": "num_groups", "Attention": "heads", "Embedding": "num_embeddings"}


# -- dependency groups ------------------------------------------------------------------


@dataclass(frozen=True)
class _Member:
    """One module dimension in a group: its channel indices, and how many go with each unit."""

    module: str
    kind: Literal["in", "out"]
    idxs: tuple[int, ...]
    per_unit: tuple[int, ...]  # how many of ``idxs`` each unit of the group removes


@dataclass(frozen=True)
class _Group:
    """A Torch-Pruning dependency group of the dense model, described by module names."""

    root: str
    channels: int
    ch_groups: int
    members: tuple[_Member, ...]
    tp_group: Any  # the tp.Group (kept for importance scoring and for pruning)
    keep: int = 1  # units that always stay (MIN_GROUP_CHANNELS per GroupNorm group)


def _example_inputs(model: UNet2DModel) -> dict[str, torch.Tensor]:
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


def _dependency_groups(model: UNet2DModel) -> tuple[Any, list[_Group]]:
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
        dg = tp.DependencyGraph().build_dependency(model, example_inputs=_example_inputs(model))
        tp_groups = list(
            dg.get_all_groups(ignored_layers=[model.conv_out], root_module_types=list(_LAYERS))
        )
    groups = []
    for g in tp_groups:
        members: dict[tuple[str, str], dict[int, int]] = {}
        ch_groups = 1
        norm_groups = 0  # the most groups of any GroupNorm in the group
        for item in g:
            module = item.dep.target.module
            if not isinstance(module, _SIZED):
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
            parts.append(_Member(name, kind, tuple(mapping), per_unit))  # type: ignore[arg-type]
        # a unit gives each GroupNorm group ch_groups / norm_groups channels
        keep = max(1, math.ceil(MIN_GROUP_CHANNELS * norm_groups / ch_groups))
        groups.append(_Group(root, channels, ch_groups, tuple(parts), g, keep))
    return dg, groups


# -- parameter counting from channel counts ----------------------------------------------


class _Shapes:
    """Parameter count of a U-Net as channels are removed, from the channel counts alone."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = {n: m for n, m in model.named_modules() if isinstance(m, _SIZED)}
        self.dims = {n: _dims(m) for n, m in self.modules.items()}
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


def _dims(m: nn.Module) -> list[int]:
    """[out, in] channels of a Conv2d/Linear, read from the weight; [C, C] of a GroupNorm;
    [embedding_dim, num_embeddings] of an Embedding (its width is pruned as output channels)."""
    if isinstance(m, nn.Embedding):
        return [m.weight.shape[1], m.weight.shape[0]]
    if isinstance(m, nn.Conv2d):
        return [m.weight.shape[0], m.weight.shape[1] * m.groups]
    if isinstance(m, nn.Linear):
        return [m.weight.shape[0], m.weight.shape[1]]
    if isinstance(m, nn.GroupNorm):
        return [m.num_channels, m.num_channels]
    raise TypeError(f"no channel sizes for {type(m).__name__}")


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
    dg, groups = _dependency_groups(work)
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


def _unit_order(groups: Sequence[_Group], method: str, seed: int) -> list[tuple[int, int]]:
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


def sync_attributes(model: nn.Module) -> None:
    """Re-derive the size attributes diffusers and torch keep beside the weights.

    Torch-Pruning resizes weights (and Conv2d/Linear/GroupNorm sizes) but not the
    attributes that diffusers blocks check or use in ``forward``; this sets all of them from
    the weight shapes, so a pruned or plan-built U-Net runs, trains and exports.
    """
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            m.out_channels, m.in_channels = m.weight.shape[0], m.weight.shape[1] * m.groups
        elif isinstance(m, nn.Linear):
            m.out_features, m.in_features = m.weight.shape
        elif isinstance(m, nn.GroupNorm) and m.weight is not None:
            m.num_channels = m.weight.shape[0]
        elif isinstance(m, nn.Embedding):
            m.num_embeddings, m.embedding_dim = m.weight.shape
    for m in model.modules():
        conv = getattr(m, "conv", None)
        if isinstance(m, (Downsample2D, Upsample2D)) and isinstance(conv, nn.Conv2d):
            m.channels, m.out_channels = conv.in_channels, conv.out_channels
        elif isinstance(m, ResnetBlock2D):
            m.in_channels, m.out_channels = m.conv1.in_channels, m.conv2.out_channels
        elif isinstance(m, Attention):
            _sync_attention(m)


def _sync_attention(m: Attention) -> None:
    m.query_dim = m.to_q.in_features
    m.inner_dim = m.to_q.out_features
    if m.to_k is not None:
        m.cross_attention_dim = m.to_k.in_features
        m.inner_kv_dim = m.to_k.out_features
    if m.to_out is not None:
        m.out_dim = m.to_out[0].out_features
    m.out_context_dim = m.query_dim
    m.sliceable_head_dim = m.heads
    m.scale = (m.inner_dim // m.heads) ** -0.5 if m.scale_qk else 1.0


# -- channel plans -----------------------------------------------------------------------


def preset_of(model: UNet2DModel) -> str:
    """The preset whose constructor arguments ``model``'s config matches."""

    def norm(v: Any) -> Any:
        return list(v) if isinstance(v, (tuple, list)) else v

    cfg = dict(model.config)
    hits = [
        name
        for name, kwargs in PRESETS.items()
        if all(norm(cfg.get(k)) == norm(v) for k, v in kwargs.items())
        and cfg.get("num_class_embeds") == kwargs.get("num_class_embeds")
    ]
    if len(hits) != 1:
        raise ConfigError(f"model config matches presets {hits}; pass preset= explicitly")
    return hits[0]


def channel_plan(model: UNet2DModel, *, preset: str | None = None) -> dict[str, Any]:
    """The JSON-able channel plan of ``model`` (pruned or dense).

    ``{"format": PLAN_FORMAT, "preset": ..., "modules": {name: entry}}`` with one entry per
    Conv2d (``in_channels``, ``out_channels``), Linear (``in_features``, ``out_features``),
    GroupNorm (``num_groups``, ``num_channels``), Attention (``heads``, ``inner_dim``) and
    Embedding (``num_embeddings``, ``embedding_dim``: the class embedding of the ``-cond``
    presets), each with its ``type``. Sizes are read from the weights.
    """
    name = preset if preset is not None else preset_of(model)
    modules = {n: _entry(m) for n, m in model.named_modules() if isinstance(m, _PLANNED)}
    return {"format": PLAN_FORMAT, "preset": name, "modules": modules}


def _entry(m: nn.Module) -> dict[str, Any]:
    if isinstance(m, nn.Conv2d):
        out, inp = _dims(m)
        return {"type": "Conv2d", "in_channels": inp, "out_channels": out}
    if isinstance(m, nn.Linear):
        return {
            "type": "Linear",
            "in_features": m.weight.shape[1],
            "out_features": m.weight.shape[0],
        }
    if isinstance(m, nn.GroupNorm):
        return {"type": "GroupNorm", "num_groups": m.num_groups, "num_channels": m.num_channels}
    if isinstance(m, Attention):
        return {"type": "Attention", "heads": m.heads, "inner_dim": m.to_q.weight.shape[0]}
    if isinstance(m, nn.Embedding):
        return {
            "type": "Embedding",
            "num_embeddings": m.weight.shape[0],
            "embedding_dim": m.weight.shape[1],
        }
    raise TypeError(f"no plan entry for {type(m).__name__}")


@functools.lru_cache(maxsize=8)
def _dense_plan_json(preset: str) -> str:
    return json.dumps(channel_plan(_meta_unet(preset), preset=preset))


def dense_plan(preset: str) -> dict[str, Any]:
    """The channel plan of the unpruned ``preset`` (a fresh copy)."""
    plan: dict[str, Any] = json.loads(_dense_plan_json(preset))
    return plan


def _meta_unet(preset: str) -> UNet2DModel:
    """``preset`` with parameters on the meta device: shapes only, no memory, no init."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    with torch.device("meta"):
        return UNet2DModel(**PRESETS[preset])


def validate_plan(preset: str, plan: Any) -> None:
    """Raise ConfigError unless ``plan`` is a well-formed channel plan of ``preset``.

    Plans travel over the network, so everything is checked before anything is built: the
    format tag and preset, the exact set of module names, each entry's type and keys,
    integer sizes in ``1..dense``, fixed sizes (GroupNorm ``num_groups``, attention
    ``heads``, the class embedding's ``num_embeddings``), GroupNorm divisibility, the sizes
    that must be equal where the forward pass would only broadcast them (residual and
    time-embedding adds, attention's projections and residual, the class embedding), and
    finally a shape-only forward pass on the meta device that proves the sizes fit together.
    """
    dense = dense_plan(preset)
    if not isinstance(plan, Mapping):
        raise ConfigError(f"channel plan must be a JSON object, got {type(plan).__name__}")
    if set(plan) != {"format", "preset", "modules"}:
        raise ConfigError(
            f"channel plan keys {sorted(map(str, plan))}: want format, preset, modules"
        )
    if plan["format"] != PLAN_FORMAT:
        raise ConfigError(
            f"channel plan format {plan['format']!r}: this build reads {PLAN_FORMAT!r}"
        )
    if plan["preset"] != preset:
        raise ConfigError(f"channel plan is for preset {plan['preset']!r}, not {preset!r}")
    modules = plan["modules"]
    if not isinstance(modules, Mapping):
        raise ConfigError("channel plan 'modules' must be a JSON object")
    unknown = sorted(map(str, set(modules) - set(dense["modules"])))
    missing = sorted(set(dense["modules"]) - set(modules))
    if unknown or missing:
        raise ConfigError(
            f"channel plan modules differ from preset {preset!r}: "
            f"unknown {unknown[:5]}, missing {missing[:5]}"
        )
    for name, ref in dense["modules"].items():
        _check_entry(name, modules[name], ref)
    _check_forward(preset, modules)


def _check_entry(name: str, entry: Any, ref: Mapping[str, Any]) -> None:
    if not isinstance(entry, Mapping) or set(entry) != set(ref):
        raise ConfigError(f"channel plan entry {name!r} must have exactly the keys {sorted(ref)}")
    if entry["type"] != ref["type"]:
        raise ConfigError(
            f"channel plan entry {name!r} has type {entry['type']!r}, not {ref['type']!r}"
        )
    for key, dense in ref.items():
        if key == "type":
            continue
        v = entry[key]
        if type(v) is not int or not 1 <= v <= dense:
            raise ConfigError(
                f"channel plan {name!r}: {key}={v!r} must be an integer in 1..{dense}"
            )
    fixed = _FIXED.get(ref["type"])
    if fixed is not None and entry[fixed] != ref[fixed]:
        raise ConfigError(f"channel plan {name!r}: {fixed} must stay {ref[fixed]}")
    if ref["type"] == "GroupNorm":
        if entry["num_channels"] % entry["num_groups"]:
            raise ConfigError(
                f"channel plan {name!r}: num_channels={entry['num_channels']} is not divisible "
                f"by num_groups={entry['num_groups']}"
            )
    if ref["type"] == "Attention" and entry["inner_dim"] % entry["heads"]:
        raise ConfigError(
            f"channel plan {name!r}: inner_dim={entry['inner_dim']} is not divisible by "
            f"heads={entry['heads']}"
        )


def _check_couplings(model: UNet2DModel, modules: Mapping[str, Any]) -> None:
    """Sizes that must be equal where the forward pass would only broadcast them: a residual
    add, a time-embedding add, attention's projections and its residual, the class
    embedding added to the time embedding. ``model`` is the dense preset (names only)."""

    def size(name: str, key: str) -> int:
        value: int = modules[name][key]
        return value

    def need(where: str, a: tuple[str, str], b: tuple[str, str], factor: int = 1) -> None:
        if size(*a) != factor * size(*b):
            times = f"{factor} x " if factor != 1 else ""
            raise ConfigError(
                f"channel plan {where!r}: {a[0]}.{a[1]}={size(*a)} must equal "
                f"{times}{b[0]}.{b[1]}={size(*b)}"
            )

    for name, m in model.named_modules():
        p = f"{name}." if name else ""
        if isinstance(m, ResnetBlock2D):
            width = (f"{p}conv1", "out_channels")
            if m.time_emb_proj is not None and m.time_embedding_norm in ("default", "scale_shift"):
                factor = 2 if m.time_embedding_norm == "scale_shift" else 1
                need(name, (f"{p}time_emb_proj", "out_features"), width, factor)
            shortcut = m.conv_shortcut
            residual = (
                (f"{p}conv_shortcut", "out_channels") if shortcut else (f"{p}conv1", "in_channels")
            )
            need(name, (f"{p}conv2", "out_channels"), residual)
        elif isinstance(m, Attention):
            inner = (name, "inner_dim")
            for proj in ("to_q", "to_k", "to_v"):
                need(name, (f"{p}{proj}", "out_features"), inner)
            need(name, (f"{p}to_out.0", "in_features"), inner)
            need(name, (f"{p}to_out.0", "out_features"), (f"{p}to_q", "in_features"))
            if m.group_norm is not None:
                need(name, (f"{p}to_q", "in_features"), (f"{p}group_norm", "num_channels"))
        elif isinstance(m, nn.Embedding):
            need(name, (name, "embedding_dim"), ("time_embedding.linear_2", "out_features"))


def _check_forward(preset: str, modules: Mapping[str, Any]) -> None:
    model = _meta_unet(preset)
    _check_couplings(model, modules)
    try:
        _apply_plan(model, modules)
    except Exception as err:  # a plan that passed every check above must not get here
        raise ConfigError(f"channel plan cannot be applied: {type(err).__name__}: {err}") from None
    c, h, w = image_shape(preset)
    sample = torch.zeros(1, c, h, w, device="meta")
    entered: list[str] = []  # names the module a shape error happens in
    for name, m in model.named_modules():
        if isinstance(m, _SIZED):
            m.register_forward_pre_hook(lambda *_, n=name: entered.append(n))
    try:
        with torch.no_grad():
            one = torch.ones(1, dtype=torch.long, device="meta")
            labels = one if model.config.num_class_embeds else None
            out = model(sample, one, class_labels=labels).sample
    except Exception as err:  # any failure of the shape-only pass is the plan's fault
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        where = f" at {entered[-1]!r}" if entered else ""
        raise ConfigError(f"channel plan sizes do not fit together{where}: {first}") from None
    if out.shape != sample.shape:
        raise ConfigError(f"channel plan changes the output shape to {list(out.shape)}")


def _apply_plan(model: nn.Module, modules: Mapping[str, Any]) -> None:
    """Resize ``model``'s parameters to ``modules`` (keeping leading channels) in place."""
    for name, entry in modules.items():
        m = model.get_submodule(name)
        if isinstance(m, nn.Conv2d):
            out, inp = entry["out_channels"], entry["in_channels"]
            _keep(m, "weight", (out, inp // m.groups))
            _keep(m, "bias", (out,))
        elif isinstance(m, nn.Linear):
            _keep(m, "weight", (entry["out_features"], entry["in_features"]))
            _keep(m, "bias", (entry["out_features"],))
        elif isinstance(m, nn.GroupNorm):
            _keep(m, "weight", (entry["num_channels"],))
            _keep(m, "bias", (entry["num_channels"],))
            m.num_channels = entry["num_channels"]
        elif isinstance(m, nn.Embedding):
            _keep(m, "weight", (entry["num_embeddings"], entry["embedding_dim"]))
        elif isinstance(m, Attention):
            m.heads = entry["heads"]
    sync_attributes(model)
    for name, entry in modules.items():
        if entry["type"] == "Attention":
            model.get_submodule(name).inner_dim = entry["inner_dim"]


def _keep(m: nn.Module, attr: str, sizes: tuple[int, ...]) -> None:
    p = getattr(m, attr, None)
    if p is None:
        return
    kept = p.detach()[tuple(slice(0, s) for s in sizes)].clone()
    setattr(m, attr, nn.Parameter(kept, requires_grad=p.requires_grad))


def build_from_plan(preset: str, plan: Mapping[str, Any] | None, *, seed: int = 0) -> UNet2DModel:
    """The ``preset`` U-Net resized to ``plan`` (``None``: dense), without Torch-Pruning.

    The dense preset is initialized from ``seed`` and every parameter is cut to its planned
    shape (leading channels kept), so the result is ready for ``load_state_dict`` of the
    weights that travel with the plan.
    """
    if plan is not None:
        validate_plan(preset, plan)
    model = build_unet(preset, seed=seed)
    if plan is not None:
        _apply_plan(model, plan["modules"])
    return model


def plan_spec(preset: str, plan: Mapping[str, Any] | None) -> dict[str, TensorSpec]:
    """Names, shapes and dtypes of the state dict under ``plan``, built on the meta device."""
    if plan is not None:
        validate_plan(preset, plan)
    model = _meta_unet(preset)
    if plan is not None:
        _apply_plan(model, plan["modules"])
    return spec_of(model.state_dict())


# -- sparse training (eqs. 16-17) ---------------------------------------------------------


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
    names: dict[nn.Module, str] = {m: n for n, m in model.named_modules() if isinstance(m, _LAYERS)}
    order: dict[str, None] = {}

    def record(module: nn.Module, args: object) -> None:
        order.setdefault(names[module], None)

    handles = [m.register_forward_pre_hook(record) for m in names]
    try:
        with torch.no_grad():
            model(**_example_inputs(model))  # type: ignore[arg-type]
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
        _, groups = _dependency_groups(work)
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


def _slices(module: nn.Module, member: _Member) -> list[tuple[str, int, tuple[int, ...]]]:
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
