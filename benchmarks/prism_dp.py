"""PRISM's privacy trade-off as a user reads it: the table and the grids of
``configs/compare/compare_prism_dp_cpu.toml`` (the same PRISM run under privacy budgets).

    ESTUARY__RUN__SEED=0 estuary compare configs/compare/compare_prism_dp_cpu.toml \
        --out runs/prism-dp/seed0 --jobs 2
    python benchmarks/prism_dp.py runs/prism-dp/seed0

Reads every method folder of the comparison (``metrics.jsonl``, ``config.json`` and the
sample grids under ``samples/``; also of a method still running: its figures are those of
the rounds it has evaluated, and the table says how many) and writes into the comparison's
folder:

- ``dp_table.md`` / ``dp_table.json``: per method, the privacy budget (epsilon, delta), the
  noise multiplier z the accountant set, the noise's standard deviation sigma on each
  released probability, the epsilon spent by the last round, FID at every evaluated round,
  the final and the best FID, and the bytes one device uploaded;
- ``dp_grids.png``: each method's sample grid of its last sampled round, side by side.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from prism_seeds import read_rows, run_figures  # the MADA comparison's reader, beside this


def budget_of(run_dir: Path) -> tuple[float, float] | None:
    """``(epsilon, delta)`` the run was calibrated to, or None for a run without privacy."""
    prism = json.loads((run_dir / "config.json").read_text())["algorithm"]["prism"]
    if prism["dp_calibrate"]:
        return float(prism["dp_epsilon"]), float(prism["dp_delta"])
    if prism["dp_noise"] > 0:
        return math.inf, float(prism["dp_delta"])  # a fixed noise: no budget was set
    return None


def last_grid(run_dir: Path) -> Path | None:
    """The sample grid of the run's last sampled round."""
    grids = sorted((run_dir / "samples").glob("round_*.png"))
    return grids[-1] if grids else None


def method_figures(run_dir: Path) -> dict[str, Any]:
    """One method's row of the table."""
    rows = read_rows(run_dir)
    devices = max((r.get("participants", 0) for r in rows), default=0)
    figures = run_figures(rows, max(devices, 1))
    fid, up = figures["fid"], figures["up"]
    algo = rows[-1].get("algorithm", {}) if rows else {}
    grid = last_grid(run_dir)
    return {
        "folder": run_dir.name,
        "budget": budget_of(run_dir),
        "rounds": rows[-1]["round"] if rows else 0,
        "noise_multiplier": algo.get("dp_noise"),
        "sigma": algo.get("dp_sigma"),
        "epsilon_spent": algo.get("dp_epsilon"),
        "fid": fid,
        "final_fid": fid[max(fid)] if fid else None,
        "best_fid": min(fid.values()) if fid else None,
        "upload_bytes_per_device": up[max(up)] if up else None,
        "grid": None if grid is None else str(grid.relative_to(run_dir)),
    }


def label(m: dict[str, Any]) -> str:
    """``no privacy``, ``epsilon 10 (delta 1e-05)`` or the folder's name."""
    if m["budget"] is None:
        return "no privacy"
    eps, delta = m["budget"]
    return f"epsilon {eps:g} (delta {delta:g})" if math.isfinite(eps) else m["folder"]


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def table_md(methods: list[dict[str, Any]]) -> str:
    """The markdown table, tightest budget last."""
    rounds = sorted({r for m in methods for r in m["fid"]})
    head = ["budget", "noise multiplier z", "sigma", "epsilon spent", "rounds"]
    head += [f"FID r{r}" for r in rounds] + ["best FID", "upload per device (MiB)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        cells = [label(m), _fmt(m["noise_multiplier"], ".4g"), _fmt(m["sigma"], ".4g"),
                 _fmt(m["epsilon_spent"], ".4g"), str(m["rounds"])]  # fmt: skip
        cells += [_fmt(m["fid"].get(r), ".1f") for r in rounds]
        up = m["upload_bytes_per_device"]
        cells += [_fmt(m["best_fid"], ".1f"), _fmt(None if up is None else up / 2**20, ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_grids(run: Path, methods: list[dict[str, Any]], out: Path) -> None:
    """Each method's last grid, side by side, titled with its budget and FID."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.image import imread

    shown = [m for m in methods if m["grid"]]
    if not shown:
        return
    fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 4.4), squeeze=False)
    for ax, m in zip(axes[0], shown, strict=True):
        ax.imshow(imread(run / m["folder"] / m["grid"]), cmap="gray")
        fid = _fmt(m["final_fid"], ".1f")
        ax.set_title(f"{label(m)}\nround {m['rounds']}, FID {fid}", fontsize=9)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def order_key(m: dict[str, Any]) -> float:
    """No privacy first, then budgets from the loosest to the tightest."""
    return -math.inf if m["budget"] is None else -m["budget"][0]


def main(argv: list[str] | None = None) -> None:
    """Write the table and the grids of the comparison folder given."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="the comparison's folder (--out of estuary compare)")
    args = ap.parse_args(argv)
    dirs = sorted(p for p in args.run.iterdir() if (p / "metrics.jsonl").is_file())
    if not dirs:
        raise SystemExit(f"no method folder with a metrics.jsonl in {args.run}")
    methods = sorted((method_figures(d) for d in dirs), key=order_key)
    (args.run / "dp_table.md").write_text(table_md(methods))
    (args.run / "dp_table.json").write_text(json.dumps(methods, indent=2))
    plot_grids(args.run, methods, args.run / "dp_grids.png")
    print(table_md(methods), end="")
    print(f"wrote {args.run}/dp_table.md, dp_table.json, dp_grids.png")


if __name__ == "__main__":
    main()
