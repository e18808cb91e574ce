from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from shared.data.datasets import (
    FILES,
    DataError,
    find_fashion_mnist,
    from_model_output,
    load_fashion_mnist,
    synthetic_dataset,
    to_model_input,
)
from tests.conftest import needs_fmnist


def _write_idx(path: Path, arr: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + arr.astype(np.uint8).tobytes())


def _fake_fmnist(root: Path, n: int = 5) -> None:
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        img, lbl = FILES[split]
        _write_idx(root / img, rng.integers(0, 256, (n, 28, 28)))
        _write_idx(root / lbl, np.arange(n) % 10)


def test_explicit_path_wins(tmp_path: Path) -> None:
    _fake_fmnist(tmp_path)
    ds = load_fashion_mnist("test", tmp_path)
    assert ds.images.shape == (5, 28, 28) and ds.labels.tolist() == [0, 1, 2, 3, 4]


def test_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_fmnist(tmp_path)
    monkeypatch.setenv("ESTUARY_FMNIST_DIR", str(tmp_path))
    assert find_fashion_mnist() in (tmp_path, Path("/usr/share/datasets/fashion-mnist"))


def test_missing_data_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shared.data.datasets.SYSTEM_DIR", tmp_path / "none")
    monkeypatch.setattr("shared.data.datasets.CACHE_DIR", tmp_path / "cache")
    monkeypatch.delenv("ESTUARY_FMNIST_DIR", raising=False)
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        find_fashion_mnist(tmp_path / "empty")


def test_corrupt_idx_rejected(tmp_path: Path) -> None:
    _fake_fmnist(tmp_path)
    with gzip.open(tmp_path / FILES["train"][0], "wb") as fh:
        fh.write(b"\x00\x00\x08\x03" + struct.pack(">3I", 9, 28, 28) + b"short")
    with pytest.raises(DataError, match="header says"):
        load_fashion_mnist("train", tmp_path)
    (tmp_path / FILES["test"][1]).write_bytes(b"not gzip")
    with pytest.raises(DataError):
        load_fashion_mnist("test", tmp_path)


@needs_fmnist
def test_real_fashion_mnist() -> None:
    ds = load_fashion_mnist("test")
    assert len(ds) == 10_000 and np.bincount(ds.labels).tolist() == [1000] * 10


def test_model_space_round_trip() -> None:
    ds = synthetic_dataset(16, seed=1)
    x = to_model_input(ds.images)
    assert x.shape == (16, 1, 32, 32) and float(x.min()) >= -1 and float(x.max()) <= 1
    back = from_model_output(x)
    assert np.array_equal(back[:, 2:30, 2:30], ds.images)
    assert (back[:, :2] == 0).all()
