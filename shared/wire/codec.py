"""Tensor codecs: safetensors bytes with a sha256, and nothing else (never pickle).

``encode_tensors`` produces deterministic bytes for a ``{name: tensor}`` dict (sorted keys,
contiguous CPU tensors); ``decode_tensors`` checks the hash when given one, parses with
safetensors, refuses non-finite values and, given an ``expected`` spec, wrong names, shapes
or dtypes. Every failure is a :class:`~shared.errors.CodecError`.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import mmap
import os
import re
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.atomic import atomic_write, atomic_write_with
from shared.errors import CodecError
from shared.wire import staged as staged_files

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that need it: the hash helpers and the metadata
# reader here serve the torch-free sampling path of the device agent (DESIGN section 5).
#: named tensors as they cross the wire (torch tensors; typed loosely so the module needs no
#: torch)
TensorDict = dict[str, Any]
MAX_METADATA_BYTES = 64 * 1024


class MappedBlob(mmap.mmap):
    """A blob's bytes in a file, mapped privately: its pages are read in as they are used
    and given back with :meth:`drop_pages` (a write to the map, as to a ``bytes`` nobody
    should change either, copies the page and never reaches the file). ``sha256`` is the
    hash of the bytes, computed as they were written; ``path`` names the file until a blob
    store adopts it as its disk copy (:meth:`~shared.transport.blobs.BlobStore.put`). A file
    no store adopted is kept to be written over, or removed, once the map is collected
    (:mod:`shared.wire.staged`). ``origin`` is a store's disk copy the map was made of, with
    its identity (inode, size, modification time) then: another store on the same file
    system links it instead of copying it."""

    sha256: str
    path: Path | None
    origin: tuple[Path, tuple[int, int, int]] | None = None

    @classmethod
    def of_file(cls, fd: int, sha256: str, staged: Path | None = None) -> MappedBlob:
        """Map the whole of open file ``fd`` (holding the bytes of ``sha256``); ``staged``
        names it where it is a staged file, not yet any store's disk copy."""
        blob = cls(fd, 0, access=mmap.ACCESS_COPY)
        blob.sha256, blob.path = sha256, staged
        if staged is not None:
            # kept to write the next blob over (staged.py); a no-op once a store renamed it
            weakref.finalize(blob, staged_files.finished, staged)
        return blob

    def drop_pages(self, start: int = 0, length: int | None = None) -> None:
        """Give back the pages wholly inside ``[start, start + length)`` (all by default):
        they are read from the file again if used."""
        end = len(self) if length is None else min(len(self), start + length)
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        last = end // mmap.PAGESIZE * mmap.PAGESIZE if end < len(self) else len(self)
        if last > first and not self.closed:
            self.madvise(mmap.MADV_DONTNEED, first, last - first)


class MappedViews(dict[str, "torch.Tensor"]):
    """Tensors that are views of a :class:`MappedBlob` (:func:`decode_tensors` with
    ``copy=False``): a reader that is done with one for now gives its pages back with
    :meth:`release` (a streaming fold, a tensor at a time); they are read in again if used.
    Like any views of a blob's bytes they are never written to."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], blob: MappedBlob) -> None:
        import torch

        super().__init__(tensors)
        self.blob = blob
        self._base = torch.frombuffer(blob, dtype=torch.uint8, count=1).data_ptr()

    def release(self, t: torch.Tensor) -> None:
        """Give back the pages of ``t`` (one of these views; anything else is left alone)."""
        start = t.data_ptr() - self._base
        nbytes = t.numel() * t.element_size()
        if 0 <= start and start + nbytes <= len(self.blob):
            self.blob.drop_pages(start, nbytes)


Blob = bytes | mmap.mmap
"""A blob's bytes: in memory, or (a large blob received or encoded into a file) a
:class:`MappedBlob` of that file, whose pages the kernel reads in as they are used and can
drop again."""


def sha256_hex(data: bytes | bytearray | memoryview | mmap.mmap) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class TensorSpec:
    """Expected dtype and shape of one named tensor. ``bits``: the tensor is ``bits`` bits
    packed into uint8 bytes by :func:`pack_bits` (shape ``[ceil(bits / 8)]``), and its
    padding bits must be zero."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    bits: int | None = None


