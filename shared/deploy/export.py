"""Export a trained generator to ONNX with a parity gate and a model card (DESIGN section 5).

:func:`export_generator` traces the noise predictor ``eps(sample, timestep[, class_labels])``
of a dense, pruned or class-conditional U-Net with a dynamic batch axis (opset >= 17,
optionally fp16 inside with fp32 inputs and outputs), then checks it against torch twice
before anything is written: on random inputs, and on a whole DDIM trajectory from the same
noise (torch eager + diffusers' scheduler against ONNX Runtime + the numpy loop the devices
run). Above ``threshold`` the export is refused with both errors in the message. A one-shot
generator (:mod:`shared.models.oneshot`) exports as ``image = f(z)``; its second check is
the images the devices' sampler makes from its own seeded latents.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from shared import __version__
from shared.atomic import atomic_write
from shared.config import DiffusionSection, RunConfig
from shared.deploy.onnx_sampler import DdimSchedule, OnnxGenerator
from shared.deploy.onnx_sampler import ddim_sample as numpy_ddim_sample
from shared.deploy.signing import (
    key_id,
    make_manifest,
    new_version,
    read_version,
    sign_manifest,
    write_signed,
)
from shared.diffusion.schedule import ddim_sample
from shared.errors import ExportError
from shared.evaluation.evaluator import model_from_state
from shared.evaluation.report import last_quality, read_metrics
from shared.methods.api import Method
from shared.methods.registry import make_algorithm
from shared.models.checkpoint import latest_checkpoint_path, load_checkpoint
from shared.models.classifier import refuse_classifier
from shared.models.oneshot import is_oneshot, latent_dim, latents
from shared.models.plan import ChannelPlan, plan_digest
from shared.models.presets import count_macs, count_params, image_shape, num_classes_of
from shared.wire.codec import encode_tensors, spec_of

MIN_OPSET = 17
#: the global model's federated tensors beside ``model.onnx`` when devices keep local parts
SHARED_FILE = "shared.safetensors"


class EpsModel(nn.Module):
    """``UNet2DModel`` as a plain function of tensors: eps = f(sample, timestep[, labels])."""

    def __init__(self, unet: nn.Module, *, fp16: bool = False) -> None:
        super().__init__()
        self.unet = copy.deepcopy(unet).half() if fp16 else unet  # the caller's stays fp32
        self.fp16 = fp16

    def forward(
        self, sample: torch.Tensor, timestep: torch.Tensor, class_labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Predicted noise, float32 whatever the inside precision."""
        x = sample.half() if self.fp16 else sample
        out = self.unet(x, timestep, class_labels=class_labels).sample
        return out.float()


@dataclass
class Parity:
    """Max abs error of ONNX Runtime against torch on random inputs and on a trajectory."""

    random_max_abs: float
    trajectory_max_abs: float
    trajectory_steps: int
    threshold: float
    samples: int

    @property
    def worst(self) -> float:
        """The larger of the two errors."""
        return max(self.random_max_abs, self.trajectory_max_abs)

    @property
    def passed(self) -> bool:
        """Whether both errors are within the threshold."""
        return self.worst <= self.threshold

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "random_max_abs": self.random_max_abs,
            "trajectory_max_abs": self.trajectory_max_abs,
            "trajectory_steps": self.trajectory_steps,
            "threshold": self.threshold,
            "samples": self.samples,
            "passed": self.passed,
        }


