"""The device's local training loop: one screen, obvious order (nanoGPT-style)."""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shared.config import TrainSection
from shared.diffusion.cuda_graph import (
    WARMUP_STEPS,
    batch_indices,
    finish_step,
    train_graphed,
    train_resident,
)
from shared.diffusion.hooks import ExtraLoss, GradHook, LossFn
from shared.diffusion.schedule import ddpm_loss, denoising_loss, draw_noise
from shared.errors import ConfigError
from shared.models.presets import module_device

if TYPE_CHECKING:
    from diffusers import DDPMScheduler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    """What one local training phase did."""

    mean_loss: float
    steps: int
    seconds: float


def set_activation_checkpointing(model: nn.Module, on: bool) -> None:
    """``train.activation_checkpointing``: turn diffusers' gradient checkpointing on or off
    for a model that has it (a U-Net); other models train as they are."""
    if getattr(model, "_supports_gradient_checkpointing", False):
        if on and not getattr(model, "is_gradient_checkpointing", False):
            model.enable_gradient_checkpointing()  # type: ignore[operator]
        elif not on and getattr(model, "is_gradient_checkpointing", False):
            model.disable_gradient_checkpointing()  # type: ignore[operator]


def num_local_steps(n_samples: int, cfg: TrainSection) -> int:
    """``local_steps`` when set, else ``local_epochs`` passes over the data.

    A pass is ``ceil(n / B)`` steps, each of exactly ``B`` images (all ``n`` when ``n < B``):
    :func:`train_local` draws batches from a shuffled order and reshuffles when fewer than
    ``B`` images are left in it, so the ``n mod B`` images left over in one order are not
    seen in it (every image is seen equally often in expectation; fixed batch shapes)."""
    if cfg.local_steps:
        return cfg.local_steps
    return cfg.local_epochs * max(1, math.ceil(n_samples / cfg.batch_size))


def make_optimizer(params: list[nn.Parameter], cfg: TrainSection) -> torch.optim.Optimizer:
    """A fresh optimizer of the configured type (never shared between devices)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    betas = cfg.adam_betas
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay)


def train_classifier(
    model: nn.Module,
    data: torch.Tensor,
    labels: torch.Tensor,
    cfg: TrainSection,
    generator: torch.Generator,
    *,
    device: torch.device | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> tuple[float, int, float]:
    """Cross-entropy minibatch training (the paper's LocalUpdate) of ``model`` on ``data``
    for ``local_epochs`` shuffled passes (or ``local_steps`` batches), batches drawn with
    ``generator`` only. Returns (mean loss, steps, seconds); the model ends on the CPU."""
    device = device or torch.device("cpu")
    model.to(device).train()
    opt = optimizer or make_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
    steps = num_local_steps(len(data), cfg)
    batch = min(cfg.batch_size, len(data))
    total, done, order, at = 0.0, 0, torch.randperm(len(data), generator=generator), 0
    start = time.perf_counter()
    while done < steps:
        if at + batch > len(order):  # reshuffle: fixed batch shapes, every image equally often
            order, at = torch.randperm(len(data), generator=generator), 0
        idx = order[at : at + batch]
        at += batch
        x, y = data[idx].to(device), labels[idx].to(device)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        total += float(loss.detach())
        done += 1
    model.to("cpu")
    return total / max(1, done), done, time.perf_counter() - start


class WeightAverage:
    """An exponential moving average of a model's weights (the "EMA" of Ho et al.'s DDPM),
    with a short warm-up: after step ``t`` (from 0) the decay is ``min(decay, (1 + t) /
    (10 + t))``, so early averages are not dominated by the initialization.

    It lives on the device of the model it follows (moved there on the first update after a
    change); :meth:`averaged` gives it on the CPU, in eval mode, for sampling and saving.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ConfigError(f"a weight average's decay must be in [0, 1), got {decay!r}")
        self.decay = decay
        self.steps = 0
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold ``model``'s current weights in (buffers are copied as they are); one
        multi-tensor ``lerp_`` over all parameters (per tensor on the CPU: the same numbers
        as a loop of ``lerp_``)."""
        decay = min(self.decay, (1 + self.steps) / (10 + self.steps))
        params: list[torch.Tensor] = list(model.parameters())
        if params and next(self.model.parameters()).device != params[0].device:
            self.model.to(params[0].device)
        averages: list[torch.Tensor] = list(self.model.parameters())
        if len(averages) != len(params):
            raise ValueError(f"average of {len(averages)} parameters, model of {len(params)}")
        if params:
            torch._foreach_lerp_(averages, params, 1 - decay)
        for buf, src in zip(self.model.buffers(), model.buffers(), strict=True):
            buf.copy_(src)
        self.steps += 1

    def averaged(self) -> nn.Module:
        """The average (on the CPU, eval mode): the module itself, not a copy."""
        return self.model.to("cpu").eval()


def resolve_device(name: str) -> torch.device:
    """The torch device for ``compute.device``: "auto" is CUDA when torch sees a GPU."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            "compute.device = 'cuda', but torch sees no CUDA device (a CPU build of torch, no "
            "GPU passed into the container, or no driver); use 'auto' to fall back to the CPU"
        )
    return torch.device("cuda")


