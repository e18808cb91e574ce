"""What pFedGPA's inversion keeps of each device's upload, scored offline on a finished run.

    python benchmarks/pfedgpa_inversion.py RUN_DIR --out OUT [--direct-run DIRECT_DIR]

RUN_DIR is a pFedGPA run that generated the whole model (``algorithm.pfedgpa.layers = ["*"]``), e.g.
``OUT/seed0-fork/pfedgpa`` of ``benchmarks/pfedgpa_seeds.sh``: its cloud kept the uploads
(``checkpoints/pfedgpa/store.safetensors``) and the diffusion model it trained before the
final round (``dm.safetensors``). From them, for every device, on its own test split:

- the depth sweep: accuracy before fine-tuning of the device's upload (the identity), the
  autoencoder's reconstruction (t0 = 0), the inversion (eq. 15) from each depth t0, the
  exact posterior-noise inversion from T, direct generation, and the average of the uploads
  (FedAvg's global model); after fine-tuning (one LocalUpdate, the run's settings, the same
  batch order for every row); the devices under 60 %. The diffusion model, the inversion
  noise and the generation noise are the ones the cloud drew (seeded by round), so the row
  of the run's own mode and depth reproduces its devices' "before FT" exactly (checked);
- the swap table: device i's accuracy with device j's upload, for j = i, j in i's group of
  dominant classes, j in a group sharing one class, j in a group sharing none;
- what the diffusion model learned: the 20 generated models against the 20 last uploads
  (accuracy on the best-served device, on average over devices, which group they serve,
  distance to the nearest stored vector).

Writes OUT/inversion.{md,json} and OUT/depth_sweep.png.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from device_agent.main import device_data, device_test_data
from shared import seeds
from shared.config import RunConfig, load_config
from shared.data.datasets import to_model_input
from shared.diffusion.training import train_classifier
from shared.methods.aggregation import fedavg
from shared.methods.pfedgpa.config import PFedGPAConfig
from shared.methods.pfedgpa.method import STATE_DIR, dm_seed
from shared.methods.pfedgpa.param_diffusion import (
    ParamDM,
    generate,
    invert,
    kept_signal,
    unflatten_params,
)
from shared.models.classifier import accuracy, build_classifier
from shared.naming import device_name
from shared.wire.codec import decode_tensors

#: the depths of the sweep (diffusion steps t0 of T = 1000); 0 is the autoencoder
DEPTHS = (1000, 500, 300, 200, 100)
UNDER = 0.6


def load_store(run: Path) -> tuple[dict[tuple[int, str], torch.Tensor], ParamDM]:
    """The cloud's stored uploads, by (round, device), and its last diffusion model."""
    folder = run / "checkpoints" / STATE_DIR
    tensors = decode_tensors((folder / "store.safetensors").read_bytes())
    store = {(int(k.split("/")[0]), k.split("/", 1)[1]): v for k, v in tensors.items()}
    return store, ParamDM.load(folder / "dm.safetensors")


class Devices:
    """Each device's training and test split (the run's own split, rebuilt from its config)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.names = [device_name(i) for i in range(cfg.federation.num_devices)]
        channels = cfg.data.input_channels
        self.train, self.test = [], []
        for i in range(len(self.names)):
            d, t = device_data(cfg, i), device_test_data(cfg, i)
            if t is None:
                raise SystemExit("the run's devices have no test splits")
            self.train.append((to_model_input(d.images, channels), torch.from_numpy(d.labels)))
            self.test.append((to_model_input(t.images, channels), torch.from_numpy(t.labels)))
        groups = cfg.data.dominant_groups
        self.group = [i % len(groups) for i in range(len(self.names))]
        self.shared = [[len(set(groups[a]) & set(groups[b])) for b in range(len(groups))]
                       for a in range(len(groups))]  # fmt: skip

    def model(self, vector: torch.Tensor, dm: ParamDM) -> torch.nn.Module:
        """A classifier of the run's preset holding ``vector`` (every parameter)."""
        model = build_classifier(self.cfg.model.preset)
        model.load_state_dict(unflatten_params(vector, dm.names, dm.shapes))
        return model

    def scores(self, vectors: torch.Tensor, dm: ParamDM) -> list[float]:
        """Device i's accuracy with ``vectors[i]`` on its own test split."""
        return [accuracy(self.model(v, dm), *self.test[i]) for i, v in enumerate(vectors)]

    def fine_tuned(self, vectors: torch.Tensor, dm: ParamDM, seed: int) -> list[float]:
        """Device i's accuracy after one LocalUpdate from ``vectors[i]`` (the batch order
        drawn from (seed, i), the same for every row of the sweep)."""
        out = []
        for i, v in enumerate(vectors):
            model = self.model(v, dm)
            gen = torch.Generator().manual_seed(seeds.integer("pfedgpa.sweep", seed, device=i))
            train_classifier(model, *self.train[i], self.cfg.train, gen)
            out.append(accuracy(model, *self.test[i]))
        return out


