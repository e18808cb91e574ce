"""Model presets and their size: parameters, MACs, fp32 bytes.

Two kinds of generator: ``unet`` presets (diffusers ``UNet2DModel``, a noise predictor that
samples in DDIM steps) and ``oneshot`` presets (:mod:`shared.models.oneshot`: PRISM's ResNet
generator, one forward pass from a latent ``z``), and one kind of classifier, ``classifier``
(:mod:`shared.models.classifier`: pFedGPA's small CNN). :func:`kind_of` tells them apart,
:func:`build_net` builds any.

``ddpm-cifar10`` is the DDPM U-Net of Ho et al. (2020) as used by FedPhD's Tables III-IV:
35.7 M parameters and 6.06 GMACs for one 32x32 forward pass; it trains on CIFAR-10 or on a
grayscale dataset viewed in 3 channels (:func:`check_trainable`). The Fashion-MNIST presets
are one-channel 32x32 models (28x28 images padded by two pixels).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shared.errors import ConfigError, did_you_mean
from shared.families import FAMILIES, family_of
from shared.models.classifier import CLASSIFIER_PRESETS, build_classifier, is_classifier
from shared.models.domain_axis import add_domain_axis
from shared.models.oneshot import ONESHOT_PRESETS, build_oneshot, is_oneshot, latent_dim
from shared.wire.codec import TensorSpec, spec_of

if TYPE_CHECKING:
    from diffusers import UNet2DModel

    from shared.config import RunConfig

#: every U-Net preset's state-dict names, shapes and dtypes: an edge or the cloud checks an
#: upload against its preset from here, without importing diffusers (about 165 MiB resident)
UNET_SPECS_PATH = Path(__file__).resolve().parents[1] / "assets" / "unet_specs.json"

PRESETS: dict[str, dict[str, Any]] = {
    "fmnist-tiny": {
        "sample_size": 32,
        "in_channels": 1,
        "out_channels": 1,
        "block_out_channels": (16, 32, 64),
        "layers_per_block": 1,
        "down_block_types": ("DownBlock2D", "DownBlock2D", "AttnDownBlock2D"),
        "up_block_types": ("AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
        "norm_num_groups": 8,
        "attention_head_dim": 32,
    },
    "fmnist-small": {
        "sample_size": 32,
        "in_channels": 1,
        "out_channels": 1,
        "block_out_channels": (64, 128, 128, 128),
        "layers_per_block": 2,
        "down_block_types": ("DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"),
        "up_block_types": ("UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        "norm_num_groups": 32,
        "attention_head_dim": None,
    },
    "ddpm-cifar10": {
        "sample_size": 32,
        "in_channels": 3,
        "out_channels": 3,
        "block_out_channels": (128, 256, 256, 256),
        "layers_per_block": 2,
        "down_block_types": ("DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"),
        "up_block_types": ("UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        "norm_num_groups": 32,
        "attention_head_dim": None,
        "flip_sin_to_cos": False,
        "freq_shift": 1,
    },
}
# Class-conditional variants: a learned class embedding added to the time embedding
# (diffusers' ``num_class_embeds``); trained with each image's label, sampled per class.
PRESETS["fmnist-tiny-cond"] = {**PRESETS["fmnist-tiny"], "num_class_embeds": 10}
PRESETS["fmnist-small-cond"] = {**PRESETS["fmnist-small"], "num_class_embeds": 10}
# Classifier-free guidance variants (FedDEO): 10 classes plus a null class (index 10) that
# training drops labels to, so that eps(x, t, null) is the unconditional prediction.
PRESETS["fmnist-tiny-cfg"] = {**PRESETS["fmnist-tiny"], "num_class_embeds": 11}
PRESETS["fmnist-small-cfg"] = {**PRESETS["fmnist-small"], "num_class_embeds": 11}
# A classifier-free-guidance U-Net whose conditioning also has a domain axis (FedDEO's
# generator that knows domains, shared.models.domain_axis): class row + domain row, the
# domains of shared.data.domains.DOMAINS plus "unspecified" (row 0).
PRESETS["fmnist-tiny-dom"] = dict(PRESETS["fmnist-tiny-cfg"])
#: presets with a domain axis -> their number of domain rows (the unspecified one included)
DOMAIN_AXIS: dict[str, int] = {"fmnist-tiny-dom": 7}
#: presets whose last class embedding is the null class of classifier-free guidance
CFG_PRESETS: frozenset[str] = frozenset({"fmnist-tiny-cfg", "fmnist-small-cfg", *DOMAIN_AXIS})


#: every preset name: U-Nets, one-shot generators and classifiers
ALL_PRESETS: tuple[str, ...] = (*PRESETS, *ONESHOT_PRESETS, *CLASSIFIER_PRESETS)
#: each family's presets are the ones built here (the families declare them torch-free)
if {f.kind: set(f.presets) for f in FAMILIES.values()} != {
    "unet": set(PRESETS), "oneshot": set(ONESHOT_PRESETS), "classifier": set(CLASSIFIER_PRESETS)
}:  # fmt: skip
    raise TypeError("shared.families declares other presets than shared.models builds")


def kind_of(preset: str) -> str:
    """``"unet"``, ``"oneshot"`` or ``"classifier"``: the preset's family
    (:mod:`shared.families`; ConfigError for an unknown preset)."""
    try:
        return family_of(preset).kind
    except KeyError:
        raise ConfigError(
            f"unknown model preset {preset!r}{did_you_mean(preset, ALL_PRESETS)}; "
            f"choose one of {sorted(ALL_PRESETS)}"
        ) from None


def build_net(preset: str, *, seed: int = 0) -> nn.Module:
    """A freshly initialized model of ``preset``, any kind; the init is drawn from ``seed``
    only."""
    kind = kind_of(preset)
    if kind == "oneshot":
        return build_oneshot(preset, seed=seed)
    if kind == "classifier":
        return build_classifier(preset, seed=seed)
    return build_unet(preset, seed=seed)


def build_unet(preset: str, *, seed: int = 0) -> UNet2DModel:
    """A freshly initialized U-Net of ``preset``; the init is drawn from ``seed`` only."""
    if kind_of(preset) != "unet":
        raise ConfigError(f"model preset {preset!r} is a {kind_of(preset)} model, not a U-Net")
    devices: list[int] = []
    with torch.random.fork_rng(devices=devices):
        torch.random.manual_seed(seed)  # scoped by fork_rng: the caller's RNG is untouched
        return construct_unet(preset)


def construct_unet(preset: str) -> UNet2DModel:
    """``preset``'s U-Net built with the current RNG and default device (its domain axis
    added, :data:`DOMAIN_AXIS`). diffusers is imported here, on first use: a role that only
    moves and averages tensors never loads it."""
    from diffusers import UNet2DModel

    unet = UNet2DModel(**PRESETS[preset])
    if preset in DOMAIN_AXIS:
        add_domain_axis(unet, DOMAIN_AXIS[preset])
    return unet


def state_spec(preset: str) -> dict[str, TensorSpec]:
    """Names, shapes and dtypes of the preset's state dict, without initializing weights.

    A U-Net preset's comes from ``shared/assets/unet_specs.json`` (a test holds it to
    :func:`construct_spec`), so a role that checks uploads never imports diffusers."""
    if kind_of(preset) == "unet":
        shipped = _shipped_unet_spec(preset)
        if shipped is not None:
            return dict(shipped)
    return construct_spec(preset)


def construct_spec(preset: str) -> dict[str, TensorSpec]:
    """:func:`state_spec` measured: the preset built on the meta device."""
    kind = kind_of(preset)
    with torch.device("meta"):
        if kind == "oneshot":
            model: nn.Module = build_oneshot(preset)
        elif kind == "classifier":
            model = build_classifier(preset)
        else:
            model = construct_unet(preset)
        return spec_of(model.state_dict())


def shipped_unet_specs(path: Path = UNET_SPECS_PATH) -> dict[str, list[list[Any]]]:
    """Preset name -> its shipped ``[name, shape, dtype]`` rows (``{}`` when missing;
    ``python -m shared.models.info_table`` writes them)."""
    if not path.is_file():
        return {}
    doc = json.loads(path.read_text())
    return dict(doc["presets"])


@functools.lru_cache(maxsize=16)
def _shipped_unet_spec(preset: str) -> dict[str, TensorSpec] | None:
    rows = shipped_unet_specs().get(preset)
    if rows is None:
        return None
    return {name: TensorSpec(tuple(shape), getattr(torch, dtype)) for name, shape, dtype in rows}


def is_weight(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the state-dict tensor ``name`` of ``shape`` is a weight matrix or kernel (two
    or more dimensions): what PRISM masks, one bit each on the wire."""
    return name.endswith(".weight") and len(shape) >= 2


