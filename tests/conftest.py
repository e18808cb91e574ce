"""Shared fixtures: tiny configs and a check for the Fashion-MNIST files."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from shared.config import RunConfig, config_from_dict
from shared.data.datasets import DataError, find_fashion_mnist

torch.set_num_threads(min(2, torch.get_num_threads()))

#: the PRISM key every test process (and the processes they start) uses; a test of the
#: missing-key error removes it with monkeypatch
TEST_PRISM_KEY = "00112233445566778899aabbccddeeff"
os.environ["ESTUARY_PRISM_KEY"] = TEST_PRISM_KEY
os.environ.pop("ESTUARY_PRISM_KEY_FILE", None)


def have_fmnist() -> bool:
    """Whether the Fashion-MNIST IDX files can be found."""
    try:
        find_fashion_mnist()
    except DataError:
        return False
    return True


needs_fmnist = pytest.mark.skipif(
    not have_fmnist(), reason="Fashion-MNIST missing: apt-get install dataset-fashion-mnist"
)


def tiny_config(**overrides: dict[str, Any]) -> RunConfig:
    """2 edges x 4 devices x 3 rounds, a few steps each, no evaluation."""
    base: dict[str, dict[str, Any]] = {
        "run": {"name": "test", "seed": 0, "rounds": 3},
        "federation": {"num_devices": 8, "num_edges": 2, "round_deadline_s": 60},
        "data": {"dataset": "synthetic", "synthetic_size": 256, "partition": "iid"},
        "model": {"preset": "fmnist-tiny"},
        "train": {"local_steps": 2, "batch_size": 8, "lr": 2e-3},
        "eval": {"every": 0, "sample_every": 0, "checkpoint_every": 1},
    }
    for section, values in overrides.items():
        base.setdefault(section, {}).update(values)
    return config_from_dict(base)


@pytest.fixture
def tiny_cfg() -> RunConfig:
    """The default tiny config."""
    return tiny_config()


def synthetic_federation(cfg: RunConfig, bus: Any = None) -> tuple[Any, Any, list[Any]]:
    """The federation ``cfg`` describes, over ``bus`` (a fresh MemoryBus by default) on its
    synthetic data split by its partition, not started yet: (federation, bus, the list the
    round summaries collect in)."""
    from estuary.simulate import build_federation
    from shared.data.datasets import load_dataset
    from shared.data.partition import make_partition
    from shared.transport.bus import MemoryBus

    data = load_dataset("synthetic", size=cfg.data.synthetic_size, seed=cfg.run.seed)
    parts = make_partition(data.labels, cfg.federation.num_devices, cfg.data, cfg.run.seed)
    bus = bus if bus is not None else MemoryBus()
    summaries: list[Any] = []
    fed = build_federation(cfg, bus, data, parts, on_round_end=summaries.append)
    return fed, bus, summaries