def summary(acc: list[float]) -> dict[str, Any]:
    """Mean and sd over devices (points), devices under 60 %, the per-device figures."""
    return {
        "mean": 100 * statistics.fmean(acc),
        "sd": 100 * statistics.pstdev(acc),
        "under_60": sum(a < UNDER for a in acc),
        "per_device": acc,
    }


def swap_table(devs: Devices, uploads: torch.Tensor, dm: ParamDM) -> dict[str, Any]:
    """Device i's accuracy with device j's upload, averaged by how their groups relate."""
    models = [devs.model(v, dm) for v in uploads]
    n = len(models)
    acc = [[accuracy(models[j], *devs.test[i]) for j in range(n)] for i in range(n)]
    cells: dict[str, list[float]] = {"own": [], "same group": [], "groups share one class": [],
                                     "groups share no class": []}  # fmt: skip
    for i in range(n):
        for j in range(n):
            gi, gj = devs.group[i], devs.group[j]
            if i == j:
                key = "own"
            elif gi == gj:
                key = "same group"
            else:
                shared = devs.shared[gi][gj]
                key = "groups share one class" if shared == 1 else "groups share no class"
                if shared not in (0, 1):
                    key = f"groups share {shared} classes"
                    cells.setdefault(key, [])
            cells[key].append(acc[i][j])
    return {
        "matrix": acc,
        "cells": {k: {"mean": 100 * statistics.fmean(v), "sd": 100 * statistics.pstdev(v),
                      "pairs": len(v), "under_60": sum(a < UNDER for a in v)}
                  for k, v in cells.items() if v},
    }  # fmt: skip


