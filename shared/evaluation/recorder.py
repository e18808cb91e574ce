"""Run directories: the config used, label counts, ``metrics.jsonl`` rows per round, sample
grids and evaluations, written by whoever owns the global model (``estuary simulate`` or the
cloud process).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from shared.atomic import atomic_write
from shared.config import RunConfig
from shared.data.partition import format_label_counts
from shared.diffusion.training import resolve_device
from shared.evaluation.evaluator import Evaluator, write_grid
from shared.evaluation.report import read_metrics
from shared.families import family_of
from shared.models.checkpoint import latest_checkpoint_path
from shared.transport.telemetry import Traffic, diff_counts

log = logging.getLogger(__name__)

UP_KINDS = (
    "device_update", "description", "edge_update", "forwarded_update", "msg_device_update",
    "msg_edge_update", "msg_hello",
)  # fmt: skip

TrafficScope = Literal["all", "cloud"]
"""What a row's ``bytes_up``/``bytes_down`` cover. ``"all"``: one :class:`Traffic` counts every
role (``estuary simulate`` over MemoryBus), so up and down are what all receivers got, on
both tiers. ``"cloud"``: the cloud process's own counters (over MQTT every role counts in its
own process): up is what the cloud received, down what it sent; a blob counts once however
many edges fetch it, since the broker fans the one stream out. Per-role totals, devices and
edges included, are in each role's Prometheus metrics."""


