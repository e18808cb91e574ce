"""Devices training on their own image folders (``data.dataset = "folder"``): the reader,
``estuary split-data``, and a federation of processes over a real mosquitto whose devices each
read only their own folder and end with the model of the same split held in memory."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import shared.data.images as data_mod
from device_agent.main import device_data
from estuary.launcher import Hierarchy
from estuary.simulate import simulate
from estuary.split_data import split_data
from shared.config import RunConfig, load_config, with_overrides
from shared.data.datasets import (
    CLASSES,
    DataError,
    class_folders,
    class_slug,
    load_dataset,
    load_image_folder,
    synthetic_dataset,
    write_image_folder,
)
from shared.errors import ConfigError
from shared.evaluation.evaluator import reference_images
from shared.transport.local_broker import LocalBroker, find_mosquitto
from tests.conftest import tiny_config


def _save(path: Path, array: np.ndarray, mode: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array, mode=mode).save(path)


def test_folder_names_are_digits_or_fashion_mnist_classes_or_your_own() -> None:
    assert class_slug("T-shirt/top") == "t-shirt-top" and class_slug("Ankle boot") == "ankle-boot"
    folders = class_folders()
    assert folders["0"] == folders["t-shirt-top"] == 0
    assert folders["9"] == folders["ankle-boot"] == 9
    assert len(folders) == 20
    assert class_folders(["cat", "dog"]) == {"cat": 0, "dog": 1}


def test_a_written_folder_reads_back_unchanged(tmp_path: Path) -> None:
    data = synthetic_dataset(40, seed=3)
    names = [f"{i:03d}" for i in range(len(data))]
    assert write_image_folder(data, tmp_path, names) == 40
    assert {p.name for p in tmp_path.iterdir()} <= {class_slug(c) for c in CLASSES}
    back = load_image_folder(tmp_path)
    assert np.array_equal(back.images, data.images)
    assert np.array_equal(back.labels, data.labels)
    assert back.name == f"folder:{tmp_path}"


def test_photos_are_gray_square_and_28_pixels(tmp_path: Path) -> None:
    """RGB, RGBA, palette and 16-bit-free JPEG files of any size: converted to luminance,
    centre-cropped, resized; nested folders below a class count."""
    rgb = np.zeros((48, 96, 3), np.uint8)
    rgb[:, 24:72] = (255, 255, 255)  # a white centre square on a black strip
    _save(tmp_path / "3" / "wide.png", rgb)
    _save(tmp_path / "3" / "deeper" / "again.jpg", rgb)
    rgba = np.full((10, 10, 4), 128, np.uint8)
    _save(tmp_path / "sneaker" / "small.png", rgba)
    back = load_image_folder(tmp_path)
    assert back.images.shape == (3, 28, 28) and back.images.dtype == np.uint8
    # name order: "again.jpg", "small.png", "wide.png"
    assert back.labels.tolist() == [3, 7, 3]
    assert back.images[2].min() == 255  # the crop kept only the white centre
    assert abs(int(back.images[0].mean()) - 255) <= 3  # JPEG, nearly white
    assert set(np.unique(back.images[1])) == {128}


def test_16_bit_and_float_images_keep_their_range(tmp_path: Path) -> None:
    """Pillow's ``convert("L")`` clips 16-bit grayscale at 255 (a scan of 0..65535 came out
    nearly all white); it is scaled instead, as float images in [0, 1] are."""
    ramp = np.arange(28 * 28, dtype=np.float64).reshape(28, 28) / (28 * 28 - 1)
    _save(tmp_path / "0" / "a16.png", np.rint(ramp * 65535).astype(np.uint16))
    _save(tmp_path / "1" / "b8.png", np.rint(ramp * 255).astype(np.uint8))
    (tmp_path / "2").mkdir()
    Image.fromarray(ramp.astype(np.float32)).save(tmp_path / "2" / "c.tiff")
    sixteen, eight, floats = load_image_folder(tmp_path).images.astype(int)
    assert np.abs(sixteen - eight).max() <= 1 and np.abs(floats - eight).max() <= 1


def test_bad_layouts_are_refused_with_the_fix(tmp_path: Path) -> None:
    img = np.zeros((28, 28), np.uint8)
    with pytest.raises(DataError, match="does not exist"):
        load_image_folder(tmp_path / "nope")
    with pytest.raises(DataError, match="no readable images"):
        load_image_folder(tmp_path)
    _save(tmp_path / "loose.png", img)
    with pytest.raises(DataError, match=r"loose.png is not in a class folder"):
        load_image_folder(tmp_path)
    (tmp_path / "loose.png").unlink()
    _save(tmp_path / "cats" / "a.png", img)
    with pytest.raises(DataError, match=r"'cats' is not a class; .*data.class_names"):
        load_image_folder(tmp_path)
    assert load_image_folder(tmp_path, class_names=["dogs", "cats"]).labels.tolist() == [1]


def test_unreadable_files_are_skipped_and_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    img = np.full((28, 28), 7, np.uint8)
    _save(tmp_path / "1" / "good.png", img)
    (tmp_path / "1" / "broken.png").write_bytes(b"\x89PNG not really")
    noise = np.random.default_rng(0).integers(0, 256, (40, 40), dtype=np.uint8)
    _save(tmp_path / "1" / "huge.png", noise)  # over 1 KB: incompressible
    (tmp_path / "1" / "notes.txt").write_text("not an image, not counted")
    monkeypatch.setattr(data_mod, "MAX_IMAGE_FILE_BYTES", 1000)
    with caplog.at_level(logging.WARNING):
        back = load_image_folder(tmp_path)
    assert back.labels.tolist() == [1] and back.skipped == 2
    assert "skipped 2 of 3 files" in caplog.text and "broken.png" in caplog.text
    (tmp_path / "1" / "good.png").unlink()
    with pytest.raises(DataError, match=r"no readable images .* 2 files failed"):
        load_image_folder(tmp_path)


def test_a_folder_that_cannot_be_listed_is_an_error_not_a_gap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``os.walk`` skips a sub-folder it cannot list (permissions, I/O error) unless asked;
    a device would train on part of its data without a word."""
    import os

    for sub in ("a", "b"):
        _save(tmp_path / "4" / sub / "x.png", np.zeros((28, 28), np.uint8))
    real = os.scandir

    def scandir(path: str | os.PathLike[str]) -> Iterator[os.DirEntry[str]]:
        if Path(path).name == "b":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)  # type: ignore[return-value]

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(DataError, match=r"cannot list .*4/b: Permission denied"):
        load_image_folder(tmp_path)


