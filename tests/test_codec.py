from __future__ import annotations

import json
import pickle
import struct

import pytest
import torch

from shared.errors import CodecError
from shared.wire.codec import (
    TensorSpec,
    decode_tensors,
    encode_tensors,
    read_metadata,
    sha256_hex,
    spec_of,
)

T = {"b": torch.arange(3, dtype=torch.float32), "a": torch.ones(2, 2, dtype=torch.float16)}


def test_round_trip_and_determinism() -> None:
    data = encode_tensors(T, {"round": "4"})
    assert data == encode_tensors(dict(reversed(list(T.items()))), {"round": "4"})
    out = decode_tensors(data, sha256=sha256_hex(data), expected=spec_of(T))
    assert set(out) == {"a", "b"}
    assert torch.equal(out["a"], T["a"]) and out["a"].dtype == torch.float16
    assert read_metadata(data) == {"round": "4"}


def test_corrupt_bytes_rejected() -> None:
    data = bytearray(encode_tensors(T))
    with pytest.raises(CodecError, match="sha256"):
        decode_tensors(bytes(data[:-1]) + b"\x00", sha256=sha256_hex(bytes(data)))
    data[3] ^= 0xFF  # header length now nonsense
    with pytest.raises(CodecError):
        decode_tensors(bytes(data))
    with pytest.raises(CodecError):
        decode_tensors(b"garbage")


def test_pickle_payload_rejected() -> None:
    with pytest.raises(CodecError):
        decode_tensors(pickle.dumps({"a": [1, 2, 3]}))


def test_non_finite_rejected() -> None:
    with pytest.raises(CodecError, match="NaN or Inf"):
        decode_tensors(encode_tensors({"x": torch.tensor([1.0, float("nan")])}))
    with pytest.raises(CodecError, match="NaN or Inf"):
        decode_tensors(encode_tensors({"x": torch.tensor([float("inf")])}))


def test_spec_mismatch_named() -> None:
    data = encode_tensors(T)
    with pytest.raises(CodecError, match="'b'"):
        decode_tensors(data, expected={**spec_of(T), "b": TensorSpec((4,), torch.float32)})
    with pytest.raises(CodecError, match="missing"):
        decode_tensors(data, expected={**spec_of(T), "c": TensorSpec((1,), torch.float32)})
    with pytest.raises(CodecError, match="float64"):
        decode_tensors(data, expected={**spec_of(T), "b": TensorSpec((3,), torch.float64)})


@pytest.mark.parametrize(("dtype", "shape", "nbytes"), [("F8_E8M0", [4], 4), ("F4", [2], 1)])
def test_unknown_header_dtypes_are_codec_errors(dtype: str, shape: list[int], nbytes: int) -> None:
    """safetensors dtypes this torch cannot map (a KeyError inside safetensors) are refused
    as CodecError, like any other bad payload, not left to escape as KeyError."""
    header = json.dumps({"t": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}})
    payload = struct.pack("<Q", len(header)) + header.encode() + b"\0" * nbytes
    with pytest.raises(CodecError):
        decode_tensors(payload)
