"""Running a comparison: each method federated (:func:`estuary.simulate.simulate`) or
centralized on the pooled data, finished ones reused from their records, then the tables
and the plots."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from estuary.compare.jobs import run_jobs
from estuary.compare.plots import write_plots
from estuary.compare.record import NO_RECORD, RECORD, fingerprint, load_record, save_record
from estuary.compare.spec import (
    CompareResult,
    CompareSpec,
    Method,
    MethodRun,
    device_sizes,
    steps_per_round,
)
from estuary.compare.tables import summarize, write_tables
from shared import seeds
from shared.atomic import atomic_write
from shared.config import RunConfig
from shared.data.datasets import ImageDataset, to_model_input
from shared.data.partition import split_dataset
from shared.diffusion.schedule import make_train_scheduler
from shared.diffusion.training import (
    WeightAverage,
    make_optimizer,
    resolve_device,
    set_deterministic,
    train_classifier,
    train_local,
)
from shared.errors import ConfigError
from shared.evaluation.domains import score_by_domain
from shared.evaluation.evaluator import Evaluator, check_evaluable
from shared.evaluation.recorder import prepare_run_dir
from shared.evaluation.report import plot_report
from shared.families import family_of
from shared.methods.api import Centralized
from shared.methods.registry import make_algorithm
from shared.models.checkpoint import save_checkpoint
from shared.models.init import initial_model
from shared.models.oneshot import FeatureMatch, is_oneshot, latent_dim, recalibrate_bn
from shared.models.plan import ChannelPlan, build_model
from shared.models.presets import check_trainable
from shared.runtime.cpu import set_torch_threads


def run_centralized(
    cfg: RunConfig,
    run_dir: Path,
    *,
    evaluate: bool,
    progress: bool,
    ema: float = 0.0,
    init: str | None = None,
) -> tuple[list[dict[str, Any]], list[int], ChannelPlan | None, dict[str, Any] | None]:
    """The ceiling: one model on the pooled data of every device, trained for the local
    steps the federation would run (round by round), evaluated at the same rounds; returns
    the rows, the steps per round, the channel plan (None: dense) and the final figures
    (a classifier's, see below; None for a generator).

    Where the named method's settings prune the model before the first round (FedPhD-OS:
    ``prune_ratio`` > 0, ``prune_at = "init"``), the ceiling trains the architecture the
    method starts from (its cloud's step on the initial state, ``after_cloud_aggregate(-1,
    ...)``): what pruning costs, apart from what federating costs.

    It is ordinary centralized training: one optimizer for the whole run (its state carries
    over the evaluation points). With ``ema`` > 0 the evaluated and checkpointed model is the
    exponential moving average of the weights
    (:class:`~shared.diffusion.training.WeightAverage`), as in FedPhD's centralized baseline
    (seed 000, section V-A, after Ho et al.). ``init`` is
    the fingerprint of ``model.init`` its checkpoint records (the caller took it already).

    A classifier preset (:func:`_centralized_classifier`) trains with cross-entropy on the
    pooled images (each device's seen in its domain) and their labels instead, and is scored
    per domain at the end."""
    set_torch_threads(cfg.train.threads)
    set_deterministic(cfg.compute.deterministic)
    prepare_run_dir(cfg, run_dir)
    data, parts = split_dataset(cfg, progress=progress)
    if family_of(cfg.model.preset).quality == "accuracy":
        return _centralized_classifier(cfg, run_dir, data, parts, progress=progress, init=init)
    pooled = to_model_input(data.images[np.unique(np.concatenate(parts))], cfg.data.input_channels)
    steps = steps_per_round(cfg, [len(p) for p in parts])
    model, plan = _first_model(cfg)
    scheduler = make_train_scheduler(cfg.diffusion)
    device = resolve_device(cfg.compute.device)
    gen = torch.Generator().manual_seed(_centralized_seed(cfg))
    every = cfg.eval.every
    evaluator = Evaluator(cfg, device) if evaluate and every else None
    own = make_algorithm(cfg).central
    central = (
        own.centralized(model, _centralized_seed(cfg)) if own is not None else _weights(model, cfg)
    )
    if ema > 0 and central.net is not model:
        raise ConfigError(f"{cfg.algorithm.name}'s centralized training does not train the "
                          "model's weights, so it takes no 'ema'")  # fmt: skip
    # a one-shot generator trains with the feature-matching loss on the pooled statistics
    match = (
        FeatureMatch.for_device({}, pooled, latent_dim(model), cfg.train.ama_lr, device)
        if is_oneshot(model)
        else None
    )
    average = WeightAverage(model, ema) if ema > 0 else None
    rows: list[dict[str, Any]] = []
    pending = 0
    for r, n in enumerate(steps):
        pending += n
        last = r + 1 == len(steps)
        if not (last or (every and (r + 1) % every == 0)):
            continue
        result = train_local(
            central.net, pooled, central.train, scheduler, gen, steps=pending, device=device,
            optimizer=central.optimizer, loss_fn=match,
            after_step=average.update if average is not None else None,
        )  # fmt: skip
        row: dict[str, Any] = {"round": r + 1, "train_loss": result.mean_loss, "steps": pending}
        pending = 0
        if evaluator is not None:
            row["quality"] = evaluator.evaluate(
                average.averaged() if average is not None else _evaluated(central.model(r), cfg)
            )
        rows.append(row)
        if progress:
            fid = row.get("quality", {}).get("fid")
            shown = f", FID {fid:.2f}" if fid is not None else ""
            print(f"  centralized round {r + 1}/{len(steps)}: loss {result.mean_loss:.4f}{shown}")
    final = len(steps) - 1
    trained = average.averaged().state_dict() if average is not None else central.state(final)
    save_checkpoint(run_dir / "checkpoints", final, trained, cfg, plan=plan,
                    init=init)  # fmt: skip
    _write_rows(rows, run_dir, cfg)
    return rows, steps, plan, None


def _first_model(cfg: RunConfig) -> tuple[nn.Module, ChannelPlan | None]:
    """The model a ceiling starts from: ``model.init``, or, where the method's settings
    prune before the first round, the architecture its cloud makes of it (and its plan)."""
    model = initial_model(cfg.model.preset, cfg.model.init, seed=cfg.run.seed)
    if not cfg.algorithm.config().prunes:
        return model, None
    method = make_algorithm(cfg)
    first = method.format.init_global({k: v.detach() for k, v in model.state_dict().items()})
    state, plan = method.aggregation.after_cloud_aggregate(-1, first, None)
    if plan is None:
        return model, None
    pruned = build_model(cfg.model.preset, plan, seed=cfg.run.seed)
    pruned.load_state_dict(method.format.materialize(state))
    return pruned, plan


def _weights(model: nn.Module, cfg: RunConfig) -> Centralized:
    """Centralized training of ``model``'s weights with the configured optimizer (every
    method without a :class:`~shared.methods.api.CentralTraining` of its own)."""
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg.train)

    def state(_round: int) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    return Centralized(model, opt, cfg.train, lambda _round: model, state)


def _evaluated(model: torch.nn.Module, cfg: RunConfig) -> torch.nn.Module:
    """``model`` as evaluation sees it, in eval mode: a one-shot generator as a copy whose
    batch norms have statistics from latents alone (as every role evaluates one)."""
    if is_oneshot(model):
        return recalibrate_bn(copy.deepcopy(model), cfg.run.seed)
    return model.eval()


def _centralized_seed(cfg: RunConfig) -> int:
    """The seed of a centralized run's batch (and noise) draws."""
    return seeds.integer("centralized", cfg.run.seed)


