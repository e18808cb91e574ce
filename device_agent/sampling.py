"""A device's deployed generators on disk: loading a deployment directory (``model.onnx`` +
``manifest.json`` [+ ``manifest.sig``]) after checking its hash, size and signature, the
device's own model beside it (FedDiffuse ULATDEC/UDEC), and PNG grids of what it samples.

The sampler itself (ONNX Runtime plus a numpy DDIM loop) is
:mod:`shared.deploy.onnx_sampler`. Only numpy, onnxruntime and pillow are imported here: a
device that only generates images never needs torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from shared.deploy.onnx_sampler import OnnxGenerator
from shared.deploy.signing import check_manifest, check_model_bytes, read_signed, verify_manifest
from shared.errors import SignatureError

log = logging.getLogger(__name__)

#: a device's own model beside its copy of a deployment (FedDiffuse ULATDEC/UDEC), and the
#: device's record of it (its sha256, the deployment's, the shared file's, parity)
OWN_MODEL_FILE = "own_model.onnx"
OWN_RECORD_FILE = "own_model.json"


def load_generator(
    model_dir: Path,
    *,
    verify_key: Any = None,
    require_signature: bool = False,
    provider: str = "auto",
    threads: int = 0,
    own: bool = False,
) -> tuple[OnnxGenerator, dict[str, Any]]:
    """Load ``model_dir`` (``model.onnx`` + ``manifest.json`` [+ ``manifest.sig``]) after
    checking the model's hash and size against the manifest and, with ``verify_key`` (an
    Ed25519 public key), the manifest's signature. Returns (generator, manifest).

    With ``own``, ``model_dir`` is a device's copy of a deployment whose devices keep local
    parts (FedDiffuse ULATDEC/UDEC), and the generator is the device's own model beside it
    (:data:`OWN_MODEL_FILE`), checked against the device's record of it
    (:data:`OWN_RECORD_FILE`: its hash, and the deployment it was built from). The device
    built it from the signed shared tensors and its own local parts: the signature covers
    the deployment, not the local parts."""
    text, signature = read_signed(model_dir)
    if verify_key is not None:
        if signature is None:
            raise SignatureError("bad_signature", f"{model_dir} has no manifest.sig")
        manifest = verify_manifest(text, signature, verify_key)
    elif require_signature:
        raise SignatureError("no_verify_key", "a signature check was required but no key given")
    else:
        manifest = json.loads(text)
        check_manifest(manifest)
    path = model_dir / manifest["model"]["file"]
    try:
        data = path.read_bytes()
    except OSError as err:
        raise SignatureError("bad_manifest", f"cannot read {path}: {err}") from None
    check_model_bytes(data, manifest)
    sha = manifest["model"]["sha256"]
    if own:
        data, sha = _own_model_bytes(model_dir, manifest)
    generator = OnnxGenerator(
        data, manifest["card"], provider=provider, threads=threads, model_sha256=sha
    )
    return generator, manifest


def _own_model_bytes(model_dir: Path, manifest: dict[str, Any]) -> tuple[bytes, str]:
    """The device's own model in ``model_dir`` and its sha256, checked against its record."""
    try:
        record = json.loads((model_dir / OWN_RECORD_FILE).read_text())
        data = (model_dir / OWN_MODEL_FILE).read_bytes()
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SignatureError(
            "bad_manifest", f"{model_dir} holds no device's own model ({err})"
        ) from None
    shared = manifest.get("shared", {}).get("sha256")
    if shared is None:
        raise SignatureError("bad_manifest", f"{model_dir}'s deployment has no shared tensors: "
                             "its devices serve the global model")  # fmt: skip
    if not isinstance(record, dict) or (record.get("deployment"), record.get("shared")) != (
        manifest["model"]["sha256"], shared,
    ):  # fmt: skip
        raise SignatureError(
            "bad_manifest", f"{model_dir / OWN_RECORD_FILE} is not for this deployment"
        )
    if hashlib.sha256(data).hexdigest() != record.get("sha256"):
        raise SignatureError(
            "hash_mismatch", f"{model_dir / OWN_MODEL_FILE} differs from its record's sha256"
        )
    return data, str(record["sha256"])


def to_uint8(images: np.ndarray) -> np.ndarray:
    """[-1, 1] float images [N, C, H, W] to uint8 [N, H, W, C]."""
    x = np.clip((images + 1.0) * 127.5 + 0.5, 0, 255).astype(np.uint8)
    return np.transpose(x, (0, 2, 3, 1))


#: grids narrower than this are enlarged by a whole factor (nearest neighbour, no blur)
GRID_MIN_WIDTH = 512


def save_grid(
    images: np.ndarray, path: Path, *, nrow: int | None = None, pad: int = 2,
    scale: int | None = None,
) -> Path:  # fmt: skip
    """Write images in [-1, 1] ([N, C, H, W]) as one PNG grid, each pixel ``scale`` x
    ``scale`` pixels (default: the whole factor, up to 8, that makes the grid at least
    :data:`GRID_MIN_WIDTH` wide; 16 images of 32 px are 138 px wide, too small to see)."""
    from PIL import Image

    pixels = to_uint8(images)
    n, h, w, c = pixels.shape
    nrow = nrow or max(1, int(np.ceil(np.sqrt(n))))
    rows = -(-n // nrow)
    grid = np.zeros((rows * (h + pad) + pad, nrow * (w + pad) + pad, c), dtype=np.uint8)
    for i in range(n):
        r, col = divmod(i, nrow)
        y, x = pad + r * (h + pad), pad + col * (w + pad)
        grid[y : y + h, x : x + w] = pixels[i]
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.fromarray(grid[..., 0] if c == 1 else grid)
    factor = scale if scale is not None else min(8, max(1, -(-GRID_MIN_WIDTH // img.width)))
    if factor > 1:
        img = img.resize((img.width * factor, img.height * factor), Image.Resampling.NEAREST)
    img.save(path)
    return path
