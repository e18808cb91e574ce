#!/usr/bin/env python
"""Pretrain a Fashion-MNIST generator for ``model.init = "pretrained"`` (the demo's start).

Usage (from the repository root)::

    python scripts/pretrain_generator.py --grid benchmarks/results/pretrained_fmnist_tiny.png

(the defaults are the shipped file's recipe: 3500 steps of batch 64, Adam at 2e-3, seed 0,
2 threads; 42 minutes on this 2-core CPU).

Trains the ``fmnist-tiny`` U-Net centrally with the DDPM loss on the Fashion-MNIST **test**
split (10k images: public data that no device holds; devices partition the train split, and
FID is measured against train images), keeps an exponential moving average of the weights,
and scores the average with the project's FID protocol. Only if that FID is at most
``--max-fid`` are the averaged weights written, atomically, as safetensors (never pickle) with
a ``.json`` sidecar, and the file's sha256 printed: put it into ``PRETRAINED`` in
``shared/models/init.py``. A grid of 64 samples is written as a PNG (``--grid``).

The demo's start, a generator that has seen the clothes only (T-shirt, trouser, pullover,
dress, coat, shirt; the demo's devices hold shoes), is trained on those classes'
test images and gated on its FID against train images of the same classes (against all ten,
even real images of six classes score about 205). 3,500 steps (21 minutes on two cores) give
FID 23.3 and clean tops, trousers, dresses and coats, and nothing else::

    python scripts/pretrain_generator.py --classes 0,1,2,3,4,6 --steps 3500 --threads 2 \
        --out shared/assets/fmnist_tiny_clothes.safetensors \
        --grid benchmarks/results/pretrained_fmnist_tiny_clothes.png

Its sidecar lists the ``classes`` and ``held_out_classes``; put its sha256 into
``SHIPPED_STARTS`` in ``shared/models/init.py``.

FedDEO's frozen generator is the classifier-free-guidance preset::

    python scripts/pretrain_generator.py --preset fmnist-tiny-cfg --steps 3500

It trains on the **public share** of the training split instead (``--source public``: 20,000
images drawn with a fixed seed, ``shared.data.domains.public_split``, that no device holds
when a run sets ``data.public_size = 20000``), each image seen in a domain drawn from
``--domain-mixture`` (identity 0.5, the five others 0.1 each; the domain is never given to the
model) and its label dropped to the null class with probability ``--p-uncond`` (0.1). Its
samples mix the domains, so its FID against plain train images is far above a plain
generator's: its gate (250; a random model scores about 350) only catches a broken run.

The unconditional ``fmnist-tiny`` was trained on the **test** split: never use it where a
classifier's accuracy is measured on that split.

All randomness (initialization from ``--seed``, batch order, noise, timesteps) comes from
generators seeded with ``--seed``; global RNGs are never used. With the same seed, thread
count and torch build the tensors should come out identical; the file's metadata also
records the training time, so its sha256 changes with every run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from tqdm import tqdm

from shared.config import RunConfig, config_from_dict
from shared.data.datasets import from_model_output, load_fashion_mnist, save_grid, to_model_input
from shared.data.domains import (
    DOMAINS,
    PUBLIC_SEED,
    apply_mixture,
    check_domains,
    mixture_domains,
    public_split,
)
from shared.diffusion.schedule import ddpm_loss, make_train_scheduler
from shared.diffusion.training import WeightAverage
from shared.errors import ConfigError, EstuaryError
from shared.evaluation import quality as quality_lib
from shared.evaluation.evaluator import Evaluator, reference_indices, write_grid
from shared.methods.feddeo.guidance import domain_grid
from shared.models.domain_axis import UNSPECIFIED, ClassDomainEmbedding, encode
from shared.models.init import ASSETS, PRETRAINED
from shared.models.presets import CFG_NUM_EMBEDS, CFG_PRESETS, DOMAIN_AXIS, build_unet
from shared.wire.codec import decode_tensors, file_sha256, write_asset

MAX_FID = 60.0
#: the FID gate of a classifier-free-guidance preset: its samples are a mixture of domains,
#: scored against plain train images, so the figure is far above a plain generator's
MAX_FID_CFG = 250.0  # a random fmnist-tiny-cfg scores about 350, a trained one about 200
DEFAULT_PUBLIC_SIZE = 20_000
DEFAULT_MIXTURE = "identity=0.5,rot90=0.1,invert=0.1,lowcontrast=0.1,noise=0.1,edges=0.1"
#: the mixture of a preset with a domain axis: identity-heavy, a default "realistic" mode
DEFAULT_MIXTURE_AXIS = "identity=0.75,rot90=0.05,invert=0.05,lowcontrast=0.05,noise=0.05,edges=0.05"


def parse_mixture(text: str) -> dict[str, float]:
    """``domain=weight,...`` as a dict (unknown domains and bad weights refused)."""
    out: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, weight = item.partition("=")
        out[name.strip()] = float(weight)
    check_domains(list(out))
    if not out or min(out.values()) < 0 or sum(out.values()) <= 0:
        raise ValueError(f"weights must be >= 0 with a positive sum: {text!r}")
    return out


def training_images(
    args: argparse.Namespace,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The pretraining images as model input, and for a classifier-free-guidance preset
    their labels, and for a preset with a domain axis each image's domain row (1 + its index
    in ``DOMAINS``): the test split, or the public share of the training split seen through
    the domain mixture (one domain per image, drawn with ``--seed``)."""
    cfg = config_from_dict({"model": {"preset": args.preset}})
    which = None
    if args.source == "test":
        ds = load_fashion_mnist("test", args.data)
        if args.classes is not None:  # only these classes' images (a start that leaves room)
            ds = ds.subset(np.flatnonzero(np.isin(ds.labels, args.classes)))
        images = ds.images
    else:
        ds = load_fashion_mnist("train", args.data)
        public, _ = public_split(len(ds), args.public_size)
        ds = ds.subset(public)
        rng = np.random.default_rng(np.random.SeedSequence([args.seed, 0x9B1C]))
        which = mixture_domains(len(ds), args.mixture, rng)
        images = apply_mixture(ds.images, which, rng)
    x = to_model_input(images, cfg.data.input_channels)
    labels = torch.from_numpy(ds.labels) if args.preset in CFG_PRESETS else None
    rows = None
    if args.preset in DOMAIN_AXIS:
        if which is None:
            raise ConfigError("a preset with a domain axis pretrains on the public share "
                              "(--source public)")  # fmt: skip
        rows = torch.from_numpy(which).long() + 1
    return x, labels, rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="fmnist-tiny", choices=sorted(PRETRAINED))
    p.add_argument(
        "--source",
        choices=("test", "public"),
        default=None,
        help="test: the Fashion-MNIST test split (the unconditional fmnist-tiny's "
        "recipe; never use its weights where accuracy is measured on that split); "
        "public: the public share of the training split no device holds "
        "(--public-size images, shared.data.domains.public_split). Default: public "
        "for a classifier-free-guidance preset, test otherwise",
    )
    p.add_argument(
        "--public-size",
        type=int,
        default=DEFAULT_PUBLIC_SIZE,
        help="images in the public share (runs must set data.public_size to it)",
    )
    p.add_argument(
        "--p-uncond",
        type=float,
        default=0.1,
        help="classifier-free guidance presets: chance a label is dropped to null",
    )
    p.add_argument(
        "--domain-mixture",
        default=None,
        help="classifier-free guidance presets: domain=weight,... each image is "
        "seen in a domain drawn from (given to the model only by a preset with a domain "
        f"axis). Default: {DEFAULT_MIXTURE_AXIS} with a domain axis, {DEFAULT_MIXTURE} "
        "otherwise",
    )
    p.add_argument(
        "--p-undomain",
        type=float,
        default=0.5,
        help="presets with a domain axis: chance an image's domain is dropped to "
        "'unspecified' (independently of the label dropout)",
    )
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from this safetensors file's weights instead of a random init (a "
        "preset with a domain axis may start from its plain classifier-free-guidance "
        "generator: its domain rows then start at zero)",
    )
    p.add_argument(
        "--classes",
        default=None,
        help="comma-separated class ids: train only on these classes' test images (the "
        "demo's start: 0,1,2,3,4,6, the clothes; the devices hold the others). Default: all",
    )
    p.add_argument("--steps", type=int, default=3500, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate")
    p.add_argument(
        "--emb-lr",
        type=float,
        default=None,
        help="Adam rate of the class (and domain) rows (default: --lr); a domain axis "
        "added to a pretrained generator starts at zero and needs a larger one to reach "
        "the scale of the class rows",
    )
    p.add_argument("--ema", type=float, default=0.999, help="decay of the weight average")
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=0,
        help="also write the weight average every this many steps to OUT.step<k>.safetensors "
        "(no gate: a look at a long run before it ends; 0 = never)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the init and the generators")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--data", default=None, help="directory with the Fashion-MNIST IDX files")
    p.add_argument("--out", type=Path, default=None, help="weights file (default: the asset)")
    p.add_argument("--grid", type=Path, default=None, help="sample grid (default: beside --out)")
    p.add_argument(
        "--domain-grid",
        type=Path,
        default=None,
        help="presets with a domain axis: a grid with one row per domain (unspecified "
        "first), 2 images of each class a row (default: beside --grid, *_domains.png)",
    )
    p.add_argument("--eval-samples", type=int, default=500, help="samples scored for the gate")
    p.add_argument(
        "--max-fid",
        type=float,
        default=None,
        help=f"refuse to write above this (default {MAX_FID:g}; {MAX_FID_CFG:g} for "
        "a classifier-free-guidance preset)",
    )
    args = p.parse_args(argv)
    if min(args.steps, args.batch_size, args.threads, args.eval_samples) < 1:
        p.error("--steps, --batch-size, --threads and --eval-samples must be >= 1")
    if not 0.0 <= args.ema < 1.0:
        p.error("--ema must be in [0, 1)")
    if args.source is None:
        args.source = "public" if args.preset in CFG_PRESETS else "test"
    if args.classes is not None:
        try:
            args.classes = sorted({int(c) for c in args.classes.split(",") if c.strip()})
        except ValueError:
            p.error(f"--classes: comma-separated class ids, got {args.classes!r}")
        if not args.classes or min(args.classes) < 0 or max(args.classes) > 9:
            p.error("--classes: ids in 0..9, at least one")
        if args.source != "test":
            p.error("--classes selects from the test split (--source test)")
    if not 0.0 <= args.p_uncond < 1.0:
        p.error("--p-uncond must be in [0, 1)")
    if not 0.0 <= args.p_undomain <= 1.0:
        p.error("--p-undomain must be in [0, 1]")
    if args.domain_mixture is None:
        axis = args.preset in DOMAIN_AXIS
        args.domain_mixture = DEFAULT_MIXTURE_AXIS if axis else DEFAULT_MIXTURE
    try:
        args.mixture = parse_mixture(args.domain_mixture)
    except (ValueError, ConfigError) as err:
        p.error(f"--domain-mixture: {err}")
    if args.out is None:
        args.out = ASSETS / PRETRAINED[args.preset][0]
    if args.grid is None:
        args.grid = args.out.with_suffix(".png")
    if args.domain_grid is None:
        args.domain_grid = args.grid.with_name(args.grid.stem + "_domains.png")
    return args


