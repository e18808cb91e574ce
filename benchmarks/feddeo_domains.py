"""The table over seeds of ``benchmarks/feddeo_domains.sh``: FedDEO on the generator that
knows domains (fmnist-tiny-dom) against the controls that separate its mechanisms, under
feature skew (accuracy per domain on the real test split seen in each domain, mean and
standard deviation over seeds), and one figure of each device's synthetic images beside
real images of its domain.

    python benchmarks/feddeo_domains.py benchmarks/results/compare_feddeo_dom_cpu

Reads ``OUT/seed<s>/<method>/summary.json`` (configs/compare/compare_feddeo_dom_cpu.toml);
the FedAvg classifier and the Ceiling come from there too, or, where a seed lacks them,
from ``--baselines`` (default benchmarks/results/compare_feddeo_cpu: the same split, model
and recipe). Writes ``table.md``, ``table.json``, ``accuracy_seeds.png`` and
``grids_seed<s>.png`` (the first seed) in ``OUT``.

The variants on the same generator, where ``OUT`` holds them (run by ``bash
benchmarks/feddeo_domains.sh``'s commands on ``compare_feddeo_dom_labelskew_cpu.toml`` into
``OUT/labelskew-seed<s>`` and ``compare_feddeo_dom_ablation_cpu.toml`` into
``OUT/ablation-seed<s>``), go to ``variants.md``: label skew (FedDEO and Prompts-Only with
their guidance controls; the FedAvg classifier and the Ceiling from ``--baselines``'
``labelskew-seed<s>/table.json``) and the description passes E (0.5, 3 and the main
table's 1), each at (3, 3) and with the descriptions alone (0, 3).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository (shared)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # feddeo_seeds beside this file

from feddeo_seeds import mean_sd, pct, plot, read_run, seeds_of

#: (row label, method folder, accuracy_by_guidance key or None for the run's own figures)
ROWS = (
    ("Prompts-Only (w_t 3)", "prompts-only", None),
    ("Prompts-Only (w_t 6)", "prompts-only", "wt6_wd0"),
    ("FedDEO (3, 3)", "feddeo", None),
    ("FedDEO descriptions only (0, 3)", "feddeo", "wt0_wd3"),
    ("Oracle (true domain, w_t 3)", "oracle", None),
    ("FedAvg classifier", "fedavg-classifier", None),
    ("Ceiling", "ceiling", None),
)
#: the domains a table.json's acc_<domain> columns may name
DOMAIN_NAMES = ("identity", "rot90", "invert", "lowcontrast", "noise", "edges")
#: the rows that do not depend on the generator (taken from --baselines where missing)
BASELINES = ("fedavg-classifier", "ceiling")
#: (column title, method folder, synthetic-grid folder) of the figure
GRIDS = (
    ("Prompts-Only (3)", "prompts-only", "synthetic"),
    ("FedDEO (3, 3)", "feddeo", "synthetic"),
    ("FedDEO (0, 3)", "feddeo", "synthetic_wt0_wd3"),
    ("Oracle", "oracle", "synthetic"),
)


def row_of(run_dir: Path, key: str | None) -> dict[str, Any]:
    """A row's per-domain accuracy and mean: the run's own, or its ``key`` control's."""
    run = read_run(run_dir)
    if key is None:
        return run
    final = json.loads((run_dir / "summary.json").read_text())["final"]
    acc = dict(final["accuracy_by_guidance"][key])
    mean = acc.pop("mean")
    return {"accuracy": acc, "mean": mean, "rounds": run["rounds"]}


def baseline_row(table_json: Path, label: str) -> dict[str, Any] | None:
    """A baseline's per-domain accuracy and mean from a comparison's ``table.json`` (what
    benchmarks/results keeps of a run whose records are not tracked), or None."""
    if not table_json.is_file():
        return None
    for row in json.loads(table_json.read_text())["rows"]:
        if row["method"] == label:
            acc = {k[4:]: v / 100 for k, v in row.items()
                   if k.startswith("acc_") and k[4:] in DOMAIN_NAMES}  # fmt: skip
            return {"accuracy": acc, "mean": row["acc_mean"] / 100, "rounds": row["rounds"]}
    return None


