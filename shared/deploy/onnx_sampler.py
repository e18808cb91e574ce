"""On-device sampling without torch: ONNX Runtime for the noise predictor plus a numpy DDIM
loop (DESIGN section 5).

The DDIM loop reproduces ``diffusers.DDIMScheduler`` as :mod:`shared.diffusion.schedule` configures
it (linear betas, epsilon prediction, "leading" timestep spacing, ``set_alpha_to_one``,
predicted x0 clipped to [-1, 1], eta = 0), so the same noise gives the same images as
``shared.diffusion.schedule.ddim_sample`` up to float rounding (``tests/test_onnx_export.py``).

Only numpy and onnxruntime are imported here: a device that only generates images never
needs torch. Loading a deployment from disk (its manifest, signature and the device's own
model) is :mod:`device_agent.sampling`; the export's parity gate runs this same loop.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import EstuaryError
from shared.runtime.cpu import ort_threads

log = logging.getLogger(__name__)


#: eps_fn(x [B,C,H,W] float32, t [B] int64, labels [B] int64 or None) -> eps, like x
EpsFn = Callable[[np.ndarray, np.ndarray, np.ndarray | None], np.ndarray]


@dataclass(frozen=True)
class DdimSchedule:
    """The scheduler parameters a model card carries (``card["scheduler"]``)."""

    num_train_timesteps: int = 1000
    beta_start: float = 1e-4
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    prediction_type: str = "epsilon"
    clip_sample: bool = True
    clip_sample_range: float = 1.0
    set_alpha_to_one: bool = True
    steps_offset: int = 0
    timestep_spacing: str = "leading"

    @classmethod
    def from_card(cls, params: dict[str, Any]) -> DdimSchedule:
        """Build from a card's ``scheduler`` entry, refusing settings this loop lacks."""
        if not isinstance(params, dict):
            raise EstuaryError(f"card scheduler must be an object, got {type(params).__name__}")
        known = {k: params[k] for k in cls.__dataclass_fields__ if k in params}
        defaults = cls()
        for key, value in known.items():
            want = type(getattr(defaults, key))
            ok = (
                isinstance(value, (int, float)) and not isinstance(value, bool)
                if want is float
                else type(value) is want
            )
            if not ok:
                raise EstuaryError(
                    f"card scheduler {key}={value!r} must be of type {want.__name__}"
                )
        sched = cls(**known)
        if not 1 <= sched.num_train_timesteps <= 100_000:
            raise EstuaryError(
                f"card num_train_timesteps={sched.num_train_timesteps} must be in 1..100000"
            )
        if not (0 < sched.beta_start <= sched.beta_end < 1):
            raise EstuaryError(
                f"card betas must satisfy 0 < beta_start <= beta_end < 1, got "
                f"{sched.beta_start}, {sched.beta_end}"
            )
        if not 0 <= sched.steps_offset < sched.num_train_timesteps:
            raise EstuaryError(
                f"card steps_offset={sched.steps_offset} must be in "
                f"0..{sched.num_train_timesteps - 1}"
            )
        if not (math.isfinite(sched.clip_sample_range) and sched.clip_sample_range > 0):
            raise EstuaryError(f"card clip_sample_range={sched.clip_sample_range} must be > 0")
        if (sched.beta_schedule, sched.prediction_type, sched.timestep_spacing) != (
            "linear", "epsilon", "leading",
        ):  # fmt: skip
            raise EstuaryError(
                "the numpy DDIM sampler supports linear betas, epsilon prediction and leading "
                f"timestep spacing; the card asks for {sched}"
            )
        return sched

    def alphas_cumprod(self) -> np.ndarray:
        """abar_t for t = 0..T-1, computed as diffusers does (float32 betas)."""
        betas = np.linspace(
            self.beta_start, self.beta_end, self.num_train_timesteps, dtype=np.float32
        )
        return np.cumprod(1.0 - betas.astype(np.float64)).astype(np.float32)

    def step_ratio(self, steps: int) -> int:
        """Training timesteps per DDIM step; raises unless ``steps`` is in 1..T."""
        if not 1 <= steps <= self.num_train_timesteps:
            raise EstuaryError(f"steps must be in 1..{self.num_train_timesteps}, got {steps}")
        return self.num_train_timesteps // steps

    def timesteps(self, steps: int) -> np.ndarray:
        """The DDIM timesteps for ``steps`` sampling steps, high to low."""
        ratio = self.step_ratio(steps)
        ts = (np.arange(steps, dtype=np.int64) * ratio)[::-1] + self.steps_offset
        if ts[0] >= self.num_train_timesteps:
            raise EstuaryError(
                f"{steps} steps with steps_offset {self.steps_offset} reach timestep {ts[0]}, "
                f"past the schedule's {self.num_train_timesteps}; use fewer steps"
            )
        return ts


