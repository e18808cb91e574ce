"""FedPhD (seed 000, Algorithm 1; DESIGN section 4): homogeneity-aware hierarchical
aggregation, homogeneity-aware edge selection, sparse training and structured pruning.

The maths are pure functions over label counts:

* SH score (eqs. 18, 20): ``mu = 2 - ||q - q_u||_2`` with ``q`` the label distribution
  (counts / n) and ``q_u`` the target (uniform unless ``algorithm.target_distribution``).
* Edge weights on the cloud (eq. 22) and device weights on an edge (eq. 24):
  ``rho_i ∝ ReLU(n_i + a * mu_i + b)``. The cloud's ``n_e`` and ``q_e`` are the label counts
  the edge accumulated from the devices it served since the last cloud aggregation (eq. 19
  with count weighting), which the edge reports with its model.
* Edge selection (eq. 25): for each edge, ``mu_e`` and ``n_e`` *after tentatively adding*
  the device; ``P(e) ∝ ReLU(a * mu_e - n_e + b)``; the device **samples** its edge with its
  own seeded RNG and falls back to the most probable online edge when the drawn one is
  offline. Participants choose one after another in sorted order: each starts from the
  edges' counts as they stood when the round opened (``RoundStart.edge_counts``, Algorithm 1
  lines 4-6 before line 17) and adds the label counts of the earlier participants' choices
  (their ``DeviceJoin`` messages), so a round does not pile every device onto the edge that
  looked best at its start; a participant that waits longer than ``join_timeout_s`` for
  an earlier choice goes without it (the device agent implements this).

Rounds here are 0-based: devices add the group penalty (eqs. 16-17, :mod:`shared.pruning`)
in rounds ``r < R_s``, and the cloud prunes (L2 group norm, ``s_p`` = fraction of parameters
removed) at its first aggregation ending a round ``r`` with ``r + 1 >= R_s``: the paper's
prose ("after R_s sparse training rounds"). Its 1-based pseudocode adds the penalty in
rounds 1 .. R_s - 1 only, one round fewer. FedPhD-OS (``prune_at = "init"``) prunes the
initial model before round 0 (random or L2).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from shared.aggregation import weighted_average
from shared.algorithms.base import (
    Algorithm,
    DeviceContext,
    LocalResult,
    Plan,
    TensorDict,
    Update,
    model_state,
    register,
)
from shared.training import ExtraLoss

log = logging.getLogger(__name__)

#: the device's group penalty (a cache: rebuilt from the module when missing)
PENALTY_KEY = "fedphd.penalty"


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


def sh_weights(
    updates: Sequence[tuple[int, Sequence[int]]],
    a: float,
    b: float,
    target: Sequence[float] | None = None,
) -> list[float]:
    """Eqs. 22/24: normalized ``ReLU(n_i + a * mu_i + b)`` for (n_i, label counts) pairs.

    When every term is zero (possible only with a negative ``b``) the weights fall back to
    sample counts, so an aggregation never divides by zero."""
    raw = [max(0.0, n + a * sh_score(c, target) + b) for n, c in updates]
    total = sum(raw)
    if total <= 0:
        raw = [float(n) for n, _ in updates]
        total = sum(raw) or float(len(raw))
        if not any(raw):
            raw = [1.0] * len(raw)
    return [r / total for r in raw]


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
    return np.random.default_rng([seed, device_index, round_, 0x5E1EC7])


@register
class FedPhD(Algorithm):
    """SH-weighted aggregation at both tiers, sparse training, pruning on the cloud."""

    name = "fedphd"
    device_cache_keys = frozenset({PENALTY_KEY})

    def _target(self) -> list[float] | None:
        return list(self.cfg.algorithm.target_distribution) or None

    # -- device ------------------------------------------------------------------------
    def device_round(
        self, ctx: DeviceContext, model: nn.Module, round_: int, *, upload: bool
    ) -> LocalResult:
        algo = self.cfg.algorithm
        extra = None
        if round_ < algo.sparse_rounds and algo.lambda0 > 0:
            extra = self._penalty(ctx, model)
        result = self.train(ctx, model, extra_loss=extra)
        return LocalResult(model_state(model) if upload else None, result)

    def _penalty(self, ctx: DeviceContext, model: nn.Module) -> ExtraLoss:
        """The group penalty for this module's architecture, built once per device."""
        from shared.pruning import SparsityPenalty

        shapes = tuple((k, tuple(v.shape)) for k, v in model.state_dict().items())
        cached = ctx.state.get(PENALTY_KEY)
        if cached is None or cached[0] != shapes:
            cached = (shapes, SparsityPenalty.from_model(model, self.cfg.algorithm.lambda0))
            ctx.state[PENALTY_KEY] = cached
        return cached[1]

    # -- aggregation ---------------------------------------------------------------------
    def _aggregate(self, updates: Sequence[Update]) -> TensorDict:
        algo = self.cfg.algorithm
        weights = sh_weights(
            [(u.n_samples, u.label_counts) for u in updates], algo.a, algo.b, self._target()
        )
        return weighted_average([u.tensors for u in updates], weights)

    def edge_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        """Eqs. 23-24 over the devices that reported to this edge."""
        return self._aggregate(updates)

    def cloud_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        """Eqs. 21-22 over the edges, with their accumulated label counts."""
        return self._aggregate(updates)

    # -- pruning -------------------------------------------------------------------------
    def after_cloud_aggregate(
        self, round_: int, state: TensorDict, plan: Plan | None
    ) -> tuple[TensorDict, Plan | None]:
        algo = self.cfg.algorithm
        if algo.prune_ratio <= 0 or plan is not None:
            return state, plan
        due = round_ == -1 if algo.prune_at == "init" else round_ + 1 >= algo.sparse_rounds
        if not due or (algo.prune_at == "sparse" and round_ < 0):
            return state, plan
        return prune_state(self.cfg.model.preset, state, algo.prune_ratio,
                           method=algo.prune_method, seed=self.cfg.run.seed)  # fmt: skip


def prune_state(
    preset: str, state: TensorDict, sp: float, *, method: str, seed: int
) -> tuple[TensorDict, Plan]:
    """Prune a dense ``state`` of ``preset`` so ``sp`` of its parameters are removed;
    returns the pruned state and its channel plan."""
    from shared.models import build_unet
    from shared.pruning import channel_plan, prune_unet

    module = build_unet(preset, seed=seed)
    module.load_state_dict(state)
    before = sum(p.numel() for p in module.parameters())
    with torch.no_grad():
        pruned = prune_unet(module, sp, method=method, seed=seed)  # type: ignore[arg-type]
    after = sum(p.numel() for p in pruned.parameters())
    log.info(
        "pruned %s by %s: %.2f M -> %.2f M params (%.1f %% removed)",
        preset, method, before / 1e6, after / 1e6, 100 * (1 - after / before),
    )  # fmt: skip
    plan = channel_plan(pruned)
    return {k: v.detach().clone() for k, v in pruned.state_dict().items()}, plan