class RunRecorder:
    """Turns round summaries into metrics.jsonl rows, grids and evaluations."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        traffic: Traffic,
        *,
        evaluate: bool,
        resume_after: int | None = None,
        traffic_scope: TrafficScope = "all",
    ) -> None:
        self.cfg = cfg
        self.traffic_scope = traffic_scope
        self.run_dir = run_dir
        self.traffic = traffic
        self.before = traffic.snapshot()
        self.rows: list[dict[str, Any]] = []
        self.model_fn: Callable[[], nn.Module] | None = None  # the current global module
        #: the devices' own models where they differ from the global one (device-local
        #: parts, in-process runs only): evaluated at the client level instead
        self.client_models_fn: Callable[[int], dict[str, nn.Module]] | None = None
        #: where grids and evaluations sample: ``compute.device`` of this process (resolved
        #: only when the run samples at all, so a setting it does not use cannot fail it)
        samples = bool(cfg.eval.sample_every or (evaluate and cfg.eval.every))
        self.device = resolve_device(cfg.compute.device) if samples else torch.device("cpu")
        self.evaluator: Evaluator | None = (
            Evaluator(cfg, self.device) if evaluate and cfg.eval.every else None
        )
        #: a classifier run: judged by the devices' accuracies, never sampled
        self.classifier = family_of(cfg.model.preset).quality == "accuracy"
        if self.classifier:
            self.evaluator = None
        self.bar: tqdm[Any] | None = None
        #: the starting model's grid and quality (:meth:`evaluate_start`), recorded as
        #: ``start`` in the first round's row
        self.start: dict[str, Any] | None = None
        self.metrics_path = run_dir / "metrics.jsonl"
        if resume_after is not None and self.metrics_path.is_file():
            # a restarted cloud keeps the rows up to its checkpoint and redoes the rest
            kept = [r for r in read_metrics(self.metrics_path) if r["round"] <= resume_after + 1]
            self.rows = kept
        atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in self.rows).encode())

    def on_round_end(self, s: Any) -> None:
        """Append one metrics row; sample and evaluate when due."""
        snap = self.traffic.snapshot()
        nbytes = diff_counts(snap["bytes"], self.before["bytes"])
        msgs = diff_counts(snap["messages"], self.before["messages"])
        self.before = snap
        received = {k.split(":", 1)[1]: v for k, v in nbytes.items() if k.startswith("received:")}
        if self.traffic_scope == "cloud":
            down = sum(v for k, v in nbytes.items() if k.startswith("sent:"))
        else:
            down = sum(v for k, v in received.items() if k not in UP_KINDS)
        row: dict[str, Any] = {
            "round": s.round + 1,  # 1-based, as people count (the wire counts from 0)
            "train_loss": s.mean_loss,
            "participants": s.participants,
            "updates": s.updates,
            "cloud_aggregated": s.cloud_aggregated,
            "model_sha256": s.model_sha256,
            "bytes_up": sum(v for k, v in received.items() if k in UP_KINDS),
            "bytes_down": down,
            "traffic_scope": self.traffic_scope,
            "bytes": nbytes,
            "messages": msgs,
            "rejected": s.rejected,
            "model_params": s.model_params,
            "arch": s.arch,
            "trained_arch": s.trained_arch,
            "edges": s.edges,
            "algorithm": dict(getattr(s, "algorithm", {})),
            "durations": {
                "round_s": round(s.round_seconds, 4),
                "aggregation_s": round(s.aggregation_seconds, 4),
                "train_s": round(s.train_seconds, 4),
            },
        }
        if self.start is not None and not self.rows:
            row["start"], self.start = self.start, None
        accuracies = getattr(s, "accuracy", None)
        if accuracies:
            row["accuracy"] = accuracy_figures(accuracies)
        if not self.classifier:
            self._evaluate(s, row)
        self.rows.append(row)
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.bar is not None:
            self.bar.update(1)
            if s.mean_loss is not None:
                self.bar.set_postfix(loss=f"{s.mean_loss:.4f}", refresh=False)

    def evaluate_start(self) -> None:
        """Score the first global model before any round: its sample grid
        (``samples/round_000000.png``) and, when the run evaluates, its quality, kept for the
        first round's row (``start``). Only a run that starts from given weights
        (``model.init`` not ``random``) is scored: a random start draws noise."""
        if self.model_fn is None or self.classifier or self.cfg.model.init == "random":
            return
        ev = self.cfg.eval
        if not (ev.sample_every or self.evaluator is not None):
            return
        model = self.model_fn()
        model.eval()
        start: dict[str, Any] = {"round": 0}
        if ev.sample_every:
            path = write_grid(self.cfg, model, self.run_dir / "samples" / "round_000000.png",
                              device=self.device)  # fmt: skip
            start["grid"] = str(path.relative_to(self.run_dir))
        if self.evaluator is not None:
            t0 = time.perf_counter()
            start["quality"] = self.evaluator.evaluate(model)
            start["eval_s"] = round(time.perf_counter() - t0, 3)
        self.start = start

    def _evaluate(self, s: Any, row: dict[str, Any]) -> None:
        ev = self.cfg.eval
        last = getattr(s, "final", False) or s.round + 1 >= self.cfg.run.rounds
        want_grid = ev.sample_every and ((s.round + 1) % ev.sample_every == 0 or last)
        want_eval = self.evaluator is not None and ((s.round + 1) % ev.every == 0 or last)
        if not (want_grid or want_eval) or self.model_fn is None:
            return
        clients = self.client_models_fn(ev.clients) if self.client_models_fn else {}
        model = next(iter(clients.values())) if clients else self.model_fn()
        model.eval()
        if want_grid:
            path = write_grid(
                self.cfg, model, self.run_dir / "samples" / f"round_{s.round + 1:06d}.png",
                device=self.device,
            )  # fmt: skip
            row["grid"] = str(path.relative_to(self.run_dir))
            if clients:
                row["grid_client"] = next(iter(clients))
        if want_eval and self.evaluator is not None:
            t0 = time.perf_counter()
            if clients:
                row["quality"] = client_quality(self.evaluator, clients)
            else:
                row["quality"] = self.evaluator.evaluate(model)
            row["durations"]["eval_s"] = round(time.perf_counter() - t0, 3)


#: a device whose accuracy is below this is counted as failed (pFedGPA's Fig. 4: 60 %)
FAIL_BELOW = 0.6


def accuracy_figures(per_device: Mapping[str, tuple[float | None, float]]) -> dict[str, Any]:
    """A round's classifier figures from each device's (before, after) accuracy on its own
    test split: means, the standard deviation over devices, devices under 60 % (before and
    after the local round), and every device's pair."""
    after = np.array([a for _, a in per_device.values()], dtype=np.float64)
    before = np.array([b for b, _ in per_device.values() if b is not None], dtype=np.float64)
    out: dict[str, Any] = {
        "devices": len(after),
        "after_mean": float(after.mean()),
        "after_std": float(after.std()),
        "after_under_60": int((after < FAIL_BELOW).sum()),
    }
    if len(before):
        out |= {
            "before_mean": float(before.mean()),
            "before_std": float(before.std()),
            "before_under_60": int((before < FAIL_BELOW).sum()),
        }
    out["per_device"] = {d: [b, a] for d, (b, a) in sorted(per_device.items())}
    return out


