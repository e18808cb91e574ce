"""Datasets: Fashion-MNIST from IDX files, a device's own image folder, a small synthetic
set for unit tests, and CIFAR-10 from its binary version.

Grayscale images are returned as ``uint8`` arrays ``(N, 28, 28)``, colour images (CIFAR-10) as
``uint8`` ``(N, 32, 32, 3)`` (channels last, R, G, B), plus ``int64`` labels;
``to_model_input`` turns them into float tensors ``(N, C, 32, 32)`` in [-1, 1], grayscale
images padded to 32x32 so U-Nets can downsample three times, and viewed in 3 identical
channels for a 3-channel model (``data.gray_to_rgb``).

Search order for Fashion-MNIST (first directory holding all four files wins):
an explicit path, ``$ESTUARY_FMNIST_DIR``, ``/usr/share/datasets/fashion-mnist`` (Debian's
``dataset-fashion-mnist``), then ``~/.cache/estuary/fashion-mnist`` (downloaded into when a
network exists and ``download=True``).

An image folder (``data.dataset = "folder"``, :func:`load_image_folder`) is a device's own data
(``data.local_dir``) or one dataset split across the devices (``data.path``):
``DIR/<class>/<image files>``, each image converted to 8-bit grayscale, centre-cropped to
a square and resized to 28x28, the format of the other datasets.

CIFAR-10 (``data.dataset = "cifar10"``, :func:`load_cifar10`) is read from the directory
``data.path`` holding its *binary* version (``data_batch_1.bin`` ... ``data_batch_5.bin``,
``test_batch.bin``; :data:`CIFAR10_URL`), never from the python version, whose batches are
pickles (unpickling a file can run code).
"""

from __future__ import annotations

import logging
import math
import os
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from shared.data.images import (
    FASHION_MNIST_CLASSES,
    IMAGE_SUFFIXES,
    MAX_IDX_BYTES,
    NUM_CLASSES,
    UNREADABLE,
    class_folders,
    class_slug,
    list_image_folder,
    read_idx,
    read_image,
)
from shared.errors import DataError
from shared.progress import progress_bar

log = logging.getLogger(__name__)

ENV_DIR = "ESTUARY_FMNIST_DIR"
SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
CACHE_DIR = Path.home() / ".cache" / "estuary" / "fashion-mnist"
MIRROR = "https://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
CLASSES = FASHION_MNIST_CLASSES
IMAGE_SIZE = 32  # model resolution (28x28 padded by 2 on each side)

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
#: the directory the archive extracts to
CIFAR10_ARCHIVE_DIR = "cifar-10-batches-bin"
CIFAR10_FILES = {
    "train": tuple(f"data_batch_{i}.bin" for i in range(1, 6)),
    "test": ("test_batch.bin",),
}
CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip
CIFAR10_SIZE = 32
#: one record: a label byte, then the R, G and B planes of a 32x32 image (row-major each)
CIFAR10_RECORD_BYTES = 1 + 3 * CIFAR10_SIZE * CIFAR10_SIZE
#: records in one batch file of the official archive; a file may hold fewer, never more
CIFAR10_MAX_RECORDS = 10_000


def histogram_problem(counts: Sequence[int], n_samples: int | None = None) -> str:
    """Why ``counts`` is not a label histogram (``NUM_CLASSES`` counts, summing to
    ``n_samples`` when that is given), or ``""`` when it is one. Messages already bound
    each count to ``[0, shared.wire.messages.MAX_COUNT]``."""
    if len(counts) != NUM_CLASSES:
        return f"{len(counts)} label counts, expected {NUM_CLASSES}"
    if n_samples is not None and sum(counts) != n_samples:
        return f"label counts sum to {sum(counts)}, not n_samples={n_samples}"
    return ""