def module_device(model: nn.Module) -> torch.device | None:
    """The device of ``model``'s first parameter (None for a module without parameters)."""
    first = next(model.parameters(), None)
    return None if first is None else first.device


def num_classes_of(model: nn.Module) -> int:
    """Number of classes a conditional U-Net embeds (0 for an unconditional one; the null
    class of a classifier-free-guidance preset is not one of them)."""
    cfg = getattr(model, "config", None)
    n = int(getattr(cfg, "num_class_embeds", None) or 0)
    return n - 1 if null_class(model) is not None else n


def null_class(model: nn.Module) -> int | None:
    """The null class index of a classifier-free-guidance U-Net (its last class embedding,
    :data:`CFG_PRESETS`), None for any other model."""
    cfg = getattr(model, "config", None)
    n = int(getattr(cfg, "num_class_embeds", None) or 0)
    return n - 1 if n == CFG_NUM_EMBEDS else None


#: class embeddings of a classifier-free-guidance preset: Fashion-MNIST's 10 plus the null one
CFG_NUM_EMBEDS = 11


def image_shape(preset: str) -> tuple[int, int, int]:
    """(channels, height, width) of the preset's images."""
    if kind_of(preset) == "oneshot":
        return (ONESHOT_PRESETS[preset]["nc"], 32, 32)
    if kind_of(preset) == "classifier":
        return (1, 32, 32)
    cfg = PRESETS[preset]
    return (cfg["in_channels"], cfg["sample_size"], cfg["sample_size"])


