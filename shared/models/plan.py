"""Channel plans: the architecture a role trains, as JSON that travels and is checked.

Every role rebuilds the same module from the preset name plus the JSON plan that travels in
``RoundStart.arch`` / ``EdgeRound.arch`` (DESIGN section 4: no pickled modules): the dense
preset with every Conv2d, Linear, GroupNorm, Attention and Embedding resized to the plan's
sizes (leading channels kept). Plans come off the network, so :func:`check_plan` validates
one before anything is built from it. Pruning itself (which produces plans) is
:mod:`shared.models.pruning`.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shared.errors import ConfigError, EstuaryError
from shared.models.domain_axis import ClassDomainEmbedding
from shared.models.presets import (
    DOMAIN_AXIS,
    PRESETS,
    build_net,
    build_unet,
    construct_unet,
    image_shape,
    kind_of,
    state_spec,
)
from shared.wire.codec import TensorSpec, spec_of

if TYPE_CHECKING:
    from diffusers import UNet2DModel
    from diffusers.models.attention_processor import Attention

#: a channel plan as JSON: ``{"format": PLAN_FORMAT, "preset": ..., "modules": {...}}``
Plan = dict[str, Any]


def plan_digest(plan: ChannelPlan | Plan | None) -> str:
    """Short stable id of a plan, parsed or as JSON ("dense" for None)."""
    if plan is None:
        return "dense"
    doc = plan.doc if isinstance(plan, ChannelPlan) else plan
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


class ChannelPlan:
    """A channel plan checked against its preset: what :func:`build_model` and
    :func:`model_spec` take, so a plan is validated once, where it arrives.

    Parse a plan that comes from outside (a message, a checkpoint, a device's state file)
    with :meth:`parse`; a plan read off a module this process built (:meth:`of_module`)
    needs no check. Immutable: :attr:`doc` is a private copy, :meth:`to_json` another."""

    __slots__ = ("_doc", "digest", "preset")

    def __init__(self, preset: str, doc: Plan) -> None:
        """Wrap an already checked plan (use :meth:`parse` or :meth:`of_module`)."""
        self.preset = preset
        self._doc = json.loads(json.dumps(doc))
        self.digest = plan_digest(self._doc)

    @classmethod
    def parse(cls, preset: str, doc: Any) -> ChannelPlan:
        """``doc`` checked against ``preset`` (:func:`validate_plan`): ConfigError naming
        what is wrong, whatever the malformation."""
        try:
            validate_plan(preset, doc)
        except ConfigError:
            raise
        except (EstuaryError, ValueError, TypeError, KeyError) as err:
            raise ConfigError(str(err)) from None
        return cls(preset, doc)

    @classmethod
    def of_module(cls, model: UNet2DModel, *, preset: str | None = None) -> ChannelPlan:
        """The plan of a module this process built or pruned (:func:`channel_plan`)."""
        doc = channel_plan(model, preset=preset)
        return cls(doc["preset"], doc)

    @property
    def doc(self) -> Plan:
        """The plan as JSON (read-only by convention: use :meth:`to_json` for a copy)."""
        return self._doc

    @property
    def modules(self) -> Mapping[str, Any]:
        """Each planned module's entry (sizes by name)."""
        modules: Mapping[str, Any] = self._doc["modules"]
        return modules

    def to_json(self) -> Plan:
        """A copy of the plan as JSON, the form that travels and is stored."""
        doc: Plan = json.loads(json.dumps(self._doc))
        return doc

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChannelPlan) and self._doc == other._doc

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"ChannelPlan({self.preset!r}, {self.digest})"


def parse_plan(preset: str, doc: Any) -> ChannelPlan | None:
    """A plan's JSON as it arrived, checked against ``preset``; None (the dense preset) for
    None. Raises ConfigError saying why the plan cannot be used."""
    return None if doc is None else ChannelPlan.parse(preset, doc)


def plan_doc(plan: ChannelPlan | None) -> Plan | None:
    """The JSON of ``plan`` (a copy), or None for the dense preset: what messages carry."""
    return None if plan is None else plan.to_json()


