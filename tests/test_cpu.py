"""CPU budget: cgroup CPU limits (v1 and v2) read from files, and in a real cgroup."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.runtime.cpu import cgroup_cpu_limit, cpu_budget, ort_threads, visible_cpus


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _limit(tmp_path: Path, memberships: str, files: dict[str, str]) -> float | None:
    root = tmp_path / "cgroup"
    _tree(root, files)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(memberships)
    return cgroup_cpu_limit(root, proc)


def test_cgroup_v2_takes_the_smallest_limit_up_the_hierarchy(tmp_path: Path) -> None:
    pod = "kubepods/pod1"
    assert _limit(tmp_path, f"0::/{pod}/ctr\n", {
        "cpu.max": "max 100000",
        "kubepods/cpu.max": "max 100000",
        f"{pod}/cpu.max": "400000 100000",  # the pod: 4 CPUs
        f"{pod}/ctr/cpu.max": "250000 100000",  # the container: 2.5
    }) == 2.5  # fmt: skip
    assert _limit(tmp_path / "b", f"0::/{pod}/ctr\n", {
        f"{pod}/cpu.max": "150000 100000",  # an ancestor's limit binds too
        f"{pod}/ctr/cpu.max": "max 100000",
    }) == 1.5  # fmt: skip
    # inside a container's own cgroup namespace: path "/", the limit at the root
    assert _limit(tmp_path / "c", "0::/\n", {"cpu.max": "50000 100000"}) == 0.5


@pytest.mark.parametrize(
    "memberships,files",
    [("0::/\n", {"cpu.max": "max 100000"}),  # no limit
     ("0::/\n", {}),  # no cpu controller (cpu.max absent)
     ("0::/\n", {"cpu.max": "lots 100000"}),  # unreadable
     ("0::/\n", {"cpu.max": "0 100000"}),
     ("4:cpu,cpuacct:/docker/abc\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1",
                                      "cpu,cpuacct/cpu.cfs_period_us": "100000"}),
     ("4:memory:/x\n", {"memory/cpu.cfs_quota_us": "100000"})],  # not the cpu hierarchy
    ids=["v2-max", "v2-absent", "v2-garbage", "v2-zero", "v1-unlimited", "v1-no-cpu"],
)  # fmt: skip
def test_no_limit_reads_as_none(tmp_path: Path, memberships: str, files: dict[str, str]) -> None:
    assert _limit(tmp_path, memberships, files) is None


def test_cgroup_v1_quota_and_period(tmp_path: Path) -> None:
    v1 = {"cpu,cpuacct/cpu.cfs_quota_us": "150000", "cpu,cpuacct/cpu.cfs_period_us": "100000"}
    # docker without a cgroup namespace: the path names the host's view, the mount holds the
    # container's own cgroup at its root
    assert _limit(tmp_path, "4:cpu,cpuacct:/docker/abc\n", v1) == 1.5
    nested = {"cpu/a/cpu.cfs_quota_us": "300000", "cpu/a/cpu.cfs_period_us": "100000",
              "cpu/a/b/cpu.cfs_quota_us": "-1", "cpu/a/b/cpu.cfs_period_us": "100000"}  # fmt: skip
    assert _limit(tmp_path / "n", "3:cpu:/a/b\n", nested) == 3.0
    assert _limit(tmp_path / "m", "", v1) is None
    assert cgroup_cpu_limit(tmp_path / "nowhere", tmp_path / "no-such-file") is None


def test_an_explicit_thread_count_is_kept() -> None:
    assert ort_threads(3) == 3
    assert 1 <= cpu_budget() <= visible_cpus()


# -- a real cgroup -----------------------------------------------------------------------

#: what a process reports about its CPU budget (also run in a container by the docker e2e)
PROBE = """
import json, torch
from shared.runtime.cpu import cgroup_cpu_limit, cpu_budget, ort_threads, set_torch_threads
before = torch.get_num_threads()
print(json.dumps({"limit": cgroup_cpu_limit(), "budget": cpu_budget(), "before": before,
                  "after": set_torch_threads(0), "torch": torch.get_num_threads(),
                  "ort": ort_threads(0)}))
"""


def _own_cgroup_v1() -> Path | None:
    """This process's cgroup in the v1 ``cpu`` hierarchy, when there is one."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            for mount in (controllers, "cpu,cpuacct", "cpu"):
                base = Path("/sys/fs/cgroup") / mount
                if (base / "cpu.cfs_quota_us").exists():
                    return base / path.lstrip("/")
    return None


@pytest.fixture
def limited_cgroup() -> Iterator[Path]:
    """A real cgroup (v1 ``cpu`` or v2) allowed 1 CPU, made for this test."""
    if os.geteuid() != 0:
        pytest.skip("making a cgroup needs root")
    v1 = _own_cgroup_v1()
    name = f"estuary-test-{os.getpid()}"
    if v1 is not None:
        group = v1 / name
        quota = ("cpu.cfs_quota_us", "100000")
    else:
        group = Path("/sys/fs/cgroup") / name
        quota = ("cpu.max", "100000 100000")
    try:
        group.mkdir()
        (group / quota[0]).write_text(quota[1])
    except OSError as err:
        pytest.skip(f"cannot make a CPU-limited cgroup here: {err}")
    try:
        yield group
    finally:
        group.rmdir()


def _probe(group: Path | None) -> dict[str, float]:
    def enter() -> None:
        assert group is not None
        (group / "cgroup.procs").write_text(str(os.getpid()))

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torch's own default
    env["PYTHONPATH"] = str(Path(__file__).parents[1])
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
        preexec_fn=enter if group is not None else None, check=True,
    ).stdout  # fmt: skip
    return json.loads(out)


def test_a_process_in_a_cpu_limited_cgroup_uses_that_many_threads(limited_cgroup: Path) -> None:
    """In a real cgroup limited to 1 CPU, torch's default would still count every visible
    core; ``set_torch_threads(0)`` and ``ort_threads(0)`` use 1. Outside it, nothing is
    capped."""
    inside = _probe(limited_cgroup)
    assert inside["limit"] == 1.0 and inside["budget"] == 1
    assert inside["torch"] == inside["after"] == 1
    free = _probe(None)
    assert free["budget"] == visible_cpus() and free["after"] == free["before"]
    if visible_cpus() > 1:  # the cap did something: torch alone would have used more
        assert inside["before"] > 1 and inside["ort"] == 1
