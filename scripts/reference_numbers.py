"""Reference FIDs (docs/algorithms.md), with the evaluation protocol ``estuary eval`` uses.

FID(held-out test images vs train reference) is the floor a perfect generator would reach;
FID(untrained fmnist-tiny samples vs train reference) is where training from a random init
starts, FID(shipped pretrained generator vs train reference) where ``model.init =
"pretrained"`` starts (the demo).

    python scripts/reference_numbers.py [--config configs/fedavg_iid_tiny.toml] [--json]
        [--device auto|cpu|cuda]

Samples are drawn on ``--device`` (default: CUDA when torch sees a GPU) from the same seeded
CPU noise, so the figures do not depend on it beyond floating-point rounding.
"""

from __future__ import annotations

import argparse
import json

from shared.config import load_config
from shared.diffusion.training import resolve_device
from shared.evaluation import quality
from shared.evaluation.evaluator import Evaluator, model_from_state, reference_images
from shared.models.init import PRETRAINED, initial_model
from shared.models.presets import build_unet


def main() -> None:
    """Print the reference numbers."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="configs/fedavg_iid_tiny.toml")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = ap.parse_args()
    cfg = load_config(args.config)
    ev = Evaluator(cfg, resolve_device(args.device))
    test = reference_images(cfg, "test", cfg.eval.num_samples)
    held_out = quality.evaluate(test, ev.reference)
    untrained = ev.evaluate(
        model_from_state(cfg, build_unet(cfg.model.preset, seed=cfg.run.seed).state_dict())
    )
    pretrained = None
    if cfg.model.preset in PRETRAINED:
        pretrained = ev.evaluate(initial_model(cfg.model.preset, "pretrained").eval())
    out = {
        "protocol": {
            "n_fake": cfg.eval.num_samples,
            "n_real_train": cfg.eval.num_reference,
            "sample_steps": cfg.eval.sample_steps,
            "extractor": quality.EXTRACTOR_NAME,
        },
        "test_vs_train": held_out,
        "untrained_vs_train": untrained,
        "pretrained_vs_train": pretrained,
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"FID(test vs train)              = {held_out['fid']:.2f}")
        print(f"FID(untrained samples vs train) = {untrained['fid']:.2f}")
        if pretrained is not None:
            print(f"FID(pretrained samples vs train) = {pretrained['fid']:.2f}")


if __name__ == "__main__":
    main()
