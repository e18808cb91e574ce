"""Atomic checkpoints: safetensors weights plus the config used and the round, written to a
temporary file and renamed into place so a crash never leaves a half-written checkpoint.

Layout under ``DIR``: ``round_000004.safetensors`` holds the model after the fourth round (file
names and ``latest.json`` count rounds from 1, as every figure a person reads does), and
``latest.json`` points at the newest one (written after it, also atomically). Inside, the
metadata's ``round`` is the protocol's 0-based index of that round (3 for the fourth), which is
what a resume continues after.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.atomic import atomic_write
from shared.config import RunConfig, config_from_dict
from shared.errors import CodecError, EstuaryError
from shared.models.plan import ChannelPlan, model_spec, parse_plan
from shared.wire.codec import (
    check_spec,
    decode_tensors,
    encode_tensors,
    read_metadata,
    sha256_hex,
    write_tensors,
)

__all__ = [
    "Checkpoint",
    "CheckpointWriter",
    "atomic_write",
    "checkpoint_name",
    "decode_checkpoint",
    "is_checkpoint",
    "latest_checkpoint_path",
    "load_checkpoint",
    "save_checkpoint",
]

MODEL_PREFIX = "model/"
STATE_PREFIX = "algo/"
CHECKPOINT_FORMAT = "estuary-checkpoint-v1"


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint."""

    #: 0-based index of the round it was saved after (people read ``round + 1``)
    round: int
    model: dict[str, torch.Tensor]
    algo_state: dict[str, torch.Tensor]
    config: RunConfig
    model_sha256: str
    path: Path
    plan: ChannelPlan | None = None  # channel plan of a pruned model; None = dense
    #: :func:`shared.models.init.init_fingerprint` of the run's ``model.init`` when it was saved
    #: (None in checkpoints written before it was recorded)
    init: str | None = None


def model_digest(model: dict[str, torch.Tensor]) -> str:
    """sha256 of the canonical safetensors encoding of a model state."""
    return sha256_hex(encode_tensors(model))


def checkpoint_name(round_: int) -> str:
    """File name of the checkpoint after the round of 0-based index ``round_``:
    ``round_000004.safetensors`` after the fourth round."""
    return f"round_{round_ + 1:06d}.safetensors"


def save_checkpoint(
    directory: Path,
    round_: int,
    model: dict[str, torch.Tensor],
    cfg: RunConfig,
    algo_state: dict[str, torch.Tensor] | None = None,
    plan: ChannelPlan | None = None,
    init: str | None = None,
    model_sha256: str | None = None,
) -> Path:
    """Write :func:`checkpoint_name` of ``round_`` (the 0-based index of the round just
    finished) and update ``latest.json``; returns the file path.

    ``init`` is the :func:`~shared.models.init.init_fingerprint` of ``cfg.model.init`` (what the
    run started from, by content), recorded so that a resume can tell a moved init file from
    another one. ``model_sha256``: the model's :func:`model_digest` when the caller has it
    (the hash of the global blob it put), else computed here."""
    tensors = {MODEL_PREFIX + k: v for k, v in model.items()}
    tensors.update({STATE_PREFIX + k: v for k, v in (algo_state or {}).items()})
    meta = {
        "round": str(round_),
        "config": cfg.to_json(),
        "model_sha256": model_sha256 or model_digest(model),
        "format": CHECKPOINT_FORMAT,
    }
    if plan is not None:
        meta["arch"] = json.dumps(plan.doc, sort_keys=True)
    if init is not None:
        meta["init"] = init
    path = directory / checkpoint_name(round_)
    write_tensors(path, tensors, meta)  # streamed: no copy of the model's bytes in memory
    pointer = {"round": round_ + 1, "file": path.name, "model_sha256": meta["model_sha256"]}
    atomic_write(directory / "latest.json", json.dumps(pointer, indent=2).encode())
    return path


