"""The ``classify`` task of a deployment on a device: serve the signed classifier and classify
the device's own images with it (its test split, else its training images, else its image
folder), reporting the accuracy."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from device_agent.sampling import OWN_MODEL_FILE, OWN_RECORD_FILE
from device_agent.served import Admitted, DeploymentTask, Fetched, Served
from shared.atomic import atomic_write
from shared.deploy.onnx_classifier import (
    CARD_FILE,
    OnnxClassifier,
    read_image_folder,
)
from shared.deploy.signing import (
    write_signed,
)
from shared.errors import (
    EstuaryError,
    SignatureError,
)
from shared.runtime.service import RoleService

log = logging.getLogger(__name__)

#: training images a deployed classifier classifies on a device without a test split (the
#: first ones), and the images read from a sampling-only device's folder
CLASSIFY_FALLBACK_IMAGES = 256


#: which of its images a device classified with a deployed classifier (the report's
#: ``request_id``)
TEST_SPLIT = "own-test-split"


TRAINING_IMAGES = "own-training-images"


IMAGE_FOLDER = "own-image-folder"


NO_IMAGES = "no-images"


#: the figures of the last classification, beside the deployed classifier
CLASSIFIED_FILE = "classified.json"


@dataclass(frozen=True)
class LocalImages:
    """The images a device classifies with a deployed classifier: uint8 (N, H, W) pixels or
    prepared floats (N, 1, 32, 32), their labels (None: unlabelled), and which set they are
    (:data:`TEST_SPLIT`, :data:`TRAINING_IMAGES`, :data:`IMAGE_FOLDER`)."""

    images: np.ndarray
    labels: np.ndarray | None
    source: str


def _as_numpy(x: Any) -> np.ndarray:
    """A torch tensor (without importing torch) or an array as a numpy array."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def local_images(service: RoleService) -> LocalImages | None:
    """What ``service`` (a device) classifies a deployed classifier on: its own test split
    (a training device's ``test_data`` / ``test_labels``), else the first
    :data:`CLASSIFY_FALLBACK_IMAGES` of its training images (``data`` / ``labels``), else the
    image folder ``data.local_dir`` (or its ``<device id>`` subfolder) read without torch,
    labelled by its class folders; None when it has none of them. A read that fails raises
    (:class:`~shared.errors.DataError`)."""
    test = getattr(service, "test_data", None)
    if test is not None:
        labels = getattr(service, "test_labels", None)
        return LocalImages(
            _as_numpy(test), None if labels is None else _as_numpy(labels), TEST_SPLIT
        )
    data = getattr(service, "data", None)
    if data is not None:
        labels = getattr(service, "labels", None)
        n = CLASSIFY_FALLBACK_IMAGES
        return LocalImages(
            _as_numpy(data[:n]), None if labels is None else _as_numpy(labels[:n]),
            TRAINING_IMAGES,
        )  # fmt: skip
    d = service.cfg.data
    if not d.local_dir:
        return None
    folder = Path(d.local_dir)
    if (folder / service.name).is_dir():
        folder = folder / service.name
    found = read_image_folder(folder, class_names=d.class_names, limit=CLASSIFY_FALLBACK_IMAGES)
    return LocalImages(found.images, found.labels, IMAGE_FOLDER)


class ClassifyTask(DeploymentTask):
    """A deployment receiver's handling of classifiers."""

    def _install_classifier(self, item: Admitted, fetched: Fetched) -> Served:
        """A ``"classify"`` deployment: its card must be a classifier's naming the signed
        file's sha256 (else ``bad_manifest``) and ONNX Runtime must load the bytes (else
        ``bad_model``); a verified copy (the model, ``card.json``, the signed manifest) is
        kept under ``out_dir/models/<sha16>``, which ``estuary classify`` reads. No torch."""
        msg, manifest, want = item.msg, item.manifest, item.manifest["model"]
        card = manifest["card"]
        if card.get("sha256") != want["sha256"]:
            named = str(card.get("sha256"))[:16]
            raise SignatureError("bad_manifest", f"the classifier's card names another model "
                                 f"({named}) than the signed file")  # fmt: skip
        if fetched.shared is not None:
            raise SignatureError("bad_manifest", "a classifier deployment carries no shared "
                                 "tensors")  # fmt: skip
        classifier = OnnxClassifier.from_bytes(
            fetched.model, card, provider=self.cfg.provider, threads=self.cfg.threads
        )
        path = self.out_dir / "models" / want["sha256"][:16]
        path.mkdir(parents=True, exist_ok=True)
        atomic_write(path / want["file"], fetched.model)
        atomic_write(path / CARD_FILE, (json.dumps(card, indent=2) + "\n").encode())
        for name in (OWN_MODEL_FILE, OWN_RECORD_FILE, CLASSIFIED_FILE):
            (path / name).unlink(missing_ok=True)
        write_signed(path, msg.manifest, msg.signature, msg.key_id)  # last, as for generators
        return Served(
            want["sha256"], None, manifest, path, version=item.version, classifier=classifier
        )

    def _classify(self) -> None:
        """Classify the device's own images (:func:`local_images`) with the classifier in
        service and report ``classified`` (accuracy when they are labelled), or ``refused``
        with the reason when that fails; the device goes on either way."""
        served = self.served
        if served is None or served.classifier is None:
            return
        sha = served.sha256
        try:
            local = local_images(self.service)
            if local is None:
                log.warning("%s: no images of its own to classify with %s", self.service.name,
                            sha[:12])  # fmt: skip
                self._report("classified", sha, request_id=NO_IMAGES,
                             reason="no images: no test split, training images or "
                             "data.local_dir")  # fmt: skip
                return
            result = served.classifier.classify(local.images, local.labels)
        except Exception as err:  # EstuaryError, or anything else: the cloud hears why
            detail = str(err) if isinstance(err, EstuaryError) else f"{type(err).__name__}: {err}"
            log.error("%s: classifying with %s failed: %s", self.service.name, sha[:12], detail)
            self._report("refused", sha, reason=f"classifying failed: {detail}"[:500],
                         request_id=f"classify-{sha[:12]}")  # fmt: skip
            return
        acc = result.accuracy
        accuracy = None if math.isnan(acc) else acc
        figures = {"deployment": sha, "set": local.source, **result.to_dict()}
        figures.pop("predictions")
        try:
            text = json.dumps(figures, indent=2) + "\n"
            atomic_write(served.path / CLASSIFIED_FILE, text.encode())
        except OSError as err:  # the figures are reported all the same
            log.warning("%s: cannot write %s: %s", self.service.name, CLASSIFIED_FILE, err)
        log.info("%s: classified %d images (%s) with %s: accuracy %s, %.0f images/s",
                 self.service.name, len(result.predictions), local.source, sha[:12],
                 "-" if accuracy is None else f"{accuracy:.4f}", result.images_per_s)  # fmt: skip
        self._report("classified", sha, request_id=local.source, classified=result,
                     accuracy=accuracy)  # fmt: skip
