"""Typed run configuration: a TOML file plus ``ESTUARY__SECTION__KEY`` environment overrides.

Every section is a frozen pydantic model that forbids unknown keys, so a typo is an error
that names the key, not a silently ignored setting. ``load_config`` returns a validated
:class:`RunConfig`; ``RunConfig.to_json`` is what gets saved beside every checkpoint.

Example override: ``ESTUARY__TRAIN__LR=3e-4 estuary simulate configs/fedavg_iid_tiny.toml``.

The ``[algorithm]`` section is assembled from each algorithm's own settings class
(:mod:`shared.config.algorithms`); the other sections are declared here.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_serializer,
    field_validator,
    model_validator,
)

from shared.config import legacy
from shared.config.algorithms import AlgorithmSection, algorithm_names, config_class
from shared.errors import ConfigError, did_you_mean
from shared.families import FAMILIES, family_of
from shared.settings import Section

ENV_PREFIX = "ESTUARY__"


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
        "fmnist-small-cfg", "ddpm-cifar10",
        "resnetg-fmnist-16", "resnetg-fmnist-32", "resnetg-fmnist-64", "resnetg-cifar10-64",
        "fmnist-cnn",
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


#: a byte limit sized from the run's model (``cache_limit_bytes``, ``memory_limit_bytes``)
AUTO = "auto"


class AutoBytes(int):
    """A blob-store limit left ``"auto"``: sized from the run's model where the run is known
    (:meth:`BrokerSection.with_blob_limits`, which every role process applies when it
    connects). The int itself is the fallback a bus built from these settings alone uses
    (tests, benchmarks): the fixed limits of earlier versions."""

    def __repr__(self) -> str:
        return f"AutoBytes({int(self)})"


#: "auto" blob limits: memory holds BLOB_MEMORY_BLOBS of the run's largest blob (what a role
#: serves: the global state and its shared part, an edge's model, a device's upload), plus
#: one per device for a role that holds a blob for each device, and at least
#: BLOB_MEMORY_FLOOR; the disk cache BLOB_DISK_FACTOR times that, at least BLOB_DISK_FLOOR.
#: Uploads an aggregator fetches are folded and dropped, never stored
BLOB_MEMORY_BLOBS, BLOB_MEMORY_FLOOR = 2, 64 << 20
BLOB_DISK_FACTOR, BLOB_DISK_FLOOR = 4, 256 << 20


class BrokerSection(Section):
    """MQTT broker connection and blob-transfer limits (deployment settings, not in the digest).

    The password never lives in the config: it comes from ``password_file`` or the
    ``ESTUARY_MQTT_PASSWORD`` environment variable.
    """

    host: str = Field("127.0.0.1", min_length=1, max_length=253)
    port: int = Field(1883, ge=1, le=65_535)
    protocol: Literal["5", "3.1.1"] = "5"
    username: str = Field("", max_length=128)
    password_file: str = ""
    tls: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    keepalive_s: int = Field(30, ge=5, le=3600)
    connect_timeout_s: float = Field(30.0, gt=0.0, le=3600.0)
    reconnect_min_s: int = Field(1, ge=1, le=60)
    reconnect_max_s: int = Field(30, ge=1, le=3600)
    session_expiry_s: int = Field(300, ge=0, le=7 * 86_400)
    chunk_bytes: int = Field(1 << 20, ge=4096, le=64 << 20, description="blob chunk size")
    max_blob_bytes: int = Field(1 << 30, ge=1, le=1 << 40)
    max_inflight_bytes: int = Field(128 << 20, ge=4096, description="sent, not yet acknowledged")
    max_fetch_bytes: int = Field(2 << 30, ge=4096, description="partial blobs being received")
    chunk_timeout_s: float = Field(5.0, gt=0.0, le=600.0, description="re-ask after silence")
    max_update_fetches: int = Field(
        2,
        ge=1,
        le=1024,
        description="uploads an edge downloads at once; each holds one upload's bytes until "
        "it is folded into the round's sum, the others wait their turn. A download silent "
        "for 3 x chunk_timeout_s gives up, so a silent device holds a turn no longer",
    )
    fetch_timeout_s: float = Field(600.0, gt=0.0, le=86_400.0)
    cache_dir: str = Field("", description="on-disk blob cache; empty = memory only")
    cache_limit_bytes: int = Field(
        AutoBytes(8 << 30), ge=0, description='on-disk blob cache; "auto": sized from the model'
    )
    memory_limit_bytes: int = Field(
        AutoBytes(2 << 30), ge=0, description='blobs kept in memory; "auto": sized from the model'
    )
    max_queue: int = Field(100_000, ge=10, le=10_000_000, description="inbound messages queued")
    max_queue_bytes: int = Field(
        64 << 20, ge=1 << 20, le=1 << 40, description="inbound message bytes queued"
    )

    @model_validator(mode="after")
    def _check(self) -> BrokerSection:
        if self.reconnect_max_s < self.reconnect_min_s:
            raise ValueError("reconnect_max_s must be >= reconnect_min_s")
        if self.max_inflight_bytes < self.chunk_bytes:
            raise ValueError("max_inflight_bytes must hold at least one chunk")
        return self

    @field_validator("cache_limit_bytes", "memory_limit_bytes", mode="wrap")
    @classmethod
    def _auto_limit(
        cls, value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo
    ) -> int:
        """``"auto"`` (or a limit still auto) stays auto; anything else is a byte count."""
        if value == AUTO or isinstance(value, AutoBytes):
            default = cls.model_fields[str(info.field_name)].default
            return AutoBytes(default)
        limit: int = handler(value)
        return limit

    @field_serializer("cache_limit_bytes", "memory_limit_bytes")
    def _dump_limit(self, value: int) -> int | str:
        """An auto limit is written as ``"auto"`` (config.json keeps it auto)."""
        return AUTO if isinstance(value, AutoBytes) else int(value)

    def with_blob_limits(self, blob_bytes: int, per_device_blobs: int = 0) -> BrokerSection:
        """These settings with each limit left ``"auto"`` sized for a run whose largest blob
        is ``blob_bytes`` and where this role holds ``per_device_blobs`` blobs, one per
        device, at once (pFedGPA's personal models on the cloud, the per-device uploads an
        edge forwards); an explicit limit is kept.

        Memory: ``max(BLOB_MEMORY_FLOOR, (BLOB_MEMORY_BLOBS + per_device_blobs) *
        blob_bytes)``: room for what the role serves at once (the global state and its
        shared part, an edge's model and its report to the cloud, a device's upload and
        the model it trained); the uploads an aggregator fetches are never stored, and an
        older blob (the previous round's model, for a device that asks late) is read back
        from disk. Evicted blobs are the least recently used ones (still on
        disk), and every request served refreshes the blob asked for. Disk:
        ``BLOB_DISK_FACTOR`` times that, at least ``BLOB_DISK_FLOOR``."""
        if blob_bytes < 0 or per_device_blobs < 0:
            raise ValueError("blob_bytes and per_device_blobs must be >= 0")
        memory = max(BLOB_MEMORY_FLOOR, (BLOB_MEMORY_BLOBS + per_device_blobs) * blob_bytes)
        update: dict[str, int] = {}
        if isinstance(self.memory_limit_bytes, AutoBytes):
            update["memory_limit_bytes"] = memory
        if isinstance(self.cache_limit_bytes, AutoBytes):
            update["cache_limit_bytes"] = max(BLOB_DISK_FLOOR, BLOB_DISK_FACTOR * memory)
        return self.model_copy(update=update) if update else self

    @property
    def blob_limits_auto(self) -> bool:
        """Whether a blob-store limit is still ``"auto"`` (not sized for a run yet)."""
        return isinstance(self.memory_limit_bytes, AutoBytes) or isinstance(
            self.cache_limit_bytes, AutoBytes
        )


class MetricsSection(Section):
    """Prometheus ``/metrics`` endpoint of a service process."""

    enabled: bool = True
    addr: str = "0.0.0.0"
    port: int = Field(9100, ge=0, le=65_535, description="0 = any free port")
    final_scrape_s: float = Field(
        0.0,
        ge=0,
        le=600,
        description="after a clean finish, keep /metrics up until Prometheus has scraped the "
        "final state (the cloud's phase 'done'), at most this long; 0 = exit at once",
    )


class ComputeSection(Section):
    """Where this process trains: a per-process setting (not part of the config digest), so
    GPU and CPU devices can serve one federation."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="local training: cuda when available (auto), or forced"
    )
    deterministic: bool = Field(
        False,
        description="deterministic kernels only (cuDNN, cuBLAS, torch's strict deterministic "
        "mode): a GPU run repeats bit for bit, somewhat slower",
    )


