"""Exception tree for Estuary.

::

    EstuaryError
    ├── ConfigError          a configuration value is missing or invalid
    ├── DataError            a dataset cannot be found or read
    ├── CodecError           bytes that do not decode to what they claim (bad hash, bad tensors)
    ├── MessageError         a wire message fails validation (carries a short ``reason``)
    ├── TransportError       the bus cannot deliver (timeout, blob missing, too large)
    ├── SignatureError       a deployment manifest, signature or key that cannot be trusted
    ├── ExportError          an ONNX export was refused (parity above threshold, bad input)
    │   └── PersonalizeError a device could not build its own model from a deployment
    └── StateError           a device's saved state cannot be used (the file is set aside)

Library exceptions (safetensors, pydantic, onnxruntime, OS errors) are converted at the
boundary so callers only need to catch ``EstuaryError``. Where an error is also a metric
label, ``reason`` carries the label (``bad_json``, ``blob_hash_mismatch``, ``bad_signature``).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``choices`` to ``word``, else ``""``:
    for error messages about a mistyped name."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class EstuaryError(Exception):
    """Root of every error Estuary raises on purpose."""


class ConfigError(EstuaryError):
    """A configuration value is missing or invalid; the message names it and the fix."""


class DataError(EstuaryError):
    """A dataset cannot be found or parsed; the message says how to get it."""


class CodecError(EstuaryError):
    """Encoded bytes are corrupt, mismatch their hash, or hold unexpected tensors.

    ``reason`` is the rejected-messages metric label (``bad_tensors``, ``blob_hash_mismatch``).
    """

    def __init__(self, message: str, reason: str = "bad_tensors") -> None:
        super().__init__(message)
        self.reason = reason


class MessageError(EstuaryError):
    """A wire message was rejected. ``reason`` is a short metric label (e.g. ``bad_json``)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class TransportError(EstuaryError):
    """The bus could not deliver a message or a blob in time or within limits.

    ``reason`` is the metric label (``blob_unavailable``, ``blob_too_large``, ``timeout``).
    """

    def __init__(self, message: str, reason: str = "blob_unavailable") -> None:
        super().__init__(message)
        self.reason = reason


class SignatureError(EstuaryError):
    """A deployment manifest, signature or key that cannot be trusted; ``reason`` labels the
    metric (``bad_signature``, ``bad_manifest``, ``hash_mismatch``, ``no_verify_key``)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class ExportError(EstuaryError):
    """The export was refused (parity above threshold, bad input)."""


class PersonalizeError(ExportError):
    """The device could not build or export its own model from a deployment."""


class StateError(EstuaryError):
    """A device's state document or file that cannot be used (the message says why)."""
