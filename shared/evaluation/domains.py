"""A classifier's accuracy on every image domain's test set (feature skew,
``data.domains``): the figure a one-shot method's summary reports, computed the same way
for any classifier (the FedAvg classifier, the centralized ceiling), so that comparisons
share one measure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from shared.config import RunConfig
from shared.data.datasets import to_model_input
from shared.data.partition import domain_test_sets
from shared.models.classifier import accuracy


def accuracy_by_domain(
    model: nn.Module, tests: Mapping[str, tuple[np.ndarray, np.ndarray]]
) -> dict[str, float]:
    """``model``'s top-1 accuracy on each domain's test set (uint8 images, labels), with
    their unweighted ``mean``."""
    out = {
        name: round(accuracy(model, to_model_input(images, 1), torch.from_numpy(labels)), 4)
        for name, (images, labels) in tests.items()
    }
    out["mean"] = round(sum(out.values()) / len(out), 4) if out else float("nan")
    return out


def score_by_domain(cfg: RunConfig, model: nn.Module) -> dict[str, Any] | None:
    """A classifier's final figures as a one-shot run's summary reports them, for any
    classifier (the FedAvg classifier, the Ceiling): ``preset``, ``accuracy`` (domain ->
    top-1 on the whole test split seen in that domain, ``identity`` alone without
    ``data.domains``; :func:`~shared.data.partition.domain_test_sets`) and ``mean_accuracy``
    (unweighted over the domains); None when the data have no test split."""
    tests = domain_test_sets(cfg)
    if not tests:
        return None
    scores = accuracy_by_domain(model.eval(), tests)
    mean = scores.pop("mean")
    return {"preset": cfg.model.preset, "accuracy": scores, "mean_accuracy": mean}
