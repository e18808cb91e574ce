"""The default demo's story as a table: FID and the share of samples in the classes only the
devices held, at the start and at every evaluation, and each class's share first and last,
from a finished ``estuary demo`` run directory (its ``metrics.jsonl`` and ``summary.json``).

    bash scripts/setup.sh demo && estuary demo --out runs/demo
    python benchmarks/demo_story.py runs/demo --out benchmarks/results/demo_story

writes ``table.md``, ``table.json`` and a copy of the run's ``report.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.data.images import FASHION_MNIST_CLASSES  # noqa: E402
from shared.evaluation.story import class_names, evaluations, story_figures  # noqa: E402


def story(run_dir: Path) -> dict[str, Any]:
    """The figures of one finished demo run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = dict(evaluations(rows))
    if 0 not in evals:
        raise SystemExit(f"{run_dir}: the start was not scored (not a demo with a shipped start)")
    first, last = evals[0], evals[max(evals)]
    return {
        "rounds": len(rows),
        "train_loss_first_last": list(story_figures(rows)["loss"]),
        "fid_by_eval": {str(k): v["fid"] for k, v in evals.items()},
        "new_classes": first["new_classes"],
        "new_class_share_by_eval": {str(k): v["new_class_share"] for k, v in evals.items()},
        "class_shares_start": first["class_shares"],
        "class_shares_last": last["class_shares"],
        "final_model_sha256": summary["final_model_sha256"],
        "demo_seconds": summary.get("demo", {}).get("wall_s"),
        "deployment": summary.get("demo", {}).get("deployment"),
    }


def table(figures: dict[str, Any]) -> str:
    """``figures`` as Markdown."""
    evals = list(figures["fid_by_eval"])
    head = ["start (round 0)" if k == "0" else f"round {k}" for k in evals]
    lines = [
        "| | " + " | ".join(head) + " |",
        "|---" * (len(evals) + 1) + "|",
        "| FID (250 samples) | "
        + " | ".join(f"{figures['fid_by_eval'][k]:.1f}" for k in evals)
        + " |",
        f"| share in {class_names(figures['new_classes'])} | "
        + " | ".join(f"{100 * figures['new_class_share_by_eval'][k]:.1f}%" for k in evals)
        + " |",
        "",
        "| class | share at the start | share after the last round |",
        "|---|---|---|",
    ]
    for name, a, b in zip(FASHION_MNIST_CLASSES, figures["class_shares_start"],
                          figures["class_shares_last"], strict=True):  # fmt: skip
        lines.append(f"| {name} | {100 * a:.1f}% | {100 * b:.1f}% |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="a finished `estuary demo` run directory")
    ap.add_argument("--out", type=Path, required=True, help="folder for table.md/.json, report")
    args = ap.parse_args(argv)
    figures = story(args.run_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.json").write_text(json.dumps(figures, indent=1) + "\n")
    (args.out / "table.md").write_text(table(figures))
    if (args.run_dir / "report.png").is_file():
        shutil.copyfile(args.run_dir / "report.png", args.out / "report.png")
    print(table(figures), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