def ddim_sample(
    eps_fn: EpsFn,
    noise: np.ndarray,
    schedule: DdimSchedule,
    steps: int,
    labels: np.ndarray | None = None,
) -> np.ndarray:
    """Deterministic DDIM (eta = 0) from ``noise``; returns images in [-1, 1] (float32)."""
    ratio = schedule.step_ratio(steps)
    abar = schedule.alphas_cumprod()
    final = np.float32(1.0) if schedule.set_alpha_to_one else abar[0]
    x = np.ascontiguousarray(noise, dtype=np.float32)
    for t in schedule.timesteps(steps):
        t_batch = np.full((x.shape[0],), t, dtype=np.int64)
        eps = eps_fn(x, t_batch, labels).astype(np.float32, copy=False)
        a_t = abar[t]
        a_prev = abar[t - ratio] if t - ratio >= 0 else final
        x0 = (x - np.sqrt(1 - a_t) * eps) / np.sqrt(a_t)
        if schedule.clip_sample:
            x0 = np.clip(x0, -schedule.clip_sample_range, schedule.clip_sample_range)
        x = (np.sqrt(a_prev) * x0 + np.sqrt(1 - a_prev) * eps).astype(np.float32, copy=False)
    return np.clip(x, -1.0, 1.0)


NVIDIA_DEVICE_DIR = Path("/dev")  # where the NVIDIA driver's device nodes appear


def gpu_visible() -> bool:
    """Whether an NVIDIA GPU is visible to this process (its driver's device nodes exist).

    Inside a container this is true only when the runtime passed a GPU in (compose's GPU
    reservation, Kubernetes' ``nvidia.com/gpu``); ``$ESTUARY_ASSUME_GPU=1`` forces it.
    """
    if os.environ.get("ESTUARY_ASSUME_GPU") == "1":
        return True
    return (NVIDIA_DEVICE_DIR / "nvidiactl").exists() and any(
        NVIDIA_DEVICE_DIR.glob("nvidia[0-9]*")
    )


def _preload_cuda_libraries() -> None:
    """Load CUDA and cuDNN from the nvidia-* wheels that PyTorch brings, when the base image
    lacks them (onnxruntime >= 1.21); nothing happens where they are already loadable."""
    import onnxruntime as ort

    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return
    try:
        preload(msvc=False)
    except Exception as err:  # best effort: the session then reports what is missing
        log.debug("onnxruntime.preload_dlls: %s", err)


