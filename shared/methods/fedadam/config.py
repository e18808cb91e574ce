"""FedAdam's settings (torch-free, read by every process)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.settings import AlgorithmConfig


class FedAdamConfig(AlgorithmConfig):
    """FedAdam (Reddi et al. 2021, Algorithm 2): the server step size ``eta`` and Adam's
    ``beta1``, ``beta2`` and ``tau`` on the cloud; devices train as FedAvg's do.
    ``variant = "yogi"`` is FedYogi (the same algorithm with Yogi's second moment)."""

    model_kinds = ("unet", "oneshot", "classifier")

    eta: float = Field(1e-2, gt=0.0, le=10.0, description="server learning rate eta")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="first-moment decay (paper: 0.9)")
    beta2: float = Field(
        0.99, ge=0.0, le=1.0,
        description="second-moment decay (paper: 0.99); 1 keeps v at tau^2: the step is then "
        "eta / (2 tau) m, server momentum (with beta1 = 0 and eta = 2 tau: FedAvg)",
    )  # fmt: skip
    tau: float = Field(
        1e-3, gt=0.0, le=1.0, description="adaptivity: v starts at tau^2; step m / (sqrt(v) + tau)"
    )
    variant: Literal["adam", "yogi"] = Field("adam", description="second moment: Adam or Yogi")

    def describe(self) -> str:
        return f"eta={self.eta:g}" + (" yogi" if self.variant == "yogi" else "")
