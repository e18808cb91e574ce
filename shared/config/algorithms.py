"""Each federated algorithm's own settings: the keys of the ``[algorithm]`` section.

Every algorithm declares one frozen, typed class of its settings here, registered under the
algorithm's name with :func:`algorithm_config`; the algorithm (``shared/algorithms/<name>.py``)
names that class as its ``config_class`` and reads its settings as ``self.settings``. The
classes live in this torch-free module, not beside the algorithms, because every process
reads the whole run config, a sampling-only device without torch included: it must accept
the same keys and compute the same config digest as the processes that train.

The ``[algorithm]`` section of a run config is assembled from the registered classes
(:data:`AlgorithmSection`): ``name`` (one of the registered names) plus every registered
algorithm's keys, each validated by its owner, so a config written for one algorithm may
carry another's keys (a comparison's base section, for example). Only the named
algorithm's cross-section rules apply (:meth:`AlgorithmConfig.check_run`,
:meth:`AlgorithmConfig.check_waste`). A key belongs to one algorithm: two classes declaring
the same key is an error at import time.

Adding an algorithm: declare ``class <Name>Config(AlgorithmConfig)`` here with
``@algorithm_config("<name>")``, and the algorithm's file in ``shared/algorithms/`` (its
class sets ``name`` and ``config_class``) imported once in ``shared/algorithms/__init__.py``.
Its keys count in the config digest only when set away from their defaults
(:attr:`AlgorithmConfig.digest_defaults`), so adding it changes no earlier run's digest.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self, TypeVar

from pydantic import Field, ValidationError, create_model, model_validator

from shared.config.section import Section

if TYPE_CHECKING:  # the run config holds the algorithm section; checks receive the whole of it
    from shared.config import RunConfig


class AlgorithmConfig(Section):
    """Base of one algorithm's settings (its keys under ``[algorithm]``)."""

    #: whether this algorithm's keys count in the config digest even at their defaults:
    #: True for the algorithms whose keys digests have always held, False (keys left out at
    #: their defaults) for every algorithm added since
    digest_defaults: ClassVar[bool] = False
    #: the kinds of generator (``model.preset``) the algorithm trains: ``unet``, and
    #: ``oneshot`` where its local step is the plain loss on the module (no U-Net parts)
    model_kinds: ClassVar[tuple[str, ...]] = ("unet",)

    @classmethod
    def of(cls, cfg: RunConfig) -> Self:
        """This algorithm's settings as ``cfg`` holds them (whichever algorithm it names)."""
        section = cfg.algorithm
        return cls.model_validate({key: getattr(section, key) for key in cls.model_fields})

    @property
    def prunes(self) -> bool:
        """Whether the cloud may change the model's architecture during the run (prune it):
        round announcements then carry a channel plan from the start."""
        return False

    def check_run(self, cfg: RunConfig) -> None:
        """Rules these settings impose on the rest of ``cfg`` when this algorithm is the one
        named; raise ValueError saying what to change. Checked whenever a config is read."""

    def check_waste(self, cfg: RunConfig) -> None:
        """Settings that would train work the run throws away, when this algorithm is the
        one named (raise ValueError). Checked when a run is configured, not when a stored
        config (a checkpoint's) is read back."""


_CONFIGS: dict[str, type[AlgorithmConfig]] = {}
C = TypeVar("C", bound=type[AlgorithmConfig])


def algorithm_config(name: str) -> Callable[[C], C]:
    """Class decorator registering an algorithm's settings class under ``name``."""

    def register(cls: C) -> C:
        new: type[AlgorithmConfig] = cls
        if name in _CONFIGS:
            raise TypeError(f"algorithm {name!r} already has its settings ({_CONFIGS[name]})")
        for other, owner in _CONFIGS.items():
            shared = set(new.model_fields) & set(owner.model_fields)
            if shared:
                raise TypeError(f"{new.__name__} declares {sorted(shared)}, keys of {other!r}")
        _CONFIGS[name] = new
        return cls

    return register


def algorithm_names() -> tuple[str, ...]:
    """The names algorithms are registered under, in registration order."""
    return tuple(_CONFIGS)


def config_class(name: str) -> type[AlgorithmConfig]:
    """The settings class of the algorithm ``name`` (KeyError when none is registered)."""
    return _CONFIGS[name]


# -- the built-in algorithms' settings (registration order is the order ``algorithm.name``'s
# -- error message lists them in) ----------------------------------------------------------


@algorithm_config("fedavg")
class FedAvgConfig(AlgorithmConfig):
    """FedAvg has no settings of its own (FedAvg(E=1) is ``train.local_epochs = 1``)."""

    digest_defaults = True
    model_kinds = ("unet", "oneshot", "classifier")


