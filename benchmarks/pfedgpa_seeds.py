"""The table over seeds of ``benchmarks/pfedgpa_seeds.sh``: pFedGPA against Local-only and
FedAvg(-FT), each figure the mean (and standard deviation) over seeds of the devices' mean
accuracy on their own test splits in the last round, and the issue's three checks against
the paper (seed 004, Tables 1-2, Fashion-MNIST, 20 clients).

    python benchmarks/pfedgpa_seeds.py runs/pfedgpa-seeds --fork 150

Writes ``table.md``, ``table.json`` and ``accuracy_seeds.png`` in the folder. Where a seed's
fork has no direct-generation run but an offline sweep (``seed<s>-fork/sweep/inversion.json``,
``benchmarks/pfedgpa_inversion.py``: the same diffusion model and generation noise the cloud
would use), the "pFedGPA, direct" row comes from the sweep, and the sweep's rows and swap
table are averaged over the seeds too.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

#: (label, folder suffix, method folder): where each method's runs lie under OUT/seed<s>…
METHODS = (
    ("Local-only", "", "local-only"),
    ("FedAvg", "", "fedavg"),
    ("pFedGPA", "-fork", "pfedgpa"),
    ("pFedGPA, direct", "-fork", "pfedgpa-direct"),
)
#: the paper's gaps at 20 clients on Fashion-MNIST (points) and the tolerances of the checks
PAPER_FT_OVER_LOCAL, PAPER_LOCAL_OVER_FEDAVG, TOLERANCE = 4.5, 1.9, 1.5
C2_GAP, C2_OVER_LOCAL = 0.7, 3.0


def last_accuracy(run_dir: Path) -> dict[str, Any]:
    """The accuracy block of the last round of ``run_dir/metrics.jsonl`` that has one."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in rows if r.get("accuracy")]
    if not measured:
        raise SystemExit(f"{run_dir}: no round measured accuracy")
    last = measured[-1]
    return {"round": last["round"], "rounds": rows[-1]["round"], **last["accuracy"]}


def seeds_of(out: Path) -> list[int]:
    """The seeds with a folder ``seed<s>`` in ``out``."""
    return sorted(int(p.name[4:]) for p in out.glob("seed*") if p.name[4:].isdigit())


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


#: the sweep's row that stands for a direct-generation run
DIRECT_ROW = "direct generation"


def sweep_of(out: Path, seed: int) -> dict[str, Any] | None:
    """The offline sweep of the seed's fork, if made."""
    path = out / f"seed{seed}-fork" / "sweep" / "inversion.json"
    return json.loads(path.read_text()) if path.is_file() else None


def from_sweep(row: dict[str, Any]) -> dict[str, Any]:
    """A sweep row in :func:`last_accuracy`'s shape (fractions), marked offline."""
    b, a = row["before"], row["after"]
    return {"before_mean": b["mean"] / 100, "after_mean": a["mean"] / 100,
            "after_std": a["sd"] / 100, "before_under_60": b["under_60"],
            "after_under_60": a["under_60"], "source": "offline sweep"}  # fmt: skip


