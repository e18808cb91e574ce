"""Local training replayed from a CUDA graph against eager training, in one run, on one GPU.

``train.cuda_graph = true`` captures a local round's training step once (after three eager
warm-up steps) and replays it (:mod:`shared.diffusion.cuda_graph`). This times the real local round
(:func:`shared.diffusion.training.train_local`: CPU-drawn batches and noise, the model moved to the
GPU and back, the capture itself included) per preset at the comparison's batch, alternating
eager and graphed rounds so drift in clocks or neighbours hits both, and reports the median
of the per-pair step-rate ratios with each side's median steps per second.

With ``--long-steps N`` it also times rounds of N steps and splits each mode's round time
into a cost per step and a fixed cost per round (the line through the two median round
times): for the graph, the fixed part is the capture and the eager warm-up steps, which a
capture reused across rounds would save; the per-step part is the replay. ``--reuse`` adds
that third mode (``train.cuda_graph_reuse``: one capture kept across rounds).

    python benchmarks/train_graph.py --out benchmarks/results/train_graph_h100.json
    python benchmarks/train_graph.py --presets fmnist-tiny --steps 24 --long-steps 120
    python benchmarks/train_graph.py --presets fmnist-tiny --steps 24 --long-steps 96 --reuse
    python benchmarks/train_graph.py --device cpu --presets fmnist-tiny --batch 16 \
        --steps 6 --repeats 1        # a rehearsal: both sides eager on the CPU

Absolute figures only from a GPU run (benchmarks/README.md). Without a graph, an H100 trains
fmnist-tiny at batch 128 at about 22 steps/s with two processes sharing it: about 2000
kernel launches per step, so the host sets the pace. On an H200, 24-step graphed rounds
ran 2.38x eager's rate on fmnist-tiny and 1.49x on fmnist-small
(benchmarks/results/train_graph_h200.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    """Alternate eager and graphed local rounds per preset; print and save the medians."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--presets", default="fmnist-tiny,fmnist-small")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60, help="local steps per timed round")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per mode and preset")
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="a third mode: train.cuda_graph_reuse (one capture kept across rounds)",
    )
    ap.add_argument(
        "--long-steps",
        type=int,
        default=0,
        help="also time rounds of this many steps: per-step and per-round costs",
    )
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args()

    import torch
    from _alternate import alternate_rounds, summarize

    from shared.config import config_from_dict

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible; --device cpu rehearses the benchmark", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    data = torch.rand(3000, 1, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    train = {"batch_size": args.batch, "lr": 2e-4, "optimizer": "adam", "grad_clip": 1.0}
    result: dict[str, Any] = {
        "benchmark": "train_graph",
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "batch_size": args.batch,
        "steps_per_round": args.steps,
        "presets": {},
    }
    for preset in args.presets.split(","):
        modes: dict[str, dict[str, bool]] = {"eager": {}, "graph": {"cuda_graph": True}}
        if args.reuse:
            modes["resident"] = {"cuda_graph": True, "cuda_graph_reuse": True}
        cfgs = {
            m: config_from_dict({"model": {"preset": preset}, "train": {**train, **opts}})
            for m, opts in modes.items()
        }
        rates = alternate_rounds(cfgs, data, device, steps=args.steps, repeats=args.repeats,
                                 warmup_steps=8, label=f"{preset} ")  # fmt: skip
        result["presets"][preset] = summarize(rates, "eager", "graph")
        if args.reuse:
            result["presets"][preset]["resident"] = summarize(rates, "eager", "resident")
        if args.long_steps > args.steps:
            long = alternate_rounds(cfgs, data, device, steps=args.long_steps,
                                    repeats=args.repeats, warmup_steps=8,
                                    label=f"{preset} long ")  # fmt: skip
            result["presets"][preset]["long"] = summarize(long, "eager", "graph")
            if args.reuse:
                result["presets"][preset]["long_resident"] = summarize(long, "eager", "resident")
            result["presets"][preset]["costs"] = split_costs(rates, long, args.steps,
                                                             args.long_steps)  # fmt: skip
    print(json.dumps(_without_lists(result), indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _without_lists(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` without its per-round lists, at any depth: what the console shows."""
    return {k: _without_lists(v) if isinstance(v, dict) else v
            for k, v in d.items() if not isinstance(v, list)}  # fmt: skip


def split_costs(
    short: dict[str, list[float]], long: dict[str, list[float]], n_short: int, n_long: int
) -> dict[str, dict[str, float]]:
    """Each mode's median round time at two round lengths (from the step rates) as a line:
    milliseconds per step (its slope) and per round (its intercept)."""
    costs = {}
    for m in short:
        t_short = statistics.median(n_short / r for r in short[m])
        t_long = statistics.median(n_long / r for r in long[m])
        per_step = (t_long - t_short) / (n_long - n_short)
        costs[m] = {"ms_per_step": 1e3 * per_step,
                    "ms_fixed_per_round": 1e3 * (t_short - n_short * per_step)}  # fmt: skip
    return costs


if __name__ == "__main__":
    sys.exit(main())
