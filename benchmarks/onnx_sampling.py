"""Images/s of on-device sampling: ONNX Runtime + the numpy DDIM loop against PyTorch eager +
diffusers' DDIMScheduler, on the same model, batch and step count, in one run.

Four contenders per run: torch dense, ORT dense, ORT pruned (s_p = 0.44 by L2 group norm),
and torch pruned for reference. Rounds alternate between them (dense torch, dense ORT,
pruned ORT, pruned torch, dense torch, ...) so drift on a shared machine hits all; every
figure is the median over ``--repeats`` rounds, and ratios are medians of per-round ratios.
Both runtimes get the same thread count. Before timing, each model is trained for a few
steps and exported through the parity gate, and the parity figures (max abs error of ONNX
Runtime against torch, random inputs and a whole DDIM trajectory) are reported too.

    python benchmarks/onnx_sampling.py --preset fmnist-small --batch 16 --steps 20 \
        --repeats 5 --out benchmarks/results/onnx_sampling_cpu.json
    # on a GPU machine (CUDA provider vs torch on CUDA):
    python benchmarks/onnx_sampling.py --device cuda --preset ddpm-cifar10 --batch 64 \
        --steps 50 --repeats 5 --out benchmarks/results/onnx_sampling_cuda.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from shared.config import config_from_dict
from shared.data.datasets import load_dataset, to_model_input
from shared.deploy.export import export_module
from shared.deploy.onnx_sampler import OnnxGenerator
from shared.diffusion.schedule import ddim_sample, make_train_scheduler
from shared.diffusion.training import train_local
from shared.models.plan import ChannelPlan
from shared.models.presets import build_unet, count_params
from shared.models.pruning import prune_unet


def prepare(preset: str, sp: float, train_steps: int, out: Path) -> tuple[nn.Module, dict]:
    """``preset`` (pruned by ``sp``), trained ``train_steps`` steps, exported to ``out``."""
    cfg = config_from_dict(
        {
            "model": {"preset": preset},
            "train": {"local_steps": max(1, train_steps), "batch_size": 16, "lr": 2e-3},
        }
    )
    model = build_unet(preset, seed=0)
    if sp:
        model = prune_unet(model, sp)
    if train_steps:
        data = load_dataset("fashion-mnist" if preset.startswith("fmnist") else "synthetic")
        x = to_model_input(data.images[:2048])
        if x.shape[1] != model.config.in_channels:  # RGB preset on grey data: repeat
            x = x.repeat(1, model.config.in_channels, 1, 1)
        gen = torch.Generator().manual_seed(0)
        labels = torch.from_numpy(data.labels[:2048]).long()
        train_local(model, x, cfg.train, make_train_scheduler(cfg.diffusion), gen, labels=labels)
    model.eval()
    plan = ChannelPlan.of_module(model, preset=preset) if sp else None
    result = export_module(cfg, model, plan, out, round_=None, source="benchmark",
                           threshold=1e-4, parity_steps=20)  # fmt: skip
    return model, {"params": count_params(model), "card": result.card,
                   "parity": result.parity.to_dict()}  # fmt: skip


def time_torch(model: nn.Module, noise: torch.Tensor, steps: int, device: str) -> float:
    """Seconds for one DDIM batch in PyTorch eager (diffusers' scheduler)."""
    cfg = config_from_dict({})
    x = noise.to(device)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    ddim_sample(model, tuple(x.shape), cfg.diffusion, torch.Generator(), steps=steps,
                batch_size=x.shape[0], noise=x)  # fmt: skip
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def time_ort(gen: OnnxGenerator, noise: np.ndarray, steps: int) -> float:
    """Seconds for one DDIM batch in ONNX Runtime + the numpy loop."""
    _, stats = gen.sample(noise.shape[0], steps=steps, batch_size=noise.shape[0], noise=noise)
    return stats.seconds


def main() -> None:
    """Run the comparison and print / write the medians."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="fmnist-small")
    ap.add_argument("--sp", type=float, default=0.44, help="fraction of parameters pruned")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="0 = torch's default")
    ap.add_argument("--train-steps", type=int, default=40, help="training before export")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--out", help="JSON results file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    provider = "cuda" if args.device == "cuda" else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        dense, dense_info = prepare(args.preset, 0.0, args.train_steps, Path(tmp) / "dense")
        pruned, pruned_info = prepare(args.preset, args.sp, args.train_steps, Path(tmp) / "p")
        ort_dense = OnnxGenerator(Path(tmp) / "dense" / "model.onnx", dense_info["card"],
                                  provider=provider, threads=threads)  # fmt: skip
        ort_pruned = OnnxGenerator(Path(tmp) / "p" / "model.onnx", pruned_info["card"],
                                   provider=provider, threads=threads)  # fmt: skip
    dense.to(args.device)
    pruned.to(args.device)
    noise = ort_dense.noise(args.batch, seed=0)
    noise_t = torch.from_numpy(noise)
    runs: dict[str, Any] = {
        "torch_dense": lambda: time_torch(dense, noise_t, args.steps, args.device),
        "ort_dense": lambda: time_ort(ort_dense, noise, args.steps),
        "ort_pruned": lambda: time_ort(ort_pruned, noise, args.steps),
        "torch_pruned": lambda: time_torch(pruned, noise_t, args.steps, args.device),
    }
    with torch.no_grad():
        for fn in runs.values():  # warm-up: allocators, ORT arenas, cuDNN autotuning
            fn()
        times: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(args.repeats):
            for name, fn in runs.items():
                times[name].append(fn())
            print(f"round {r + 1}/{args.repeats}: " + ", ".join(
                f"{k} {args.batch / v[-1]:.2f} img/s" for k, v in times.items()))  # fmt: skip
    ips = {k: args.batch / statistics.median(v) for k, v in times.items()}

    def ratio(a: str, b: str) -> float:
        return statistics.median(tb / ta for ta, tb in zip(times[a], times[b], strict=True))

    result = {
        "preset": args.preset, "sp": args.sp, "batch": args.batch, "steps": args.steps,
        "repeats": args.repeats, "threads": threads, "device": args.device,
        "providers": ort_dense.providers,
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
        "params": {"dense": dense_info["params"], "pruned": pruned_info["params"]},
        "macs": {"dense": dense_info["card"]["macs"], "pruned": pruned_info["card"]["macs"]},
        "parity": {"dense": dense_info["parity"], "pruned": pruned_info["parity"]},
        "images_per_s_median": {k: round(v, 3) for k, v in ips.items()},
        "ratio_ort_pruned_vs_torch_dense": round(ratio("ort_pruned", "torch_dense"), 3),
        "ratio_ort_dense_vs_torch_dense": round(ratio("ort_dense", "torch_dense"), 3),
        "ratio_torch_pruned_vs_torch_dense": round(ratio("torch_pruned", "torch_dense"), 3),
        "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
    }  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "seconds"}, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
