"""The FedDEO table over seeds of ``benchmarks/feddeo_seeds.sh``: FedDEO against Prompts-Only,
the FedAvg classifier and the Ceiling under feature skew (accuracy per domain on the real
test split seen in each domain, mean and standard deviation over seeds), the per-domain gap
FedDEO - Prompts-Only, each method's upload per device, and the N / E ablations (seed 003,
Tables 1, 3 and 4).

    python benchmarks/feddeo_seeds.py benchmarks/results/compare_feddeo_cpu

Reads ``OUT/seed<s>/<method>/summary.json`` (and ``OUT/ablation-seed<s>/...`` when present,
and ``OUT/labelskew-seed<s>/...``); writes ``table.md``, ``table.json`` and
``accuracy_seeds.png`` in ``OUT``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

#: (label, method folder) of the feature-skew comparison
METHODS = (
    ("FedDEO", "feddeo"),
    ("Prompts-Only", "prompts-only"),
    ("FedAvg classifier", "fedavg-classifier"),
    ("Ceiling", "ceiling"),
)


def seeds_of(out: Path, prefix: str) -> list[int]:
    """The seeds with a folder ``<prefix><s>`` in ``out``."""
    n = len(prefix)
    return sorted(int(p.name[n:]) for p in out.glob(f"{prefix}*") if p.name[n:].isdigit())


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def read_run(run_dir: Path) -> dict[str, Any]:
    """A method's final per-domain accuracy, rounds and device upload from its summary."""
    path = run_dir / "summary.json"
    if not path.is_file():
        raise SystemExit(f"{run_dir}: not run yet (benchmarks/feddeo_seeds.sh)")
    summary = json.loads(path.read_text())
    final = summary.get("final")
    if not final:
        raise SystemExit(f"{path}: no final per-domain accuracy")
    out: dict[str, Any] = {
        "accuracy": final["accuracy"],
        "mean": final["mean_accuracy"],
        "rounds": summary.get("rounds"),
        "by_n": final.get("accuracy_by_n", {}),
    }
    cfg_path = run_dir / "config.json"
    devices = None
    if cfg_path.is_file():
        devices = json.loads(cfg_path.read_text())["federation"]["num_devices"]
    traffic = summary.get("traffic", {}).get("bytes", {})
    if traffic and devices:
        blobs = traffic.get("sent:device_update", 0) + traffic.get("sent:description", 0)
        out["upload_blob_per_device"] = blobs / devices
        out["upload_msgs_per_device"] = traffic.get("sent:msg_device_update", 0) / devices
        out["download_per_device"] = traffic.get("received:global_model", 0) / devices
    return out