class CheckpointWriter:
    """Writes checkpoints one at a time, in order, on a thread of its own (``background``)
    or inline: a role announces its next round while the last checkpoint is written, and
    :meth:`wait` (before anything that depends on that checkpoint) joins it. A write that
    fails raises from :meth:`wait` or the next :meth:`write`, in the caller's thread."""

    def __init__(self, *, background: bool = True) -> None:
        self.background = background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def write(self, fn: Callable[[], object], *, inline: bool = False) -> None:
        """Run ``fn`` (a checkpoint write) after the previous one finished: on the writer's
        thread, or here with ``inline`` (or without ``background``)."""
        self.wait()
        if inline or not self.background:
            fn()
            return

        def run() -> None:
            try:
                fn()
            except BaseException as err:  # handed to the role's thread by wait()
                self._error = err

        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float = 600.0) -> None:
        """Until the write under way (if any) is on disk; re-raises its error. A write that
        takes longer than ``timeout_s`` is an EstuaryError (a disk that stopped)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                self._thread = thread
                raise EstuaryError(f"a checkpoint write took longer than {timeout_s:.0f} s")
        error, self._error = self._error, None
        if error is not None:
            raise error


def latest_checkpoint_path(directory: Path) -> Path | None:
    """Path named by ``latest.json`` (or the newest round file), or None."""
    pointer = directory / "latest.json"
    if pointer.is_file():
        try:
            name = json.loads(pointer.read_text())["file"]
            # a bare file name of this directory (never a path out of it)
            if isinstance(name, str) and name == Path(name).name and (directory / name).is_file():
                return directory / name
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
    files = sorted(directory.glob("round_*.safetensors"))
    return files[-1] if files else None


def is_checkpoint(data: bytes) -> bool:
    """Whether safetensors bytes carry the Estuary checkpoint format tag."""
    return read_metadata(data).get("format") == CHECKPOINT_FORMAT


def checkpoint_of(source: Path) -> Path:
    """The checkpoint ``source`` names: a run directory's latest, or the file itself;
    EstuaryError when there is none."""
    path = latest_checkpoint_path(source / "checkpoints") if source.is_dir() else source
    if path is None or not path.is_file():
        raise EstuaryError(f"no checkpoint found in {source}")
    return path


def load_checkpoint(path: Path) -> Checkpoint:
    """Load and verify a checkpoint file (safetensors only; nothing is unpickled)."""
    return decode_checkpoint(path.read_bytes(), path)


def decode_checkpoint(data: bytes, path: Path) -> Checkpoint:
    """Verify and split checkpoint bytes read from ``path`` (named in errors)."""
    meta = read_metadata(data)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CodecError(f"{path} is not an Estuary checkpoint")
    tensors = decode_tensors(data)
    model = {k[len(MODEL_PREFIX) :]: v for k, v in tensors.items() if k.startswith(MODEL_PREFIX)}
    state = {k[len(STATE_PREFIX) :]: v for k, v in tensors.items() if k.startswith(STATE_PREFIX)}
    digest = model_digest(model)
    if digest != meta.get("model_sha256"):
        raise CodecError(f"{path}: model hash differs from the recorded one ({digest[:12]}…)")
    try:
        cfg = config_from_dict(json.loads(meta["config"]), source=f"{path} metadata", stored=True)
        round_ = int(meta["round"])
    except (KeyError, ValueError) as err:
        raise CodecError(f"{path}: round or config missing from the metadata ({err})") from None
    try:
        doc = json.loads(meta["arch"]) if "arch" in meta else None
    except json.JSONDecodeError as err:
        raise CodecError(f"{path}: unreadable architecture plan: {err}") from None
    try:
        plan = parse_plan(cfg.model.preset, doc)
    except EstuaryError as err:
        raise CodecError(f"{path}: bad architecture plan: {err}") from None
    _check_fits(model, cfg, plan, path)
    init = meta.get("init")
    return Checkpoint(round_, model, state, cfg, digest, path, plan, init)


def _check_fits(
    model: Mapping[str, torch.Tensor], cfg: RunConfig, plan: ChannelPlan | None, path: Path
) -> None:
    """CodecError unless ``model`` holds every tensor of ``cfg``'s preset under ``plan`` with
    its shape (a method's extra global tensors may follow); for a method whose state stands
    for the model instead of holding its tensors (PRISM's probabilities), every tensor of its
    global state (:meth:`~shared.methods.api.StateFormat.global_spec`)."""
    from shared.methods.registry import make_algorithm

    preset = cfg.model.preset
    spec = model_spec(preset, plan)
    state = make_algorithm(cfg).format.global_spec(spec)
    if not set(spec) <= set(state):  # a state standing for the model: its own tensors
        spec = state
    try:
        check_spec({k: v for k, v in model.items() if k in spec}, spec)
    except CodecError as err:
        arch = "dense" if plan is None else "its channel plan"
        raise CodecError(f"{path}: the weights do not fit {arch} of {preset!r}: {err}") from None