@dataclass
class ExportResult:
    """What :func:`export_generator` wrote."""

    out_dir: Path
    model_path: Path
    card: dict[str, Any]
    parity: Parity
    manifest_path: Path
    signed: bool
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (what ``estuary export --json`` prints)."""
        return {
            "out_dir": str(self.out_dir),
            "model": str(self.model_path),
            "manifest": str(self.manifest_path),
            "signed": self.signed,
            "seconds": round(self.seconds, 2),
            "parity": self.parity.to_dict(),
            "card": self.card,
            **self.extra,
        }


def scheduler_card(cfg: DiffusionSection) -> dict[str, Any]:
    """The scheduler entry of a model card (what the numpy DDIM loop needs)."""
    return {
        "name": "DDIM",
        "num_train_timesteps": cfg.num_train_timesteps,
        "beta_start": cfg.beta_start,
        "beta_end": cfg.beta_end,
        "beta_schedule": "linear",
        "prediction_type": "epsilon",
        "clip_sample": True,
        "clip_sample_range": 1.0,
        "set_alpha_to_one": True,
        "steps_offset": 0,
        "timestep_spacing": "leading",
        "eta": 0.0,
        "default_steps": cfg.sample_steps,
    }


def example_inputs(
    unet: nn.Module, batch: int, generator: torch.Generator, num_train_timesteps: int = 1000
) -> tuple[torch.Tensor, ...]:
    """Random (sample, timestep[, class_labels]) for tracing and for the parity check."""
    cfg: Any = getattr(unet, "config")  # noqa: B009 - diffusers' FrozenDict, untyped
    x = torch.randn(batch, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=generator)
    t = torch.randint(0, num_train_timesteps, (batch,), generator=generator)
    if cfg.num_class_embeds:
        return x, t, torch.randint(0, cfg.num_class_embeds, (batch,), generator=generator)
    return x, t


class ImageModel(nn.Module):
    """A one-shot generator as a plain function of tensors: image = f(z), float32 whatever
    the inside precision."""

    def __init__(self, generator: nn.Module, *, fp16: bool = False) -> None:
        super().__init__()
        self.generator = copy.deepcopy(generator).half() if fp16 else generator
        self.fp16 = fp16

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] from latents (batch, nz, 1, 1)."""
        out: torch.Tensor = self.generator(z.half() if self.fp16 else z)
        return out.float()


def _onnx_signature(
    unet: nn.Module, fp16: bool
) -> tuple[nn.Module, tuple[torch.Tensor, ...], list[str], str]:
    """(traced module, example inputs, input names, output name) of either kind."""
    gen = torch.Generator().manual_seed(0)
    if is_oneshot(unet):
        z = latents(2, latent_dim(unet), gen)
        return ImageModel(unet, fp16=fp16).eval(), (z,), ["z"], "image"
    inputs = example_inputs(unet, 2, gen)
    names = ["sample", "timestep", "class_labels"][: len(inputs)]
    return EpsModel(unet, fp16=fp16).eval(), inputs, names, "eps"


def to_onnx(unet: nn.Module, *, opset: int = MIN_OPSET, fp16: bool = False) -> bytes:
    """ONNX bytes of ``unet``'s noise predictor (a one-shot generator: its map from latents
    to images) with a dynamic batch axis.

    Uses the TorchScript exporter (``dynamo=False``): it traces these U-Nets in seconds,
    where the dynamo exporter takes about a minute per model on a CPU.
    """
    refuse_classifier(unet, "generator export")
    if opset < MIN_OPSET:
        raise ExportError(f"opset must be >= {MIN_OPSET}, got {opset}")
    model, inputs, names, output = _onnx_signature(unet, fp16)
    buf = io.BytesIO()
    with (
        torch.no_grad(),
        contextlib.redirect_stdout(io.StringIO()),
        warnings.catch_warnings(),
    ):
        # diffusers' shape asserts become trace-time constants; the shapes are fixed here
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        # the TorchScript exporter is chosen on purpose (see above); torch flags it legacy
        warnings.filterwarnings(
            "ignore", "You are using the legacy TorchScript", DeprecationWarning
        )
        # ... and warns about its own internal logging helper (torch 2.13), on every export
        warnings.filterwarnings(
            "ignore", "The feature will be removed", DeprecationWarning, r"torch\.onnx\."
        )
        torch.onnx.export(
            model,
            inputs,
            buf,  # type: ignore[arg-type]
            opset_version=opset,
            dynamo=False,
            input_names=names,
            output_names=[output],
            dynamic_axes={n: {0: "batch"} for n in [*names, output]},
        )
    return buf.getvalue()


