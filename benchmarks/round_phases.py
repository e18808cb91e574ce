"""Where a round's time and memory go at model scale: the phases of its critical path, every
role's peak RSS and the bytes on the wire, for a deployed federation of ddpm-cifar10.

A real federation, every role its own process over a real mosquitto (the launcher's
:class:`~estuary.launcher.Hierarchy`, as ``estuary demo`` starts it): the ``ddpm-cifar10``
preset (35.7 M parameters, 136 MiB fp32) on the 3-channel view of Fashion-MNIST, one edge,
``--devices`` devices (4 and 8 by default, one federation each), one local step per round,
a checkpoint after every round, no evaluation, grids or deployment. Every role writes its
round timeline (``ESTUARY_TRACE_DIR``, :mod:`shared.runtime.trace`); per round ``r`` the
benchmark cuts the time from the cloud's announcement of ``r`` to its announcement of
``r + 1`` into consecutive phases of the critical path:

- ``download``: announcement until the first device starts training (the edge fetches the
  global model, announces, the devices fetch the edge's model);
- ``training``: first device's training start until the last device's training end;
- ``upload``: until the edge holds the last update (encode, serve, fetch, verify);
- ``edge_aggregation``: until the edge's report is sent (aggregate, put the edge model);
- ``edge_to_cloud``: until the cloud holds the edge's model;
- ``cloud_aggregation``, ``checkpoint``, ``announce`` (close, put the new global, send).

The figure judged is the **overhead**: the round's wall time minus the slowest device's
training (its own ``train_s``). The first round (imports, first fetches) and the last (no
next announcement) are not measured; the medians are over the rounds between. Peak RSS is
each process's ``VmHWM``; bytes on the wire are the blobs the roles fetched per round
(``bytes`` of the trace's fetch events) and the payload bytes each role counted
(``estuary_bytes_total``, scraped every second)::

    python benchmarks/round_phases.py --devices 4 8 \\
        --out benchmarks/results/round_phases.json --plot benchmarks/results/round_phases.png

A busy machine: ``--load 1`` runs every federation twice, quiet and beside one process that
keeps one core busy (a plain Python loop at normal priority, started before the roles and
killed after them), the order alternating with ``--repeats``; the table gives per phase the
median loaded / quiet ratio. Every run also reads the CPU time of every role and of the
broker (``/proc/<pid>/stat``, with the RSS samples) and gives per round the CPU seconds of
each and their share of the machine's CPUs; with ``--load`` the comparison adds the least
wall time a quiet round's CPU work can take on the cores the busy processes leave (a round
that already kept the machine busy cannot be faster than that, whatever its code).
``--placement split`` puts the devices on half the CPUs and the cloud, the edge, the broker
and the busy processes on the other half (each thread pinned): devices on machines of their
own beside server roles that share theirs with a neighbour.

``--floor`` measures the transfer floor of a round right after each quiet run, in the same
machine state (``benchmarks/_round_floor.py``: the same bytes along the same four legs
through the same broker by plain paho clients, no model work), each run's overhead / floor
ratio and, per device count, their median and range over ``--repeats``; and once per device
count the floor with sha256 over the bytes on both sides, the least a content-addressed
transfer adds::

    python benchmarks/round_phases.py --devices 4 8 --load 1 --floor \\
        --out benchmarks/results/round_phases_load.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from estuary.launcher import Hierarchy  # noqa: E402
from shared.config import RunConfig, config_from_dict  # noqa: E402
from shared.runtime.trace import ENV_DIR  # noqa: E402
from shared.transport.local_broker import LocalBroker, find_mosquitto  # noqa: E402

PHASES = (
    "download",
    "training",
    "upload",
    "edge_aggregation",
    "edge_to_cloud",
    "cloud_aggregation",
    "checkpoint",
    "announce",
)


def bench_config(
    rounds: int, devices: int, preset: str, batch: int, samples: int, deadline_s: float
) -> RunConfig:
    """``preset`` on the 3-channel view of Fashion-MNIST, one edge, ``devices`` devices,
    ``rounds`` rounds of one local step (batch ``batch``, one thread) on ``samples`` images
    per device; a checkpoint every round; no evaluation, grids or deployment."""
    return config_from_dict(
        {
            "run": {"name": "phases", "seed": 0, "rounds": rounds},
            "federation": {
                "num_devices": devices,
                "num_edges": 1,
                "round_deadline_s": deadline_s,
            },
            "data": {
                "dataset": "fashion-mnist",
                "partition": "iid",
                "max_samples_per_device": samples,
                "gray_to_rgb": preset == "ddpm-cifar10",
            },
            "model": {"preset": preset},
            "train": {"local_steps": 1, "batch_size": batch, "threads": 1},
            "eval": {"every": 0, "sample_every": 0, "checkpoint_every": 1},
            "deploy": {"enabled": False},
        }
    )


def proc_status(pid: int) -> dict[str, float]:
    """``VmRSS`` and ``VmHWM`` (peak) of process ``pid`` in MiB; empty once it is gone."""
    out: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line[:5]] = int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return {}
    return out


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system, all threads) of process ``pid`` in seconds; None once gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, ValueError, IndexError):
        return None


def pin(pid: int, cpus: set[int]) -> None:
    """Keep every thread of process ``pid`` on ``cpus`` (threads it starts later inherit
    the mask of the thread that starts them; a thread gone meanwhile is skipped)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (OSError, ValueError):
            pass


