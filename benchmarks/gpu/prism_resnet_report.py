#!/usr/bin/env python
"""The methods of a PRISM comparison at equal rounds, from each method's ``metrics.jsonl``:
works on a comparison stopped by its time budget too (``estuary compare`` writes its own
tables only once every method has finished).

Usage::

    python benchmarks/gpu/prism_resnet_report.py runs/prism-resnet-gpu

Prints a markdown table (FID at every round all methods evaluated, cumulative device upload
bytes, mean seconds per round, MADA's lambda) and writes ``equal_rounds.png`` into the
directory: FID against rounds and against cumulative device uploads.

When several FedAvg rows ran (labels starting with "FedAvg": one per learning rate), it says
which one the comparison keeps: the lowest mean training loss over the first
:data:`SELECT_ROUNDS` rounds (the feature-matching loss every device reports), never FID.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def read_method(path: Path) -> tuple[str, list[dict[str, Any]]]:
    """(label, rows) of one method's directory."""
    label = path.name
    method = path / "method.json"
    if method.is_file():
        label = json.loads(method.read_text()).get("label", label)
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line]
    return label, [r for r in rows if "round" in r]


#: the rounds whose training loss chooses FedAvg's learning rate
SELECT_ROUNDS = 5


def choose_fedavg(methods: list[tuple[str, list[dict[str, Any]]]]) -> str | None:
    """The FedAvg row with the lowest mean training loss over its first
    :data:`SELECT_ROUNDS` rounds (None: no FedAvg row has that many); printed with each
    candidate's figure."""
    losses = {}
    for label, rows in methods:
        first = [r["train_loss"] for r in rows[:SELECT_ROUNDS] if r.get("train_loss") is not None]
        if label.startswith("FedAvg") and len(first) == SELECT_ROUNDS:
            losses[label] = statistics.fmean(first)
    if not losses:
        return None
    chosen = min(losses, key=losses.__getitem__)
    shown = ", ".join(f"{k} {v:.1f}" for k, v in sorted(losses.items()))
    print(f"FedAvg's learning rate, on the mean training loss of rounds 1-{SELECT_ROUNDS} "
          f"({shown}): {chosen}\n")  # fmt: skip
    return chosen


def main(argv: list[str]) -> int:
    """Print the table, write the plot."""
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[0])
    methods = [read_method(p) for p in sorted(root.iterdir()) if (p / "metrics.jsonl").is_file()]
    if not methods:
        print(f"no metrics.jsonl under {root}", file=sys.stderr)
        return 1
    fid = {label: {r["round"]: r["quality"]["fid"] for r in rows if "quality" in r}
           for label, rows in methods}  # fmt: skip
    up: dict[str, dict[int, int]] = {}
    for label, rows in methods:
        total, up[label] = 0, {}
        for r in rows:
            total += r.get("bytes", {}).get("received:device_update", 0)
            up[label][r["round"]] = total
    common = sorted(set.intersection(*(set(f) for f in fid.values())))
    print(f"# {root.name}: quality at equal rounds\n")
    choose_fedavg(methods)
    head = ["method", "rounds done", "s/round (median)", "last MADA lambda"]
    head += [f"FID r{r}" for r in common] + ["device uploads MiB at last"]
    print("| " + " | ".join(head) + " |")
    print("|---" * (5 + len(common)) + "|")
    for label, rows in methods:
        secs = [r["durations"]["round_s"] for r in rows if "durations" in r]
        lam = [r["algorithm"]["mada_lambda"] for r in rows
               if "mada_lambda" in r.get("algorithm", {})]  # fmt: skip
        last = common[-1] if common else rows[-1]["round"]
        cells = [f"{fid[label][r]:.1f}" for r in common]
        print(f"| {label} | {len(rows)} | {statistics.median(secs):.1f} | "
              f"{lam[-1] if lam else '-'} | " + " | ".join(cells)
              + f" | {up[label].get(last, 0) / 2**20:.1f} |")  # fmt: skip
    _plot(methods, fid, up, root / "equal_rounds.png")
    return 0


def _plot(
    methods: list[tuple[str, list[dict[str, Any]]]],
    fid: dict[str, dict[int, float]],
    up: dict[str, dict[int, int]],
    path: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for label, _ in methods:
        rounds = sorted(fid[label])
        axes[0].plot([r + 1 for r in rounds], [fid[label][r] for r in rounds], marker="o",
                     label=label)  # fmt: skip
        axes[1].plot([up[label][r] / 2**20 for r in rounds], [fid[label][r] for r in rounds],
                     marker="o", label=label)  # fmt: skip
    axes[0].set(xlabel="round", ylabel="FID (fmnist-cnn-v1)", title="quality per round")
    axes[1].set(xlabel="cumulative device uploads, MiB (log)", ylabel="FID", xscale="log",
                title="quality against what the devices uploaded")  # fmt: skip
    for a in axes:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
