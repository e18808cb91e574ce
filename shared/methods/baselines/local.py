"""Local-only (pFedGPA's first baseline, seed 004 Table 1): every device trains its own
model, starting from the common initial one, and never uploads or receives another; the
edges and the cloud aggregate nothing.

A device keeps its model in its state (``local.model``) and loads it instead of the edge's
from its second round on. For a classifier it reports the accuracy of its own model on its
test split after each round (the figure the paper's Local-only row reports).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from torch import nn

from shared.methods.base import (
    Algorithm,
    DeviceContext,
    LocalResult,
    TensorDict,
    Update,
    model_state,
)
from shared.methods.baselines.config import LocalConfig
from shared.models.classifier import is_classifier
from shared.settings import AlgorithmConfig

#: ``DeviceContext.state`` key of the device's own model
OWN_MODEL = "local.model"


class Local(Algorithm):
    """No federation: each device trains alone; nothing travels up."""

    name = "local"
    config_class: ClassVar[type[AlgorithmConfig]] = LocalConfig

    def needs_download(self, ctx: DeviceContext) -> bool:
        return OWN_MODEL not in ctx.state

    def device_load(self, ctx: DeviceContext, model: nn.Module, state: TensorDict) -> None:
        own = ctx.state.get(OWN_MODEL)
        model.load_state_dict(own if own is not None else state)

    def device_round(
        self, ctx: DeviceContext, model: nn.Module, round_: int, *, upload: bool
    ) -> LocalResult:
        if is_classifier(model):
            result = self.classify_round(ctx, model, upload=False)
        else:
            result = LocalResult(None, self.train(ctx, model))
        ctx.state[OWN_MODEL] = model_state(model)  # replaced, never mutated (see the agent)
        return result

    def edge_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        return current

    def cloud_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        return current