def collect(out: Path) -> dict[str, list[dict[str, Any]]]:
    """Per method, the last-round accuracy of every seed (in seed order)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for label, suffix, folder in METHODS:
        runs[label] = []
        for s in seeds_of(out):
            d = out / f"seed{s}{suffix}" / folder
            sweep = sweep_of(out, s)
            if not (d / "metrics.jsonl").is_file():
                if label == "pFedGPA, direct" and sweep is not None:
                    runs[label].append({"seed": s, **from_sweep(sweep["rows"][DIRECT_ROW])})
                    continue
                raise SystemExit(f"{d}: not run yet (benchmarks/pfedgpa_seeds.sh)")
            runs[label].append({"seed": s, **last_accuracy(d)})
    return runs


def sweeps_md(out: Path) -> tuple[str, dict[str, Any]]:
    """The offline sweeps' rows and swap tables, mean ± sd over the seeds that have one."""
    docs = [d for s in seeds_of(out) if (d := sweep_of(out, s)) is not None]
    if not docs:
        return "", {}
    seeds = [d["seed"] for d in docs]
    lines = [f"Offline sweep over seeds {', '.join(map(str, seeds))} "
             "(benchmarks/pfedgpa_inversion.py; mean ± sd over seeds of the devices' mean "
             "accuracy, %; devices < 60 % averaged over seeds):", "",
             "| row | before FT | devices < 60 % | after FT | devices < 60 % after |",
             "|---|---|---|---|---|"]  # fmt: skip
    agg: dict[str, Any] = {"seeds": seeds, "rows": {}, "swap": {}}
    for label in docs[0]["rows"]:
        b = mean_sd([d["rows"][label]["before"]["mean"] for d in docs])
        a = mean_sd([d["rows"][label]["after"]["mean"] for d in docs])
        ub = statistics.fmean(d["rows"][label]["before"]["under_60"] for d in docs)
        ua = statistics.fmean(d["rows"][label]["after"]["under_60"] for d in docs)
        agg["rows"][label] = {"before": b, "after": a, "before_under_60": ub,
                              "after_under_60": ua}  # fmt: skip
        lines.append(f"| {label} | {b[0]:.2f} ± {b[1]:.2f} | {ub:.1f} | {a[0]:.2f} ± {a[1]:.2f} "
                     f"| {ua:.1f} |")  # fmt: skip
    lines += [
        "",
        "Device i with device j's upload, before FT (mean ± sd over seeds, %):",
        "",
        "| pairs | accuracy | pairs < 60 % (per seed) |",
        "|---|---|---|",
    ]
    for key in docs[0]["swap"]["cells"]:
        m = mean_sd([d["swap"]["cells"][key]["mean"] for d in docs])
        u = statistics.fmean(d["swap"]["cells"][key]["under_60"] for d in docs)
        n = docs[0]["swap"]["cells"][key]["pairs"]
        agg["swap"][key] = {"mean": m, "under_60": u, "pairs": n}
        lines.append(f"| {key} ({n} pairs) | {m[0]:.2f} ± {m[1]:.2f} | {u:.1f} |")
    return "\n".join(lines) + "\n", agg


