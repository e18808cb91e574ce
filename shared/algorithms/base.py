"""The algorithm interface: device, edge and cloud parts of one algorithm in one class.

Services own the rounds and call these steps; algorithms own the maths. A subclass lives in
its own file (``fedavg.py``, ...) and registers itself with :func:`register`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from shared.config import RunConfig
from shared.diffusion import make_train_scheduler
from shared.errors import ConfigError
from shared.training import TrainResult

TensorDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Update:
    """One contribution to an aggregation: tensors plus the weights' ingredients."""

    source: str
    tensors: TensorDict
    n_samples: int
    label_counts: tuple[int, ...]


@dataclass
class DeviceContext:
    """Everything a device's local step may use: its private data and its own RNG."""

    device: str
    data: torch.Tensor
    labels: torch.Tensor
    generator: torch.Generator


@dataclass(frozen=True)
class LocalResult:
    """Outcome of a device round; ``tensors`` is None when the round uploads nothing."""

    tensors: TensorDict | None
    train: TrainResult


class Algorithm(ABC):
    """A federated algorithm: ``device_round`` on devices, ``edge_aggregate`` on edges,
    ``cloud_aggregate`` on the cloud. Instances hold only their own role's state."""

    name: ClassVar[str]

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.scheduler = make_train_scheduler(cfg.diffusion)

    @abstractmethod
    def device_round(
        self, ctx: DeviceContext, model: nn.Module, round_: int, *, upload: bool
    ) -> LocalResult:
        """Train ``model`` (already holding the edge model) on the device's data."""

    @abstractmethod
    def edge_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        """Combine device updates into the edge model."""

    @abstractmethod
    def cloud_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        """Combine edge models into the global model."""

    def upload_names(self, model_keys: Sequence[str]) -> list[str]:
        """Tensor names a device uploads (all of them unless the algorithm says otherwise)."""
        return list(model_keys)


_REGISTRY: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator adding ``cls`` to the registry under ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def make_algorithm(cfg: RunConfig) -> Algorithm:
    """Instantiate the algorithm named in ``cfg.algorithm.name``."""
    try:
        cls = _REGISTRY[cfg.algorithm.name]
    except KeyError:
        raise ConfigError(
            f"unknown algorithm {cfg.algorithm.name!r}; registered: {sorted(_REGISTRY)}"
        ) from None
    return cls(cfg)


def registered() -> list[str]:
    """Names of every registered algorithm."""
    return sorted(_REGISTRY)
