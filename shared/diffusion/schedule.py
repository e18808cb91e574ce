"""DDPM training loss and DDIM sampling with diffusers' schedulers (DESIGN section 3).

T = 1000, linear betas 1e-4..0.02, epsilon prediction, MSE loss (FedPhD eq. 6); DDIM with
eta = 0 for sampling. Every random draw takes a ``torch.Generator`` the caller owns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shared.config import DiffusionSection
from shared.models.presets import module_device, num_classes_of

if TYPE_CHECKING:
    from diffusers import DDIMScheduler, DDPMScheduler


def make_train_scheduler(cfg: DiffusionSection) -> DDPMScheduler:
    """The forward-noising schedule used for training."""
    from diffusers import DDPMScheduler  # on first use: a role that trains nothing skips it

    return DDPMScheduler(
        num_train_timesteps=cfg.num_train_timesteps,
        beta_start=cfg.beta_start,
        beta_end=cfg.beta_end,
        beta_schedule="linear",
        prediction_type="epsilon",
    )


def make_sample_scheduler(cfg: DiffusionSection) -> DDIMScheduler:
    """The DDIM sampler matching :func:`make_train_scheduler`'s schedule."""
    from diffusers import DDIMScheduler

    return DDIMScheduler(
        num_train_timesteps=cfg.num_train_timesteps,
        beta_start=cfg.beta_start,
        beta_end=cfg.beta_end,
        beta_schedule="linear",
        prediction_type="epsilon",
        clip_sample=True,
        set_alpha_to_one=True,
    )


def ddpm_loss(
    model: nn.Module,
    x0: torch.Tensor,
    scheduler: DDPMScheduler,
    generator: torch.Generator,
    class_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """E_{t, eps} ||eps - eps_theta(sqrt(abar_t) x0 + sqrt(1 - abar_t) eps, t[, y])||^2."""
    t, noise = draw_noise(x0.shape, x0.dtype, scheduler, generator)
    return denoising_loss(model, x0, noise.to(x0.device), t.to(x0.device), scheduler, class_labels)


def denoising_loss(
    model: nn.Module,
    x0: torch.Tensor,
    noise: torch.Tensor,
    t: torch.Tensor,
    scheduler: DDPMScheduler,
    class_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`ddpm_loss` for drawn ``t`` and ``noise`` (on ``x0``'s device): no random draw
    and no host-device copy, so a CUDA graph can capture it."""
    noisy = scheduler.add_noise(x0, noise, t)
    cond = {} if class_labels is None else {"class_labels": class_labels}
    pred = model(noisy, t, **cond).sample
    return F.mse_loss(pred, noise)


def draw_noise(
    shape: torch.Size | tuple[int, ...],
    dtype: torch.dtype,
    scheduler: DDPMScheduler,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, eps) for a training batch of ``shape``: t ~ U{0..T-1}, then eps ~ N(0, I), from
    ``generator`` and where it lives (the CPU for the devices' seeded generators): a run
    draws the same numbers whether it trains on the CPU or on a GPU."""
    t = torch.randint(
        0, scheduler.config.num_train_timesteps, (shape[0],), generator=generator,
        device=generator.device,
    )  # fmt: skip
    noise = torch.randn(shape, generator=generator, device=generator.device, dtype=dtype)
    return t, noise


def noise_batch(
    x0: torch.Tensor, scheduler: DDPMScheduler, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_t, eps, t) for a training step, drawn by :func:`draw_noise` and moved to ``x0``'s
    device."""
    t, noise = draw_noise(x0.shape, x0.dtype, scheduler, generator)
    t, noise = t.to(x0.device), noise.to(x0.device)
    return scheduler.add_noise(x0, noise, t), noise, t


@torch.no_grad()
def ddim_sample(
    model: nn.Module,
    shape: tuple[int, ...],
    cfg: DiffusionSection,
    generator: torch.Generator,
    *,
    steps: int | None = None,
    batch_size: int = 256,
    noise: torch.Tensor | None = None,
    class_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw ``shape[0]`` images in [-1, 1] with DDIM (eta from ``cfg``), in batches.

    A class-conditional model samples ``class_labels`` (default: 0, 1, ..., 9, 0, 1, ...).
    The model runs where its parameters are; the noise (the start ``noise`` unless given,
    and eta's per-step noise) is drawn on ``generator``'s device and moved there, so a CPU
    generator gives the same draws on any device. The images are returned on the CPU.
    """
    scheduler = make_sample_scheduler(cfg)
    scheduler.set_timesteps(steps or cfg.sample_steps)
    device = module_device(model) or torch.device("cpu")
    was_training = model.training
    model.eval()
    if noise is None:
        noise = torch.randn(shape, generator=generator, device=generator.device)
    noise = noise.to(device)
    classes = num_classes_of(model)
    if classes and class_labels is None:
        class_labels = torch.arange(shape[0]) % classes
    if class_labels is not None:
        class_labels = class_labels.to(device)
    out = []
    try:
        for start in range(0, shape[0], batch_size):
            x = noise[start : start + batch_size].clone()
            labels = None if class_labels is None else class_labels[start : start + batch_size]
            for t in scheduler.timesteps:
                eps = (model(x, t) if labels is None else model(x, t, class_labels=labels)).sample
                x = scheduler.step(eps, t, x, eta=cfg.eta, generator=generator).prev_sample
            out.append(x.clamp(-1, 1))
    finally:
        model.train(was_training)
    return torch.cat(out).cpu()
