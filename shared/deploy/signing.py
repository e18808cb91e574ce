"""Signed deployments (DESIGN section 5): Ed25519 keys, the deployment manifest, and its
signature.

A manifest is a small JSON object naming the model file by sha256 and size and carrying the
model card. It is signed over its canonical JSON bytes (sorted keys, no whitespace, ASCII),
so the same manifest verifies whether it arrived as text over MQTT or was re-read from
``manifest.json`` on disk. Devices verify the signature *before* parsing anything else, then
the model's hash and size against the manifest, and load nothing that fails.

Every manifest carries a ``version`` inside the signed bytes: the run it was exported from
and a ``serial``, the export's time in milliseconds since the epoch, raised above the serial
of the manifest the export replaces in the same directory (so a cloud resuming from its
checkpoints, whose export directory sits beside them, numbers on even if its clock went
back). Devices serve a deployment of a run only if its serial is greater than that of the
run's deployment they served last (:func:`refuse_older`): a replayed older deployment, validly
signed as it is, is refused. Manifests exported before versions existed read as serial 0.

A manifest may say what its model is for, in the signed ``task``: ``"generate"`` (a
generator the devices sample from; what a manifest without ``task`` means) or ``"classify"``
(a classifier the devices run on their own images, :data:`CLASSIFY_TASK`).

Torch-free on purpose: the device agent's sampling path imports this.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared.atomic import atomic_write
from shared.errors import EstuaryError, SignatureError
from shared.wire.codec import Blob
from shared.wire.messages import MODEL_BLOB_KIND as MODEL_BLOB_KIND  # the files' blob kinds
from shared.wire.messages import SHARED_BLOB_KIND as SHARED_BLOB_KIND

MANIFEST_FORMAT = "estuary-deployment-v1"
MAX_MANIFEST_BYTES = 64 * 1024
PRIVATE_KEY_FILE = "deploy_ed25519.pem"
PUBLIC_KEY_FILE = "deploy_ed25519.pub.pem"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: the file names of a deployment directory's model and shared weights (never the manifest,
#: never a path)
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_FILE_SUFFIX = {"model": ".onnx", "shared": ".safetensors"}
_SIGNATURE = re.compile(r"^[0-9a-f]{128}$")
#: largest version serial (milliseconds since the epoch fit many times over; exact in a float
#: up to 2**53, which the served-version gauge shows)
MAX_SERIAL = 2**53 - 1
_MAX_RUN_CHARS = 128
#: the reason a device refuses a deployment that is not newer than the one it served
NOT_NEWER = "deployment_not_newer"
#: what a deployed model is for (the manifest's ``task``; absent: generate)
GENERATE_TASK = "generate"
CLASSIFY_TASK = "classify"
TASKS = (GENERATE_TASK, CLASSIFY_TASK)


# -- keys ---------------------------------------------------------------------------------


def generate_keys(out_dir: Path, *, overwrite: bool = False) -> tuple[Path, Path]:
    """Write a new Ed25519 key pair as PEM files into ``out_dir``; the private key is
    readable by its owner only. Returns (private, public) paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    priv_path, pub_path = out_dir / PRIVATE_KEY_FILE, out_dir / PUBLIC_KEY_FILE
    if not overwrite and (priv_path.exists() or pub_path.exists()):
        raise EstuaryError(f"{priv_path} or {pub_path} exists; pass --force to replace them")
    key = Ed25519PrivateKey.generate()
    priv = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(priv)
    pub_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return priv_path, pub_path


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    """The Ed25519 signing key in PEM file ``path``."""
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as err:
        raise EstuaryError(f"cannot read the signing key {path}: {err}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise EstuaryError(f"{path} is not an Ed25519 private key")
    return key


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    """The Ed25519 verification key in PEM file ``path``."""
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError, TypeError) as err:
        raise EstuaryError(f"cannot read the verification key {path}: {err}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise EstuaryError(f"{path} is not an Ed25519 public key")
    return key


def key_id(key: Ed25519PublicKey) -> str:
    """Short fingerprint of a public key (first 16 hex digits of sha256 of its raw bytes)."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


# -- manifests ----------------------------------------------------------------------------


def canonical_json(obj: Any) -> bytes:
    """The bytes a manifest is signed over: sorted keys, no whitespace, ASCII only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


@dataclass(frozen=True)
class DeploymentVersion:
    """Where a deployment stands among its run's deployments: ``run`` (the run name it was
    exported from) and ``serial`` (greater: exported later; 0: exported before manifests
    carried versions)."""

    run: str
    serial: int

    def to_dict(self) -> dict[str, Any]:
        """The manifest's ``version`` entry."""
        return {"run": self.run, "serial": self.serial}


def new_version(run: str, after: int = 0) -> DeploymentVersion:
    """A version of ``run`` for an export made now: the time in milliseconds since the
    epoch, or ``after + 1`` when that is greater (a clock that went back, two exports within
    a millisecond)."""
    now_ms = time.time_ns() // 1_000_000
    return DeploymentVersion(run, min(MAX_SERIAL, max(now_ms, after + 1)))


def version_of(manifest: dict[str, Any]) -> DeploymentVersion:
    """The version of a manifest (devices read it from checked ones only:
    :func:`check_manifest`); one without a well-formed ``version`` entry is serial 0 of the
    run its card names as its source."""
    version = manifest.get("version")
    if isinstance(version, dict):
        run, serial = version.get("run"), version.get("serial")
        if isinstance(run, str) and type(serial) is int:
            return DeploymentVersion(run, serial)
    card = manifest.get("card")
    source = card.get("source") if isinstance(card, dict) else None
    run = source.get("run") if isinstance(source, dict) else None
    return DeploymentVersion(run if isinstance(run, str) else "", 0)


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of a manifest's canonical bytes: the identity of a deployment (its signed
    content, whatever the unsigned fields of the message that carried it)."""
    return hashlib.sha256(canonical_json(manifest)).hexdigest()


def refuse_older(
    version: DeploymentVersion, digest: str, served: tuple[int, str] | None
) -> str | None:
    """Why a deployment of ``version`` (manifest digest ``digest``) must not replace the
    deployment of its run served last, ``served`` as (serial, manifest digest); None when it
    may. A deployment is newer when its serial is greater; the same deployment again (same
    digest) may be loaded again (a restart, another run served in between). A run whose last
    deployment had no version (serial 0) accepts any of its deployments, as before versions."""
    if served is None or served[0] == 0:
        return None
    serial, served_digest = served
    if version.serial > serial or (version.serial == serial and digest == served_digest):
        return None
    return (
        f"version {version.serial} of run {version.run!r:.80} is not newer than version "
        f"{serial}, the run's deployment served last"
    )


def make_manifest(
    model_sha256: str,
    model_size: int,
    card: dict[str, Any],
    *,
    file: str = "model.onnx",
    shared: dict[str, Any] | None = None,
    version: DeploymentVersion | None = None,
    task: str | None = None,
) -> dict[str, Any]:
    """The manifest of a model file: its hash, size, card, creation time and ``version``
    (default: :func:`new_version` of the card's source run); with ``shared`` (``{"file",
    "sha256", "size"}``), also the safetensors file of the global model's federated tensors
    that devices holding their own local parts build their model from (FedDiffuse
    ULATDEC/UDEC); with ``task`` (one of :data:`TASKS`), what the model is for (without:
    no ``task`` entry, which reads as ``"generate"``)."""
    if task is not None and task not in TASKS:
        raise EstuaryError(f"deployment task must be one of {TASKS}, got {task!r}")
    if version is None:
        version = new_version(version_of({"card": card}).run)
    manifest = {
        "format": MANIFEST_FORMAT,
        "model": {"file": file, "sha256": model_sha256, "size": int(model_size)},
        "card": card,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "version": version.to_dict(),
    }
    if shared is not None:
        manifest["shared"] = dict(shared)
    if task is not None:
        manifest["task"] = task
    return manifest


def task_of(manifest: dict[str, Any]) -> str:
    """What a (checked) manifest's model is for: its ``task``, ``"generate"`` without one."""
    task = manifest.get("task", GENERATE_TASK)
    return task if isinstance(task, str) else GENERATE_TASK


