"""The table over seeds of ``configs/compare/compare_prism_mada_cpu.toml``: FedAvg (fair),
PRISM, PRISM without MADA and PRISM with a fixed lambda, each run once per seed into
``OUT/seed<s>`` (``ESTUARY__RUN__SEED=<s> estuary compare ... --out OUT/seed<s>``).

    python benchmarks/prism_seeds.py runs/prism-mada

Reads every method's ``metrics.jsonl`` (also of a comparison still running: a method's
figures are those of the rounds it has evaluated; the table says how many), and writes into
``OUT``:

- ``table.md`` / ``table.json``: per method, the final and the best FID (mean and sample
  standard deviation over seeds, and each seed's), FID at every evaluated round (mean over
  seeds), the bytes one device uploaded over the run, MADA's lambda, the distance it
  measures, the local divergence (the paper's Fig. 6) and the mask density early and late;
- ``fid_rounds.png``: FID against rounds (mean over seeds, the band one standard deviation);
- ``fid_bytes.png``: FID against the cumulative bytes one device uploaded (PRISM and FedAvg);
- ``mada.png``: lambda, the measured distance, the local divergence and the density per
  round (mean over seeds) of the PRISM methods.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

#: (label, method folder) in table order
METHODS = (
    ("FedAvg", "fedavg"),
    ("PRISM", "prism"),
    ("PRISM (no MADA)", "prism-no-mada"),
    ("PRISM (fixed lambda 0.35)", "prism-fixed-lambda-0-35"),
)
#: the per-round figures of the PRISM methods (``metrics.jsonl`` rows' ``algorithm``)
FIGURES = ("mada_lambda", "mask_distance", "local_divergence", "density")
#: rounds averaged for the "early" and "late" figures
WINDOW = 10
UPLOAD = "received:device_update"


def seeds_of(out: Path) -> list[int]:
    """The seeds with a folder ``seed<s>`` in ``out``."""
    return sorted(int(p.name[4:]) for p in out.glob("seed*") if p.name[4:].isdigit())


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The round rows of ``run_dir/metrics.jsonl``."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in (json.loads(line) for line in lines if line) if "round" in r]


def run_figures(rows: list[dict[str, Any]], devices: int) -> dict[str, Any]:
    """One run's figures: FID per evaluated round, the cumulative upload of one device at
    each round, and the per-round algorithm figures."""
    fid = {int(r["round"]): float(r["quality"]["fid"]) for r in rows if r.get("quality")}
    up, total = {}, 0.0
    for r in rows:
        total += r.get("bytes", {}).get(UPLOAD, 0) / devices
        up[int(r["round"])] = total
    figures = {k: [float(r["algorithm"][k]) for r in rows if k in r.get("algorithm", {})]
               for k in FIGURES}  # fmt: skip
    return {"rounds": len(rows), "fid": fid, "up": up, "figures": figures}


def collect(out: Path, devices: int) -> dict[str, dict[int, dict[str, Any]]]:
    """Per method, per seed: :func:`run_figures` (methods not run yet are left out)."""
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for label, folder in METHODS:
        for s in seeds_of(out):
            d = out / f"seed{s}" / folder
            if (d / "metrics.jsonl").is_file():
                rows = read_rows(d)
                if rows:
                    runs.setdefault(label, {})[s] = run_figures(rows, devices)
    return runs


def _window(values: list[float], late: bool) -> float | None:
    part = values[-WINDOW:] if late else values[:WINDOW]
    return statistics.fmean(part) if part else None


def summarize(runs: dict[str, dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per method: final and best FID over seeds, FID per round, bytes, figures."""
    table = []
    for label, by_seed in runs.items():
        finals = {s: r["fid"][max(r["fid"])] for s, r in by_seed.items() if r["fid"]}
        bests = {s: min(r["fid"].values()) for s, r in by_seed.items() if r["fid"]}
        if not finals:
            continue
        rounds = sorted(set.intersection(*(set(r["fid"]) for r in by_seed.values())))
        row: dict[str, Any] = {
            "method": label,
            "seeds": sorted(finals),
            "rounds_run": {s: r["rounds"] for s, r in by_seed.items()},
            "final_round": {s: max(r["fid"]) for s, r in by_seed.items() if r["fid"]},
            "fid_final": mean_sd(list(finals.values())),
            "fid_best": mean_sd(list(bests.values())),
            "fid_final_by_seed": finals,
            "fid_best_by_seed": bests,
            "fid_by_round": {k: mean_sd([r["fid"][k] for r in by_seed.values()]) for k in rounds},
            "up_per_device": statistics.fmean(
                r["up"][max(r["up"])] for r in by_seed.values() if r["up"]
            ),
        }
        for k in FIGURES:
            series = [r["figures"][k] for r in by_seed.values() if r["figures"][k]]
            if series:
                row[k] = {
                    "early": statistics.fmean(_window(v, False) or 0.0 for v in series),
                    "late": statistics.fmean(_window(v, True) or 0.0 for v in series),
                }
        table.append(row)
    return table