@algorithm_config("fedphd")
class FedPhDConfig(AlgorithmConfig):
    """FedPhD (seed 000): SH-weighted aggregation (eqs. 22, 24), edge selection (eq. 25),
    sparse training (eqs. 16-17) and structured pruning."""

    digest_defaults = True

    a: float = Field(15_000.0, ge=0.0, description="weight of the SH score against counts")
    b: float = Field(0.0, description="offset inside the ReLU of eqs. 22, 24, 25")
    target_distribution: list[float] = Field(
        default_factory=list, description="q_u over the 10 labels; empty = uniform"
    )
    sparse_rounds: int = Field(0, ge=0, description="R_s: sparse training for rounds < R_s")
    lambda0: float = Field(1e-4, ge=0.0, description="lambda_0 of the group penalty")
    prune_ratio: float = Field(0.0, ge=0.0, lt=0.95, description="s_p: params removed")
    prune_at: Literal["sparse", "init"] = Field(
        "sparse", description="sparse: at r = R_s (after sparse training); init: OS at r = 0"
    )
    prune_method: Literal["l2", "random"] = "l2"

    @model_validator(mode="after")
    def _check(self) -> FedPhDConfig:
        q = self.target_distribution
        if q and (len(q) != 10 or any(x < 0 for x in q) or abs(sum(q) - 1.0) > 1e-6):
            raise ValueError("target_distribution must be 10 non-negative numbers summing to 1")
        if self.prune_ratio > 0 and self.prune_at == "sparse" and self.sparse_rounds == 0:
            raise ValueError("prune_at = 'sparse' prunes at r = R_s: set sparse_rounds >= 1")
        return self

    @property
    def prunes(self) -> bool:
        return self.prune_ratio > 0

    def check_waste(self, cfg: RunConfig) -> None:
        if self.prune_ratio <= 0:
            return
        rounds, r_g, r_s = cfg.run.rounds, cfg.federation.cloud_every, self.sparse_rounds
        if self.prune_at == "init" and r_s:
            raise ValueError(
                f"algorithm.prune_at = 'init' (FedPhD-OS) prunes before the first round, so "
                f"sparse_rounds (R_s={r_s}) would add the group penalty to the pruned "
                "model and never prune again; set sparse_rounds = 0"
            )
        if self.prune_at == "sparse" and r_s % r_g:
            raise ValueError(
                f"algorithm.sparse_rounds (R_s={r_s}) is not a multiple of "
                f"federation.cloud_every (r_g={r_g}): the cloud prunes after a central "
                f"aggregation, so rounds {r_s + 1}..{r_s - r_s % r_g + r_g} would train "
                "the dense model without the penalty; use a multiple of r_g"
            )
        if self.prune_at == "sparse" and r_s >= rounds:
            raise ValueError(
                f"algorithm.sparse_rounds (R_s={r_s}) must be below run.rounds ({rounds}): "
                "the pruned model would never be trained (or never pruned)"
            )


@algorithm_config("feddiffuse")
class FedDiffuseConfig(AlgorithmConfig):
    """FedDiffuse (seed 001): which parts of the U-Net are federated."""

    digest_defaults = True

    split: Literal["full", "usplit", "ulatdec", "udec"] = "full"

    def check_run(self, cfg: RunConfig) -> None:
        if self.split == "usplit" and cfg.federation.assignment != "static":
            # USPLIT pairs the devices of one edge; with devices choosing their edge during
            # the round, no edge knows its devices when it announces the round
            raise ValueError(
                "FedDiffuse USPLIT pairs the devices within each edge, which needs a fixed "
                f"assignment: federation.assignment = {cfg.federation.assignment!r} lets "
                "devices pick their edge during the round; use 'static'"
            )


@algorithm_config("fedprox")
class FedProxConfig(AlgorithmConfig):
    """FedProx: the proximal term's weight."""

    digest_defaults = True
    model_kinds = ("unet", "oneshot")

    prox_mu: float = Field(1.0, ge=0.0, description="FedProx mu (mu/2 ||w - w_g||^2)")


@algorithm_config("scaffold")
class ScaffoldConfig(AlgorithmConfig):
    """SCAFFOLD has no settings of its own (its step size is ``train.lr``)."""

    digest_defaults = True
    model_kinds = ("unet", "oneshot")


@algorithm_config("moon")
class MoonConfig(AlgorithmConfig):
    """MOON: the model-contrastive loss's weight and temperature."""

    digest_defaults = True

    moon_mu: float = Field(1.0, ge=0.0, description="MOON contrastive loss weight")
    moon_tau: float = Field(0.5, gt=0.0, description="MOON temperature")


