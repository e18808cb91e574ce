"""Memory of every role over a long run: does any process grow round after round?

A real federation, every role its own process over a real mosquitto (the launcher's
:class:`~estuary.launcher.Hierarchy`, as ``estuary demo`` starts it): fmnist-tiny, 2 edges x
2 devices, one local step of a small batch per round, no evaluation, no sample grids, no
deployment, so a round is mostly the federation's own machinery (messages, blobs, state)
and a leak of it shows within a few hundred rounds. Every ``--interval`` seconds the
benchmark reads each process's resident set (``VmRSS`` of ``/proc/<pid>/status``) and tags
the sample with the rounds the cloud has finished (lines of its ``metrics.jsonl``).

A role's RSS *at round r* is the largest sample taken while round r ran. The run passes when
every process stays within ``--tolerance`` (10 %) of its value at ``--baseline`` (round 20,
when imports, the allocator and the first rounds' caches have settled) for every later
round; otherwise the script exits 1. It writes the series as JSON and a plot (one line per
process, the baseline band of each role shaded):

    python benchmarks/memory_rounds.py --rounds 200 \\
        --out benchmarks/results/memory_rounds.json --plot benchmarks/results/memory_rounds.png

``--env KEY=VALUE`` passes an environment override to every role, e.g.
``--env ESTUARY__BROKER__MEMORY_LIMIT_BYTES=2147483648`` for the fixed 2 GiB blob memory of
earlier versions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from estuary.launcher import Hierarchy  # noqa: E402
from shared.config import RunConfig, config_from_dict  # noqa: E402
from shared.transport.local_broker import LocalBroker, find_mosquitto  # noqa: E402


def bench_config(rounds: int, devices: int, edges: int, samples: int) -> RunConfig:
    """fmnist-tiny, ``devices`` devices under ``edges`` edges, ``rounds`` rounds of one local
    step (batch 8) on ``samples`` images per device; no evaluation, grids or deployment."""
    return config_from_dict(
        {
            "run": {"name": "memrounds", "seed": 0, "rounds": rounds},
            "federation": {"num_devices": devices, "num_edges": edges, "round_deadline_s": 120},
            "data": {
                "dataset": "fashion-mnist",
                "partition": "iid",
                "max_samples_per_device": samples,
            },
            "model": {"preset": "fmnist-tiny"},
            "train": {"local_steps": 1, "batch_size": 8, "threads": 1},
            "eval": {"every": 0, "sample_every": 0, "checkpoint_every": 10},
            "deploy": {"enabled": False},
        }
    )


def rss_mib(pid: int) -> float | None:
    """Resident set of process ``pid`` in MiB (``VmRSS``), None once it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def rounds_done(metrics: Path) -> int:
    """Rounds the cloud has finished: the rows of its ``metrics.jsonl``."""
    try:
        with metrics.open("rb") as fh:
            return sum(1 for line in fh if line.strip())
    except OSError:
        return 0


def dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    if not path.is_dir():
        return 0
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(OSError):
            if p.is_file():
                total += p.stat().st_size
    return total


def per_round(
    samples: Sequence[Mapping[str, Any]], names: Sequence[str], last: int
) -> dict[str, dict[int, float]]:
    """Each process's RSS at each round up to ``last``: the largest sample taken while that
    round ran (after ``round - 1`` rounds were done)."""
    out: dict[str, dict[int, float]] = {n: {} for n in names}
    for s in samples:
        r = s["done"] + 1
        if r > last:  # after the last round: writing the outputs, shutting down
            continue
        for name, mib in s["rss"].items():
            if mib is not None and name in out:
                out[name][r] = max(out[name].get(r, 0.0), mib)
    return out


def judge(
    series: Mapping[str, Mapping[int, float]], baseline: int, tolerance: float, last: int
) -> dict[str, dict[str, Any]]:
    """Per process: RSS at ``baseline`` and at ``last``, the largest and smallest ratio to
    the baseline after it, and whether every round stayed within ``tolerance``."""
    verdict: dict[str, dict[str, Any]] = {}
    for name, by_round in series.items():
        base = by_round.get(baseline)
        later = {r: v for r, v in by_round.items() if r > baseline}
        if base is None or not later:
            verdict[name] = {"ok": False, "why": f"no samples at round {baseline} or after"}
            continue
        ratios = {r: v / base for r, v in later.items()}
        worst_hi = max(ratios, key=lambda r: ratios[r])
        worst_lo = min(ratios, key=lambda r: ratios[r])
        end = by_round.get(last, later[max(later)])
        verdict[name] = {
            "rss_baseline_mib": round(base, 1),
            "rss_last_mib": round(end, 1),
            "max_ratio": round(ratios[worst_hi], 4),
            "max_ratio_round": worst_hi,
            "min_ratio": round(ratios[worst_lo], 4),
            "min_ratio_round": worst_lo,
            "ok": 1 - tolerance <= ratios[worst_lo] and ratios[worst_hi] <= 1 + tolerance,
        }
    return verdict