def placement_cpus(placement: str) -> tuple[set[int], set[int]] | None:
    """The CPUs of the devices and of the servers (cloud, edges, broker and any busy
    process) under ``placement``: ``shared``, everyone everywhere (None); ``split``,
    the devices on the first half of this process's CPUs, the rest on the second half, as
    devices on machines of their own beside an edge server and a cloud that share one."""
    if placement == "shared":
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--placement split needs at least 2 CPUs")
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


def cpu_per_round(
    series: Sequence[tuple[float, Mapping[str, float]]], starts: Mapping[int, float], rounds: int
) -> dict[int, dict[str, float]]:
    """CPU seconds each process used between the cloud's announcements of round ``r`` and
    ``r + 1`` (from ``series``: (unix time, cumulative CPU s by process), the samples
    nearest each announcement), for every round with both."""
    out: dict[int, dict[str, float]] = {}
    times = [t for t, _ in series]

    def at(t: float) -> Mapping[str, float]:
        i = min(range(len(times)), key=lambda k: abs(times[k] - t))
        return series[i][1]

    for r in range(rounds - 1):
        if r not in starts or r + 1 not in starts or not series:
            continue
        a, b = at(starts[r]), at(starts[r + 1])
        row = {n: round(b[n] - a[n], 3) for n in b if n in a}
        row["total"] = round(sum(row.values()), 3)
        out[r] = row
    return out


def read_traces(directory: Path) -> list[dict[str, Any]]:
    """Every event of every role's trace file, in time order."""
    events: list[dict[str, Any]] = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                events.append(json.loads(line))
    return sorted(events, key=lambda e: e["t"])