def test_listing_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(4):
        _save(tmp_path / "0" / f"{i}.png", np.zeros((28, 28), np.uint8))
    monkeypatch.setattr(data_mod, "MAX_FOLDER_IMAGES", 3)
    with pytest.raises(DataError, match=r"more than 3 images; set data.max_samples_per_device"):
        load_image_folder(tmp_path)


def test_max_images_draws_a_seeded_sample_before_decoding(tmp_path: Path) -> None:
    data = synthetic_dataset(30, seed=1)
    write_image_folder(data, tmp_path, [f"{i:02d}" for i in range(30)])
    a = load_image_folder(tmp_path, max_images=10, seed=5)
    assert len(a) == 10 and np.array_equal(a.images, load_image_folder(
        tmp_path, max_images=10, seed=5).images)  # fmt: skip
    assert not np.array_equal(a.images, load_image_folder(tmp_path, max_images=10, seed=6).images)


def test_split_data_folders_train_the_devices_on_the_same_images(tmp_path: Path) -> None:
    """Each device's folder holds exactly its share of the split, in the split's order; the
    cloud's folder is the evaluation's reference set; the written config differs only in
    reading folders."""
    cfg = tiny_config(
        federation={"num_devices": 4},
        data={"partition": "classes", "classes_per_device": 2},
        eval={"num_reference": 50},
    )
    out = tmp_path / "split"
    summary = split_data(cfg, out, progress=False)
    assert 0 < sum(summary.device_images) <= cfg.data.synthetic_size
    assert summary.reference_images == 50
    folder_cfg = load_config(summary.config_path)
    assert folder_cfg.data.dataset == "folder"
    for i in range(4):
        mine = with_overrides(folder_cfg, {"data": {"local_dir": str(out / f"dev00{i}")}})
        want, got = device_data(cfg, i), device_data(mine, i)
        assert np.array_equal(want.images, got.images) and np.array_equal(want.labels, got.labels)
        assert len(got) == summary.device_images[i]
        # given the whole layout (split-data's config as it is), a device reads its own folder
        assert np.array_equal(device_data(folder_cfg, i).images, want.images)
        assert len(np.unique(got.labels)) <= 2
    assert folder_cfg.eval.reference_dir == str((out / "cloud").resolve())
    assert torch.equal(reference_images(cfg), reference_images(folder_cfg))
    split = json.loads((out / "split.json").read_text())
    assert split["folder_config_digest"] == folder_cfg.digest() != cfg.digest()
    with pytest.raises(ConfigError, match="not empty"):
        split_data(cfg, out, progress=False)
    with pytest.raises(ConfigError, match="already reads the devices' own image folders"):
        split_data(folder_cfg, tmp_path / "again", progress=False)


