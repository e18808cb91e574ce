"""A device's training state on disk, so that a restarted device agent goes on where it
stopped instead of starting over.

What a device keeps between rounds lives in :attr:`DeviceAgent.algo_state`: SCAFFOLD's
control variate ``c_i``, FedDiffuse's local parts (ULATDEC's encoder never leaves the
device), MOON's previous model and, with ``train.optimizer_state = "keep"``, the optimizer's
moments. Between edge aggregations (``r_e > 1``) the device is also still training its own
model. Lost on a restart, SCAFFOLD's server variate no longer matches its devices', a
FedDiffuse device deploys an encoder back at its initialization, and the next rounds train
from the wrong place. With ``--state-dir DIR`` the agent writes all of it to
``DIR/<device>.safetensors`` after every round it trains (atomic write and rename, before
it reports the round), and reads it back when it starts.

The file is safetensors only; nothing is pickled. The state's structure (dicts with
string or integer keys, lists, tuples, numbers, strings) travels as one JSON document in
a ``uint8`` tensor, with its tensors as ``s/<index>`` and the kept model as ``m/<name>``.
The document also names the device, the run's config digest, the architecture (channel
plan), the round and session the state is from, the last update the device sent (which it
resends when the round is announced again) and its recent edge choices.

A file that cannot be used (another device's, another config's, unreadable, for an
architecture the preset refuses) is moved aside as ``<name>.<reason>-<unix time>``, never
deleted, and the agent starts afresh. So does a state from another run of the same
config: a round-0 announcement of a session other than the state's means the cloud started
the run over (a resumed cloud starts at round 1 or later), and the device drops whatever
it kept, in memory too.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shared.atomic import atomic_write
from shared.errors import StateError
from shared.wire.codec import decode_tensors, encode_tensors

log = logging.getLogger(__name__)

STATE_FORMAT = "estuary-device-state-v1"
DOC_KEY = "doc"
STATE_PREFIX = "s/"
MODEL_PREFIX = "m/"
#: the JSON document's size limit (a ddpm-cifar10 optimizer state's structure is ~60 KB)
MAX_DOC_BYTES = 16 * 2**20
#: the state file's size limit (a dense ddpm-cifar10 with kept Adam moments, SCAFFOLD's
#: variate and the kept model is ~0.7 GB)
MAX_STATE_BYTES = 4 * 2**30


# -- the structure codec ------------------------------------------------------------------
def pack(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` as JSON, its tensors appended to ``tensors`` and named by index.

    Every container is tagged (``{"T": i}`` a tensor, ``{"L": [...]}`` a list, ``{"U":
    [...]}`` a tuple, ``{"D": [[key, value], ...]}`` a dict), so a plain JSON object never
    appears and tuples and integer keys come back as they were. Raises StateError for
    anything else (a module, a non-finite float)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach().to("cpu"))
        return {"T": len(tensors) - 1}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise StateError(f"non-finite number {obj!r}")
        return obj
    if isinstance(obj, list):
        return {"L": [pack(v, tensors) for v in obj]}
    if isinstance(obj, tuple):
        return {"U": [pack(v, tensors) for v in obj]}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise StateError(f"dict key {k!r} of type {type(k).__name__}")
            items.append([k, pack(v, tensors)])
        return {"D": items}
    raise StateError(f"cannot store a {type(obj).__name__}")


def unpack(doc: Any, tensors: Mapping[int, torch.Tensor]) -> Any:
    """The inverse of :func:`pack`; StateError on anything :func:`pack` does not write."""
    if doc is None or isinstance(doc, (bool, int, str)):
        return doc
    if isinstance(doc, float):
        if not math.isfinite(doc):
            raise StateError("non-finite number")
        return doc
    if not isinstance(doc, dict) or len(doc) != 1:
        raise StateError(f"not a tagged value: {str(doc)[:60]!r}")
    ((tag, body),) = doc.items()
    if tag == "T":
        if isinstance(body, bool) or not isinstance(body, int) or body not in tensors:
            raise StateError(f"no tensor {body!r}")
        return tensors[body]
    if tag in ("L", "U", "D") and not isinstance(body, list):
        raise StateError(f"{tag}: not a list")
    if tag == "L":
        return [unpack(v, tensors) for v in body]
    if tag == "U":
        return tuple(unpack(v, tensors) for v in body)
    if tag == "D":
        out: dict[Any, Any] = {}
        for item in body:
            if not (isinstance(item, list) and len(item) == 2):
                raise StateError("D: an item is not a [key, value] pair")
            key = item[0]
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise StateError(f"D: key {key!r}")
            out[key] = unpack(item[1], tensors)
        return out
    raise StateError(f"unknown tag {tag!r}")


# -- the file ---------------------------------------------------------------------------
@dataclass
class DeviceState:
    """What :func:`save_state` writes and :func:`load_state` returns."""

    device: str
    config_digest: str
    plan: dict[str, Any] | None
    algo_state: dict[str, Any]
    #: the round and session of the last round the device trained
    round: int
    session: str
    #: the agent's ``kept_local`` (session, round, edge, edge model sha256) and the model it
    #: keeps training until its edge aggregates (None: it takes the edge's next model)
    kept_local: tuple[str, int, str, str] | None = None
    model: dict[str, torch.Tensor] | None = None
    #: the last DeviceUpdate sent, as JSON (resent when its round is announced again)
    last_update: dict[str, Any] | None = None
    #: recent edge choices: (session, round, edge)
    choices: list[tuple[str, int, str]] = field(default_factory=list)


def state_path(state_dir: Path, device: str) -> Path:
    """Where ``device`` keeps its state under ``state_dir``."""
    return state_dir / f"{device}.safetensors"


def encode_state(state: DeviceState, skip: frozenset[str] = frozenset()) -> bytes:
    """``state`` as safetensors bytes; ``skip``: entries of ``algo_state`` that are caches
    (rebuilt when missing) and are not stored. StateError when an entry cannot be stored."""
    tensors: list[torch.Tensor] = []
    entries = {}
    for key, value in state.algo_state.items():
        if key in skip:
            continue
        try:
            entries[key] = pack(value, tensors)
        except StateError as err:
            raise StateError(f"algo_state[{key!r}]: {err}") from None
    doc = {
        "format": STATE_FORMAT,
        "device": state.device,
        "config_digest": state.config_digest,
        "plan": state.plan,
        "round": state.round,
        "session": state.session,
        "state": entries,
        "kept_local": list(state.kept_local) if state.kept_local else None,
        "last_update": state.last_update,
        "choices": [list(c) for c in state.choices],
    }
    text = json.dumps(doc, sort_keys=True, allow_nan=False).encode()
    if len(text) > MAX_DOC_BYTES:
        raise StateError(f"the state's structure is {len(text)} bytes (limit {MAX_DOC_BYTES})")
    named = {f"{STATE_PREFIX}{i}": t for i, t in enumerate(tensors)}
    named.update({MODEL_PREFIX + k: v for k, v in (state.model or {}).items()})
    named[DOC_KEY] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return encode_tensors(named, {"format": STATE_FORMAT})


def decode_state(data: bytes) -> DeviceState:
    """Parse :func:`encode_state`'s bytes; StateError (or CodecError) when they do not hold
    a well-formed device state."""
    tensors = decode_tensors(data)
    raw = tensors.pop(DOC_KEY, None)
    if raw is None or raw.dtype != torch.uint8 or raw.ndim != 1:
        raise StateError("no state document")
    if raw.numel() > MAX_DOC_BYTES:
        raise StateError(f"state document of {raw.numel()} bytes (limit {MAX_DOC_BYTES})")
    try:
        doc = json.loads(bytes(raw.numpy()).decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise StateError(f"state document: {type(err).__name__}: {err}") from None
    if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT:
        raise StateError(f"not a {STATE_FORMAT} document")
    indexed: dict[int, torch.Tensor] = {}
    model: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.startswith(MODEL_PREFIX):
            model[name[len(MODEL_PREFIX) :]] = t
        elif name.startswith(STATE_PREFIX) and name[len(STATE_PREFIX) :].isdigit():
            indexed[int(name[len(STATE_PREFIX) :])] = t
        else:
            raise StateError(f"unexpected tensor {name!r}")
    try:
        entries = doc["state"]
        if not isinstance(entries, dict):
            raise StateError("state: not an object")
        algo_state = {str(k): unpack(v, indexed) for k, v in entries.items()}
        kept = doc["kept_local"]
        kept_local = None
        if kept is not None:
            s, r, e, sha = kept
            kept_local = (str(s), int(r), str(e), str(sha))
        if (kept_local is None) != (not model):
            raise StateError("a kept model without kept_local, or the reverse")
        plan = doc["plan"]
        if plan is not None and not isinstance(plan, dict):
            raise StateError("plan: not an object")
        last = doc["last_update"]
        if last is not None and not isinstance(last, dict):
            raise StateError("last_update: not an object")
        choices = [(str(s), int(r), str(e)) for s, r, e in doc["choices"]]
        return DeviceState(
            device=str(doc["device"]),
            config_digest=str(doc["config_digest"]),
            plan=plan,
            algo_state=algo_state,
            round=int(doc["round"]),
            session=str(doc["session"]),
            kept_local=kept_local,
            model=model or None,
            last_update=last,
            choices=choices,
        )
    except StateError:
        raise
    except (KeyError, TypeError, ValueError) as err:
        raise StateError(f"state document: {type(err).__name__}: {err}") from None


def save_state(path: Path, state: DeviceState, skip: frozenset[str] = frozenset()) -> int:
    """Write ``state`` to ``path`` atomically; returns the bytes written."""
    data = encode_state(state, skip)
    atomic_write(path, data)
    return len(data)


def set_aside(path: Path, reason: str) -> Path:
    """Move ``path`` out of the way as ``<name>.<reason>-<unix time>`` (never deleted)."""
    target = path.with_name(f"{path.name}.{reason}-{int(time.time())}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.{reason}-{int(time.time())}-{n}")
        n += 1
    path.replace(target)
    return target


def read_state(path: Path) -> DeviceState | None:
    """The state in ``path`` (None when there is none); StateError or CodecError when the
    file is there but unusable, OSError when it cannot be read."""
    if not path.is_file():
        return None
    size = path.stat().st_size
    if size > MAX_STATE_BYTES:
        raise StateError(f"{size} bytes (limit {MAX_STATE_BYTES})")
    return decode_state(path.read_bytes())


__all__ = [
    "DeviceState",
    "StateError",
    "decode_state",
    "encode_state",
    "pack",
    "read_state",
    "save_state",
    "set_aside",
    "state_path",
    "unpack",
]
