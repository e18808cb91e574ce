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
    ``pfedgpa_store_rounds`` rounds, trains a latent diffusion model over their (flattened)
    parameters and sends each device its own parameters, obtained by inverting what it
    uploaded (eqs. 11-16). Before the first diffusion round the devices train the global
    average (FedAvg-FT); the readings the lost appendix leaves open are settings here."""

    model_kinds = ("classifier",)

    pfedgpa_store_rounds: int = Field(
        20, ge=1, le=1000, description="rounds of uploads the cloud keeps (the paper: 20)"
    )
    pfedgpa_dm_every: int = Field(
        0, ge=0, le=100_000,
        description="train the diffusion model every this many rounds (and personalize "
        "after it); 0 = only before the final round (the paper generates in the final round)",
    )  # fmt: skip
    pfedgpa_mode: Literal["inversion", "generation"] = Field(
        "inversion",
        description="inversion: each device's own upload inverted (eqs. 11-16); generation: "
        "direct sampling from noise (Table 2's 'w/o inversion' ablation)",
    )
    pfedgpa_layers: list[str] = Field(
        default_factory=lambda: ["auto"],
        min_length=1,
        max_length=64,
        description="the model's layers (module names) whose parameters the diffusion model "
        "generates; the rest stays the device's own. ['*'] = the whole model (the paper's "
        "Fashion-MNIST setting); ['auto'] = the whole model where the cloud has a GPU "
        "(compute.device), the last layer (fc2) on a CPU",
    )
    pfedgpa_ae_size: Literal["small", "medium"] = Field(
        "small", description="p-diff autoencoder size (small: f=k=3; medium: f=k=5)"
    )
    pfedgpa_denoiser_width: int = Field(64, ge=4, le=1024, description="denoiser channels")
    pfedgpa_ae_steps: int = Field(2000, ge=1, le=10_000_000, description="autoencoder steps")
    pfedgpa_dm_steps: int = Field(2000, ge=1, le=10_000_000, description="latent DDPM steps")
    pfedgpa_batch: int = Field(64, ge=1, le=100_000, description="vectors per DM step")
    pfedgpa_lr: float = Field(1e-3, gt=0.0, le=1.0, description="AdamW learning rate")
    pfedgpa_timesteps: int = Field(1000, ge=10, le=10_000, description="diffusion steps T")
    pfedgpa_invert_from: int = Field(
        0, ge=0, le=10_000,
        description="the inversion's start depth t0 (0 = T, the whole chain; not stated in "
        "the paper)",
    )  # fmt: skip

    pfedgpa_guide_rounds: int = Field(
        0, ge=0, le=1000,
        description="global guidance (eq. 10, Alg. 1 lines 7-14): a device whose first upload "
        "is at most this many rounds old, once a diffusion model exists, gets guided "
        "parameters instead of inverted ones; 0 = off",
    )  # fmt: skip
    pfedgpa_guide_omega: float = Field(1.0, ge=0.0, le=100.0, description="guidance omega")
    pfedgpa_guide_steps: int = Field(10, ge=1, le=10_000, description="denoising steps s")
    pfedgpa_guide_from: int = Field(
        100, ge=1, le=10_000, description="the noise level (timestep) guidance starts from"
    )

    def traffic(self) -> Traffic:
        """The cloud sees every upload and sends each device its own parameters."""
        return Traffic(cloud_sees="every_upload", downlink="per_device", product="device_models")

    def check_run(self, cfg: RunConfig) -> None:
        check_classifier_rounds("pfedgpa", cfg)
        guide = (self.pfedgpa_guide_steps, self.pfedgpa_guide_from, self.pfedgpa_timesteps)
        if self.pfedgpa_guide_rounds and not guide[0] <= guide[1] <= guide[2]:
            raise ValueError("need pfedgpa_guide_steps <= pfedgpa_guide_from <= pfedgpa_timesteps")
        if self.pfedgpa_invert_from > self.pfedgpa_timesteps:
            raise ValueError("pfedgpa_invert_from cannot exceed pfedgpa_timesteps")