def sign_manifest(manifest: dict[str, Any], key: Ed25519PrivateKey) -> tuple[str, str]:
    """(canonical manifest text, hex Ed25519 signature over its bytes)."""
    data = canonical_json(manifest)
    if len(data) > MAX_MANIFEST_BYTES:
        raise EstuaryError(f"manifest is {len(data)} bytes > {MAX_MANIFEST_BYTES}")
    return data.decode(), key.sign(data).hex()


def verify_manifest(text: str, signature: str, key: Ed25519PublicKey) -> dict[str, Any]:
    """Check ``signature`` over ``text`` with ``key``, then parse and check the manifest.

    Raises :class:`SignatureError` (reasons ``bad_signature``, ``bad_manifest``).
    """
    data = text.encode()
    if len(data) > MAX_MANIFEST_BYTES:
        raise SignatureError("bad_manifest", f"manifest is {len(data)} bytes")
    if not _SIGNATURE.match(signature):
        raise SignatureError("bad_signature", "signature is not 64 bytes of hex")
    try:
        key.verify(bytes.fromhex(signature), data)
    except InvalidSignature:
        raise SignatureError("bad_signature", "Ed25519 signature does not verify") from None
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SignatureError("bad_manifest", f"signed text is not JSON: {err}") from None
    check_manifest(manifest)
    return manifest