def _write_rows(rows: list[dict[str, Any]], run_dir: Path, cfg: RunConfig) -> None:
    """A centralized run's ``metrics.jsonl`` and ``report.png``."""
    atomic_write(run_dir / "metrics.jsonl", "".join(json.dumps(x) + "\n" for x in rows).encode())
    plot_report(rows, run_dir / "report.png", title=f"{cfg.run.name} (centralized)")


def _centralized_classifier(
    cfg: RunConfig,
    run_dir: Path,
    data: ImageDataset,
    parts: list[np.ndarray],
    *,
    progress: bool,
    init: str | None,
) -> tuple[list[dict[str, Any]], list[int], None, dict[str, Any] | None]:
    """:func:`run_centralized` of a classifier: cross-entropy
    (:func:`~shared.diffusion.training.train_classifier`, the ``train`` settings, one
    optimizer for the run) on the pooled images and labels of every device, ``local_epochs``
    passes (or ``local_steps`` batches) a round for ``run.rounds`` rounds, so as many passes
    over the data as a device makes over its own. Returns the rows (one per round), the
    steps per round, no plan (dense) and :func:`classifier_final` of the trained model (also
    written to ``summary.json``)."""
    index = np.unique(np.concatenate(parts))
    images = to_model_input(data.images[index], cfg.data.input_channels)
    labels = torch.from_numpy(data.labels[index]).long()
    model = initial_model(cfg.model.preset, cfg.model.init, seed=cfg.run.seed)
    device = resolve_device(cfg.compute.device)
    gen = torch.Generator().manual_seed(_centralized_seed(cfg))
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg.train)
    rows: list[dict[str, Any]] = []
    steps: list[int] = []
    for r in range(cfg.run.rounds):
        loss, n, _ = train_classifier(model, images, labels, cfg.train, gen, device=device,
                                      optimizer=opt)  # fmt: skip
        steps.append(n)
        rows.append({"round": r + 1, "train_loss": loss, "steps": n})
        if progress:
            print(f"  centralized round {r + 1}/{cfg.run.rounds}: loss {loss:.4f}")
    model.eval()
    save_checkpoint(run_dir / "checkpoints", cfg.run.rounds - 1, model.state_dict(), cfg,
                    init=init)  # fmt: skip
    _write_rows(rows, run_dir, cfg)
    final = score_by_domain(cfg, model)
    if final is not None:
        summary = {"rounds": cfg.run.rounds, "centralized": True, "final": final}
        atomic_write(run_dir / "summary.json", json.dumps(summary, indent=2).encode())
        if progress:
            print(f"  centralized classifier: mean accuracy {final['mean_accuracy']:.4f} over "
                  f"{list(final['accuracy'])}")  # fmt: skip
    return rows, steps, None, final