def plot(
    series: Mapping[str, Mapping[int, float]],
    verdict: Mapping[str, Mapping[str, Any]],
    baseline: int,
    tolerance: float,
    path: Path,
    title: str,
) -> None:
    """One line per process (x round, y RSS MiB), each with its baseline +-tolerance band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, by_round) in enumerate(sorted(series.items())):
        rounds = sorted(by_round)
        color = colors[i % len(colors)]
        ok = verdict.get(name, {}).get("ok", False)
        label = f"{name}{'' if ok else ' (left the band)'}"
        ax.plot(rounds, [by_round[r] for r in rounds], color=color, label=label, lw=1.2)
        base = by_round.get(baseline)
        if base is not None:
            ax.fill_between(
                [baseline, max(rounds)], base * (1 - tolerance), base * (1 + tolerance),
                color=color, alpha=0.08, lw=0,
            )  # fmt: skip
    ax.axvline(baseline, color="grey", ls="--", lw=0.8)
    ax.text(baseline, ax.get_ylim()[1], f" round {baseline} ±{tolerance:.0%}", va="top",
            fontsize=8, color="grey")  # fmt: skip
    ax.set_xlabel("round")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="center right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the hierarchy, sample until the cloud exits, stop everything; the raw record."""
    cfg = bench_config(args.rounds, args.devices, args.edges, args.samples)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="memrounds-"))
    work.mkdir(parents=True, exist_ok=True)
    config_path = work / "config.json"
    config_path.write_text(cfg.to_json())
    run_dir = work / "run"
    env = dict(kv.split("=", 1) for kv in args.env)
    # the roles import this checkout, wherever the benchmark is started from
    path = os.environ.get("PYTHONPATH", "")
    role_env = {**env, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)}
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    code: int | None = None
    pids: dict[str, int] = {}
    caches: dict[str, int] = {}
    failed: dict[str, int | None] = {}
    cloud_tail = ""
    try:
        with LocalBroker(kind="mosquitto", workdir=work / "broker") as broker:
            hier = Hierarchy(cfg, config_path, run_dir, broker, evaluate=False, env=role_env)
            try:
                hier.start_all()
                pids.update({n: p.popen.pid for n, p in hier.procs.items() if p.popen})
                if broker.process is not None:
                    pids["mosquitto"] = broker.process.pid
                metrics = run_dir / "metrics.jsonl"
                next_log, last_scrape = 0, 0.0
                while hier.procs["cloud"].alive:
                    if time.monotonic() - started > args.timeout:
                        print(f"timed out after {args.timeout:.0f} s", file=sys.stderr)
                        break
                    done = rounds_done(metrics)
                    sample: dict[str, Any] = {
                        "t": round(time.monotonic() - started, 2),
                        "done": done,
                        "rss": {n: rss_mib(pid) for n, pid in pids.items()},
                    }
                    if time.monotonic() - last_scrape >= args.scrape_every:
                        # what Prometheus would do, and how many series each role exports
                        last_scrape = time.monotonic()
                        sample["series"] = {n: len(m) for n, m in hier.scrape_all().items()}
                    samples.append(sample)
                    if done >= next_log:
                        rss = " ".join(f"{n}={v:.0f}" for n, v in sample["rss"].items() if v)
                        print(f"[{sample['t']:7.1f}s] rounds done {done:4d}  RSS MiB {rss}",
                              flush=True)  # fmt: skip
                        next_log = done + args.log_every
                    time.sleep(args.interval)
                code = hier.wait("cloud", 60)
                caches = {n: dir_bytes(run_dir / "cache" / n) for n in hier.procs}
                failed = {p.name: p.returncode for p in hier.failed()}
                cloud_tail = hier.procs["cloud"].log_tail(15)
            finally:
                hier.stop_all(timeout_s=15)
    finally:
        wall_s = time.monotonic() - started
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return {
        "config": json.loads(cfg.to_json()),
        "env": env,
        "wall_s": round(wall_s, 1),
        "cloud_exit": code,
        "failed": failed,
        "cloud_log_tail": cloud_tail if code != 0 else "",
        "cache_bytes": caches,
        "samples": samples,
        "pids": pids,
    }


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    """Run, judge, write JSON and plot; exit 1 when a role left its band or the run failed."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--edges", type=int, default=2)
    ap.add_argument("--samples", type=int, default=64, help="images per device")
    ap.add_argument("--baseline", type=int, default=20, help="round the band is centred on")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--interval", type=float, default=0.25, help="seconds between samples")
    ap.add_argument("--scrape-every", type=float, default=5.0, help="seconds between scrapes")
    ap.add_argument("--log-every", type=int, default=10, help="print every this many rounds")
    ap.add_argument("--timeout", type=float, default=3600.0, help="give up after (s)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--workdir", help="run here and keep it (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--out", type=Path, help="JSON of the series and verdict")
    ap.add_argument("--plot", type=Path, help="PNG plot")
    args = ap.parse_args(argv)
    if find_mosquitto() is None:
        print("mosquitto is not installed", file=sys.stderr)
        return 2
    if args.baseline >= args.rounds:
        ap.error("--baseline must be below --rounds")
    # stopped (SIGTERM, or SIGINT where a background job ignores it): stop the hierarchy too
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    record = run(args)
    roles = sorted(record["pids"])
    last = args.rounds
    series = per_round(record["samples"], roles, last)
    verdict = judge({n: s for n, s in series.items() if n != "mosquitto"}, args.baseline,
                    args.tolerance, last)  # fmt: skip
    broker = judge({"mosquitto": series.get("mosquitto", {})}, args.baseline, 1e9, last)
    done = max((s["done"] for s in record["samples"]), default=0)
    ok = record["cloud_exit"] == 0 and all(v["ok"] for v in verdict.values())
    t_base = next((s["t"] for s in record["samples"] if s["done"] >= args.baseline), 0.0)
    t_done = next((s["t"] for s in record["samples"] if s["done"] >= done), 0.0)
    s_per_round = (t_done - t_base) / (done - args.baseline) if done > args.baseline else 0.0
    result = {
        "benchmark": "memory_rounds",
        "date": time.strftime("%Y-%m-%d"),
        "host_cpus": os.cpu_count(),
        "rounds": args.rounds,
        "rounds_done": done,
        "baseline_round": args.baseline,
        "tolerance": args.tolerance,
        "wall_s": record["wall_s"],
        "s_per_round_after_baseline": round(s_per_round, 3),
        "ok": ok,
        "verdict": verdict,
        "broker": broker["mosquitto"],
        "cache_bytes_at_end": record["cache_bytes"],
        "rss_mib_per_round": {
            n: {str(r): round(v, 1) for r, v in sorted(s.items())} for n, s in series.items()
        },
        "series_exported_first_last": {
            n: scraped[:1] + scraped[-1:]
            for n in roles
            if (scraped := [s["series"][n] for s in record["samples"] if n in s.get("series", {})])
        },
        "cloud_exit": record["cloud_exit"],
        "failed": record["failed"],
        "env": record["env"],
        "config": record["config"],
    }
    if record["cloud_log_tail"]:
        result["cloud_log_tail"] = record["cloud_log_tail"]
    print(f"\n{done} rounds in {record['wall_s']:.0f} s ({s_per_round:.2f} s/round after "
          f"round {args.baseline})")  # fmt: skip
    print(f"{'process':10s} {'r' + str(args.baseline):>9s} {'r' + str(last):>9s} "
          f"{'max ratio':>10s} {'min ratio':>10s}  ok")  # fmt: skip
    for name, v in sorted({**verdict, "mosquitto": broker["mosquitto"]}.items()):
        if "rss_baseline_mib" not in v:
            print(f"{name:10s} {v.get('why', '?')}")
            continue
        flag = "-" if name == "mosquitto" else ("yes" if v["ok"] else "NO")
        print(f"{name:10s} {v['rss_baseline_mib']:9.1f} {v['rss_last_mib']:9.1f} "
              f"{v['max_ratio']:10.3f} {v['min_ratio']:10.3f}  {flag}")  # fmt: skip
    if record["cloud_exit"] != 0:
        print(f"the cloud exited with {record['cloud_exit']}:\n{record['cloud_log_tail']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        title = (f"RSS per round: fmnist-tiny, {args.edges} edges, {args.devices} devices, "
                 f"{done} rounds over mosquitto")  # fmt: skip
        roles_only = {n: s for n, s in series.items() if n != "mosquitto"}
        plot(roles_only, verdict, args.baseline, args.tolerance, args.plot, title)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