class DeploySection(Section):
    """Shipping the trained generator to the devices (DESIGN section 5)."""

    enabled: bool = Field(True, description="cloud exports and publishes after training")
    signing_key: str = Field("", description="cloud: Ed25519 private key (PEM) to sign with")
    verify_key: str = Field("", description="devices: Ed25519 public key (PEM) to verify with")
    opset: int = Field(17, ge=17, le=23)
    fp16: bool = False
    parity_threshold: float = Field(1e-4, gt=0.0, description="max abs error vs torch")
    parity_steps: int = Field(20, ge=1, le=1000, description="DDIM steps of the parity check")
    sample_steps: int = Field(50, ge=1, le=1000, description="DDIM steps of device grids")
    grid_size: int = Field(16, ge=1, le=1024, description="images in a device's sample grid")
    max_request_images: int = Field(256, ge=1, le=100_000, description="cap per request")
    provider: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int = Field(0, ge=0, description="ONNX Runtime intra-op threads; 0 = default")
    out_dir: str = Field("", description="devices: where grids and models go; empty = ./deploy")
    wait_s: float = Field(
        120.0, ge=0.0, le=86_400.0, description="cloud: serve the deployment this long for reports"
    )
    fetch_timeout_s: float = Field(
        60.0,
        gt=0.0,
        le=86_400.0,
        description="devices: give up fetching a deployment's files after this long (the fetch "
        "runs beside training and sampling; capped by broker.fetch_timeout_s)",
    )