def check_trainable(cfg: RunConfig) -> None:
    """Refuse to train ``model.preset`` on data that cannot become its input.

    The data gives ``data.input_channels`` channels: 1 for the grayscale datasets
    (Fashion-MNIST, synthetic, image folders), 3 for CIFAR-10 and for a grayscale dataset
    viewed in 3 channels (``data.gray_to_rgb``). A 3-channel one-shot generator is refused
    on any data: PRISM's feature-matching loss runs a 1-channel network."""
    preset, data = cfg.model.preset, cfg.data
    channels = image_shape(preset)[0]
    if channels != 1 and kind_of(preset) == "oneshot":
        raise ConfigError(
            f"model.preset = {preset!r} takes {channels}-channel images, and a one-shot "
            "generator trains with a feature-matching loss on a 1-channel Fashion-MNIST "
            "network (fmnist-match-v1): train a 'resnetg-fmnist-*' preset"
        )
    if channels == data.input_channels:
        return
    if data.gray_to_rgb:
        raise ConfigError(
            f"data.gray_to_rgb = true views the grayscale images in 3 channels, and "
            f"model.preset = {preset!r} takes {channels}-channel images: nothing to view; "
            "remove data.gray_to_rgb, or train a 3-channel preset ('ddpm-cifar10')"
        )
    if data.channels == 1:
        raise ConfigError(
            f"model.preset = {preset!r} takes {channels}-channel images, and data.dataset = "
            f"{data.dataset!r} is grayscale (1 channel): set data.gray_to_rgb = true to train "
            "it on each image replicated into 3 identical channels, or data.dataset = "
            "'cifar10' with data.path = CIFAR-10's binary version (docs/configuration.md)"
        )
    raise ConfigError(
        f"data.dataset = {data.dataset!r} holds {data.channels}-channel colour images, and "
        f"model.preset = {preset!r} takes {channels}-channel images (no colour-to-gray "
        "conversion is defined): train 'ddpm-cifar10' on it"
    )


@dataclass(frozen=True)
class ModelInfo:
    """Size of a model: parameters, multiply-accumulates per image, fp32 bytes.

    ``macs`` is Torch-Pruning's operation count (FedPhD's convention); ``weight_macs`` counts
    only the weight multiply-accumulates of convolutions and linear layers (no bias
    additions, no normalization), the stricter textbook figure.
    """

    preset: str
    params: int
    macs: int
    weight_macs: int
    fp32_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """JSON form with human-readable millions/giga figures too."""
        return {
            "preset": self.preset,
            "params": self.params,
            "params_m": round(self.params / 1e6, 3),
            "macs": self.macs,
            "gmacs": round(self.macs / 1e9, 3),
            "weight_macs": self.weight_macs,
            "weight_gmacs": round(self.weight_macs / 1e9, 3),
            "fp32_bytes": self.fp32_bytes,
            "fp32_mib": round(self.fp32_bytes / 2**20, 2),
        }


