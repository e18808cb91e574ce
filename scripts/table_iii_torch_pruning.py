"""FedPhD Table III under a chosen Torch-Pruning version: Diff-Pruning's recipe at given ratios.

Diff-Pruning's ``ddpm_prune.py`` (the DepGraph script FedPhD builds on) prunes the whole
``ddpm-cifar10`` U-Net but ``conv_out`` with Torch-Pruning's local magnitude pruner at one
channel ratio, and reports ``tp.utils.count_ops_and_params``. This script does the same with
whichever Torch-Pruning it imports, so the versions can be compared with Table III
(``shared/models/pruning.py`` explains what the comparison shows):

    pip install --no-deps --target /tmp/tp-1.5.2 torch-pruning==1.5.2
    python scripts/table_iii_torch_pruning.py --tp /tmp/tp-1.5.2 --ratios 0.11,0.22,0.31,0.41
    python scripts/table_iii_torch_pruning.py --twice 0.22,0.25    # installed version, twice
    python scripts/table_iii_torch_pruning.py --global --ratios 0.45,0.5,0.55,0.6

Without ``--tp`` the installed Torch-Pruning is used.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
import warnings
from typing import Any

#: Table III, CIFAR-10: removed fraction -> (params M, MACs G)
TABLE_III = {
    0.0: (35.7, 6.1),
    0.25: (26.9, 4.2),
    0.44: (20.3, 3.4),
    0.61: (13.9, 2.1),
    0.74: (9.3, 1.5),
}


def _ratios(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of numbers: {text!r}"
        ) from err
    if not values or not all(0.0 < v < 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"ratios must lie in (0, 1): {text!r}")
    return values


def prune(
    tp: Any, model: Any, ratio: float, inputs: dict[str, Any], *, global_pruning: bool = False
) -> Any:
    """Diff-Pruning's step: local magnitude pruning at ``ratio``, ``conv_out`` kept
    (``global_pruning``: Torch-Pruning ranks the groups of the whole network instead)."""
    kwargs = {
        "importance": tp.importance.MagnitudeImportance(),
        "iterative_steps": 1,
        "channel_groups": {},
        "ignored_layers": [model.conv_out],
        "global_pruning": global_pruning,
    }
    try:  # Torch-Pruning >= 1.4 renamed ch_sparsity
        pruner = tp.pruner.MagnitudePruner(model, inputs, pruning_ratio=ratio, **kwargs)
    except TypeError:
        pruner = tp.pruner.MagnitudePruner(model, inputs, ch_sparsity=ratio, **kwargs)
    for group in pruner.step(interactive=True):
        group.prune()
    from shared.models.plan import sync_attributes  # after main() has put --tp first on the path

    sync_attributes(model)  # diffusers' size attributes, as every pruned model in Estuary
    return model


def main(argv: list[str] | None = None) -> int:
    """Print params and MACs for each ratio (or ratio pair with ``--twice``)."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--tp", help="directory a Torch-Pruning version was pip-installed into (--target)"
    )
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--ratios", type=_ratios, default=_ratios("0.1,0.25,0.3,0.4"))
    group.add_argument("--twice", type=_ratios, help="two ratios: prune, then prune the result")
    ap.add_argument(
        "--global", dest="global_pruning", action="store_true",
        help="Torch-Pruning's global pruning (groups ranked across the network by their "
        "weights, here the seed-0 initial ones) instead of Diff-Pruning's local pruning",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.twice is not None and len(args.twice) != 2:
        ap.error("--twice takes exactly two ratios")
    if args.tp:
        sys.path.insert(0, args.tp)
    warnings.filterwarnings("ignore")
    import torch

    tp = importlib.import_module("torch_pruning")
    from shared.models.presets import build_unet

    dists = importlib.metadata.distributions(path=[args.tp] if args.tp else sys.path)
    versions = [d.version for d in dists if d.metadata["Name"].lower() == "torch-pruning"]
    print(f"torch-pruning {versions[0] if versions else '?'} from {tp.__file__}")
    inputs = {"sample": torch.zeros(1, 3, 32, 32), "timestep": torch.ones((1,)).long()}
    dense = build_unet("ddpm-cifar10", seed=0).eval()
    base_macs, base_params = tp.utils.count_ops_and_params(dense, inputs)
    print(f"dense: {base_params / 1e6:.3f} M params, {base_macs / 1e9:.4f} G MACs")
    steps = [args.twice] if args.twice is not None else [[r] for r in args.ratios]
    for ratios in steps:
        model = build_unet("ddpm-cifar10", seed=0).eval()
        for r in ratios:
            model = prune(tp, model, r, inputs, global_pruning=args.global_pruning)
        macs, params = tp.utils.count_ops_and_params(model, inputs)
        removed = 1 - params / base_params
        row = min(TABLE_III, key=lambda k: abs(k - removed))
        paper_params, paper_macs = TABLE_III[row]
        print(
            f"ratio {'+'.join(f'{r:g}' for r in ratios)}: {params / 1e6:.3f} M "
            f"({removed:.3f} removed), {macs / 1e9:.4f} G; Table III {row:.0%} row: "
            f"{paper_params} M ({params / 1e6 / paper_params - 1:+.1%}), "
            f"{paper_macs} G ({macs / 1e9 / paper_macs - 1:+.1%})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
