"""Alternating local-training rounds of two or more variants of one config, on one device:
the shared loop of the ``train_*`` benchmarks (precision, CUDA graph)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from shared.config import RunConfig
from shared.diffusion.schedule import make_train_scheduler
from shared.diffusion.training import train_local
from shared.models.presets import build_unet


def alternate_rounds(
    cfgs: dict[str, RunConfig],
    data: torch.Tensor,
    device: torch.device,
    *,
    steps: int,
    repeats: int,
    warmup_steps: int,
    label: str = "",
) -> dict[str, list[float]]:
    """Steps per second of ``repeats`` real local rounds (:func:`train_local`, ``steps``
    each) per variant, each variant training its own copy of its preset's seed-0 model.
    Variants alternate, in reverse order every other repeat, so drift in clocks or
    neighbours hits all of them; one ``warmup_steps`` round each first (CUDA context,
    cuDNN's choices, caches and captures)."""
    first = next(iter(cfgs.values()))
    sched = make_train_scheduler(first.diffusion)
    models = {m: build_unet(c.model.preset, seed=0) for m, c in cfgs.items()}
    gen = torch.Generator().manual_seed(1)

    def round_rate(m: str, n: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_local(models[m], data, cfgs[m].train, sched, gen, steps=n, device=device)
        return n / (time.perf_counter() - t0)  # train_local ends on the CPU: synced

    for m in cfgs:
        round_rate(m, warmup_steps)
    names = list(cfgs)
    rates: dict[str, list[float]] = {m: [] for m in names}
    for i in range(repeats):
        for m in names if i % 2 == 0 else names[::-1]:
            rates[m].append(round_rate(m, steps))
        said = ", ".join(f"{m} {rates[m][-1]:.2f} steps/s" for m in names)
        print(f"{label}round {i + 1}/{repeats}: {said}", flush=True)
    return rates


def summarize(rates: dict[str, list[float]], base: str, other: str) -> dict[str, Any]:
    """Each side's rates and median, and the median per-pair speedup of ``other`` over
    ``base``."""
    ratios = [o / b for b, o in zip(rates[base], rates[other], strict=True)]
    return {
        f"{base}_steps_per_s": rates[base],
        f"{other}_steps_per_s": rates[other],
        f"median_{base}_steps_per_s": statistics.median(rates[base]),
        f"median_{other}_steps_per_s": statistics.median(rates[other]),
        "median_speedup": statistics.median(ratios),
    }
