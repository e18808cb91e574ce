"""Aggregation maths as pure functions over tensor dicts (no messaging, no state).

FedAvg (McMahan et al. 2017): theta = sum_k (n_k / sum n) theta_k. Weighted averages are
computed in float64 and cast back so the result does not depend on summation order beyond
float64 rounding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from shared.errors import EstuaryError

#: a model state (or any named tensors) as aggregation sees it
TensorDict = dict[str, torch.Tensor]


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights scaled to sum to one; all-zero or negative weights are an error."""
    if not weights:
        raise EstuaryError("cannot aggregate zero updates")
    if any(w < 0 for w in weights):
        raise EstuaryError(f"negative aggregation weight in {list(weights)}")
    total = float(sum(weights))
    if total <= 0:
        raise EstuaryError("aggregation weights sum to zero")
    return [float(w) / total for w in weights]


def weighted_average(
    states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
) -> TensorDict:
    """sum_k w_k * state_k / sum_k w_k, key by key; every state must have the same keys."""
    if len(states) != len(weights):
        raise EstuaryError(f"{len(states)} states but {len(weights)} weights")
    w = normalize(weights)
    keys = list(states[0])
    for s in states[1:]:
        if list(s) != keys and set(s) != set(keys):
            raise EstuaryError("states to average have different tensor names")
    out: TensorDict = {}
    for k in keys:
        ref = states[0][k]
        if not ref.is_floating_point():
            out[k] = ref.clone()  # integer buffers (e.g. counters) are not averaged
            continue
        acc = torch.zeros(ref.shape, dtype=torch.float64, device=ref.device)
        for wi, s in zip(w, states, strict=True):
            acc.add_(s[k].to(torch.float64), alpha=wi)
        out[k] = acc.to(ref.dtype)
    return out


def fedavg(states: Sequence[Mapping[str, torch.Tensor]], n_samples: Sequence[int]) -> TensorDict:
    """FedAvg: average weighted by local sample counts."""
    return weighted_average(states, [float(n) for n in n_samples])
