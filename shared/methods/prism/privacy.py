"""PRISM's differential privacy: the Gaussian mechanism on a device's clipped probabilities
(:func:`privatize`, its L2 :func:`sensitivity`) and the privacy loss of its releases by
Opacus's RDP accountant at sampling rate 1 (:func:`dp_epsilon`; :func:`dp_rounds`, the most
releases a budget allows; :func:`dp_noise_for`, the least noise that lets ``releases`` fit a
budget). How a run uses them is in :mod:`shared.methods.prism.method`."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch

from shared.errors import ConfigError

#: the Renyi orders the accountant optimizes over (Opacus's defaults)
ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))


@functools.lru_cache(maxsize=256)
def dp_epsilon(noise: float, releases: int, delta: float) -> float:
    """epsilon of ``releases`` Gaussian mechanisms of noise multiplier ``noise`` at
    sampling rate 1, by Opacus's RDP accountant (0 for no release)."""
    if releases <= 0:
        return 0.0
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    rdp = compute_rdp(q=1.0, noise_multiplier=noise, steps=releases, orders=list(ORDERS))
    eps, _order = get_privacy_spent(orders=list(ORDERS), rdp=rdp, delta=delta)
    return float(eps)


def dp_rounds(noise: float, budget: float, delta: float, limit: int) -> int:
    """The most releases (at most ``limit``) whose epsilon stays within ``budget``."""
    lo, hi = 0, limit
    while lo < hi:  # epsilon grows with the releases
        mid = (lo + hi + 1) // 2
        if dp_epsilon(noise, mid, delta) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def dp_noise_for(budget: float, delta: float, releases: int) -> float:
    """The smallest noise multiplier (to 4 significant digits, rounded up) whose
    ``releases`` Gaussian mechanisms at sampling rate 1 spend at most ``budget``."""
    if releases <= 0:
        raise ConfigError("a privacy budget needs at least one release (run.rounds >= 1)")
    lo, hi = 1e-6, 1e6  # epsilon falls as the noise grows
    if dp_epsilon(hi, releases, delta) > budget:
        raise ConfigError(f"no noise multiplier up to {hi:g} keeps {releases} releases within "
                          f"epsilon = {budget:g} (delta = {delta:g})")  # fmt: skip
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        if dp_epsilon(mid, releases, delta) <= budget:
            hi = mid
        else:
            lo = mid
    digits = 3 - math.floor(math.log10(hi))
    z = math.ceil(hi * 10**digits) / 10**digits
    return z if dp_epsilon(z, releases, delta) <= budget else hi


def sensitivity(clip: float, weights: int) -> float:
    """L2 sensitivity of a probability vector of ``weights`` entries clipped to [c, 1 - c]."""
    return (1.0 - 2.0 * clip) * math.sqrt(weights)


def privatize(
    theta: Mapping[str, torch.Tensor], *, noise: float, clip: float, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Clip to [c, 1 - c], add ``N(0, (noise * Delta)^2)`` per weight, clip again."""
    sigma = noise * sensitivity(clip, sum(t.numel() for t in theta.values()))
    out = {}
    for name, t in theta.items():
        z = torch.randn(t.shape, generator=generator, dtype=torch.float32)
        out[name] = (t.clamp(clip, 1.0 - clip) + sigma * z).clamp(clip, 1.0 - clip)
    return out
