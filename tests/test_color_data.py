"""3-channel data: the gray view of a grayscale dataset (``data.gray_to_rgb``) and CIFAR-10
read from its binary version, down to the tensors a device trains on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from shared.config import RunConfig, config_from_dict
from shared.data import datasets
from shared.data.datasets import (
    CIFAR10_CLASSES,
    CIFAR10_FILES,
    CIFAR10_RECORD_BYTES,
    CIFAR10_URL,
    ImageDataset,
    from_model_output,
    load_dataset,
    synthetic_dataset,
    to_model_input,
    write_image_folder,
)
from shared.errors import ConfigError, DataError
from shared.evaluation import quality
from shared.evaluation.evaluator import check_evaluable
from shared.evaluation.report import save_grid
from shared.models.presets import check_trainable
from tests.conftest import tiny_config

# --- CIFAR-10 binary files, written by hand -------------------------------------------------


def _record(label: int, seed: int) -> tuple[bytes, np.ndarray]:
    """One binary record (label byte, then the R, G, B planes) and the image it holds,
    ``(32, 32, 3)`` with ``image[y, x, c]`` the byte at ``1 + c * 1024 + y * 32 + x``."""
    image = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    planes = b"".join(image[:, :, c].tobytes() for c in range(3))  # row-major per channel
    return bytes([label]) + planes, image


def _write_cifar(
    root: Path, per_file: int = 2
) -> tuple[dict[str, np.ndarray], dict[str, list[int]]]:
    """A miniature CIFAR-10 binary directory: ``per_file`` records in each of the six batch
    files; returns the images and labels each split should read back, in file order."""
    root.mkdir(parents=True, exist_ok=True)
    images: dict[str, list[np.ndarray]] = {"train": [], "test": []}
    labels: dict[str, list[int]] = {"train": [], "test": []}
    seed = 0
    for split, names in CIFAR10_FILES.items():
        for name in names:
            raw = b""
            for _ in range(per_file):
                label = (seed * 7 + 3) % 10
                rec, img = _record(label, seed)
                raw += rec
                images[split].append(img)
                labels[split].append(label)
                seed += 1
            (root / name).write_bytes(raw)
    return {k: np.stack(v) for k, v in images.items()}, labels


def test_the_binary_records_are_read_back_exactly(tmp_path: Path) -> None:
    want, labels = _write_cifar(tmp_path / "cifar")
    train = load_dataset("cifar10", str(tmp_path / "cifar"))
    test = load_dataset("cifar10", str(tmp_path / "cifar"), split="test")
    assert train.images.shape == (10, 32, 32, 3) and test.images.shape == (2, 32, 32, 3)
    assert train.labels.tolist() == labels["train"] and test.labels.tolist() == labels["test"]
    assert np.array_equal(train.images, want["train"]) and np.array_equal(test.images, want["test"])
    assert train.channels == 3 and train.name == "cifar10/train"
    # pixel order by hand: byte 1 + c * 1024 + y * 32 + x of a record is pixel (y, x) of channel c
    raw = (tmp_path / "cifar" / "data_batch_2.bin").read_bytes()
    second = raw[CIFAR10_RECORD_BYTES:]  # the second record of batch 2: image 3 of the split
    for y, x, c in ((0, 0, 0), (0, 1, 0), (1, 0, 1), (31, 30, 2), (17, 5, 2)):
        assert train.images[3, y, x, c] == second[1 + c * 1024 + y * 32 + x]
    assert train.labels[3] == second[0]
    assert len(CIFAR10_CLASSES) == 10 and CIFAR10_CLASSES[0] == "airplane"


def test_the_extracted_archive_directory_is_found_from_its_parent(tmp_path: Path) -> None:
    want, _ = _write_cifar(tmp_path / "cifar-10-batches-bin")
    data = load_dataset("cifar10", str(tmp_path))
    assert np.array_equal(data.images, want["train"])


def test_cifar10_model_input_is_channels_first_and_unpadded(tmp_path: Path) -> None:
    want, _ = _write_cifar(tmp_path)
    data = load_dataset("cifar10", str(tmp_path))
    x = to_model_input(data.images, 3)
    assert x.shape == (10, 3, 32, 32) and x.dtype == torch.float32 and x.is_contiguous()
    assert x[4, 2, 7, 9].item() == pytest.approx(want["train"][4, 7, 9, 2] / 127.5 - 1.0)
    assert x.min() >= -1.0 and x.max() <= 1.0
    assert np.array_equal(from_model_output(x), want["train"])  # colour images round-trip
    with pytest.raises(DataError, match="3 channels cannot be 1-channel"):
        to_model_input(data.images, 1)


@pytest.mark.parametrize(
    ("size", "match"),
    [
        (2 * CIFAR10_RECORD_BYTES + 5, "not a whole number of 3073-byte records"),
        (0, "not a whole number"),
        (4 * CIFAR10_RECORD_BYTES, "larger than"),  # the bound set to 3 records below
    ],
)
def test_a_batch_file_of_the_wrong_size_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int, match: str
) -> None:
    _write_cifar(tmp_path)
    monkeypatch.setattr(datasets, "CIFAR10_MAX_RECORDS", 3)
    (tmp_path / "data_batch_3.bin").write_bytes(bytes(size))
    with pytest.raises(DataError, match=match) as err:
        load_dataset("cifar10", str(tmp_path))
    assert "data_batch_3.bin" in str(err.value) and CIFAR10_URL in str(err.value)


def test_a_label_out_of_range_is_refused(tmp_path: Path) -> None:
    _write_cifar(tmp_path)
    rec, _ = _record(10, 0)
    (tmp_path / "test_batch.bin").write_bytes(_record(1, 1)[0] + rec)
    with pytest.raises(DataError, match="record 1 has label 10"):
        load_dataset("cifar10", str(tmp_path), split="test")


def test_missing_files_say_where_to_get_the_binary_version(tmp_path: Path) -> None:
    _write_cifar(tmp_path)
    (tmp_path / "data_batch_5.bin").unlink()
    with pytest.raises(DataError) as err:
        load_dataset("cifar10", str(tmp_path))
    msg = str(err.value)
    assert "missing data_batch_5.bin" in msg and CIFAR10_URL in msg and "data.path" in msg
    assert "python version" not in msg
    with pytest.raises(DataError, match=r"needs data\.path"):
        load_dataset("cifar10", "")
    pickled = tmp_path / "py"
    pickled.mkdir()
    (pickled / "data_batch_1").write_bytes(b"\x80\x04")  # never opened
    with pytest.raises(DataError, match=r"python version .* never reads") as err:
        load_dataset("cifar10", str(pickled))
    assert CIFAR10_URL in str(err.value)


# --- the gray view ------------------------------------------------------------------------


def test_the_gray_view_replicates_the_padded_gray_image_in_three_channels() -> None:
    images = synthetic_dataset(6, seed=3).images
    gray = to_model_input(images)
    assert torch.equal(gray, to_model_input(images, 1))
    # the 1-channel input is the formula it always was: x / 127.5 - 1, padded with -1
    want = torch.full((6, 1, 32, 32), -1.0)
    want[:, 0, 2:30, 2:30] = torch.from_numpy(images).float() / 127.5 - 1.0
    assert torch.equal(gray, want)
    view = to_model_input(images, 3)
    assert view.shape == (6, 3, 32, 32) and view.dtype == torch.float32 and view.is_contiguous()
    for c in range(3):
        assert torch.equal(view[:, c : c + 1], gray)
    # the quality metrics' 1-channel image of the view is the gray image exactly
    assert torch.equal(quality.one_channel(view), gray)
    assert quality.one_channel(gray) is gray
    grid = from_model_output(view)
    assert grid.shape == (6, 32, 32, 3) and np.array_equal(grid[..., 1], from_model_output(gray))
    with pytest.raises(DataError, match="1 or 3 channels"):
        to_model_input(images, 2)


def test_colour_sample_grids_are_rgb_pngs(tmp_path: Path) -> None:
    images = np.zeros((3, 4, 4, 3), dtype=np.uint8)
    images[1, :, :, 0] = 200  # the second image is red
    path = save_grid(images, tmp_path / "grid.png", pad=1)
    with Image.open(path) as im:
        assert im.mode == "RGB"
        pixels = np.asarray(im)
    # 2 x 2 grid of 4x4 images with a 1-pixel border, scaled 3x: image 1 is top right
    assert tuple(pixels[3 * 2, 3 * 6]) == (200, 0, 0)
    assert tuple(pixels[3 * 2, 3 * 2]) == (0, 0, 0)
    assert tuple(pixels[0, 0]) == (255, 255, 255)


def test_colour_images_are_not_written_to_an_image_folder(tmp_path: Path) -> None:
    data = ImageDataset(np.zeros((1, 32, 32, 3), np.uint8), np.zeros(1, np.int64), "c")
    with pytest.raises(DataError, match="grayscale"):
        write_image_folder(data, tmp_path, ["a"])
    with pytest.raises(DataError, match=r"\(N, H, W\) or \(N, H, W, 3\)"):
        ImageDataset(np.zeros((1, 32, 32, 2), np.uint8), np.zeros(1, np.int64), "bad")


# --- configuration and refusals -----------------------------------------------------------


def test_a_three_channel_preset_on_grayscale_data_names_the_key() -> None:
    cfg = tiny_config(model={"preset": "ddpm-cifar10"})
    with pytest.raises(ConfigError, match="takes 3-channel images") as err:
        check_trainable(cfg)
    assert "data.gray_to_rgb = true" in str(err.value) and "cifar10" in str(err.value)
    check_trainable(tiny_config(model={"preset": "ddpm-cifar10"}, data={"gray_to_rgb": True}))
    check_trainable(tiny_config())


def test_the_gray_view_of_a_one_channel_preset_is_refused() -> None:
    cfg = tiny_config(data={"gray_to_rgb": True})
    with pytest.raises(ConfigError, match="nothing to view"):
        check_trainable(cfg)


def test_cifar10_takes_a_three_channel_preset_and_no_gray_view() -> None:
    check_trainable(tiny_config(model={"preset": "ddpm-cifar10"}, data={"dataset": "cifar10"}))
    with pytest.raises(ConfigError, match="'cifar10' holds 3-channel colour images"):
        check_trainable(tiny_config(data={"dataset": "cifar10"}))
    with pytest.raises(ConfigError, match=r"data\.gray_to_rgb .* colour already"):
        tiny_config(
            model={"preset": "ddpm-cifar10"}, data={"dataset": "cifar10", "gray_to_rgb": True}
        )


def test_a_three_channel_one_shot_generator_stays_refused() -> None:
    cfg = tiny_config(model={"preset": "resnetg-cifar10-64"}, data={"gray_to_rgb": True})
    with pytest.raises(ConfigError, match="feature-matching loss"):
        check_trainable(cfg)


def test_quality_metrics_are_refused_on_cifar10(tmp_path: Path) -> None:
    from estuary.simulate import simulate

    cfg = tiny_config(model={"preset": "ddpm-cifar10"}, data={"dataset": "cifar10"},
                      eval={"every": 1})  # fmt: skip
    with pytest.raises(ConfigError, match=r"eval\.every = 0"):
        check_evaluable(cfg)
    with pytest.raises(ConfigError, match=r"mean nothing on data\.dataset = 'cifar10'"):
        simulate(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
    check_evaluable(tiny_config(model={"preset": "ddpm-cifar10"}, data={"gray_to_rgb": True}))


def test_the_key_left_at_its_default_keeps_the_digest() -> None:
    cfg = tiny_config()
    explicit = tiny_config(data={"gray_to_rgb": False})
    assert explicit.digest() == cfg.digest() and cfg.data.input_channels == 1
    on = tiny_config(model={"preset": "ddpm-cifar10"}, data={"gray_to_rgb": True})
    assert on.digest() != tiny_config(model={"preset": "ddpm-cifar10"}).digest()
    assert on.data.input_channels == 3 and on.data.channels == 1
    assert config_from_dict(on.to_dict()) == on


# --- down to what a device trains on --------------------------------------------------------


def _two_devices(**data: object) -> RunConfig:
    return tiny_config(
        federation={"num_devices": 2, "num_edges": 1},
        data={"synthetic_size": 12, **data},
        model={"preset": "ddpm-cifar10"},
        train={"local_steps": 1, "batch_size": 2},
    )


@pytest.mark.parametrize("source", ["gray view", "cifar10"])
def test_devices_train_ddpm_cifar10_on_three_channel_tensors(tmp_path: Path, source: str) -> None:
    """The devices of an in-process federation hold ``(N, 3, 32, 32)`` tensors of their own
    share of the images, and one real local FedAvg step of ddpm-cifar10 runs on them."""
    from estuary.simulate import build_federation
    from shared.data.partition import split_dataset
    from shared.methods.base import DeviceContext, build_algorithm
    from shared.transport.bus import MemoryBus

    if source == "cifar10":
        _write_cifar(tmp_path, per_file=3)
        cfg = _two_devices(dataset="cifar10", path=str(tmp_path))
    else:
        cfg = _two_devices(gray_to_rgb=True)
    data, parts = split_dataset(cfg)
    fed = build_federation(cfg, MemoryBus(), data, parts)
    for device, part in zip(fed.devices, parts, strict=True):
        x = device.data
        assert x.shape == (len(part), 3, 32, 32) and x.dtype == torch.float32
        if source == "cifar10":
            assert torch.equal(x, torch.from_numpy(data.images[part]).permute(0, 3, 1, 2)
                               .float().div(127.5).sub(1.0))  # fmt: skip
        else:
            gray = to_model_input(data.images[part])
            assert all(torch.equal(x[:, c : c + 1], gray) for c in range(3))
        assert torch.equal(device.labels, torch.from_numpy(data.labels[part]))
    device = fed.devices[0]
    ctx = DeviceContext(device.name, device.data, device.labels, torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in device.model.state_dict().items()}
    result = build_algorithm(cfg).device_round(ctx, device.model, 0, upload=True)
    assert result.train.steps == 1 and np.isfinite(result.train.mean_loss)
    assert result.tensors is not None
    assert any(not torch.equal(result.tensors[k], before[k]) for k in before)


def test_a_gray_view_model_is_scored_and_drawn(tmp_path: Path) -> None:
    """The evaluator scores a 3-channel model's samples in one channel against 1-channel
    real images, and draws its sample grid in colour."""
    from shared.evaluation.evaluator import Evaluator, reference_images, write_grid
    from shared.models.presets import build_unet

    cfg = tiny_config(
        model={"preset": "ddpm-cifar10"},
        data={"gray_to_rgb": True, "synthetic_size": 64},
        eval={"every": 1, "num_samples": 10, "num_reference": 10, "sample_steps": 1,
              "grid_size": 4},
    )  # fmt: skip
    assert reference_images(cfg).shape == (10, 1, 32, 32)
    model = build_unet("ddpm-cifar10", seed=0).eval()
    scores = Evaluator(cfg).evaluate(model)
    assert np.isfinite(scores["fid"]) and scores["sample_steps"] == 1
    with Image.open(write_grid(cfg, model, tmp_path / "grid.png")) as im:
        assert im.mode == "RGB"
