"""The baselines' settings (FedAvg, FedProx, SCAFFOLD, MOON, Local-only): torch-free,
read by every process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from shared.settings import AlgorithmConfig, Traffic

if TYPE_CHECKING:
    from shared.config import RunConfig


class FedAvgConfig(AlgorithmConfig):
    """FedAvg has no settings of its own (FedAvg(E=1) is ``train.local_epochs = 1``)."""

    digest_defaults = True
    model_kinds = ("unet", "oneshot", "classifier")


class FedProxConfig(AlgorithmConfig):
    """FedProx: the proximal term's weight."""

    digest_defaults = True
    model_kinds = ("unet", "oneshot")

    mu: float = Field(1.0, ge=0.0, description="FedProx mu (mu/2 ||w - w_g||^2)")


class ScaffoldConfig(AlgorithmConfig):
    """SCAFFOLD has no settings of its own (its step size is ``train.lr``)."""

    digest_defaults = True
    model_kinds = ("unet", "oneshot")


class MoonConfig(AlgorithmConfig):
    """MOON: the model-contrastive loss's weight and temperature."""

    digest_defaults = True

    mu: float = Field(1.0, ge=0.0, description="MOON contrastive loss weight")
    tau: float = Field(0.5, gt=0.0, description="MOON temperature")


class LocalConfig(AlgorithmConfig):
    """Local-only (pFedGPA's baseline, seed 004 Table 1): every device trains its own model
    from the common initial one and nothing is aggregated or uploaded."""

    model_kinds = ("unet", "oneshot", "classifier")

    def traffic(self) -> Traffic:
        """Nothing travels up; each device's own model is the product."""
        return Traffic(uplink="none", product="device_models")


def check_classifier_rounds(name: str, cfg: RunConfig) -> None:
    """A per-device algorithm's rounds are single-tier: every round is a cloud round."""
    if cfg.federation.edge_every != 1 or cfg.federation.cloud_every != 1:
        raise ValueError(
            f"{name} personalizes every device at every cloud round: set "
            "federation.edge_every = 1 and federation.cloud_every = 1"
        )