def run_method(
    m: Method,
    out: Path,
    *,
    evaluate: bool,
    progress: bool,
    sizes: list[int] | None = None,
    init: str | None = None,
    fresh: bool = False,
) -> MethodRun:
    """Simulate (or train centrally) one method into ``out / m.slug``, and record it there
    (``method.json``) once it has finished. ``sizes`` (the devices' sample counts, shared
    by every method of a comparison) saves splitting the data again to count steps; ``init``
    is the :func:`~shared.models.init.init_fingerprint` taken before the run (default: now).

    A federated method interrupted before (its run directory holds checkpoints of this
    config) goes on after its latest checkpoint unless ``fresh``
    (:func:`~estuary.simulate.simulate`); one whose checkpoints are of another config starts
    over, said once. A centralized ceiling checkpoints only at its end, so it starts over."""
    from estuary.resume import ResumeRefused
    from estuary.simulate import simulate

    init = init or fingerprint(m)
    run_dir = out / m.slug
    (run_dir / RECORD).unlink(missing_ok=True)  # an interrupted rerun must not look finished
    t0 = time.perf_counter()
    if m.centralized:
        rows, steps, plan, final = run_centralized(
            m.cfg, run_dir, evaluate=evaluate, progress=progress, ema=m.ema, init=init
        )
        run = MethodRun(m, run_dir, rows, {}, plan, time.perf_counter() - t0, steps, final=final)
    else:
        try:
            res = simulate(m.cfg, run_dir, progress=progress, evaluate=evaluate, fresh=fresh)
        except ResumeRefused as err:
            if progress:
                print(f"{m.label}: not resuming ({err}); starting over")
            res = simulate(m.cfg, run_dir, progress=progress, evaluate=evaluate, fresh=True)
        steps = steps_per_round(m.cfg, sizes or device_sizes(m.cfg))
        wall_s = res.earlier_wall_s + time.perf_counter() - t0
        run = MethodRun(m, run_dir, res.rows, res.traffic, res.plan, wall_s, steps,
                        final=res.final)  # fmt: skip
    run.threads = torch.get_num_threads()  # as the run set them (train.threads)
    run.deterministic = torch.are_deterministic_algorithms_enabled()
    save_record(run, evaluate=evaluate, init=init)
    return run