def _fmt(pair: tuple[float, float]) -> str:
    return f"{pair[0]:.1f} ± {pair[1]:.1f}"


def write_table(table: list[dict[str, Any]], out: Path) -> None:
    """``table.md`` and ``table.json``."""
    lines = [
        "| method | seeds | final FID | best FID | final FID per seed | upload per device "
        "(MiB) | lambda early / late | distance early / late | local divergence early / "
        "late | density early / late |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        per_seed = ", ".join(f"{s}: {v:.1f}" for s, v in sorted(r["fid_final_by_seed"].items()))

        def pair(key: str, r: dict[str, Any] = r) -> str:
            v = r.get(key)
            return f"{v['early']:.3f} / {v['late']:.3f}" if v else "-"

        lines.append(
            f"| {r['method']} | {len(r['seeds'])} | {_fmt(r['fid_final'])} | "
            f"{_fmt(r['fid_best'])} | {per_seed} | {r['up_per_device'] / 2**20:.2f} | "
            f"{pair('mada_lambda')} | {pair('mask_distance')} | {pair('local_divergence')} | "
            f"{pair('density')} |"
        )
    rounds = sorted({k for r in table for k in r["fid_by_round"]})
    lines += ["", "FID by round (mean ± sd over seeds):", "",
              "| method | " + " | ".join(str(k) for k in rounds) + " |",
              "|---|" + "---|" * len(rounds)]  # fmt: skip
    for r in table:
        cells = [_fmt(r["fid_by_round"][k]) if k in r["fid_by_round"] else "-" for k in rounds]
        lines.append(f"| {r['method']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Final FID: at the last round each seed evaluated (1,000 samples, fmnist-cnn-v1 "
        f"features); best FID: the lowest over the evaluated rounds. Early / late: the mean of "
        f"the first / last {WINDOW} rounds. Upload per device: every device_update blob the "
        "edges received over the run, over the devices.",
    ]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "table.json").write_text(json.dumps(table, indent=2) + "\n")


def write_plots(runs: dict[str, dict[int, dict[str, Any]]], out: Path) -> None:
    """``fid_rounds.png``, ``fid_bytes.png`` and ``mada.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, by_seed in runs.items():
        rounds = sorted(set.intersection(*(set(r["fid"]) for r in by_seed.values())))
        if not rounds:
            continue
        stats = [mean_sd([r["fid"][k] for r in by_seed.values()]) for k in rounds]
        mean = [m for m, _ in stats]
        seeds = f"{len(by_seed)} seed{'' if len(by_seed) == 1 else 's'}"
        ax.plot(rounds, mean, marker="o", label=f"{label} ({seeds})")
        ax.fill_between(rounds, [m - s for m, s in stats], [m + s for m, s in stats], alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("FID (1,000 samples)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fid_rounds.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in ("FedAvg", "PRISM"):
        for s, r in sorted(runs.get(label, {}).items()):
            xs = [r["up"][k] / 2**20 for k in sorted(r["fid"])]
            ax.plot(xs, [r["fid"][k] for k in sorted(r["fid"])], marker="o",
                    color="C0" if label == "FedAvg" else "C1", alpha=0.8,
                    label=label if s == min(runs[label]) else None)  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("cumulative upload of one device (MiB)")
    ax.set_ylabel("FID (1,000 samples)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fid_bytes.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    # one colour per method in every panel (a method without lambda is absent from one)
    colour = {label: f"C{i}" for i, label in enumerate(runs)}
    for ax, key in zip(axes.flat, FIGURES, strict=True):
        for label, by_seed in runs.items():
            series = [r["figures"][key] for r in by_seed.values() if r["figures"][key]]
            if not series:
                continue
            n = min(len(v) for v in series)
            mean = [statistics.fmean(v[i] for v in series) for i in range(n)]
            ax.plot(range(1, n + 1), mean, label=label, color=colour[label])
        ax.set_title(key)
        ax.grid(alpha=0.3)
    axes[1, 0].set_xlabel("round")
    axes[1, 1].set_xlabel("round")
    axes[0, 1].legend(fontsize=8)  # the distance: every PRISM method records it
    fig.tight_layout()
    fig.savefig(out / "mada.png", dpi=120)
    plt.close(fig)


def main() -> None:
    """Read the seeds' runs, write the table and the plots."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder holding seed<s>/<method>/")
    parser.add_argument("--devices", type=int, default=10, help="devices of the federation")
    args = parser.parse_args()
    runs = collect(args.out, args.devices)
    if not runs:
        raise SystemExit(f"{args.out}: no seed<s>/<method>/metrics.jsonl yet")
    table = summarize(runs)
    write_table(table, args.out)
    write_plots(runs, args.out)
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
