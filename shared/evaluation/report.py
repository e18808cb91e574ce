"""Run reports: sample grids and the ``report.png`` summary figure (matplotlib, Agg)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.atomic import atomic_write
from shared.data.datasets import save_grid  # noqa: F401  (re-exported: grids are written here too)
from shared.errors import EstuaryError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` file. A last line cut short (a writer killed mid-row, or
    a row being appended while this reads) is left out; a bad line before it is an error."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i == len(lines) - 1:
                log.warning("%s: last line is incomplete (%s); ignored", path, err)
                break
            raise EstuaryError(f"{path} line {i + 1} is not JSON: {err}") from None
    return rows


def last_quality(
    rows: list[dict[str, Any]], up_to_round: int | None = None
) -> dict[str, Any] | None:
    """The latest quality evaluation among ``rows`` (at or before ``up_to_round``), with
    its round, or None."""
    for row in reversed(rows):
        if row.get("quality") and (up_to_round is None or row.get("round", 0) <= up_to_round):
            return {"round": row["round"], **row["quality"]}
    return None


def headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The results a reader looks for first in ``summary.json``: the mean training loss of
    the first and the last round, the last quality evaluation, the starting model's
    (``start_quality``, round 0, when the cloud scored it) and the last accuracy
    measurement (each with its round; absent when the run had none)."""
    out: dict[str, Any] = {}
    losses = [(r["round"], r["train_loss"]) for r in rows if r.get("train_loss") is not None]
    if losses:
        out["train_loss"] = {"first": losses[0][1], "last": losses[-1][1],
                             "first_round": losses[0][0], "last_round": losses[-1][0]}  # fmt: skip
    quality = last_quality(rows)
    if quality is not None:
        out["quality"] = {k: v for k, v in quality.items() if not isinstance(v, (list, dict))}
    start = next((r["start"] for r in rows if r.get("start")), None)
    if start and start.get("quality"):  # the starting model, scored before round 1
        scalars = {k: v for k, v in start["quality"].items() if not isinstance(v, (list, dict))}
        out["start_quality"] = {"round": 0, **scalars}
    for row in reversed(rows):
        if row.get("accuracy"):
            figures = {k: v for k, v in row["accuracy"].items() if not isinstance(v, (list, dict))}
            out["accuracy"] = {"round": row["round"], **figures}
            break
    return out


def traffic_labels(rows: list[dict[str, Any]]) -> tuple[str, str, str]:
    """Title and up/down labels of the traffic panel for the rows' ``traffic_scope``."""
    if rows and all(r.get("traffic_scope") == "cloud" for r in rows):
        return (
            "traffic per round at the cloud (every role: its /metrics)",
            "up: received by the cloud (edges→cloud)",
            "down: sent by the cloud (cloud→edges, once per blob fetched)",
        )
    return "traffic per round", "up (devices→edges→cloud)", "down (cloud→edges→devices)"


def before_after(rows: list[dict[str, Any]], run_dir: Path | None) -> tuple[Path, Path] | None:
    """The starting model's sample grid and the last round's, when both are in ``run_dir``."""
    if run_dir is None:
        return None
    start = next((r["start"] for r in rows if r.get("start")), None)
    grids = [r["grid"] for r in rows if r.get("grid")]
    if not start or not start.get("grid") or not grids:
        return None
    before, after = run_dir / start["grid"], run_dir / grids[-1]
    return (before, after) if before.is_file() and after.is_file() else None


