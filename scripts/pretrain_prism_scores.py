#!/usr/bin/env python
"""Pretrain PRISM's demo scores (``algorithm.prism.init = "demo"``, the PRISM demo's start).

Usage (from the repository root)::

    python scripts/pretrain_prism_scores.py

(the defaults are the shipped file's recipe; its ``.json`` sidecar records it with the FID
curve and the training time: 414 s of CPU at one thread, 83 minutes of wall time on a
2-core VM shared with other work).

Trains the scores of every masked weight of the one-shot ResNet generator
(``resnetg-fmnist-16``) centrally, exactly as ``estuary compare``'s centralized PRISM does
(``Prism.centralized``: Adam at lr 0.1, betas (0.5, 0.999), no clipping, one Bernoulli mask per
forward, the feature-matching loss with moving averages), on the Fashion-MNIST **test** split
(10k images that no device holds: devices partition the train split, and FID is measured
against train images). The frozen weights and the first scores come from the **public demo
key** (:data:`shared.methods.prism.masking.DEMO_KEY`, derived from a fixed label) and ``--seed``:
anyone can regenerate them, so nothing trained from these scores is secret. Use them for
demonstrations, never where the frozen weights must stay private.

FID (``--eval-samples`` samples of the dense model of one fixed mask, batch norms recalibrated
on latents, against ``--num-reference`` train images) is measured every ``--eval-every``
steps. Only if the last FID is at most ``--max-fid`` are the probabilities written, atomically,
as safetensors (never pickle) with a ``.json`` sidecar, and the file's sha256 printed: put it
into ``DEMO_SCORES`` in ``shared/methods/prism/masking.py``. A grid of 64 samples is written
as a PNG (``--grid``).

All randomness (the masks, the latents, the batch order) comes from generators seeded with
``--seed``; global RNGs are never used. With the same seed, thread count and torch build the
probabilities should come out identical; the file's metadata also records the training
time, so its sha256 changes with every run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from shared.config import config_from_dict
from shared.data.datasets import load_fashion_mnist, to_model_input
from shared.diffusion.schedule import make_train_scheduler
from shared.diffusion.training import train_local
from shared.errors import EstuaryError
from shared.evaluation.evaluator import Evaluator, model_from_state, write_grid
from shared.methods.base import build_algorithm
from shared.methods.prism.masking import ASSETS, DEMO_KEY, KEY_ENV, KEY_FILE_ENV
from shared.methods.prism.method import THETA
from shared.models.init import initial_model
from shared.models.oneshot import FeatureMatch, latent_dim
from shared.wire.codec import write_asset

PRESET = "resnetg-fmnist-16"
DEFAULT_OUT = ASSETS / "prism_resnetg_fmnist_16_demo.safetensors"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="latents per step")
    p.add_argument("--lr", type=float, default=0.1, help="Adam learning rate on the scores")
    p.add_argument("--ama-lr", type=float, default=0.005, help="moving averages' Adam lr")
    p.add_argument("--seed", type=int, default=0, help="run seed (frozen weights, draws)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--data", default=None, help="directory with the Fashion-MNIST IDX files")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="scores file")
    p.add_argument("--grid", type=Path, default=None, help="sample grid (default: beside --out)")
    p.add_argument("--eval-every", type=int, default=500, help="steps between FIDs")
    p.add_argument("--eval-samples", type=int, default=1000, help="samples per FID")
    p.add_argument("--num-reference", type=int, default=2000, help="real images per FID")
    p.add_argument("--max-fid", type=float, default=70.0, help="refuse to write above this")
    args = p.parse_args(argv)
    if min(args.steps, args.batch_size, args.threads, args.eval_every, args.eval_samples) < 1:
        p.error("--steps, --batch-size, --threads, --eval-every, --eval-samples must be >= 1")
    if args.grid is None:
        args.grid = args.out.with_suffix(".png")
    return args


def main(argv: list[str] | None = None) -> int:
    """Train, score along the way, check the FID gate, write scores + sidecar + grid."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.pop(KEY_FILE_ENV, None)
    os.environ[KEY_ENV] = DEMO_KEY.secret.hex()  # the public demo key, in this process only
    cfg = config_from_dict(
        {
            "run": {"seed": args.seed},
            "data": {"path": args.data or ""},
            "model": {"preset": PRESET},
            "train": {"batch_size": args.batch_size, "local_steps": 1, "ama_lr": args.ama_lr},
            "algorithm": {"name": "prism", "prism": {"lr": args.lr, "mada": False}},
            "eval": {"num_samples": args.eval_samples, "num_reference": args.num_reference,
                     "grid_size": 64},
        },
        source="pretrain-prism",
    )  # fmt: skip
    algo = build_algorithm(cfg)
    if algo.central is None:
        raise TypeError("PRISM trains its own ceiling (Prism.central)")
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        data = to_model_input(load_fashion_mnist("test", args.data).images, 1)
        model = initial_model(PRESET, "random", seed=args.seed)
        central = algo.central.centralized(model, seed=args.seed)
        match = FeatureMatch.for_device({}, data, latent_dim(model), args.ama_lr,
                                        torch.device("cpu"))  # fmt: skip
        evaluator = Evaluator(cfg)
        gen = torch.Generator().manual_seed(args.seed)
        scheduler = make_train_scheduler(cfg.diffusion)
        curve: list[dict[str, float]] = []
        done = 0
        while done < args.steps:
            n = min(args.eval_every, args.steps - done)
            result = train_local(central.net, data, central.train, scheduler, gen, steps=n,
                                 optimizer=central.optimizer, loss_fn=match)  # fmt: skip
            done += n
            state = central.state(0)
            fid = float(evaluator.evaluate(model_from_state(cfg, state, algorithm=algo))["fid"])
            curve.append({"step": done, "loss": round(result.mean_loss, 2), "fid": round(fid, 2)})
            print(f"step {done}: loss {result.mean_loss:.1f}, FID {fid:.2f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    except EstuaryError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    grid = write_grid(cfg, model_from_state(cfg, state, algorithm=algo), args.grid)
    print(f"sample grid: {grid}")
    fid = curve[-1]["fid"]
    if fid > args.max_fid:
        print(f"refusing to write {args.out}: FID {fid:.2f} > {args.max_fid:g}; train longer "
              "(--steps)", file=sys.stderr)  # fmt: skip
        return 1
    info: dict[str, object] = {
        "preset": PRESET,
        "data": "fashion-mnist/test",
        "key": "public demo key (shared.methods.prism.masking.DEMO_KEY)",
        "key_fingerprint": DEMO_KEY.fingerprint,
        "seed": args.seed,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "betas": [0.5, 0.999],
        "ama_lr": args.ama_lr,
        "curve": curve,
        "fid_samples": args.eval_samples,
        "fid_reference": args.num_reference,
        "train_seconds": round(seconds),
        "train_cpu_seconds": round(cpu_seconds),
        "threads": args.threads,
        "torch": torch.__version__,
    }
    theta = {k: v.contiguous() for k, v in state.items() if k.startswith(THETA)}
    digest = write_asset(args.out, theta, info)
    print(f"wrote {args.out}")
    print(f"sha256: {digest}")
    print(f"set DEMO_SCORES[{PRESET!r}] in shared/methods/prism/masking.py to this value")
    return 0


if __name__ == "__main__":
    sys.exit(main())
