from __future__ import annotations

import numpy as np
import pytest

from shared.config import DataSection
from shared.data.partition import label_count_matrix, make_partition
from shared.errors import ConfigError

LABELS = np.repeat(np.arange(10), 100)  # 1000 samples, 100 per class


def _split(**kw: object) -> list[np.ndarray]:
    cfg = DataSection(**kw)  # type: ignore[arg-type]
    return make_partition(LABELS, 20, cfg, seed=7)


@pytest.mark.parametrize("name", ["iid", "dirichlet", "classes", "shards", "quantity", "dominant"])
def test_parts_are_disjoint_and_seeded(name: str) -> None:
    a, b = _split(partition=name), _split(partition=name)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    joined = np.concatenate(a)
    assert len(joined) == len(np.unique(joined))
    other = make_partition(LABELS, 20, DataSection(partition=name), seed=8)  # type: ignore[arg-type]
    assert any(not np.array_equal(x, y) for x, y in zip(a, other, strict=True))


def test_iid_counts() -> None:
    parts = _split(partition="iid")
    assert [len(p) for p in parts] == [50] * 20
    assert sum(len(p) for p in parts) == 1000


def test_k_classes_per_device() -> None:
    parts = _split(partition="classes", classes_per_device=2)
    m = label_count_matrix(LABELS, parts, 10)
    assert ((m > 0).sum(1) == 2).all()
    assert m.sum() == 1000  # every image used: each class goes to 4 devices, split evenly
    assert ((m > 0).sum(0) == 4).all()
    # the devices holding a class have different partners: not the same C / 2 = 5 pairs
    # four times over, as one permutation dealt in a cycle gives
    pairs = {tuple(np.flatnonzero(row)) for row in m}
    assert len(pairs) > 10


@pytest.mark.parametrize(("k", "n"), [(1, 20), (3, 20), (3, 7), (9, 5), (10, 3)])
def test_k_classes_are_distinct_and_used_evenly(k: int, n: int) -> None:
    parts = make_partition(LABELS, n, DataSection(partition="classes", classes_per_device=k), 3)  # type: ignore[arg-type]
    m = label_count_matrix(LABELS, parts, 10)
    assert ((m > 0).sum(1) == k).all()
    holders = (m > 0).sum(0)
    assert holders.max() - holders.min() <= 1, holders


def test_shards_use_four_shards_each() -> None:
    parts = _split(partition="shards", shards_per_device=4)
    assert all(48 <= len(p) <= 52 for p in parts)  # 4 shards of 12 or 13 images
    m = label_count_matrix(LABELS, parts, 10)
    assert ((m > 0).sum(1) <= 8).all()  # a sorted shard spans at most two classes
    assert sum(len(p) for p in parts) == 1000


def test_dominant_share() -> None:
    parts = _split(partition="dominant", dominant_uniform_fraction=0.2)
    m = label_count_matrix(LABELS, parts, 10)
    assert m[0].argmax() == 0 and m[0, 0] >= 40  # 80 % of 50 from class 0, plus uniform draws


def test_max_samples_per_device() -> None:
    parts = _split(partition="iid", max_samples_per_device=10)
    assert all(len(p) == 10 for p in parts)


def test_label_count_matrix_hand_computed() -> None:
    labels = np.array([0, 1, 1, 2, 2, 2])
    m = label_count_matrix(labels, [np.array([0, 1]), np.array([2, 3, 4, 5])], 3)
    assert m.tolist() == [[1, 1, 0], [0, 1, 3]]


def test_a_partition_leaving_a_device_empty_is_refused() -> None:
    """Dirichlet(0.01) over 200 devices leaves most of them without a single image; such a
    device could not train, so the split is refused with a reason instead."""
    cfg = DataSection(partition="dirichlet", dirichlet_beta=0.01)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=r"devices without samples .*dirichlet_beta"):
        make_partition(LABELS, 200, cfg, seed=7)