def diagnostic(
    devs: Devices,
    dm: ParamDM,
    generated: torch.Tensor,
    uploads: torch.Tensor,
    store: torch.Tensor,
) -> dict[str, Any]:
    """What the parameter model learned: generated models against the last uploads."""

    def profile(vectors: torch.Tensor) -> dict[str, Any]:
        per = [[accuracy(devs.model(v, dm), *devs.test[i]) for i in range(len(devs.names))]
               for v in vectors]  # fmt: skip
        best = [max(row) for row in per]
        served = [devs.group[int(np.argmax(row))] for row in per]
        return {
            "best_device_mean": 100 * statistics.fmean(best),
            "best_device_min": 100 * min(best),
            "all_devices_mean": 100 * statistics.fmean(statistics.fmean(r) for r in per),
            "groups_served": [served.count(g) for g in range(max(devs.group) + 1)],
        }

    norm = dm.normalizer
    s = norm.normalize(store)
    d_gen = torch.cdist(norm.normalize(generated), s).min(dim=1).values
    dist_store = torch.cdist(s, s)
    dist_store.fill_diagonal_(float("inf"))
    d_store = dist_store.min(dim=1).values
    d_mean = (s - s.mean(dim=0)).norm(dim=1)
    with torch.no_grad():
        recon = dm.autoencoder(s)
    return {
        "generated": profile(generated),
        "uploads": profile(uploads),
        "nn_distance_generated_to_store": float(d_gen.mean()),
        "nn_distance_within_store": float(d_store.mean()),
        "distance_store_to_its_mean": float(d_mean.mean()),
        "ae_normalized_mse": float(((recon - s) ** 2).mean()),
    }


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Every row, the swap table and the diagnostic of one run."""
    run: Path = args.run
    cfg = load_config(run / "config.json", env={})
    settings = cfg.algorithm.settings_of("pfedgpa")
    if not isinstance(settings, PFedGPAConfig) or list(settings.layers) != ["*"]:
        raise SystemExit(f"{run}: the diffusion model did not generate the whole model "
                         "(algorithm.pfedgpa.layers = ['*'])")  # fmt: skip
    store, dm = load_store(run)
    dm_bytes = (run / "checkpoints" / STATE_DIR / "dm.safetensors").read_bytes()
    # the cloud trains before the final round and inverts that round's uploads
    dm_round = cfg.run.rounds - 2
    if settings.dm_every or dm_round not in {r for r, _ in store}:
        raise SystemExit(f"{run}: no diffusion model of round {dm_round} (the one before the "
                         "last, algorithm.pfedgpa.dm_every = 0) with its uploads")  # fmt: skip
    devs = Devices(cfg)
    uploads = torch.stack([store[(dm_round, d)] for d in devs.names])
    history = torch.stack([v for (r, _), v in sorted(store.items()) if r <= dm_round])
    seed = cfg.run.seed
    T = dm.betas.shape[0]
    rows: dict[str, torch.Tensor] = {"identity (own upload)": uploads}
    rows["autoencoder (t0 = 0)"] = invert(dm, uploads, dm_seed(seed, dm_round, 2), t0=0)
    for t0 in args.depths:
        rows[f"inversion t0 = {t0}"] = invert(dm, uploads, dm_seed(seed, dm_round, 2), t0=t0)
    rows[f"posterior inversion t0 = {T}"] = invert(
        dm, uploads, dm_seed(seed, dm_round, 2), t0=T, noise="posterior"
    )
    rows["direct generation"] = generate(dm, len(uploads), dm_seed(seed, dm_round, 2))
    global_model = fedavg(
        [unflatten_params(v, dm.names, dm.shapes) for v in uploads],
        [len(x) for x, _ in devs.train],
    )
    rows["average of the uploads (FedAvg)"] = torch.cat(
        [global_model[n].reshape(-1) for n in dm.names]
    ).expand(len(uploads), -1)
    results: dict[str, Any] = {}
    for label, vectors in rows.items():
        t = time.perf_counter()
        before = summary(devs.scores(vectors, dm))
        after = summary(devs.fine_tuned(vectors, dm, seed)) if args.fine_tune else None
        # in the store's standardized coordinates: how the deviations from its mean align
        corr = float(torch.nn.functional.cosine_similarity(
            dm.normalizer.normalize(vectors), dm.normalizer.normalize(uploads), dim=1
        ).mean())  # fmt: skip
        results[label] = {"before": before, "after": after, "cosine_to_upload": corr}
        print(f"{label}: before {before['mean']:.2f} ({before['under_60']} < 60 %)"
              + (f", after {after['mean']:.2f}" if after else "")
              + f"; cosine to the upload {corr:.3f} ({time.perf_counter() - t:.0f}s)",
              flush=True)  # fmt: skip
    check = run_check(run, settings, T, results)
    return {
        "run": str(run), "seed": seed, "preset": cfg.model.preset, "dm_round": dm_round,
        "devices": len(devs.names),
        "dm_sha256": hashlib.sha256(dm_bytes).hexdigest(), "T": T,
        "kept_signal": {str(t0): kept_signal(dm.betas, t0) for t0 in (0, *args.depths)},
        "dm_config": dm.meta()["config"], "rows": results, "run_check": check,
        "swap": swap_table(devs, uploads, dm),
        "diagnostic": diagnostic(devs, dm, rows["direct generation"], uploads, history),
    }  # fmt: skip


def run_check(
    run: Path, settings: PFedGPAConfig, T: int, results: dict[str, Any]
) -> dict[str, Any]:
    """The run's own "before FT" per device against this script's row of its mode."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    last = [json.loads(line) for line in lines][-1]["accuracy"]
    if settings.mode == "generation":
        label = "direct generation"
    elif settings.inversion == "posterior":
        label = f"posterior inversion t0 = {T}"
    else:
        label = f"inversion t0 = {settings.invert_from}"
    if label not in results:
        return {"row": label, "checked": False}
    run_before = [last["per_device"][d][0] for d in sorted(last["per_device"])]
    mine = results[label]["before"]["per_device"]
    return {"row": label, "checked": True, "max_abs_diff": max(
        abs(a - b) for a, b in zip(run_before, mine, strict=True)
    ), "run_before_mean": 100 * statistics.fmean(run_before)}  # fmt: skip


