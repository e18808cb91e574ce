"""Feature skew (``data.domains``) and the public share (``data.public_size``): each domain's
transform, and every path that gives a device its data (the split, its test split, its own
folder, ``estuary split-data``, a device agent's share) giving device ``i`` the same images,
in its domain, none of them public."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from device_agent.main import device_data, device_test_data
from estuary.split_data import split_data
from shared.config import config_from_dict, load_config, with_overrides
from shared.data.datasets import load_dataset, load_image_folder, write_image_folder
from shared.data.domains import (
    DOMAINS,
    apply_domain,
    device_domain_images,
    domain_of,
    public_split,
)
from shared.data.partition import (
    device_folder,
    domain_test_sets,
    make_partition,
    split_dataset,
    split_test,
)
from shared.errors import ConfigError
from tests.conftest import tiny_config

ALL = list(DOMAINS)


def test_each_domain_transforms_a_hand_made_image() -> None:
    x = np.array([[[1, 2], [3, 4]]], dtype=np.uint8)
    assert apply_domain(x, "identity") is x
    # a quarter turn counter-clockwise: the top row is the old right column
    assert apply_domain(x, "rot90").tolist() == [[[2, 4], [1, 3]]]
    assert apply_domain(x, "invert").tolist() == [[[254, 253], [252, 251]]]
    levels = np.array([[[0, 100, 255]]], dtype=np.uint8)
    # x * 0.35 + 80, rounded: 80, 115, 169.25
    assert apply_domain(levels, "lowcontrast").tolist() == [[[80, 115, 169]]]
    step = np.zeros((1, 4, 4), dtype=np.uint8)
    step[:, :, 2:] = 255
    # the gradient is at the step (columns 1 and 2), none where the image is flat
    assert apply_domain(step, "edges").tolist() == [[[0, 255, 255, 0]] * 4]
    assert apply_domain(np.zeros((2, 3, 3), np.uint8), "edges").tolist() == [[[0] * 3] * 3] * 2
    for name in ALL:
        y = apply_domain(x, name, np.random.default_rng(0))
        assert y.dtype == np.uint8 and y.shape == x.shape


def test_noise_is_seeded_per_device_and_split() -> None:
    x = np.full((3, 28, 28), 128, dtype=np.uint8)
    a = device_domain_images(x, ["noise"], 0, 7)
    assert np.array_equal(a, device_domain_images(x, ["noise"], 0, 7))
    assert not np.array_equal(a, device_domain_images(x, ["noise"], 1, 7))
    assert not np.array_equal(a, device_domain_images(x, ["noise"], 0, 8))
    assert not np.array_equal(a, device_domain_images(x, ["noise"], 0, 7, test=True))
    assert 30 < np.std(a.astype(float) - 128) < 50  # sigma 40 of 255
    with pytest.raises(ValueError, match="seeded generator"):
        apply_domain(x, "noise")
    assert [domain_of(["rot90", "noise"], i) for i in range(3)] == ["rot90", "noise", "rot90"]
    assert domain_of([], 5) == "identity"


def test_unknown_domains_are_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match=r"data\.domains\.1: .*'rot90'.* \(got 'sepia'\)"):
        config_from_dict({"data": {"domains": ["invert", "sepia"]}})
    with pytest.raises(ConfigError):
        apply_domain(np.zeros((1, 2, 2), np.uint8), "sepia")


def test_a_config_without_domains_keeps_its_digest() -> None:
    plain = config_from_dict({}).digest()
    assert plain == config_from_dict({"data": {"domains": [], "public_size": 0}}).digest()
    assert plain != config_from_dict({"data": {"domains": ["invert"]}}).digest()
    assert plain != config_from_dict({"data": {"public_size": 10}}).digest()


def test_no_device_holds_a_public_image_and_the_share_is_every_runs() -> None:
    public, rest = public_split(256, 50)
    assert len(public) == 50 and len(rest) == 206 and not np.intersect1d(public, rest).size
    assert np.array_equal(np.union1d(public, rest), np.arange(256))
    for seed in (0, 3):
        cfg = tiny_config(run={"seed": seed}, data={"public_size": 50})
        data, parts = split_dataset(cfg)
        raw = load_dataset("synthetic", size=256, seed=seed)
        # the returned dataset is the rest (the same indices whatever the run's seed)
        assert np.array_equal(data.images, raw.images[rest])
        assert np.array_equal(data.labels, raw.labels[rest])
        for p in parts:
            assert not np.intersect1d(rest[p], public).size
        assert sum(len(p) for p in parts) == len(rest)
    with pytest.raises(ConfigError, match="public_size"):
        split_dataset(tiny_config(data={"public_size": 256}))


@pytest.mark.parametrize("public_size", [0, 40])
def test_the_split_gives_each_device_its_part_in_its_domain(public_size: int) -> None:
    cfg = tiny_config(data={"domains": ALL, "public_size": public_size, "partition": "classes"})
    data, parts = split_dataset(cfg)
    raw, raw_parts = split_dataset(cfg, domains=False)
    assert np.array_equal(data.labels, raw.labels) and len(parts) == 8
    for i, (p, q) in enumerate(zip(parts, raw_parts, strict=True)):
        assert np.array_equal(p, q)
        want = device_domain_images(raw.images[p], ALL, i, cfg.run.seed)
        assert np.array_equal(data.images[p], want)
        if domain_of(ALL, i) != "identity":
            assert not np.array_equal(want, raw.images[p])
        # a device agent process gets exactly what simulate gives device i
        assert np.array_equal(device_data(cfg, i).images, want)
    plain = tiny_config(data={"public_size": public_size, "partition": "classes"})
    assert np.array_equal(split_dataset(plain)[0].images, raw.images)


def test_test_splits_are_seen_in_the_devices_domains() -> None:
    cfg = tiny_config(
        federation={"num_devices": 6},
        data={"domains": ["noise", "rot90", "invert"], "partition": "dominant_groups",
              "samples_per_device": 20, "test_samples_per_device": 60},
        model={"preset": "fmnist-cnn"},
        algorithm={"name": "fedavg"},
    )  # fmt: skip
    test = split_test(cfg)
    assert test is not None
    data, parts = test
    raw = load_dataset("synthetic", split="test", size=256, seed=cfg.run.seed)
    raw_parts = make_partition(raw.labels, 6, cfg.data, cfg.run.seed, test=True)
    # dominant_groups' test splits overlap: each device holds copies of its own
    assert len(np.unique(np.concatenate(raw_parts))) < sum(len(p) for p in raw_parts)
    train, train_parts = split_dataset(cfg)
    for i, q in enumerate(raw_parts):
        want = device_domain_images(raw.images[q], cfg.data.domains, i, cfg.run.seed, test=True)
        assert np.array_equal(data.images[parts[i]], want)
        assert np.array_equal(data.labels[parts[i]], raw.labels[q])
        mine = device_test_data(cfg, i)
        assert mine is not None and np.array_equal(mine.images, want)
    assert len(train_parts) == 6 and len(train) == 256
    # disjoint test splits keep their indices into the test set
    iid = tiny_config(data={"domains": ["invert"], "public_size": 30})
    test = split_test(iid)
    assert test is not None and len(test[0]) == 256  # no public share of the test split
    assert np.array_equal(test[0].images, 255 - raw.images)


def test_a_devices_own_folder_is_seen_in_its_domain(tmp_path: Path) -> None:
    raw = load_dataset("synthetic", size=40, seed=0)
    write_image_folder(raw, tmp_path / "dev001", [f"{i:02d}" for i in range(len(raw))])
    cfg = tiny_config(
        federation={"num_devices": 2, "num_edges": 1},
        data={"dataset": "folder", "local_dir": str(tmp_path), "domains": ["invert", "noise"]},
    )
    stored = load_image_folder(tmp_path / "dev001")
    got = device_folder(cfg, 1, tmp_path / "dev001")
    want = device_domain_images(stored.images, ["invert", "noise"], 1, cfg.run.seed)
    assert np.array_equal(got.images, want)
    assert np.array_equal(got.labels, stored.labels)
    assert np.array_equal(device_folder(cfg, 1, tmp_path / "dev001", domains=False).images,
                          stored.images)  # fmt: skip
    assert np.array_equal(device_data(cfg, 1).images, got.images)


def test_split_data_writes_untransformed_folders_read_in_the_domains(tmp_path: Path) -> None:
    """The folders hold the images as stored, without the public share; a device reading its
    folder sees it in its domain, the images the split gives it."""
    cfg = tiny_config(
        federation={"num_devices": 4},
        data={"domains": ["rot90", "noise"], "public_size": 30, "partition": "iid"},
        eval={"num_reference": 20},
    )
    out = tmp_path / "split"
    summary = split_data(cfg, out, progress=False)
    folder_cfg = load_config(summary.config_path)
    assert folder_cfg.data.domains == cfg.data.domains
    raw, raw_parts = split_dataset(cfg, domains=False)
    assert sum(summary.device_images) == len(raw) == 256 - 30
    for i in range(4):
        stored = load_image_folder(out / f"dev00{i}")
        assert np.array_equal(stored.images, raw.images[raw_parts[i]])
        want = device_data(cfg, i)
        assert np.array_equal(device_data(folder_cfg, i).images, want.images)
        mine = with_overrides(folder_cfg, {"data": {"local_dir": str(out / f"dev00{i}")}})
        assert np.array_equal(device_data(mine, i).images, want.images)
    folders, folder_parts = split_dataset(folder_cfg)
    data, parts = split_dataset(cfg)
    for p, q in zip(parts, folder_parts, strict=True):
        assert np.array_equal(data.images[p], folders.images[q])


def test_domain_test_sets_hold_the_whole_test_set_in_every_domain() -> None:
    cfg = tiny_config(data={"domains": ["noise", "invert", "noise", "edges", "invert"]})
    sets = domain_test_sets(cfg)
    assert list(sets) == ["noise", "invert", "edges"]
    raw = load_dataset("synthetic", split="test", size=256, seed=0)
    for name, (images, labels) in sets.items():
        assert images.dtype == np.uint8 and images.shape == raw.images.shape
        assert np.array_equal(labels, raw.labels)
        if name != "noise":
            assert np.array_equal(images, apply_domain(raw.images, name))
    assert np.array_equal(sets["noise"][0], domain_test_sets(cfg)["noise"][0])
    assert not np.array_equal(sets["noise"][0], raw.images)
    plain = domain_test_sets(tiny_config())
    assert list(plain) == ["identity"] and np.array_equal(plain["identity"][0], raw.images)
    assert domain_test_sets(tiny_config(data={"dataset": "folder", "local_dir": "x"})) == {}
