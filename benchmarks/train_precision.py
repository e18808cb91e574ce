"""Local training in bf16 autocast against plain fp32, in one run, on one device.

``train.precision = "bf16"`` runs a device's forward passes under bf16 autocast
(:func:`shared.diffusion.training.autocast_for`). This times the real local round
(:func:`shared.diffusion.training.train_local`: CPU-drawn batches and noise, the model moved to the
device and back) of the comparison's model at the comparison's batch, alternating fp32 and
bf16 rounds so drift in clocks or neighbours hits both, and reports the median of the
per-pair step-rate ratios with each side's median steps per second.

    python benchmarks/train_precision.py --out benchmarks/results/train_precision_h100.json
    python benchmarks/train_precision.py --device cpu --preset fmnist-tiny --batch 32 \
        --steps 8 --repeats 3        # a rehearsal: CPU figures say nothing about GPUs

Absolute figures only from a GPU run (benchmarks/README.md); on the CPU the ratio is a check
that both paths run. Measured on an H100 on 2026-11-27
(``benchmarks/results/train_precision_h100.json``, ``--repeats 3``): fmnist-small at batch 128
trains at a median 13.0 steps/s in fp32 and 11.3 under bf16 autocast, a speedup of 0.87x.
The step holds about 36 ms of GPU time, so at 13 steps/s the host's op launches, not the
GPU, set the pace, and autocast's casts add to them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    """Alternate fp32 and bf16 local rounds; print and optionally save the medians."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--preset", default="fmnist-small")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24, help="local steps per timed round")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds per precision")
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
    cfgs = {
        p: config_from_dict({"model": {"preset": args.preset}, "train": {**train, "precision": p}})
        for p in ("fp32", "bf16")
    }
    rates = alternate_rounds(cfgs, data, device, steps=args.steps, repeats=args.repeats,
                             warmup_steps=3)  # fmt: skip
    result: dict[str, Any] = {
        "benchmark": "train_precision",
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "preset": args.preset,
        "batch_size": args.batch,
        "steps_per_round": args.steps,
        **summarize(rates, "fp32", "bf16"),
    }
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
