"""FedDEO's settings (torch-free, read by every process)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from shared.settings import AlgorithmConfig, Traffic

if TYPE_CHECKING:
    from shared.config import RunConfig


#: the classifier-free-guidance presets FedDEO's frozen generator may be (a null class)
FEDDEO_PRESETS = ("fmnist-tiny-cfg", "fmnist-small-cfg", "fmnist-tiny-dom")
#: those of them whose conditioning has a domain axis (shared.models.presets.DOMAIN_AXIS)
FEDDEO_DOMAIN_PRESETS = ("fmnist-tiny-dom",)


class FedDEOConfig(AlgorithmConfig):
    """FedDEO (seed 003): one-shot federated learning with descriptions. Each device trains
    one description vector per local class against a frozen class-conditional generator
    (the noise-prediction loss, gradients into the vectors only) and uploads them once; the
    cloud generates ``images_per_class`` images per (device, class) with eq. 5's
    guidance and trains the classifier it deploys on that synthetic set only."""

    use_descriptions: bool = Field(
        True,
        description="false = the Prompts-Only baseline: devices upload nothing and the cloud "
        "generates from the class prompts alone (w_d has no effect)",
    )
    w_t: float = Field(3.0, ge=0.0, le=100.0, description="eq. 5's class (text) weight")
    w_d: float = Field(3.0, ge=0.0, le=100.0, description="eq. 5's description weight")
    images_per_class: int = Field(
        30, ge=1, le=100_000, description="N: synthetic images per (device, class); "
        "image i of a (device, class) has its own seed, so a smaller N is a prefix"
    )  # fmt: skip
    eval_n: list[int] = Field(
        default_factory=list,
        max_length=16,
        description="also train and score a classifier on the first n images per (device, "
        "class) for each n here (the N ablation of Table 3 from one generation); each must "
        "be at most images_per_class",
    )
    eval_guidance: list[tuple[float, float]] = Field(
        default_factory=list,
        max_length=8,
        description="also generate the synthetic set with each (w_t, w_d) pair here, from "
        "the same descriptions and image seeds, and score a classifier trained on it "
        "(accuracy_by_guidance; the controls of eq. 5's two terms); the deployed classifier "
        "stays that of w_t and w_d",
    )
    sample_steps: int = Field(50, ge=1, le=1000, description="DDIM steps")
    sample_eta: float = Field(
        0.0, ge=0.0, le=1.0, description="DDIM's eta: 0 = deterministic, 1 = ancestral "
        "sampling as eq. 6 (fresh noise each step from the image's own seed)"
    )  # fmt: skip
    prompt_domain: Literal["unspecified", "device"] = Field(
        "unspecified",
        description="the domain the class prompt names: 'unspecified' (the paper's class-"
        "name prompt) or 'device' (each device's true domain, from data.domains: the "
        "Oracle control, which needs a generator with a domain axis, fmnist-tiny-dom)",
    )
    sample_batch: int = Field(
        128, ge=1, le=65_536, description="images per guided forward pass (x3 model inputs)"
    )
    desc_epochs: float = Field(
        10.0, gt=0.0, le=10_000.0, description="E: passes over the device's images that "
        "train its descriptions (Table 4)"
    )  # fmt: skip
    desc_lr: float = Field(0.2, gt=0.0, le=100.0, description="Adam rate of descriptions")
    desc_lrs: list[float] = Field(
        default_factory=list,
        max_length=8,
        description="candidate rates: each device trains its descriptions at each on all "
        "but a held-out part of its images and keeps those with the lowest eq. 4 loss on the "
        "held-out part (fixed timesteps and noise); empty = desc_lr on all images",
    )
    desc_holdout: float = Field(
        0.1, gt=0.0, lt=1.0, description="share of a device's images held out to choose "
        "among desc_lrs"
    )  # fmt: skip
    desc_batch: int = Field(64, ge=1, le=65_536, description="images per description step")
    min_class_images: int = Field(
        1, ge=1, le=1_000_000, description="a device describes a class it holds at least this "
        "many images of"
    )  # fmt: skip
    classifier: Literal["fmnist-cnn"] = Field(
        "fmnist-cnn", description="the classifier preset the cloud trains and deploys"
    )
    clf_epochs: int = Field(20, ge=1, le=10_000, description="classifier epochs")
    clf_lr: float = Field(0.01, gt=0.0, le=10.0, description="classifier SGD rate")
    clf_batch: int = Field(64, ge=1, le=65_536, description="classifier batch size")
    grid_per_class: int = Field(
        4, ge=0, le=64, description="images per class in each device's grid (0 = no grids)"
    )

    phase_text: ClassVar[dict[str, str]] = {
        "aggregating": "generating the synthetic set and training the classifier",
        "deploying": "classifier to ONNX, parity check, signing, devices classifying",
    }

    def traffic(self) -> Traffic:
        """Descriptions go up once, each one forwarded to the cloud, which makes the
        classifier the run deploys."""
        return Traffic(blob_kind="description", cloud_sees="every_upload", product="cloud_made")

    def product_preset(self, cfg: RunConfig) -> str:
        return self.classifier

    def describe(self) -> str:
        return "" if self.use_descriptions else "prompts-only"

    def check_run(self, cfg: RunConfig) -> None:
        if cfg.model.preset not in FEDDEO_PRESETS:
            raise ValueError(
                f"feddeo needs a classifier-free-guidance generator (a null class): set "
                f"model.preset to one of {list(FEDDEO_PRESETS)} (model.preset = "
                f"{cfg.model.preset!r})"
            )
        if cfg.run.rounds != 1:
            raise ValueError(
                f"feddeo is one-shot: every device uploads its descriptions once; set "
                f"run.rounds = 1 (got {cfg.run.rounds})"
            )
        if cfg.federation.edge_every != 1 or cfg.federation.cloud_every != 1:
            raise ValueError("feddeo's one round goes to the cloud: set federation.edge_every "
                             "= 1 and federation.cloud_every = 1")  # fmt: skip
        if self.prompt_domain == "device" and cfg.model.preset not in FEDDEO_DOMAIN_PRESETS:
            raise ValueError(
                f"algorithm.feddeo.prompt_domain = 'device' conditions on a domain: set "
                f"model.preset to a generator with a domain axis ({list(FEDDEO_DOMAIN_PRESETS)})"
            )
        for w_t, w_d in self.eval_guidance:
            if not (0.0 <= w_t <= 100.0 and 0.0 <= w_d <= 100.0):
                raise ValueError("algorithm.feddeo.eval_guidance: weights must be in [0, 100]")
            if w_d and not self.use_descriptions:
                raise ValueError("algorithm.feddeo.eval_guidance: a pair with w_d > 0 needs "
                                 "use_descriptions = true")  # fmt: skip
        if any(not 0.0 < lr <= 100.0 for lr in self.desc_lrs):
            raise ValueError("algorithm.feddeo.desc_lrs: every rate must be in (0, 100]")
        big = [n for n in self.eval_n if not 1 <= n <= self.images_per_class]
        if big:
            raise ValueError(
                f"algorithm.feddeo.eval_n {big}: each must be between 1 and images_per_class "
                f"({self.images_per_class})"
            )
