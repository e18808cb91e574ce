"""``python -m cloud`` / ``estuary cloud``: the cloud aggregator as a process over MQTT.

It owns the run directory (``--out``): config, ``metrics.jsonl``, checkpoints after every
global aggregation, sample grids, ``report.png`` and ``summary.json``. Restarted on the same
run directory (after a crash or SIGKILL) it resumes from the latest checkpoint whose config
digest matches, at the round after it, with a new session id so edges and devices redo the
interrupted round.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from cloud.deploy import deploy_when_trained
from cloud.service import CloudServer, RoundSummary, check_round_start_fits
from shared.atomic import atomic_write
from shared.config import RunConfig
from shared.diffusion.training import set_deterministic
from shared.errors import CodecError, ConfigError, EstuaryError
from shared.evaluation.recorder import RunRecorder, prepare_run_dir
from shared.evaluation.report import headline, last_quality, plot_report
from shared.methods.api import origin_of
from shared.methods.registry import make_algorithm
from shared.models.checkpoint import latest_checkpoint_path, load_checkpoint
from shared.models.init import init_fingerprint, initial_model
from shared.models.plan import ChannelPlan, model_spec, plan_doc
from shared.runtime.cpu import set_torch_threads
from shared.runtime.memory import tune_allocator
from shared.runtime.process import (
    EXIT_ERROR,
    Serve,
    add_common_args,
    connect_bus,
    run_role,
    run_until_done,
    serve_metrics,
)
from shared.runtime.service import TensorDict
from shared.transport.mqtt import MqttBus
from shared.wire.codec import check_spec

log = logging.getLogger("cloud")


def build_parser() -> argparse.ArgumentParser:
    """Arguments of the cloud process."""
    p = argparse.ArgumentParser(prog="estuary cloud", description=__doc__)
    add_common_args(p)
    p.add_argument("--out", required=True, help="run directory (created; resumed if it exists)")
    p.add_argument("--no-eval", action="store_true", help="skip quality evaluation")
    p.add_argument(
        "--reference",
        metavar="DIR",
        help="with data.dataset = 'folder': the real images quality metrics compare with, "
        "DIR/<class>/<files> (sets eval.reference_dir)",
    )
    p.add_argument("--fresh", action="store_true", help="ignore existing checkpoints in --out")
    return p


@dataclass(frozen=True)
class ResumePoint:
    """Where a restarted cloud continues: the latest checkpoint of its config."""

    model: TensorDict
    plan: ChannelPlan | None
    next_round: int
    init: str | None  # the checkpoint's init fingerprint, carried into later checkpoints


def _init_free_digest(cfg: RunConfig) -> str:
    """The config digest with ``model.init`` blanked: equal for two configs that differ only
    in where the initial weights were read from."""
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"init": ""})}).digest()


def resume_point(cfg: RunConfig, run_dir: Path) -> ResumePoint | None:
    """The latest checkpoint of this config in ``run_dir``, or None when there is none.

    A checkpoint of another config is refused (EstuaryError), except when the configs differ
    only in ``model.init`` and the checkpoint recorded the same initial weights by content
    (the init file was moved or renamed): resuming reads only the checkpoint."""
    path = latest_checkpoint_path(run_dir / "checkpoints")
    if path is None:
        return None
    ckpt = load_checkpoint(path)
    if ckpt.config.digest() != cfg.digest():
        refusal = (
            f"{run_dir} holds checkpoints of a different config "
            f"({ckpt.config.digest()} != {cfg.digest()})"
        )
        if _init_free_digest(ckpt.config) != _init_free_digest(cfg):
            raise EstuaryError(f"{refusal}; use another --out or --fresh")
        now = init_fingerprint(cfg.model.preset, cfg.model.init)
        was, init = ckpt.config.model.init, cfg.model.init
        if ckpt.init is None:
            raise EstuaryError(
                f"{refusal}: model.init was {was!r}, now {init!r}, and the checkpoint does not "
                "record what the run started from; use the old model.init, another --out, "
                "or --fresh"
            )
        origin = origin_of(make_algorithm(cfg))
        now = now if origin is None else f"{now}+{origin}"
        if ckpt.init != now:
            raise EstuaryError(
                f"{refusal}: model.init {init!r} ({now}) is not what the run started from "
                f"({was!r}, {ckpt.init}); use another --out or --fresh"
            )
        log.info("model.init moved from %r to %r, same content (%s)", was, init, now)
    # the state is the algorithm's (the model's tensors and its extras, or what stands for
    # the model): what the edges will check every download against
    algorithm = make_algorithm(cfg)
    origin = origin_of(algorithm)
    if origin is not None and not (ckpt.init or "").endswith(f"+{origin}"):
        raise EstuaryError(
            f"{path} was not trained from {origin} (it records {ckpt.init!r}): resuming "
            "would mix two runs; use the run's own key, another --out or --fresh"
        )
    spec = algorithm.format.global_spec(model_spec(cfg.model.preset, ckpt.plan))
    try:
        check_spec(ckpt.model, spec)
    except CodecError as err:
        raise EstuaryError(f"{path} does not hold a global state of this run: {err}") from None
    log.info("resuming after round %d from %s (model %s)", ckpt.round + 1, path,
             ckpt.model_sha256[:12])  # fmt: skip
    return ResumePoint(ckpt.model, ckpt.plan, ckpt.round + 1, ckpt.init)


def fresh_start(cfg: RunConfig) -> ResumePoint:
    """Round 0: the first global model ``model.init`` names, with its fingerprint taken
    around the load (a file replaced while it was read is a ConfigError, not a checkpoint
    recording other weights than the run started from)."""
    before = init_fingerprint(cfg.model.preset, cfg.model.init)
    model = initial_model(cfg.model.preset, cfg.model.init, seed=cfg.run.seed)
    if init_fingerprint(cfg.model.preset, cfg.model.init) != before:
        raise ConfigError(f"model.init {cfg.model.init} changed while it was read; start again")
    origin = origin_of(make_algorithm(cfg))  # recorded beside model.init in every checkpoint
    init = f"{before}+{origin}" if origin is not None else before
    return ResumePoint(dict(model.state_dict()), None, 0, init)


def main(argv: list[str] | None = None) -> int:
    """Run the cloud until the configured rounds are done; returns the exit code."""
    return run_role(build_parser(), argv, lambda _args: "cloud", _start, log)


def _start(args: argparse.Namespace, cfg: RunConfig) -> Serve:
    """Check the config, prepare ``--out`` (resuming its latest checkpoint unless
    ``--fresh``) and connect; returns the serving body."""
    tune_allocator()  # model-sized buffers every round: keep RSS near what is held
    set_torch_threads(0)  # evaluation: torch's default, within this process's CPU limit
    set_deterministic(cfg.compute.deterministic)  # sampling for evaluation and grids
    check_round_start_fits(cfg)
    # refused before the run directory changes (a refused resume keeps its config.json)
    resumed = None if args.fresh else resume_point(cfg, Path(args.out))
    run_dir = prepare_run_dir(cfg, Path(args.out), resuming=resumed is not None)
    # without a checkpoint, the first global model (model.init is checked before anyone
    # connects)
    start = resumed or fresh_start(cfg)
    bus = connect_bus(cfg, "cloud", "cloud", run_dir / "cache" / "cloud")
    return functools.partial(_serve, args, cfg, bus, run_dir, start, resumed)


def _serve(
    args: argparse.Namespace,
    cfg: RunConfig,
    bus: MqttBus,
    run_dir: Path,
    start: ResumePoint,
    resumed: ResumePoint | None,
) -> int:
    """Record, aggregate and serve from ``start`` until the run is done (with ``--stay``:
    until stopped); returns the exit code."""
    start_round = start.next_round
    started = time.monotonic()
    try:  # the evaluator reads its reference images here (a folder run: --reference)
        recorder = RunRecorder(
            cfg,
            run_dir,
            bus.traffic,
            evaluate=not args.no_eval,
            resume_after=start_round - 1 if resumed else None,
            traffic_scope="cloud",
        )
    except EstuaryError as err:
        log.error("%s", err)
        return EXIT_ERROR

    def on_round_end(s: RoundSummary) -> None:
        recorder.on_round_end(s)
        row = recorder.rows[-1]
        loss = f"{s.mean_loss:.4f}" if s.mean_loss is not None else "-"
        fid = row.get("quality", {}).get("fid")
        log.info(
            "round %d/%d done: %d/%d updates, loss %s, %.1f KiB received, %.1f KiB sent%s",
            s.round + 1,
            cloud.rounds,
            s.updates,
            s.participants,
            loss,
            row["bytes_up"] / 1024,
            row["bytes_down"] / 1024,
            f", FID {fid:.1f}" if fid is not None else "",
        )

    cloud = CloudServer(
        cfg,
        bus,
        make_algorithm(cfg),
        initial_model=start.model,
        plan=start.plan,
        start_round=start_round,
        checkpoint_dir=run_dir / "checkpoints",
        on_round_end=on_round_end,
        init=start.init,
    )
    view = cloud.algorithm.state_view
    if resumed and view is not None:
        view.load_cloud_state(run_dir / "checkpoints", start_round - 1)
    recorder.model_fn = cloud.global_module
    if recorder.evaluator is not None and cloud.algorithm.traffic.device_keeps == "local_parts":
        log.warning(
            "%s keeps model parts on the devices: the FID logged here is the global model's, "
            "with those parts at their initialization; the client-level FID the paper "
            "reports comes from `estuary simulate` / `estuary compare`",
            cfg.algorithm.name,
        )
    try:
        deploy_when_trained(cloud, run_dir, quality=lambda: last_quality(recorder.rows))
    except EstuaryError as err:
        log.error("%s", err)
        return EXIT_ERROR
    serve_metrics(cloud, cfg)
    if resumed is None:
        cloud.clear_deployment()  # an earlier run's under this name is not this run's
        cloud.metrics.phase.state("scoring")  # the demo's bar says so, not "waiting"
        recorder.evaluate_start()  # the start's grid and quality: what the rounds change
    cloud.start()
    log.info("cloud session %s waiting for %d devices", cloud.session, cfg.federation.num_devices)

    def write_outputs() -> None:
        plot_report(recorder.rows, run_dir / "report.png", title=f"{cfg.run.name} (MQTT)")
        summary = {
            "rounds": cloud.round,
            "results": headline(recorder.rows),
            "wall_s": round(time.monotonic() - started, 1),
            "final_model_sha256": cloud.model_sha,
            "model_params": cloud.model_params(),
            "arch": plan_doc(cloud.plan),
            "resumed_after_round": start_round if resumed else None,  # from 1
            "traffic": bus.traffic.snapshot(),
            "transport": bus.traffic.transport(),
        }
        if cloud.final is not None:  # a one-shot algorithm's product and its figures
            summary["final"] = {"preset": cloud.final.preset, **cloud.final.report}
        atomic_write(run_dir / "summary.json", json.dumps(summary, indent=2).encode())
        log.info("run complete: final global model %s; outputs in %s", cloud.model_sha, run_dir)

    staying = False

    def finished() -> bool:
        """Done, failed, or (``--stay``) done and the outputs written: keep serving."""
        nonlocal staying
        if cloud.failed is not None:
            return True
        if cloud.done and args.stay and not staying:
            staying = True
            if cloud.round >= cloud.rounds:
                write_outputs()
            log.info(
                "run done; staying up (--stay) for /metrics, the retained state and the "
                "deployed model's blobs until stopped"
            )
        return cloud.done and not args.stay

    code = run_until_done(cloud, bus, finished)
    if cloud.failed is not None:
        log.error("cloud stopped: %s", cloud.failed)
        return EXIT_ERROR
    if cloud.done and cloud.round >= cloud.rounds:
        write_outputs()  # again after --stay: the traffic until the end
    elif cloud.done:  # stopped before the last round: no device registered in time
        log.error("cloud stopped after round %d of %d", cloud.round, cloud.rounds)
        return EXIT_ERROR
    return code