def count_params(model: nn.Module) -> int:
    """Number of trainable and frozen parameters."""
    return sum(p.numel() for p in model.parameters())


def count_macs(model: nn.Module, sample: torch.Tensor, timestep: int = 10) -> int:
    """Multiply-accumulates of one forward pass on ``sample``, per image.

    Uses Torch-Pruning's operation counter, the convention behind FedPhD's Table III
    (module operations; the attention score products are not counted), so pruned models
    can be compared with the paper's figures.
    """
    import torch_pruning as tp

    inputs = forward_inputs(model, sample, timestep)
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        ops, _ = tp.utils.count_ops_and_params(model, example_inputs=inputs)
    return int(ops) // sample.shape[0]


def forward_inputs(model: nn.Module, sample: torch.Tensor, timestep: int) -> dict[str, Any]:
    """Keyword inputs of one forward pass producing images like ``sample``: a U-Net's
    (sample, timestep, class 0 when conditional), a one-shot generator's latent ``z``, a
    classifier's images ``x``."""
    if is_classifier(model):
        return {"x": sample}
    if is_oneshot(model):
        return {"z": torch.zeros(sample.shape[0], latent_dim(model), 1, 1)}
    inputs = {
        "sample": sample,
        "timestep": torch.full((sample.shape[0],), timestep, dtype=torch.long),
    }
    if num_classes_of(model):
        inputs["class_labels"] = torch.zeros(sample.shape[0], dtype=torch.long)
    return inputs


def count_weight_macs(model: nn.Module, sample: torch.Tensor, timestep: int = 10) -> int:
    """Weight multiply-accumulates of one forward pass on ``sample``, per image.

    Counts ``out_elements * in_channels / groups * kernel_area`` for every Conv2d and
    ``out_elements * in_features`` for every Linear, ``in_elements * out_channels / groups *
    kernel_area`` for every transposed convolution, and nothing else: no bias additions,
    no normalization or activation operations (which :func:`count_macs` includes).
    """
    total = 0

    def conv(m: nn.Conv2d, _inp: Any, out: torch.Tensor) -> None:
        nonlocal total
        total += out.numel() * (m.in_channels // m.groups) * math.prod(m.kernel_size)

    def linear(m: nn.Linear, _inp: Any, out: torch.Tensor) -> None:
        nonlocal total
        total += out.numel() * m.in_features

    def conv_t(m: nn.ConvTranspose2d, inp: tuple[torch.Tensor, ...], _out: Any) -> None:
        nonlocal total
        total += inp[0].numel() * (m.out_channels // m.groups) * math.prod(m.kernel_size)

    hooks = []
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            hooks.append(m.register_forward_hook(conv))
        elif isinstance(m, nn.ConvTranspose2d):
            hooks.append(m.register_forward_hook(conv_t))
        elif isinstance(m, nn.Linear):
            hooks.append(m.register_forward_hook(linear))
    inputs = forward_inputs(model, sample, timestep)
    try:
        with torch.no_grad():
            if "z" in inputs or "x" in inputs:
                model(*inputs.values())
            else:
                model(inputs.pop("sample"), inputs.pop("timestep"), **inputs)
    finally:
        for h in hooks:
            h.remove()
    return total // sample.shape[0]


def model_info(preset: str, *, model_fn: Callable[[], nn.Module] | None = None) -> ModelInfo:
    """Params, MACs (one image at the preset's resolution) and fp32 bytes of ``preset``."""
    model = model_fn() if model_fn is not None else build_net(preset)
    model.eval()
    c, h, w = image_shape(preset)
    params = count_params(model)
    sample = torch.zeros(1, c, h, w)
    macs = count_macs(model, sample)
    weight_macs = count_weight_macs(model, sample)
    return ModelInfo(
        preset=preset, params=params, macs=macs, weight_macs=weight_macs, fp32_bytes=params * 4
    )
