"""Local training in a CPU-limited cgroup: torch's default threads against the capped count.

A container's CPU limit (Kubernetes ``resources.limits.cpu``, ``docker run --cpus``) is a
cgroup CFS quota that torch does not see: it starts a thread per visible core, and the
kernel throttles them. Estuary caps the count at the limit (:mod:`shared.runtime.cpu`). This runs
the same local training (fmnist-tiny, batch 32, Fashion-MNIST) in a real cgroup allowed
``--cpus`` CPUs, alternately with torch's default thread count (what a role did before) and
with :func:`shared.runtime.cpu.set_torch_threads` (``train.threads = 0``), and reports the median
of the per-pair time ratios. Needs root and a writable cgroup file system (v1 ``cpu`` or v2).

    sudo python benchmarks/cpu_limit_threads.py --cpus 1 --repeats 5 \
        --out benchmarks/results/cpu_limit_threads.json

The gap grows with the visible cores: on a 2-core host torch's default is 2 threads.
``--host-threads N`` runs the default side with N threads instead, the count torch picks on
an N-core node (an emulation of a bigger host: the cgroup and its limit are real).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(mode: str, steps: int, host_threads: int) -> None:
    """Train ``steps`` local steps and print ``{"seconds", "threads"}`` (in the cgroup)."""
    import torch

    from shared.config import config_from_dict
    from shared.data.datasets import load_dataset, to_model_input
    from shared.diffusion.schedule import make_train_scheduler
    from shared.diffusion.training import train_local
    from shared.models.presets import build_unet
    from shared.runtime.cpu import set_torch_threads

    if host_threads:
        torch.set_num_threads(host_threads)  # torch's default on a host_threads-core node
    if mode == "capped":
        set_torch_threads(0)
    cfg = config_from_dict({"model": {"preset": "fmnist-tiny"},
                            "train": {"local_steps": steps, "batch_size": 32}})  # fmt: skip
    data = to_model_input(load_dataset("fashion-mnist").images[:2048])
    model = build_unet(cfg.model.preset, seed=0)
    sched = make_train_scheduler(cfg.diffusion)
    train_local(model, data, cfg.train, sched, torch.Generator().manual_seed(0), steps=2)  # warm-up
    start = time.perf_counter()
    train_local(model, data, cfg.train, sched, torch.Generator().manual_seed(1), steps=steps)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "threads": torch.get_num_threads()}))


def _cgroup(cpus: float) -> Path:
    """A new cgroup allowed ``cpus`` CPUs (v1 ``cpu`` hierarchy when mounted, else v2)."""
    v1 = Path("/sys/fs/cgroup/cpu")
    name = f"estuary-bench-{os.getpid()}"
    if (v1 / "cpu.cfs_quota_us").exists():
        group = v1 / name
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(int(cpus * 100000)))
    else:
        group = Path("/sys/fs/cgroup") / name
        group.mkdir()
        (group / "cpu.max").write_text(f"{int(cpus * 100000)} 100000")
    return group


def run(group: Path, mode: str, steps: int, host_threads: int) -> dict[str, float]:
    """One worker process inside ``group``."""

    def enter() -> None:
        (group / "cgroup.procs").write_text(str(os.getpid()))

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, __file__, "--worker", mode, "--steps", str(steps),
         "--host-threads", str(host_threads)], env=env,
        preexec_fn=enter, capture_output=True, text=True, timeout=1800, check=True,
    ).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    """Parse arguments; run the pairs; print and optionally write the result."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpus", type=float, default=1.0, help="the cgroup's CPU limit")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--host-threads",
        type=int,
        default=0,
        help="emulate torch's default on a node with this many cores (0: this host)",
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument("--worker", choices=["default", "capped"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.host_threads)
        return
    group = _cgroup(args.cpus)
    rows: list[dict[str, float]] = []
    try:
        for i in range(args.repeats):
            default = run(group, "default", args.steps, args.host_threads)
            capped = run(group, "capped", args.steps, args.host_threads)
            rows.append({"default_s": default["seconds"], "capped_s": capped["seconds"],
                         "default_threads": default["threads"],
                         "capped_threads": capped["threads"]})  # fmt: skip
            print(f"{i + 1}/{args.repeats}: default {default['threads']:.0f} threads "
                  f"{default['seconds']:.2f} s, capped {capped['threads']:.0f} threads "
                  f"{capped['seconds']:.2f} s", flush=True)  # fmt: skip
    finally:
        group.rmdir()
    ratios = [r["default_s"] / r["capped_s"] for r in rows]
    result = {
        "what": "local training steps in a CPU-limited cgroup: torch default threads / capped",
        "cpus_limit": args.cpus, "visible_cpus": len(os.sched_getaffinity(0)),
        "host_threads": args.host_threads or None, "steps": args.steps,
        "repeats": args.repeats,
        "median_default_s": statistics.median(r["default_s"] for r in rows),
        "median_capped_s": statistics.median(r["capped_s"] for r in rows),
        "median_speedup": statistics.median(ratios), "rows": rows,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