def check_parity(
    unet: nn.Module,
    onnx_bytes: bytes,
    card: dict[str, Any],
    diffusion: DiffusionSection,
    *,
    threshold: float,
    steps: int = 20,
    samples: int = 4,
    seed: int = 0,
) -> Parity:
    """Max abs error of the ONNX model against torch: eps on random inputs, and the final
    images of a ``steps``-step DDIM trajectory from the same noise (torch: diffusers'
    scheduler; ONNX: the devices' numpy loop)."""
    unet = unet.eval()
    gen = torch.Generator().manual_seed(seed)
    onnx = OnnxGenerator(onnx_bytes, card, provider="cpu")
    if is_oneshot(unet):
        return _oneshot_parity(unet, onnx, threshold=threshold, samples=samples, gen=gen, seed=seed)
    inputs = example_inputs(unet, samples, gen, diffusion.num_train_timesteps)
    names = ["sample", "timestep", "class_labels"]
    feed = {n: v.numpy() for n, v in zip(names, inputs, strict=False)}
    with torch.no_grad():
        want = EpsModel(unet)(*inputs).numpy()
    got = onnx.session.run(None, feed)[0]
    random_err = float(np.abs(got - want).max())

    noise = torch.randn((samples, *inputs[0].shape[1:]), generator=gen)
    labels = inputs[2] if len(inputs) > 2 else None
    want_img = ddim_sample(
        unet, tuple(noise.shape), diffusion, gen, steps=steps, noise=noise, class_labels=labels
    ).numpy()
    got_img = numpy_ddim_sample(
        onnx.eps,
        noise.numpy(),
        DdimSchedule.from_card(card["scheduler"]),
        steps,
        labels.numpy() if labels is not None else None,
    )
    traj_err = float(np.abs(got_img - want_img).max())
    return Parity(random_err, traj_err, steps, threshold, samples)


def _oneshot_parity(
    model: nn.Module,
    onnx: OnnxGenerator,
    *,
    threshold: float,
    samples: int,
    gen: torch.Generator,
    seed: int,
) -> Parity:
    """A one-shot generator's parity: images from random latents, and the images the
    devices' sampler makes from its own seeded latents (one pass, so ``trajectory_steps``
    is 1), ONNX Runtime against torch."""
    z = latents(samples, latent_dim(model), gen)
    with torch.no_grad():
        want = model(z).float().numpy()
    got = onnx.session.run(None, {"z": z.numpy()})[0]
    random_err = float(np.abs(got - want).max())
    got_img, _ = onnx.sample(samples, steps=1, seed=seed)
    with torch.no_grad():
        want_img = model(torch.from_numpy(onnx.noise(samples, seed))).float().numpy()
    return Parity(random_err, float(np.abs(got_img - want_img).max()), 1, threshold, samples)


def _quality_of(run_dir: Path | None, round_: int) -> dict[str, Any] | None:
    """The run's last quality evaluation at or before round ``round_`` (from 1), if any."""
    if run_dir is None or not (run_dir / "metrics.jsonl").is_file():
        return None
    return last_quality(read_metrics(run_dir / "metrics.jsonl"), round_)