def default_providers() -> list[str]:
    """CUDA when this onnxruntime build has it and a GPU is visible, else CPU."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers() and gpu_visible():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def make_session(
    model: bytes | Path, *, provider: str = "auto", threads: int = 0
) -> Any:  # onnxruntime.InferenceSession
    """An ONNX Runtime session on ``provider`` ("auto", "cpu" or "cuda").

    "auto" uses CUDA where the build has it and a GPU is visible, and otherwise (or when the
    CUDA provider fails to load) the CPU; "cuda" fails unless the session really runs on CUDA.
    """
    import onnxruntime as ort

    if threads < 0:
        raise EstuaryError(f"threads must be >= 0 (0 = ONNX Runtime's default), got {threads}")
    if provider == "cpu":
        providers = ["CPUExecutionProvider"]
    elif provider == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise EstuaryError("provider 'cuda' asked for, but this onnxruntime has no CUDA EP")
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    else:
        providers = default_providers()
    if "CUDAExecutionProvider" in providers:
        _preload_cuda_libraries()
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if (n := ort_threads(threads)) > 0:  # 0: ONNX Runtime's default (no CPU limit below it)
        opts.intra_op_num_threads = n
    opts.log_severity_level = 3
    source = str(model) if isinstance(model, Path) else model
    try:
        session = ort.InferenceSession(source, sess_options=opts, providers=providers)
    except Exception as err:  # onnxruntime raises its own exception types
        raise EstuaryError(f"ONNX Runtime cannot load the model: {err}") from None
    if "CUDAExecutionProvider" in providers and (
        "CUDAExecutionProvider" not in session.get_providers()
    ):
        if provider == "cuda":
            raise EstuaryError(
                "provider 'cuda' asked for, but ONNX Runtime could not start its CUDA provider "
                "(no GPU visible, or CUDA/cuDNN libraries missing); set deploy.provider = "
                "'auto' to fall back to the CPU"
            )
        log.warning("ONNX Runtime's CUDA provider did not start; sampling on the CPU")
    return session


@dataclass
class SampleStats:
    """Timing of one sampling call."""

    n: int
    steps: int
    seconds: float
    batch_size: int

    @property
    def images_per_s(self) -> float:
        """Throughput of the whole call."""
        return self.n / self.seconds if self.seconds > 0 else float("inf")

    @property
    def latency_s(self) -> float:
        """Seconds per batch of ``batch_size`` images (time to first batch)."""
        batches = -(-self.n // self.batch_size)
        return self.seconds / max(1, batches)

    def to_dict(self) -> dict[str, float | int]:
        """JSON form."""
        return {
            "n": self.n,
            "steps": self.steps,
            "batch_size": self.batch_size,
            "seconds": round(self.seconds, 4),
            "images_per_s": round(self.images_per_s, 3),
            "latency_s": round(self.latency_s, 4),
        }


def _card_shape(card: dict[str, Any]) -> tuple[int, int, int]:
    """The card's ``image_shape`` [C, H, W], checked."""
    shape = card.get("image_shape")
    if not (
        isinstance(shape, list)
        and len(shape) == 3
        and all(type(s) is int and 0 < s <= 4096 for s in shape)
    ):
        raise EstuaryError(f"card image_shape must be [C, H, W] of ints, got {shape!r}")
    return (shape[0], shape[1], shape[2])