def checks(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The issue's checks C1-C3 on the means over seeds (points, not fractions)."""

    def pts(label: str, key: str) -> float:
        return 100 * statistics.fmean(r[key] for r in runs[label])

    local, fedavg, ft = (
        pts("Local-only", "after_mean"),
        pts("FedAvg", "before_mean"),
        pts("FedAvg", "after_mean"),
    )
    inv_before, dir_before = pts("pFedGPA", "before_mean"), pts("pFedGPA, direct", "before_mean")
    inv_after = pts("pFedGPA", "after_mean")
    under = {k: statistics.fmean(r["before_under_60"] for r in runs[k])
             for k in ("pFedGPA", "pFedGPA, direct")}  # fmt: skip
    rows = [
        {"check": "C1 order FedAvg-FT > Local-only > FedAvg", "value": f"{ft:.2f} > {local:.2f} "
         f"> {fedavg:.2f}", "pass": ft > local > fedavg},
        {"check": f"C1 FedAvg-FT - Local-only within {TOLERANCE} of +{PAPER_FT_OVER_LOCAL}",
         "value": f"{ft - local:+.2f}", "pass": abs(ft - local - PAPER_FT_OVER_LOCAL) <= TOLERANCE},
        {"check": f"C1 Local-only - FedAvg within {TOLERANCE} of +{PAPER_LOCAL_OVER_FEDAVG}",
         "value": f"{local - fedavg:+.2f}",
         "pass": abs(local - fedavg - PAPER_LOCAL_OVER_FEDAVG) <= TOLERANCE},
        {"check": f"C2 pFedGPA after FT within {C2_GAP} of FedAvg-FT",
         "value": f"{inv_after - ft:+.2f}", "pass": abs(inv_after - ft) <= C2_GAP},
        {"check": f"C2 pFedGPA after FT >= Local-only + {C2_OVER_LOCAL}",
         "value": f"{inv_after - local:+.2f}", "pass": inv_after - local >= C2_OVER_LOCAL},
        {"check": "C3 before FT, inversion > direct generation (paper +15)",
         "value": f"{inv_before - dir_before:+.2f}", "pass": inv_before > dir_before},
        {"check": "C3 fewer devices under 60 % with inversion (before FT)",
         "value": f"{under['pFedGPA']:.1f} vs {under['pFedGPA, direct']:.1f}",
         "pass": under["pFedGPA"] < under["pFedGPA, direct"]},
    ]  # fmt: skip
    return rows


def fork_check(out: Path) -> list[dict[str, Any]]:
    """Seeds with a full 200-round compare beside the fork (``seed<s>/pfedgpa``): both."""
    rows = []
    for s in seeds_of(out):
        for label, _, folder in METHODS[2:]:
            full = out / f"seed{s}" / folder
            if (full / "metrics.jsonl").is_file():
                a, b = last_accuracy(full), last_accuracy(out / f"seed{s}-fork" / folder)
                rows.append({
                    "seed": s, "method": label,
                    "full_before": a["before_mean"], "fork_before": b["before_mean"],
                    "full_after": a["after_mean"], "fork_after": b["after_mean"],
                })  # fmt: skip
    return rows


def table_md(
    runs: dict[str, list[dict[str, Any]]], found: list[dict[str, Any]], fork: int | None
) -> str:
    """The markdown table, the checks and the fork check."""
    seeds = [r["seed"] for r in next(iter(runs.values()))]
    lines = [
        f"Seeds {', '.join(map(str, seeds))}; mean ± sd over seeds of the devices' mean accuracy "
        "(%) in the last round" + (f"; pFedGPA forked from FedAvg at round {fork}" if fork else ""),
        "",
        "| method | before FT | after FT | sd over devices (after) | devices < 60 % "
        "(before / after) |",
        "|---|---|---|---|---|",
    ]
    for label, rs in runs.items():
        b, a = mean_sd([100 * r["before_mean"] for r in rs]), mean_sd([100 * r["after_mean"]
                                                                      for r in rs])  # fmt: skip
        sd = statistics.fmean(100 * r["after_std"] for r in rs)
        ub = statistics.fmean(r["before_under_60"] for r in rs)
        ua = statistics.fmean(r["after_under_60"] for r in rs)
        before = "—" if label == "Local-only" else f"{b[0]:.2f} ± {b[1]:.2f}"
        offline = sum(1 for r in rs if r.get("source"))
        name = label + (f" (offline sweep, {offline} of {len(rs)} seeds)" if offline else "")
        lines.append(f"| {name} | {before} | {a[0]:.2f} ± {a[1]:.2f} | {sd:.2f} | "
                     f"{ub:.1f} / {ua:.1f} |")  # fmt: skip
    lines += ["", "| check | measured | holds |", "|---|---|---|"]
    for c in found:
        lines.append(f"| {c['check']} | {c['value']} | {'yes' if c['pass'] else 'no'} |")
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Bars of before/after FT per method, the seeds as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = list(runs)
    for i, label in enumerate(labels):
        for j, (key, color, name) in enumerate(
            (("before_mean", "tab:gray", "before FT"), ("after_mean", "tab:blue", "after FT"))
        ):
            if label == "Local-only" and key == "before_mean":
                continue
            vals = [100 * r[key] for r in runs[label]]
            x = i + (j - 0.5) * 0.35
            ax.bar(x, statistics.fmean(vals), 0.33, color=color, label=name if i == 1 else None)
            ax.plot([x] * len(vals), vals, "k.", ms=4)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylim(50, 100)  # a fixed range: gaps of a point look like a point
    ax.set_ylabel("mean device accuracy (%)")
    ax.set_title("pFedGPA and baselines, Fashion-MNIST, 20 devices (dots: seeds)")
    ax.legend(loc="upper left", frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="OUT of benchmarks/pfedgpa_seeds.sh")
    p.add_argument("--fork", type=int, help="the fork round (for the caption)")
    args = p.parse_args()
    runs = collect(args.out)
    found = checks(runs)
    text = table_md(runs, found, args.fork)
    sweep_text, sweeps = sweeps_md(args.out)
    if sweep_text:
        text += "\n" + sweep_text
    fork_rows = fork_check(args.out)
    if fork_rows:
        text += "\nFork against a full 200-round run of the same seed (accuracy %):\n\n"
        text += "| seed | method | before FT full / fork | after FT full / fork |\n"
        text += "|---|---|---|---|\n"
        for r in fork_rows:
            text += (f"| {r['seed']} | {r['method']} | {100 * r['full_before']:.2f} / "
                     f"{100 * r['fork_before']:.2f} | {100 * r['full_after']:.2f} / "
                     f"{100 * r['fork_after']:.2f} |\n")  # fmt: skip
    (args.out / "table.md").write_text(text)
    doc = {"runs": runs, "checks": found, "fork": args.fork, "fork_check": fork_rows,
           "sweeps": sweeps}  # fmt: skip
    (args.out / "table.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(runs, args.out / "accuracy_seeds.png")
    print(text)
    print(f"wrote {args.out / 'table.md'}, table.json, accuracy_seeds.png")


if __name__ == "__main__":
    main()