def collect(out: Path, baselines: Path) -> dict[str, list[dict[str, Any]]]:
    """Per row label, the runs of every seed of ``out`` (in seed order); the FedAvg
    classifier and the Ceiling from ``baselines`` where ``out`` lacks them (its run records,
    else its table.json)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for label, folder, key in ROWS:
        rows = []
        for s in seeds_of(out, "seed"):
            where = out / f"seed{s}" / folder
            if not (where / "summary.json").is_file() and folder in BASELINES:
                where = baselines / f"seed{s}" / folder
                if not (where / "summary.json").is_file():
                    row = baseline_row(baselines / f"seed{s}" / "table.json", label)
                    if row is not None:
                        rows.append({"seed": s, "source": str(where.parent), **row})
                    continue
            if (where / "summary.json").is_file():
                rows.append({"seed": s, "source": str(where), **row_of(where, key)})
        if rows:
            runs[label] = rows
    return runs


def table(runs: dict[str, list[dict[str, Any]]]) -> tuple[list[str], dict[str, Any]]:
    """Markdown and JSON: every row's accuracy per domain and mean, mean ± sd over its
    seeds (with the seeds it has)."""
    first = next(iter(runs.values()))[0]
    domains = list(first["accuracy"])
    lines = [
        "Accuracy (%) on the real Fashion-MNIST test split seen in each domain, mean ± sd "
        "over the seeds in the last column:",
        "",
        "| row | " + " | ".join(domains) + " | mean | seeds |",
        "|---|" + "---|" * (len(domains) + 2),
    ]
    out: dict[str, Any] = {"domains": domains, "rows": {}}
    for label, rs in runs.items():
        entry: dict[str, Any] = {"accuracy": {}, "per_seed": rs}
        cells = []
        for d in domains:
            m, sd = mean_sd([r["accuracy"][d] for r in rs])
            entry["accuracy"][d] = [m, sd]
            cells.append(f"{pct(m)} ± {pct(sd)}")
        m, sd = mean_sd([r["mean"] for r in rs])
        entry["mean"] = [m, sd]
        seeds = [r["seed"] for r in rs]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | **{pct(m)} ± {pct(sd)}** | "
                     f"{', '.join(map(str, seeds))} |")  # fmt: skip
        out["rows"][label] = entry
    lines.append("")
    return lines, out


def grids_figure(out: Path, seed: int, path: Path) -> Path | None:
    """Each device's synthetic grid of every generating row beside 40 real test images of
    its domain (4 of each class), one device a row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from PIL import Image

    from shared.config import config_from_dict
    from shared.data.partition import domain_test_sets

    base = out / f"seed{seed}"
    cfg_path = base / "oracle" / "config.json"
    if not cfg_path.is_file():
        return None
    cfg = config_from_dict(json.loads(cfg_path.read_text()))
    tests = domain_test_sets(cfg)
    domains = cfg.data.domains
    fig, axes = plt.subplots(len(domains), len(GRIDS) + 1,
                             figsize=(3 * (len(GRIDS) + 1), 3 * len(domains)))  # fmt: skip
    for i, domain in enumerate(domains):
        for j, (title, folder, sub) in enumerate(GRIDS):
            ax = axes[i, j]
            png = base / folder / sub / f"dev{i:03d}.png"
            if png.is_file():
                ax.imshow(np.asarray(Image.open(png)), cmap="gray")
            ax.set_axis_off()
            if i == 0:
                ax.set_title(title, fontsize=10)
        images, labels = tests[domain]
        pick = np.concatenate([np.flatnonzero(labels == c)[:4] for c in range(10)])
        real = images[pick]
        h, w = real.shape[1:3]
        canvas = np.full((7 * (h + 2) + 2, 6 * (w + 2) + 2), 255, dtype=np.uint8)
        for k, img in enumerate(real):
            r, c = divmod(k, 6)
            canvas[2 + r * (h + 2) : 2 + r * (h + 2) + h, 2 + c * (w + 2) : 2 + c * (w + 2) + w] = (
                img
            )
        ax = axes[i, len(GRIDS)]
        ax.imshow(canvas, cmap="gray", vmin=0, vmax=255)
        ax.set_axis_off()
        if i == 0:
            ax.set_title("real (test split)", fontsize=10)
        axes[i, 0].text(-0.05, 0.5, f"dev{i:03d}\n{domain}", transform=axes[i, 0].transAxes,
                        ha="right", va="center", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


#: (row label, method folder, accuracy_by_guidance key) of the label-skew variant
LABELSKEW_ROWS = (
    ("Prompts-Only (w_t 3)", "prompts-only", None),
    ("Prompts-Only (w_t 6)", "prompts-only", "wt6_wd0"),
    ("FedDEO (3, 3)", "feddeo", None),
    ("FedDEO descriptions only (0, 3)", "feddeo", "wt0_wd3"),
)
#: (E, folder prefix, method folder) of the description-pass ablation; E = 1 is the main run
ABLATION_ROWS = (
    ("0.5", "ablation-seed", "feddeo-e-0-5"),
    ("1", "seed", "feddeo"),
    ("3", "ablation-seed", "feddeo-e-3"),
)


def _cell(values: list[float]) -> str:
    m, sd = mean_sd(values)
    return f"{pct(m)} ± {pct(sd)}"


def variants(out: Path, baselines: Path) -> list[str]:
    """``variants.md``'s lines: the label-skew rows and the E ablation over the seeds
    ``out`` holds of each (empty where it holds none)."""
    lines: list[str] = []
    seeds = seeds_of(out, "labelskew-seed")
    if seeds:
        lines += ["## Label skew (5 devices x 2 classes, no transform; identity test split)", "",
                  "| row | accuracy (%) | seeds |", "|---|---|---|"]  # fmt: skip
        for label, folder, key in LABELSKEW_ROWS:
            got = [
                (s, row_of(out / f"labelskew-seed{s}" / folder, key)["mean"])
                for s in seeds
                if (out / f"labelskew-seed{s}" / folder / "summary.json").is_file()
            ]
            if got:
                lines.append(f"| {label} | {_cell([v for _, v in got])} | "
                             f"{', '.join(str(s) for s, _ in got)} |")  # fmt: skip
        for label in ("FedAvg classifier", "Ceiling"):
            got = [(s, row["mean"]) for s in seeds
                   if (row := baseline_row(baselines / f"labelskew-seed{s}" / "table.json",
                                           label)) is not None]  # fmt: skip
            if got:
                lines.append(f"| {label} (the earlier run's, same split) | "
                             f"{_cell([v for _, v in got])} | "
                             f"{', '.join(str(s) for s, _ in got)} |")  # fmt: skip
        lines.append("")
    seeds = seeds_of(out, "ablation-seed")
    if seeds:
        lines += [
            "## Description passes E (feature skew, mean over the domains, %)",
            "",
            "| E | FedDEO (3, 3) | descriptions only (0, 3) | seeds |",
            "|---|---|---|---|",
        ]
        for e, prefix, folder in ABLATION_ROWS:
            dirs = [(s, out / f"{prefix}{s}" / folder) for s in seeds]
            dirs = [(s, d) for s, d in dirs if (d / "summary.json").is_file()]
            if dirs:
                both = [_cell([row_of(d, None)["mean"] for _, d in dirs])]
                try:  # the ablation's spec generates no (0, 3) control; the main run does
                    both.append(_cell([row_of(d, "wt0_wd3")["mean"] for _, d in dirs]))
                except KeyError:
                    both.append("-")
                lines.append(f"| {e} | {both[0]} | {both[1]} | "
                             f"{', '.join(str(s) for s, _ in dirs)} |")  # fmt: skip
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--baselines", type=Path, default=Path("benchmarks/results/compare_feddeo_cpu"))
    args = p.parse_args(argv)
    runs = collect(args.out, args.baselines)
    if not runs:
        raise SystemExit(f"{args.out}: no finished run (benchmarks/feddeo_domains.sh)")
    lines, out = table(runs)
    lines = ["# FedDEO on a generator that knows domains", "", *lines]
    (args.out / "table.md").write_text("\n".join(lines))
    (args.out / "table.json").write_text(json.dumps(out, indent=2))
    seeds = sorted({r["seed"] for rs in runs.values() for r in rs})
    plot({"domains": out["domains"], "seeds": seeds,
          "methods": {k: {"accuracy": v["accuracy"], "mean": v["mean"]}
                      for k, v in out["rows"].items()}},
         args.out / "accuracy_seeds.png")  # fmt: skip
    if seeds:
        grids_figure(args.out, seeds[0], args.out / f"grids_seed{seeds[0]}.png")
    extra = variants(args.out, args.baselines)
    if extra:
        (args.out / "variants.md").write_text("\n".join(["# FedDEO's variants on fmnist-tiny-dom",
                                                         "", *extra]))  # fmt: skip
    print("\n".join([*lines, *extra]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
