"""The size of every preset, computed once and shipped (``shared/assets/preset_info.json``):
``estuary model-info`` answers from it at once, without importing torch or building a model.

The table is what :func:`shared.models.presets.model_info` measures (parameters, Torch-Pruning's
MACs, weight multiply-accumulates, fp32 bytes) plus the weights PRISM masks; a test
recomputes it and fails when a preset changed without the table:
``python -m shared.models.info_table`` writes it again.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from shared.atomic import atomic_write

TABLE_PATH = Path(__file__).resolve().parents[1] / "assets" / "preset_info.json"


def load_table(path: Path = TABLE_PATH) -> dict[str, dict[str, Any]]:
    """Preset name -> its ``model_info`` figures (``{}`` when the file is missing)."""
    if not path.is_file():
        return {}
    doc = json.loads(path.read_text())
    return dict(doc["presets"])


def masked_weight_count(preset: str) -> int:
    """What PRISM masks of a dense ``preset`` (one bit each on the wire): every weight of two
    or more dimensions (torch)."""
    from shared.models.presets import is_weight, state_spec

    return sum(math.prod(s.shape) for n, s in state_spec(preset).items() if is_weight(n, s.shape))


def compute_table() -> dict[str, dict[str, Any]]:
    """Measure every preset (builds each model once; torch)."""
    from shared.models.presets import ALL_PRESETS, kind_of, model_info

    table: dict[str, dict[str, Any]] = {}
    for preset in sorted(ALL_PRESETS):
        info = model_info(preset).to_dict()
        info["kind"] = kind_of(preset)
        if info["kind"] != "classifier":
            info["masked_weights"] = masked_weight_count(preset)
        table[preset] = info
    return table


def write_table(path: Path = TABLE_PATH) -> Path:
    """Compute the table and write it (atomically)."""
    doc = {"about": "written by python -m shared.models.info_table", "presets": compute_table()}
    atomic_write(path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
    return path


def compute_unet_specs() -> dict[str, list[list[Any]]]:
    """Each U-Net preset's state dict as ``[name, shape, dtype]`` rows, in state-dict order
    (builds each model on the meta device; torch and diffusers)."""
    from shared.models.presets import ALL_PRESETS, construct_spec, kind_of

    return {
        preset: [[k, list(s.shape), str(s.dtype).removeprefix("torch.")]
                 for k, s in construct_spec(preset).items()]
        for preset in sorted(ALL_PRESETS) if kind_of(preset) == "unet"
    }  # fmt: skip


def write_unet_specs(path: Path | None = None) -> Path:
    """Compute every U-Net preset's state spec and write it (atomically; by default to
    :data:`shared.models.presets.UNET_SPECS_PATH`, what :func:`~shared.models.presets.
    state_spec` reads)."""
    from shared.models.presets import UNET_SPECS_PATH

    path = path or UNET_SPECS_PATH
    doc = {"about": "written by python -m shared.models.info_table",
           "presets": compute_unet_specs()}  # fmt: skip
    atomic_write(path, (json.dumps(doc, separators=(",", ":"), sort_keys=True) + "\n").encode())
    return path


if __name__ == "__main__":
    print(f"wrote {write_table()}")
    print(f"wrote {write_unet_specs()}")
