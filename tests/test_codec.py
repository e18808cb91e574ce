from __future__ import annotations

import gc
import json
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.errors import CodecError
from shared.wire.codec import (
    FINITE_CHUNK,
    SERIAL_CHUNK,
    MappedBlob,
    TensorSpec,
    all_finite,
    decode_tensors,
    encode_tensors,
    encode_tensors_to_file,
    read_metadata,
    serial_clone,
    serial_copy,
    sha256_hex,
    spec_of,
    write_tensors,
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


def _mixed() -> dict[str, torch.Tensor]:
    """Every dtype the direct writer lays out, names in and out of order, empty tensors."""
    g = torch.Generator().manual_seed(0)
    return {
        "b.weight": torch.randn(3, 4, generator=g),
        "a": torch.randn(2, generator=g).double(),
        "steps": torch.arange(3),
        "c": torch.arange(4, dtype=torch.int32),
        "h": torch.randn(3, generator=g).half(),
        "bf": torch.randn(3, generator=g).bfloat16(),
        "i16": torch.arange(3, dtype=torch.int16),
        "i8": torch.arange(3, dtype=torch.int8),
        "mask": torch.arange(5, dtype=torch.uint8),
        "flag": torch.tensor(True),
        "empty": torch.empty(0, 3),
        "aa": torch.randn(1, generator=g),
    }


def test_direct_writer_gives_the_libraries_bytes() -> None:
    """encode_tensors writes what safetensors.torch.save writes, byte for byte (hashes and
    checkpoints of earlier runs stay valid), for every dtype it lays out itself."""
    from safetensors.torch import save

    from shared.wire.codec import _encode_direct

    for tensors in (_mixed(), {"x": torch.randn(4, 5, 6)}, {}, {"only_empty": torch.empty(0)}):
        ordered = {k: tensors[k].contiguous() for k in sorted(tensors)}
        assert _encode_direct(ordered) == save(ordered)
        assert encode_tensors(tensors) == save(ordered)
    # what it does not lay out goes to the library
    assert _encode_direct({'say "hi"': torch.ones(1)}) is None
    assert _encode_direct({"c64": torch.ones(1, dtype=torch.complex64)}) is None


def test_views_decode_what_copies_decode_and_refuse_what_they_refuse() -> None:
    data = encode_tensors(_mixed())
    copied, viewed = decode_tensors(data), decode_tensors(data, copy=False)
    assert list(sorted(copied)) == list(sorted(viewed))
    for k, t in copied.items():
        assert viewed[k].dtype == t.dtype and torch.equal(viewed[k], t), k
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    bad_offsets = dict(header, aa={**header["aa"], "data_offsets": [0, 4]})  # overlaps
    for broken in (data[:-1], data[:8] + b"[" + data[9:], _with_header(data, bad_offsets)):
        with pytest.raises(CodecError):
            decode_tensors(broken, copy=False)


def _with_header(data: bytes, header: dict[str, Any]) -> bytes:
    """``data`` with its safetensors header replaced by ``header`` (padded to 8 bytes)."""
    n = int.from_bytes(data[:8], "little")
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]


def _rss_file_pages_kib() -> int:
    """This process's resident pages of mapped files (RssFile), in KiB."""
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