def report_figure(
    rows: list[dict[str, Any]], title: str = "", run_dir: Path | None = None
) -> Figure:
    """Three panels: training loss, bytes per round (up/down), quality per evaluation (the
    starting model's at round 0 when the cloud scored it, and the share of samples in the
    classes the start never saw when the run has them); then, when ``run_dir`` holds the
    starting model's grid and a last one, the two side by side ("before" and "after")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grids = before_after(rows, run_dir)
    if grids is None:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    else:
        fig, all_axes = plt.subplots(
            1, 5, figsize=(25, 4.8), gridspec_kw={"width_ratios": [1, 1, 1, 0.8, 0.8]}
        )
        axes = all_axes[:3]
        rounds_of = [r["round"] for r in rows if r.get("grid")]
        for a, path, label in zip(
            all_axes[3:], grids, ("before: the start (round 0)", f"after: round {rounds_of[-1]}"),
            strict=True,
        ):  # fmt: skip
            a.imshow(plt.imread(path), cmap="gray", vmin=0.0, vmax=1.0)  # PNG: 0..1
            a.set_title(label)
            a.axis("off")
    rounds = [r["round"] for r in rows]
    loss = [r.get("train_loss") for r in rows]
    ax = axes[0]
    ax.plot(
        [x for x, y in zip(rounds, loss, strict=True) if y is not None],
        [y for y in loss if y is not None],
        marker="o",
        ms=3,
    )
    ax.set(title="mean device training loss", xlabel="round",
            ylabel="DDPM loss (MSE); one-shot: eq. 1")  # fmt: skip
    ax.set_ylim(bottom=0)  # from zero: a flat loss must not look like a spike
    ax.grid(alpha=0.3)

    ax = axes[1]
    up = np.array([r.get("bytes_up", 0) for r in rows]) / 2**20
    down = np.array([r.get("bytes_down", 0) for r in rows]) / 2**20
    panel_title, up_label, down_label = traffic_labels(rows)
    ax.bar(rounds, up, label=up_label)
    ax.bar(rounds, down, bottom=up, label=down_label)
    ax.set(title=panel_title, xlabel="round", ylabel="MiB")
    top = float((up + down).max()) if len(rows) else 0.0
    ax.set_ylim(0, top * 1.4 if top > 0 else 1.0)  # headroom: the legend sits above the bars
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3, axis="y")

    ax = axes[2]
    q = [(r["round"], r["quality"]) for r in rows if r.get("quality")]
    start = next((r["start"] for r in rows if r.get("start")), None)
    if q and start and start.get("quality"):
        q.insert(0, (0, start["quality"]))
    if q:
        ax.plot([x for x, _ in q], [m["fid"] for _, m in q], marker="o", color="C3", label="FID")
        ax.set(ylabel=f"FID ({q[0][1].get('extractor', '?')} features)")
        ax.set_ylim(0, max(m["fid"] for _, m in q) * 1.15)  # from zero: 35.5 -> 34.8 is small
        ax2 = ax.twinx()
        ax2.plot(
            [x for x, _ in q],
            [m["precision"] for _, m in q],
            "--",
            marker="s",
            color="C2",
            label="precision",
        )
        ax2.plot([x for x, _ in q], [m["recall"] for _, m in q], ":", marker="^", color="C4",
                 label="recall")  # fmt: skip
        new = [(x, m["new_class_share"]) for x, m in q if m.get("new_class_share") is not None]
        if new:
            ax2.plot([x for x, _ in new], [y for _, y in new], "-", marker="D", color="C1",
                     lw=2, label="share in classes new to the start")  # fmt: skip
        ax2.set(ylim=(0, 1), ylabel="precision / recall / share")
        handles = ax.get_lines() + ax2.get_lines()  # one legend for both axes' lines
        ax2.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper right")
    else:
        ax.text(0.5, 0.5, "no quality evaluation in this run", ha="center", va="center")
    ax.set(title="sample quality", xlabel="round")
    ax.grid(alpha=0.3)
    from matplotlib.ticker import MaxNLocator

    for a in axes:
        # integer rounds, also when a panel has a single point (one evaluation)
        a.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_report(rows: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Write :func:`report_figure` of ``rows`` to ``path`` as a PNG (atomically); the rows'
    sample grids are read relative to ``path``'s folder (the run directory)."""
    import matplotlib.pyplot as plt

    fig = report_figure(rows, title, run_dir=path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    atomic_write(path, tmp.read_bytes())
    tmp.unlink()
    return path