def table_md(doc: dict[str, Any]) -> str:
    """The sweep, the swap table and the diagnostic as markdown."""
    rows = doc["rows"]
    out = [
        f"Run {doc['run']} (seed {doc['seed']}, {doc['preset']}); diffusion model trained "
        f"before the final round on the stored uploads, T = {doc['T']}. Mean accuracy (%) of "
        f"the {doc['devices']} devices on their own test splits; after FT = one LocalUpdate.",
        "",
        "| row | kept signal sqrt(abar_t0) | cosine to the upload | before FT | devices < 60 % "
        "| after FT | devices < 60 % after |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, r in rows.items():
        t0 = label.rsplit("= ", 1)[-1].rstrip(")") if "t0 =" in label else None
        kept = "" if t0 is None or "posterior" in label else f"{doc['kept_signal'][t0]:.3f}"
        b, a = r["before"], r["after"]
        after = "—" if a is None else f"{a['mean']:.2f} ± {a['sd']:.2f} | {a['under_60']}"
        out.append(f"| {label} | {kept} | {r['cosine_to_upload']:.3f} | {b['mean']:.2f} ± "
                   f"{b['sd']:.2f} | {b['under_60']} | {after} |")  # fmt: skip
    c = doc["run_check"]
    if c.get("checked"):
        out += [
            "",
            f"The run's own devices before FT ({c['row']}): {c['run_before_mean']:.2f}; "
            f"largest per-device difference from this row {c['max_abs_diff']:.4f}.",
        ]
    out += [
        "",
        "Device i with device j's upload (before FT):",
        "",
        "| pairs | mean (%) | sd | pairs | pairs < 60 % |",
        "|---|---|---|---|---|",
    ]
    for k, v in doc["swap"]["cells"].items():
        out.append(f"| {k} | {v['mean']:.2f} | {v['sd']:.2f} | {v['pairs']} | {v['under_60']} |")
    g = doc["diagnostic"]
    out += ["", f"What the parameter model learned ({doc['devices']} generated models against "
            f"the {doc['devices']} uploads of its last stored round):", "",
            "| | best-served device (mean / min) | mean over all devices | groups served |",
            "|---|---|---|---|"]  # fmt: skip
    for k in ("uploads", "generated"):
        p = g[k]
        out.append(
            f"| {k} | {p['best_device_mean']:.2f} / {p['best_device_min']:.2f} | "
            f"{p['all_devices_mean']:.2f} | {p['groups_served']} |"
        )
    out += [
        "",
        f"Normalized distances: generated to the nearest stored upload "
        f"{g['nn_distance_generated_to_store']:.1f}, a stored upload to its nearest other "
        f"{g['nn_distance_within_store']:.1f}, a stored upload to the store's mean "
        f"{g['distance_store_to_its_mean']:.1f}; the autoencoder's normalized MSE on the "
        f"store {g['ae_normalized_mse']:.3f} (1 = predicting the mean).",
    ]
    return "\n".join(out) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """Accuracy before FT against the start depth, with the identity, the autoencoder,
    direct generation and the average as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    depths = [int(k.split("= ")[1]) for k in rows if k.startswith("inversion t0")]
    fig, ax = plt.subplots(figsize=(7, 4))
    ys = [rows[f"inversion t0 = {t}"]["before"]["mean"] for t in depths]
    ax.plot(depths, ys, "o-", color="tab:blue", label="inversion (eq. 15) from t0")
    for label, color in (("identity (own upload)", "black"), ("autoencoder (t0 = 0)", "tab:green"),
                         ("direct generation", "tab:red"),
                         ("average of the uploads (FedAvg)", "tab:gray")):  # fmt: skip
        ax.axhline(rows[label]["before"]["mean"], color=color, ls="--", lw=1, label=label)
    ax.set_xlabel("start depth t0 (diffusion steps of T = 1000)")
    ax.set_ylabel("mean device accuracy before FT (%)")
    ax.set_title(f"pFedGPA inversion depth, seed {doc['seed']}")
    ax.legend(loc="lower left", fontsize=8, frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a pFedGPA run directory (whole-model generation)")
    p.add_argument("--out", type=Path, required=True, help="where the tables go")
    p.add_argument("--depths", type=int, nargs="+", default=list(DEPTHS))
    p.add_argument(
        "--no-fine-tune", dest="fine_tune", action="store_false", help="before FT only (faster)"
    )
    p.add_argument(
        "--direct-run",
        type=Path,
        help="the run's direct-generation twin: its diffusion model must be the same",
    )
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.direct_run is not None:
        a, b = (
            r / "checkpoints" / STATE_DIR / "dm.safetensors" for r in (args.run, args.direct_run)
        )
        if a.read_bytes() != b.read_bytes():
            raise SystemExit(f"{a} and {b} differ: the two arms trained different models")
    doc = sweep(args)
    args.out.mkdir(parents=True, exist_ok=True)
    text = table_md(doc)
    (args.out / "inversion.md").write_text(text)
    (args.out / "inversion.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, args.out / "depth_sweep.png")
    print(text)


if __name__ == "__main__":
    main()
