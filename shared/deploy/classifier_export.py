"""Export a device's own fine-tuned classifier to ONNX, gated on parity with torch.

With pFedGPA every device ends with its own classifier, fine-tuned on its own data; the
cloud never sees it. :func:`export_classifier` runs on the device: it traces the model
(``images`` float32 [batch, 1, 32, 32] in [-1, 1] -> ``logits`` float32 [batch, classes],
dynamic batch, TorchScript exporter as :func:`shared.deploy.export.to_onnx`), runs ONNX
Runtime (CPU) and torch on a fixed batch of the device's images and refuses the export
(:class:`~shared.errors.ExportError`, nothing written) unless the logits agree within
``tolerance`` and every argmax agrees. It writes ``model.onnx`` and ``card.json`` (kind
``"classifier"``, the ONNX bytes' sha256, the parity figures, ONNX Runtime's accuracy on
the labels given, the caller's ``origin``).

Nothing is signed: Estuary signs only what it received signed (the cloud's deployments,
:mod:`shared.deploy.signing`), and a device holds no signing key, so a model made on the
device says ``"signed": false`` in its card. The card's sha256 lets
:class:`shared.deploy.onnx_classifier.OnnxClassifier` refuse a damaged or replaced file.

A classifier the *cloud* made (FedDEO's, trained on its synthetic images) is deployed like a
generator: :func:`export_signed_classifier` runs the same parity-gated export, then writes an
Ed25519-signed manifest whose ``task`` is ``"classify"`` (``manifest.json``,
``manifest.sig``), which :class:`cloud.deploy.DeploymentPublisher` publishes and the devices
verify before they load it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from shared import __version__
from shared.atomic import atomic_write
from shared.deploy.onnx_classifier import (
    CARD_FILE,
    CARD_FORMAT,
    CLASSIFIER_KIND,
    IMAGE_SHAPE,
    INPUT_NAME,
    MODEL_FILE,
    OUTPUT_NAME,
)
from shared.deploy.onnx_sampler import make_session
from shared.deploy.signing import (
    CLASSIFY_TASK,
    key_id,
    make_manifest,
    new_version,
    read_version,
    sign_manifest,
    write_signed,
)
from shared.errors import EstuaryError, ExportError
from shared.models.classifier import CLASSIFIER_PRESETS, is_classifier

#: the lowest opset exported, as ``shared.deploy.export.MIN_OPSET`` (not imported from
#: there: that module pulls in diffusers, which a device exporting a classifier never needs)
MIN_OPSET = 17
#: images per torch / ONNX Runtime run of the parity check
PARITY_BATCH = 256
#: files of an earlier export that would vouch for another model than the one written
STALE_FILES = ("manifest.json", "manifest.sig", "shared.safetensors")
PREPROCESSING = "8-bit grayscale 28x28, x / 127.5 - 1, padded by 2 pixels of -1"
SIGNATURE_NOTE = (
    "made and exported on the device from its own fine-tuning; Estuary signs only what it "
    "received signed (the cloud's deployments), so this model carries no signature"
)
CLOUD_SIGNATURE_NOTE = (
    "made and exported on the cloud and deployed with an Ed25519-signed manifest "
    "(manifest.json, manifest.sig); devices verify the signature and this file's sha256 "
    "before they load it"
)


@dataclass(frozen=True)
class ClassifierParity:
    """ONNX Runtime against torch on the parity batch: the largest logit difference and
    the fraction of images whose argmax agrees."""

    max_abs: float
    argmax_agreement: float
    tolerance: float
    images: int

    @property
    def passed(self) -> bool:
        """Logits within ``tolerance`` and every argmax the same."""
        return self.max_abs <= self.tolerance and self.argmax_agreement == 1.0

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the card's ``parity``)."""
        return {
            "max_abs": self.max_abs,
            "argmax_agreement": self.argmax_agreement,
            "tolerance": self.tolerance,
            "images": self.images,
            "passed": self.passed,
        }


