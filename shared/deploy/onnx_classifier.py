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
two pixels to 32x32 and mapped to ``x / 127.5 - 1`` in float32. Files are decoded by the
same readers training uses (:mod:`shared.data.images`, numpy and Pillow only), so an image
folder written by ``write_image_folder`` gives the pixels the device trained on;
:func:`read_fashion_mnist_test` reads the IDX test split with them. Only numpy, onnxruntime
and Pillow are imported.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.data.images import (
    FASHION_MNIST_CLASSES,
    IMAGE_SUFFIXES,
    MAX_FOLDER_IMAGES,
    UNREADABLE,
    class_folders,
    class_slug,
    list_image_folder,
    read_idx,
    read_image,
)
from shared.deploy.onnx_sampler import make_session
from shared.errors import DataError, EstuaryError

__all__ = [  # the image readers are shared.data.images'; a device names them here too
    "FASHION_MNIST_CLASSES",
    "class_folders",
    "class_slug",
    "read_image",
]

#: the card's ``kind`` of a classifier export, and its format tag
CLASSIFIER_KIND = "classifier"
CARD_FORMAT = "estuary-classifier-v1"
MODEL_FILE = "model.onnx"
CARD_FILE = "card.json"
#: ONNX input and output names
INPUT_NAME = "images"
OUTPUT_NAME = "logits"
#: model input (C, H, W)
IMAGE_SHAPE = (1, 32, 32)
MAX_CARD_BYTES = 256 * 1024
MAX_MODEL_BYTES = 512 * 2**20
#: Fashion-MNIST's test split's files
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
    images = read_idx(root / FASHION_MNIST_TEST[0], 3)
    labels = read_idx(root / FASHION_MNIST_TEST[1], 1).astype(np.int64)
    if len(images) != len(labels):
        raise DataError(f"{root}: {len(images)} test images but {len(labels)} labels")
    return images, labels


@dataclass(frozen=True)
class FolderImages:
    """Images read from a folder: uint8 (N, 28, 28), their labels (None for a flat folder),
    the files (relative to the folder) in the same order, and the unreadable files skipped."""

    images: np.ndarray
    labels: np.ndarray | None
    files: list[str]
    skipped: list[str] = field(default_factory=list)


def read_image_folder(
    root: str | Path, *, class_names: Sequence[str] = (), limit: int = 0
) -> FolderImages:
    """The images of ``root``: ``root/<class>/...`` gives labels (class folders named as
    :func:`class_folders` says), ``root/<image files>`` none. ``limit`` > 0 keeps the first
    that many files. Unreadable files are skipped and listed; none readable is an error."""
    root = Path(root)
    files = list_image_folder(root, class_folders(class_names), flat=True)
    if len(files) > MAX_FOLDER_IMAGES:
        raise DataError(f"{root} holds more than {MAX_FOLDER_IMAGES} images")
    files = files[:limit] if limit > 0 else files
    images, labels, names, skipped = [], [], [], []
    for path, label in files:
        try:
            images.append(read_image(path))
        except UNREADABLE as err:
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