#: cuBLAS's workspace setting that makes its matrix products repeat bit for bit (NVIDIA's
#: cuBLAS guide, "Results reproducibility"); torch's deterministic mode asks for it on CUDA
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def set_deterministic(enabled: bool) -> None:
    """``compute.deterministic``: when ``enabled``, this process runs deterministic kernels
    only, so a GPU run repeats bit for bit (a CPU run does already, at one thread count):
    cuDNN's deterministic convolutions without autotuning, cuBLAS's fixed workspace
    (``CUBLAS_WORKSPACE_CONFIG``, unless the environment set one; it must be set before the
    process's first cuBLAS call, hence at start-up) and torch's deterministic mode, strict:
    an operation without a deterministic kernel stops the run with torch's error naming it.
    Strict also because some kernels choose by it: the memory-efficient attention's
    backward on a GPU (what fp32 attention runs) takes its deterministic path only then,
    and merely warns under ``warn_only``. Process-wide and one-way: ``False`` leaves torch's
    settings as they are, so a caller that made them exact keeps them."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


def autocast_for(
    precision: str, device: torch.device, *, cache: bool = True
) -> AbstractContextManager[object]:
    """The context local training runs its forward passes (and loss) in: bf16 autocast for
    ``train.precision = "bf16"``, else nothing. Autocast leaves the weights, their gradients
    and the optimizer in fp32 and runs the losses (MSE, softmax) in fp32, so bf16 needs no
    loss scaling. A CUDA device without native bf16 (before Ampere) is refused: it would
    emulate it, slower than fp32. ``cache=False`` turns off autocast's cache of cast
    weights, which a CUDA graph capture must not use."""
    if precision == "fp32":
        return nullcontext()
    if precision != "bf16":
        raise ConfigError(f"unknown train.precision {precision!r}; choose 'fp32' or 'bf16'")
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ConfigError(
            f"train.precision = 'bf16', but {torch.cuda.get_device_name(device)} has no native "
            "bf16 (it needs compute capability 8.0, Ampere, or later); use 'fp32'"
        )
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache)


@contextmanager
def placed(model: nn.Module, device: torch.device | None) -> Iterator[nn.Module]:
    """``model`` moved to ``device`` for the ``with`` block and back to where its parameters
    were afterwards, also on an error (the same module, not a copy); None: left where it is."""
    home = module_device(model)
    if device is None or home is None or home == device:
        yield model
        return
    model.to(device)
    try:
        yield model
    finally:
        model.to(home)


def train_local(
    model: nn.Module,
    data: torch.Tensor,
    cfg: TrainSection,
    scheduler: DDPMScheduler,
    generator: torch.Generator,
    *,
    extra_loss: ExtraLoss | None = None,
    loss_fn: LossFn | None = None,
    grad_hook: GradHook | None = None,
    steps: int | None = None,
    labels: torch.Tensor | None = None,
    device: torch.device | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    after_step: Callable[[nn.Module], None] | None = None,
) -> TrainResult:
    """Minimize the DDPM loss (or ``loss_fn``), plus ``extra_loss``, on ``data`` for the
    configured steps; ``grad_hook`` may edit gradients before each optimizer step, and
    ``after_step`` sees the model after each one (a weight average, say). The mean loss
    reported is that of ``loss_fn`` (the DDPM loss by default) without ``extra_loss``: a
    regularizer (FedPhD's group penalty, FedProx's proximal term) is not a measure of fit.
    MOON's ``loss_fn`` includes its contrastive term (computed on the same forward pass).

    Each call makes a fresh optimizer (a device's restarts every round) unless one is given
    (built on ``model``'s trainable parameters, kept by a caller that trains in pieces:
    centralized training, or a device with ``train.optimizer_state = "keep"``).

    A class-conditional model (``num_class_embeds``) is trained with each image's label
    from ``labels``. With a ``device`` other than the CPU the model trains there (batches
    are moved step by step; ``data`` stays where it is) and is back on the CPU on return,
    so its state dict is ready to upload. ``train.precision = "bf16"`` runs the forward
    passes under bf16 autocast (:func:`autocast_for`); the mean loss is still fp32.
    ``train.cuda_graph`` on a CUDA device replays each step from a CUDA graph
    (:func:`~shared.diffusion.cuda_graph.train_graphed`): the same draws, steps and updates,
    one launch per step. With ``train.cuda_graph_reuse`` too, a round with a fresh optimizer and no
    local terms replays a capture kept across rounds instead
    (:func:`~shared.diffusion.cuda_graph.train_resident`): ``model`` stays on the CPU, its
    weights copied to the GPU and back.
    """
    start = time.perf_counter()
    n = data.shape[0]
    conditional = bool(getattr(getattr(model, "config", None), "num_class_embeds", None))
    if conditional and (labels is None or loss_fn is not None):
        raise ConfigError(
            "a class-conditional model needs the DDPM loss and the images' labels; this "
            "algorithm does not pass them (use fedavg, fedphd, fedprox or scaffold)"
        )
    steps = steps if steps is not None else num_local_steps(n, cfg)
    on = device if device is not None and device.type != "cpu" else None
    autocast = autocast_for(cfg.precision, on or torch.device("cpu"))
    set_activation_checkpointing(model, cfg.activation_checkpointing)
    graph_on = on if _graphable(cfg, on, loss_fn, steps) else None  # None: eager steps
    cond_labels = labels if conditional else None  # not None when conditional (checked above)
    per_call = (optimizer, extra_loss, grad_hook, after_step)  # what a reused capture lacks
    if graph_on is not None and cfg.cuda_graph_reuse and all(h is None for h in per_call):
        total = train_resident(
            model, data, cond_labels, batch_size=cfg.batch_size,
            grad_clip=cfg.grad_clip, steps=steps, scheduler=scheduler, generator=generator,
            device=graph_on, autocast=lambda: autocast_for(cfg.precision, graph_on, cache=False),
            make_opt=lambda ps: make_optimizer(ps, cfg), settings=resident_settings(cfg),
        )  # fmt: skip
        model.train()
        return TrainResult(float(total) / max(1, steps), steps, time.perf_counter() - start)
    with placed(model, on):
        params = [p for p in model.parameters() if p.requires_grad]
        opt = optimizer if optimizer is not None else make_optimizer(params, cfg)
        model.train()
        if graph_on is not None:
            total = train_graphed(
                model, opt, params, data, cond_labels,
                batch_size=cfg.batch_size, grad_clip=cfg.grad_clip, steps=steps,
                scheduler=scheduler, generator=generator, device=graph_on,
                autocast=lambda: autocast_for(cfg.precision, graph_on, cache=False),
                extra_loss=extra_loss, grad_hook=grad_hook, after_step=after_step,
            )  # fmt: skip
        else:
            total = torch.zeros((), dtype=torch.float64, device=on)
            micro = cfg.micro_batch if loss_fn is None else 0  # a custom loss: whole batches
            for idx in batch_indices(n, cfg.batch_size, steps, generator):
                opt.zero_grad(set_to_none=True)
                x = data[idx] if on is None else data[idx].to(on, non_blocking=True)
                y = None if cond_labels is None else cond_labels[idx]
                y = y if y is None or on is None else y.to(on, non_blocking=True)
                sliced = 0 < micro < len(idx)  # backward per slice, inside the call
                if sliced:
                    loss = micro_batch_backward(model, x, y, scheduler, generator, micro, autocast)
                else:
                    with autocast:  # forward and loss; the regularizer and backward in fp32
                        if y is not None:
                            loss = ddpm_loss(model, x, scheduler, generator, class_labels=y)
                        else:
                            loss = (loss_fn or ddpm_loss)(model, x, scheduler, generator)
                # summed where the loss lives (float64): no device sync per step
                finish_step(model, opt, params, loss, total, grad_clip=cfg.grad_clip,
                            extra_loss=extra_loss, grad_hook=grad_hook,
                            backward=not sliced)  # fmt: skip
                if after_step is not None:
                    after_step(model)
        opt.zero_grad(set_to_none=True)  # free gradient memory between rounds
    return TrainResult(float(total) / max(1, steps), steps, time.perf_counter() - start)


def micro_batch_backward(
    model: nn.Module,
    x: torch.Tensor,
    labels: torch.Tensor | None,
    scheduler: DDPMScheduler,
    generator: torch.Generator,
    micro: int,
    autocast: AbstractContextManager[object],
) -> torch.Tensor:
    """The DDPM loss of the batch ``x`` (its timesteps and noise drawn at once, as
    :func:`~shared.diffusion.schedule.ddpm_loss` draws them) with its gradient accumulated
    ``micro`` images at a time: each slice's mean loss weighted by its share of the batch,
    so the gradient is the whole batch's up to float rounding while only one slice's
    activations are held. Returns the batch's loss (detached)."""
    t, noise = draw_noise(x.shape, x.dtype, scheduler, generator)
    t, noise = t.to(x.device), noise.to(x.device)
    n = x.shape[0]
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    for at in range(0, n, micro):
        part = slice(at, min(at + micro, n))
        with autocast:
            y = None if labels is None else labels[part]
            mean = denoising_loss(model, x[part], noise[part], t[part], scheduler, y)
        share = mean.float() * ((part.stop - part.start) / n)
        share.backward()
        loss += share.detach()
    return loss


def resident_settings(cfg: TrainSection) -> str:
    """The training settings a resident capture
    (:func:`~shared.diffusion.cuda_graph.train_resident`) was made with: every one that shapes
    a step (the round's length does not)."""
    return cfg.model_dump_json(exclude={"local_steps", "local_epochs", "threads"})


def _graphable(
    cfg: TrainSection, on: torch.device | None, loss_fn: LossFn | None, steps: int
) -> bool:
    """Whether this call's steps replay from a CUDA graph (:mod:`shared.diffusion.cuda_graph`):
    ``train.cuda_graph`` on a CUDA device, the DDPM loss, and enough steps to pay for the
    capture. A configured graph that cannot be used is said once per reason, in the log."""
    if not cfg.cuda_graph or on is None or on.type != "cuda":
        return False
    if loss_fn is not None:
        key, why = "loss", "a custom loss (MOON) draws its own noise"
    elif steps < WARMUP_STEPS + 2:
        key, why = "steps", f"{steps} steps do not pay for the capture"
    else:
        return True
    if key not in _SAID:
        _SAID.add(key)
        log.info("train.cuda_graph: training eagerly (%s)", why)
    return False


#: reasons :func:`_graphable` has logged, each said once per process
_SAID: set[str] = set()
