"""FedDEO's description learning on a device (eq. 4): one description per class it holds,
started at the class's prompt in the frozen generator and trained with Adam on its images,
at a rate it chooses by the loss on a held-out share (:func:`train_descriptions`). How a
round uses them is in :mod:`shared.methods.feddeo.method`."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shared.data.datasets import NUM_CLASSES
from shared.diffusion.schedule import draw_noise
from shared.diffusion.training import TrainResult, placed
from shared.errors import ConfigError
from shared.methods.feddeo.config import FedDEOConfig
from shared.methods.feddeo.guidance import class_table, eps_with_embedding


def _fit(
    unet: nn.Module,
    x_all: torch.Tensor,
    y_all: torch.Tensor,
    init: torch.Tensor,
    lr: float,
    s: FedDEOConfig,
    scheduler: Any,
    generator: torch.Generator,
    device: torch.device,
) -> tuple[torch.Tensor, float, int]:
    """Adam at ``lr`` on eq. 4 from ``init`` (C, D) over ``x_all`` (every image conditioned
    on its class's row) for ``desc_epochs`` passes of ``desc_batch``; the
    model must be frozen and in eval mode. Returns (descriptions, mean loss, steps)."""
    batch = min(s.desc_batch, len(x_all))
    steps = max(1, math.ceil(s.desc_epochs * len(x_all) / batch))
    param = nn.Parameter(init.clone().to(device))
    opt = torch.optim.Adam([param], lr=lr)
    total = 0.0
    order, at = torch.randperm(len(x_all), generator=generator), 0
    for _ in range(steps):
        if at + batch > len(order):
            order, at = torch.randperm(len(x_all), generator=generator), 0
        idx = order[at : at + batch]
        at += batch
        x0, y = x_all[idx].to(device), y_all[idx].to(device)
        t, noise = draw_noise(x0.shape, x0.dtype, scheduler, generator)
        t, noise = t.to(device), noise.to(device)
        noisy = scheduler.add_noise(x0, noise, t)
        loss = F.mse_loss(eps_with_embedding(unet, noisy, t, param[y]), noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += float(loss.detach())
    return param.detach().cpu(), total / steps, steps


@torch.no_grad()
def heldout_loss(
    unet: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    desc: torch.Tensor,
    scheduler: Any,
    seed: int,
    device: torch.device,
    *,
    batch: int = 256,
) -> float:
    """Eq. 4's loss of descriptions ``desc`` (C, D) on images ``x`` of classes ``y``, with
    timesteps and noise drawn once from ``seed``: the same draws for every candidate."""
    gen = torch.Generator().manual_seed(seed)
    t, noise = draw_noise(x.shape, x.dtype, scheduler, gen)
    total = 0.0
    for lo in range(0, len(x), batch):
        x0, e = x[lo : lo + batch].to(device), noise[lo : lo + batch].to(device)
        tt = t[lo : lo + batch].to(device)
        eps = eps_with_embedding(unet, scheduler.add_noise(x0, e, tt), tt,
                                 desc.to(device)[y[lo : lo + batch].to(device)])  # fmt: skip
        total += float(F.mse_loss(eps, e, reduction="sum"))
    return total / x.numel()


def train_descriptions(
    unet: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    s: FedDEOConfig,
    scheduler: Any,
    generator: torch.Generator,
    *,
    device: torch.device | None = None,
    report: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, TrainResult]:
    """Eq. 4 on a device: one description per class it holds at least
    ``min_class_images`` of, started at the class's prompt in the frozen ``unet``
    (:func:`~shared.methods.feddeo.guidance.class_table`) and trained with Adam on ``images``
    (every image conditions on its class's description) for ``desc_epochs`` passes.

    With ``desc_lrs``, the device chooses the rate itself: it holds out a random
    ``desc_holdout`` of its images, trains the descriptions at each candidate rate on
    the rest (the same batches and noise for each), and keeps those with the lowest eq. 4
    loss on the held-out images (the same timesteps and noise for each). Otherwise it trains
    on all its images at ``desc_lr``. ``report`` (when given) receives the rate used
    and, when it chose, every candidate's held-out loss.

    Returns (descriptions (C, D), mask (C,), the training figures); rows of classes it does
    not describe stay the class prompts, with mask 0."""
    table = class_table(unet)
    counts = torch.bincount(labels.long(), minlength=NUM_CLASSES)[:NUM_CLASSES]
    mask = (counts >= s.min_class_images).float()
    desc = table[:NUM_CLASSES].clone().float()
    keep = mask[labels.long()] > 0
    x_all, y_all = images[keep], labels[keep].long()
    if not len(x_all):
        return desc, mask, TrainResult(0.0, 0, 0.0)
    device = device or torch.device("cpu")
    flags = [p.requires_grad for p in unet.parameters()]
    was_training = unet.training
    unet.requires_grad_(False)
    unet.eval()
    start = time.perf_counter()
    try:
        with placed(unet, device):
            if not s.desc_lrs:
                out, loss, steps = _fit(unet, x_all, y_all, desc, s.desc_lr, s,
                                        scheduler, generator, device)  # fmt: skip
                if report is not None:
                    report["lr"] = s.desc_lr
            else:
                perm = torch.randperm(len(x_all), generator=generator)
                n_hold = max(1, round(s.desc_holdout * len(x_all)))
                if n_hold >= len(x_all):
                    raise ConfigError(f"desc_holdout leaves no image to train on "
                                      f"({len(x_all)} images)")  # fmt: skip
                hold, fit = perm[:n_hold], perm[n_hold:]
                eval_seed = int(torch.randint(0, 2**62, (1,), generator=generator))
                state = generator.get_state()
                best: tuple[float, float, torch.Tensor, float, int] | None = None
                losses: dict[str, float] = {}
                for lr in s.desc_lrs:
                    gen = torch.Generator().set_state(state)  # same batches for each rate
                    cand, loss, steps = _fit(unet, x_all[fit], y_all[fit], desc, lr, s,
                                             scheduler, gen, device)  # fmt: skip
                    held = heldout_loss(unet, x_all[hold], y_all[hold], cand, scheduler,
                                        eval_seed, device)  # fmt: skip
                    losses[f"{lr:g}"] = round(held, 6)
                    if best is None or held < best[0]:
                        best = (held, lr, cand, loss, steps)
                if best is None:
                    raise ConfigError("desc_lrs is empty")
                _, lr, out, loss, steps = best
                generator.set_state(state)
                if report is not None:
                    report.update(lr=lr, heldout_loss=losses)
    finally:
        for p, flag in zip(unet.parameters(), flags, strict=True):
            p.requires_grad_(flag)
        unet.train(was_training)
    out[mask == 0] = desc[mask == 0]
    return out, mask, TrainResult(loss, steps, time.perf_counter() - start)