def check_manifest(manifest: Any) -> None:
    """Raise ``SignatureError("bad_manifest")`` unless ``manifest`` has the expected shape."""
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise SignatureError("bad_manifest", f"not an {MANIFEST_FORMAT} manifest")
    if not isinstance(manifest.get("model"), dict):
        raise SignatureError("bad_manifest", "manifest has no model entry")
    for entry, suffix in _FILE_SUFFIX.items():
        if entry == "model" or entry in manifest:
            _check_file_entry(entry, manifest[entry], suffix)
    if not isinstance(manifest.get("card"), dict):
        raise SignatureError("bad_manifest", "manifest has no model card")
    if "version" in manifest:
        _check_version(manifest["version"])
    task = manifest.get("task", GENERATE_TASK)
    if task not in TASKS:
        raise SignatureError("bad_manifest", f"task is not one of {TASKS}: {task!r:.80}")


def _check_version(value: Any) -> None:
    if not isinstance(value, dict) or set(value) != {"run", "serial"}:
        raise SignatureError("bad_manifest", "manifest's version is not {run, serial}")
    run, serial = value["run"], value["serial"]
    if not isinstance(run, str) or len(run) > _MAX_RUN_CHARS:
        raise SignatureError("bad_manifest", f"version.run is not a run name: {run!r:.80}")
    if type(serial) is not int or not 0 < serial <= MAX_SERIAL:
        raise SignatureError("bad_manifest", f"version.serial is not in 1..{MAX_SERIAL}")


def _check_file_entry(entry: str, value: Any, suffix: str) -> None:
    if not isinstance(value, dict):
        raise SignatureError("bad_manifest", f"manifest's {entry} entry is not an object")
    sha, size, file = value.get("sha256"), value.get("size"), value.get("file")
    if not isinstance(sha, str) or not _SHA256.match(sha):
        raise SignatureError("bad_manifest", f"{entry}.sha256 is not a sha256")
    if type(size) is not int or size <= 0:
        raise SignatureError("bad_manifest", f"{entry}.size is not a positive integer")
    if not isinstance(file, str) or not _PLAIN_NAME.fullmatch(file) or not file.endswith(suffix):
        raise SignatureError(
            "bad_manifest", f"{entry}.file must be a plain *{suffix} file name, got {file!r:.80}"
        )


def check_model_bytes(data: Blob, manifest: dict[str, Any], entry: str = "model") -> None:
    """Raise ``SignatureError("hash_mismatch")`` unless ``data`` is the manifest's model (or
    the file of its ``entry``: ``"shared"``)."""
    want = manifest[entry]
    if len(data) != want["size"]:
        raise SignatureError("hash_mismatch", f"{entry} is {len(data)} bytes, manifest says "
                             f"{want['size']}")  # fmt: skip
    got = hashlib.sha256(data).hexdigest()
    if got != want["sha256"]:
        raise SignatureError(
            "hash_mismatch", f"{entry} sha256 {got[:16]}… differs from the manifest's "
            f"{want['sha256'][:16]}…",
        )  # fmt: skip


def write_signed(out_dir: Path, text: str, signature: str, signer: str) -> Path:
    """Write ``manifest.json`` (readable) and ``manifest.sig`` (hex) into ``out_dir``, each
    atomically (a reader sees the old file or the new one, never a torn one)."""
    manifest = json.loads(text)
    path = out_dir / "manifest.json"
    atomic_write(path, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    sig = json.dumps({"signature": signature, "key_id": signer})
    atomic_write(out_dir / "manifest.sig", sig.encode())
    return path


def read_signed(model_dir: Path) -> tuple[str, str | None]:
    """(canonical manifest text, hex signature or None when unsigned) from ``model_dir``."""
    try:
        manifest = json.loads((model_dir / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SignatureError(
            "bad_manifest", f"cannot read {model_dir}/manifest.json: {err}"
        ) from None
    sig_path = model_dir / "manifest.sig"
    signature = None
    if sig_path.is_file():
        try:
            signature = str(json.loads(sig_path.read_text())["signature"])
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise SignatureError("bad_signature", f"cannot read {sig_path}: {err}") from None
    return canonical_json(manifest).decode(), signature


def read_version(model_dir: Path) -> DeploymentVersion | None:
    """The version of the manifest in ``model_dir`` (unverified: what an exporter numbers
    its next export after), or None when there is none or it is unreadable."""
    try:
        manifest = json.loads((model_dir / "manifest.json").read_text())
        check_manifest(manifest)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, SignatureError):
        return None
    return version_of(manifest)
