#!/usr/bin/env python
"""Train a Fashion-MNIST feature network: the FID extractor or the feature-matching kernel.

Usage (from the repository root)::

    python scripts/train_feature_classifier.py --epochs 5 --seed 0
    python scripts/train_feature_classifier.py --net match --epochs 3

``--net fid`` (default) trains :class:`shared.evaluation.quality.FeatureNet`, the extractor
used by ``shared.evaluation.quality`` (FID and friends); put the printed hash into
``FEATURE_WEIGHTS_SHA256`` in ``shared/evaluation/quality.py``. ``--net match`` trains
:class:`shared.models.feature_match.MatchNet`, the separate network whose features are PRISM's
feature-matching training loss (kept apart from the FID net so FID stays an independent
judge); put the printed hash into ``MATCH_WEIGHTS_SHA256`` in
``shared/models/feature_match.py``. ``--seed`` defaults to 0 for fid and 1 for match.

Both are trained on the 60k train split with the same loop, optimizer and augmentation; the
script reports accuracy on the 10k test split and, only if it reaches ``--min-accuracy``
(0.90), writes the weights atomically as safetensors (never pickle) plus a ``.json`` sidecar,
and prints the file's sha256.

All randomness (initialisation, shuffling, augmentation) comes from one ``torch.Generator``
seeded with ``--seed``; global RNGs are never seeded or used. With the same seed, thread
count and torch build the output file should be byte-identical (the safetensors metadata is a
single JSON string, so its serialisation order is fixed).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from shared.data.datasets import load_fashion_mnist, to_model_input
from shared.errors import EstuaryError
from shared.evaluation.quality import DEFAULT_WEIGHTS, EXTRACTOR_NAME, FeatureNet
from shared.models.feature_match import MATCH_EXTRACTOR_NAME, MATCH_WEIGHTS, MatchNet
from shared.wire.codec import write_asset

MIN_ACCURACY = 0.90
#: per ``--net``: (default seed, default output file, extractor name, where the hash goes)
NETS: dict[str, tuple[int, Path, str, str]] = {
    "fid": (
        0,
        DEFAULT_WEIGHTS,
        EXTRACTOR_NAME,
        "FEATURE_WEIGHTS_SHA256 in shared/evaluation/quality.py",
    ),
    "match": (
        1,
        MATCH_WEIGHTS,
        MATCH_EXTRACTOR_NAME,
        "MATCH_WEIGHTS_SHA256 in shared/models/feature_match.py",
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--net",
        choices=sorted(NETS),
        default="fid",
        help="fid: FID extractor FeatureNet; match: PRISM feature-matching kernel MatchNet",
    )
    p.add_argument("--epochs", type=int, default=5, help="passes over the train split")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the one torch.Generator used (default: 0 for fid, 1 for match)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="weights file to write (default: the shipped asset of --net)",
    )
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (one-cycle AdamW)")
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--no-augment", action="store_true", help="disable random horizontal flips")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--data", default=None, help="directory with the Fashion-MNIST IDX files")
    p.add_argument("--min-accuracy", type=float, default=MIN_ACCURACY)
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.threads < 1:
        p.error("--epochs, --batch-size and --threads must be >= 1")
    default_seed, default_out, _, _ = NETS[args.net]
    if args.seed is None:
        args.seed = default_seed
    if args.out is None:
        args.out = default_out
    return args


@torch.no_grad()
def accuracy(model: nn.Module, images: np.ndarray, labels: np.ndarray, batch: int = 1000) -> float:
    """Top-1 accuracy of ``model`` (eval mode) on uint8 images ``(N, 28, 28)``."""
    model.eval()
    correct = 0
    for s in range(0, len(labels), batch):
        pred = model(to_model_input(images[s : s + batch], 1)).argmax(dim=1).numpy()
        correct += int((pred == labels[s : s + batch]).sum())
    return correct / len(labels)


def train(args: argparse.Namespace) -> tuple[FeatureNet | MatchNet, float]:
    """Train from scratch; return the model (eval mode) and its test accuracy."""
    gen = torch.Generator().manual_seed(args.seed)
    train_set = load_fashion_mnist("train", args.data)
    test_set = load_fashion_mnist("test", args.data)
    model: FeatureNet | MatchNet = FeatureNet() if args.net == "fid" else MatchNet()
    model.init_weights(gen)
    n = len(train_set)
    steps_per_epoch = (n + args.batch_size - 1) // args.batch_size
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch
    )
    labels_all = torch.from_numpy(train_set.labels)
    for epoch in range(args.epochs):
        model.train()
        t0 = time.perf_counter()
        perm = torch.randperm(n, generator=gen)
        loss_sum, correct = 0.0, 0
        for s in range(0, n, args.batch_size):
            idx = perm[s : s + args.batch_size]
            x = to_model_input(train_set.images[idx.numpy()], 1)
            y = labels_all[idx]
            if not args.no_augment:
                flip = torch.rand(len(idx), generator=gen) < 0.5
                x = torch.where(flip[:, None, None, None], x.flip(-1), x)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += loss.item() * len(idx)
            correct += int((logits.argmax(1) == y).sum())
        print(
            f"epoch {epoch + 1}/{args.epochs}: loss {loss_sum / n:.4f} "
            f"train acc {correct / n:.4f} ({time.perf_counter() - t0:.0f}s)",
            flush=True,
        )
    acc = accuracy(model, test_set.images, test_set.labels)
    model.eval()
    return model, acc


def main(argv: list[str] | None = None) -> int:
    """Train, check the accuracy gate, write weights + sidecar JSON, print the sha256."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    try:
        model, acc = train(args)
    except EstuaryError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"test accuracy: {acc:.4f} (trained in {time.perf_counter() - t0:.0f}s)")
    if acc < args.min_accuracy:
        print(
            f"refusing to write {args.out}: test accuracy {acc:.4f} < {args.min_accuracy:.2f}; "
            "train longer (--epochs) or try another --seed",
            file=sys.stderr,
        )
        return 1
    _, _, extractor_name, hash_constant = NETS[args.net]
    info: dict[str, object] = {
        "extractor": extractor_name,
        "test_accuracy": round(acc, 4),
        "seed": args.seed,
        "epochs": args.epochs,
    }
    digest = write_asset(args.out, model.state_dict(), info)
    print(f"wrote {args.out}")
    print(f"sha256: {digest}")
    print(f"set {hash_constant} to this value")
    return 0


if __name__ == "__main__":
    sys.exit(main())