@algorithm_config("prism")
class PrismConfig(AlgorithmConfig):
    """PRISM (seed 002): stochastic binary masks over frozen random weights. Devices train
    one score per weight (theta = sigmoid(score)), upload one bit per weight, and the cloud
    averages the bits into probabilities, mixed with the previous ones by MADA.

    The frozen weights and the initial scores come from a secret key that is never part of
    the config (``ESTUARY_PRISM_KEY`` / ``ESTUARY_PRISM_KEY_FILE``, docs/algorithms.md)."""

    model_kinds = ("unet", "oneshot")

    prism_estimator: Literal["scaled", "identity"] = Field(
        "scaled",
        description="gradient through the Bernoulli draw: scaled = theta times the mask's "
        "gradient (the authors' code), identity = plain straight-through",
    )
    prism_lr: float = Field(0.1, gt=0.0, le=10.0, description="Adam learning rate on scores")
    prism_beta1: float = Field(0.5, ge=0.0, lt=1.0, description="Adam beta1 on scores")
    prism_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="Adam beta2 on scores")
    prism_local_iters: int = Field(100, ge=1, le=1_000_000, description="local steps a round")
    prism_mask_eps: float = Field(
        0.01, gt=0.0, lt=0.5, description="the cloud maps mean masks into [eps, 1 - eps]"
    )
    prism_mada: bool = Field(True, description="MADA (eq. 2, Alg. 1); false = PRISM-dagger")
    prism_mada_space: Literal["score", "prob"] = Field(
        "score", description="mix scores (Alg. 1, the authors' code) or probabilities (eq. 2)"
    )
    prism_mada_distance: Literal["hamming", "cosine"] = Field(
        "hamming", description="lambda between two seeded Bernoulli samples (App. L: cosine)"
    )
    prism_alpha: float = Field(
        0.0, ge=0.0, le=100.0,
        description="PRISM*: the last alpha % of the masked layers in depth order (output "
        "side) upload their probabilities as float32 instead of masks; 0 = PRISM",
    )  # fmt: skip
    prism_weighting: Literal["masks", "samples"] = Field(
        "masks", description="average masks one per device (eq. 2) or by sample counts"
    )
    prism_dp_noise: float = Field(
        0.0, ge=0.0, le=1e6,
        description="Gaussian noise multiplier z on theta (sigma = z x the L2 sensitivity); "
        "0 = no differential privacy",
    )  # fmt: skip
    prism_dp_epsilon: float = Field(
        10.0, gt=0.0, le=1e6, description="privacy budget: the run stops before exceeding it"
    )
    prism_dp_delta: float = Field(1e-5, gt=0.0, lt=1.0, description="delta of (eps, delta)-DP")
    prism_dp_clip: float = Field(
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


@algorithm_config("local")
class LocalConfig(AlgorithmConfig):
    """Local-only (pFedGPA's baseline, seed 004 Table 1): every device trains its own model
    from the common initial one and nothing is aggregated or uploaded."""

    model_kinds = ("unet", "oneshot", "classifier")


def _check_classifier_rounds(name: str, cfg: RunConfig) -> None:
    """A per-device algorithm's rounds are single-tier: every round is a cloud round."""
    if cfg.federation.edge_every != 1 or cfg.federation.cloud_every != 1:
        raise ValueError(
            f"{name} personalizes every device at every cloud round: set "
            "federation.edge_every = 1 and federation.cloud_every = 1"
        )


@algorithm_config("pfedgpa")
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

    def check_run(self, cfg: RunConfig) -> None:
        _check_classifier_rounds("pfedgpa", cfg)
        guide = (self.pfedgpa_guide_steps, self.pfedgpa_guide_from, self.pfedgpa_timesteps)
        if self.pfedgpa_guide_rounds and not guide[0] <= guide[1] <= guide[2]:
            raise ValueError("need pfedgpa_guide_steps <= pfedgpa_guide_from <= pfedgpa_timesteps")
        if self.pfedgpa_invert_from > self.pfedgpa_timesteps:
            raise ValueError("pfedgpa_invert_from cannot exceed pfedgpa_timesteps")


#: the classifier-free-guidance presets FedDEO's frozen generator may be (a null class)
FEDDEO_PRESETS = ("fmnist-tiny-cfg", "fmnist-small-cfg")


@algorithm_config("feddeo")
class FedDEOConfig(AlgorithmConfig):
    """FedDEO (seed 003): one-shot federated learning with descriptions. Each device trains
    one description vector per local class against a frozen class-conditional generator
    (the noise-prediction loss, gradients into the vectors only) and uploads them once; the
    cloud generates ``feddeo_images_per_class`` images per (device, class) with eq. 5's
    guidance and trains the classifier it deploys on that synthetic set only."""

    feddeo_use_descriptions: bool = Field(
        True,
        description="false = the Prompts-Only baseline: devices upload nothing and the cloud "
        "generates from the class prompts alone (w_d has no effect)",
    )
    feddeo_w_t: float = Field(3.0, ge=0.0, le=100.0, description="eq. 5's class (text) weight")
    feddeo_w_d: float = Field(3.0, ge=0.0, le=100.0, description="eq. 5's description weight")
    feddeo_images_per_class: int = Field(
        30, ge=1, le=100_000, description="N: synthetic images per (device, class); "
        "image i of a (device, class) has its own seed, so a smaller N is a prefix"
    )  # fmt: skip
    feddeo_eval_n: list[int] = Field(
        default_factory=list,
        max_length=16,
        description="also train and score a classifier on the first n images per (device, "
        "class) for each n here (the N ablation of Table 3 from one generation); each must "
        "be at most feddeo_images_per_class",
    )
    feddeo_sample_steps: int = Field(50, ge=1, le=1000, description="DDIM steps (eta 0)")
    feddeo_sample_batch: int = Field(
        128, ge=1, le=65_536, description="images per guided forward pass (x3 model inputs)"
    )
    feddeo_desc_epochs: float = Field(
        10.0, gt=0.0, le=10_000.0, description="E: passes over the device's images that "
        "train its descriptions (Table 4)"
    )  # fmt: skip
    feddeo_desc_lr: float = Field(0.2, gt=0.0, le=100.0, description="Adam rate of descriptions")
    feddeo_desc_batch: int = Field(64, ge=1, le=65_536, description="images per description step")
    feddeo_min_class_images: int = Field(
        1, ge=1, le=1_000_000, description="a device describes a class it holds at least this "
        "many images of"
    )  # fmt: skip
    feddeo_classifier: Literal["fmnist-cnn"] = Field(
        "fmnist-cnn", description="the classifier preset the cloud trains and deploys"
    )
    feddeo_clf_epochs: int = Field(20, ge=1, le=10_000, description="classifier epochs")
    feddeo_clf_lr: float = Field(0.01, gt=0.0, le=10.0, description="classifier SGD rate")
    feddeo_clf_batch: int = Field(64, ge=1, le=65_536, description="classifier batch size")
    feddeo_grid_per_class: int = Field(
        4, ge=0, le=64, description="images per class in each device's grid (0 = no grids)"
    )

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
        big = [n for n in self.feddeo_eval_n if not 1 <= n <= self.feddeo_images_per_class]
        if big:
            raise ValueError(
                f"feddeo_eval_n {big}: each must be between 1 and feddeo_images_per_class "
                f"({self.feddeo_images_per_class})"
            )


# -- the [algorithm] section ------------------------------------------------------------------


class AlgorithmSectionBase(Section):
    """The ``[algorithm]`` section: the algorithm's registered name, plus every registered
    algorithm's keys (the class used at run time, :data:`AlgorithmSection`, adds them)."""

    name: str = "fedavg"

    def config(self) -> AlgorithmConfig:
        """The named algorithm's settings."""
        cls = config_class(self.name)
        return cls.model_validate({key: getattr(self, key) for key in cls.model_fields})

    @model_validator(mode="after")
    def _check_each(self) -> AlgorithmSectionBase:
        """Every registered algorithm's own checks on its keys (they hold whichever
        algorithm is named, so a config never carries settings its owner would refuse)."""
        for cls in _CONFIGS.values():
            try:
                cls.model_validate({key: getattr(self, key) for key in cls.model_fields})
            except ValidationError as err:
                first = err.errors()[0]
                cause = first.get("ctx", {}).get("error")
                raise ValueError(str(cause) if cause is not None else first["msg"]) from None
        return self


def digest_later_keys() -> tuple[str, ...]:
    """The ``[algorithm]`` keys a config digest leaves out at their defaults: those of every
    algorithm whose :attr:`~AlgorithmConfig.digest_defaults` is False."""
    return tuple(
        key for cls in _CONFIGS.values() if not cls.digest_defaults for key in cls.model_fields
    )


def _assemble() -> type[AlgorithmSectionBase]:
    """The section class: ``name`` as a choice of the registered names, then each registered
    algorithm's keys in registration order (so errors list in that order too)."""
    fields: dict[str, Any] = {"name": (Literal[algorithm_names()], "fedavg")}
    for cls in _CONFIGS.values():
        for key, info in cls.model_fields.items():
            fields[key] = (info.annotation, copy.copy(info))
    model: type[AlgorithmSectionBase] = create_model(
        "AlgorithmSection",
        __base__=AlgorithmSectionBase,
        __doc__=AlgorithmSectionBase.__doc__,
        __module__=__name__,
        **fields,
    )
    return model


if TYPE_CHECKING:
    AlgorithmSection = AlgorithmSectionBase
else:
    AlgorithmSection = _assemble()