def model_spec(preset: str, plan: ChannelPlan | None) -> dict[str, TensorSpec]:
    """Tensor names, shapes and dtypes of ``preset`` under ``plan`` (no weights built)."""
    if plan is None:
        return state_spec(preset)
    model = _meta_unet(preset)
    _apply_plan(model, plan.modules)
    return spec_of(model.state_dict())


def build_model(preset: str, plan: ChannelPlan | None, *, seed: int = 0) -> nn.Module:
    """A module of ``preset`` under ``plan``, initialized from ``seed``: the dense preset
    with every parameter cut to its planned shape (leading channels kept), ready for
    ``load_state_dict`` of the weights that travel with the plan. No Torch-Pruning needed."""
    if kind_of(preset) != "unet":
        if plan is not None:
            raise ConfigError(
                f"model preset {preset!r} is a {kind_of(preset)} model: no channel plan"
            )
        return build_net(preset, seed=seed)
    model = build_unet(preset, seed=seed)
    if plan is not None:
        _apply_plan(model, plan.modules)
    return model


#: version tag of the JSON channel plan; a plan with another tag is refused
PLAN_FORMAT = "estuary.channel-plan/1"
#: modules a plan sizes: Conv2d, Linear, GroupNorm and Embedding by their weights
SIZED_MODULES = (nn.Conv2d, nn.Linear, nn.GroupNorm, nn.Embedding)


def _planned() -> tuple[type[nn.Module], ...]:
    """The module types a plan sizes: :data:`SIZED_MODULES` and diffusers' attention.

    diffusers is imported where a U-Net's modules are looked at, never at import: a role
    that only moves and averages tensors (an edge, the cloud between evaluations) does not
    load it (about 165 MiB of resident memory)."""
    from diffusers.models.attention_processor import Attention

    return (*SIZED_MODULES, Attention)


#: plan entry sizes that pruning never changes: GroupNorm groups, attention heads (a head
#: count change with the same tensor shapes would silently change the model's function),
#: the class embedding's number of classes
_FIXED = {"GroupNorm": "num_groups", "Attention": "heads", "Embedding": "num_embeddings"}


def channel_dims(m: nn.Module) -> list[int]:
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


def sync_attributes(model: nn.Module) -> None:
    """Re-derive the size attributes diffusers and torch keep beside the weights.

    Torch-Pruning resizes weights (and Conv2d/Linear/GroupNorm sizes) but not the
    attributes that diffusers blocks check or use in ``forward``; this sets all of them from
    the weight shapes, so a pruned or plan-built U-Net runs, trains and exports.
    """
    from diffusers.models.attention_processor import Attention
    from diffusers.models.downsampling import Downsample2D
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.upsampling import Upsample2D

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


def preset_of(model: UNet2DModel) -> str:
    """The preset whose constructor arguments ``model``'s config matches."""

    def norm(v: Any) -> Any:
        return list(v) if isinstance(v, (tuple, list)) else v

    cfg = dict(model.config)
    axis = isinstance(getattr(model, "class_embedding", None), ClassDomainEmbedding)
    hits = [
        name
        for name, kwargs in PRESETS.items()
        if all(norm(cfg.get(k)) == norm(v) for k, v in kwargs.items())
        and cfg.get("num_class_embeds") == kwargs.get("num_class_embeds")
        and (name in DOMAIN_AXIS) == axis
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
    modules = {n: _entry(m) for n, m in model.named_modules() if isinstance(m, _planned())}
    return {"format": PLAN_FORMAT, "preset": name, "modules": modules}


def _entry(m: nn.Module) -> dict[str, Any]:
    from diffusers.models.attention_processor import Attention

    if isinstance(m, nn.Conv2d):
        out, inp = channel_dims(m)
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
        return construct_unet(preset)


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
    from diffusers.models.attention_processor import Attention
    from diffusers.models.resnet import ResnetBlock2D

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
        if isinstance(m, SIZED_MODULES):
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
    from diffusers.models.attention_processor import Attention

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