@dataclass(frozen=True)
class ImageDataset:
    """Images and labels ``(N,)`` int64, held in memory: grayscale images uint8
    ``(N, H, W)``, colour images uint8 ``(N, H, W, 3)`` (channels last, R, G, B)."""

    images: np.ndarray
    labels: np.ndarray
    name: str
    #: files of an image folder that were not readable images (skipped when it was read)
    skipped: int = 0

    def __post_init__(self) -> None:
        colour = self.images.ndim == 4 and self.images.shape[-1] == 3
        if not (self.images.ndim == 3 or colour) or self.images.dtype != np.uint8:
            raise DataError(
                f"{self.name}: images must be uint8 (N, H, W) or (N, H, W, 3), got "
                f"{self.images.dtype} {self.images.shape}"
            )
        if self.labels.shape != (self.images.shape[0],):
            raise DataError(f"{self.name}: {len(self.labels)} labels for {len(self.images)} images")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def channels(self) -> int:
        """1 for grayscale images, 3 for colour ones."""
        return 1 if self.images.ndim == 3 else int(self.images.shape[-1])

    def subset(self, indices: np.ndarray) -> ImageDataset:
        """A new dataset holding ``indices`` (copied)."""
        return ImageDataset(self.images[indices], self.labels[indices], self.name, self.skipped)


def _candidate_dirs(path: str | Path | None) -> list[Path]:
    dirs = []
    if path:
        dirs.append(Path(path))
    if os.environ.get(ENV_DIR):
        dirs.append(Path(os.environ[ENV_DIR]))
    dirs += [SYSTEM_DIR, CACHE_DIR]
    return dirs


def _download(dest: Path, timeout_s: float = 20.0) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in FILES["train"] + FILES["test"]:
        target = dest / name
        if target.exists():
            continue
        tmp = target.with_suffix(".part")
        with urllib.request.urlopen(MIRROR + name, timeout=timeout_s) as resp:
            tmp.write_bytes(resp.read(MAX_IDX_BYTES))
        tmp.replace(target)


def find_fashion_mnist(path: str | Path | None = None, *, download: bool = False) -> Path:
    """Return the first directory holding all four Fashion-MNIST IDX files."""
    needed = FILES["train"] + FILES["test"]
    tried = _candidate_dirs(path)
    for d in tried:
        if all((d / f).is_file() for f in needed):
            return d
    if download:
        try:
            _download(CACHE_DIR)
            return CACHE_DIR
        except OSError as err:
            log.warning("download of Fashion-MNIST failed: %s", err)
    raise DataError(
        "Fashion-MNIST not found. Looked in: "
        + ", ".join(str(d) for d in tried)
        + ". Install it with `apt-get install dataset-fashion-mnist`, or set "
        f"{ENV_DIR}=/dir/with/the/4/idx.gz/files, or pass data.path in the config."
    )


def load_fashion_mnist(
    split: str = "train", path: str | Path | None = None, *, download: bool = False
) -> ImageDataset:
    """Load the ``train`` (60k) or ``test`` (10k) split as uint8 images and int64 labels."""
    if split not in FILES:
        raise DataError(f"unknown split {split!r}; use 'train' or 'test'")
    root = find_fashion_mnist(path, download=download)
    img_file, lbl_file = FILES[split]
    images = read_idx(root / img_file, 3)
    labels = read_idx(root / lbl_file, 1).astype(np.int64)
    if labels.max(initial=0) >= NUM_CLASSES:
        raise DataError(f"{root / lbl_file}: label {labels.max()} out of range")
    return ImageDataset(images, labels, f"fashion-mnist/{split}")


