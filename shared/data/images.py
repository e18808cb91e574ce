"""Images from files without torch: Fashion-MNIST's IDX files, image files and image
folders, decoded to uint8 arrays with numpy and Pillow only.

Both the training data (:mod:`shared.data.datasets`, which adds torch's tensors) and a device
that only classifies with a deployed model (:mod:`shared.deploy.onnx_classifier`, no torch
installed) read images here, so a folder gives the same pixels to both: each file as 8-bit
luminance, centre-cropped to a square and box-resized to 28x28.

An image folder is ``DIR/<class>/...`` (any depth below a class folder), each class folder
named as :func:`class_folders` says; read in name order (file name, then path). A flat folder
of image files (no labels) is read where :func:`list_image_folder` allows it.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import numpy as np
from PIL import Image

from shared.errors import DataError

NUM_CLASSES = 10
#: Fashion-MNIST's class names, in label order
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
#: the side of a stored grayscale image (models pad it to 32)
STORED_SIZE = 28
MAX_IDX_BYTES = 200 * 2**20
#: image files an image folder may hold (28x28 bytes each in memory: 784 MB at the limit)
MAX_FOLDER_IMAGES = 1_000_000
#: largest image file read from an image folder
MAX_IMAGE_FILE_BYTES = 64 * 2**20
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".pgm")
#: what :func:`read_image` may raise for a file that is not a readable image
UNREADABLE = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


def read_idx(path: Path, expect_dims: int) -> np.ndarray:
    """One IDX file of unsigned bytes (gzipped or plain): magic, dims, big-endian sizes, the
    raw uint8 data."""
    try:
        with path.open("rb") as fh:
            gz = fh.read(2) == b"\x1f\x8b"
        with gzip.open(path, "rb") if gz else path.open("rb") as fh:
            raw = fh.read(MAX_IDX_BYTES + 1)
    except (OSError, EOFError) as err:
        raise DataError(f"cannot read {path}: {err}") from None
    if len(raw) > MAX_IDX_BYTES:
        raise DataError(f"{path} is larger than {MAX_IDX_BYTES} bytes; not an IDX file?")
    if len(raw) < 4 or raw[:3] != b"\x00\x00\x08":
        raise DataError(f"{path} is not an unsigned-byte IDX file (bad magic)")
    ndim = raw[3]
    if ndim != expect_dims or len(raw) < 4 + 4 * ndim:
        raise DataError(f"{path}: expected {expect_dims} dimensions, file says {ndim}")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != math.prod(shape):
        raise DataError(f"{path}: header says {shape} but holds {data.size} bytes")
    return data.reshape(shape).copy()


def class_slug(name: str) -> str:
    """A class name as a folder name: lower case, runs of other characters as one ``-``
    (``"T-shirt/top"`` -> ``"t-shirt-top"``)."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def class_folders(class_names: Sequence[str] = ()) -> dict[str, int]:
    """Folder name -> label of an image folder. With ``class_names`` (at most
    ``NUM_CLASSES``), exactly those names, in label order; without, the digits ``0``-``9`` and
    Fashion-MNIST's class names as :func:`class_slug` writes them (``t-shirt-top``, ...,
    ``ankle-boot``)."""
    if class_names:
        if len(class_names) > NUM_CLASSES:
            raise DataError(f"{len(class_names)} class names; at most {NUM_CLASSES}")
        return {name: label for label, name in enumerate(class_names)}
    folders = {str(label): label for label in range(NUM_CLASSES)}
    folders.update({class_slug(name): label for label, name in enumerate(FASHION_MNIST_CLASSES)})
    return folders


def is_image_file(path: Path) -> bool:
    """Whether ``path`` names an image file an image folder holds (not a hidden one)."""
    return not path.name.startswith(".") and path.suffix.lower() in IMAGE_SUFFIXES


def read_image(path: Path) -> np.ndarray:
    """One image file as uint8 ``(STORED_SIZE, STORED_SIZE)`` grayscale: converted to 8-bit
    luminance, centre-cropped to a square, resized (an image of that size already in 8-bit
    grayscale is read unchanged). Raises one of :data:`UNREADABLE` for a file that is not a
    readable image."""
    size = path.stat().st_size
    if size > MAX_IMAGE_FILE_BYTES:
        raise ValueError(f"{size} bytes, more than {MAX_IMAGE_FILE_BYTES}")
    with Image.open(path) as im:
        im.draft("L", (STORED_SIZE, STORED_SIZE))  # JPEG: decode at a reduced size
        if im.mode in ("I", "F") or im.mode.startswith("I;16"):
            # 16-bit (and 32-bit) grayscale: Pillow's convert("L") would clip at 255
            a = np.asarray(im, dtype=np.float64)
            a = a * 255.0 if im.mode == "F" and a.max(initial=0.0) <= 1.0 else a
            a = a / 257.0 if im.mode != "F" else a  # 0..65535 -> 0..255
            gray = Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8), mode="L")
        else:
            gray = im.convert("L")
    w, h = gray.size
    side = min(w, h)
    if (w, h) != (side, side):
        left, top = (w - side) // 2, (h - side) // 2
        gray = gray.crop((left, top, left + side, top + side))
    if side != STORED_SIZE:
        gray = gray.resize((STORED_SIZE, STORED_SIZE), Image.Resampling.BOX)
    return np.asarray(gray, dtype=np.uint8)


def list_image_folder(
    root: Path, folders: dict[str, int], *, flat: bool = False
) -> list[tuple[Path, int | None]]:
    """Every image file under ``root``'s class folders with its label, in name order (file
    name, then path), bounded by ``MAX_FOLDER_IMAGES``; with ``flat``, a folder of image
    files alone is read too (labels None). An image file beside class folders, or a folder
    that is not a class, is an error."""
    if not root.is_dir():
        raise DataError(f"image folder {root} does not exist (or is not a directory)")

    def unlistable(err: OSError) -> NoReturn:  # os.walk would skip it without a word
        raise DataError(f"cannot list {err.filename}: {err.strerror}")

    try:
        entries = sorted(e for e in root.iterdir() if not e.name.startswith("."))
    except OSError as err:
        unlistable(err)
    loose = [e for e in entries if e.is_file() and is_image_file(e)]
    dirs = [e for e in entries if e.is_dir()]
    if loose and (dirs or not flat):
        raise DataError(
            f"{loose[0]} is not in a class folder: put each image in {root}/<class>/, "
            f"<class> one of {sorted(folders, key=folders.__getitem__)}"
        )
    if loose:
        return [(p, None) for p in loose[: MAX_FOLDER_IMAGES + 1]]
    found: list[tuple[str, str, Path, int | None]] = []
    for entry in dirs:
        if entry.name not in folders:
            raise DataError(
                f"{entry}: {entry.name!r} is not a class; class folders are named "
                f"{sorted(folders, key=folders.__getitem__)} (set data.class_names to name "
                "your own classes)"
            )
        label = folders[entry.name]
        # os.walk does not follow links to directories (no cycles)
        for dirpath, dirnames, filenames in os.walk(entry, onerror=unlistable):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in filenames:
                path = Path(dirpath) / name
                if not is_image_file(path):
                    continue
                found.append((name, str(path.relative_to(root)), path, label))
                if len(found) > MAX_FOLDER_IMAGES:
                    raise DataError(
                        f"{root} holds more than {MAX_FOLDER_IMAGES} images; set "
                        "data.max_samples_per_device to train on a sample of them"
                    )
    found.sort(key=lambda f: (f[0], f[1]))
    return [(path, label) for _, _, path, label in found]