def phases_of(events: Sequence[Mapping[str, Any]], rounds: int) -> dict[int, dict[str, float]]:
    """Per round with a next announcement: the phases (s), its wall time, the slowest
    device's training, the overhead and the blob bytes fetched."""
    at: dict[tuple[str, str, int], list[Mapping[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("round") is not None:
            role = "cloud" if e["who"] == "cloud" else ("edge" if e["who"].startswith("edge")
                                                        else "device")  # fmt: skip
            at[(role, e["ev"], e["round"])].append(e)
    out: dict[int, dict[str, float]] = {}
    for r in range(rounds - 1):
        try:
            start = at[("cloud", "announce", r)][0]["t"]
            nxt = at[("cloud", "announce", r + 1)][0]["t"]
            trained = at[("device", "trained", r)]
            train_starts = [e["t"] - e["train_s"] for e in trained]
            train_ends = [e["t"] for e in trained]
            fetched = at[("edge", "update_fetched", r)]
            reported = at[("edge", "reported", r)]
            edge_fetched = at[("cloud", "edge_fetched", r)]
            aggregated = at[("cloud", "aggregated", r)][0]["t"]
            checkpointed = at[("cloud", "checkpointed", r)][0]["t"]
        except (KeyError, IndexError):
            continue
        if not trained or not fetched or not reported or not edge_fetched:
            continue
        marks = [
            start,
            min(train_starts),
            max(train_ends),
            max(e["t"] for e in fetched),
            max(e["t"] for e in reported),
            max(e["t"] for e in edge_fetched),
            aggregated,
            checkpointed,
            nxt,
        ]
        row = {p: marks[i + 1] - marks[i] for i, p in enumerate(PHASES)}
        slowest = max(e["train_s"] for e in trained)
        row["wall"] = nxt - start
        row["slowest_training"] = slowest
        row["overhead"] = row["wall"] - slowest
        row["devices_trained"] = len(trained)
        blobs = [("device", "downloaded"), ("edge", "update_fetched"), ("cloud", "edge_fetched"),
                 ("edge", "global_fetched")]  # fmt: skip
        row["blob_bytes"] = sum(e.get("bytes", 0) for k in blobs for e in at[(k[0], k[1], r)])
        out[r] = row
    return out


class BusyLoad:
    """``n`` processes that each keep one core busy (on ``cpus``; by default anywhere: the
    scheduler places them as it would a neighbour's job), for the duration of a ``with``
    block."""

    def __init__(self, n: int, cpus: set[int] | None = None) -> None:
        self.n = n
        self.cpus = cpus
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> BusyLoad:
        for _ in range(self.n):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                start_new_session=True))  # fmt: skip
            if self.cpus is not None:
                pin(self.procs[-1].pid, self.cpus)
        return self

    def __exit__(self, *_: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait(10)
        self.procs = []


def _floor_beside(res: dict[str, Any], devices: int, rounds: int) -> None:
    """Measure the transfer floor right after quiet run ``res`` (its model's bytes) and add
    it and the run's overhead over it to ``res`` (or the error that stopped it)."""
    size = int(res["median"]["blob_bytes"]) // (2 * devices + 2)  # 2n + 2 models a round
    try:
        res["floor"] = floor_of(devices, size, rounds)
    except (TimeoutError, OSError) as err:  # the figures so far are still written
        res["floor_error"] = f"{type(err).__name__}: {err}"
        print(f"   no floor: {res['floor_error']}", flush=True)
        return
    f = res["floor"]["median"]["floor"]
    res["overhead_over_floor"] = round(res["median"]["overhead"] / f, 2)
    print(f"   transfer floor ({size / 2**20:.0f} MiB model) {f:.2f} s; this run's overhead "
          f"{res['median']['overhead']:.2f} s = {res['overhead_over_floor']}x it",
          flush=True)  # fmt: skip


def floor_of(devices: int, size: int, rounds: int, hashed: bool = False) -> dict[str, Any]:
    """The transfer floor of a round of ``devices`` devices and a ``size``-byte model
    (``_round_floor.FloorRound``; ``hashed``: with sha256 on both sides) through a fresh
    mosquitto set up as the federation's: the median over ``rounds`` rounds, per leg."""
    from _round_floor import FloorRound

    from shared.config.deployment import BrokerSection

    turns = BrokerSection().max_update_fetches  # the edge's downloads at once
    with LocalBroker(kind="mosquitto") as broker:
        floor = FloorRound(broker.host, broker.port, devices, size, turns=turns, hashed=hashed)
        try:
            rows = [floor.round(f"r{i}") for i in range(rounds)]
        finally:
            floor.close()
    return {
        "model_bytes": size,
        "rounds": rows,
        "median": {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]},
    }


def run_one(
    args: argparse.Namespace, devices: int, split: tuple[set[int], set[int]] | None = None
) -> dict[str, Any]:
    """One federation of ``devices`` devices: its per-round phases, peak RSS and bytes."""
    cfg = bench_config(args.rounds, devices, args.preset, args.batch, args.samples, args.deadline)
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"phases{devices}-", dir=args.workdir))
    config_path = work / "config.json"
    config_path.write_text(cfg.to_json())
    run_dir, trace_dir = work / "run", work / "trace"
    path = os.environ.get("PYTHONPATH", "")
    env = {
        ENV_DIR: str(trace_dir),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
        **dict(kv.split("=", 1) for kv in args.env),
    }
    peak: dict[str, float] = {}
    rss: list[tuple[float, dict[str, float]]] = []  # (unix time, VmRSS MiB by process)
    cpu: list[tuple[float, dict[str, float]]] = []  # (unix time, CPU s so far by process)
    wire: dict[str, dict[str, float]] = {}
    started = time.monotonic()
    code: int | None = None
    failed: dict[str, int | None] = {}
    tail = ""
    try:
        with LocalBroker(kind="mosquitto", workdir=work / "broker") as broker:
            hier = Hierarchy(cfg, config_path, run_dir, broker, evaluate=False, env=env)
            try:
                hier.start_all()
                pids = {n: p.popen.pid for n, p in hier.procs.items() if p.popen}
                if broker.process is not None:
                    pids["mosquitto"] = broker.process.pid
                devices_of = {n for n, p in hier.procs.items() if p.role == "device"}
                last_scrape = last_pin = 0.0
                while hier.procs["cloud"].alive:
                    if split is not None and time.monotonic() - last_pin >= 1.0:
                        last_pin = time.monotonic()  # again: threads started since
                        for name, pid in pids.items():
                            pin(pid, split[0] if name in devices_of else split[1])
                    now_cpu = {n: c for n, pid in pids.items()
                               if (c := cpu_seconds(pid)) is not None}  # fmt: skip
                    cpu.append((time.time(), now_cpu))
                    if time.monotonic() - started > args.timeout:
                        print(f"timed out after {args.timeout:.0f} s", file=sys.stderr)
                        break
                    now_rss: dict[str, float] = {}
                    for name, pid in pids.items():
                        if name == "mosquitto":
                            continue
                        st = proc_status(pid)
                        if "VmHWM" in st:
                            peak[name] = max(peak.get(name, 0.0), st["VmHWM"])
                            now_rss[name] = round(st["VmRSS"], 1)
                    rss.append((round(time.time(), 2), now_rss))
                    if time.monotonic() - last_scrape >= 1.0:
                        last_scrape = time.monotonic()
                        for name, m in hier.scrape_all(timeout_s=1.0).items():
                            wire[name] = {
                                d: sum(v for k, v in m.items()
                                       if k.startswith("estuary_bytes_total{")
                                       and f'direction="{d}"' in k)
                                for d in ("sent", "received")
                            }  # fmt: skip
                    time.sleep(args.interval)
                code = hier.wait("cloud", 120)
                failed = {p.name: p.returncode for p in hier.failed()}
                tail = hier.procs["cloud"].log_tail(20)
            finally:
                hier.stop_all(timeout_s=15)
        events = read_traces(trace_dir)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    rows = phases_of(events, args.rounds)
    measured = {r: row for r, row in rows.items() if r >= 1}
    keys = (*PHASES, "wall", "slowest_training", "overhead", "blob_bytes")
    medians: dict[str, Any] = (
        {k: round(statistics.median(row[k] for row in measured.values()), 3) for k in keys}
        if measured
        else {}
    )
    starts = {e["round"]: e["t"] for e in events if e["who"] == "cloud" and e["ev"] == "announce"}
    cpu_rounds = cpu_per_round(cpu, starts, args.rounds)
    measured_cpu = [row for r, row in cpu_rounds.items() if r in measured]
    if measured_cpu:
        names = sorted(set.intersection(*(set(row) for row in measured_cpu)))
        medians["cpu_s"] = {n: round(statistics.median(row[n] for row in measured_cpu), 2)
                            for n in names}  # fmt: skip
        cores = len(os.sched_getaffinity(0))
        medians["cpu_utilization"] = round(
            statistics.median(cpu_rounds[r]["total"] / (measured[r]["wall"] * cores)
                              for r in measured if r in cpu_rounds), 3)  # fmt: skip
    return {
        "devices": devices,
        "placement": args.placement,
        "cloud_exit": code,
        "failed": failed,
        "cloud_log_tail": tail if code != 0 else "",
        "wall_s": round(time.monotonic() - started, 1),
        "rounds": {str(r): {k: round(v, 3) for k, v in row.items()} for r, row in rows.items()},
        "median": medians,
        "peak_rss_mib": {n: round(v, 1) for n, v in sorted(peak.items())},
        "rss_mib_series": rss,
        "round_starts": starts,
        "cpu_per_round": {str(r): row for r, row in cpu_rounds.items()},
        "payload_bytes_whole_run": wire,
        "workdir": str(work) if args.keep else None,
    }