def _cifar10_missing(root: Path, missing: Sequence[str]) -> DataError:
    """The error for a CIFAR-10 directory without the binary batch files ``missing``."""
    pickled = (root / "data_batch_1").is_file() or (root / "cifar-10-batches-py").is_dir()
    return DataError(
        f"CIFAR-10 not found in data.path = {str(root)!r}: missing {', '.join(missing)}. "
        + (
            "That directory holds the python version (pickled batches), which Estuary never "
            "reads (unpickling a file can run code). "
            if pickled
            else ""
        )
        + f"Download the binary version, {CIFAR10_URL}, extract it (tar xzf "
        f"cifar-10-binary.tar.gz makes {CIFAR10_ARCHIVE_DIR}/ with data_batch_1.bin ... "
        "data_batch_5.bin and test_batch.bin) and set data.path to that directory."
    )


def find_cifar10(path: str | Path) -> Path:
    """The directory holding CIFAR-10's binary batch files: ``path`` itself, or the
    ``cifar-10-batches-bin`` directory in it (where the archive extracts to)."""
    if isinstance(path, str) and not path:
        raise DataError(
            "data.dataset = 'cifar10' needs data.path: the directory of CIFAR-10's binary "
            f"version ({CIFAR10_URL}, extracted: {CIFAR10_ARCHIVE_DIR}/)"
        )
    root = Path(path)
    needed = CIFAR10_FILES["train"] + CIFAR10_FILES["test"]
    for d in (root, root / CIFAR10_ARCHIVE_DIR):
        if all((d / f).is_file() for f in needed):
            return d
    raise _cifar10_missing(root, [f for f in needed if not (root / f).is_file()])


def read_cifar10_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 binary batch file: images uint8 ``(N, 32, 32, 3)`` (the file's R, G, B
    planes moved channels last) and labels int64 ``(N,)``. The file must be a whole number
    of 3,073-byte records, at most :data:`CIFAR10_MAX_RECORDS` of them, with labels 0-9."""
    limit = CIFAR10_MAX_RECORDS * CIFAR10_RECORD_BYTES
    try:
        with path.open("rb") as fh:
            raw = fh.read(limit + 1)
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror or err}") from None
    if len(raw) > limit:
        raise DataError(
            f"{path} is larger than {limit} bytes ({CIFAR10_MAX_RECORDS} records): not a "
            f"CIFAR-10 binary batch file (get them from {CIFAR10_URL})"
        )
    if not raw or len(raw) % CIFAR10_RECORD_BYTES:
        raise DataError(
            f"{path} holds {len(raw)} bytes, not a whole number of {CIFAR10_RECORD_BYTES}-byte "
            f"records (a label byte and 32x32x3 pixels): truncated or not CIFAR-10's binary "
            f"version (get it from {CIFAR10_URL})"
        )
    records = np.frombuffer(raw, dtype=np.uint8).reshape(-1, CIFAR10_RECORD_BYTES)
    labels = records[:, 0].astype(np.int64)
    if labels.max(initial=0) >= NUM_CLASSES:
        bad = int(np.argmax(labels >= NUM_CLASSES))
        raise DataError(f"{path}: record {bad} has label {labels[bad]}, not 0-9")
    planes = records[:, 1:].reshape(-1, 3, CIFAR10_SIZE, CIFAR10_SIZE)
    return np.ascontiguousarray(planes.transpose(0, 2, 3, 1)), labels


def load_cifar10(split: str = "train", path: str | Path = "") -> ImageDataset:
    """CIFAR-10's ``train`` (``data_batch_1.bin`` ... ``data_batch_5.bin``, 50k) or ``test``
    (``test_batch.bin``, 10k) split from the binary version in ``path``
    (:func:`find_cifar10`), as colour images ``(N, 32, 32, 3)``; labels index
    :data:`CIFAR10_CLASSES`."""
    if split not in CIFAR10_FILES:
        raise DataError(f"unknown split {split!r}; use 'train' or 'test'")
    root = find_cifar10(path)
    batches = [read_cifar10_batch(root / name) for name in CIFAR10_FILES[split]]
    images = np.concatenate([b[0] for b in batches])
    labels = np.concatenate([b[1] for b in batches])
    return ImageDataset(images, labels, f"cifar10/{split}")


def synthetic_dataset(
    n: int = 512, *, seed: int = 0, num_classes: int = NUM_CLASSES
) -> ImageDataset:
    """Tiny, learnable stand-in for Fashion-MNIST: one blurred shape per class plus noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, size=n).astype(np.int64)
    yy, xx = np.mgrid[0:28, 0:28].astype(np.float32)
    protos = []
    for c in range(num_classes):
        angle = 2 * np.pi * c / num_classes
        cy, cx = 14 + 7 * np.sin(angle), 14 + 7 * np.cos(angle)
        protos.append(np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * (2 + c % 3) ** 2)))
    base = np.stack(protos)[labels] * 230
    noisy = base + rng.normal(0, 12, size=base.shape)
    return ImageDataset(np.clip(noisy, 0, 255).astype(np.uint8), labels, "synthetic")