class OnnxGenerator:
    """A deployed generator: an ONNX noise predictor, its card, and the DDIM loop; or, for a
    card of ``kind = "oneshot"``, a map from latents ``z`` to images (one run per batch)."""

    def __init__(
        self,
        model: bytes | Path,
        card: dict[str, Any],
        *,
        provider: str = "auto",
        threads: int = 0,
        model_sha256: str | None = None,
    ) -> None:
        self.card = card
        #: sha256 of the ONNX bytes, as the caller verified them (None: not given)
        self.model_sha256 = model_sha256
        self.session = make_session(model, provider=provider, threads=threads)
        self.kind = card.get("kind", "unet")
        if self.kind not in ("unet", "oneshot"):
            raise EstuaryError(f"card kind must be 'unet' or 'oneshot', got {self.kind!r}")
        self.schedule = DdimSchedule.from_card(card.get("scheduler", {}))
        names = {i.name for i in self.session.get_inputs()}
        self.image_shape = _card_shape(card)
        self.latent_dim = 0
        self.num_classes = 0
        if self.kind == "oneshot":
            self._check_oneshot(card, names)
            return
        if not {"sample", "timestep"} <= names:
            raise EstuaryError(f"model inputs {sorted(names)} lack 'sample' and 'timestep'")
        classes = card.get("num_classes") or 0
        if type(classes) is not int or not 0 <= classes <= 100_000:
            raise EstuaryError(f"card num_classes must be an integer >= 0, got {classes!r}")
        self.num_classes = classes
        if ("class_labels" in names) != (self.num_classes > 0):
            raise EstuaryError("the model's class_labels input and the card's num_classes differ")
        shape = list(self.image_shape)
        sample = next(i for i in self.session.get_inputs() if i.name == "sample")
        fixed = [d if isinstance(d, int) else None for d in list(sample.shape)[1:]]
        if len(fixed) != 3 or any(
            d is not None and d != s for d, s in zip(fixed, shape, strict=True)
        ):
            raise EstuaryError(
                f"card image_shape {shape} does not match the model's sample input {sample.shape}"
            )

    def _check_oneshot(self, card: dict[str, Any], names: set[str]) -> None:
        """A one-shot model has one input ``z`` of the card's ``latent_dim`` and no classes."""
        if names != {"z"}:
            raise EstuaryError(f"a one-shot model takes one input 'z', not {sorted(names)}")
        nz = card.get("latent_dim")
        if type(nz) is not int or not 0 < nz <= 65_536:
            raise EstuaryError(f"card latent_dim must be an integer in 1..65536, got {nz!r}")
        if card.get("num_classes") not in (None, 0):
            raise EstuaryError("a one-shot card cannot have classes (num_classes must be 0)")
        z = self.session.get_inputs()[0]
        dims = [d if isinstance(d, int) else None for d in list(z.shape)[1:]]
        if not dims or (dims[0] is not None and dims[0] != nz):
            raise EstuaryError(f"card latent_dim {nz} does not match the model's z input {z.shape}")
        self.latent_dim = nz

    @property
    def providers(self) -> list[str]:
        """The execution providers the session runs on."""
        return list(self.session.get_providers())

    def eps(self, x: np.ndarray, t: np.ndarray, labels: np.ndarray | None) -> np.ndarray:
        """One noise prediction."""
        feed: dict[str, np.ndarray] = {"sample": x, "timestep": t}
        if self.num_classes:
            feed["class_labels"] = labels if labels is not None else np.zeros_like(t)
        try:
            out: np.ndarray = self.session.run(None, feed)[0]
        except Exception as err:  # onnxruntime's own error types
            raise EstuaryError(f"ONNX Runtime failed: {type(err).__name__}: {err}") from None
        return out

    def _images(self, z: np.ndarray) -> np.ndarray:
        """A one-shot generator's images of latents ``z``."""
        try:
            out: np.ndarray = self.session.run(None, {"z": z})[0]
        except Exception as err:  # onnxruntime's own error types
            raise EstuaryError(f"ONNX Runtime failed: {type(err).__name__}: {err}") from None
        return out

    def noise(self, n: int, seed: int) -> np.ndarray:
        """Start noise for ``n`` images from ``seed`` (numpy's PCG64): a U-Net's noise
        images, a one-shot generator's latents (n, latent_dim, 1, 1)."""
        rng = np.random.default_rng(seed)
        shape = (self.latent_dim, 1, 1) if self.kind == "oneshot" else self.image_shape
        return rng.standard_normal((n, *shape), dtype=np.float32)

    def balanced_labels(self, n: int) -> np.ndarray | None:
        """Class labels 0, 1, ..., 0, 1, ... for a conditional model (None otherwise)."""
        return np.arange(n, dtype=np.int64) % self.num_classes if self.num_classes else None

    def sample(
        self,
        n: int,
        *,
        steps: int,
        seed: int = 0,
        batch_size: int = 64,
        labels: np.ndarray | None = None,
        noise: np.ndarray | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> tuple[np.ndarray, SampleStats]:
        """``n`` images in [-1, 1] and the timing of the call (a one-shot generator maps
        its latents in one run per batch: ``steps`` and ``labels`` do not apply)."""
        if n < 1 or batch_size < 1:
            raise EstuaryError("n and batch_size must be positive")
        noise = self.noise(n, seed) if noise is None else noise
        labels = self.balanced_labels(n) if labels is None else labels
        if labels is not None and self.num_classes:
            if labels.shape != (n,) or labels.min() < 0 or labels.max() >= self.num_classes:
                raise EstuaryError(f"labels must be {n} ints in [0, {self.num_classes})")
        out = []
        start = time.perf_counter()
        for lo in range(0, n, batch_size):
            hi = min(n, lo + batch_size)
            lab = labels[lo:hi] if labels is not None else None
            if self.kind == "oneshot":
                out.append(self._images(noise[lo:hi]))
            else:
                out.append(ddim_sample(self.eps, noise[lo:hi], self.schedule, steps, lab))
            if progress is not None:
                progress(hi - lo)
        seconds = time.perf_counter() - start
        passes = 1 if self.kind == "oneshot" else steps
        return np.concatenate(out), SampleStats(n, passes, seconds, min(batch_size, n))