def client_quality(evaluator: Evaluator, clients: Mapping[str, nn.Module]) -> dict[str, Any]:
    """Quality at the client level (FedDiffuse's ULATDEC/UDEC, seed 001 section 5): every
    metric averaged over the clients' models, ``fid_std`` across them, and each client's
    FID and IS under ``clients``; ``level`` is ``"client"``."""
    per = {name: evaluator.evaluate(m.eval()) for name, m in clients.items()}
    first = next(iter(per.values()))
    out: dict[str, Any] = dict(first)
    for key, value in first.items():
        if isinstance(value, float):
            out[key] = float(np.mean([q[key] for q in per.values()]))
    out["fid_std"] = float(np.std([q["fid"] for q in per.values()]))
    out["level"] = "client"
    out["clients"] = {n: {"fid": q["fid"], "is_mean": q["is_mean"]} for n, q in per.items()}
    return out


def prepare_run_dir(cfg: RunConfig, out: Path | None, *, resuming: bool = False) -> Path:
    """``out`` or ``runs/<name>-<UTC timestamp>``, created, with the config saved.

    A run that starts over (not ``resuming``) in a directory holding checkpoints of an
    earlier run moves them aside to ``checkpoints.replaced-<UTC timestamp>`` (logged), so
    neither a later resume nor ``estuary eval`` can pick up a stale one. Only the earlier
    run's latest checkpoint (and ``latest.json``) is kept there, so reruns do not pile up
    whole runs of checkpoints; its metrics, samples and report are overwritten as before.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    run_dir = out or Path("runs") / f"{cfg.run.name}-{stamp}"
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpts = run_dir / "checkpoints"
    if not resuming and ckpts.is_dir() and any(ckpts.iterdir()):
        aside = run_dir / f"checkpoints.replaced-{stamp}"
        n = 1
        while aside.exists():
            aside, n = run_dir / f"checkpoints.replaced-{stamp}.{n}", n + 1
        ckpts.rename(aside)
        keep = latest_checkpoint_path(aside)
        for f in aside.glob("round_*.safetensors"):
            if f != keep:
                f.unlink()
        log.warning("%s held an earlier run's checkpoints; moved them to %s", run_dir, aside)
    atomic_write(run_dir / "config.json", cfg.to_json().encode())
    return run_dir


def save_label_counts(
    run_dir: Path, matrix: np.ndarray, names: list[str], *, show: bool,
    name: str = "label_counts.csv",
) -> None:  # fmt: skip
    """Write ``name`` (device x class counts) and optionally print the table."""
    header = "device," + ",".join(str(c) for c in range(matrix.shape[1]))
    lines = [header] + [
        f"{n}," + ",".join(str(int(v)) for v in row) for n, row in zip(names, matrix, strict=True)
    ]
    atomic_write(run_dir / name, ("\n".join(lines) + "\n").encode())
    if show:
        print("label counts per device (rows) and class (columns):")
        print(format_label_counts(matrix, names))