def test_a_blob_encoded_to_a_file_is_the_same_blob_and_gives_its_pages_back(
    tmp_path: Path,
) -> None:
    """encode_tensors_to_file writes encode_tensors' bytes (the same sha256, computed as it
    writes; the library's layout included), maps them without reading them in, and decoding
    views of the map gives each checked tensor's pages back, where copies give all of them
    back; the staged file goes when the map does."""
    big = {"w": torch.randn(1024, 1024), "b": torch.arange(7, dtype=torch.int64)}
    for i, tensors in enumerate((_mixed(), big, {'say "hi"': torch.ones(3)})):
        path = tmp_path / f"{i}.part"
        blob = encode_tensors_to_file(tensors, path)
        assert isinstance(blob, MappedBlob) and blob.path == path
        assert blob[:] == encode_tensors(tensors) and blob.sha256 == sha256_hex(blob[:])
        del blob
        gc.collect()
        assert not path.exists()

    # a first decode of each kind reads in the code it runs (library pages are RssFile too)
    warm = encode_tensors_to_file(big, tmp_path / "warm.part")
    decode_tensors(warm, copy=False)
    decode_tensors(warm)
    blob = encode_tensors_to_file(big, tmp_path / "big.part")
    before = _rss_file_pages_kib()
    viewed = decode_tensors(blob, copy=False)
    assert _rss_file_pages_kib() - before < 1024  # 4 MiB checked, its pages given back
    assert torch.equal(viewed["w"], big["w"])  # read in again as used
    assert _rss_file_pages_kib() - before >= 3 * 1024
    copied = decode_tensors(blob)
    assert _rss_file_pages_kib() - before < 1024 and torch.equal(copied["w"], big["w"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_all_finite_finds_every_non_finite_value_on_either_path(dtype: torch.dtype) -> None:
    # NumPy checks float16/32/64 in FINITE_CHUNK steps, torch checks bfloat16 in
    # SERIAL_CHUNK steps: a bad value at a chunk's first or last element, or in a short
    # last chunk, is found all the same, in contiguous and strided tensors
    n = 2 * FINITE_CHUNK + 5
    assert all_finite(torch.zeros(n, dtype=dtype))
    assert all_finite(torch.zeros(0, dtype=dtype))
    for at in (0, FINITE_CHUNK - 1, FINITE_CHUNK, SERIAL_CHUNK, n - 1):
        for bad in (float("nan"), float("inf"), float("-inf")):
            t = torch.zeros(n, dtype=dtype)
            t[at] = bad
            assert not all_finite(t), (at, bad)
            assert not all_finite(t.view(-1, 1).expand(n, 2).t()), (at, bad)  # strided


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_serial_copies_are_exact_copies(dtype: torch.dtype) -> None:
    src = (torch.randn(7 * (SERIAL_CHUNK + 3)) * 100).to(dtype)
    dst = torch.empty_like(src)
    assert serial_copy(dst, src) is dst and torch.equal(dst, src)
    clone = serial_clone(src.view(-1, 7)[:, :5])  # a strided source
    assert clone.is_contiguous() and torch.equal(clone, src.view(-1, 7)[:, :5])


def test_write_tensors_writes_encode_tensors_bytes_without_building_them(
    tmp_path: Path,
) -> None:
    """write_tensors (a checkpoint's writer) leaves exactly encode_tensors' bytes at the
    path, metadata included, for the layouts it writes itself, and the same tensors and
    metadata for one only the library writes (whose metadata order is its own); no
    temporary file stays beside them, and an existing file is replaced whole."""
    big = {"w": torch.randn(256, 256), "b": torch.arange(7, dtype=torch.int64)}
    meta = {"round": "3", "config": '{"a": 1}'}
    for i, tensors in enumerate((_mixed(), big)):
        path = tmp_path / f"{i}.safetensors"
        path.write_bytes(b"x" * 10_000_000)  # a longer file there before
        write_tensors(path, tensors, meta)
        assert path.read_bytes() == encode_tensors(tensors, meta)
    path = tmp_path / "2.safetensors"
    write_tensors(path, {'say "hi"': torch.ones(3)}, meta)
    data = path.read_bytes()
    assert torch.equal(decode_tensors(data)['say "hi"'], torch.ones(3))
    assert read_metadata(data) == meta
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{i}.safetensors" for i in range(3)]
    with pytest.raises(CodecError, match="metadata larger"):
        write_tensors(tmp_path / "x.safetensors", big, {"k": "v" * 70_000})
    assert not (tmp_path / "x.safetensors").exists()
