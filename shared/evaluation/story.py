"""What a run taught its generator: which classes its samples fall in, before and after.

The shipped classifier (:class:`~shared.evaluation.quality.FeatureNet`, ``fmnist-cnn-v1``,
the network FID uses) assigns every evaluation sample to one of the ten Fashion-MNIST
classes; :func:`class_shares` is the share of samples per class. A run that starts from a
generator pretrained on some classes only (its ``.json`` sidecar lists the
``held_out_classes``, e.g. ``shared/assets/fmnist_tiny_clothes.json``) while its devices hold
some of the others is judged by :func:`new_class_share`: the share of samples in the
classes the start never saw and the devices hold (:func:`new_classes`). The classifier also
calls a misshapen garment a bag, so :func:`class_shares` per class sits beside the sum.
The cloud scores the starting model before the first round
(:meth:`shared.evaluation.recorder.RunRecorder.evaluate_start`), so a run's first and last
figures (:func:`story_figures`) tell what the devices' data added.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.data.images import FASHION_MNIST_CLASSES
from shared.errors import DataError

if TYPE_CHECKING:
    from shared.config import RunConfig


def class_shares(probs: np.ndarray) -> list[float]:
    """The share of samples the classifier assigns to each class (argmax of ``probs``, an
    ``(N, C)`` array of class probabilities); the shares sum to 1."""
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] < 1 or p.shape[1] < 1:
        raise DataError(f"probs must be (N, C) with N, C >= 1, got shape {p.shape}")
    counts = np.bincount(p.argmax(axis=1), minlength=p.shape[1])
    return [float(c) / p.shape[0] for c in counts]


def new_class_share(shares: Sequence[float], classes: Sequence[int]) -> float:
    """The share of samples in ``classes`` (class ids into ``shares``)."""
    if any(not 0 <= c < len(shares) for c in classes):
        raise DataError(f"classes {list(classes)} out of range for {len(shares)} shares")
    return float(sum(shares[c] for c in set(classes)))


def start_recipe(cfg: RunConfig) -> dict[str, Any] | None:
    """The ``.json`` recipe beside the safetensors file ``model.init`` names (None for
    ``random``, ``pretrained`` or a file without one)."""
    init = cfg.model.init
    if init in ("random", "pretrained"):
        return None
    sidecar = Path(init).with_suffix(".json")
    try:
        recipe = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return None
    return recipe if isinstance(recipe, dict) else None


def device_classes(cfg: RunConfig) -> set[int] | None:
    """The classes the devices hold when the partition names them (``dominant_groups``
    with no uniform share: the union of the groups), else None (any class)."""
    d = cfg.data
    if d.partition == "dominant_groups" and d.dominant_uniform_fraction == 0.0:
        return {int(c) for g in d.dominant_groups for c in g}
    return None


def new_classes(cfg: RunConfig) -> list[int] | None:
    """The classes only the devices held: those the run's starting generator never saw (its
    recipe's ``held_out_classes``) that the devices hold (:func:`device_classes`); None when
    the start has no such recipe or no device holds any of them."""
    recipe = start_recipe(cfg)
    held_out = recipe.get("held_out_classes") if recipe else None
    if not isinstance(held_out, list) or not held_out:
        return None
    held = device_classes(cfg)
    classes = sorted(int(c) for c in held_out if held is None or int(c) in held)
    return classes or None


def class_names(classes: Sequence[int]) -> str:
    """``"Sandal, Sneaker, Bag, Ankle boot"`` for Fashion-MNIST class ids."""
    return ", ".join(FASHION_MNIST_CLASSES[c] for c in classes)


def evaluations(rows: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """A run's evaluations in order, as ``(round, quality)`` from its ``metrics.jsonl``
    rows: the start's (round 0), when the cloud scored it, then each evaluated round's."""
    evaluated = [(int(r["round"]), r["quality"]) for r in rows if r.get("quality")]
    start = next((r["start"] for r in rows if r.get("start")), None)
    if start and start.get("quality"):
        evaluated.insert(0, (0, start["quality"]))
    return evaluated


def story_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """First and last of a run's headline figures from its ``metrics.jsonl`` rows: training
    loss (first and last round), FID and the new-class share (the start's evaluation, when
    the cloud scored it, else the first evaluated round; and the last evaluated round), and
    the before/after sample grids (paths relative to the run directory). Keys are absent
    where the run has no such figure."""
    out: dict[str, Any] = {}
    losses = [r["train_loss"] for r in rows if r.get("train_loss") is not None]
    if losses:
        out["loss"] = (losses[0], losses[-1])
    evaluated = evaluations(rows)
    start = next((r["start"] for r in rows if r.get("start")), None)
    if evaluated:
        (r0, q0), (r1, q1) = evaluated[0], evaluated[-1]
        out["rounds"] = (r0, r1)
        out["fid"] = (q0["fid"], q1["fid"])
        if q0.get("new_class_share") is not None and q1.get("new_class_share") is not None:
            out["new_class_share"] = (q0["new_class_share"], q1["new_class_share"])
            out["new_classes"] = list(q1.get("new_classes", []))
    grids = [r["grid"] for r in rows if r.get("grid")]
    before = start.get("grid") if start else None
    if before and grids:
        out["grids"] = (before, grids[-1])
    return out


def story_text(figures: dict[str, Any]) -> list[str]:
    """The lines the demo prints about :func:`story_figures`."""
    lines = []
    if "loss" in figures:
        a, b = figures["loss"]
        lines.append(f"train loss: first round {a:.4f} -> last round {b:.4f}")
    if "fid" in figures:
        (r0, r1), (a, b) = figures["rounds"], figures["fid"]
        first = "the start" if r0 == 0 else f"round {r0}"
        lines.append(f"FID: {first} {a:.1f} -> round {r1} {b:.1f}")
    if "new_class_share" in figures:
        a, b = figures["new_class_share"]
        lines.append(
            f"samples drawn in the classes only the devices held "
            f"({class_names(figures['new_classes'])}): {a:.0%} -> {b:.0%}"
        )
    return lines
