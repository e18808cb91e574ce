"""Overhead of ``estuary simulate`` over a plain single-process training loop.

Both do the same number of optimizer steps with the same batch size on the same images
(the union of the devices' data): the plain loop is one model, one optimizer, one process;
simulate runs the cloud, 2 edges and 8 devices over MemoryBus with every message encoded,
hashed, decoded and aggregated. Runs alternate (plain, simulate, plain, ...) so drift on a
shared machine hits both; the reported figure is the median of the per-pair ratios.

    python benchmarks/simulate_overhead.py --repeats 3 \
        --out benchmarks/results/simulate_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from estuary.simulate import simulate
from shared.config import RunConfig, config_from_dict
from shared.data.datasets import load_dataset, to_model_input
from shared.data.partition import make_partition
from shared.diffusion.schedule import make_train_scheduler
from shared.diffusion.training import resolve_device, train_local
from shared.models.presets import build_unet


def bench_config(rounds: int, steps: int) -> RunConfig:
    """fmnist-tiny, 8 devices, 2 edges, ``steps`` local steps per round, no evaluation."""
    return config_from_dict(
        {
            "run": {"name": "bench", "seed": 0, "rounds": rounds},
            "federation": {"num_devices": 8, "num_edges": 2},
            "data": {"dataset": "fashion-mnist", "partition": "iid", "max_samples_per_device": 512},
            "model": {"preset": "fmnist-tiny"},
            "train": {"local_steps": steps, "batch_size": 32},
            "eval": {"every": 0, "sample_every": 0, "checkpoint_every": 1},
        }
    )


def plain_loop(cfg: RunConfig) -> float:
    """Wall seconds of one model trained for the same total steps on the pooled device data."""
    start = time.perf_counter()
    data = load_dataset(cfg.data.dataset, cfg.data.path)
    parts = make_partition(data.labels, cfg.federation.num_devices, cfg.data, cfg.run.seed)
    channels = cfg.data.input_channels
    pooled = torch.cat([to_model_input(data.images[p], channels) for p in parts])
    model = build_unet(cfg.model.preset, seed=cfg.run.seed)
    total = cfg.run.rounds * cfg.federation.num_devices * cfg.train.local_steps
    gen = torch.Generator().manual_seed(cfg.run.seed)
    train_local(model, pooled, cfg.train, make_train_scheduler(cfg.diffusion), gen, steps=total,
                device=resolve_device(cfg.compute.device))  # fmt: skip
    return time.perf_counter() - start


def simulated(cfg: RunConfig) -> float:
    """Wall seconds of ``estuary simulate`` (run directory, checkpoints and report included)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        simulate(cfg, Path(tmp) / "run", progress=False, evaluate=False)
    return time.perf_counter() - start


def main() -> None:
    """Run the comparison and print/save medians."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16, help="local steps per device per round")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--out", type=Path, default=None, help="write results JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = bench_config(args.rounds, args.steps)
    plain_loop(bench_config(1, 1))  # warm-up: imports, allocator, dataset page cache
    plain_s, sim_s = [], []
    for i in range(args.repeats):
        plain_s.append(plain_loop(cfg))
        sim_s.append(simulated(cfg))
        print(
            f"repeat {i + 1}: plain {plain_s[-1]:.2f}s  simulate {sim_s[-1]:.2f}s  "
            f"ratio {sim_s[-1] / plain_s[-1]:.3f}",
            flush=True,
        )
    ratios = [s / p for s, p in zip(sim_s, plain_s, strict=True)]
    result = {
        "benchmark": "simulate_overhead",
        "optimizer_steps": args.rounds * 8 * args.steps,
        "batch_size": cfg.train.batch_size,
        "torch_threads": torch.get_num_threads(),
        "plain_s": plain_s,
        "simulate_s": sim_s,
        "median_plain_s": statistics.median(plain_s),
        "median_simulate_s": statistics.median(sim_s),
        "median_ratio": statistics.median(ratios),
        "ratios": ratios,
    }
    print(json.dumps({k: v for k, v in result.items() if k.startswith("median")}, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