def load_dataset(
    name: str,
    path: str = "",
    *,
    split: str = "train",
    size: int = 512,
    seed: int = 0,
    class_names: Sequence[str] = (),
) -> ImageDataset:
    """Dataset by config name: ``fashion-mnist``, ``synthetic``, ``cifar10`` (the binary
    version in ``path``, :func:`load_cifar10`), or ``folder`` with a ``path``, one image
    folder holding the whole dataset (:func:`load_image_folder`; it has no splits). Without a
    path, image folders are the devices' own data (see
    :func:`shared.data.partition.split_dataset`)."""
    if name == "folder":
        if not path:
            raise DataError(
                "data.dataset = 'folder' without data.path is the devices' own image folders, "
                "not one dataset: read them with shared.data.partition.split_dataset"
            )
        return load_image_folder(path, class_names=class_names)
    if name == "fashion-mnist":
        return load_fashion_mnist(split, path or None, download=True)
    if name == "synthetic":
        return synthetic_dataset(size, seed=seed + (0 if split == "train" else 1))
    if name == "cifar10":
        return load_cifar10(split, path)
    raise DataError(f"unknown dataset {name!r}")


def load_image_folder(
    root: str | Path,
    *,
    class_names: Sequence[str] = (),
    max_images: int = 0,
    seed: int = 0,
    progress: bool = True,
) -> ImageDataset:
    """A process's own images: ``root/<class>/...`` (any depth below the class folder; see
    :func:`class_folders` for the names), in name order. ``max_images`` > 0 keeps that many,
    drawn with ``seed`` (before any file is decoded). A file that cannot be read as an image
    is skipped and reported; a folder with no readable image is an error."""
    root = Path(root)
    files = list_image_folder(root, class_folders(class_names))
    if max_images and len(files) > max_images:
        keep = np.sort(np.random.default_rng(seed).permutation(len(files))[:max_images])
        files = [files[i] for i in keep]
    images: list[np.ndarray] = []
    labels: list[int] = []
    skipped: list[str] = []
    bar = progress_bar(
        files, desc=f"reading {root}", unit="img", mininterval=2.0,
        disable=not progress or len(files) < 5000,
    )  # fmt: skip
    for path, label in bar:
        try:
            images.append(read_image(path))
        except UNREADABLE as err:
            skipped.append(f"{path}: {err}")
            continue
        labels.append(int(label or 0))  # class folders only: every file has its label
    if skipped:
        log.warning(
            "%s: skipped %d of %d files that are not readable images (first: %s)",
            root, len(skipped), len(files), "; ".join(skipped[:3]),
        )  # fmt: skip
    if not images:
        raise DataError(
            f"no readable images in {root}: expected {root}/<class>/<image files> "
            f"({', '.join(IMAGE_SUFFIXES)})"
            + (f"; {len(skipped)} files failed, first: {skipped[0]}" if skipped else "")
        )
    return ImageDataset(
        np.stack(images), np.asarray(labels, dtype=np.int64), f"folder:{root}", len(skipped)
    )


