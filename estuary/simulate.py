"""``estuary simulate``: the whole hierarchy in one process over MemoryBus.

The cloud, edge and device services are the same classes that run over MQTT; only the bus
differs. The run directory receives the config used, the label-count matrix,
``metrics.jsonl`` (one object per round), atomic checkpoints, sample grids and
``report.png``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from cloud import CloudServer, RoundSummary
from cloud.service import edge_ids
from device_agent import DeviceAgent
from edge_node import EdgeServer
from shared.algorithms import make_algorithm
from shared.bus import MemoryBus
from shared.checkpoint import atomic_write
from shared.config import RunConfig
from shared.data import NUM_CLASSES, ImageDataset, load_dataset, to_model_input
from shared.evaluation import Evaluator, model_from_state, write_grid
from shared.models import build_unet
from shared.partition import format_label_counts, label_count_matrix, make_partition
from shared.report import plot_report
from shared.telemetry import Traffic, diff_counts

log = logging.getLogger(__name__)

UP_KINDS = ("device_update", "edge_update", "msg_device_update", "msg_edge_update", "msg_hello")


@dataclass
class SimulationResult:
    """Where the outputs went and the final state of the run."""

    run_dir: Path
    rounds: int
    final_model_sha256: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    traffic: dict[str, Any] = field(default_factory=dict)


class RunRecorder:
    """Turns round summaries into metrics.jsonl rows, grids and evaluations."""

    def __init__(self, cfg: RunConfig, run_dir: Path, traffic: Traffic, *, evaluate: bool) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.traffic = traffic
        self.before = traffic.snapshot()
        self.rows: list[dict[str, Any]] = []
        self.cloud: CloudServer | None = None
        self.evaluator: Evaluator | None = Evaluator(cfg) if evaluate and cfg.eval.every else None
        self.bar: tqdm[Any] | None = None
        self.metrics_path = run_dir / "metrics.jsonl"
        self.metrics_path.write_text("")

    def on_round_end(self, s: RoundSummary) -> None:
        """Append one metrics row; sample and evaluate when due."""
        snap = self.traffic.snapshot()
        nbytes = diff_counts(snap["bytes"], self.before["bytes"])
        msgs = diff_counts(snap["messages"], self.before["messages"])
        self.before = snap
        received = {k.split(":", 1)[1]: v for k, v in nbytes.items() if k.startswith("received:")}
        row: dict[str, Any] = {
            "round": s.round,
            "train_loss": s.mean_loss,
            "participants": s.participants,
            "updates": s.updates,
            "cloud_aggregated": s.cloud_aggregated,
            "model_sha256": s.model_sha256,
            "bytes_up": sum(v for k, v in received.items() if k in UP_KINDS),
            "bytes_down": sum(v for k, v in received.items() if k not in UP_KINDS),
            "bytes": nbytes,
            "messages": msgs,
            "rejected": s.rejected,
            "durations": {
                "round_s": round(s.round_seconds, 4),
                "aggregation_s": round(s.aggregation_seconds, 4),
                "train_s": round(s.train_seconds, 4),
            },
        }
        self._evaluate(s, row)
        self.rows.append(row)
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.bar is not None:
            self.bar.update(1)
            if s.mean_loss is not None:
                self.bar.set_postfix(loss=f"{s.mean_loss:.4f}", refresh=False)

    def _evaluate(self, s: RoundSummary, row: dict[str, Any]) -> None:
        ev = self.cfg.eval
        last = s.round + 1 >= self.cfg.run.rounds
        want_grid = ev.sample_every and ((s.round + 1) % ev.sample_every == 0 or last)
        want_eval = self.evaluator is not None and ((s.round + 1) % ev.every == 0 or last)
        if not (want_grid or want_eval) or self.cloud is None:
            return
        model = model_from_state(self.cfg, self.cloud.model)
        if want_grid:
            path = write_grid(
                self.cfg, model, self.run_dir / "samples" / f"round_{s.round:06d}.png"
            )
            row["grid"] = str(path.relative_to(self.run_dir))
        if want_eval and self.evaluator is not None:
            t0 = time.perf_counter()
            row["quality"] = self.evaluator.evaluate(model)
            row["durations"]["eval_s"] = round(time.perf_counter() - t0, 3)


def prepare_run_dir(cfg: RunConfig, out: Path | None) -> Path:
    """``out`` or ``runs/<name>-<UTC timestamp>``, created, with the config saved."""
    run_dir = (
        out or Path("runs") / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / "config.json", cfg.to_json().encode())
    return run_dir


def device_name(index: int) -> str:
    """Name of the ``index``-th simulated device: ``dev000``, ``dev001``, ..."""
    return f"dev{index:03d}"


@dataclass
class Federation:
    """Every service of an in-process federation, wired to one bus."""

    cloud: CloudServer
    edges: list[EdgeServer]
    devices: list[DeviceAgent]

    def start(self) -> None:
        """Start the cloud, then the edges, then the devices."""
        self.cloud.start()
        for edge in self.edges:
            edge.start()
        for device in self.devices:
            device.start()


def build_federation(
    cfg: RunConfig,
    bus: MemoryBus,
    data: ImageDataset,
    parts: list[np.ndarray],
    *,
    checkpoint_dir: Path | None = None,
    on_round_end: Callable[[RoundSummary], None] | None = None,
) -> Federation:
    """Cloud, edges and devices (device i's private data is ``data[parts[i]]``).

    Every service gets its own algorithm instance; nothing is shared but the bus.
    """
    initial = build_unet(cfg.model.preset, seed=cfg.run.seed).state_dict()
    cloud = CloudServer(
        cfg, bus, make_algorithm(cfg), initial_model=dict(initial),
        checkpoint_dir=checkpoint_dir, on_round_end=on_round_end,
    )  # fmt: skip
    edges = [EdgeServer(cfg, bus, make_algorithm(cfg), edge_id=e) for e in edge_ids(cfg)]
    devices = [
        DeviceAgent(
            cfg,
            bus,
            make_algorithm(cfg),
            device_id=device_name(i),
            index=i,
            home_edge=edges[i % len(edges)].name,
            data=to_model_input(data.images[p]),
            labels=torch.from_numpy(data.labels[p]),
        )
        for i, p in enumerate(parts)
    ]
    return Federation(cloud, edges, devices)


def simulate(
    cfg: RunConfig, out: Path | None = None, *, progress: bool = True, evaluate: bool = True
) -> SimulationResult:
    """Run the configured federation in-process and write the run directory."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    run_dir = prepare_run_dir(cfg, out)
    data = load_dataset(
        cfg.data.dataset, cfg.data.path, size=cfg.data.synthetic_size, seed=cfg.run.seed
    )
    parts = make_partition(data.labels, cfg.federation.num_devices, cfg.data, cfg.run.seed)
    device_names = [device_name(i) for i in range(len(parts))]
    matrix = label_count_matrix(data.labels, parts, NUM_CLASSES)
    _save_label_counts(run_dir, matrix, device_names, show=progress)

    bus = MemoryBus()
    recorder = RunRecorder(cfg, run_dir, bus.traffic, evaluate=evaluate)
    fed = build_federation(
        cfg,
        bus,
        data,
        parts,
        checkpoint_dir=run_dir / "checkpoints",
        on_round_end=recorder.on_round_end,
    )
    cloud = recorder.cloud = fed.cloud
    fed.start()
    with tqdm(total=cfg.run.rounds, desc=cfg.run.name, unit="round", disable=not progress) as bar:
        recorder.bar = bar
        bus.run(lambda: cloud.done)
    if not cloud.done:
        raise RuntimeError("simulation stopped before the cloud finished (no events left)")
    plot_report(
        recorder.rows, run_dir / "report.png", title=f"{cfg.run.name} ({cfg.algorithm.name})"
    )
    traffic = bus.traffic.snapshot()
    summary = {"rounds": cloud.round, "final_model_sha256": cloud.model_sha, "traffic": traffic}
    atomic_write(run_dir / "summary.json", json.dumps(summary, indent=2).encode())
    return SimulationResult(run_dir, cloud.round, cloud.model_sha, recorder.rows, traffic)


def _save_label_counts(run_dir: Path, matrix: np.ndarray, names: list[str], *, show: bool) -> None:
    header = "device," + ",".join(str(c) for c in range(matrix.shape[1]))
    lines = [header] + [
        f"{n}," + ",".join(str(int(v)) for v in row) for n, row in zip(names, matrix, strict=True)
    ]
    atomic_write(run_dir / "label_counts.csv", ("\n".join(lines) + "\n").encode())
    if show:
        print("label counts per device (rows) and class (columns):")
        print(format_label_counts(matrix, names))
