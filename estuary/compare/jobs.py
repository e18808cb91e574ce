"""``jobs`` > 1: methods run at once, each in its own ``estuary compare --only LABEL``
process with an equal share of the CPUs, its output in ``<slug>/compare.log``; the parent
reads back their records."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from estuary.compare.record import load_record
from estuary.compare.spec import CompareSpec, Method, MethodRun
from estuary.launcher import stop_processes
from shared.errors import ConfigError, EstuaryError
from shared.lifetime import die_with_parent_preexec
from shared.runtime.cpu import cpu_budget
from shared.runtime.process import interrupts_as_keyboard

#: how often the parent of ``jobs`` looks at its children, and how long a child it stops
#: (Ctrl-C, ``kill``, or an error in the parent) gets to exit before it is killed
JOB_POLL_S = 0.5
JOB_STOP_S = 10.0


def _job_threads(jobs: int) -> str:
    """The CPU threads each of ``jobs`` processes gets (an equal share of
    :func:`~shared.runtime.cpu.cpu_budget`, at least one)."""
    return str(max(1, cpu_budget() // jobs))


def run_jobs(
    spec: CompareSpec,
    out: Path,
    todo: list[tuple[int, Method, str]],
    jobs: int,
    *,
    evaluate: bool,
    progress: bool,
    fresh: bool = False,
) -> dict[str, MethodRun]:
    """Run ``todo`` in up to ``jobs`` child processes (``estuary compare --only LABEL``) and
    read back their records; every child is stopped if this one is interrupted (Ctrl-C, or
    SIGTERM, which unwinds the same way). A child resumes its method after the latest
    checkpoint in its run directory unless ``fresh``."""
    if spec.source is None:
        raise ConfigError(
            f"comparison {spec.name!r} was not read from a file (load_compare), and each job "
            "re-reads it from there: run it with jobs = 1"
        )
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, _job_threads(jobs))  # torch's default intra-op threads
    queue = list(todo)
    running: dict[subprocess.Popen[bytes], tuple[int, Method, str, Path, float]] = {}
    finished: dict[str, MethodRun] = {}
    failed: list[str] = []
    n = len(spec.methods)
    main = threading.current_thread() is threading.main_thread()  # signals are set there only
    with interrupts_as_keyboard() if main else contextlib.nullcontext():
        try:
            while queue or running:
                while queue and len(running) < jobs:
                    i, m, init = queue.pop(0)
                    log_path = out / m.slug / "compare.log"
                    log_path.parent.mkdir(parents=True, exist_ok=True)
                    cmd = [sys.executable, "-m", "estuary", "compare", str(spec.source),
                           "--out", str(out), "--only", m.label, "--no-table",
                           *(("--fresh",) if fresh else ()),
                           *(() if evaluate else ("--no-eval",))]  # fmt: skip
                    with log_path.open("wb") as log_file:
                        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=env,
                                                preexec_fn=die_with_parent_preexec())  # fmt: skip
                    running[proc] = (i, m, init, log_path, time.perf_counter())
                    if progress:
                        kind = "centralized" if m.centralized else m.cfg.algorithm.name
                        print(f"[{i}/{n}] {m.label} ({kind}, {m.cfg.run.rounds} rounds): "
                              f"started, output in {log_path}")  # fmt: skip
                time.sleep(JOB_POLL_S)
                for proc in [p for p in running if p.poll() is not None]:
                    i, m, init, log_path, t0 = running.pop(proc)
                    run, why = None, f"exit status {proc.returncode}"
                    if proc.returncode == 0:
                        run, why = load_record(m, out / m.slug, evaluate=evaluate, init=init)
                    if run is None:
                        failed.append(f"{m.label} ({why}; see {log_path})")
                        if progress:
                            took = time.perf_counter() - t0
                            print(f"[{i}/{n}] {m.label} FAILED after {took:.1f} s: {why}")
                        continue
                    finished[m.label] = run
                    if progress:
                        print(f"[{i}/{n}] {m.label} done in {run.wall_s:.1f} s")
        finally:
            stop_processes({m.label: p for p, (_, m, *_) in running.items()}, JOB_STOP_S)
    if failed:
        raise EstuaryError(
            f"{len(failed)} method(s) failed: {'; '.join(failed)}. The methods that finished "
            f"kept their records in {out}: the same command runs only the rest"
        )
    return finished
