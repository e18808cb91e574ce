"""PRISM's settings (torch-free, read by every process)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from shared.settings import AlgorithmConfig

if TYPE_CHECKING:
    from shared.config import RunConfig


class PrismConfig(AlgorithmConfig):
    """PRISM (seed 002): stochastic binary masks over frozen random weights. Devices train
    one score per weight (theta = sigmoid(score)), upload one bit per weight, and the cloud
    averages the bits into probabilities, mixed with the previous ones by MADA.

    The frozen weights and the initial scores come from a secret key that is never part of
    the config (``ESTUARY_PRISM_KEY`` / ``ESTUARY_PRISM_KEY_FILE``, docs/algorithms.md)."""

    model_kinds = ("unet", "oneshot")

    estimator: Literal["scaled", "identity"] = Field(
        "scaled",
        description="gradient through the Bernoulli draw: scaled = theta times the mask's "
        "gradient (the authors' code), identity = plain straight-through",
    )
    init: Literal["key", "demo"] = Field(
        "key",
        description="the first probabilities: key = sigmoid of N(0, 1) scores drawn from the "
        "secret key; demo = the preset's shipped demo scores, trained under a public demo key "
        "that the run then uses (its frozen weights are public: demonstrations only)",
    )
    lr: float = Field(0.1, gt=0.0, le=10.0, description="Adam learning rate on scores")
    beta1: float = Field(0.5, ge=0.0, lt=1.0, description="Adam beta1 on scores")
    beta2: float = Field(0.999, ge=0.0, lt=1.0, description="Adam beta2 on scores")
    local_iters: int = Field(100, ge=1, le=1_000_000, description="local steps a round")
    mask_eps: float = Field(
        0.01, gt=0.0, lt=0.5, description="the cloud maps mean masks into [eps, 1 - eps]"
    )
    mada: bool = Field(True, description="MADA (eq. 2, Alg. 1); false = PRISM-dagger")
    mada_fixed_lambda: float = Field(
        0.0, ge=0.0, le=1.0,
        description="with mada: mix with this constant lambda instead of MADA's distance (a "
        "control that keeps the damping and drops the adaptivity); 0 = MADA's lambda",
    )  # fmt: skip
    mada_space: Literal["score", "prob"] = Field(
        "score", description="mix scores (Alg. 1, the authors' code) or probabilities (eq. 2)"
    )
    mada_distance: Literal["hamming", "cosine"] = Field(
        "hamming", description="lambda between two seeded Bernoulli samples (App. L: cosine)"
    )
    alpha: float = Field(
        0.0, ge=0.0, le=100.0,
        description="PRISM*: the last alpha % of the masked layers in depth order (output "
        "side) upload their probabilities as float32 instead of masks; 0 = PRISM",
    )  # fmt: skip
    weighting: Literal["masks", "samples"] = Field(
        "masks", description="average masks one per device (eq. 2) or by sample counts"
    )
    dp_noise: float = Field(
        0.0, ge=0.0, le=1e6,
        description="Gaussian noise multiplier z on theta (sigma = z x the L2 sensitivity); "
        "0 = no differential privacy",
    )  # fmt: skip
    dp_calibrate: bool = Field(
        False,
        description="differential privacy with the noise the accountant sets: the smallest "
        "noise multiplier whose run.rounds releases fit dp_epsilon (dp_noise is then not read)",
    )
    dp_epsilon: float = Field(
        10.0, gt=0.0, le=1e6, description="privacy budget: the run stops before exceeding it"
    )
    dp_delta: float = Field(1e-5, gt=0.0, lt=1.0, description="delta of (eps, delta)-DP")
    dp_clip: float = Field(
        0.1, ge=0.0, lt=0.5, description="c: theta is clipped to [c, 1 - c] around the noise"
    )

    def check_run(self, cfg: RunConfig) -> None:
        if cfg.model.preset.endswith("-cond"):
            raise ValueError(
                f"PRISM masks an unconditional generator: model.preset = {cfg.model.preset!r} "
                "is class-conditional; use its unconditional preset"
            )
        if cfg.model.init != "random":
            raise ValueError(
                "PRISM's weights are frozen random signs drawn from its secret key, so "
                f"model.init = {cfg.model.init!r} would be ignored; use 'random'"
            )
