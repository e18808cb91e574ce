"""FedPhD's comparison (Tables I and IV) on one GPU, sized to fit a wall-clock budget.

A GPU run with a time budget of minutes leaves no room for a second try, so this script
measures before it plans:

1. **calibrate**: ``--jobs`` processes train the comparison's model (batch 128, Adam) on the
   GPU at the same time, then sample with DDIM, each for a few seconds; their step and
   sampling rates *under that contention* are what the methods will see;
2. **size**: the largest FedAvg round count ``R`` (E = 5; the E = 1 methods run ``5 R``
   rounds, so every method does the same local steps) whose predicted wall time fits the
   budget, and an evaluation cadence that puts 4-5 FID points at equal-compute rounds;
3. **compare**: write that comparison's TOML (the paper's setup of
   ``configs/compare/compare_gpu_small.toml``: N = 20 devices with 2 Fashion-MNIST classes,
   N_e = 2, kappa = 0.2, r_g = 5, r_e = 1) and run ``estuary compare --jobs N`` on it; at the
   deadline the comparison is stopped and whatever each method recorded (``metrics.jsonl``)
   is kept;
4. **pack**: tables, plots, per-method metrics, logs and the last sample grids into one
   ``.tar.gz`` under ``--out``.

    python benchmarks/gpu/gpu_compare.py --budget-s 480 --out OUT
    python benchmarks/gpu/gpu_compare.py --preset fmnist-tiny --max-rounds 200 \
        --budget-s 480 --out OUT
    python benchmarks/gpu/gpu_compare.py --dry-run --out OUT  # the same pipeline, tiny, on the CPU

``fmnist-small`` (8.9 M parameters, 1.52 GMACs per image) is the comparison's own model; a
15-minute GPU budget gives it about a thousand local steps per method, far from settled.
``fmnist-tiny`` (0.69 M, 0.095 GMACs) costs about 16 times less per step, so the same budget
runs it many times longer: the methods' ordering closer to a settled FID, on a smaller
U-Net.

Methods: FedAvg, FedAvg (E=1), FedPhD (s_p = 0.44 after R_s = 5 sparse rounds), FedPhD (OS),
FedDiffuse (USPLIT) and SCAFFOLD. The learning rate is 5e-4 rather than the paper's 2e-4
because the run is about a hundred times shorter than the paper's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: devices per round (N = 20, kappa = 0.2) and their E = 1 steps (~3000 images, batch 128)
DEVICES_PER_ROUND = 4
#: seconds a method spends before its first round (imports, data, reference features)
STARTUP_S = 30.0
#: per-round work besides local training (serialization, aggregation, accounting), seconds
ROUND_OVERHEAD_S = 0.6
#: seconds an evaluation spends besides sampling (features and statistics of the samples:
#: 0.2 s for 1000 images on a 2-core CPU; an H200 run's whole evaluations took 3.4-4.3 s)
EVAL_OVERHEAD_S = 2.0
#: the share of the budget the prediction may fill (the rest absorbs misprediction). Three
#: H100 runs and one H200 run took 0.84, 0.91, 1.00 and 0.80 of the time predicted when the
#: plan still counted ``eval.clients`` evaluations per point and 5 s per evaluation besides
#: sampling; recomputed as :func:`plan` counts now, the two runs whose calibration is
#: recorded (H100 ``fmnist-small``, H200 ``fmnist-tiny``) took 1.01 and 1.00. A run that
#: overshoots is stopped at the deadline with what it recorded
FILL = 0.9


def _calibrate_worker(
    idx: int,
    preset: str,
    batch: int,
    train_opts: dict[str, Any],
    seconds: float,
    device: str,
    barrier: Any,
    queue: Any,
) -> None:
    """One calibration process: train ``preset`` in device rounds of 24 steps (with
    ``train_opts``: precision, CUDA graph), then sample with DDIM, each for ``seconds``
    (halved for sampling), in step with the others."""
    try:
        import torch

        from shared.config import config_from_dict
        from shared.diffusion.schedule import ddim_sample, make_train_scheduler
        from shared.diffusion.training import train_local
        from shared.models.presets import build_unet

        torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(1, barrier.parties)))
        cfg = config_from_dict({
            "model": {"preset": preset},
            "train": {"batch_size": batch, "lr": 5e-4, "optimizer": "adam", "grad_clip": 1.0,
                      **train_opts},
        })  # fmt: skip
        dev = torch.device(device)
        model = build_unet(preset, seed=idx)
        data = torch.rand(3000, 1, 32, 32, generator=torch.Generator().manual_seed(idx)) * 2 - 1
        sched = make_train_scheduler(cfg.diffusion)
        gen = torch.Generator().manual_seed(idx)
        rates = {}
        # with reuse, also the per-call path (the rounds with a local term still take it);
        # on the CPU both are the eager loop
        modes = {"steps_per_s": cfg.train}
        if cfg.train.cuda_graph_reuse and dev.type == "cuda":
            modes["percall_steps_per_s"] = cfg.train.model_copy(update={"cuda_graph_reuse": False})
        for name, train in modes.items():
            train_local(model, data, train, sched, gen, steps=3, device=dev)  # warm-up
            barrier.wait(timeout=300)
            t0, steps = time.perf_counter(), 0
            while time.perf_counter() - t0 < seconds:
                steps += train_local(model, data, train, sched, gen, steps=24, device=dev).steps
            rates[name] = steps / (time.perf_counter() - t0)
            barrier.wait(timeout=300)
        model.to(dev)
        n_img = 256 if device != "cpu" else 16
        ddim_sample(model, (n_img, 1, 32, 32), cfg.diffusion, gen, steps=1)  # warm-up
        t0, image_steps = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds / 2:
            ddim_sample(model, (n_img, 1, 32, 32), cfg.diffusion, gen, steps=5)
            image_steps += n_img * 5
        sample_cost = (time.perf_counter() - t0) / image_steps
        queue.put({"worker": idx, **rates, "s_per_image_step": sample_cost})
    except Exception as exc:  # reported to the parent, which stops
        queue.put({"worker": idx, "error": f"{type(exc).__name__}: {exc}"})


def calibrate(
    preset: str, batch: int, train_opts: dict[str, Any], jobs: int, seconds: float, device: str
) -> dict[str, Any]:
    """Rates of ``jobs`` processes training and sampling ``preset`` at once (the slowest's)."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(jobs), ctx.Queue()
    procs = [
        ctx.Process(target=_calibrate_worker,
                    args=(i, preset, batch, train_opts, seconds, device, barrier, queue))
        for i in range(jobs)
    ]  # fmt: skip
    for p in procs:
        p.start()
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + 240 + 2 * seconds
    while len(results) < jobs and time.monotonic() < deadline:
        try:
            results.append(queue.get(timeout=1.0))
        except queue_mod.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                barrier.abort()  # a worker died without reporting (its traceback is on stderr)
                break
            continue
        if "error" in results[-1]:
            barrier.abort()  # the others stop waiting for it
            break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    errors = [r["error"] for r in results if "error" in r]
    if errors or len(results) < jobs:
        raise RuntimeError(f"calibration failed: {errors or 'a worker did not report in time'}")
    rates = {k: min(r[k] for r in results) for k in results[0] if k.endswith("steps_per_s")}
    return {
        "jobs": jobs,
        "workers": results,
        **rates,
        "s_per_image_step": max(r["s_per_image_step"] for r in results),
    }


#: the comparison's methods, in the order :func:`compare_toml` writes them
METHODS = ("FedAvg", "FedAvg (E=1)", "FedPhD", "FedPhD (OS)", "FedDiffuse (USPLIT)", "SCAFFOLD")
#: device rounds that capture per call although ``train.cuda_graph_reuse`` is on (a local
#: term), per method, for ``r`` FedAvg (E = 5) rounds: FedPhD's R_s = 5 sparse rounds (its
#: group penalty; FedPhD (OS) prunes at r = 0 and trains no sparse round) and SCAFFOLD's
#: every round (its correction hook)
PER_CALL_ROUNDS: dict[str, Callable[[int], int]] = {
    "FedPhD": lambda r: 5 * DEVICES_PER_ROUND,
    "SCAFFOLD": lambda r: r * DEVICES_PER_ROUND,
}


def plan(cal: dict[str, Any], budget_s: float, *, num_samples: int, sample_steps: int,
         max_rounds: int, methods: Sequence[str] = METHODS) -> dict[str, Any]:  # fmt: skip
    """The largest FedAvg (E = 5) round count whose predicted time fits ``FILL x budget_s``.

    Every method trains ``r x 480`` local steps at the calibrated rate of 24-step rounds.
    With a resident capture (``percall_steps_per_s`` calibrated beside ``steps_per_s``) the
    rounds that still capture per call (:data:`PER_CALL_ROUNDS`) add the difference, a
    capture's fixed cost, each; the slowest of ``methods`` sets the time. One model is
    evaluated per evaluation point: none of :data:`METHODS` keeps local parts on its
    devices (FedDiffuse's USPLIT federates every part), so ``eval.clients`` adds no
    client-level evaluations to any of them."""
    steps_per_e5_round = DEVICES_PER_ROUND * 5 * 24
    eval_s = num_samples * sample_steps * cal["s_per_image_step"] + EVAL_OVERHEAD_S
    rate = cal["steps_per_s"]
    per_call = max(0.0, 24 / cal.get("percall_steps_per_s", rate) - 24 / rate)

    def predict(r: int) -> tuple[float, int]:
        every = max(1, r // 4)
        n_eval = r // every
        calls = max((PER_CALL_ROUNDS[m](r) for m in methods if m in PER_CALL_ROUNDS), default=0)
        t = (STARTUP_S + r * steps_per_e5_round / rate + calls * per_call
             + n_eval * eval_s + 5 * r * ROUND_OVERHEAD_S)  # fmt: skip
        return t, every

    def entry(r: int) -> dict[str, Any]:
        t, every = predict(r)
        return {"rounds_e5": r, "eval_every_e5": every, "predicted_s": t, "eval_s_each": eval_s}

    best = entry(2)  # the shortest comparison, even where nothing fits
    for r in range(3, max_rounds + 1):
        if (e := entry(r))["predicted_s"] <= FILL * budget_s:
            best = e
    return best


def compare_toml(p: dict[str, Any], *, preset: str, batch: int, lr: float, num_samples: int,
                 num_reference: int, sample_steps: int, clients: int) -> str:  # fmt: skip
    """The comparison's TOML for plan ``p`` (see the module docstring)."""
    r5, k5 = p["rounds_e5"], p["eval_every_e5"]
    e5 = (f'"run.rounds" = {r5}, "train.local_epochs" = 5, "eval.every" = {k5}, '
          f'"eval.sample_every" = {k5}')  # fmt: skip
    fedphd = ('"algorithm.name" = "fedphd", "federation.assignment" = "select", '
              '"federation.cloud_every" = 5, "federation.sh_a" = 18000.0, '
              '"federation.sh_b" = 0.0, "algorithm.fedphd.prune_ratio" = 0.44, '
              '"algorithm.fedphd.prune_method" = "l2"')  # fmt: skip
    return f"""# Written by benchmarks/gpu/gpu_compare.py from a calibration on this machine: {p}
# FedPhD's comparison (Tables I and IV): N = 20 devices with 2 Fashion-MNIST classes each,
# N_e = 2 edges, kappa = 0.2 (C = 4 per round), r_g = 5 (FedPhD), r_e = 1, batch {batch}, Adam.
# Equal local computation: the E = 5 methods run {r5} rounds, the E = 1 methods {5 * r5}.

[compare]
name = "compare-gpu-budget"
reference = "FedAvg"
d_e = 1.0
d_c = 10.0

[base.run]
seed = 0
rounds = {5 * r5}

[base.federation]
num_devices = 20
num_edges = 2
participation = 0.2
edge_every = 1
cloud_every = 1
min_updates = 1
round_deadline_s = 3600

[base.data]
dataset = "fashion-mnist"
partition = "classes"
classes_per_device = 2

[base.model]
preset = "{preset}"

[base.diffusion]
num_train_timesteps = 1000
beta_start = 1e-4
beta_end = 0.02
sample_steps = {sample_steps}
eta = 0.0

[base.train]
local_epochs = 1
batch_size = {batch}
lr = {lr}
optimizer = "adam"
grad_clip = 1.0

[base.algorithm]
name = "fedavg"

[base.eval]
every = {5 * k5}
sample_every = {5 * k5}
num_samples = {num_samples}
num_reference = {num_reference}
sample_steps = {sample_steps}
checkpoint_every = 0
clients = {clients}

[[method]]
label = "FedAvg"
overrides = {{"algorithm.name" = "fedavg", {e5}}}

[[method]]
label = "FedAvg (E=1)"
overrides = {{"algorithm.name" = "fedavg"}}

[[method]]
label = "FedPhD"
overrides = {{{fedphd}, "algorithm.fedphd.sparse_rounds" = 5, "algorithm.fedphd.lambda0" = 1e-4, "algorithm.fedphd.prune_at" = "sparse"}}

[[method]]
label = "FedPhD (OS)"
overrides = {{{fedphd}, "algorithm.fedphd.prune_at" = "init"}}

[[method]]
label = "FedDiffuse (USPLIT)"
overrides = {{"algorithm.name" = "feddiffuse", "algorithm.split" = "usplit", {e5}}}

[[method]]
label = "SCAFFOLD"
overrides = {{"algorithm.name" = "scaffold", {e5}}}
"""  # noqa: E501


def keep_methods(toml: str, labels: list[str]) -> str:
    """``toml`` with only the ``[[method]]`` tables of ``labels`` (FedAvg, the reference,
    must be among them)."""
    unknown = sorted(set(labels) - set(METHODS))
    if unknown or "FedAvg" not in labels:
        raise SystemExit(f"--methods: {unknown or 'FedAvg (the reference) is missing'}; "
                         f"choose from {', '.join(METHODS)}")  # fmt: skip
    head, *tables = toml.split("\n[[method]]\n")
    kept = [t for t in tables if t.split("\n", 1)[0] in {f'label = "{x}"' for x in labels}]
    return "\n[[method]]\n".join([head, *kept])


def run_compare(toml: Path, out: Path, jobs: int, deadline: float, log: Path) -> int | None:
    """``estuary compare --jobs`` until it ends or ``deadline`` (monotonic): its exit status,
    or None when it was stopped at the deadline."""
    cmd = [sys.executable, "-m", "estuary", "compare", str(toml), "--out", str(out),
           "--jobs", str(jobs), "--fresh"]  # fmt: skip
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)  # fmt: skip
        while proc.poll() is None:
            if time.monotonic() >= deadline:
                os.killpg(proc.pid, signal.SIGTERM)  # the parent stops its jobs too
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
                return None
            time.sleep(1.0)
    return proc.returncode


def pack(out: Path, compare_dir: Path, extra: list[Path]) -> Path:
    """Tables, plots, per-method metrics and logs, and each method's last grid, in one file."""
    keep = {"table.md", "table.json", "table.csv", "quality.png", "bytes.png", "metrics.jsonl",
            "summary.json", "method.json", "compare.log", "config.json", "report.png",
            "label_counts.csv"}  # fmt: skip
    tar_path = out / "gpu_compare.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        for path in sorted(compare_dir.rglob("*")):
            if path.is_file() and path.name in keep:
                tar.add(path, arcname=str(path.relative_to(compare_dir.parent)))
        for samples in sorted(compare_dir.glob("*/samples")):
            grids = sorted(samples.glob("*.png"))
            if grids:
                tar.add(grids[-1], arcname=str(grids[-1].relative_to(compare_dir.parent)))
        for path in extra:
            if path.is_file():
                tar.add(path, arcname=path.name)
    return tar_path


def main() -> int:
    """Calibrate, size, compare, pack."""
    t_start = time.monotonic()
    # the project without an install (a GPU machine that only has the wheels): here, in the
    # calibration processes (spawn hands them this sys.path) and the comparison's processes
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.getenv("PYTHONPATH")]))
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=480.0,
        help="wall-clock seconds for everything, this script's start to its end",
    )
    ap.add_argument("--out", required=True, help="directory for the packed results")
    ap.add_argument("--work", default="runs/compare-gpu-budget", help="comparison directory")
    ap.add_argument("--jobs", type=int, default=0, help="methods at once (0: all of them)")
    ap.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated labels to run (FedAvg is the reference; default: all six)",
    )
    ap.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="train.precision of every method (bf16: autocast, GPUs from Ampere on)",
    )
    ap.add_argument(
        "--cuda-graph",
        action="store_true",
        help="train.cuda_graph for every method: each local round's step captured once and "
        "replayed (shared/diffusion/cuda_graph.py; run `pytest -m gpu tests/test_graphed.py` "
        "first)",
    )
    ap.add_argument(
        "--graph-reuse",
        action="store_true",
        help="with --cuda-graph, train.cuda_graph_reuse too: rounds without a local term "
        "replay one capture kept across rounds (run `pytest -m gpu tests/test_graphed.py -k "
        "resident` first)",
    )
    ap.add_argument(
        "--preset",
        choices=["fmnist-small", "fmnist-tiny"],
        default="fmnist-small",
        help="the U-Net every method trains (fmnist-tiny: 13x fewer parameters, 16x fewer "
        "MACs, so many more steps fit a budget; --dry-run always uses fmnist-tiny)",
    )
    ap.add_argument("--calibrate-s", type=float, default=8.0)
    ap.add_argument("--max-rounds", type=int, default=60, help="cap on FedAvg (E=5) rounds")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="the same pipeline on the CPU with fmnist-tiny, small batches",
    )
    args = ap.parse_args()  # fmt: skip
    out, work = Path(args.out), ROOT / args.work
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    deadline = t_start + args.budget_s
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    keep_methods("", methods)  # check the labels before any work
    args.jobs = args.jobs or len(methods)
    os.environ["ESTUARY__TRAIN__PRECISION"] = args.precision  # every method, every process
    if args.graph_reuse and not args.cuda_graph:
        raise SystemExit("--graph-reuse needs --cuda-graph")
    os.environ["ESTUARY__TRAIN__CUDA_GRAPH"] = "true" if args.cuda_graph else "false"
    os.environ["ESTUARY__TRAIN__CUDA_GRAPH_REUSE"] = "true" if args.graph_reuse else "false"
    train_opts = {"precision": args.precision, "cuda_graph": args.cuda_graph,
                  "cuda_graph_reuse": args.graph_reuse}  # fmt: skip
    info: dict[str, Any] = {
        "budget_s": args.budget_s,
        "jobs": args.jobs,
        "methods": methods,
        "precision": args.precision,
        "cuda_graph": args.cuda_graph,
        "cuda_graph_reuse": args.graph_reuse,
    }

    import torch

    if args.dry_run:
        device, preset, batch, samples, ref, steps, clients = (
            "cpu", "fmnist-tiny", 128, 50, 200, 5, 1)  # fmt: skip
        os.environ["ESTUARY__DATA__MAX_SAMPLES_PER_DEVICE"] = "128"
        os.environ["ESTUARY__COMPUTE__DEVICE"] = "cpu"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --dry-run for the CPU rehearsal", file=sys.stderr)
            return 2
        device, preset, batch, samples, ref, steps, clients = (
            "cuda", args.preset, 128, 1000, 10000, 50, 2)  # fmt: skip
        info["gpu"] = torch.cuda.get_device_name(0)
    info["preset"] = preset
    info["torch"] = torch.__version__
    print(f"[gpu_compare] {info}", flush=True)

    try:
        cal = calibrate(preset, batch, train_opts, args.jobs, args.calibrate_s, device)
    except Exception as exc:  # a cautious guess: the comparison's own log then says more
        print(f"[gpu_compare] {exc}; planning from a guess", file=sys.stderr, flush=True)
        cal = {"jobs": args.jobs, "error": str(exc), "steps_per_s": 10.0,
               "s_per_image_step": 5e-5 if device != "cpu" else 5e-3}  # fmt: skip
    info["calibration"] = cal
    print(f"[gpu_compare] calibration: {cal['steps_per_s']:.1f} steps/s and "
          f"{cal['s_per_image_step'] * 1e6:.1f} us per image-step per process, "
          f"{args.jobs} at once", flush=True)  # fmt: skip
    reserve = 25.0  # stopping, packing
    compare_budget = deadline - time.monotonic() - reserve
    p = plan(cal, compare_budget, num_samples=samples, sample_steps=steps,
             max_rounds=2 if args.dry_run else args.max_rounds, methods=methods)  # fmt: skip
    info["plan"] = p
    print(f"[gpu_compare] plan: {p} within {compare_budget:.0f} s", flush=True)
    toml = work / "compare.toml"
    text = compare_toml(p, preset=preset, batch=batch, lr=5e-4, num_samples=samples,
                        num_reference=ref, sample_steps=steps, clients=clients)  # fmt: skip
    toml.write_text(keep_methods(text, methods))
    log = work / "compare-parent.log"
    t0 = time.monotonic()
    rc = run_compare(toml, work, args.jobs, deadline - reserve, log)
    info["compare_rc"] = rc
    info["compare_s"] = time.monotonic() - t0
    print(f"[gpu_compare] compare {'stopped at the deadline' if rc is None else f'rc {rc}'} "
          f"after {info['compare_s']:.0f} s", flush=True)  # fmt: skip
    (work / "gpu_compare.json").write_text(json.dumps(info, indent=2))
    tar = pack(out, work, [toml, log, work / "gpu_compare.json"])
    table = work / "table.md"
    if table.is_file():
        (out / "table.md").write_text(table.read_text())
        print(table.read_text(), flush=True)
    print(f"[gpu_compare] packed {tar} ({tar.stat().st_size / 2**20:.1f} MiB) after "
          f"{time.monotonic() - t_start:.0f} s", flush=True)  # fmt: skip
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
