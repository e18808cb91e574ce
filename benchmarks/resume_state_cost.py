"""What writing the devices' kept state at each checkpoint costs (bytes and seconds), the
price of resuming an in-process run exactly (:mod:`estuary.resume`).

Each federated method of a comparison (or the tiny FedAvg with and without kept optimizer
state) runs two rounds with a checkpoint after each, no evaluation and one local step per
device (what a device keeps does not depend on how many steps it took); the state write of
each checkpoint is timed and its bytes counted, beside the checkpoint's own size.

    python benchmarks/resume_state_cost.py configs/compare/compare_prism_mada_cpu.toml \
        --only FedAvg --only PRISM --tiny --out /tmp/resume_state_cost.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from estuary.compare import load_compare
from estuary.resume import StateCost
from estuary.simulate import simulate
from shared.config import RunConfig, config_from_dict, with_overrides


def short(cfg: RunConfig) -> RunConfig:
    """``cfg`` for two rounds of one local step, a checkpoint after each, no evaluation."""
    cfg = cfg.model_copy(
        update={
            "run": cfg.run.model_copy(update={"rounds": 2}),
            "eval": cfg.eval.model_copy(
                update={"every": 0, "sample_every": 0, "checkpoint_every": 1}
            ),
            "train": cfg.train.model_copy(update={"local_steps": 1}),
        }
    )
    if cfg.algorithm.name == "prism":
        cfg = with_overrides(cfg, {"algorithm": {"prism": {"local_iters": 1}}})
    return cfg


def tiny(keep: bool) -> RunConfig:
    """fmnist-tiny FedAvg, 8 devices at 2 edges, with or without kept optimizer state."""
    return config_from_dict({
        "run": {"name": "tiny", "seed": 0, "rounds": 2},
        "federation": {"num_devices": 8, "num_edges": 2, "round_deadline_s": 600},
        "data": {"dataset": "synthetic", "synthetic_size": 256, "partition": "iid"},
        "model": {"preset": "fmnist-tiny"},
        "train": {"local_steps": 2, "batch_size": 8, "lr": 2e-3, "threads": 1,
                  "optimizer_state": "keep" if keep else "reset"},
        "eval": {"every": 0, "sample_every": 0, "checkpoint_every": 1},
    })  # fmt: skip


def measure(label: str, cfg: RunConfig, root: Path) -> dict[str, Any]:
    """Run ``cfg`` into ``root`` and return what its state writes cost."""
    costs: list[StateCost] = []
    t0 = time.perf_counter()
    res = simulate(cfg, root / label.replace(" ", "_"), progress=False, evaluate=False,
                   state_costs=costs)  # fmt: skip
    ckpt = sorted((res.run_dir / "checkpoints").glob("round_*.safetensors"))[-1]
    return {
        "label": label,
        "preset": cfg.model.preset,
        "algorithm": cfg.algorithm.name,
        "devices": cfg.federation.num_devices,
        "optimizer_state": cfg.train.optimizer_state,
        "state_bytes": [c.bytes for c in costs],
        "state_seconds": [round(c.seconds, 3) for c in costs],
        "checkpoint_bytes": ckpt.stat().st_size,
        "round_seconds": [r["durations"]["round_s"] for r in res.rows],
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    """Measure and print (and write ``--out``) one record per method."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("compare", nargs="?", help="a comparison TOML (its federated methods)")
    p.add_argument("--only", action="append", default=[], help="method label (repeatable)")
    p.add_argument("--tiny", action="store_true", help="also fmnist-tiny FedAvg keep/reset")
    p.add_argument("--out", help="JSON file for the records")
    args = p.parse_args()
    runs: list[tuple[str, RunConfig]] = []
    if args.compare:
        for m in load_compare(Path(args.compare)).methods:
            if not m.centralized and (not args.only or m.label in args.only):
                runs.append((m.label, short(m.cfg)))
    if args.tiny:
        runs += [("fmnist-tiny FedAvg keep", tiny(True)), ("fmnist-tiny FedAvg reset", tiny(False))]
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, cfg in runs:
            rec = measure(label, cfg, Path(tmp))
            print(json.dumps(rec), flush=True)
            records.append(rec)
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