@dataclass(frozen=True)
class ClassifierExport:
    """What :func:`export_classifier` wrote."""

    out_dir: Path
    model_path: Path
    card_path: Path
    parity: ClassifierParity
    #: ONNX Runtime's accuracy on the labels given (None without labels)
    accuracy: float | None
    sha256: str
    card: dict[str, Any]
    seconds: float
    #: the signed manifest (:func:`export_signed_classifier`); None: unsigned
    manifest_path: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "out_dir": str(self.out_dir),
            "model": str(self.model_path),
            "card": str(self.card_path),
            "manifest": None if self.manifest_path is None else str(self.manifest_path),
            "sha256": self.sha256,
            "accuracy": self.accuracy,
            "parity": self.parity.to_dict(),
            "seconds": round(self.seconds, 3),
        }


def preset_of(model: nn.Module) -> str:
    """The classifier preset ``model`` was built from (its class and constructor arguments);
    ExportError for a generator or an unknown classifier."""
    if not is_classifier(model):
        raise ExportError(
            f"{type(model).__name__} is not a classifier; generators export with "
            "shared.deploy.export.export_generator (estuary export)"
        )
    for name, kwargs in CLASSIFIER_PRESETS.items():
        if all(getattr(model, k, None) == v for k, v in kwargs.items()):
            return name
    raise ExportError(f"{type(model).__name__} matches no classifier preset "
                      f"({sorted(CLASSIFIER_PRESETS)})")  # fmt: skip


def classifier_to_onnx(model: nn.Module, *, opset: int = MIN_OPSET) -> bytes:
    """ONNX bytes of ``model`` (eval mode): ``images`` [batch, 1, 32, 32] -> ``logits``
    [batch, classes], dynamic batch, traced with the TorchScript exporter (``dynamo=False``)
    on a batch of two blank images (-1 everywhere)."""
    if opset < MIN_OPSET:
        raise ExportError(f"opset must be >= {MIN_OPSET}, got {opset}")
    example = torch.full((2, *IMAGE_SHAPE), -1.0)
    buf = io.BytesIO()
    with (
        torch.no_grad(),
        contextlib.redirect_stdout(io.StringIO()),
        warnings.catch_warnings(),
    ):
        # the TorchScript exporter is chosen on purpose, as for generators; torch flags it
        warnings.filterwarnings(
            "ignore", "You are using the legacy TorchScript", DeprecationWarning
        )
        warnings.filterwarnings(
            "ignore", "The feature will be removed", DeprecationWarning, r"torch\.onnx\."
        )
        torch.onnx.export(
            model,
            (example,),
            buf,  # type: ignore[arg-type]
            opset_version=opset,
            dynamo=False,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
        )
    return buf.getvalue()