def test_folder_runs_need_their_folders(tmp_path: Path) -> None:
    folder_cfg = tiny_config(data={"dataset": "folder"}, eval={"every": 1})
    with pytest.raises(ConfigError, match="needs its image folder; pass --data DIR"):
        device_data(folder_cfg, 0)
    with pytest.raises(DataError, match=r"quality metrics need real images .* --reference DIR"):
        reference_images(folder_cfg)
    with pytest.raises(ConfigError, match=r"set data.local_dir to the directory holding one"):
        simulate(folder_cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
    (tmp_path / "fleet" / "dev000" / "0").mkdir(parents=True)
    _save(tmp_path / "fleet" / "dev000" / "0" / "a.png", np.zeros((28, 28), np.uint8))
    missing = with_overrides(folder_cfg, {"data": {"local_dir": str(tmp_path / "fleet")}})
    with pytest.raises(DataError, match=r"fleet/dev001 does not exist"):
        simulate(missing, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
    with pytest.raises(DataError, match=r"without data.path is the devices. own image folders"):
        load_dataset("folder")


def test_simulate_and_compare_train_on_the_folders_as_on_the_dataset(tmp_path: Path) -> None:
    """``estuary simulate DIR/config.json`` on ``split-data``'s folders: the same final model
    and FID as the original config on the dataset in memory, in ``compare`` too, whose
    centralized method pools the folders."""
    from estuary.compare import CompareSpec, Method, load_record, run_compare

    cfg = tiny_config(
        run={"rounds": 2},
        federation={"num_devices": 4},
        data={"partition": "dirichlet"},
        eval={"every": 2, "num_samples": 16, "num_reference": 40, "sample_steps": 5},
    )
    split = split_data(cfg, tmp_path / "split", progress=False)
    folder_cfg = load_config(split.config_path)
    want = simulate(cfg, tmp_path / "a", progress=False)
    got = simulate(folder_cfg, tmp_path / "b", progress=False)
    assert got.final_model_sha256 == want.final_model_sha256
    fid = [r["quality"]["fid"] for r in (want.rows, got.rows)[1] if r.get("quality")]
    assert fid == [r["quality"]["fid"] for r in want.rows if r.get("quality")] and fid
    rows = {}
    for name, c in (("dataset", cfg), ("folders", folder_cfg)):
        methods = [Method("FedAvg", "fedavg", c), Method("C", "c", c, centralized=True)]
        spec = CompareSpec(name=name, methods=methods, reference="FedAvg")
        rows[name] = run_compare(spec, tmp_path / name, progress=False).rows
    assert rows["folders"][0]["fid"] == rows["dataset"][0]["fid"] == fid[-1]
    # the folders are per-process settings outside the digest: other folders, no reuse
    moved = tmp_path / "moved"
    (tmp_path / "split").rename(moved)
    dirs = {"data": {"local_dir": str(moved)}, "eval": {"reference_dir": str(moved / "cloud")}}
    again = with_overrides(folder_cfg, dirs)
    assert again.digest() == folder_cfg.digest()
    method = Method("FedAvg", "fedavg", again)
    record, why = load_record(method, tmp_path / "folders" / "fedavg", evaluate=True)
    assert record is None and "has folders" in why
    method = Method("FedAvg", "fedavg", folder_cfg)
    assert load_record(method, tmp_path / "folders" / "fedavg", evaluate=True)[0] is not None
    # centralized pools the same images, in the folders' order rather than the dataset's
    assert rows["folders"][1]["fid"] == pytest.approx(rows["dataset"][1]["fid"], rel=0.2)


@pytest.mark.process
@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
def test_devices_reading_only_their_own_folders_train_the_same_model(tmp_path: Path) -> None:
    """Cloud, 2 edges and 4 device processes on a real mosquitto, each device started with
    ``--data`` on its own folder from ``split-data`` and the cloud evaluating against its own:
    the final model is the one ``simulate`` trains from the shared dataset, and so is the FID.
    A broken file in dev001's folder is skipped and shows on its /metrics."""
    cfg = tiny_config(
        run={"name": "folders", "rounds": 2},
        federation={"num_devices": 4, "num_edges": 2, "round_deadline_s": 60},
        data={"partition": "classes", "classes_per_device": 2},
        train={"local_steps": 3, "batch_size": 8, "threads": 1},
        eval={"every": 2, "num_samples": 16, "num_reference": 40, "sample_steps": 5},
    )
    reference = simulate(cfg, tmp_path / "reference", progress=False, evaluate=True)
    split = split_data(cfg, tmp_path / "split", progress=False)
    folder_cfg = load_config(split.config_path)
    (tmp_path / "split" / "dev001" / "3").mkdir(exist_ok=True)
    (tmp_path / "split" / "dev001" / "3" / "zz-truncated.png").write_bytes(b"\x89PNG\r\n")
    broker = LocalBroker(kind="mosquitto", workdir=tmp_path / "broker").start()
    hier = Hierarchy(folder_cfg, split.config_path, tmp_path / "run", broker,
                     data_dir=tmp_path / "split")  # fmt: skip
    try:
        hier.start_all()
        deadline = time.monotonic() + 60
        gauges: dict[str, float] = {}
        while "estuary_training_images" not in gauges and time.monotonic() < deadline:
            time.sleep(0.2)  # until dev001 has read its folder
            gauges = hier.scrape_all().get("dev001", {})
        assert gauges.get("estuary_training_images") == split.device_images[1], gauges
        assert gauges.get("estuary_skipped_image_files") == 1, gauges
        code = hier.wait("cloud", 180)
        assert code == 0, hier.procs["cloud"].log_tail(30)
    finally:
        hier.stop_all(timeout_s=10)
        broker.stop()
    summary = json.loads((hier.run_dir / "summary.json").read_text())
    assert summary["final_model_sha256"] == reference.final_model_sha256
    device_log = hier.procs["dev002"].log_path.read_text()
    assert f"from folder:{tmp_path / 'split' / 'dev002'}" in device_log
    rows = [json.loads(line) for line in (hier.run_dir / "metrics.jsonl").read_text().splitlines()]
    fid = [r["quality"]["fid"] for r in rows if r.get("quality")]
    want = [r["quality"]["fid"] for r in reference.rows if r.get("quality")]
    assert len(fid) == len(want) == 1
    assert fid[0] == pytest.approx(want[0], rel=1e-3)


def test_folder_config_round_trips(tmp_path: Path) -> None:
    cfg: RunConfig = tiny_config(data={"dataset": "folder", "class_names": ["a", "b"]})
    path = tmp_path / "c.json"
    path.write_text(cfg.to_json())
    assert load_config(path) == cfg


def test_an_rgb_preset_is_refused_before_training(tmp_path: Path) -> None:
    """``ddpm-cifar10`` takes 3-channel images and every dataset is grayscale: simulate,
    compare and a device refuse it at start (it used to fail inside the first training
    step with a convolution shape error)."""
    from estuary.compare import CompareSpec, Method, run_compare

    cfg = tiny_config(model={"preset": "ddpm-cifar10"})
    with pytest.raises(ConfigError, match=r"'ddpm-cifar10' takes 3-channel images"):
        simulate(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="3-channel"):
        device_data(cfg, 0)
    folder = with_overrides(cfg, {"data": {"dataset": "folder", "local_dir": str(tmp_path)}})
    with pytest.raises(ConfigError, match="3-channel"):
        device_data(folder, 0)
    methods = [Method("ok", "ok", tiny_config()), Method("rgb", "rgb", cfg)]
    spec = CompareSpec(name="c", methods=methods, reference="ok")
    with pytest.raises(ConfigError, match="3-channel"):
        run_compare(spec, tmp_path / "cmp", progress=False)
    assert not (tmp_path / "cmp").exists()


def test_one_folder_split_across_the_devices_is_a_dataset_like_the_others(tmp_path: Path) -> None:
    """``data.dataset = "folder"`` with ``data.path``: one labelled image folder (your own
    Fashion-MNIST-like set) split by ``data.partition`` in every role, evaluated against
    images drawn from it; written from the synthetic set in index order, it trains the
    synthetic set's model and FID exactly."""
    data = load_dataset("synthetic", size=256, seed=0)
    write_image_folder(data, tmp_path / "all", [f"{i:03d}" for i in range(len(data))])
    over: dict[str, dict[str, Any]] = {
        "run": {"rounds": 2},
        "federation": {"num_devices": 4},
        "data": {"partition": "classes", "classes_per_device": 2},
        "eval": {"every": 2, "num_samples": 16, "num_reference": 40, "sample_steps": 5},
    }
    cfg = tiny_config(**over)
    folder = with_overrides(cfg, {"data": {"dataset": "folder", "path": str(tmp_path / "all")}})
    want = simulate(cfg, tmp_path / "a", progress=False)
    got = simulate(folder, tmp_path / "b", progress=False)
    assert got.final_model_sha256 == want.final_model_sha256
    assert [r.get("quality") for r in got.rows] == [r.get("quality") for r in want.rows]
    for i in range(4):
        assert np.array_equal(device_data(folder, i).images, device_data(cfg, i).images)
    # ... and split-data writes its per-device layout like any dataset's
    split = split_data(folder, tmp_path / "split", progress=False)
    assert split.device_images == [len(device_data(cfg, i)) for i in range(4)]
    with pytest.raises(ConfigError, match=r"data.path .* and data.local_dir .* exclude"):
        with_overrides(folder, {"data": {"local_dir": str(tmp_path)}})
