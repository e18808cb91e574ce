"""The sections of a run config that describe the experiment: the run, the federation,
the data, the model, the diffusion schedule, local training and evaluation. Each is a frozen
pydantic model that forbids unknown keys (:class:`~shared.settings.Section`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from shared.families import FAMILIES, family_of
from shared.settings import Section

if TYPE_CHECKING:
    from shared.config import RunConfig


class RunSection(Section):
    """Identity and length of a run."""

    name: str = Field("estuary", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    seed: int = Field(0, ge=0, le=2**31 - 1)
    rounds: int = Field(10, ge=1, le=1_000_000)


class FederationSection(Section):
    """Shape of the hierarchy and the round protocol (DESIGN section 2)."""

    num_devices: int = Field(8, ge=1, le=100_000)
    num_edges: int = Field(2, ge=1, le=10_000)
    participation: float = Field(1.0, gt=0.0, le=1.0, description="kappa: devices per round")
    edge_every: int = Field(1, ge=1, description="r_e: edge aggregation every r_e rounds")
    cloud_every: int = Field(1, ge=1, description="r_g: cloud aggregation every r_g rounds")
    min_updates: int = Field(1, ge=1, description="updates an edge needs to close at deadline")
    round_deadline_s: float = Field(600.0, gt=0.0, le=86_400.0)
    registration_timeout_s: float = Field(300.0, gt=0.0, le=86_400.0)
    join_timeout_s: float = Field(
        30.0, gt=0.0, le=3600.0, description="how long a device waits for earlier choices"
    )
    assignment: Literal["static", "select", "random"] = Field(
        "static",
        description="static: devices train at their home edge; select: each device picks "
        "an edge per round by FedPhD eq. 25; random: each device picks one uniformly",
    )
    brokers: Literal["one", "per-edge"] = Field(
        "one",
        description="one: every role talks through one broker; per-edge: each edge site "
        "(an edge and its devices) has its own broker, bridged to the cloud's "
        "(shared.federation.topology; needs assignment = 'static'). Where the roles connect, "
        "not what they compute: not part of the config digest",
    )
    #: statistical homogeneity (FedPhD eqs. 18-25): edge selection's (eq. 25) and FedPhD's
    #: weights (eqs. 22, 24) ``ReLU(n + a mu + b)``, ``mu = 2 - ||q - q_u||_2``
    sh_a: float = Field(15_000.0, ge=0.0, description="weight of the SH score against counts")
    sh_b: float = Field(0.0, description="offset inside the ReLU of eqs. 22, 24, 25")
    sh_target: list[float] = Field(
        default_factory=list, description="q_u over the 10 labels; empty = uniform"
    )

    @model_validator(mode="after")
    def _check(self) -> FederationSection:
        q = self.sh_target
        if q and (len(q) != 10 or any(x < 0 for x in q) or abs(sum(q) - 1.0) > 1e-6):
            raise ValueError("sh_target must be 10 non-negative numbers summing to 1")
        if self.cloud_every % self.edge_every != 0:
            raise ValueError(
                f"cloud_every (r_g={self.cloud_every}) must be a multiple of "
                f"edge_every (r_e={self.edge_every}) so edges hold a fresh aggregate "
                "whenever the cloud aggregates"
            )
        if self.brokers == "per-edge" and self.assignment != "static":
            raise ValueError(
                f"federation.brokers = 'per-edge' needs federation.assignment = 'static' (got "
                f"{self.assignment!r}): a device talks to its own site's broker only, so it "
                "cannot train with another site's edge"
            )
        if self.num_edges > self.num_devices:
            raise ValueError(
                f"num_edges ({self.num_edges}) exceeds num_devices ({self.num_devices}); "
                "every edge needs at least one device"
            )
        return self


PartitionName = Literal[
    "iid", "dirichlet", "classes", "shards", "quantity", "dominant", "dominant_groups"
]  # fmt: skip

#: FedPAC's groups of dominant classes (overlapping triples), device i in group i mod 5
FEDPAC_GROUPS = ((0, 1, 2), (2, 3, 4), (4, 5, 6), (6, 7, 8), (8, 9, 0))


#: the image domains of feature skew (:mod:`shared.data.domains` implements them, in this order)
DomainName = Literal["identity", "rot90", "invert", "lowcontrast", "noise", "edges"]


class DataSection(Section):
    """Dataset and how it is split across devices (DESIGN section 3)."""

    dataset: Literal["fashion-mnist", "synthetic", "folder", "cifar10"] = "fashion-mnist"
    path: str = Field(
        "",
        description="fashion-mnist: directory with the IDX .gz files (empty = search); "
        "folder: one image folder DIR/<class>/<files> split across the devices; cifar10: "
        "the directory of CIFAR-10's binary version (data_batch_1.bin ... data_batch_5.bin, "
        "test_batch.bin), required",
    )
    gray_to_rgb: bool = Field(
        False,
        description="a grayscale dataset (fashion-mnist, synthetic, folder) as 3-channel "
        "model input: each image replicated into 3 identical channels, for a 3-channel "
        "model.preset (ddpm-cifar10); false: such a preset is refused on grayscale data",
    )
    local_dir: str = Field(
        "",
        max_length=4096,
        description="dataset = 'folder': a device's own images, DIR/<class>/<files>; in "
        "simulate and compare, the directory holding one such folder per device (dev000, "
        "dev001, ...); per process",
    )
    class_names: list[str] = Field(
        default_factory=list,
        max_length=10,
        description="dataset = 'folder': the class folder names, in label order "
        "(empty: 0-9 or Fashion-MNIST's names)",
    )
    partition: PartitionName = "iid"
    classes_per_device: int = Field(2, ge=1, le=10)
    dirichlet_beta: float = Field(0.5, gt=0.0)
    shards_per_device: int = Field(4, ge=1)
    dominant_uniform_fraction: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="dominant, dominant_groups: the share s drawn from "
        "all classes (pFedGPA's default 20 %)",
    )
    dominant_groups: list[list[int]] = Field(
        default_factory=lambda: [list(g) for g in FEDPAC_GROUPS],
        min_length=1,
        max_length=1000,
        description="dominant_groups: the groups of dominant classes; device i draws the "
        "rest of its samples evenly from group i mod len(groups) (default: FedPAC's "
        "overlapping triples, which pFedGPA's setup implies)",
    )
    samples_per_device: int = Field(
        600,
        ge=0,
        le=10_000_000,
        description="dominant_groups: training samples per device "
        "(pFedGPA: 600); 0 = an equal share of the dataset",
    )
    test_samples_per_device: int = Field(
        600,
        ge=0,
        le=10_000_000,
        description="dominant_groups: test samples per device, "
        "drawn from the test set by the same rule (a device's own test split); 0 = an equal "
        "share of the test set",
    )
    quantity_sigma: float = Field(1.0, gt=0.0)
    domains: list[DomainName] = Field(
        default_factory=list,
        max_length=64,
        description="feature skew: device i sees its images (training and test) in domain "
        "domains[i % len(domains)], a fixed transform of the 8-bit images (identity, rot90, "
        "invert, lowcontrast, noise, edges; shared/data/domains.py) applied on every path that "
        "gives a device its data; empty = no transform",
    )
    public_size: int = Field(
        0, ge=0, le=10_000_000,
        description="images of the training split held out as the public share no device "
        "holds (a seeded draw, the same in every run: shared.data.domains.public_split); the "
        "generator FedDEO starts from is pretrained on it (20000 for the shipped "
        "fmnist-tiny-cfg); 0 = none",
    )  # fmt: skip
    max_samples_per_device: int = Field(0, ge=0, description="0 = keep all")
    synthetic_size: int = Field(512, ge=10, le=1_000_000)

    @property
    def channels(self) -> int:
        """Channels of the dataset's images as stored: 3 for CIFAR-10's colour images, 1 for
        the grayscale datasets (Fashion-MNIST, synthetic, image folders)."""
        return 3 if self.dataset == "cifar10" else 1

    @property
    def input_channels(self) -> int:
        """Channels of the model input the images become
        (:func:`shared.data.datasets.to_model_input`): 3 for a grayscale dataset viewed in
        3 channels (``gray_to_rgb``), else :attr:`channels`."""
        return 3 if self.gray_to_rgb else self.channels

    @model_validator(mode="after")
    def _check_gray_view(self) -> DataSection:
        if self.domains and self.channels != 1:
            raise ValueError(
                "data.domains transform grayscale images; "
                f"data.dataset = {self.dataset!r} is colour"
            )
        if self.gray_to_rgb and self.channels != 1:
            raise ValueError(
                f"data.gray_to_rgb views a grayscale dataset in 3 channels, and data.dataset = "
                f"{self.dataset!r} is colour already: remove data.gray_to_rgb"
            )
        return self

    @property
    def own_folders(self) -> bool:
        """Each device trains on an image folder of its own (``dataset = "folder"`` without
        ``path``; with a path, the one folder is split like any dataset)."""
        return self.dataset == "folder" and not self.path

    @field_validator("dominant_groups")
    @classmethod
    def _check_groups(cls, groups: list[list[int]]) -> list[list[int]]:
        for g in groups:
            if not g or len(set(g)) != len(g) or not all(0 <= c < 1000 for c in g):
                raise ValueError(
                    f"group {g}: a group is a non-empty list of distinct class indices"
                )
        return groups

    @field_validator("class_names")
    @classmethod
    def _check_class_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not name or name.startswith(".") or "/" in name or "\\" in name or len(name) > 100:
                raise ValueError(f"{name!r} cannot be a folder name")
        if len(set(names)) != len(names):
            raise ValueError("class names must differ")
        return names


#: presets of one-shot generators and of classifiers (the model families: shared.families)
ONESHOT_PRESETS = FAMILIES["oneshot"].presets
CLASSIFIER_PRESETS = FAMILIES["classifier"].presets

#: what each model kind is, for error messages
KIND_NAMES: dict[str, str] = {kind: family.name for kind, family in FAMILIES.items()}
KIND_PLURALS: dict[str, str] = {kind: family.plural for kind, family in FAMILIES.items()}


def model_kind(preset: str) -> str:
    """The model family of ``preset``: ``"unet"``, ``"oneshot"`` or ``"classifier"``
    (:mod:`shared.families`)."""
    return family_of(preset).kind


def classifies(cfg: RunConfig) -> bool:
    """Whether the devices judge a classifier on their own test split: the run trains one
    (``model.preset``) or delivers one (its method's product, FedDEO's)."""
    product = cfg.algorithm.config().product_preset(cfg)
    return "accuracy" in (family_of(cfg.model.preset).quality, family_of(product).quality)


class ModelSection(Section):
    """Which generator preset to train (a U-Net or a one-shot generator), and where its
    first weights come from."""

    preset: Literal[
        "fmnist-tiny", "fmnist-small", "fmnist-tiny-cond", "fmnist-small-cond", "fmnist-tiny-cfg",
        "fmnist-small-cfg", "fmnist-tiny-dom", "ddpm-cifar10",
        "resnetg-fmnist-16", "resnetg-fmnist-32", "resnetg-fmnist-64", "resnetg-cifar10-64",
        "fmnist-cnn", "fmnist-cnn-small",
    ] = "fmnist-tiny"  # fmt: skip
    init: str = Field(
        "random",
        min_length=1,
        max_length=4096,
        description="the first global model: 'random' (drawn from run.seed), 'pretrained' "
        "(the preset's generator shipped in shared/assets, trained by "
        "scripts/pretrain_generator.py), or the path of a .safetensors file: an Estuary "
        "checkpoint of a dense model of this preset, or its bare state dict",
    )

    @field_validator("init")
    @classmethod
    def _check_init(cls, value: str) -> str:
        if value not in ("random", "pretrained") and not value.endswith(".safetensors"):
            raise ValueError("must be 'random', 'pretrained' or a path ending in .safetensors")
        return value


class DiffusionSection(Section):
    """DDPM training schedule and DDIM sampling (DESIGN section 3)."""

    num_train_timesteps: int = Field(1000, ge=10, le=10_000)
    beta_start: float = Field(1e-4, gt=0.0, lt=1.0)
    beta_end: float = Field(0.02, gt=0.0, lt=1.0)
    sample_steps: int = Field(100, ge=1, le=10_000)
    eta: float = Field(0.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _check(self) -> DiffusionSection:
        if self.beta_end <= self.beta_start:
            raise ValueError(
                f"beta_end ({self.beta_end}) must exceed beta_start ({self.beta_start})"
            )
        if self.sample_steps > self.num_train_timesteps:
            raise ValueError("sample_steps cannot exceed num_train_timesteps")
        return self


class TrainSection(Section):
    """Local training on each device."""

    local_epochs: int = Field(1, ge=0, le=10_000)
    local_steps: int = Field(0, ge=0, description="> 0 overrides local_epochs")
    batch_size: int = Field(64, ge=1, le=65_536)
    lr: float = Field(1e-3, gt=0.0, le=10.0)
    weight_decay: float = Field(0.0, ge=0.0)
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    momentum: float = Field(
        0.9, ge=0.0, lt=1.0, description="SGD momentum (sgd only); SCAFFOLD as defined needs 0"
    )
    adam_betas: tuple[float, float] = Field(
        (0.9, 0.999),
        description="(beta1, beta2) of adam and adamw; PRISM's score optimizer and a FedAvg "
        "matched to it use (0.5, 0.999)",
    )
    grad_clip: float = Field(1.0, ge=0.0, description="0 disables clipping")
    optimizer_state: Literal["reset", "keep"] = Field(
        "reset",
        description="reset: a fresh optimizer every local round (FedAvg as usually run); "
        "keep: each device keeps its optimizer's state (Adam's moments) from its last round, "
        "on the device (never sent), starting afresh when the model's shapes change (pruning)",
    )
    threads: int = Field(
        0,
        ge=0,
        description="torch threads of this process; 0 = torch's default within the process's "
        "CPU limit (shared.runtime.cpu). Per process, like the deployment sections: not part of "
        "the config digest, so each device may set its own",
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="local training's forward passes: fp32, or bf16 autocast (weights, "
        "gradients, optimizer state and everything sent stay fp32; for GPUs with bf16, "
        "Ampere and later). Per process, like threads: a GPU device may use bf16 in a "
        "federation whose CPU devices train in fp32",
    )
    activation_checkpointing: bool = Field(
        False,
        description="U-Net models: recompute each block's activations in the backward pass "
        "instead of keeping them from the forward pass (diffusers' gradient checkpointing): "
        "the same steps and updates in less memory, for about a third more training time. "
        "Per process, like precision: a device short of memory may turn it on alone",
    )
    micro_batch: int = Field(
        0,
        ge=0,
        le=65_536,
        description="DDPM training: run each step's batch through the model this many images "
        "at a time, accumulating the gradient, so that only a micro-batch's activations are "
        "held (0: the whole batch at once). The same draws and the same gradient up to float "
        "rounding, for some speed on a CPU. Not for a custom loss (MOON: whole batches). Per "
        "process, like precision: a device short of memory may set it alone",
    )
    cuda_graph: bool = Field(
        False,
        description="on a CUDA device, capture each local round's training step as a CUDA "
        "graph after 3 eager warm-up steps and replay it: the same draws and updates with one "
        "launch per step instead of thousands (small U-Nets are bound by the host otherwise). "
        "Not for MOON (eager). Per process, like precision",
    )
    cuda_graph_reuse: bool = Field(
        False,
        description="with cuda_graph: a round without local terms (FedAvg, FedDiffuse, "
        "FedPhD after its sparse rounds) and with a fresh optimizer replays one capture kept "
        "on the GPU across rounds and devices (weights copied in and out, optimizer state "
        "zeroed) instead of capturing anew: no warm-up or capture per round. Per process",
    )

    ama_lr: float = Field(
        0.005,
        gt=0.0,
        le=1.0,
        description="one-shot generators: Adam learning rate of the moving averages of the "
        "feature-matching loss (AMA, PRISM eqs. 7-8; the paper's 0.005, its code's default "
        "1e-5); not used by U-Nets",
    )

    @model_validator(mode="after")
    def _check(self) -> TrainSection:
        if self.local_epochs == 0 and self.local_steps == 0:
            raise ValueError("set local_epochs >= 1 or local_steps >= 1")
        if not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise ValueError(f"adam_betas must lie in [0, 1), got {list(self.adam_betas)}")
        return self


class EvalSection(Section):
    """Evaluation, sampling and checkpoint cadence."""

    every: int = Field(5, ge=0, description="quality evaluation every k rounds; 0 = off")
    sample_every: int = Field(5, ge=0, description="sample grid every k rounds; 0 = off")
    grid_size: int = Field(64, ge=1, le=1024)
    num_samples: int = Field(500, ge=10, le=100_000, description="generated images for FID")
    num_reference: int = Field(2000, ge=10, le=100_000, description="real train images for FID")
    sample_steps: int = Field(50, ge=1, le=10_000, description="DDIM steps for eval sampling")
    checkpoint_every: int = Field(1, ge=0, description="checkpoint every k cloud aggregations")
    clients: int = Field(
        5,
        ge=1,
        le=10_000,
        description="client-level evaluation (models with device-local parts, in-process "
        "runs): the devices averaged, the first k by name among those holding local parts",
    )
    reference_dir: str = Field(
        "",
        max_length=4096,
        description="data.dataset = 'folder': the real images quality metrics compare with, "
        "DIR/<class>/<files> (the cloud's, or an in-process run's); per process",
    )