def _check_inputs(
    images: torch.Tensor, labels: torch.Tensor | None, tolerance: float, origin: Any
) -> None:
    if not (tolerance >= 0 and math.isfinite(tolerance)):
        raise ExportError(f"parity tolerance must be a finite number >= 0, got {tolerance}")
    if images.ndim != 4 or tuple(images.shape[1:]) != IMAGE_SHAPE or len(images) == 0:
        raise ExportError(f"parity images must be a non-empty float batch (N, 1, 32, 32), "
                          f"got {tuple(images.shape)}")  # fmt: skip
    if not images.is_floating_point():
        raise ExportError(f"parity images must be floats in [-1, 1], got {images.dtype}")
    if labels is not None and tuple(labels.shape) != (len(images),):
        raise ExportError(f"{tuple(labels.shape)} labels for {len(images)} images")
    if origin is not None:
        if not isinstance(origin, dict):
            raise ExportError(f"origin must be a dict, got {type(origin).__name__}")
        try:
            json.dumps(origin, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ExportError(f"origin must be JSON (str keys, plain values): {err}") from None


@torch.no_grad()
def _torch_logits(model: nn.Module, images: torch.Tensor) -> np.ndarray:
    x = images.detach().to("cpu", torch.float32)
    batches = [model(x[i : i + PARITY_BATCH]) for i in range(0, len(x), PARITY_BATCH)]
    return torch.cat(batches).numpy()


def _onnx_logits(onnx_bytes: bytes, images: np.ndarray) -> np.ndarray:
    session = make_session(onnx_bytes, provider="cpu")
    return np.concatenate([
        session.run([OUTPUT_NAME], {INPUT_NAME: images[i : i + PARITY_BATCH]})[0]
        for i in range(0, len(images), PARITY_BATCH)
    ])  # fmt: skip


def check_classifier_parity(
    model: nn.Module, onnx_bytes: bytes, images: torch.Tensor, *, tolerance: float
) -> tuple[ClassifierParity, np.ndarray]:
    """Parity of ``onnx_bytes`` (ONNX Runtime, CPU) with ``model`` (torch, eval mode) on
    ``images``, and ONNX Runtime's logits."""
    want = _torch_logits(model, images)
    got = _onnx_logits(onnx_bytes, images.detach().to("cpu", torch.float32).numpy())
    if got.shape != want.shape:
        raise ExportError(f"ONNX Runtime returned logits {got.shape}, torch {want.shape}")
    max_abs = float(np.abs(got - want).max())
    agreement = float(np.mean(got.argmax(1) == want.argmax(1)))
    return ClassifierParity(max_abs, agreement, tolerance, len(images)), got


def classifier_card(
    model: nn.Module,
    onnx_bytes: bytes,
    *,
    num_classes: int,
    opset: int,
    parity: ClassifierParity,
    accuracy: float | None,
    origin: dict[str, Any] | None,
) -> dict[str, Any]:
    """The card beside a classifier's ``model.onnx`` (what :class:`OnnxClassifier` reads)."""
    sha = hashlib.sha256(onnx_bytes).hexdigest()
    measured: dict[str, Any] | None = None
    if accuracy is not None:
        measured = {"value": accuracy, "images": parity.images, "runtime": "onnxruntime-cpu"}
    return {
        "format": CARD_FORMAT,
        "kind": CLASSIFIER_KIND,
        "preset": preset_of(model),
        "num_classes": num_classes,
        "image_shape": list(IMAGE_SHAPE),
        "inputs": {INPUT_NAME: f"float32 [batch, 1, 32, 32] in [-1, 1] ({PREPROCESSING})"},
        "outputs": {OUTPUT_NAME: f"float32 [batch, {num_classes}]"},
        "params": sum(p.numel() for p in model.parameters()),
        "opset": opset,
        "onnx_bytes": len(onnx_bytes),
        "sha256": sha,
        "parity": parity.to_dict(),
        "accuracy": measured,
        "signed": False,
        "signature_note": SIGNATURE_NOTE,
        "origin": json.loads(json.dumps(origin)) if origin is not None else {},
        "exporter": f"estuary {__version__}, torch {torch.__version__}",
    }


def export_classifier(
    model: nn.Module,
    out_dir: Path,
    *,
    images: torch.Tensor,
    labels: torch.Tensor | None = None,
    opset: int = MIN_OPSET,
    tolerance: float = 1e-4,
    origin: dict[str, Any] | None = None,
) -> ClassifierExport:
    """Export the device's classifier ``model`` into ``out_dir`` (``model.onnx`` and
    ``card.json``), after checking ONNX Runtime against torch on ``images`` (a fixed batch,
    e.g. the device's test split): max |logit difference| <= ``tolerance`` and the same
    argmax for every image, else :class:`ExportError` and nothing is written. With
    ``labels``, the card records ONNX Runtime's accuracy on them. ``origin`` (e.g.
    ``{"device": "dev003", "round": 200, "algorithm": "pfedgpa"}``) is copied into the card.

    The export is unsigned by design: a device signs nothing it did not receive signed
    (the card says ``"signed": false``). Files an earlier export left in ``out_dir`` that
    would vouch for another model (``manifest.json``, ``manifest.sig``,
    ``shared.safetensors``) are removed. The model's train/eval mode is restored.
    """
    start = time.perf_counter()
    _check_inputs(images, labels, tolerance, origin)
    preset_of(model)
    was_training = model.training
    model.eval()
    try:
        onnx_bytes = classifier_to_onnx(model, opset=opset)
        parity, logits = check_classifier_parity(model, onnx_bytes, images, tolerance=tolerance)
    finally:
        model.train(was_training)
    if not parity.passed:
        raise ExportError(
            f"classifier export refused: ONNX Runtime differs from torch by up to "
            f"{parity.max_abs:.3g} in the logits (tolerance {tolerance:g}) and agrees on the "
            f"class of {parity.argmax_agreement:.2%} of {parity.images} images (needs 100%)"
        )
    accuracy = None
    if labels is not None:
        accuracy = float(np.mean(logits.argmax(1) == labels.detach().cpu().numpy()))
    card = classifier_card(
        model, onnx_bytes, num_classes=int(logits.shape[1]), opset=opset, parity=parity,
        accuracy=accuracy, origin=origin,
    )  # fmt: skip
    out_dir = Path(out_dir)
    model_path, card_path = out_dir / MODEL_FILE, out_dir / CARD_FILE
    for name in STALE_FILES:
        (out_dir / name).unlink(missing_ok=True)
    atomic_write(model_path, onnx_bytes)
    atomic_write(card_path, (json.dumps(card, indent=2) + "\n").encode())
    return ClassifierExport(
        out_dir, model_path, card_path, parity, accuracy, card["sha256"], card,
        time.perf_counter() - start,
    )  # fmt: skip


def export_signed_classifier(
    model: nn.Module,
    out_dir: Path,
    *,
    images: torch.Tensor,
    signing_key: Any,
    run: str,
    labels: torch.Tensor | None = None,
    opset: int = MIN_OPSET,
    tolerance: float = 1e-4,
    origin: dict[str, Any] | None = None,
    card: dict[str, Any] | None = None,
) -> ClassifierExport:
    """:func:`export_classifier` (the same parity gate on ``images``), then sign it for
    deployment: the card says ``"signed": true`` and takes the entries of ``card`` (e.g. the
    source run and the training report), and ``manifest.json`` / ``manifest.sig`` hold an
    Ed25519-signed manifest (``signing_key``) with the ONNX file's sha256 and size, the card,
    ``task = "classify"`` and a new version of ``run``, numbered after the manifest already
    in ``out_dir`` (as :func:`shared.deploy.export.export_module` numbers generators).

    A refused parity check writes nothing; a manifest that cannot be signed (larger than
    :data:`~shared.deploy.signing.MAX_MANIFEST_BYTES`) raises :class:`ExportError` and leaves
    the unsigned export (``"signed": false``) without a manifest."""
    try:
        extra = json.loads(json.dumps(card or {}, allow_nan=False))
    except (TypeError, ValueError) as err:
        raise ExportError(f"card entries must be JSON (no NaN): {err}") from None
    out_dir = Path(out_dir)
    previous = read_version(out_dir)  # export_classifier removes the manifest it replaces
    result = export_classifier(
        model, out_dir, images=images, labels=labels, opset=opset, tolerance=tolerance,
        origin=origin,
    )  # fmt: skip
    full = {**result.card, "signed": True, "signature_note": CLOUD_SIGNATURE_NOTE, **extra}
    version = new_version(run, previous.serial if previous is not None else 0)
    manifest = make_manifest(
        result.sha256, int(full["onnx_bytes"]), full, file=result.model_path.name,
        version=version, task=CLASSIFY_TASK,
    )  # fmt: skip
    try:
        text, signature = sign_manifest(manifest, signing_key)
    except EstuaryError as err:
        raise ExportError(f"classifier deployment not signed: {err}") from None
    atomic_write(result.card_path, (json.dumps(full, indent=2) + "\n").encode())
    manifest_path = write_signed(out_dir, text, signature, key_id(signing_key.public_key()))
    return dataclasses.replace(result, card=full, manifest_path=manifest_path)
