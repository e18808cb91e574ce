"""On-device classification without torch: a device's own exported classifier in ONNX
Runtime, plus the readers that turn images into its input.

An export directory (:func:`shared.deploy.classifier_export.export_classifier`) holds
``model.onnx`` and ``card.json`` (``kind = "classifier"``, the sha256 of the ONNX bytes).
:class:`OnnxClassifier` refuses a card of another kind and a model whose bytes do not match
the card's hash. The model is the device's own fine-tuned classifier (pFedGPA), made and
exported on the device, so it carries no signature: the card's hash guards against a
damaged or swapped file, not against someone who can rewrite both files. A classifier the
cloud deploys (FedDEO's) is signed instead: the device verifies its manifest
(:mod:`shared.deploy.signing`) and loads the checked bytes with
:meth:`OnnxClassifier.from_bytes`.

Inputs are prepared the way training prepares them (:mod:`shared.data.datasets`, which
imports torch and is therefore not imported here): 8-bit grayscale 28x28 images, padded by
two pixels to 32x32 and mapped to ``x / 127.5 - 1`` in float32. :func:`read_image_folder`
decodes files exactly as ``load_image_folder`` does (8-bit luminance, centre crop to a
square, box-resized to 28x28), so an image folder written by ``write_image_folder`` gives
the pixels the device trained on; :func:`read_fashion_mnist_test` parses the gzipped IDX
test split with numpy. Only numpy, onnxruntime and (for image files) Pillow are imported.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.deploy.onnx_sampler import make_session
from shared.errors import DataError, EstuaryError

#: the card's ``kind`` of a classifier export, and its format tag
CLASSIFIER_KIND = "classifier"
CARD_FORMAT = "estuary-classifier-v1"
MODEL_FILE = "model.onnx"
CARD_FILE = "card.json"
#: ONNX input and output names
INPUT_NAME = "images"
OUTPUT_NAME = "logits"
#: model input (C, H, W), and the side of the stored images before padding
IMAGE_SHAPE = (1, 32, 32)
STORED_SIZE = 28
MAX_CARD_BYTES = 256 * 1024
MAX_MODEL_BYTES = 512 * 2**20
MAX_IDX_BYTES = 200 * 2**20
MAX_IMAGE_FILE_BYTES = 64 * 2**20
MAX_FOLDER_IMAGES = 1_000_000
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".pgm")
#: Fashion-MNIST's class names (label order) and its test split's files
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
FASHION_MNIST_TEST = ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
FASHION_MNIST_DIRS = (
    Path("/usr/share/datasets/fashion-mnist"),
    Path.home() / ".cache" / "estuary" / "fashion-mnist",
)
FASHION_MNIST_ENV = "ESTUARY_FMNIST_DIR"


# ---------------------------------------------------------------------------- inputs


def model_input(images: np.ndarray) -> np.ndarray:
    """Images as the classifier's float32 input (N, 1, 32, 32) in [-1, 1].

    uint8 (N, H, W) with H = W <= 32 (Fashion-MNIST's 28x28) become ``x / 127.5 - 1``,
    padded with -1 to 32x32, the float32 arithmetic of ``shared.data.datasets.to_model_input``;
    float (N, 1, 32, 32) or (N, 32, 32) is taken as already prepared.
    """
    x = np.asarray(images)
    if x.dtype == np.uint8:
        if x.ndim != 3 or x.shape[1] != x.shape[2] or x.shape[1] > IMAGE_SHAPE[1]:
            raise DataError(f"uint8 images must be (N, H, W) with H = W <= 32, got {x.shape}")
        y = x.astype(np.float32) / np.float32(127.5) - np.float32(1.0)
        pad = (IMAGE_SHAPE[1] - x.shape[1]) // 2
        if pad > 0:
            y = np.pad(y, ((0, 0), (pad, pad), (pad, pad)), constant_values=np.float32(-1.0))
        return np.ascontiguousarray(y[:, None])
    if x.dtype.kind != "f":
        raise DataError(f"images must be uint8 pixels or floats in [-1, 1], got {x.dtype}")
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4 or tuple(x.shape[1:]) != IMAGE_SHAPE:
        raise DataError(f"float images must be (N, 1, 32, 32), got {x.shape}")
    return np.ascontiguousarray(x, dtype=np.float32)


def _read_idx(path: Path, expect_dims: int) -> np.ndarray:
    """One IDX file of unsigned bytes (gzipped or plain), as ``shared.data.datasets`` reads it."""
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
    if raw[3] != expect_dims or len(raw) < 4 + 4 * expect_dims:
        raise DataError(f"{path}: expected {expect_dims} dimensions, file says {raw[3]}")
    shape = struct.unpack(f">{expect_dims}I", raw[4 : 4 + 4 * expect_dims])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * expect_dims)
    if data.size != math.prod(shape):
        raise DataError(f"{path}: header says {shape} but holds {data.size} bytes")
    return data.reshape(shape).copy()


def find_fashion_mnist_test(path: str | Path | None = None) -> Path:
    """The first directory holding Fashion-MNIST's two test files: ``path``, then
    ``$ESTUARY_FMNIST_DIR``, Debian's ``/usr/share/datasets/fashion-mnist``, then
    ``~/.cache/estuary/fashion-mnist`` (nothing is downloaded)."""
    tried = [Path(path)] if path else []
    if os.environ.get(FASHION_MNIST_ENV):
        tried.append(Path(os.environ[FASHION_MNIST_ENV]))
    tried += FASHION_MNIST_DIRS if not path else []
    for d in tried:
        if all((d / f).is_file() for f in FASHION_MNIST_TEST):
            return d
    raise DataError(
        f"Fashion-MNIST's test split ({' and '.join(FASHION_MNIST_TEST)}) not found in "
        f"{', '.join(str(d) for d in tried)}; pass its directory, set {FASHION_MNIST_ENV}, or "
        "apt-get install dataset-fashion-mnist"
    )


def read_fashion_mnist_test(path: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST's test split: uint8 images (N, 28, 28) and int64 labels (N,)."""
    root = find_fashion_mnist_test(path)
    images = _read_idx(root / FASHION_MNIST_TEST[0], 3)
    labels = _read_idx(root / FASHION_MNIST_TEST[1], 1).astype(np.int64)
    if len(images) != len(labels):
        raise DataError(f"{root}: {len(images)} test images but {len(labels)} labels")
    return images, labels


def class_slug(name: str) -> str:
    """A class name as a folder name, as ``shared.data.datasets.class_slug`` writes it."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def class_folders(class_names: Sequence[str] = ()) -> dict[str, int]:
    """Folder name -> label: ``class_names`` in label order, or else the digits and
    Fashion-MNIST's class slugs (the names ``shared.data.datasets.class_folders`` accepts)."""
    if class_names:
        return {name: label for label, name in enumerate(class_names)}
    folders = {str(label): label for label in range(len(FASHION_MNIST_CLASSES))}
    folders.update({class_slug(n): label for label, n in enumerate(FASHION_MNIST_CLASSES)})
    return folders


def read_image(path: Path) -> np.ndarray:
    """One image file as uint8 (28, 28) grayscale, decoded as training decodes it
    (``shared.data.datasets._read_image``): 8-bit luminance, centre crop to a square, box
    resize."""
    from PIL import Image

    size = path.stat().st_size
    if size > MAX_IMAGE_FILE_BYTES:
        raise ValueError(f"{size} bytes, more than {MAX_IMAGE_FILE_BYTES}")
    with Image.open(path) as im:
        im.draft("L", (STORED_SIZE, STORED_SIZE))
        if im.mode in ("I", "F") or im.mode.startswith("I;16"):
            a = np.asarray(im, dtype=np.float64)
            a = a * 255.0 if im.mode == "F" and a.max(initial=0.0) <= 1.0 else a
            a = a / 257.0 if im.mode != "F" else a
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


@dataclass(frozen=True)
class FolderImages:
    """Images read from a folder: uint8 (N, 28, 28), their labels (None for a flat folder),
    the files (relative to the folder) in the same order, and the unreadable files skipped."""

    images: np.ndarray
    labels: np.ndarray | None
    files: list[str]
    skipped: list[str] = field(default_factory=list)


def _is_image(path: Path) -> bool:
    return not path.name.startswith(".") and path.suffix.lower() in IMAGE_SUFFIXES


def _list_folder(root: Path, folders: dict[str, int]) -> list[tuple[Path, int | None]]:
    """Image files of ``root`` with their labels: class folders (any depth below each, in
    ``load_image_folder``'s order: file name, then path) or flat (files of ``root`` only)."""
    if not root.is_dir():
        raise DataError(f"image folder {root} does not exist (or is not a directory)")
    try:
        entries = sorted(e for e in root.iterdir() if not e.name.startswith("."))
        flat = [e for e in entries if e.is_file() and _is_image(e)]
        dirs = [e for e in entries if e.is_dir()]
    except OSError as err:
        raise DataError(f"cannot list {root}: {err}") from None
    if flat and dirs:
        raise DataError(f"{root} holds both image files and folders: use either class "
                        "folders (labelled) or a flat folder of images (unlabelled)")  # fmt: skip
    if flat:
        return [(p, None) for p in flat[: MAX_FOLDER_IMAGES + 1]]

    def unlistable(err: OSError) -> None:  # os.walk would skip it without a word
        raise DataError(f"cannot list {err.filename}: {err.strerror}")

    found: list[tuple[str, str, Path, int | None]] = []
    for entry in dirs:
        if entry.name not in folders:
            raise DataError(f"{entry}: {entry.name!r} is not a class; class folders are named "
                            f"{sorted(folders, key=folders.__getitem__)}")  # fmt: skip
        for dirpath, dirnames, filenames in os.walk(entry, onerror=unlistable):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in filenames:
                path = Path(dirpath) / name
                if _is_image(path):
                    found.append((name, str(path.relative_to(root)), path, folders[entry.name]))
            if len(found) > MAX_FOLDER_IMAGES:
                raise DataError(f"{root} holds more than {MAX_FOLDER_IMAGES} images")
    found.sort(key=lambda f: (f[0], f[1]))
    return [(path, label) for _, _, path, label in found]


def read_image_folder(
    root: str | Path, *, class_names: Sequence[str] = (), limit: int = 0
) -> FolderImages:
    """The images of ``root``: ``root/<class>/...`` gives labels (class folders named as
    :func:`class_folders` says), ``root/<image files>`` none. ``limit`` > 0 keeps the first
    that many files. Unreadable files are skipped and listed; none readable is an error."""
    from PIL import Image

    root = Path(root)
    files = _list_folder(root, class_folders(class_names))
    if len(files) > MAX_FOLDER_IMAGES:
        raise DataError(f"{root} holds more than {MAX_FOLDER_IMAGES} images")
    files = files[:limit] if limit > 0 else files
    images, labels, names, skipped = [], [], [], []
    for path, label in files:
        try:
            images.append(read_image(path))
        except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as err:
            skipped.append(f"{path}: {err}")
            continue
        labels.append(label)
        names.append(str(path.relative_to(root)))
    if not images:
        raise DataError(f"no readable images in {root} ({', '.join(IMAGE_SUFFIXES)})"
                        + (f"; first failure: {skipped[0]}" if skipped else ""))  # fmt: skip
    unlabelled = labels[0] is None
    return FolderImages(
        np.stack(images),
        None if unlabelled else np.asarray(labels, dtype=np.int64),
        names,
        skipped,
    )


# ---------------------------------------------------------------------------- model


def _read_card(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise EstuaryError(f"cannot read the model card {path}: {err}") from None
    if len(raw) > MAX_CARD_BYTES:
        raise EstuaryError(f"{path} is larger than {MAX_CARD_BYTES} bytes; not a model card")
    try:
        card = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise EstuaryError(f"{path} is not JSON: {err}") from None
    if not isinstance(card, dict):
        raise EstuaryError(f"{path} must hold a JSON object, got {type(card).__name__}")
    return card


def check_card(card: dict[str, Any]) -> int:
    """Check a classifier card's kind and fields; returns its number of classes."""
    kind = card.get("kind")
    if kind != CLASSIFIER_KIND:
        raise EstuaryError(
            f"card kind is {kind!r}, not {CLASSIFIER_KIND!r}: this is not a classifier export "
            "(generators are sampled with `estuary sample`)"
        )
    classes = card.get("num_classes")
    if type(classes) is not int or not 2 <= classes <= 100_000:
        raise EstuaryError(f"card num_classes must be an integer >= 2, got {classes!r}")
    if card.get("image_shape") != list(IMAGE_SHAPE):
        raise EstuaryError(
            f"card image_shape {card.get('image_shape')!r} is not {list(IMAGE_SHAPE)}"
        )
    digest = card.get("sha256")
    if not (isinstance(digest, str) and len(digest) == 64):
        raise EstuaryError(f"card sha256 must be 64 hex digits, got {digest!r}")
    return classes


@dataclass
class ClassifyResult:
    """Predictions of a batch of images, how long they took, and, with labels, how many
    were right (``accuracy`` nan for no labels)."""

    predictions: np.ndarray
    labels: np.ndarray | None
    num_classes: int
    seconds: float
    provider: str

    @property
    def images_per_s(self) -> float:
        """Throughput of the whole call."""
        return len(self.predictions) / self.seconds if self.seconds > 0 else float("inf")

    @property
    def accuracy(self) -> float:
        """Fraction predicted as labelled (nan without labels or images)."""
        if self.labels is None or len(self.labels) == 0:
            return float("nan")
        return float(np.mean(self.predictions == self.labels))

    def per_class(self) -> list[dict[str, Any]]:
        """For each class: images predicted as it and, with labels, images of it and how
        many of those were predicted right."""
        predicted = np.bincount(self.predictions, minlength=self.num_classes)
        rows: list[dict[str, Any]] = []
        for c in range(self.num_classes):
            row: dict[str, Any] = {"class": c, "predicted": int(predicted[c])}
            if self.labels is not None:
                mine = self.labels == c
                right = int(np.sum(self.predictions[mine] == c))
                row.update(images=int(mine.sum()), correct=right,
                           accuracy=right / int(mine.sum()) if mine.any() else None)  # fmt: skip
            rows.append(row)
        return rows

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the predictions included)."""
        acc = self.accuracy
        labelled = self.labels is not None
        return {
            "images": len(self.predictions),
            "labelled": labelled,
            "correct": int(np.sum(self.predictions == self.labels)) if labelled else None,
            "accuracy": None if math.isnan(acc) else acc,
            "provider": self.provider,
            "seconds": round(self.seconds, 4),
            "images_per_s": round(self.images_per_s, 1),
            "per_class": self.per_class(),
            "predictions": self.predictions.tolist(),
        }


class OnnxClassifier:
    """A device's exported classifier (``model.onnx`` + ``card.json``) in ONNX Runtime.

    Refuses a card whose kind is not ``"classifier"`` and a ``model.onnx`` whose sha256
    differs from the card's. ``provider``: "auto" (CUDA where a GPU is visible), "cpu" or
    "cuda", as :func:`shared.deploy.onnx_sampler.make_session` picks.
    """

    def __init__(self, model_dir: str | Path, *, provider: str = "auto", threads: int = 0) -> None:
        directory = Path(model_dir)
        #: the export directory read (None: loaded from bytes in hand)
        self.model_dir: Path | None = directory
        card = _read_card(directory / CARD_FILE)
        model_path = directory / MODEL_FILE
        try:
            if model_path.stat().st_size > MAX_MODEL_BYTES:
                raise EstuaryError(f"{model_path} is larger than {MAX_MODEL_BYTES} bytes")
            data = model_path.read_bytes()
        except OSError as err:
            raise EstuaryError(f"cannot read {model_path}: {err}") from None
        self._load(data, card, str(model_path), provider=provider, threads=threads)

    @classmethod
    def from_bytes(
        cls, data: bytes, card: dict[str, Any], *, provider: str = "auto", threads: int = 0
    ) -> OnnxClassifier:
        """A classifier from ONNX bytes and their card in hand (a deployment the device
        fetched and verified), checked as :class:`OnnxClassifier` checks an export
        directory: the card's kind and fields, and the bytes' sha256 against the card's."""
        if not isinstance(card, dict):
            raise EstuaryError(f"a model card is a JSON object, got {type(card).__name__}")
        if len(data) > MAX_MODEL_BYTES:
            raise EstuaryError(f"the model is larger than {MAX_MODEL_BYTES} bytes")
        self = cls.__new__(cls)
        self.model_dir = None
        self._load(data, card, "the model", provider=provider, threads=threads)
        return self

    def _load(
        self, data: bytes, card: dict[str, Any], what: str, *, provider: str, threads: int
    ) -> None:
        """Check ``card`` and ``data`` (named ``what`` in errors) and open the session."""
        self.card = card
        self.num_classes = check_card(card)
        self.sha256 = hashlib.sha256(data).hexdigest()
        if self.sha256 != self.card["sha256"]:
            raise EstuaryError(
                f"{what} does not match its card: sha256 {self.sha256[:16]}..., the card "
                f"says {self.card['sha256'][:16]}... (damaged or replaced; export it again)"
            )
        self.session = make_session(data, provider=provider, threads=threads)
        inputs = [i.name for i in self.session.get_inputs()]
        outputs = [o.name for o in self.session.get_outputs()]
        if inputs != [INPUT_NAME] or outputs != [OUTPUT_NAME]:
            raise EstuaryError(f"a classifier maps {INPUT_NAME!r} to {OUTPUT_NAME!r}; this model "
                               f"maps {inputs} to {outputs}")  # fmt: skip

    @property
    def providers(self) -> list[str]:
        """The execution providers the session runs on."""
        return list(self.session.get_providers())

    def logits(self, images: np.ndarray, *, batch_size: int = 256) -> np.ndarray:
        """float32 logits (N, num_classes) of uint8 or prepared float images
        (:func:`model_input`), ``batch_size`` images per ONNX Runtime run."""
        if batch_size < 1:
            raise EstuaryError(f"batch_size must be >= 1, got {batch_size}")
        x = model_input(images)
        out = [np.zeros((0, self.num_classes), dtype=np.float32)]
        for lo in range(0, len(x), batch_size):
            try:
                y = self.session.run([OUTPUT_NAME], {INPUT_NAME: x[lo : lo + batch_size]})[0]
            except Exception as err:  # onnxruntime's own error types
                raise EstuaryError(f"ONNX Runtime failed: {type(err).__name__}: {err}") from None
            out.append(np.asarray(y, dtype=np.float32))
        logits = np.concatenate(out)
        if logits.shape != (len(x), self.num_classes):
            raise EstuaryError(f"the model returned logits {logits.shape}, expected "
                               f"({len(x)}, {self.num_classes}) as its card says")  # fmt: skip
        return logits

    def predict(self, images: np.ndarray, *, batch_size: int = 256) -> np.ndarray:
        """Predicted classes (int64, N) of ``images`` (uint8 pixels or prepared floats)."""
        return self.logits(images, batch_size=batch_size).argmax(1).astype(np.int64)

    def accuracy(self, images: np.ndarray, labels: np.ndarray, *, batch_size: int = 256) -> float:
        """Fraction of ``images`` predicted as ``labels`` (nan for no images)."""
        return self.classify(images, labels, batch_size=batch_size).accuracy

    def classify(
        self, images: np.ndarray, labels: np.ndarray | None = None, *, batch_size: int = 256
    ) -> ClassifyResult:
        """Predictions of ``images``, timed, judged against ``labels`` when given."""
        if labels is not None:
            labels = np.asarray(labels, dtype=np.int64)
            if labels.shape != (len(images),):
                raise DataError(f"{len(labels)} labels for {len(images)} images")
            if len(labels) and (labels.min() < 0 or labels.max() >= self.num_classes):
                raise DataError(f"labels must lie in [0, {self.num_classes}), got "
                                f"{labels.min()}..{labels.max()}")  # fmt: skip
        start = time.perf_counter()
        predictions = self.predict(images, batch_size=batch_size)
        seconds = time.perf_counter() - start
        return ClassifyResult(predictions, labels, self.num_classes, seconds, self.providers[0])