DEPLOYMENT_SECTIONS = ("broker", "metrics", "deploy", "compute")
#: settings of other sections that are per process too (counted at their defaults)
PER_PROCESS_KEYS = (
    ("train", "threads"),
    ("train", "precision"),
    ("train", "cuda_graph"),
    ("train", "cuda_graph_reuse"),
    ("data", "local_dir"),
    ("eval", "reference_dir"),
)
#: the config format this code writes (:mod:`shared.config.legacy` reads format 1)
FORMAT: Literal[2] = 2


class RunConfig(Section):
    """The whole configuration of one federated run."""

    #: the config's format: 2 (``[algorithm.<name>]`` tables), or 1 (one flat, prefixed
    #: ``[algorithm]`` table, read by :mod:`shared.config.legacy`; its digest is format 1's).
    #: A config that does not say is format 1 when its ``[algorithm]`` holds a flat key,
    #: else 2.
    format: Literal[1, 2] = FORMAT
    run: RunSection = RunSection()
    federation: FederationSection = FederationSection()
    data: DataSection = DataSection()
    model: ModelSection = ModelSection()
    diffusion: DiffusionSection = DiffusionSection()
    train: TrainSection = TrainSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    eval: EvalSection = EvalSection()
    broker: BrokerSection = BrokerSection()
    metrics: MetricsSection = MetricsSection()
    deploy: DeploySection = DeploySection()
    compute: ComputeSection = ComputeSection()

    @model_validator(mode="before")
    @classmethod
    def _nest(cls, data: Any, info: ValidationInfo) -> Any:
        """Format 1's flat ``[algorithm]`` keys moved to their tables (said once per key,
        not for a stored config); ``format`` inferred where the config does not say."""
        if not isinstance(data, dict):
            return data
        algorithm = data.get("algorithm")
        flat = isinstance(algorithm, dict) and bool(legacy.flat_keys_of(algorithm))
        note = not (info.context or {}).get("stored")
        out = legacy.nest(data, note=note) if flat else dict(data)
        out.setdefault("format", 1 if flat else FORMAT)
        return out

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> RunConfig:
        settings = self.algorithm.config()
        kind = model_kind(self.model.preset)
        if kind not in settings.model_kinds:
            trains = " and ".join(KIND_PLURALS[k] for k in settings.model_kinds)
            raise ValueError(
                f"algorithm {self.algorithm.name!r} trains {trains}, and model.preset = "
                f"{self.model.preset!r} is {KIND_NAMES[kind]}; train it with "
                f"{[n for n in algorithm_names() if kind in config_class(n).model_kinds]}"
            )
        settings.check_run(self)
        if self.federation.cloud_every > self.run.rounds:
            raise ValueError(
                f"federation.cloud_every (r_g={self.federation.cloud_every}) exceeds "
                f"run.rounds ({self.run.rounds}): the cloud would never aggregate and the run "
                "would end with the initial model"
            )
        if not (info.context or {}).get("stored"):
            self._check_waste()
        steps = self.diffusion.num_train_timesteps
        for section, value in (
            ("eval", self.eval.sample_steps),
            ("deploy", self.deploy.sample_steps),
        ):
            if value > steps:
                raise ValueError(
                    f"{section}.sample_steps ({value}) exceeds diffusion.num_train_timesteps "
                    f"({steps})"
                )
        return self

    def _check_waste(self) -> None:
        """Settings that would train work the run throws away. Checked when a run is
        configured, not when a stored config is read back (a checkpoint or record of a run
        made before a rule existed stays readable)."""
        rounds, r_g = self.run.rounds, self.federation.cloud_every
        if rounds % r_g:
            raise ValueError(
                f"run.rounds ({rounds}) is not a multiple of federation.cloud_every "
                f"(r_g={r_g}): the last {rounds % r_g} round(s) would train without ever "
                f"reaching the cloud's model; use {rounds - rounds % r_g} or "
                f"{rounds - rounds % r_g + r_g} rounds"
            )
        if self.data.dataset == "folder" and self.data.path and self.data.local_dir:
            raise ValueError(
                "data.path (one image folder split across the devices) and data.local_dir "
                "(each device's own folder) exclude each other; set one"
            )
        if self.data.own_folders and self.data.partition != "iid":
            raise ValueError(
                f"data.partition = {self.data.partition!r} splits one dataset across the "
                "devices, but with data.dataset = 'folder' and no data.path each device trains "
                "on its own folder as it is; leave data.partition unset (or set data.path to "
                "one image folder to split)"
            )
        self.algorithm.config().check_waste(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every value (defaults included)."""
        return self.model_dump(mode="json")

    def to_json(self) -> str:
        """Canonical JSON (sorted keys), the form saved with checkpoints."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    def digest(self) -> str:
        """Short sha256 of the canonical JSON without the deployment sections (broker,
        metrics, deploy, compute) and with the per-process keys (``train.threads``,
        ``data.local_dir``, ``eval.reference_dir``, ...) at their defaults, of which
        ``[algorithm]`` counts only the named method's table: identifies the experiment on
        the wire, wherever each role connects from and whatever it runs on. A format 1
        config keeps format 1's digest (:func:`shared.config.legacy.legacy_digest`)."""
        data = {
            k: v
            for k, v in self.to_dict().items()
            if k not in DEPLOYMENT_SECTIONS and k != "format"
        }
        # per-process keys count at their defaults, whatever this process set
        for section, key in PER_PROCESS_KEYS:
            data[section] = {**data[section], key: _default(self, section, key)}
        if self.format == 1:
            return legacy.legacy_digest(self, data)
        name = self.algorithm.name
        data["algorithm"] = {"name": name, name: data["algorithm"][name]}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _default(cfg: RunConfig, section: str, key: str) -> Any:
    """The default of ``section.key`` (from the section's class, not from ``cfg``)."""
    return type(getattr(cfg, section)).model_fields[key].get_default(call_default_factory=True)


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The field names of the section that ``loc`` (a path of keys) sits in."""
    model: Any = RunConfig
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
        # a method's table is optional: its model is the union's member that has fields
        model = next((m for m in get_args(model) if hasattr(m, "model_fields")), model)
    return list(getattr(model, "model_fields", {}))


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        value = e.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        hint = ""
        if e["type"] == "extra_forbidden" and e["loc"]:
            hint = did_you_mean(str(e["loc"][-1]), _fields_at(tuple(e["loc"])))
        elif e["type"] == "literal_error" and isinstance(value, str):
            expected = (e.get("ctx") or {}).get("expected", "")
            hint = did_you_mean(value, re.findall(r"'([^']*)'", str(expected)))
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  - {loc}: {msg}{shown}{hint}")
    return "\n".join(lines)


def _parse_env_value(raw: str) -> Any:
    """Parse an override as a TOML value (numbers, booleans, arrays), else keep the string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_env_overrides(data: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """Return a copy of ``data`` with ``ESTUARY__SECTION__KEY`` values applied (a method's
    table: ``ESTUARY__ALGORITHM__<NAME>__KEY``)."""
    merged: dict[str, Any] = copy.deepcopy(dict(data))
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        table = len(parts) == 3 and parts[0] == "algorithm"  # a method's table
        if not (len(parts) == 2 or table) or not all(parts):
            raise ConfigError(
                f"environment override {name} must look like {ENV_PREFIX}SECTION__KEY (or "
                f"{ENV_PREFIX}ALGORITHM__<METHOD>__KEY)"
            )
        *path, key = parts
        target = merged
        for part in path:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"environment override {name}: {part} is not a section")
        target[key] = _parse_env_value(raw)
    return merged


def config_from_dict(
    data: Mapping[str, Any],
    *,
    env: Mapping[str, str] | None = None,
    source: str = "dict",
    stored: bool = False,
) -> RunConfig:
    """Validate a mapping (plus optional env overrides) into a :class:`RunConfig`;
    ``stored``: the config of a run already made (a checkpoint's), read back without the
    rules against wasted work (:meth:`RunConfig._check_waste`)."""
    merged = apply_env_overrides(data, env or {})
    try:
        return RunConfig.model_validate(merged, context={"stored": stored})
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def with_overrides(
    cfg: RunConfig,
    updates: Mapping[str, Mapping[str, Any]],
    *,
    source: str = "overrides",
    stored: bool = False,
) -> RunConfig:
    """``cfg`` with ``{section: {key: value}}`` replaced (a method's table merged key by key:
    ``{"algorithm": {"prism": {"lr": 0.2}}}``), validated like a loaded config (a
    ConfigError naming ``source`` if a value is out of range); ``stored`` as in
    :func:`config_from_dict`."""
    data = cfg.to_dict()
    for section, values in updates.items():
        target = data.setdefault(section, {})
        for key, value in values.items():
            old = target.get(key)
            merge = isinstance(value, Mapping) and isinstance(old, dict)
            target[key] = {**old, **value} if merge else value
    return config_from_dict(data, source=source, stored=stored)


def load_config(path: str | Path, *, env: Mapping[str, str] | None = None) -> RunConfig:
    """Load a TOML (or a saved JSON) config; ``env`` defaults to ``os.environ``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot parse {p}: {err}") from None
    return config_from_dict(data, env=os.environ if env is None else env, source=str(p))
