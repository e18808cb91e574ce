"""``estuary classify``: run a device's exported classifier (ONNX Runtime, no torch) on a
folder of images or Fashion-MNIST's test split, and print how it did."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from shared.errors import DataError


def _load_images(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """(uint8 images, labels or None, a description of the source) of the command's input."""
    from shared.deploy.onnx_classifier import (
        find_fashion_mnist_test,
        read_fashion_mnist_test,
        read_image_folder,
    )

    if args.images:
        names = [n for n in args.class_names.split(",") if n] if args.class_names else []
        folder = read_image_folder(Path(args.images), class_names=names, limit=args.limit)
        if folder.skipped:
            print(f"estuary: note: skipped {len(folder.skipped)} unreadable files (first: "
                  f"{folder.skipped[0]})", file=sys.stderr)  # fmt: skip
        source = {"kind": "folder", "path": args.images, "files": folder.files,
                  "skipped": len(folder.skipped)}  # fmt: skip
        return folder.images, folder.labels, source
    root = find_fashion_mnist_test(args.fashion_mnist_test or None)
    images, labels = read_fashion_mnist_test(root)
    if args.limit:
        images, labels = images[: args.limit], labels[: args.limit]
    return images, labels, {"kind": "fashion-mnist-test", "path": str(root)}


def _class_names(args: argparse.Namespace, num_classes: int) -> list[str]:
    from shared.deploy.onnx_classifier import FASHION_MNIST_CLASSES

    if args.class_names:
        names = [n for n in args.class_names.split(",") if n]
        return names + [str(c) for c in range(len(names), num_classes)]
    if num_classes == len(FASHION_MNIST_CLASSES):
        return list(FASHION_MNIST_CLASSES)
    return [str(c) for c in range(num_classes)]


def _describe_model(card: dict[str, Any], sha256: str) -> str:
    origin = card.get("origin") or {}
    made = ", ".join(f"{k} {v}" for k, v in origin.items() if isinstance(v, (str, int, float)))
    signed = "signed" if card.get("signed") else "unsigned"
    return (f"{card.get('preset', '?')} classifier, sha256 {sha256[:12]}, {signed}"
            + (f" ({made})" if made else ""))  # fmt: skip


def _print_table(rows: list[dict[str, Any]], names: list[str], labelled: bool) -> None:
    width = max(12, *(len(n) for n in names))
    head = f"  {'class':<{width + 4}} {'predicted':>9}"
    print(head + (f" {'images':>7} {'correct':>7} {'accuracy':>8}" if labelled else ""))
    for row, name in zip(rows, names, strict=True):
        line = f"  {row['class']:>2}  {name:<{width}} {row['predicted']:>9}"
        if labelled:
            acc = "-" if row["accuracy"] is None else f"{row['accuracy']:.4f}"
            line += f" {row['images']:>7} {row['correct']:>7} {acc:>8}"
        print(line)


def cmd_classify(args: argparse.Namespace) -> int:
    """Classify images with an exported classifier; accuracy where labels exist."""
    from shared.deploy.onnx_classifier import OnnxClassifier

    if args.limit < 0:
        raise DataError(f"--limit must be >= 0 (0: every image), got {args.limit}")
    if args.batch_size < 1:
        raise DataError(f"--batch-size must be >= 1, got {args.batch_size}")
    clf = OnnxClassifier(Path(args.model_dir), provider=args.provider, threads=args.threads)
    images, labels, source = _load_images(args)
    result = clf.classify(images, labels, batch_size=args.batch_size)
    names = _class_names(args, clf.num_classes)
    card_acc = (clf.card.get("accuracy") or {}).get("value")
    out = {
        "model_dir": str(args.model_dir),
        "model_sha256": clf.sha256,
        "signed": bool(clf.card.get("signed")),
        "origin": clf.card.get("origin") or {},
        "card_accuracy": card_acc,
        "source": source,
        "class_names": names,
        **result.to_dict(),
    }
    if args.json:
        text = json.dumps(out, indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
            return 0
        Path(args.json).write_text(text)
    print(f"model: {_describe_model(clf.card, clf.sha256)}")
    print(f"{out['images']} images from {source['kind']} {source['path']} on {out['provider']}: "
          f"{out['images_per_s']:.1f} images/s")  # fmt: skip
    _print_table(out["per_class"], names, out["labelled"])
    if out["labelled"]:
        acc = f"accuracy: {out['accuracy']:.4f} ({out['correct']}/{out['images']})"
        if isinstance(card_acc, (int, float)) and not math.isnan(card_acc):
            acc += f"; at export, on the device's own images: {card_acc:.4f}"
        print(acc)
    else:
        print("no labels (a flat folder): predicted counts only")
    if args.json:
        print(f"JSON: {args.json}")
    return 0


def add_parser(sub: Any) -> None:
    """Register ``classify`` on ``sub`` (argparse subparsers)."""
    c = sub.add_parser(
        "classify", help="classify images with a device's exported classifier (ONNX Runtime)"
    )
    c.add_argument("model_dir", help="export directory (model.onnx + card.json)")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", metavar="DIR", help="image folder: DIR/<class>/<files> "
                     "(labelled) or DIR/<files> (unlabelled)")  # fmt: skip
    src.add_argument("--fashion-mnist-test", nargs="?", const="", metavar="PATH",
                     help="Fashion-MNIST's test split (its directory; default: "
                     "$ESTUARY_FMNIST_DIR, then the usual places)")  # fmt: skip
    c.add_argument("--limit", type=int, default=0, metavar="N", help="the first N images only")
    c.add_argument("--class-names", metavar="A,B,...", help="class folder names in label order "
                   "(default: 0-9 or Fashion-MNIST's class names)")  # fmt: skip
    c.add_argument("--batch-size", type=int, default=256, help="images per ORT run")
    c.add_argument("--provider", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA where a GPU is visible, else CPU")  # fmt: skip
    c.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0 = default)")
    c.add_argument("--json", metavar="OUT", help="also write the result (predictions "
                   "included) as JSON to OUT ('-': print only the JSON)")  # fmt: skip
    c.set_defaults(func=cmd_classify)