def packed_spec(bits: int) -> TensorSpec:
    """The spec of ``bits`` bits as :func:`pack_bits` packs them."""
    import torch

    if bits < 1:
        raise ValueError(f"a packed bit vector holds at least one bit, not {bits}")
    return TensorSpec(((bits + 7) // 8,), torch.uint8, bits)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a tensor of 0/1 values (any shape, read flat in C order) into uint8 bytes.

    Bit order (the wire's, and the compact artifact's): element ``8 j + i`` is bit ``i``
    (value ``1 << i``) of byte ``j`` -- little bit order, as ``numpy.packbits(...,
    bitorder="little")``. A length that is not a multiple of 8 is padded with zero bits."""
    import torch

    flat = mask.detach().reshape(-1).to("cpu")
    if flat.numel() == 0:
        raise ValueError("nothing to pack")
    bits = flat.to(torch.uint8)
    if bool((bits > 1).any()):
        raise ValueError("pack_bits takes 0/1 values only")
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    return (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The first ``bits`` bits of :func:`pack_bits`'s bytes as a flat uint8 tensor of 0/1.
    CodecError when the byte count is not ``ceil(bits / 8)`` or a padding bit is set."""
    import torch

    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != (bits + 7) // 8:
        raise CodecError(
            f"a packed vector of {bits} bits is {(bits + 7) // 8} uint8 bytes, "
            f"got {packed.dtype} {list(packed.shape)}"
        )
    shifts = torch.arange(8, dtype=torch.uint8)
    out = (packed.reshape(-1, 1) >> shifts) & 1
    out = out.reshape(-1)
    if bool(out[bits:].any()):
        raise CodecError(f"non-zero padding bit after bit {bits} of a packed vector")
    return out[:bits]


def spec_bytes(spec: Mapping[str, TensorSpec]) -> int:
    """Bytes of the tensor data of ``spec`` (no header)."""
    return sum(math.prod(t.shape) * t.dtype.itemsize for t in spec.values())


def encoded_size_limit(spec: Mapping[str, TensorSpec]) -> int:
    """The most bytes :func:`encode_tensors` can produce for tensors of ``spec``: their data,
    a generous header per tensor (name, dtype, shape, offsets) and the metadata limit. A blob
    declared larger than this cannot be a valid encoding of ``spec``: refuse it before
    downloading a byte of it."""
    header = sum(2 * len(name) + 128 + 24 * len(t.shape) for name, t in spec.items())
    return spec_bytes(spec) + header + 8 + MAX_METADATA_BYTES + 64  # + length, padding


def spec_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """The spec a decoder should enforce for tensors shaped like ``tensors``."""
    return {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in tensors.items()}


def encode_tensors(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> bytes:
    """Serialize to safetensors bytes; identical inputs give identical bytes."""
    from safetensors.torch import save as st_save

    ordered = {k: tensors[k].detach().to("cpu").contiguous() for k in sorted(tensors)}
    meta = dict(metadata or {})
    if len(json.dumps(meta)) > MAX_METADATA_BYTES:
        raise CodecError(f"metadata larger than {MAX_METADATA_BYTES} bytes")
    fast = _encode_direct(ordered, meta)
    if fast is not None:
        return fast
    return st_save(ordered, metadata=meta or None)


#: the dtypes :func:`_encode_direct` writes, in the order the safetensors library lays them
#: out (its ``Dtype`` enum, descending; a tensor's place is (that order, its name))
_DIRECT_ORDER = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8", "U8", "BOOL")
_PLAIN = re.compile(r"[ -!#-\[\]-~]*")  # printable ASCII without '"' and '\\'


def _direct_layout(
    tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str] | None = None
) -> tuple[bytes, list[str]] | None:
    """The length-prefixed header ``safetensors.torch.save`` writes for ``tensors`` and the
    order their data follows in, or None for anything outside what :func:`_encode_direct`
    lays out exactly as the library does (a dtype not in :data:`_DIRECT_ORDER`, a tensor
    name that JSON would escape). Metadata comes first, in sorted key order (the library
    writes it in no fixed order; readers do not care)."""
    names: dict[str, str] = {}
    for name, t in tensors.items():
        dtype = _SAFETENSORS_NAMES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None or not _PLAIN.fullmatch(name):
            return None
        names[name] = dtype
    meta = dict(meta or {})
    rank = {d: i for i, d in enumerate(_DIRECT_ORDER)}
    order = sorted(tensors, key=lambda n: (rank[names[n]], n))
    entries, offset = [], 0
    if meta:
        inner = ",".join(
            f"{json.dumps(k, ensure_ascii=False)}:{json.dumps(v, ensure_ascii=False)}"
            for k, v in sorted(meta.items())
        )
        entries.append(f'"__metadata__":{{{inner}}}')
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        shape = ",".join(str(d) for d in t.shape)
        entries.append(f'"{name}":{{"dtype":"{names[name]}","shape":[{shape}],'
                       f'"data_offsets":[{offset},{offset + size}]}}')  # fmt: skip
        offset += size
    header = ("{" + ",".join(entries) + "}").encode("utf-8")
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header, order


def _data_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    import torch

    return t.reshape(-1).view(torch.uint8).numpy().data


def _encode_direct(
    tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str] | None = None
) -> bytes | None:
    """The bytes ``safetensors.torch.save`` writes for ``tensors`` (contiguous, on the CPU),
    written straight into one growing buffer that becomes the result: one copy of the data
    where the library makes three. None (the caller uses the library) where
    :func:`_direct_layout` is. ``tests/test_codec.py`` holds the two equal."""
    layout = _direct_layout(tensors, meta)
    if layout is None:
        return None
    out = io.BytesIO()
    for part in _direct_parts(tensors, layout):
        out.write(part)
    return out.getvalue()  # written in order: CPython hands over its buffer, no copy


def _direct_parts(
    tensors: Mapping[str, torch.Tensor], layout: tuple[bytes, list[str]]
) -> Iterator[bytes | memoryview]:
    """The pieces of :func:`_encode_direct`'s bytes in order: the header of ``layout``
    (:func:`_direct_layout`), then each tensor's data, without a copy."""
    header, order = layout
    yield header
    for name in order:
        if tensors[name].numel():
            yield _data_of(tensors[name])


def encoded_size(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes :func:`encode_tensors` gives for ``tensors`` without metadata (an upper bound
    within a header's length where the library encodes them)."""
    layout = _direct_layout(tensors)
    head = len(layout[0]) if layout is not None else 8 + 160 * len(tensors)
    return head + sum(t.numel() * t.element_size() for t in tensors.values())


def encode_tensors_to_file(tensors: Mapping[str, torch.Tensor], path: Path) -> MappedBlob:
    """:func:`encode_tensors` written to staged file ``path`` (new, or kept to be written
    over: :mod:`shared.wire.staged`) instead of memory (hashed as it is written), returned
    as a :class:`MappedBlob` of it holding none of its pages: a role that puts a large blob
    keeps no copy of its bytes in memory. Raises OSError when the file cannot be written
    (nothing is left behind)."""
    ordered = {k: tensors[k].detach().to("cpu").contiguous() for k in sorted(tensors)}
    layout = _direct_layout(ordered)
    h = hashlib.sha256()
    fd = staged_files.open_staged(path)  # a new file, or a kept one written over
    try:
        with os.fdopen(os.dup(fd), "wb") as fh:
            if layout is None:  # a layout only the library writes: through memory
                data = encode_tensors(ordered)
                fh.write(data)
                h.update(data)
            else:
                for part in _direct_parts(ordered, layout):
                    fh.write(part)
                    h.update(part)
            fh.flush()
            os.ftruncate(fd, fh.tell())  # the end of a longer blob written there before
        blob = MappedBlob.of_file(fd, h.hexdigest(), path)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return blob


def write_tensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """:func:`encode_tensors` written to ``path`` atomically (a temporary file beside it,
    synced, then renamed), a tensor at a time: no copy of a model's bytes is built in
    memory first (a checkpoint written every round would take fresh pages for one)."""
    ordered = {k: tensors[k].detach().to("cpu").contiguous() for k in sorted(tensors)}
    meta = dict(metadata or {})
    if len(json.dumps(meta)) > MAX_METADATA_BYTES:
        raise CodecError(f"metadata larger than {MAX_METADATA_BYTES} bytes")
    layout = _direct_layout(ordered, meta)
    if layout is None:  # a layout only the library writes: through memory
        atomic_write(path, encode_tensors(ordered, meta))
        return
    atomic_write_with(path, lambda fh: fh.writelines(_direct_parts(ordered, layout)))


def write_asset(path: Path, tensors: Mapping[str, torch.Tensor], info: Mapping[str, Any]) -> str:
    """Write weights the repository ships (``shared/assets``): safetensors with ``info`` as
    one JSON metadata entry (one key, so the bytes do not depend on dict order), atomically
    and world-readable, plus a ``.json`` sidecar ``{"sha256": ..., **info}``. Returns the
    file's sha256, the value the loader checks."""
    data = encode_tensors(tensors, {"estuary": json.dumps(dict(info), sort_keys=True)})
    atomic_write(path, data)
    os.chmod(path, 0o644)
    digest = sha256_hex(data)
    sidecar = json.dumps({"sha256": digest, **info}, indent=2) + "\n"
    atomic_write(path.with_suffix(".json"), sidecar.encode())
    os.chmod(path.with_suffix(".json"), 0o644)
    return digest


#: elements per step of the checks and copies a role makes over a whole model: fewer than
#: PyTorch's grain size (32,768), so each op runs on the calling thread alone. An op over
#: more elements is an OpenMP parallel region whose end waits for every thread of the pool;
#: where a neighbour's job has taken a core, each such wait can last a scheduler time
#: slice, and the hundreds of tensors of a model made a check many times slower instead of
#: slower by the CPU lost (``benchmarks/round_phases.py --load 1``)
SERIAL_CHUNK = 1 << 14

#: elements per step of :func:`all_finite`'s NumPy check (its boolean temporary, 64 KiB,
#: stays in the CPU's cache)
FINITE_CHUNK = 1 << 16

#: the float dtypes NumPy reads in place (torch's names), checked and copied by NumPy: its
#: element loops are vectorized and never leave the calling thread
_NUMPY_FLOATS = frozenset({"float32", "float64", "float16"})


def _numpy_view(t: torch.Tensor) -> Any:
    """``t`` (on the CPU, any strides) as a NumPy array of the same memory, or None for a
    tensor NumPy cannot read in place (bfloat16, another device)."""
    if t.device.type != "cpu" or str(t.dtype).removeprefix("torch.") not in _NUMPY_FLOATS:
        return None
    return t.detach().numpy()


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of the floating-point tensor ``t`` is finite, checked on the
    calling thread: by NumPy, :data:`FINITE_CHUNK` elements at a time (float16/32/64, about
    8x faster than torch's check), else :data:`SERIAL_CHUNK` elements at a time by torch."""
    import torch

    flat = t.reshape(-1)
    arr = _numpy_view(flat)
    if arr is not None:
        import numpy as np

        for i in range(0, arr.size, FINITE_CHUNK):
            if not np.isfinite(arr[i : i + FINITE_CHUNK]).all():
                return False
        return True
    for i in range(0, flat.numel(), SERIAL_CHUNK):
        if not bool(torch.isfinite(flat[i : i + SERIAL_CHUNK]).all()):
            return False
    return True


def serial_copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for flat contiguous tensors of the same size and dtype, on the
    calling thread (NumPy's copy, else :data:`SERIAL_CHUNK` elements at a time); returns
    ``dst``."""
    d, s = _numpy_view(dst), _numpy_view(src)
    if d is not None and s is not None and d.dtype == s.dtype:
        import numpy as np

        np.copyto(d, s)
        return dst
    for i in range(0, dst.numel(), SERIAL_CHUNK):
        dst[i : i + SERIAL_CHUNK].copy_(src[i : i + SERIAL_CHUNK])
    return dst


def serial_clone(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (contiguous, same shape and dtype) made on the calling thread
    (:func:`serial_copy`)."""
    import torch

    out = torch.empty(t.shape, dtype=t.dtype)
    serial_copy(out.reshape(-1), t.detach().reshape(-1))
    return out


def decode_tensors(
    data: Blob,
    *,
    sha256: str | None = None,
    expected: Mapping[str, TensorSpec] | None = None,
    allow_nonfinite: bool = False,
    partial: bool = False,
    copy: bool = True,
) -> TensorDict:
    """Parse safetensors bytes, verifying hash, finiteness and (optionally) the spec; with
    ``partial`` a non-empty subset of the spec's names is accepted.

    With ``copy`` False the tensors are read-only views of ``data`` (no second buffer): for
    a caller that only reads them and drops them with the bytes (an aggregator folding an
    upload into its sum). Writing to such a tensor writes into ``data``."""
    from safetensors import SafetensorError
    from safetensors.torch import load as st_load

    if sha256 is not None and sha256_hex(data) != sha256:
        raise CodecError(f"sha256 mismatch: expected {sha256[:16]}…, got {sha256_hex(data)[:16]}…")
    try:
        if not copy:
            tensors = _views(data)
        elif isinstance(data, bytes):
            tensors = st_load(data)
        else:  # mapped: copied from views of the map, each one's pages given back at once
            views = MappedViews(_views(data), data) if isinstance(data, MappedBlob) else None
            tensors = {}
            for name, t in (views or _views(data)).items():
                tensors[name] = serial_clone(t)  # on this thread (see SERIAL_CHUNK)
                if views is not None:
                    views.release(t)
    except (SafetensorError, ValueError, RuntimeError, KeyError, TypeError) as err:
        # KeyError: a header dtype this torch has no mapping for (F8_E8M0, F4, ...)
        raise CodecError(f"not a valid safetensors payload: {type(err).__name__}: {err}") from None
    if expected is not None:
        check_spec(tensors, expected, partial=partial)
    # a mapped blob's views give their pages back once checked: the caller reads them in
    # again as it uses them (so two uploads checked at once hold a tensor each, not all)
    mapped = None
    if isinstance(data, MappedBlob) and not copy and len(data):
        tensors = mapped = MappedViews(tensors, data)
    if not allow_nonfinite:
        for name, t in tensors.items():
            if not t.is_floating_point():
                continue
            try:
                finite = all_finite(t)
            except RuntimeError as err:  # a float dtype without isfinite (float8 variants)
                raise CodecError(f"tensor {name!r} of {t.dtype}: {err}") from None
            if not finite:
                raise CodecError(f"tensor {name!r} holds NaN or Inf")
            if mapped is not None:
                mapped.release(t)
    return tensors


#: safetensors dtype names -> torch dtype names (what :func:`_views` reads and
#: :func:`_encode_direct` writes)
_VIEW_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip
_SAFETENSORS_NAMES = {torch_name: name for name, torch_name in _VIEW_DTYPES.items()}


def _header(data: bytes | bytearray | memoryview) -> tuple[int, Any]:
    """``(n, header)``: the length and the parsed JSON of a safetensors payload's header
    (CodecError when the payload is too short, the length out of range or the JSON bad)."""
    if len(data) < 8:
        raise CodecError("payload too short for safetensors")
    n = int.from_bytes(data[:8], "little")
    if n > min(len(data) - 8, 100 * 2**20):
        raise CodecError("safetensors header length out of range")
    try:
        return n, json.loads(bytes(data[8 : 8 + n]))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CodecError(f"bad safetensors header: {err}") from None


def _views(data: bytes | bytearray | memoryview | mmap.mmap) -> TensorDict:
    """The tensors of safetensors ``data`` as views of its bytes, with the checks the
    safetensors library makes: a header in range, known dtypes, each tensor's byte range
    matching its shape, the ranges covering the data exactly, in order, without overlap."""
    import warnings

    import torch

    buf = memoryview(data).cast("B")
    n, header = _header(buf)
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    header.pop("__metadata__", None)
    start, size = 8 + n, len(buf) - 8 - n
    entries = []
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise ValueError(f"entry {name!r} is not an object")
        dtype_name, shape = entry.get("dtype"), entry.get("shape")
        offsets = entry.get("data_offsets")
        if dtype_name not in _VIEW_DTYPES:
            raise KeyError(f"dtype {dtype_name!r} of {name!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ValueError(f"bad shape of {name!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets)):  # fmt: skip
            raise ValueError(f"bad data_offsets of {name!r}")
        dtype = getattr(torch, _VIEW_DTYPES[dtype_name])
        numel = math.prod(shape)
        if offsets[1] - offsets[0] != numel * dtype.itemsize:
            raise ValueError(f"{name!r}: {offsets[1] - offsets[0]} bytes for {numel} elements")
        entries.append((offsets[0], offsets[1], name, dtype, shape))
    entries.sort()
    end = 0
    for begin, stop, name, _, _ in entries:
        if begin != end:
            raise ValueError(f"{name!r} starts at {begin}, not at {end}: gap or overlap")
        end = stop
    if end != size:
        raise ValueError(f"tensors cover {end} of {size} data bytes")
    out: TensorDict = {}
    with warnings.catch_warnings():  # a bytes buffer is read-only: the views are read only
        warnings.simplefilter("ignore", UserWarning)
        for begin, stop, name, dtype, shape in entries:
            if stop == begin:
                out[name] = torch.empty(shape, dtype=dtype)
                continue
            flat = torch.frombuffer(buf, dtype=dtype, count=(stop - begin) // dtype.itemsize,
                                    offset=start + begin)  # fmt: skip
            out[name] = flat.view(shape)
    return out


def check_spec(
    tensors: Mapping[str, torch.Tensor],
    expected: Mapping[str, TensorSpec],
    *,
    partial: bool = False,
) -> None:
    """CodecError unless ``tensors`` has exactly the names (with ``partial``: a non-empty
    subset of them), shapes and dtypes of ``expected``."""
    missing = [] if partial else sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra or not tensors:
        raise CodecError(f"tensor names differ: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, t in tensors.items():
        spec = expected[name]
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise CodecError(
                f"tensor {name!r}: expected {spec.dtype} {list(spec.shape)}, "
                f"got {t.dtype} {list(t.shape)}"
            )
        if spec.bits is not None and spec.bits % 8:
            last = int(t[-1])  # the padding bits are the high bits of the last byte
            if last >> (spec.bits % 8):
                raise CodecError(f"tensor {name!r}: non-zero padding bit after bit {spec.bits}")


def read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors payload, without loading tensors."""
    _, header = _header(data)
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else {}
    return {str(k): str(v) for k, v in meta.items()}


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