def collect(out: Path, prefix: str, methods: tuple[tuple[str, str], ...]) -> dict[str, list]:
    """Per method label, the runs of every seed (in seed order)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for label, folder in methods:
        runs[label] = [
            {"seed": s, **read_run(out / f"{prefix}{s}" / folder)} for s in seeds_of(out, prefix)
        ]
    return runs


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def feature_table(runs: dict[str, list[dict[str, Any]]]) -> tuple[list[str], dict[str, Any]]:
    """Markdown lines and JSON of the feature-skew comparison over seeds."""
    first = next(iter(runs.values()))[0]
    domains = list(first["accuracy"])
    seeds = [r["seed"] for r in next(iter(runs.values()))]
    lines = [
        f"Accuracy (%) on the real Fashion-MNIST test split seen in each domain, mean ± sd "
        f"over seeds {seeds}:",
        "",
        "| method | " + " | ".join(domains) + " | mean | rounds | upload / device |",
        "|---|" + "---|" * (len(domains) + 3),
    ]
    table: dict[str, Any] = {"seeds": seeds, "domains": domains, "methods": {}}
    for label, rs in runs.items():
        cells = []
        entry: dict[str, Any] = {"accuracy": {}, "per_seed": rs}
        for d in domains:
            m, sd = mean_sd([r["accuracy"][d] for r in rs])
            entry["accuracy"][d] = [m, sd]
            cells.append(f"{pct(m)} ± {pct(sd)}")
        m, sd = mean_sd([r["mean"] for r in rs])
        entry["mean"] = [m, sd]
        up = rs[0].get("upload_blob_per_device", 0) + rs[0].get("upload_msgs_per_device", 0)
        entry["upload_per_device_bytes"] = up
        lines.append(
            f"| {label} | " + " | ".join(cells) + f" | **{pct(m)} ± {pct(sd)}** | "
            f"{rs[0]['rounds']} | {f'{up / 1024:,.1f} KiB' if up else '- (centralized)'} |"
        )
        table["methods"][label] = entry
    lines.append("")
    if "FedDEO" in runs and "Prompts-Only" in runs:
        gaps = {
            d: [
                a["accuracy"][d] - b["accuracy"][d]
                for a, b in zip(runs["FedDEO"], runs["Prompts-Only"], strict=True)
            ]
            for d in domains
        }
        gaps["mean"] = [
            a["mean"] - b["mean"] for a, b in zip(runs["FedDEO"], runs["Prompts-Only"], strict=True)
        ]
        table["gap_feddeo_minus_prompts"] = {k: mean_sd(v) for k, v in gaps.items()}
        lines += [
            "FedDEO − Prompts-Only (points), mean ± sd over seeds; per seed in brackets:",
            "",
            "| " + " | ".join([*domains, "mean"]) + " |",
            "|" + "---|" * (len(domains) + 1),
            "| "
            + " | ".join(
                f"{100 * mean_sd(v)[0]:+.1f} ± {100 * mean_sd(v)[1]:.1f} "
                f"[{', '.join(f'{100 * x:+.1f}' for x in v)}]"
                for v in gaps.values()
            )
            + " |",
            "",
        ]
    if "FedAvg classifier" in table["methods"] and "FedDEO" in table["methods"]:
        fa = table["methods"]["FedAvg classifier"]["upload_per_device_bytes"]
        fd = table["methods"]["FedDEO"]["upload_per_device_bytes"]
        if fd:
            table["upload_ratio_fedavg_over_feddeo"] = fa / fd
            lines += [
                f"Upload per device: FedDEO {fd:,.0f} B in one round (blob and message) vs the "
                f"FedAvg classifier's {fa:,.0f} B over its rounds: {fa / fd:,.0f}× less.",
                "",
            ]
    return lines, table


def ablation_table(out: Path) -> tuple[list[str], dict[str, Any]]:
    """The N and E ablations (mean over the ablation seeds)."""
    seeds = seeds_of(out, "ablation-seed")
    if not seeds:
        return [], {}
    n_rows: dict[str, list[dict[str, float]]] = {}
    e_rows: dict[str, list[float]] = {}
    for s in seeds:
        base = out / f"ablation-seed{s}"
        n50 = read_run(base / "feddeo-n-50")
        for n, acc in n50["by_n"].items():
            n_rows.setdefault(n, []).append(acc)
        e_rows.setdefault("5", []).append(n50["by_n"]["30"]["mean"])
        for e in ("1", "10"):
            e_rows.setdefault(e, []).append(read_run(base / f"feddeo-e-{e}")["mean"])
    domains = [k for k in next(iter(n_rows.values()))[0] if k != "mean"]
    lines = [
        f"Ablations (seeds {seeds}), accuracy (%) per domain and mean:",
        "",
        *_setting_table(
            "setting", {f"N = {n}": n_rows[n] for n in sorted(n_rows, key=int)}, domains
        ),
    ]
    lines.append("| description epochs E (N = 30) | mean |")
    lines.append("|---|---|")
    for e in sorted(e_rows, key=int):
        lines.append(f"| E = {e} | {pct(statistics.fmean(e_rows[e]))} |")
    lines.append("")
    w_rows: dict[str, list[dict[str, float]]] = {}
    for s in seeds_of(out, "wd-seed"):
        main = out / f"seed{s}"
        w_rows.setdefault("0", []).append(_domains(read_run(main / "prompts-only")))
        w_rows.setdefault("3", []).append(_domains(read_run(main / "feddeo")))
        for w in ("1", "5"):
            w_rows.setdefault(w, []).append(
                _domains(read_run(out / f"wd-seed{s}" / f"feddeo-w-d-{w}"))
            )
    if w_rows:
        lines += [
            f"Description weight w_d at w_t = 3 (seeds {seeds_of(out, 'wd-seed')}; w_d = 0 is "
            "Prompts-Only's generation, 3 the paper's code):",
            "",
            *_setting_table("w_d", {w: w_rows[w] for w in sorted(w_rows, key=float)}, domains),
        ]
    return lines, {"seeds": seeds, "N": n_rows, "E": e_rows, "w_d": w_rows}


def _setting_table(
    head: str, settings: dict[str, list[dict[str, float]]], domains: list[str]
) -> list[str]:
    """Markdown rows: one per setting, its accuracy per domain and mean (%) averaged over
    its runs, then a blank line."""
    lines = [f"| {head} | " + " | ".join(domains) + " | mean |",
             "|---|" + "---|" * (len(domains) + 1)]  # fmt: skip
    for label, rows in settings.items():
        lines.append(
            f"| {label} | "
            + " | ".join(pct(statistics.fmean(r[d] for r in rows)) for d in domains)
            + f" | **{pct(statistics.fmean(r['mean'] for r in rows))}** |"
        )
    return [*lines, ""]


def _domains(run: dict[str, Any]) -> dict[str, float]:
    """A run's accuracy per domain with its ``mean``."""
    return {**run["accuracy"], "mean": run["mean"]}


def plot(table: dict[str, Any], path: Path) -> None:
    """Grouped bars: domains x methods, mean over seeds with sd whiskers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = [*table["domains"], "mean"]
    methods = list(table["methods"])
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(10, 4))
    for k, label in enumerate(methods):
        entry = table["methods"][label]
        vals = [entry["accuracy"][d] if d != "mean" else entry["mean"] for d in domains]
        xs = [i + (k - (len(methods) - 1) / 2) * width for i in range(len(domains))]
        ax.bar(xs, [100 * v[0] for v in vals], width, yerr=[100 * v[1] for v in vals],
               label=label, capsize=2)  # fmt: skip
    ax.set_xticks(range(len(domains)), domains)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"FedDEO on Fashion-MNIST domains (seeds {table['seeds']})")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    lines = ["# FedDEO over seeds", ""]
    runs = collect(args.out, "seed", METHODS)
    feat_lines, table = feature_table(runs)
    lines += ["## Feature skew", "", *feat_lines]
    abl_lines, abl = ablation_table(args.out)
    if abl_lines:
        lines += ["## Ablations", "", *abl_lines]
        table["ablations"] = abl
    if seeds_of(args.out, "labelskew-seed"):
        label_runs = collect(args.out, "labelskew-seed", METHODS)
        label_lines, label_table = feature_table(label_runs)
        lines += ["## Label skew", "", *label_lines]
        table["label_skew"] = label_table
    (args.out / "table.md").write_text("\n".join(lines))
    (args.out / "table.json").write_text(json.dumps(table, indent=2))
    plot(table, args.out / "accuracy_seeds.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