def model_card(
    cfg: RunConfig,
    unet: nn.Module,
    plan: ChannelPlan | None,
    *,
    onnx_bytes: bytes,
    round_: int | None,
    source: str,
    fp16: bool,
    opset: int,
    quality: dict[str, Any] | None,
    parity: Parity | None = None,
) -> dict[str, Any]:
    """The card that travels with a deployed model (and sits beside it as card.json).
    ``round_``: how many rounds trained the model (its last round, counted from 1)."""
    c, h, w = image_shape(cfg.model.preset)
    if is_oneshot(unet):
        nz = latent_dim(unet)
        io_entries: dict[str, Any] = {
            "kind": "oneshot",
            "latent_dim": nz,
            "inputs": {"z": f"float32 [batch, {nz}, 1, 1] ~ N(0, I)"},
            "outputs": {"image": "float32 [batch, C, H, W] in [-1, 1]"},
        }
    else:
        io_entries = {
            "kind": "unet",
            "inputs": {
                "sample": "float32 [batch, C, H, W]",
                "timestep": "int64 [batch]",
                **({"class_labels": "int64 [batch]"} if num_classes_of(unet) else {}),
            },
            "outputs": {"eps": "float32 [batch, C, H, W]"},
            "scheduler": scheduler_card(cfg.diffusion),
        }
    card: dict[str, Any] = {
        "name": f"{cfg.run.name}-{cfg.model.preset}-{plan_digest(plan)}",
        "preset": cfg.model.preset,
        "arch": plan_digest(plan),
        "pruned": plan is not None,
        "params": count_params(unet),
        "macs": count_macs(unet.eval(), torch.zeros(1, c, h, w)),
        "onnx_bytes": len(onnx_bytes),
        "dtype": "float16" if fp16 else "float32",
        "opset": opset,
        "image_shape": [c, h, w],
        "num_classes": num_classes_of(unet),
        **io_entries,
        "source": {"run": cfg.run.name, "round": round_, "path": source,
                   "config_digest": cfg.digest(), "algorithm": cfg.algorithm.name},
        "quality": quality,
        "exporter": f"estuary {__version__}, torch {torch.__version__}",
    }  # fmt: skip
    if parity is not None:
        card["parity"] = parity.to_dict()
    return card


def resolve_source(path: Path) -> Path:
    """A checkpoint file, or a run directory's latest checkpoint."""
    if path.is_dir():
        found = latest_checkpoint_path(path / "checkpoints") or latest_checkpoint_path(path)
        if found is None:
            raise ExportError(f"{path} holds no checkpoints (checkpoints/latest.json)")
        return found
    if not path.is_file():
        raise ExportError(f"{path} is neither a checkpoint file nor a run directory")
    return path


def export_generator(
    source: Path,
    out_dir: Path,
    *,
    fp16: bool = False,
    opset: int = MIN_OPSET,
    threshold: float | None = None,
    parity_steps: int = 20,
    signing_key: Any = None,
) -> ExportResult:
    """Export the model of ``source`` (checkpoint or run directory) into ``out_dir``:
    ``model.onnx``, ``card.json``, ``manifest.json`` and, with ``signing_key`` (an Ed25519
    private key), ``manifest.sig``. Refused (:class:`ExportError`) when parity fails."""
    start = time.perf_counter()
    ckpt_path = resolve_source(source)
    ckpt = load_checkpoint(ckpt_path)
    cfg = ckpt.config
    unet = model_from_state(cfg, ckpt.model, ckpt.plan)
    run_dir = ckpt_path.parent.parent if ckpt_path.parent.name == "checkpoints" else None
    threshold = threshold if threshold is not None else (5e-2 if fp16 else 1e-4)
    return export_module(
        cfg, unet, ckpt.plan, out_dir,
        round_=ckpt.round + 1, source=str(ckpt_path), fp16=fp16, opset=opset, threshold=threshold,
        parity_steps=parity_steps, signing_key=signing_key,
        quality=_quality_of(run_dir, ckpt.round + 1), start=start,
    )  # fmt: skip


