"""How many CPUs this process may really use, and thread counts that respect it.

PyTorch (OpenMP) and ONNX Runtime size their thread pools from the cores they can see,
which honours an affinity mask (``taskset``, a cpuset) but not a CPU *bandwidth* limit: a
Kubernetes ``resources.limits.cpu`` or ``docker run --cpus`` is a CFS quota, and the host's
cores all stay visible. A device pod limited to 4 CPUs on a 64-core node then trains with 32
threads that the kernel throttles in turn, many times slower than 4 would be. So where a
config leaves the thread count to the library (``train.threads = 0``, ``deploy.threads =
0``), every role caps it at :func:`cpu_budget`: the affinity mask's size, and the cgroup CPU
limit (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; the
smallest along the process's cgroup and its ancestors) rounded down, at least 1. An explicit
thread count is used as given.

Several roles sharing one machine without limits (the demo, ``docker compose up`` on one
host) are not visible from inside one process: give them ``threads`` explicitly (the demo
and the compose config set 1).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)

#: where the cgroup file systems are mounted, and this process's cgroup memberships
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
#: the deepest cgroup path looked at (a bound on the walk up the hierarchy)
_MAX_DEPTH = 64


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None


def _ancestors(relative: str) -> list[str]:
    """``/a/b/c`` -> ``["a/b/c", "a/b", "a", ""]`` (at most :data:`_MAX_DEPTH` deep)."""
    parts = [p for p in relative.strip("/").split("/") if p and p not in (".", "..")]
    parts = parts[:_MAX_DEPTH]
    return ["/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _v2_limit(text: str) -> float | None:
    """``cpu.max``: ``"max 100000"`` (no limit) or ``"<quota> <period>"``."""
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_limit(directory: Path) -> float | None:
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None  # -1: no limit


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPU bandwidth this process's cgroups allow, in CPUs (``2.5`` = 250 ms of CPU time
    per 100 ms), or ``None`` when no limit is set or none can be read. The smallest limit
    along the cgroup and its ancestors counts, as the kernel applies them all; inside a
    container with its own cgroup namespace the cgroup path is ``/`` and the container's
    limit is at the root."""
    memberships = _read(proc_cgroup)
    if memberships is None:
        return None
    limits: list[float] = []
    for line in memberships.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":  # cgroup v2 (unified)
            for rel in _ancestors(path):
                text = _read(root / rel / "cpu.max")
                if text is not None and (limit := _v2_limit(text)) is not None:
                    limits.append(limit)
        elif "cpu" in controllers.split(","):  # cgroup v1, the cpu controller's hierarchy
            for mount in (controllers, "cpu,cpuacct", "cpu"):
                base = root / mount
                if base.is_dir():
                    for rel in _ancestors(path):
                        if (limit := _v1_limit(base / rel)) is not None:
                            limits.append(limit)
                    break
    return min(limits) if limits else None


def visible_cpus() -> int:
    """CPUs this process may be scheduled on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def cpu_budget() -> int:
    """How many threads of busy work this process can run at once: the affinity mask, capped
    by the cgroup CPU limit rounded down (at least 1)."""
    cpus = visible_cpus()
    limit = cgroup_cpu_limit()
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit)))
    return cpus


def set_torch_threads(requested: int) -> int:
    """Set PyTorch's intra-op threads: ``requested`` when it is positive, otherwise PyTorch's
    own default capped at :func:`cpu_budget` (said in the log when that lowers it). Returns
    the number in use."""
    import torch

    if requested > 0:
        torch.set_num_threads(requested)
        return requested
    current, budget = torch.get_num_threads(), cpu_budget()
    if budget < current:
        torch.set_num_threads(budget)
        log.info("using %d torch threads, not %d: this process may use %d CPU(s) (affinity "
                 "mask and cgroup CPU limit)", budget, current, budget)  # fmt: skip
        return budget
    return current


def ort_threads(requested: int) -> int:
    """ONNX Runtime's intra-op thread count: ``requested`` when positive; otherwise
    :func:`cpu_budget` where that is below the cores ONNX Runtime would count, else 0 (its
    own default)."""
    if requested > 0:
        return requested
    budget = cpu_budget()
    return budget if budget < (os.cpu_count() or 1) else 0