def plot(results: Sequence[Mapping[str, Any]], path: Path, title: str) -> None:
    """Left: stacked median phases per device count; right: peak RSS per role."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.5))
    labels = [f"{r['devices']} devices" for r in results]
    bottom = [0.0] * len(results)
    for phase in PHASES:
        vals = [r["median"].get(phase, 0.0) for r in results]
        ax.bar(labels, vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, r in enumerate(results):
        m = r["median"]
        if m:
            ax.text(i, bottom[i], f"wall {m['wall']:.1f} s\noverhead {m['overhead']:.1f} s",
                    ha="center", va="bottom", fontsize=9)  # fmt: skip
    ax.set_ylabel("seconds (median round)")
    ax.set_title("critical path of a round")
    ax.legend(fontsize=8)
    roles = sorted({"cloud", "edge0", "device (max)"})
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        rss = r["peak_rss_mib"]
        dev = max((v for n, v in rss.items() if n.startswith("dev")), default=0.0)
        vals = [rss.get("cloud", 0.0), rss.get("edge0", 0.0), dev]
        xs = [j + i * width for j in range(len(roles))]
        bx.bar(xs, [v / 1024 for v in vals], width, label=labels[i])
    bx.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(roles))],
                  ["cloud", "edge0", "device (max)"])  # fmt: skip
    bx.set_ylabel("peak RSS (GiB)")
    bx.set_title("peak memory per role")
    bx.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _print_run(res: Mapping[str, Any]) -> None:
    m = res["median"]
    if m:
        print("   " + "  ".join(f"{p} {m[p]:.2f}" for p in PHASES), flush=True)
        print(f"   wall {m['wall']:.2f} s, slowest training {m['slowest_training']:.2f} s, "
              f"overhead {m['overhead']:.2f} s, blobs {m['blob_bytes'] / 2**20:.0f} MiB",
              flush=True)  # fmt: skip
    if "cpu_s" in m:
        print(f"   CPU per round {m['cpu_s']['total']:.2f} s ("
              + " ".join(f"{k}={v:.2f}" for k, v in m["cpu_s"].items() if k != "total")
              + f"), {m['cpu_utilization']:.0%} of the CPUs", flush=True)  # fmt: skip
    print("   peak RSS MiB " + " ".join(f"{k}={v:.0f}" for k, v in res["peak_rss_mib"].items()),
          flush=True)  # fmt: skip
    if res["cloud_exit"] != 0:
        print(f"   cloud exited {res['cloud_exit']}:\n{res['cloud_log_tail']}", flush=True)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    """Run one federation per device count; print, write JSON and plot."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--devices", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--rounds", type=int, default=5, help="the first and last are not measured")
    ap.add_argument("--preset", default="ddpm-cifar10")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--samples", type=int, default=64, help="images per device")
    ap.add_argument("--deadline", type=float, default=600.0, help="round deadline (s)")
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between RSS samples")
    ap.add_argument("--timeout", type=float, default=1800.0, help="give up a federation after")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--workdir", help="parent of the run directories (default: /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument(
        "--load",
        type=int,
        default=0,
        metavar="N",
        help="also run each federation beside N busy processes (one core each)",
    )
    ap.add_argument(
        "--placement",
        choices=("shared", "split"),
        default="shared",
        help="shared: every process on every CPU; split: the devices on half the CPUs, the "
        "cloud, edge, broker and busy processes on the other half",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="quiet/loaded pairs per device count (the order alternates)",
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="measure the transfer floor of a round beside each device count",
    )
    ap.add_argument("--floor-rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, help="JSON of the figures")
    ap.add_argument("--plot", type=Path, help="PNG plot")
    args = ap.parse_args(argv)
    if args.rounds < 3:
        ap.error("--rounds must be at least 3 (the first and last are not measured)")
    if find_mosquitto() is None:
        print("mosquitto is not installed", file=sys.stderr)
        return 2
    start_load = list(os.getloadavg())
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    results = []
    comparisons = []
    split = placement_cpus(args.placement)  # (devices' CPUs, the servers'), or None
    for n in args.devices:
        legs = ["quiet", "loaded"] if args.load else ["quiet"]
        runs: dict[str, list[dict[str, Any]]] = {leg: [] for leg in legs}
        for rep in range(args.repeats):
            for leg in legs if rep % 2 == 0 else legs[::-1]:
                print(f"-- {n} devices, {leg}" + (f" ({args.load} busy)" if leg == "loaded"
                      else "") + f", repeat {rep + 1}/{args.repeats}", flush=True)  # fmt: skip
                with BusyLoad(args.load if leg == "loaded" else 0, split and split[1]):
                    res = run_one(args, n, split)
                res["load"] = args.load if leg == "loaded" else 0
                res["repeat"] = rep
                runs[leg].append(res)
                if leg == "quiet" and rep == 0:
                    results.append(res)
                _print_run(res)
                if args.floor and leg == "quiet" and res["median"]:
                    _floor_beside(res, n, args.floor_rounds)
        row: dict[str, Any] = {"devices": n}
        keys = (*PHASES, "wall", "slowest_training", "overhead")
        for leg in legs:
            row[leg] = {
                k: round(statistics.median(r["median"].get(k, float("nan")) for r in runs[leg]), 3)
                for k in keys
            }
        for leg in legs:
            cpu = [r["median"]["cpu_s"]["total"] for r in runs[leg] if "cpu_s" in r["median"]]
            if cpu:
                row[leg]["cpu_s"] = round(statistics.median(cpu), 2)
        if args.load and args.placement == "shared" and "cpu_s" in row["quiet"]:
            # the least wall time a quiet round's CPU work can take with the busy cores gone
            cores = len(os.sched_getaffinity(0)) - args.load
            if cores > 0:
                bound = row["quiet"]["cpu_s"] / cores
                row["loaded_wall_bound"] = round(max(bound, row["quiet"]["wall"]), 2)
        if args.load:
            row["loaded_over_quiet"] = {
                k: round(row["loaded"][k] / row["quiet"][k], 2) if row["quiet"][k] > 0 else None
                for k in keys
            }
            ratio = row["loaded_over_quiet"]
            if "loaded_wall_bound" in row:
                row["loaded_bound_over_quiet"] = round(
                    row["loaded_wall_bound"] / row["quiet"]["wall"], 2
                )
                print(f"   a quiet round's CPU work ({row['quiet']['cpu_s']:.1f} s) on the "
                      f"cores left: at least {row['loaded_wall_bound']:.2f} s, "
                      f"x{row['loaded_bound_over_quiet']}", flush=True)  # fmt: skip
            print(
                f"   loaded / quiet: wall {ratio['wall']}, overhead {ratio['overhead']}, "
                + ", ".join(f"{p} {ratio[p]}" for p in PHASES),
                flush=True,
            )
        floored = [r for r in runs["quiet"] if "floor" in r]
        if args.floor and not floored:
            row["floor_error"] = "no quiet run measured a floor"
            print(f"   no floor: {row['floor_error']}", flush=True)
        elif floored:
            # each quiet run's overhead over the floor measured right after it (the same
            # machine state): their median, and the spread over the repeats
            ratios = [r["overhead_over_floor"] for r in floored]
            row["floor"] = {
                "runs": [r["floor"] for r in floored],
                "median": {
                    k: round(statistics.median(r["floor"]["median"][k] for r in floored), 3)
                    for k in floored[0]["floor"]["median"]
                },
            }
            row["overhead_over_floor"] = round(statistics.median(ratios), 2)
            row["overhead_over_floor_runs"] = ratios
            f = row["floor"]["median"]["floor"]
            print(f"   floor {f:.2f} s (" + ", ".join(
                f"{k} {v:.2f}" for k, v in row["floor"]["median"].items() if k != "floor")
                + f"); quiet overhead {row['quiet']['overhead']:.2f} s; overhead / floor "
                f"{row['overhead_over_floor']}x (median of {len(ratios)}: "
                f"{min(ratios)}-{max(ratios)})", flush=True)  # fmt: skip
            size = floored[0]["floor"]["model_bytes"]
            try:  # the same with the sha256 a content-addressed transfer cannot skip
                row["floor_hashed"] = floor_of(n, size, args.floor_rounds, hashed=True)
            except (TimeoutError, OSError) as err:
                row["floor_hashed_error"] = f"{type(err).__name__}: {err}"
            else:
                fh = row["floor_hashed"]["median"]["floor"]
                row["overhead_over_hashed_floor"] = round(row["quiet"]["overhead"] / fh, 2)
                print(f"   floor with sha256 on both sides {fh:.2f} s; quiet overhead = "
                      f"{row['overhead_over_hashed_floor']}x it", flush=True)  # fmt: skip
        row["runs"] = runs
        comparisons.append(row)
    record = {
        "benchmark": "round_phases",
        "date": time.strftime("%Y-%m-%d"),
        "host_cpus": os.cpu_count(),
        "preset": args.preset,
        "batch": args.batch,
        "rounds": args.rounds,
        "env": args.env,
        "load": args.load,
        "placement": args.placement,
        "repeats": args.repeats,
        "loadavg_at_start": start_load,
        "results": results,
        "comparisons": comparisons,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    if args.plot:
        plot(results, args.plot, f"{args.preset}, 1 edge, one local step (batch {args.batch}), "
             f"{time.strftime('%Y-%m-%d')}")  # fmt: skip
    ok = all(
        r["cloud_exit"] == 0 and r["median"]
        for c in comparisons
        for leg in c["runs"].values()
        for r in leg
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
