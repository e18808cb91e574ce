"""Image domains (feature skew) and the public share of a training set.

FedDEO's setting (seed 003) is feature skew: every device holds the same classes seen in a
different *domain*. On Fashion-MNIST a domain is a fixed transform of the 8-bit images,
applied on every path that gives a device its data (the seeded split in simulate and compare,
a device agent's share, a device's own image folder) and to the test split a device or the
cloud measures accuracy on:

``identity``, ``rot90`` (a quarter turn counter-clockwise), ``invert`` (255 - x),
``lowcontrast`` (x * 0.35 + 80), ``noise`` (Gaussian, sigma 40 of 255, seeded per device),
``edges`` (Sobel gradient magnitude, scaled so each image's strongest edge is 255).

Device ``i`` gets ``data.domains[i % len(data.domains)]``; an empty list is no transform.

The *public share* (``data.public_size``) is a seeded part of the training split that no
device ever holds: the conditional generator FedDEO starts from is pretrained on it
(``scripts/pretrain_generator.py --source public``). Its indices come from a fixed seed
(:data:`PUBLIC_SEED`), not the run's, so the share a shipped generator saw is the share every
run leaves out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

import numpy as np

from shared import seeds
from shared.config import DomainName
from shared.errors import ConfigError, did_you_mean

#: every domain, in the order the default feature-skew setup assigns them to devices (the
#: names a config accepts: ``shared.config.DomainName``)
DOMAINS: tuple[str, ...] = get_args(DomainName)
#: seed of the public share's draw (fixed: the shipped generator's share is every run's)
PUBLIC_SEED = 20_240_719
#: the noise domain's standard deviation, in 8-bit levels
NOISE_SIGMA = 40.0
#: the low-contrast domain: x * scale + offset
LOW_CONTRAST = (0.35, 80.0)


def check_domains(names: Sequence[str]) -> None:
    """Raise ConfigError naming the first unknown domain of ``names``."""
    for name in names:
        if name not in DOMAINS:
            raise ConfigError(f"unknown domain {name!r}{did_you_mean(name, DOMAINS)}; "
                              f"choose among {list(DOMAINS)}")  # fmt: skip


def domain_of(domains: Sequence[str], index: int) -> str:
    """Device ``index``'s domain under ``domains`` (``identity`` for an empty list)."""
    return domains[index % len(domains)] if domains else "identity"


def domain_seed(seed: int, index: int, *, test: bool = False) -> np.random.Generator:
    """The generator of device ``index``'s random domain (noise) in a run of ``seed``;
    ``test``: the stream of its test split, independent of its training images' stream."""
    return np.random.default_rng(
        seeds.sequence("data.domain.test" if test else "data.domain.device", seed, device=index)
    )


def _sobel(x: np.ndarray) -> np.ndarray:
    """Sobel gradient magnitude of float images (N, H, W), edges replicated."""
    p = np.pad(x, ((0, 0), (1, 1), (1, 1)), mode="edge")
    gx = (p[:, :-2, 2:] + 2 * p[:, 1:-1, 2:] + p[:, 2:, 2:]
          - p[:, :-2, :-2] - 2 * p[:, 1:-1, :-2] - p[:, 2:, :-2])  # fmt: skip
    gy = (p[:, 2:, :-2] + 2 * p[:, 2:, 1:-1] + p[:, 2:, 2:]
          - p[:, :-2, :-2] - 2 * p[:, :-2, 1:-1] - p[:, :-2, 2:])  # fmt: skip
    return np.hypot(gx, gy)


def apply_domain(
    images: np.ndarray, name: str, rng: np.random.Generator | None = None
) -> np.ndarray:
    """``images`` (uint8, (N, H, W) grayscale or (N, H, W, 3)) seen in domain ``name``: a
    new uint8 array of the same shape (``identity`` returns ``images`` itself). ``noise``
    draws from ``rng`` (required for it)."""
    check_domains([name])
    if images.dtype != np.uint8 or images.ndim not in (3, 4):
        raise ValueError(f"domains transform uint8 (N, H, W[, C]) images, got "
                         f"{images.dtype} {images.shape}")  # fmt: skip
    if name == "identity":
        return images
    if name == "rot90":
        return np.ascontiguousarray(np.rot90(images, 1, axes=(1, 2)))
    if name == "invert":
        return 255 - images
    x = images.astype(np.float32)
    if name == "lowcontrast":
        scale, offset = LOW_CONTRAST
        y = x * scale + offset
    elif name == "noise":
        if rng is None:
            raise ValueError("the noise domain needs a seeded generator")
        y = x + rng.normal(0.0, NOISE_SIGMA, size=x.shape).astype(np.float32)
    else:  # edges
        gray = x if x.ndim == 3 else x.mean(-1)
        mag = _sobel(gray)
        peak = mag.reshape(len(mag), -1).max(1).reshape(-1, 1, 1)
        y = mag * (255.0 / np.maximum(peak, 1e-6))
        if x.ndim == 4:
            y = np.repeat(y[..., None], x.shape[-1], axis=-1)
    return np.clip(np.rint(y), 0, 255).astype(np.uint8)


def device_domain_images(
    images: np.ndarray, domains: Sequence[str], index: int, seed: int, *, test: bool = False
) -> np.ndarray:
    """Device ``index``'s images in its domain (:func:`domain_of`), the noise seeded by
    (``seed``, ``index``; ``test``: the test split's stream, :func:`domain_seed`)."""
    return apply_domain(images, domain_of(domains, index), domain_seed(seed, index, test=test))


def public_split(n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the public share (``size`` of ``n``, drawn with :data:`PUBLIC_SEED`) and of
    the rest, both sorted."""
    if not 0 <= size < n:
        raise ConfigError(f"data.public_size = {size} must be at least 0 and below the "
                          f"training split's {n} images")  # fmt: skip
    order = np.random.default_rng(PUBLIC_SEED).permutation(n)
    return np.sort(order[:size]), np.sort(order[size:])


def mixture_domains(n: int, weights: dict[str, float], rng: np.random.Generator) -> np.ndarray:
    """``n`` domain indices (into :data:`DOMAINS`) drawn from the mixture ``weights``
    (domain -> weight, normalized here)."""
    check_domains(list(weights))
    p = np.array([weights.get(d, 0.0) for d in DOMAINS], dtype=np.float64)
    if (p < 0).any() or p.sum() <= 0:
        raise ConfigError(f"domain mixture weights must be >= 0 with a positive sum: {weights}")
    return rng.choice(len(DOMAINS), size=n, p=p / p.sum())


def apply_mixture(images: np.ndarray, which: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``images`` with image ``j`` seen in domain ``DOMAINS[which[j]]`` (a new array)."""
    out = images.copy()
    for k, name in enumerate(DOMAINS):
        sel = np.flatnonzero(which == k)
        if len(sel) and name != "identity":
            out[sel] = apply_domain(images[sel], name, rng)
    return out