def write_image_folder(data: ImageDataset, root: str | Path, names: Sequence[str]) -> int:
    """Write ``data`` as ``root/<class slug>/<name>.png`` (one name per image, in order), the
    layout :func:`load_image_folder` reads back unchanged when the names sort in that order.
    Returns the number of files written."""
    if len(names) != len(data):
        raise DataError(f"{len(names)} names for {len(data)} images")
    if data.channels != 1:
        raise DataError(
            f"{data.name}: image folders hold grayscale images (they are read back as 8-bit "
            "luminance); colour images are not written to one"
        )
    root = Path(root)
    slugs = [class_slug(c) for c in CLASSES]
    for image, label, name in zip(data.images, data.labels, names, strict=True):
        folder = root / slugs[int(label)]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image, mode="L").save(folder / f"{name}.png")
    return len(data)


def to_model_input(images: np.ndarray, channels: int = 1) -> torch.Tensor:
    """uint8 images -> float32 ``(N, channels, 32, 32)`` in [-1, 1] (zero pixels map to -1).

    Grayscale ``(N, 28, 28)`` images are padded with -1 to 32x32; with ``channels = 3`` each
    is then replicated into 3 identical channels (``data.gray_to_rgb``: the gray view a
    3-channel model trains on). Colour ``(N, 32, 32, 3)`` images (CIFAR-10) move their
    channels first, unpadded, and need ``channels = 3``. Callers pass the configured
    ``data.input_channels``."""
    if channels not in (1, 3):
        raise DataError(f"model input has 1 or 3 channels, not {channels}")
    colour = images.ndim == 4
    if colour and images.shape[-1] != channels:
        raise DataError(
            f"images with {images.shape[-1]} channels cannot be {channels}-channel model input "
            "(no conversion of colour images to grayscale is defined)"
        )
    x = torch.from_numpy(np.ascontiguousarray(images)).float().div_(127.5).sub_(1.0)
    if colour:
        x = x.permute(0, 3, 1, 2)
    pad = (IMAGE_SIZE - x.shape[-1]) // 2
    if pad > 0:
        x = torch.nn.functional.pad(x, (pad, pad, pad, pad), value=-1.0)
    if colour:
        return x.contiguous()
    x = x.unsqueeze(1)
    return x if channels == 1 else x.expand(-1, channels, -1, -1).contiguous()


def from_model_output(x: torch.Tensor) -> np.ndarray:
    """float ``(N, 1, H, W)`` in [-1, 1] -> uint8 ``(N, H, W)``; ``(N, 3, H, W)`` -> uint8
    ``(N, H, W, 3)`` (colour images, channels last, as :class:`ImageDataset` holds them)."""
    y = ((x.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    if y.shape[1] == 1:
        return y[:, 0].cpu().numpy()
    if y.shape[1] != 3:
        raise DataError(f"model output has 1 or 3 channels, got {tuple(y.shape)}")
    return y.permute(0, 2, 3, 1).contiguous().cpu().numpy()


def save_grid(images: np.ndarray, path: Path, *, pad: int = 2, cols: int | None = None) -> Path:
    """Tile uint8 images, grayscale ``(N, H, W)`` or colour ``(N, H, W, 3)``, into a
    grid PNG (RGB for colour images): ``cols`` images a row, square-ish by default."""
    n, h, w = images.shape[:3]
    cols = cols or math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    shape = (rows * (h + pad) + pad, cols * (w + pad) + pad, *images.shape[3:])
    canvas = np.full(shape, 255, dtype=np.uint8)
    for i, img in enumerate(images):
        r, c = divmod(i, cols)
        y, x = pad + r * (h + pad), pad + c * (w + pad)
        canvas[y : y + h, x : x + w] = img
    path.parent.mkdir(parents=True, exist_ok=True)
    big = Image.fromarray(canvas).resize(
        (canvas.shape[1] * 3, canvas.shape[0] * 3), Image.Resampling.NEAREST
    )
    big.save(path)
    return path
