"""FedAvg (McMahan et al., 2017) for DDPM training, the FEDDIFF "FULL" variant (seed 001,
Algorithm 3): every device trains the whole U-Net for E local epochs (or S steps) with the
DDPM loss and uploads it; edges and the cloud average weighted by sample counts.
FedAvg(E=1) is the config ``train.local_epochs = 1``.

For a classifier the same run gives two of pFedGPA's baselines (seed 004, Table 1): each
device measures the global model it received on its own test split (FedAvg) and the model
after its local round, its fine-tuning (FedAvg-FT).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from torch import nn

from shared.methods.base import (
    Algorithm,
    DeviceContext,
    Fold,
    LocalResult,
    MeanFold,
    TensorDict,
    Update,
    fold_all,
)
from shared.methods.baselines.config import FedAvgConfig
from shared.models.classifier import is_classifier
from shared.settings import AlgorithmConfig


class FedAvg(Algorithm):
    """Sample-weighted averaging at both tiers; plain DDPM loss on devices."""

    name = "fedavg"
    config_class: ClassVar[type[AlgorithmConfig]] = FedAvgConfig

    def device_round(
        self, ctx: DeviceContext, model: nn.Module, round_: int, *, upload: bool
    ) -> LocalResult:
        if is_classifier(model):  # FedAvg-FT: accuracy of the global model and after the FT
            return self.classify_round(ctx, model, upload=upload)
        result = self.train(ctx, model)
        tensors = {k: v.detach().clone() for k, v in model.state_dict().items()} if upload else None
        return LocalResult(tensors, result)

    def edge_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        return fold_all(self.edge_fold(current), updates)

    def cloud_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        return fold_all(self.cloud_fold(current), updates)

    aggregation_stateless = True

    def edge_fold(self, current: TensorDict) -> Fold:
        """The sample-weighted mean, folded as the updates arrive."""
        return MeanFold()

    def cloud_fold(self, current: TensorDict) -> Fold:
        """The sample-weighted mean of the edges' states, folded as they arrive."""
        return MeanFold()