def run_compare(
    spec: CompareSpec,
    out: Path,
    *,
    evaluate: bool = True,
    progress: bool = True,
    fresh: bool = False,
    only: Sequence[str] = (),
    jobs: int = 1,
    tables: bool = True,
) -> CompareResult:
    """Run every method (reusing those already finished in ``out`` and resuming those
    interrupted after their latest checkpoint, unless ``fresh``), then write the tables and
    the plots (``tables``) once every method has a record.

    ``only``: labels of the methods to run (the rest only reused); ``jobs``: how many run at
    once, each in its own process (see :mod:`estuary.compare`). Raises
    :class:`~shared.errors.EstuaryError` naming every method that failed in a job, after the
    others finished."""
    labels = [m.label for m in spec.methods]
    unknown = [label for label in only if label not in labels]
    if unknown:
        raise ConfigError(f"--only {unknown}: no such method; this comparison has {labels}")
    if jobs < 1:
        raise ConfigError(f"jobs must be at least 1, got {jobs}")
    if jobs > 1 and spec.source is None:
        raise ConfigError("jobs > 1 needs a comparison read from a file (load_compare)")
    for m in spec.methods:  # refused now, not after the methods before it have trained
        check_trainable(m.cfg)
        if evaluate and m.cfg.eval.every:
            check_evaluable(m.cfg)
    out.mkdir(parents=True, exist_ok=True)
    # what the methods need before they run (PRISM's key: one for every PRISM method, the
    # same frozen weights and first scores, kept in ``out`` so reused and resumed methods
    # share it; jobs inherit the environment), once per kind
    prepared: set[type] = set()
    for m in spec.methods:
        method = make_algorithm(m.cfg)
        # a ceiling trains the model's weights unless its method trains something of its own
        preparation = None if m.centralized and method.central is None else method.preparation
        if preparation is not None and type(preparation) not in prepared:
            prepared.add(type(preparation))
            preparation.prepare(out, show=progress)
    n = len(spec.methods)
    done: dict[str, MethodRun] = {}
    todo: list[tuple[int, Method, str]] = []  # (position, method, init fingerprint)
    for i, m in enumerate(spec.methods, 1):
        if only and m.label not in only and not tables:
            continue  # read back only for the table (a job of --jobs reads none)
        init = fingerprint(m)  # once per method, before it runs: the weights it starts from
        if not fresh or (only and m.label not in only):
            run, why = load_record(m, out / m.slug, evaluate=evaluate, init=init)
            if run is not None:
                if progress:
                    print(f"[{i}/{n}] {m.label}: reusing the run finished "
                          f"earlier in {run.run_dir} ({run.wall_s:.1f} s)")  # fmt: skip
                done[m.label] = run
                continue
            if progress and why != NO_RECORD and (not only or m.label in only):
                print(f"[{i}/{n}] {m.label}: not reusing ({why})")
        if not only or m.label in only:
            todo.append((i, m, init))
    if jobs > 1 and len(todo) > 1:
        done.update(run_jobs(spec, out, todo, jobs, evaluate=evaluate, progress=progress,
                             fresh=fresh))  # fmt: skip
    else:
        sizes: list[int] | None = None  # the split is the same for every method: count it once
        for i, m, init in todo:
            if progress:
                kind = "centralized" if m.centralized else m.cfg.algorithm.name
                print(f"[{i}/{n}] {m.label} ({kind}, {m.cfg.run.rounds} rounds)")
            if sizes is None and not m.centralized:
                sizes = device_sizes(m.cfg)
            run = run_method(m, out, evaluate=evaluate, progress=progress, sizes=sizes,
                             init=init, fresh=fresh)  # fmt: skip
            done[m.label] = run
            if progress:
                print(f"[{i}/{n}] {m.label} done in {run.wall_s:.1f} s")
    runs = [done[label] for label in labels if label in done]
    missing = [label for label in labels if label not in done]
    rows: list[dict[str, Any]] = []
    if missing:
        if progress and tables:
            print(f"no table yet: {', '.join(missing)} not run (--only); run them, or the "
                  "whole comparison, into the same --out to finish it")  # fmt: skip
    elif tables:
        rows = summarize(runs, spec)
        write_tables(rows, spec, out)
        write_plots(runs, out, spec.distances)
    return CompareResult(out, rows, runs, missing)
