"""``estuary split-data CONFIG --out DIR``: a config's federated split as image folders.

Writes each device's share of the config's dataset (the seeded split ``estuary simulate``
makes) as ``DIR/<device id>/<class>/<index>.png`` and the cloud's evaluation reference as
``DIR/cloud/<class>/<index>.png``, plus ``DIR/config.json``: the same run with
``data.dataset = "folder"``. ``estuary simulate DIR/config.json`` trains on them
as the original config trains on the dataset, and so do role processes started with
``--data DIR/<device id>`` (the cloud with ``--reference DIR/cloud``), each device reading only
its own folder: the layout a device on a real fleet keeps its own images in, and the way to
try it before there is a fleet.

The public share (``data.public_size``) is left out of the devices' folders, as the split
leaves it out. The folders hold the images as stored, *not* seen in the devices' domains
(``data.domains``): the domain is applied where a device reads its data, here when a
device reads its folder (:func:`shared.data.partition.device_folder`, with the config's
domains, which the written config keeps), so a device of the folder layout trains on the
images the original split gives it. Writing transformed images would have them transformed
again on reading.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.atomic import atomic_write
from shared.config import RunConfig, with_overrides
from shared.data.datasets import ImageDataset, load_dataset, write_image_folder
from shared.data.partition import split_dataset
from shared.errors import ConfigError
from shared.evaluation.evaluator import reference_indices
from shared.naming import device_name
from shared.progress import progress_bar


@dataclass(frozen=True)
class SplitSummary:
    """What :func:`split_data` wrote."""

    out: Path
    #: images per device, in device order
    device_images: list[int]
    reference_images: int
    config_path: Path


def folder_config(cfg: RunConfig, out: Path) -> RunConfig:
    """``cfg`` reading the image folders under ``out``: ``data.dataset = "folder"``, no
    partition (each device holds its share already), no per-device cap (already applied),
    ``data.local_dir`` = ``out`` and ``eval.reference_dir`` = ``out/cloud`` (absolute), so
    ``estuary simulate``/``compare`` read them as they are; role processes give each their
    own folder (``--data``, ``--reference``)."""
    root = out.resolve()
    return with_overrides(
        cfg,
        {"data": {"dataset": "folder", "partition": "iid", "max_samples_per_device": 0,
                  "path": "", "local_dir": str(root)},
         "eval": {"reference_dir": str(root / "cloud")}},
        source="split-data",
    )  # fmt: skip


def split_data(cfg: RunConfig, out: Path, *, progress: bool = True) -> SplitSummary:
    """Write ``cfg``'s split of its dataset under ``out`` (which must be new or empty): the
    devices' images untransformed (their domains are applied when their folders are read),
    the cloud's reference from the whole training split, as ``reference_images`` draws it."""
    if cfg.data.own_folders:
        raise ConfigError(
            "the config already reads the devices' own image folders (data.dataset = 'folder' "
            "without data.path)"
        )
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} is not empty; split-data writes only into a new directory")
    data, parts = split_dataset(cfg, domains=False)
    full = data
    if cfg.data.public_size:  # the reference is drawn from the whole split, public share too
        d = cfg.data
        full = load_dataset(
            d.dataset, d.path, size=d.synthetic_size, seed=cfg.run.seed, class_names=d.class_names
        )
    width = len(str(len(full) - 1))
    fcfg = folder_config(cfg, out)
    out.mkdir(parents=True, exist_ok=True)

    def write(share: ImageDataset, indices: np.ndarray, folder: Path) -> int:
        # names are the dataset indices, zero-padded: name order is the split's order
        return write_image_folder(share, folder, [f"{i:0{width}d}" for i in indices])

    sizes = []
    for i, idx in enumerate(progress_bar(parts, desc="devices", unit="dev", disable=not progress)):
        sizes.append(write(data.subset(idx), idx, out / device_name(i)))
    ref = reference_indices(len(full), cfg.eval.num_reference)
    n_ref = write(full.subset(ref), ref, out / "cloud")
    config_path = out / "config.json"
    atomic_write(config_path, fcfg.to_json().encode())
    atomic_write(
        out / "split.json",
        json.dumps(
            {"source": cfg.data.dataset, "config_digest": cfg.digest(),
             "folder_config_digest": fcfg.digest(), "device_images": sizes,
             "reference_images": n_ref},
            indent=2,
        ).encode(),
    )  # fmt: skip
    return SplitSummary(out, sizes, n_ref, config_path)
