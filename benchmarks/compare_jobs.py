"""Wall time of ``estuary compare --jobs N`` against the same comparison run one method after
another (``--jobs 1``, the default), on this host.

Both are the real command line, run fresh into their own temporary directories, on the same
config; runs alternate (sequential, parallel, sequential, ...) so drift on a shared machine
hits both, and the reported figure is the median of the per-pair ratios. The FIDs of the
two runs are printed side by side: the methods are the same training, only the threads each
gets differ.

    python benchmarks/compare_jobs.py configs/compare/compare_cpu_tiny.toml --jobs 2 \
        --out benchmarks/results/compare_jobs_cpu_tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: the longest one comparison may take before the benchmark gives up on it
RUN_TIMEOUT_S = 4 * 3600


def run_once(config: Path, out: Path, jobs: int) -> tuple[float, dict[str, Any]]:
    """Wall seconds of one fresh ``estuary compare`` and its ``table.json``."""
    cmd = [sys.executable, "-m", "estuary", "compare", str(config), "--out", str(out),
           "--fresh", "--quiet", "--jobs", str(jobs)]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return wall, json.loads((out / "table.json").read_text())


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print and optionally save the figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", type=Path, help="comparison TOML")
    p.add_argument("--jobs", type=int, default=2, help="methods at once in the parallel run")
    p.add_argument("--repeats", type=int, default=1, help="pairs of runs (median reported)")
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = p.parse_args(argv)
    pairs = []
    with tempfile.TemporaryDirectory(prefix="compare-jobs-") as tmp:
        for k in range(args.repeats):
            seq_s, seq = run_once(args.config, Path(tmp) / f"seq{k}", 1)
            par_s, par = run_once(args.config, Path(tmp) / f"par{k}", args.jobs)
            pairs.append((seq_s, par_s, seq, par))
            print(f"pair {k + 1}: --jobs 1 {seq_s:.1f} s, --jobs {args.jobs} {par_s:.1f} s "
                  f"({seq_s / par_s:.2f}x)")  # fmt: skip
    fids = [
        {"method": a["method"], "fid_jobs_1": a["fid"], f"fid_jobs_{args.jobs}": b["fid"]}
        for a, b in zip(pairs[-1][2]["rows"], pairs[-1][3]["rows"], strict=True)
    ]
    for row in fids:
        print("  " + ", ".join(f"{k} {v}" for k, v in row.items()))
    result = {
        "config": str(args.config),
        "jobs": args.jobs,
        "cpus": os.cpu_count(),
        "host": platform.processor() or platform.machine(),
        "wall_s_jobs_1": [a for a, _, _, _ in pairs],
        f"wall_s_jobs_{args.jobs}": [b for _, b, _, _ in pairs],
        "median_speedup": statistics.median(a / b for a, b, _, _ in pairs),
        "fids_last_pair": fids,
    }
    print(f"median speed-up of --jobs {args.jobs}: {result['median_speedup']:.2f}x "
          f"on {result['cpus']} CPUs")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