def _write_shared(
    algorithm: Method, unet: nn.Module, out_dir: Path, card: dict[str, Any]
) -> dict[str, Any] | None:
    """FedDiffuse ULATDEC/UDEC: write the global model's federated tensors as
    :data:`SHARED_FILE` and say in ``card`` that devices holding their own local parts
    generate with those over their parts; the manifest entry of the file, or None (and no
    such file) when every device generates with the global model."""
    state = unet.state_dict()
    spec = algorithm.format.shared_spec(spec_of(state))
    if spec is None:
        (out_dir / SHARED_FILE).unlink(missing_ok=True)
        return None
    data = encode_tensors({k: state[k] for k in spec})
    atomic_write(out_dir / SHARED_FILE, data)
    card["personalized"] = {
        "shared": SHARED_FILE,
        "tensors": len(spec),
        "note": "a device that holds local parts generates with the global model's federated "
        "tensors over its own parts (exported on the device, same parity gate); this ONNX "
        "model has those parts at their initialization",
    }
    return {"file": SHARED_FILE, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def export_module(
    cfg: RunConfig,
    unet: nn.Module,
    plan: ChannelPlan | None,
    out_dir: Path,
    *,
    round_: int | None,
    source: str,
    fp16: bool = False,
    opset: int = MIN_OPSET,
    threshold: float = 1e-4,
    parity_steps: int = 20,
    signing_key: Any = None,
    quality: dict[str, Any] | None = None,
    start: float | None = None,
    algorithm: Method | None = None,
) -> ExportResult:
    """:func:`export_generator` for a module in hand (the cloud after training, which
    passes its ``algorithm``; else the one ``cfg`` names). ``round_``: the model's last
    round, counted from 1 (None: not from a run).

    The manifest's version is a new serial of ``cfg.run.name``
    (:func:`~shared.deploy.signing.new_version`), above the serial of the manifest already in
    ``out_dir``: the cloud exports into its run directory, so a cloud resumed from its
    checkpoints numbers its next deployment after the last one it made."""
    start = time.perf_counter() if start is None else start
    if not (threshold >= 0 and math.isfinite(threshold)):
        raise ExportError(f"parity threshold must be a finite number >= 0, got {threshold}")
    unet = unet.eval()
    onnx_bytes = to_onnx(unet, opset=opset, fp16=fp16)
    card = model_card(
        cfg, unet, plan, onnx_bytes=onnx_bytes, round_=round_, source=source, fp16=fp16,
        opset=opset, quality=quality,
    )  # fmt: skip
    parity = check_parity(
        unet, onnx_bytes, card, cfg.diffusion, threshold=threshold, steps=parity_steps,
        seed=cfg.run.seed,
    )  # fmt: skip
    if not parity.passed:
        raise ExportError(
            f"export refused: ONNX Runtime differs from torch by {parity.random_max_abs:.3g} "
            f"(random inputs) and {parity.trajectory_max_abs:.3g} ({parity_steps}-step DDIM "
            f"trajectory), above the threshold {threshold:g}"
        )
    card["parity"] = parity.to_dict()
    algorithm = algorithm or make_algorithm(cfg)
    view = algorithm.state_view
    entry = view.card_entry(unet) if view is not None else {}
    if entry:
        card[cfg.algorithm.name] = entry
    out_dir.mkdir(parents=True, exist_ok=True)
    shared = _write_shared(algorithm, unet, out_dir, card)
    model_path = out_dir / "model.onnx"
    atomic_write(model_path, onnx_bytes)
    atomic_write(out_dir / "card.json", (json.dumps(card, indent=2) + "\n").encode())
    previous = read_version(out_dir)  # read before anything of this export replaces it
    version = new_version(cfg.run.name, previous.serial if previous is not None else 0)
    manifest = make_manifest(
        hashlib.sha256(onnx_bytes).hexdigest(), len(onnx_bytes), card, shared=shared,
        version=version,
    )  # fmt: skip
    signed = signing_key is not None
    if signed:
        text, signature = sign_manifest(manifest, signing_key)
        manifest_path = write_signed(out_dir, text, signature, key_id(signing_key.public_key()))
    else:
        manifest_path = out_dir / "manifest.json"
        atomic_write(
            manifest_path, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
        )
        (out_dir / "manifest.sig").unlink(missing_ok=True)
    return ExportResult(
        out_dir, model_path, card, parity, manifest_path, signed, time.perf_counter() - start,
        extra={"version": version.to_dict()},
    )  # fmt: skip
