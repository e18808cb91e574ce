"""``estuary simulate``: the whole hierarchy in one process over MemoryBus.

The cloud, edge and device services are the same classes that run over MQTT; only the bus
differs. The run directory receives the config used, the label-count matrix,
``metrics.jsonl`` (one object per round), atomic checkpoints with the devices' kept state
beside them (``state/``), sample grids and ``report.png``. Run again into a directory
holding checkpoints of the same config it resumes after the latest (:mod:`estuary.resume`).
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from cloud import CloudServer, RoundSummary
from cloud.main import ResumePoint
from device_agent import DeviceAgent
from edge_node import EdgeServer
from estuary.resume import (
    STATE_DIR,
    StateCost,
    add_counts,
    find_resume,
    load_federation_state,
    save_federation_state,
)
from shared.atomic import atomic_write
from shared.config import RunConfig, classifies
from shared.data.datasets import NUM_CLASSES, ImageDataset, to_model_input
from shared.data.partition import label_count_matrix, split_dataset, split_test
from shared.diffusion.training import set_deterministic
from shared.errors import EstuaryError
from shared.evaluation.domains import score_by_domain
from shared.evaluation.evaluator import check_evaluable
from shared.evaluation.recorder import RunRecorder, prepare_run_dir, save_label_counts
from shared.evaluation.report import headline, plot_report
from shared.families import family_of
from shared.methods.registry import make_algorithm
from shared.models.init import initial_model
from shared.models.plan import ChannelPlan, plan_doc
from shared.naming import device_name, edge_ids, home_edge
from shared.progress import progress_bar
from shared.runtime.cpu import set_torch_threads
from shared.transport.bus import MemoryBus

log = logging.getLogger(__name__)


@dataclass
class SimulationResult:
    """Where the outputs went and the final state of the run."""

    run_dir: Path
    rounds: int
    final_model_sha256: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    traffic: dict[str, Any] = field(default_factory=dict)
    plan: ChannelPlan | None = None  # the final global model's channel plan (pruned)
    #: the summary's ``"final"``: a one-shot algorithm's product and its figures (FedDEO:
    #: ``preset``, per-domain ``accuracy``, ``mean_accuracy``, ``accuracy_by_n``, ...), or a
    #: classifier run's final global model scored on every domain's test set when
    #: ``data.domains`` is set (``preset``, ``accuracy``, ``mean_accuracy``); else None
    final: dict[str, Any] | None = None
    #: the 1-based round of the checkpoint the run was resumed after (None: from the start)
    resumed_after_round: int | None = None
    #: the wall time of the run before it was resumed (0 for one that was not)
    earlier_wall_s: float = 0.0


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
    test: tuple[ImageDataset, list[np.ndarray]] | None = None,
    start: ResumePoint | None = None,
) -> Federation:
    """Cloud, edges and devices (device i's private data is ``data[parts[i]]``, its test
    split ``test[0][test[1][i]]`` when given); the cloud starts from ``start`` (a
    checkpoint, :func:`cloud.main.resume_point`) when given, else from ``model.init``.

    Every service gets its own algorithm instance; nothing is shared but the bus.
    """
    channels = cfg.data.input_channels
    if start is None:
        initial = initial_model(cfg.model.preset, cfg.model.init, seed=cfg.run.seed).state_dict()
        cloud = CloudServer(
            cfg, bus, make_algorithm(cfg), initial_model=dict(initial),
            checkpoint_dir=checkpoint_dir, on_round_end=on_round_end,
        )  # fmt: skip
    else:
        cloud = CloudServer(
            cfg, bus, make_algorithm(cfg), initial_model=start.model, plan=start.plan,
            start_round=start.next_round, checkpoint_dir=checkpoint_dir,
            on_round_end=on_round_end, init=start.init,
        )  # fmt: skip
    edges = [EdgeServer(cfg, bus, make_algorithm(cfg), edge_id=e) for e in edge_ids(cfg)]
    devices = [
        DeviceAgent(
            cfg,
            bus,
            make_algorithm(cfg),
            device_id=device_name(i),
            index=i,
            home_edge=home_edge(i, cfg),
            data=to_model_input(data.images[p], channels),
            labels=torch.from_numpy(data.labels[p]),
            test_data=(
                None if test is None else to_model_input(test[0].images[test[1][i]], channels)
            ),
            test_labels=None if test is None else torch.from_numpy(test[0].labels[test[1][i]]),
        )
        for i, p in enumerate(parts)
    ]
    return Federation(cloud, edges, devices)


def client_modules(fed: Federation, limit: int) -> dict[str, nn.Module]:
    """The models of the first ``limit`` devices (by name): the cloud's current global state
    with each device's own parts (:meth:`~shared.methods.api.DeviceStep.client_state`),
    or the global model for a device that holds none yet (it is what that device would be
    deployed), so the evaluated set stays the same from round to round; empty while none of
    those devices holds local parts (every one of their models is the global one)."""
    cloud = fed.cloud
    chosen = sorted(fed.devices, key=lambda d: d.name)[:limit]
    step = cloud.algorithm.device
    states = {d.name: step.client_state(cloud.model, d.algo_state) for d in chosen}
    if all(state is None for state in states.values()):
        return {}
    out = dict[str, nn.Module]()
    for name, state in states.items():
        module = cloud.global_module()
        if state is not None:
            keys = set(module.state_dict())
            module.load_state_dict({k: v for k, v in state.items() if k in keys})
        out[name] = module
    return out


def device_test_splits(
    cfg: RunConfig, run_dir: Path, names: list[str], *, show: bool
) -> tuple[ImageDataset, list[np.ndarray]] | None:
    """A classifier run's per-device test splits (:func:`split_test`), their label counts
    saved as ``label_counts_test.csv`` (and printed with ``show``); None for generators,
    except where the run delivers a classifier (FedDEO's devices classify with it)."""
    if not classifies(cfg):
        return None
    test = split_test(cfg)
    if test is None:
        log.warning("%s has no test set: the devices report no accuracy", cfg.data.dataset)
        return None
    matrix = label_count_matrix(test[0].labels, test[1], NUM_CLASSES)
    if show:
        print("test split:")
    save_label_counts(run_dir, matrix, names, show=show, name="label_counts_test.csv")
    return test


def simulate(
    cfg: RunConfig,
    out: Path | None = None,
    *,
    progress: bool = True,
    evaluate: bool = True,
    fresh: bool = False,
    state_costs: list[StateCost] | None = None,
) -> SimulationResult:
    """Run the configured federation in-process and write the run directory.

    An ``out`` that holds checkpoints of this config (with the devices' states beside them,
    :mod:`estuary.resume`) is resumed after the latest one, unless ``fresh``: its
    ``metrics.jsonl`` rows up to the checkpoint are kept and the run appends after them.
    Checkpoints of another config are refused (:class:`~estuary.resume.ResumeRefused`)
    unless ``fresh``; a fresh
    start moves earlier checkpoints aside (:func:`prepare_run_dir`). ``state_costs``
    receives what writing the states cost at each checkpoint."""
    started = time.monotonic()
    set_torch_threads(cfg.train.threads)
    set_deterministic(cfg.compute.deterministic)
    # first: a refused split or evaluation leaves no run directory
    if evaluate and cfg.eval.every and family_of(cfg.model.preset).quality == "fid":
        check_evaluable(cfg)
    data, parts = split_dataset(cfg, progress=progress)
    method = make_algorithm(cfg)
    if out is not None and method.preparation is not None and (out / "checkpoints").is_dir():
        # the key a resume checks its checkpoint against (kept in the run directory)
        method.preparation.prepare(out, show=False)
    resumed = None if fresh or out is None else find_resume(cfg, out)
    run_dir = prepare_run_dir(cfg, out, resuming=resumed is not None)
    if resumed is None:
        shutil.rmtree(run_dir / STATE_DIR, ignore_errors=True)  # an earlier run's states
    elif progress:
        print(f"resuming {run_dir} after round {resumed.after_round} of {cfg.run.rounds} "
              "(its latest checkpoint; --fresh starts over)")  # fmt: skip
    if method.preparation is not None:  # what the run needs first (PRISM: its key)
        method.preparation.prepare(run_dir, show=progress)
    if progress and (method.personalization or method.finalizer):  # minutes of cloud work
        logging.getLogger(type(method).__module__.rpartition(".")[0]).setLevel(logging.INFO)
        logging.getLogger("cloud.service").setLevel(logging.INFO)
    device_names = [device_name(i) for i in range(len(parts))]
    matrix = label_count_matrix(data.labels, parts, NUM_CLASSES)
    save_label_counts(run_dir, matrix, device_names, show=progress)
    test = device_test_splits(cfg, run_dir, device_names, show=progress)

    bus = MemoryBus()
    recorder = RunRecorder(
        cfg, run_dir, bus.traffic, evaluate=evaluate,
        resume_after=None if resumed is None else resumed.after_round - 1,
    )  # fmt: skip
    fed = build_federation(
        cfg,
        bus,
        data,
        parts,
        checkpoint_dir=run_dir / "checkpoints",
        on_round_end=recorder.on_round_end,
        test=test,
        start=None if resumed is None else resumed.point,
    )
    cloud = fed.cloud
    earlier_traffic: dict[str, dict[str, int]] = {} if resumed is None else resumed.traffic
    earlier_wall = 0.0 if resumed is None else resumed.wall_s
    if resumed is not None:
        view = cloud.algorithm.state_view
        if view is not None:
            view.load_cloud_state(run_dir / "checkpoints", resumed.after_round - 1)
        load_federation_state(fed, run_dir, resumed)

    def save_states(r: int) -> None:
        """The devices' states at the checkpoint of round ``r`` (written before it)."""
        progress_doc = {
            "traffic": add_counts(earlier_traffic, bus.traffic.snapshot()),
            "wall_s": round(earlier_wall + time.monotonic() - started, 1),
        }
        cost = save_federation_state(fed, run_dir, r, progress_doc)
        log.debug("device states of round %d: %d bytes in %.3f s", r + 1, cost.bytes,
                  cost.seconds)  # fmt: skip
        if state_costs is not None:
            state_costs.append(cost)

    cloud.on_checkpoint = save_states
    recorder.model_fn = cloud.global_module
    if cloud.algorithm.traffic.device_keeps == "local_parts":
        recorder.client_models_fn = functools.partial(client_modules, fed)
    fed.start()
    bar_args = {"total": cfg.run.rounds, "desc": cfg.run.name, "unit": "round",
                "initial": 0 if resumed is None else resumed.after_round}  # fmt: skip
    with progress_bar(**bar_args, disable=not progress) as bar:
        recorder.bar = bar
        bus.run(lambda: cloud.done or cloud.failed is not None)
    if cloud.failed is not None:
        raise EstuaryError(f"the simulated cloud stopped: {cloud.failed}")
    if not cloud.done:
        raise RuntimeError("simulation stopped before the cloud finished (no events left)")
    plot_report(
        recorder.rows, run_dir / "report.png", title=f"{cfg.run.name} ({cfg.algorithm.name})"
    )
    traffic = add_counts(earlier_traffic, bus.traffic.snapshot())
    summary = {
        "rounds": cloud.round,
        "results": headline(recorder.rows),
        "wall_s": round(earlier_wall + time.monotonic() - started, 1),
        # the 1-based round of the checkpoint this run went on after (None: from the start)
        "resumed_after_round": None if resumed is None else resumed.after_round,
        "final_model_sha256": cloud.model_sha,
        "model_params": cloud.model_params(),
        "arch": plan_doc(cloud.plan),
        "traffic": traffic,
    }
    final: dict[str, Any] | None = None
    if cloud.final is not None:  # a one-shot algorithm's product and its figures
        final = {"preset": cloud.final.preset, **cloud.final.report}
    elif family_of(cfg.model.preset).quality == "accuracy" and cfg.data.domains:
        # the final global classifier on the whole test set seen in every domain: the
        # figure a one-shot method reports, so feature-skew comparisons share one measure
        final = score_by_domain(cfg, cloud.global_module())
    if final is not None:
        summary["final"] = final
    atomic_write(run_dir / "summary.json", json.dumps(summary, indent=2).encode())
    return SimulationResult(
        run_dir, cloud.round, cloud.model_sha, recorder.rows, traffic, cloud.plan, final,
        resumed_after_round=None if resumed is None else resumed.after_round,
        earlier_wall_s=earlier_wall,
    )  # fmt: skip
