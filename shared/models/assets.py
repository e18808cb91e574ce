"""Frozen networks the repository ships in ``shared/assets`` (the FID feature net, the
feature-matching net): loaded only when the file's sha256 is the recorded one, built once
per (path, hash) and shared."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from torch import nn

from shared.errors import CodecError
from shared.wire.codec import file_sha256

N = TypeVar("N", bound=nn.Module)


def load_shipped_net(
    cls: type[N], path: Path, expected_sha256: str, *, name: str, hint: str, constant: str
) -> N:
    """``cls()`` holding the weights of ``path`` (eval mode, parameters frozen) after
    checking the file's sha256 against ``expected_sha256``. The hash is checked on every
    call; the model is built once per (path, hash) and cached, so callers share one
    instance: do not modify it. Gradients still flow through it to its input.

    ``name`` is the network's name, ``hint`` how to retrain it, ``constant`` where its hash
    is recorded; all three go into the errors.

    Raises:
        CodecError: the file is missing, its sha256 differs from ``expected_sha256``, or it
            does not hold exactly ``cls``'s tensors.
    """
    try:
        digest = file_sha256(path)
    except OSError as err:
        raise CodecError(f"cannot read the weights of {name}, {path}: {err}. {hint}.") from None
    if digest != expected_sha256:
        raise CodecError(
            f"the weights of {name}, {path}, have sha256 {digest}, expected {expected_sha256}; "
            f"the file is corrupt or from another training run. {hint} and update {constant}."
        )
    key = (f"{cls.__module__}.{cls.__qualname__}", str(path.resolve()), digest)
    if key not in _BUILT:
        if len(_BUILT) >= MAX_BUILT:
            _BUILT.pop(next(iter(_BUILT)))
        _BUILT[key] = _build(cls, key[1], hint)
    model = _BUILT[key]
    assert isinstance(model, cls)
    return model


#: networks built so far, by (class, path, sha256); at most MAX_BUILT (oldest dropped)
_BUILT: dict[tuple[str, str, str], nn.Module] = {}
MAX_BUILT = 8


def _build(cls: type[N], path: str, hint: str) -> N:
    """Build the model from a file whose hash was already checked."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise CodecError(f"cannot decode {path} as safetensors: {err}. {hint}.") from None
    model = cls()
    expected = model.state_dict()
    if set(tensors) != set(expected):
        missing = sorted(set(expected) - set(tensors))
        extra = sorted(set(tensors) - set(expected))
        raise CodecError(
            f"{path}: tensor names differ (missing {missing}, unexpected {extra}). {hint}."
        )
    for key, t in tensors.items():
        if t.shape != expected[key].shape or t.dtype != expected[key].dtype:
            raise CodecError(
                f"{path}: tensor {key} is {t.dtype}{tuple(t.shape)}, expected "
                f"{expected[key].dtype}{tuple(expected[key].shape)}. {hint}."
            )
    model.load_state_dict(tensors)
    model.eval()
    model.requires_grad_(False)
    return model
