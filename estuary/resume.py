"""Resuming an in-process run (``estuary simulate``, ``estuary compare``) from its latest
checkpoint.

The cloud's checkpoint holds the global state (and the method's cloud files beside it,
:class:`~shared.methods.api.StateView`); what the devices keep between rounds (optimizer
moments with ``train.optimizer_state = "keep"``, SCAFFOLD's variate, FedDiffuse's local
parts, PRISM's score optimizer, ...) lives in the devices. At every checkpoint of round
``r`` the run writes, before the checkpoint itself, ``state/round_<r+1>/`` (six digits, as
the checkpoint's name):

- ``<device>.safetensors``: every device's kept state in the ``--state-dir`` format of
  :mod:`device_agent.state`;
- ``uploads.safetensors``: the devices' uploads the cloud holds for the next round's
  personalization (pFedGPA), when there are any;
- ``progress.json``: the traffic counters and the wall time up to the checkpoint, which a
  resumed run adds to its own.

The directory is written under a temporary name and renamed into place, so a round's states
are there whole or not at all; only the states of the latest two checkpoints are kept. A
resume takes the latest checkpoint (:func:`cloud.main.resume_point`: one of another config
is refused) together with its round's states, and the resumed rounds draw what the
uninterrupted ones drew (every draw is keyed by run seed, round and device,
:mod:`shared.seeds`), so the run ends with the same final model.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.atomic import atomic_write
from shared.config import RunConfig
from shared.errors import CodecError, EstuaryError
from shared.methods.registry import make_algorithm
from shared.models.checkpoint import latest_checkpoint_path
from shared.wire.codec import decode_tensors, encode_tensors

if TYPE_CHECKING:
    from cloud.main import ResumePoint
    from estuary.simulate import Federation

log = logging.getLogger(__name__)

#: the folder of a run directory that holds the devices' states at each checkpoint
STATE_DIR = "state"
UPLOADS_FILE = "uploads.safetensors"
PROGRESS_FILE = "progress.json"


def round_state_dir(run_dir: Path, round_: int) -> Path:
    """Where the states at the checkpoint of round ``round_`` (0-based) are kept."""
    return run_dir / STATE_DIR / f"round_{round_ + 1:06d}"


class ResumeRefused(EstuaryError):
    """The run directory holds checkpoints this run cannot go on from (another config's,
    another key's): the caller starts over (``--fresh``) or uses another directory."""


@dataclass
class StateCost:
    """What writing the states at one checkpoint cost."""

    round: int
    bytes: int
    seconds: float
    devices: int


@dataclass
class Resumed:
    """A resume: the cloud's checkpoint and the progress recorded with the states."""

    point: ResumePoint
    #: the traffic counters and wall time of the run up to the checkpoint
    traffic: dict[str, dict[str, int]]
    wall_s: float

    @property
    def after_round(self) -> int:
        """The 1-based round of the checkpoint the run goes on after."""
        return self.point.next_round


def save_federation_state(
    fed: Federation, run_dir: Path, round_: int, progress: dict[str, Any]
) -> StateCost:
    """Write every device's kept state (and the cloud's held uploads) for the checkpoint of
    ``round_``, with ``progress`` (``traffic``, ``wall_s``); drop the states of checkpoints
    older than the latest one on disk."""
    t0 = time.perf_counter()
    final = round_state_dir(run_dir, round_)
    partial = final.with_name(final.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    total = 0
    session = fed.cloud.session
    for device in fed.devices:
        total += device.write_state(partial / f"{device.name}.safetensors", round_, session)
    uploads = fed.cloud.uploads
    if uploads:
        data = encode_tensors(
            {f"{dev}/{name}": t for dev, tensors in uploads.items() for name, t in tensors.items()}
        )
        atomic_write(partial / UPLOADS_FILE, data)
        total += len(data)
    doc = json.dumps(progress).encode()
    atomic_write(partial / PROGRESS_FILE, doc)
    total += len(doc)
    if final.exists():  # a rerun of that round (started over since): replaced
        shutil.rmtree(final)
    partial.rename(final)
    _prune(run_dir, keep={final.name})
    return StateCost(round_, total, time.perf_counter() - t0, len(fed.devices))


def _prune(run_dir: Path, keep: set[str]) -> None:
    """Remove the states of every round but ``keep`` and the latest checkpoint's."""
    latest = latest_checkpoint_path(run_dir / "checkpoints")
    if latest is not None:
        keep = keep | {latest.stem}
    for d in (run_dir / STATE_DIR).iterdir():
        if d.is_dir() and d.name not in keep:
            shutil.rmtree(d)


def find_resume(cfg: RunConfig, run_dir: Path) -> Resumed | None:
    """The latest checkpoint of ``cfg`` in ``run_dir`` with its devices' states, or None
    when there is no checkpoint, or none with the states (written by the MQTT cloud, or
    cut short before they were), or the method has a final step (FedDEO: it collects every
    round's uploads in memory): the run then starts over, as said in the log. A
    checkpoint of another config raises ResumeRefused (:func:`cloud.main.resume_point`'s
    refusal)."""
    from cloud.main import resume_point

    if latest_checkpoint_path(run_dir / "checkpoints") is None:
        return None
    if make_algorithm(cfg).finalizer is not None:
        # what its final step collected from the rounds (FedDEO's descriptions) is in the
        # cloud's memory only
        log.warning("%s: %s makes its product from every round's uploads, which no "
                    "checkpoint holds: starting over", run_dir, cfg.algorithm.name)  # fmt: skip
        return None
    try:
        point = resume_point(cfg, run_dir)
    except EstuaryError as err:
        raise ResumeRefused(str(err)) from None
    if point is None:
        return None
    states = round_state_dir(run_dir, point.next_round - 1)
    if not (states / PROGRESS_FILE).is_file():
        log.warning(
            "%s: the checkpoint of round %d has no device states beside it (%s): starting "
            "over", run_dir, point.next_round, states,
        )  # fmt: skip
        return None
    try:
        progress = json.loads((states / PROGRESS_FILE).read_text())
        traffic = {k: dict(v) for k, v in progress["traffic"].items()}
        wall_s = float(progress["wall_s"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise EstuaryError(f"{states / PROGRESS_FILE} is unreadable ({err}); use --fresh") from None
    return Resumed(point, traffic, wall_s)


def load_federation_state(fed: Federation, run_dir: Path, resumed: Resumed) -> None:
    """Give every device of ``fed`` its state at the checkpoint, and the cloud the uploads
    it held then. EstuaryError when a device's state is missing or unusable."""
    states = round_state_dir(run_dir, resumed.point.next_round - 1)
    for device in fed.devices:
        path = states / f"{device.name}.safetensors"
        if not path.is_file() or not device.restore_state(path):
            raise EstuaryError(
                f"{path}: no usable state of {device.name} at the checkpoint of round "
                f"{resumed.after_round}; use --fresh"
            )
    uploads_path = states / UPLOADS_FILE
    if uploads_path.is_file():
        try:
            flat = decode_tensors(uploads_path.read_bytes())
        except CodecError as err:
            raise EstuaryError(f"{uploads_path}: {err}; use --fresh") from None
        uploads: dict[str, dict[str, Any]] = {}
        for key, t in flat.items():
            dev, _, name = key.partition("/")
            uploads.setdefault(dev, {})[name] = t
        fed.cloud.uploads = uploads


def add_counts(before: dict[str, dict[str, int]], now: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Traffic snapshots added up, counter by counter (``bytes``, ``messages``, ...)."""
    out: dict[str, Any] = {}
    for section in sorted(set(before) | set(now)):
        a, b = before.get(section, {}), now.get(section, {})
        out[section] = {k: a.get(k, 0) + b.get(k, 0) for k in sorted(set(a) | set(b))}
    return out


__all__ = [
    "STATE_DIR",
    "ResumeRefused",
    "Resumed",
    "StateCost",
    "add_counts",
    "find_resume",
    "load_federation_state",
    "round_state_dir",
    "save_federation_state",
]
