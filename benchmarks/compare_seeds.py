"""A comparison's curves over seeds: for every method of a compare spec run once per seed
(``OUT/seed<s>``, each an ``estuary compare SPEC --out OUT/seed<s>`` with
``ESTUARY__RUN__SEED=<s>``), the training loss and the FID of every round, and a table of the
last round's figures as mean, sample standard deviation and range over the seeds.

    python benchmarks/compare_seeds.py configs/compare/compare_fedadam_cpu.toml runs/fedadam

Writes ``table.md``, ``table.json`` and ``curves.png`` (loss and FID per round: the mean over
seeds, the range shaded, each seed a thin line) in ``OUT`` (or ``--into``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from estuary.compare.spec import load_compare

#: a round's figures read from ``metrics.jsonl`` (name -> how to read it from a row)
FIGURES = ("train_loss", "fid")


def seeds_of(out: Path) -> list[int]:
    """The seeds with a folder ``seed<s>`` in ``out``."""
    return sorted(int(p.name[4:]) for p in out.glob("seed*") if p.name[4:].isdigit())


def per_round(run_dir: Path) -> dict[str, dict[int, float]]:
    """Round -> training loss, and round -> FID where the round was evaluated."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{run_dir}: not run yet (no metrics.jsonl)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    curves: dict[str, dict[int, float]] = {name: {} for name in FIGURES}
    for row in rows:
        if row.get("train_loss") is not None:
            curves["train_loss"][row["round"]] = float(row["train_loss"])
        if row.get("quality"):
            curves["fid"][row["round"]] = float(row["quality"]["fid"])
    return curves


def summary(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), min and max."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "sd": sd, "min": min(values), "max": max(values)}


def collect(spec_path: Path, out: Path) -> dict[str, Any]:
    """Every method's per-round curves of every seed, and their last-round summaries."""
    spec = load_compare(spec_path)
    seeds = seeds_of(out)
    if not seeds:
        raise SystemExit(f"{out}: no seed<s> folder")
    methods: dict[str, Any] = {}
    for m in spec.methods:
        runs = {s: per_round(out / f"seed{s}" / m.slug) for s in seeds}
        last: dict[str, Any] = {}
        for name in FIGURES:
            ends = [max(r[name].items())[1] for r in runs.values() if r[name]]
            best = [min(r[name].values()) for r in runs.values() if r[name]]
            if len(ends) == len(seeds):
                last[name] = {"per_seed": ends, **summary(ends)}
                last[f"best_{name}"] = {"per_seed": best, **summary(best)}
        methods[m.label] = {
            "slug": m.slug,
            "algorithm": m.cfg.algorithm.name,
            "curves": {
                str(s): {name: {str(r): v for r, v in c.items()} for name, c in curves.items()}
                for s, curves in runs.items()
            },
            "last": last,
        }
    return {"name": spec.name, "spec": str(spec_path), "seeds": seeds, "methods": methods}


def _cell(block: dict[str, Any] | None) -> str:
    if not block:
        return "-"
    return f"{block['mean']:.4g} ± {block['sd']:.2g} ({block['min']:.4g} to {block['max']:.4g})"


def write_table(doc: dict[str, Any], into: Path) -> None:
    """``table.md`` and ``table.json``."""
    lines = [
        f"# {doc['name']}: {len(doc['seeds'])} seeds ({', '.join(map(str, doc['seeds']))})",
        "",
        "mean ± sample standard deviation (range) over the seeds, of each seed's last round "
        "(best: the lowest of its rounds)",
        "",
        "| method | algorithm | train loss, last round | FID, last round | best FID |",
        "|---|---|---|---|---|",
    ]
    for label, m in doc["methods"].items():
        last = m["last"]
        lines.append(f"| {label} | {m['algorithm']} | {_cell(last.get('train_loss'))} | "
                     f"{_cell(last.get('fid'))} | {_cell(last.get('best_fid'))} |")  # fmt: skip
    lines += ["", "per seed (seed: train loss, FID of the last round):", ""]
    for label, m in doc["methods"].items():
        cells = []
        for i, s in enumerate(doc["seeds"]):
            figures = [f"{m['last'][name]['per_seed'][i]:.4g}" for name in FIGURES
                       if name in m["last"]]  # fmt: skip
            cells.append(f"{s}: " + ", ".join(figures))
        lines.append(f"- {label}: " + "; ".join(cells))
    (into / "table.md").write_text("\n".join(lines) + "\n")
    (into / "table.json").write_text(json.dumps(doc, indent=1) + "\n")


def write_curves(doc: dict[str, Any], path: Path) -> None:
    """``curves.png``: loss and FID per round, the mean over seeds with its range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    titles = {"train_loss": "training loss (devices' mean, per round)",
              "fid": "FID per round (lower is better)"}  # fmt: skip
    for ax, name in zip(axes, FIGURES, strict=True):
        for i, (label, m) in enumerate(doc["methods"].items()):
            color = f"C{i}"
            curves = [{int(r): v for r, v in c[name].items()} for c in m["curves"].values()]
            rounds = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if not rounds:
                continue
            for c in curves:
                ax.plot(sorted(c), [c[r] for r in sorted(c)], color=color, lw=0.6, alpha=0.4)
            values = [[c[r] for c in curves] for r in rounds]
            ax.fill_between(rounds, [min(v) for v in values], [max(v) for v in values],
                            color=color, alpha=0.15)  # fmt: skip
            ax.plot(rounds, [statistics.fmean(v) for v in values], color=color, marker="o",
                    ms=3, label=f"{label} (mean of {len(curves)} seeds)")  # fmt: skip
        ax.set(xlabel="round", title=titles[name], ylabel=name.replace("_", " "))
        if name == "train_loss":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", type=Path, help="the compare spec every seed ran")
    parser.add_argument("out", type=Path, help="the folder holding seed<s>/ runs")
    parser.add_argument("--into", type=Path, help="where to write (default: OUT)")
    args = parser.parse_args()
    into = args.into or args.out
    into.mkdir(parents=True, exist_ok=True)
    doc = collect(args.spec, args.out)
    write_table(doc, into)
    write_curves(doc, into / "curves.png")
    print((into / "table.md").read_text())


if __name__ == "__main__":
    main()