def start_from(model: torch.nn.Module, path: Path) -> None:
    """Load ``path``'s weights (safetensors) into ``model``: every tensor of the file must be
    the model's; a domain axis the file lacks starts at zero, so the model starts as exactly
    the file's generator with the domain unspecified and every domain alike."""
    tensors = decode_tensors(path.read_bytes())
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"class_embedding.domain_weight"}:
        raise ConfigError(f"--init-from {path}: missing {missing}, unexpected {unexpected}")
    emb = getattr(model, "class_embedding", None)
    if "class_embedding.domain_weight" in missing and isinstance(emb, ClassDomainEmbedding):
        with torch.no_grad():
            emb.domain_weight.zero_()


def train(args: argparse.Namespace) -> tuple[torch.nn.Module, float]:
    """Train from ``--seed``; return the weight average (eval mode) and the last 100 steps'
    mean loss."""
    cfg = config_from_dict({"model": {"preset": args.preset}, "run": {"seed": args.seed}})
    data, labels, rows = training_images(args)
    model = build_unet(args.preset, seed=args.seed)
    if args.init_from is not None:
        start_from(model, args.init_from)
    ema = WeightAverage(model, args.ema)  # decay min(ema, (1 + t) / (10 + t)): a short warm-up
    scheduler = make_train_scheduler(cfg.diffusion)
    gen = torch.Generator().manual_seed(args.seed)
    emb = [p for n, p in model.named_parameters() if n.startswith("class_embedding.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("class_embedding.")]
    groups = [{"params": rest}]
    if emb:  # the conditioning rows may learn at a rate of their own (--emb-lr)
        groups.append({"params": emb, "lr": args.emb_lr if args.emb_lr else args.lr})
    opt = torch.optim.Adam(groups, lr=args.lr)
    n, cursor = len(data), 0
    order = torch.randperm(n, generator=gen)
    recent: list[float] = []
    bar = tqdm(range(args.steps), desc="pretraining", unit="step", mininterval=5.0)
    for step in bar:
        if cursor + args.batch_size > n:
            order, cursor = torch.randperm(n, generator=gen), 0
        idx = order[cursor : cursor + args.batch_size]
        x = data[idx]
        cursor += args.batch_size
        y = None
        if labels is not None:  # label dropout to the null class (classifier-free guidance)
            y = labels[idx].clone()
            drop = torch.rand(len(y), generator=gen) < args.p_uncond
            y[drop] = CFG_NUM_EMBEDS - 1
        if rows is not None and y is not None:  # domain dropout to "unspecified" (row 0)
            r = rows[idx].clone()
            r[torch.rand(len(r), generator=gen) < args.p_undomain] = UNSPECIFIED
            y = encode(y, r)  # label + 11 x domain row
        loss = ddpm_loss(model, x, scheduler, gen, class_labels=y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema.update(model)
        recent = [*recent[-99:], loss.item()]
        if step % 100 == 99:
            bar.set_postfix(loss=f"{sum(recent) / len(recent):.4f}")
        done = step + 1
        if args.snapshot_every and done % args.snapshot_every == 0 and done < args.steps:
            snap = args.out.with_name(f"{args.out.stem}.step{done}.safetensors")
            info = {"preset": args.preset, "steps": done, "snapshot": True,
                    "loss": round(sum(recent) / len(recent), 5)}  # fmt: skip
            write_asset(snap, ema.averaged().state_dict(), info)  # moved back by ema.update
    return ema.averaged(), sum(recent) / len(recent)


def write_domain_grid(model: torch.nn.Module, cfg: RunConfig, path: Path, seed: int) -> Path:
    """A generator with a domain axis drawn in each domain row (unspecified, then
    ``DOMAINS``; 2 images per class a row, guidance 3 against the null, DDIM eta 1 in 25
    steps, the same start noise in every row), as a PNG."""
    images = domain_grid(model, cfg.diffusion, per_class=2, weight=3.0, steps=25, eta=1.0,
                         seed=seed)  # fmt: skip
    return save_grid(from_model_output(images), path, cols=20)


def class_reference(cfg: RunConfig, classes: list[int]) -> quality_lib.ReferenceStats:
    """The FID reference of a generator trained on ``classes`` only: ``eval.num_reference``
    train images of those classes (a fixed draw). Against all ten classes even real images
    of six of them score about 205 (500 samples), so that FID would not tell a good start
    from a poor one."""
    train = load_fashion_mnist("train", cfg.data.path or None)
    pool = np.flatnonzero(np.isin(train.labels, classes))
    pick = pool[reference_indices(len(pool), cfg.eval.num_reference)]
    return quality_lib.reference_stats(to_model_input(train.images[pick], 1))


def main(argv: list[str] | None = None) -> int:
    """Train, score, check the FID gate, write weights + sidecar + grid, print the sha256."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    eval_cfg = config_from_dict(
        {
            "model": {"preset": args.preset},
            "run": {"seed": args.seed},
            "data": {"path": args.data or ""},
            "eval": {"num_samples": args.eval_samples, "sample_steps": 50, "grid_size": 64},
        },
        source="pretrain",
    )
    try:
        model, loss = train(args)
        seconds = time.perf_counter() - t0
        print(f"trained {args.steps} steps in {seconds:.0f}s (last 100 steps: loss {loss:.4f})")
        evaluator = Evaluator(eval_cfg)
        if args.classes is not None:  # the gate: FID against train images of those classes
            evaluator.reference = class_reference(eval_cfg, args.classes)
        quality = evaluator.evaluate(model)
    except EstuaryError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    fid = float(quality["fid"])
    against = "train images" if args.classes is None else f"train images of classes {args.classes}"
    print(f"FID {fid:.2f} ({args.eval_samples} DDIM-50 samples vs {against}), IS "
          f"{quality['is_mean']:.2f}; samples per class {quality['class_shares']}")  # fmt: skip
    grid = write_grid(eval_cfg, model, args.grid)
    print(f"sample grid: {grid}")
    if args.preset in DOMAIN_AXIS:
        print(f"domain grid: {write_domain_grid(model, eval_cfg, args.domain_grid, args.seed)}")
    max_fid = (
        args.max_fid
        if args.max_fid is not None
        else (MAX_FID_CFG if args.preset in CFG_PRESETS else MAX_FID)
    )
    if fid > max_fid:
        print(
            f"refusing to write {args.out}: FID {fid:.2f} > {max_fid:.1f}; train longer "
            "(--steps) or try another --seed",
            file=sys.stderr,
        )
        return 1
    info: dict[str, object] = {
        "preset": args.preset,
        "data": (
            "fashion-mnist/test"
            if args.classes is None
            else f"fashion-mnist/test, classes {args.classes} only"
        )
        if args.source == "test"
        else f"fashion-mnist/train public share ({args.public_size} images, "
        f"shared.data.domains.public_split, seed {PUBLIC_SEED})",
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "emb_lr": args.emb_lr if args.emb_lr else args.lr,
        "ema": args.ema,
        "seed": args.seed,
        "final_loss": round(loss, 5),
        "fid": round(fid, 2),
        "fid_reference": "train images"
        if args.classes is None
        else f"train images of classes {args.classes}",
        "class_shares": quality["class_shares"],
        "fid_samples": args.eval_samples,
        "train_seconds": round(seconds),
        "torch": torch.__version__,
        "threads": args.threads,
    }
    if args.classes is not None:
        info.update(classes=args.classes, held_out_classes=[
            c for c in range(10) if c not in args.classes])  # fmt: skip
    if args.preset in CFG_PRESETS:
        info.update(
            public_size=args.public_size,
            p_uncond=args.p_uncond,
            domain_mixture=args.mixture,
            null_class=CFG_NUM_EMBEDS - 1,
        )
    if args.init_from is not None:
        info.update(init_from=f"{args.init_from.name} (sha256 {file_sha256(args.init_from)})")
    if args.preset in DOMAIN_AXIS:
        info.update(
            p_undomain=args.p_undomain,
            domain_rows=["unspecified", *DOMAINS],
            label_encoding="class + 11 * domain_row (shared.models.domain_axis)",
        )
    digest = write_asset(args.out, model.state_dict(), info)
    print(f"wrote {args.out}")
    print(f"sha256: {digest}")
    if args.classes is not None:
        print(f"set SHIPPED_STARTS[{args.out.name!r}] in shared/models/init.py to this value")
    else:
        print(f"set PRETRAINED[{args.preset!r}] in shared/models/init.py to this value")
    return 0


if __name__ == "__main__":
    sys.exit(main())
