"""The architecture a role trains: a dense preset, or a preset pruned by a channel plan.

Every role rebuilds the same module from the preset name plus the JSON plan that travels in
``RoundStart.arch`` / ``EdgeRound.arch`` (DESIGN section 4: no pickled modules). Plans come
off the network, so :func:`check_plan` validates one before anything is built from it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from torch import nn

from shared.codec import TensorSpec
from shared.errors import EstuaryError
from shared.models import build_unet, state_spec

Plan = dict[str, Any]


def plan_digest(plan: Plan | None) -> str:
    """Short stable id of a plan ("dense" for None)."""
    if plan is None:
        return "dense"
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]


def model_spec(preset: str, plan: Plan | None) -> dict[str, TensorSpec]:
    """Tensor names, shapes and dtypes of ``preset`` under ``plan`` (no weights built)."""
    if plan is None:
        return state_spec(preset)
    from shared.pruning import plan_spec

    return plan_spec(preset, plan)


def build_model(preset: str, plan: Plan | None, *, seed: int = 0) -> nn.Module:
    """A module of ``preset`` under ``plan``, initialized from ``seed``."""
    if plan is None:
        return build_unet(preset, seed=seed)
    from shared.pruning import build_from_plan

    return build_from_plan(preset, plan, seed=seed)


def check_plan(preset: str, plan: Plan | None) -> str:
    """Why ``plan`` cannot be used for ``preset`` ("" when it can)."""
    if plan is None:
        return ""
    from shared.pruning import validate_plan

    try:
        validate_plan(preset, plan)
    except (EstuaryError, ValueError, TypeError, KeyError) as err:
        return f"bad architecture plan: {err}"
    return ""
