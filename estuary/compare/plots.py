"""The plots of a comparison: quality against rounds and bytes, accuracy against rounds, and
accuracy by domain."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from estuary.compare.spec import MethodRun
from estuary.compare.tables import _final_accuracy, _upload_key
from shared.atomic import atomic_write
from shared.metrics import accounting as acc


def _curves(run: MethodRun, d: acc.Distances) -> dict[str, list[float]]:
    done = np.cumsum(run.steps)
    flat = acc.is_flat(run.method.cfg.federation)
    x, mib, cost = [0.0], [0.0], [0.0]  # cumulative curves start at the origin
    fid_x, fid, fid_up = [], [], []
    total = weighted = uploaded = 0.0
    up_key = "" if run.method.centralized else _upload_key(run.method)
    for row in run.rows:
        step = float(done[row["round"] - 1])
        b = acc.split_received(row.get("bytes", {}))
        total += acc.mib(b.total)
        uploaded += acc.mib(row.get("bytes", {}).get(up_key, 0))
        weighted += acc.weighted_cost(b, flat=flat, d=d) if not run.method.centralized else 0.0
        x.append(step)
        mib.append(total)
        cost.append(weighted)
        if row.get("quality"):
            fid_x.append(step)
            fid.append(row["quality"]["fid"])
            fid_up.append(uploaded)
    return {"x": x, "fid_x": fid_x, "fid": fid, "fid_up": fid_up, "mib": mib, "cost": cost}


def write_plots(runs: list[MethodRun], out: Path, d: acc.Distances) -> None:
    """``quality.png`` (FID against local steps, and against the cumulative bytes the
    devices uploaded) and ``bytes.png`` (cumulative traffic and the weighted cost at
    distances ``d``, the comparison's ``d_e``/``d_c``), every method on each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if any(r.get("accuracy") for run in runs for r in run.rows):
        _accuracy_plot(runs, out / "accuracy.png")
    if any(_final_accuracy(run) for run in runs):
        _domain_plot(runs, out / "accuracy_by_domain.png")
    curves = [(run.method.label, _curves(run, d)) for run in runs]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for label, c in curves:
        if c["fid"]:
            axes[0].plot(c["fid_x"], c["fid"], marker="o", ms=3, label=label)
            if c["fid_up"][-1] > 0:  # a federated method: FID against what devices sent
                axes[1].plot(c["fid_up"], c["fid"], marker="o", ms=3, label=label)
    if not any(c["fid"] for _, c in curves):
        for a in axes:
            a.text(0.5, 0.5, "no quality evaluation in this comparison", ha="center", va="center")
    axes[0].set(xlabel="local training steps, all devices (equal-compute axis)", ylabel="FID")
    axes[0].set_title("sample quality (lower is better)")
    axes[1].set(xlabel="cumulative device uploads, MiB (log)", ylabel="FID", xscale="symlog")
    axes[1].set_title("sample quality against what the devices uploaded")
    _finish(fig, axes, out / "quality.png")

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for label, c in curves:
        axes[0].plot(c["x"], c["mib"], label=label)
        axes[1].plot(c["x"], c["cost"], label=label)
    axes[0].set(title="cumulative traffic (every byte received)", ylabel="MiB")
    axes[1].set(title="cumulative weighted cost (C_ne, C_ce)", ylabel="cost (MiB-weighted)")
    for a in axes:
        a.set(xlabel="local training steps, all devices")
    _finish(fig, axes, out / "bytes.png")


def _accuracy_plot(runs: list[MethodRun], path: Path) -> None:
    """``accuracy.png``: each method's mean device accuracy by round, before and after the
    local round (fine-tuning), and the devices under 60 % before it."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for run in runs:
        rows = [r for r in run.rows if r.get("accuracy")]
        x = [r["round"] for r in rows]
        line = axes[0].plot(x, [100 * r["accuracy"]["after_mean"] for r in rows],
                            label=f"{run.method.label}, after FT")[0]  # fmt: skip
        before = [(r["round"], r["accuracy"]) for r in rows if "before_mean" in r["accuracy"]]
        if before:
            axes[0].plot(
                [b[0] for b in before],
                [100 * b[1]["before_mean"] for b in before],
                ls="--",
                color=line.get_color(),
                label=f"{run.method.label}, before FT",
            )
            axes[1].plot([b[0] for b in before], [b[1]["before_under_60"] for b in before],
                         color=line.get_color(), label=run.method.label)  # fmt: skip
    axes[0].set(xlabel="round", ylabel="accuracy (%)", title="mean device test accuracy")
    axes[1].set(xlabel="round", ylabel="devices", title="devices under 60 % before FT")
    _finish(fig, axes, path)


def _domain_plot(runs: list[MethodRun], path: Path) -> None:
    """``accuracy_by_domain.png``: grouped bars, each domain (and the mean) a group with
    one bar per method that reports per-domain accuracy."""
    import matplotlib.pyplot as plt

    scored = [(run.method.label, f) for run in runs if (f := _final_accuracy(run))]
    domains = list(dict.fromkeys(d for _, f in scored for d in f["domains"]))
    groups = [*domains, "mean"]
    x = np.arange(len(groups))
    width = 0.8 / len(scored)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(groups) * max(1, len(scored)) / 2), 4.5))
    for i, (label, f) in enumerate(scored):
        values = [f.get(f"acc_{d}", np.nan) for d in domains] + [f["acc_mean"]]
        ax.bar(x - 0.4 + (i + 0.5) * width, values, width, label=label)
    ax.set_xticks(x, groups)
    ax.set(ylabel="accuracy (%)", ylim=(0, 100), title="final classifier accuracy by domain")
    _finish(fig, ax, path)


def _finish(fig: Any, axes: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    for a in np.atleast_1d(axes):
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write(path, buf.getvalue())
