"""benchmarks/results/ keeps what a reader needs: per experiment its README (with the
command that regenerates it), its tables and a few plots; raw runs stay out of git."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: the most files kept under benchmarks/results
MAX_FILES = 150
#: what a raw run leaves behind, never kept
RAW = ("metrics.jsonl", "summary.json", "config.json", "method.json", "compare.log",
       "label_counts.csv", "label_counts_test.csv", ".safetensors", "table.csv")  # fmt: skip


#: a command that regenerates results: a comparison, or a benchmark's script
COMMAND = re.compile(r"estuary compare |python3? benchmarks/|bash benchmarks/")


def kept_files() -> list[Path]:
    """The files of benchmarks/results git tracks (every file where there is no git)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "benchmarks/results"],
            cwd=ROOT, capture_output=True, check=True, timeout=60,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return sorted(p for p in RESULTS.rglob("*") if p.is_file())
    return sorted(ROOT / name for name in out.decode().split("\0") if name)


def test_the_results_folder_stays_small() -> None:
    files = kept_files()
    assert 0 < len(files) <= MAX_FILES, len(files)
    raw = [f for f in files if f.name.endswith(RAW)]
    assert raw == [], raw


def test_every_experiment_says_how_to_regenerate_it() -> None:
    for folder in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        readme = folder / "README.md"
        assert readme.is_file(), f"{folder} has no README.md"
        text = readme.read_text(encoding="utf-8")
        assert COMMAND.search(text), f"{readme} gives no command that regenerates it"
        plots = [f for f in folder.rglob("*.png")]
        assert len(plots) <= 4, f"{folder} keeps {len(plots)} plots"
