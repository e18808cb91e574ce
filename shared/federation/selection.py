"""Edge selection (FedPhD eq. 25): a federation feature every method may use
(``federation.assignment = "select"``), not one method's.

Statistical homogeneity (eqs. 18, 20): ``mu = 2 - ||q - q_u||_2`` with ``q`` the label
distribution (counts / n) and ``q_u`` the target (uniform unless configured). A device picks
its edge for a round by eq. 25: for each edge, ``mu_e`` and ``n_e`` *after tentatively adding*
the device; ``P(e) ∝ ReLU(a * mu_e - n_e + b)``; the device **samples** its edge with its own
seeded RNG and falls back to the most probable online edge when the drawn one is offline.
``a``, ``b`` and ``q_u`` are the federation's ``sh_a``, ``sh_b`` and ``sh_target`` (FedPhD
weighs its aggregations with the same ones). Numpy only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from shared import seeds

if TYPE_CHECKING:
    from shared.config import RunConfig


def distribution(counts: Sequence[float] | np.ndarray) -> np.ndarray:
    """Label counts as a distribution (all zeros stay zeros)."""
    c = np.asarray(counts, dtype=np.float64)
    total = c.sum()
    return c / total if total > 0 else c


def target_of(target: Sequence[float] | None, classes: int) -> np.ndarray:
    """``q_u``: the configured target, or uniform over ``classes``."""
    if target:
        return np.asarray(target, dtype=np.float64)
    return np.full(classes, 1.0 / classes)


def sh_score(counts: Sequence[float] | np.ndarray, target: Sequence[float] | None = None) -> float:
    """Statistical homogeneity, eqs. 18/20: ``2 - ||q - q_u||_2``."""
    q = distribution(counts)
    return float(2.0 - np.linalg.norm(q - target_of(target, len(q))))


def selection_probs(
    edge_counts: Mapping[str, Sequence[int] | np.ndarray],
    device_counts: Sequence[int] | np.ndarray,
    a: float,
    b: float,
    target: Sequence[float] | None = None,
) -> dict[str, float]:
    """Eq. 25: ``P(e) ∝ ReLU(a * mu_e' - n_e' + b)`` with the device tentatively added.

    All-zero numerators give a uniform distribution (documented fallback)."""
    dev = np.asarray(device_counts, dtype=np.float64)
    raw: dict[str, float] = {}
    for edge in sorted(edge_counts):
        after = np.asarray(edge_counts[edge], dtype=np.float64) + dev
        raw[edge] = max(0.0, a * sh_score(after, target) - float(after.sum()) + b)
    total = sum(raw.values())
    if total <= 0:
        return {e: 1.0 / len(raw) for e in raw}
    return {e: v / total for e, v in raw.items()}


def choose_edge(
    probs: Mapping[str, float], online: set[str] | None, rng: np.random.Generator
) -> str:
    """Sample an edge from ``probs``; if it is offline take the most probable online one
    (ties by name). Raises ValueError when no edge is online."""
    names = sorted(probs)
    p = np.asarray([probs[e] for e in names], dtype=np.float64)
    pick = names[int(rng.choice(len(names), p=p / p.sum()))]
    if online is None or pick in online:
        return pick
    alive = [e for e in names if e in online]
    if not alive:
        raise ValueError("no edge is online")
    return min(alive, key=lambda e: (-probs[e], e))  # most probable, then first by name


def selection_rng(seed: int, device_index: int, round_: int) -> np.random.Generator:
    """The device's own RNG for its edge choice in ``round_``."""
    return seeds.rng("edge.select", seed, device=device_index, round=round_)


def selection_settings(cfg: RunConfig) -> tuple[float, float, list[float] | None]:
    """Eq. 25's ``a``, ``b`` and target ``q_u`` (None: uniform) as ``cfg`` holds them."""
    fed = cfg.federation
    return fed.sh_a, fed.sh_b, list(fed.sh_target) or None
