"""pFedGPA's settings (torch-free, read by every process)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from shared.methods.baselines.config import check_classifier_rounds
from shared.settings import AlgorithmConfig, Traffic

if TYPE_CHECKING:
    from shared.config import RunConfig


class PFedGPAConfig(AlgorithmConfig):
    """pFedGPA (seed 004): the cloud keeps the devices' uploaded classifiers of the last
    ``store_rounds`` rounds, trains a latent diffusion model over their (flattened)
    parameters and sends each device its own parameters, obtained by inverting what it
    uploaded (eqs. 11-16). Before the first diffusion round the devices train the global
    average (FedAvg-FT); the readings the lost appendix leaves open are settings here."""

    model_kinds = ("classifier",)

    store_rounds: int = Field(
        20, ge=1, le=1000, description="rounds of uploads the cloud keeps (the paper: 20)"
    )
    dm_every: int = Field(
        0, ge=0, le=100_000,
        description="train the diffusion model every this many rounds (and personalize "
        "after it); 0 = only before the final round (the paper generates in the final round)",
    )  # fmt: skip
    mode: Literal["inversion", "generation"] = Field(
        "inversion",
        description="inversion: each device's own upload inverted (eqs. 11-16); generation: "
        "direct sampling from noise (Table 2's 'w/o inversion' ablation)",
    )
    layers: list[str] = Field(
        default_factory=lambda: ["auto"],
        min_length=1,
        max_length=64,
        description="the model's layers (module names) whose parameters the diffusion model "
        "generates; the rest stays the device's own. ['*'] = the whole model (the paper's "
        "Fashion-MNIST setting); ['auto'] = the whole model where the cloud has a GPU "
        "(compute.device), the last layer (fc2) on a CPU",
    )
    ae_size: Literal["tiny", "small", "medium", "linear"] = Field(
        "small",
        description="the parameter autoencoder: p-diff's 1-D convolutional one (small: "
        "f=k=3; medium: f=k=5; tiny: small with its decoder halved), or linear: one linear "
        "map each way to a latent as large as small's, which (unlike convolutions shared "
        "along the flattened vector) can keep what tells one device's parameters from "
        "another's; the whole-model CPU setting uses it",
    )
    denoiser: Literal["conv", "mlp"] = Field(
        "conv",
        description="the latent denoiser: conv = p-diff's 1-D conv U-Net over the latent; "
        "mlp = a residual MLP over the flattened latent (for the linear autoencoder, whose "
        "latent positions are not neighbours)",
    )
    denoiser_width: int = Field(
        64, ge=4, le=4096, description="denoiser channels (conv) or hidden units (mlp)"
    )
    ae_steps: int = Field(2000, ge=1, le=10_000_000, description="autoencoder steps")
    dm_steps: int = Field(2000, ge=1, le=10_000_000, description="latent DDPM steps")
    batch: int = Field(64, ge=1, le=100_000, description="vectors per DM step")
    lr: float = Field(1e-3, gt=0.0, le=1.0, description="AdamW learning rate")
    timesteps: int = Field(1000, ge=10, le=10_000, description="diffusion steps T")
    invert_from: int = Field(
        200, ge=0, le=10_000,
        description="the inversion's start depth t0 in diffusion steps (the paper leaves it "
        "open): 0 = no diffusion (the autoencoder's reconstruction), timesteps = the "
        "whole chain. The forward chain keeps sqrt(abar_t0) of the upload: 0.81 at 200 of "
        "T = 1000, 0.0064 at 1000, where inversion is direct generation in distribution",
    )  # fmt: skip
    inversion: Literal["chain", "posterior"] = Field(
        "chain",
        description="the reverse pass's noise: chain = eq. 15 with the forward chain's noises "
        "(the paper's); posterior = the residuals that retrace the recorded chain exactly, "
        "so the device gets the autoencoder's reconstruction of its upload at any depth "
        "(the exact-reconstruction control)",
    )

    guide_rounds: int = Field(
        0, ge=0, le=1000,
        description="global guidance (eq. 10, Alg. 1 lines 7-14): a device whose first upload "
        "is at most this many rounds old, once a diffusion model exists, gets guided "
        "parameters instead of inverted ones; 0 = off",
    )  # fmt: skip
    guide_omega: float = Field(1.0, ge=0.0, le=100.0, description="guidance omega")
    guide_steps: int = Field(10, ge=1, le=10_000, description="denoising steps s")
    guide_from: int = Field(
        100, ge=1, le=10_000, description="the noise level (timestep) guidance starts from"
    )

    def traffic(self) -> Traffic:
        """The cloud sees every upload and sends each device its own parameters."""
        return Traffic(cloud_sees="every_upload", downlink="per_device", product="device_models")

    def check_run(self, cfg: RunConfig) -> None:
        check_classifier_rounds("pfedgpa", cfg)
        guide = (self.guide_steps, self.guide_from, self.timesteps)
        if self.guide_rounds and not guide[0] <= guide[1] <= guide[2]:
            raise ValueError("algorithm.pfedgpa needs guide_steps <= guide_from <= timesteps")
        if self.invert_from > self.timesteps:
            raise ValueError(
                f"algorithm.pfedgpa.invert_from ({self.invert_from}) cannot exceed "
                f"timesteps ({self.timesteps}); with fewer diffusion steps, set the depth "
                "too (about a fifth of them keeps most of the upload)"
            )
