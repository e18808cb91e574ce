"""``estuary compare``: several methods on the same data split and seed, one table, two plots.

The config is TOML: a base run config and a list of methods, each a label plus overrides::

    [compare]
    name = "my-compare"    # default: the file's stem (and runs/<name> without --out)
    reference = "FedAvg"   # ratios and the equal-compute window (default: first federated)
    d_e = 1.0              # distances of the weighted cost (FedPhD: d_c = 10 d_e)
    d_c = 10.0

    [base.run]             # any run config (or: base = "configs/some_run.toml")
    seed = 0
    ...

    [[method]]
    label = "FedPhD"
    overrides = {"algorithm.name" = "fedphd", "federation.cloud_every" = 5}

    [[method]]
    label = "Centralized"
    centralized = true     # one model on the pooled data of all devices, same local steps
    ema = 0.999            # optional: evaluate an average of its weights (the paper's
                           # centralized baseline uses EMA; its federated methods do not)

    [[method]]
    label = "Centralized (s_p=0.44)"
    centralized = true     # the ceiling of a pruned architecture: pruned once at init
    overrides = {"algorithm.prune_ratio" = 0.44, "algorithm.prune_at" = "init"}

Overrides are dotted ``section.key`` names (an ``[method.overrides]`` sub-table, or nested
tables, work too); an unknown section or key is a :class:`ConfigError` naming it.

``ESTUARY__SECTION__KEY`` environment overrides apply to the base; a method's overrides win.
Methods may not change the split (``data.*``, ``federation.num_devices``, ``run.seed``).
The output directory gets one run directory per method, ``table.md``/``.csv``/``.json``
(:mod:`shared.metrics.accounting` defines every byte and cost column) and ``quality.png`` /
``bytes.png``. Rounds differ in length between methods (FedAvg with E = 5 trains five times
longer per round than E = 1), so both plots put total local steps (all devices) on the x axis.

A finished method leaves ``<slug>/method.json`` (its rows, traffic, plan and timing, keyed by
the config digest and the content hash of the ``model.init`` file). Running the same
comparison into the same directory again reuses every method whose record matches and runs
the rest, so a long comparison that was interrupted (or split over several time-limited
sessions) picks up where it stopped; ``fresh=True`` (``--fresh``) runs everything again. A
record that does not parse or belongs to another config is ignored with the reason printed,
and that method runs.

``only`` (``--only LABEL``, repeatable) runs just those methods; the others are reused where
they have a record, and the tables and plots are written once every method has one (until
then the missing ones are named). ``jobs`` (``--jobs N``) runs up to N methods at once, each
in its own ``estuary compare --only`` process with ``1/N`` of the CPUs it may use (unless
``train.threads`` says otherwise) and its output in ``<slug>/compare.log``; the parent reads
back their records, so a method that fails leaves the others' records for the next run.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cloud.service import sample_participants
from estuary.launcher import stop_processes
from shared.algorithms import make_algorithm
from shared.atomic import atomic_write
from shared.config import RunConfig, apply_env_overrides, config_from_dict
from shared.data.datasets import to_model_input
from shared.data.partition import split_dataset
from shared.diffusion.schedule import make_train_scheduler
from shared.diffusion.training import (
    WeightAverage,
    make_optimizer,
    num_local_steps,
    resolve_device,
    set_deterministic,
    train_local,
)
from shared.errors import ConfigError, EstuaryError
from shared.evaluation.evaluator import Evaluator
from shared.evaluation.recorder import prepare_run_dir
from shared.evaluation.report import plot_report
from shared.lifetime import die_with_parent_preexec
from shared.metrics import accounting as acc
from shared.metrics.accounting import Distances
from shared.models.checkpoint import save_checkpoint
from shared.models.init import init_fingerprint, initial_unet
from shared.models.plan import build_model, channel_plan
from shared.models.presets import check_trainable, model_info
from shared.models.pruning import PRUNING_RECIPE, prune_unet
from shared.naming import device_name
from shared.runtime.cpu import cpu_budget, set_torch_threads
from shared.runtime.process import interrupts_as_keyboard

SPLIT_KEYS = ("data", "federation.num_devices", "run.seed")


@dataclass(frozen=True)
class Method:
    """One row of the comparison: a label, its run config, and how it trains."""

    label: str
    slug: str
    cfg: RunConfig
    centralized: bool = False
    #: decay of the weight average a centralized method is evaluated with (0: none)
    ema: float = 0.0


@dataclass(frozen=True)
class CompareSpec:
    """A parsed comparison config."""

    name: str
    methods: list[Method]
    reference: str
    distances: Distances = field(default_factory=Distances)
    #: the TOML it was read from (None when parsed from a dict): what ``jobs`` > 1 re-reads
    source: Path | None = None


@dataclass
class MethodRun:
    """What running one method produced."""

    method: Method
    run_dir: Path
    rows: list[dict[str, Any]]
    traffic: dict[str, Any]
    plan: dict[str, Any] | None
    wall_s: float
    steps: list[int]  # local steps per round, all devices
    #: torch's intra-op threads in the process that ran it (None: a record from before this
    #: was kept). The float reduction order, hence the trajectory, depends on it: FedAvg (E=1)
    #: of compare_cpu_tiny_xlong.toml on one thread and on two differs by up to 30 FID
    threads: int | None = None
    #: whether it ran with deterministic kernels only (``compute.deterministic``; None: a
    #: record from before this was kept): a GPU run repeats bit for bit only then
    deterministic: bool | None = None


# -- config ----------------------------------------------------------------------------------
def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in table.items():
        key = f"{prefix}{k}"
        out.update(_flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def apply_overrides(base: dict[str, Any], overrides: dict[str, Any], label: str) -> dict[str, Any]:
    """A copy of ``base`` with dotted ``section.key`` overrides set; unknown keys are errors."""
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, value in _flatten(overrides).items():
        section, _, name = key.partition(".")
        fields = RunConfig.model_fields
        if section not in fields or not name or "." in name:
            raise ConfigError(
                f"method {label!r}: unknown override key {key!r}; use 'section.key' with a "
                f"section of {sorted(fields)}"
            )
        known = fields[section].annotation.model_fields  # type: ignore[union-attr]
        if name not in known:
            raise ConfigError(
                f"method {label!r}: unknown override key {key!r} (no {name!r} in [{section}]; "
                f"known: {', '.join(sorted(known))})"
            )
        merged.setdefault(section, {})[name] = value
    return merged


def _slug(label: str, taken: set[str]) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")[:48] or "method"
    out, i = slug, 2
    while out in taken:
        out, i = f"{slug}-{i}", i + 1
    taken.add(out)
    return out


def _split_of(cfg: RunConfig) -> dict[str, Any]:
    return {
        "data": cfg.data.model_dump(),
        "federation.num_devices": cfg.federation.num_devices,
        "run.seed": cfg.run.seed,
    }


def _read_base(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    base = raw.get("base", {})
    if isinstance(base, str):
        file = (path.parent / base) if not Path(base).is_absolute() else Path(base)
        try:
            base = tomllib.loads(file.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ConfigError(f"{path}: cannot read base config {file}: {err}") from None
    if not isinstance(base, dict):
        raise ConfigError(f"{path}: 'base' must be a table of run-config sections or a path")
    bad = sorted(k for k, v in base.items() if not isinstance(v, dict))
    if bad:
        raise ConfigError(f"{path}: base sections {bad} must be tables ([base.{bad[0]}])")
    return base


def _method(entry: Any, i: int, base: dict[str, Any], path: Path, taken: set[str]) -> Method:
    if not isinstance(entry, dict) or not isinstance(entry.get("label"), str):
        raise ConfigError(f"{path}: [[method]] #{i + 1} needs a string 'label'")
    label = entry["label"].strip()
    unknown = set(entry) - {"label", "overrides", "centralized", "ema"}
    if not label or unknown:
        raise ConfigError(
            f"{path}: method {label!r}: empty label or unknown keys {sorted(unknown)}"
        )
    overrides = entry.get("overrides", {})
    if not isinstance(overrides, dict):
        raise ConfigError(f"{path}: method {label!r}: 'overrides' must be a table")
    centralized = entry.get("centralized", False)
    if not isinstance(centralized, bool):
        raise ConfigError(
            f"{path}: method {label!r}: 'centralized' must be true or false, got {centralized!r}"
        )
    ema = entry.get("ema", 0.0)
    if type(ema) not in (int, float) or not 0.0 <= ema < 1.0:
        raise ConfigError(f"{path}: method {label!r}: 'ema' must be a number in [0, 1), "
                          f"got {ema!r}")  # fmt: skip
    if ema and not centralized:
        raise ConfigError(
            f"{path}: method {label!r}: 'ema' is for centralized training only (FedPhD's "
            "distributed methods do not average weights over time)"
        )
    slug = _slug(label, taken)
    data = apply_overrides(base, {"run.name": slug, **overrides}, label)
    cfg = config_from_dict(data, source=f"{path} method {label!r}")
    algo = cfg.algorithm
    if centralized and algo.prune_ratio > 0 and algo.prune_at != "init":
        raise ConfigError(
            f"{path}: method {label!r}: centralized training has no sparse rounds, so it "
            "prunes only before its first step: set algorithm.prune_at = 'init' (and "
            "algorithm.sparse_rounds = 0)"
        )
    return Method(label, slug, cfg, centralized, float(ema))


def parse_compare(
    raw: dict[str, Any], path: Path, env: dict[str, str] | None = None
) -> CompareSpec:
    """Validate a comparison config (already parsed TOML); see the module docstring."""
    unknown = set(raw) - {"compare", "base", "method"}
    if unknown:
        raise ConfigError(f"{path}: unknown top-level keys {sorted(unknown)}")
    opts = raw.get("compare", {})
    if not isinstance(opts, dict):
        raise ConfigError(f"{path}: [compare] must be a table, got {type(opts).__name__}")
    extra = set(opts) - {"name", "reference", "d_e", "d_c"}
    if extra:
        raise ConfigError(f"{path}: unknown keys in [compare]: {sorted(extra)}")
    base = apply_env_overrides(_read_base(raw, path), env or {})
    entries = raw.get("method", [])
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: no [[method]] entries")
    taken: set[str] = set()
    methods = [_method(e, i, base, path, taken) for i, e in enumerate(entries)]
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"{path}: duplicate method labels in {labels}")
    split = _split_of(methods[0].cfg)
    for m in methods[1:]:
        for key, value in _split_of(m.cfg).items():
            if value != split[key]:
                raise ConfigError(
                    f"{path}: method {m.label!r} changes {key}; every method must use the same "
                    f"split and seed ({', '.join(SPLIT_KEYS)} belong in the base)"
                )
    federated = [m.label for m in methods if not m.centralized]
    reference = opts.get("reference", federated[0] if federated else labels[0])
    if reference not in federated:
        raise ConfigError(f"{path}: reference {reference!r} is not a federated method {federated}")
    try:
        dist = Distances(float(opts.get("d_e", 1.0)), float(opts.get("d_c", 10.0)))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{path}: bad distances in [compare]: {err}") from None
    return CompareSpec(str(opts.get("name", path.stem)), methods, reference, dist)


def load_compare(path: str | Path) -> CompareSpec:
    """Read and validate a comparison TOML."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"comparison config not found: {p}")
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot parse {p}: {err}") from None
    return dataclasses.replace(parse_compare(raw, p, dict(os.environ)), source=p.resolve())


# -- running ---------------------------------------------------------------------------------
def steps_per_round(cfg: RunConfig, sizes: list[int]) -> list[int]:
    """Local steps of every round, summed over that round's participants (as the cloud
    samples them)."""
    names = [device_name(i) for i in range(len(sizes))]
    out = []
    for r in range(cfg.run.rounds):
        chosen = sample_participants(names, cfg.federation.participation, cfg.run.seed, r)
        out.append(sum(num_local_steps(sizes[names.index(d)], cfg.train) for d in chosen))
    return out


def _device_sizes(cfg: RunConfig) -> list[int]:
    """How many samples each device holds under ``cfg``'s split."""
    return [len(p) for p in split_dataset(cfg)[1]]


def run_centralized(
    cfg: RunConfig,
    run_dir: Path,
    *,
    evaluate: bool,
    progress: bool,
    ema: float = 0.0,
    init: str | None = None,
) -> tuple[list[dict[str, Any]], list[int], dict[str, Any] | None]:
    """The ceiling: one model on the pooled data of every device, trained for the local
    steps the federation would run (round by round), evaluated at the same rounds; returns
    the rows, the steps per round and the channel plan (None: dense).

    With ``algorithm.prune_ratio`` > 0 (``prune_at = "init"``) the initial model is pruned
    first, as FedPhD-OS prunes it (``algorithm.prune_method``, seed ``run.seed``): the
    ceiling of that architecture, which separates what pruning costs from what federating
    costs.

    It is ordinary centralized training: one optimizer for the whole run (its state carries
    over the evaluation points). With ``ema`` > 0 the evaluated and checkpointed model is the
    exponential moving average of the weights
    (:class:`~shared.diffusion.training.WeightAverage`), as in FedPhD's centralized baseline
    (seed 000, section V-A, after Ho et al.). ``init`` is
    the fingerprint of ``model.init`` its checkpoint records (the caller took it already)."""
    set_torch_threads(cfg.train.threads)
    set_deterministic(cfg.compute.deterministic)
    prepare_run_dir(cfg, run_dir)
    data, parts = split_dataset(cfg, progress=progress)
    pooled = to_model_input(data.images[np.unique(np.concatenate(parts))])
    steps = steps_per_round(cfg, [len(p) for p in parts])
    model = initial_unet(cfg.model.preset, cfg.model.init, seed=cfg.run.seed)
    plan: dict[str, Any] | None = None
    algo = cfg.algorithm
    if algo.prune_ratio > 0:
        with torch.no_grad():
            model = prune_unet(model, algo.prune_ratio, method=algo.prune_method,
                               seed=cfg.run.seed)  # fmt: skip
        plan = channel_plan(model)
    scheduler = make_train_scheduler(cfg.diffusion)
    device = resolve_device(cfg.compute.device)
    gen = torch.Generator().manual_seed(
        int(np.random.SeedSequence([cfg.run.seed, 0xCE7]).generate_state(1)[0])
    )
    every = cfg.eval.every
    evaluator = Evaluator(cfg, device) if evaluate and every else None
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg.train)
    average = WeightAverage(model, ema) if ema > 0 else None
    rows: list[dict[str, Any]] = []
    pending = 0
    for r, n in enumerate(steps):
        pending += n
        last = r + 1 == len(steps)
        if not (last or (every and (r + 1) % every == 0)):
            continue
        result = train_local(
            model, pooled, cfg.train, scheduler, gen, steps=pending, device=device,
            optimizer=opt, after_step=average.update if average is not None else None,
        )  # fmt: skip
        row: dict[str, Any] = {"round": r, "train_loss": result.mean_loss, "steps": pending}
        pending = 0
        if evaluator is not None:
            row["quality"] = evaluator.evaluate(
                average.averaged() if average is not None else model.eval()
            )
        rows.append(row)
        if progress:
            fid = row.get("quality", {}).get("fid")
            shown = f", FID {fid:.2f}" if fid is not None else ""
            print(f"  centralized round {r + 1}/{len(steps)}: loss {result.mean_loss:.4f}{shown}")
    final = average.averaged() if average is not None else model
    save_checkpoint(run_dir / "checkpoints", len(steps) - 1, final.state_dict(), cfg,
                    plan=plan, init=init)  # fmt: skip
    atomic_write(run_dir / "metrics.jsonl", "".join(json.dumps(x) + "\n" for x in rows).encode())
    plot_report(rows, run_dir / "report.png", title=f"{cfg.run.name} (centralized)")
    return rows, steps, plan


def run_method(
    m: Method,
    out: Path,
    *,
    evaluate: bool,
    progress: bool,
    sizes: list[int] | None = None,
    init: str | None = None,
) -> MethodRun:
    """Simulate (or train centrally) one method into ``out / m.slug``, and record it there
    (``method.json``) once it has finished. ``sizes`` (the devices' sample counts, shared
    by every method of a comparison) saves splitting the data again to count steps; ``init``
    is the :func:`~shared.models.init.init_fingerprint` taken before the run (default: now)."""
    from estuary.simulate import simulate

    init = init or _fingerprint(m)
    run_dir = out / m.slug
    (run_dir / RECORD).unlink(missing_ok=True)  # an interrupted rerun must not look finished
    t0 = time.perf_counter()
    if m.centralized:
        rows, steps, plan = run_centralized(
            m.cfg, run_dir, evaluate=evaluate, progress=progress, ema=m.ema, init=init
        )
        run = MethodRun(m, run_dir, rows, {}, plan, time.perf_counter() - t0, steps)
    else:
        res = simulate(m.cfg, run_dir, progress=progress, evaluate=evaluate)
        steps = steps_per_round(m.cfg, sizes or _device_sizes(m.cfg))
        run = MethodRun(
            m, run_dir, res.rows, res.traffic, res.plan, time.perf_counter() - t0, steps
        )
    run.threads = torch.get_num_threads()  # as the run set them (train.threads)
    run.deterministic = torch.are_deterministic_algorithms_enabled()
    save_record(run, evaluate=evaluate, init=init)
    return run


# -- finished-method records ----------------------------------------------------------------
#: file name of a finished method's record, inside its run directory
RECORD = "method.json"
#: version tag of the record; another tag is not reused
RECORD_FORMAT = "estuary.compare-method/1"
#: a record larger than this is not read (rows of 10,000 rounds are well under it)
RECORD_MAX_BYTES = 64 * 2**20
#: what a record written before a key existed implies for it (earlier runs trained in fp32)
RECORD_DEFAULTS: dict[str, Any] = {"precision": "fp32"}
#: :func:`load_record`'s reason when the method has not finished before (nothing to report)
NO_RECORD = "no finished run"


def _training_key(m: Method) -> dict[str, Any]:
    """What a method's record must match beyond its config digest: how a centralized method
    trained (a record from before one optimizer per run and the weight average lacks it, so
    reruns), the pruning recipe of a method that prunes, which folders a folder run read
    (``data.local_dir`` and ``eval.reference_dir`` are per-process settings, outside the
    digest), and the precision it trained in (``train.precision``, per process too)."""
    key: dict[str, Any] = {"precision": m.cfg.train.precision}
    if m.centralized:
        key["centralized_training"] = {"optimizer": "one per run", "ema": m.ema}
    algo = m.cfg.algorithm
    if algo.prune_ratio > 0 and (m.centralized or algo.name == "fedphd"):
        # a record of another recipe (or of a centralized method that versions before the
        # pruned ceiling trained dense) lacks this key or differs in it, so reruns
        key["pruning"] = PRUNING_RECIPE
    if m.cfg.data.dataset == "folder":
        key["folders"] = [str(Path(d).resolve()) if d else ""
                          for d in (m.cfg.data.local_dir, m.cfg.eval.reference_dir)]  # fmt: skip
    return key


def _fingerprint(m: Method) -> str:
    return init_fingerprint(m.cfg.model.preset, m.cfg.model.init)


def save_record(run: MethodRun, *, evaluate: bool, init: str | None = None) -> None:
    """Write ``run``'s record atomically, so a later comparison can reuse it; ``init`` is the
    fingerprint of the weights the run started from (default: the file as it is now)."""
    doc = {
        "format": RECORD_FORMAT,
        "label": run.method.label,
        "digest": run.method.cfg.digest(),
        "init": init or _fingerprint(run.method),
        "centralized": run.method.centralized,
        **_training_key(run.method),
        "evaluate": evaluate,
        "rows": run.rows,
        "traffic": run.traffic,
        "plan": run.plan,
        "wall_s": run.wall_s,
        "steps": run.steps,
        "torch_threads": run.threads,
        "deterministic": run.deterministic,
    }
    atomic_write(run.run_dir / RECORD, json.dumps(doc).encode())


def load_record(
    m: Method, run_dir: Path, *, evaluate: bool, init: str | None = None
) -> tuple[MethodRun | None, str]:
    """``m``'s finished run from ``run_dir / method.json``, or None and why it is not usable
    (``init``: ``m``'s init fingerprint, if the caller has it already)."""
    path = run_dir / RECORD
    if not path.is_file():
        return None, NO_RECORD
    if path.stat().st_size > RECORD_MAX_BYTES:
        return None, f"{path} is larger than {RECORD_MAX_BYTES} bytes"
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"{path} is not JSON ({e})"
    if not isinstance(doc, dict) or doc.get("format") != RECORD_FORMAT:
        return None, f"{path} is not a {RECORD_FORMAT} record"
    want = {
        "label": m.label,
        "digest": m.cfg.digest(),
        "init": init or _fingerprint(m),
        "centralized": m.centralized,
        **_training_key(m),
        # an evaluated run serves a comparison without evaluation too (its FID is kept)
        "evaluate": evaluate or doc.get("evaluate") is True,
    }
    for key, value in want.items():
        got = doc.get(key, RECORD_DEFAULTS.get(key))
        if got != value:
            return None, f"{path} has {key} {got!r}, this comparison {value!r}"
    rows, traffic, plan, wall_s, steps = (
        doc.get(k) for k in ("rows", "traffic", "plan", "wall_s", "steps")
    )
    bad = f"{path}: rows, traffic, plan, wall_s or steps malformed"
    if not (
        isinstance(rows, list)
        and isinstance(traffic, dict)
        and (plan is None or isinstance(plan, dict))
        and isinstance(wall_s, (int, float))
        and isinstance(steps, list)
    ):
        return None, bad
    rows_ok = all(isinstance(r, dict) and isinstance(r.get("round"), int) for r in rows)
    steps_ok = len(steps) == m.cfg.run.rounds and all(isinstance(n, int) and n >= 0 for n in steps)
    if not (rows_ok and steps_ok):
        return None, bad
    threads = doc.get("torch_threads")
    if not (threads is None or (type(threads) is int and threads > 0)):
        return None, f"{path}: torch_threads {threads!r} is not a positive integer"
    deterministic = doc.get("deterministic")
    if not (deterministic is None or isinstance(deterministic, bool)):
        return None, f"{path}: deterministic {deterministic!r} is not true or false"
    run = MethodRun(m, run_dir, rows, traffic, plan, float(wall_s), steps, threads=threads,
                    deterministic=deterministic)  # fmt: skip
    return run, "finished earlier"


@dataclass
class CompareResult:
    """Where the comparison went and its table rows."""

    out: Path
    rows: list[dict[str, Any]]  # empty until every method has a record
    runs: list[MethodRun]
    missing: list[str] = field(default_factory=list)  # labels not run yet (``only``)


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
    """Run every method (reusing those already finished in ``out`` unless ``fresh``), then
    write the tables and the plots (``tables``) once every method has a record.

    ``only``: labels of the methods to run (the rest only reused); ``jobs``: how many run at
    once, each in its own process (see the module docstring). Raises
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
        check_trainable(m.cfg.model.preset)
    out.mkdir(parents=True, exist_ok=True)
    n = len(spec.methods)
    done: dict[str, MethodRun] = {}
    todo: list[tuple[int, Method, str]] = []  # (position, method, init fingerprint)
    for i, m in enumerate(spec.methods, 1):
        if only and m.label not in only and not tables:
            continue  # read back only for the table (a job of --jobs reads none)
        init = _fingerprint(m)  # once per method, before it runs: the weights it starts from
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
        done.update(_run_jobs(spec, out, todo, jobs, evaluate=evaluate, progress=progress))
    else:
        sizes: list[int] | None = None  # the split is the same for every method: count it once
        for i, m, init in todo:
            if progress:
                kind = "centralized" if m.centralized else m.cfg.algorithm.name
                print(f"[{i}/{n}] {m.label} ({kind}, {m.cfg.run.rounds} rounds)")
            if sizes is None and not m.centralized:
                sizes = _device_sizes(m.cfg)
            run = run_method(m, out, evaluate=evaluate, progress=progress, sizes=sizes, init=init)
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


#: how often the parent of ``jobs`` looks at its children, and how long a child it stops
#: (Ctrl-C, ``kill``, or an error in the parent) gets to exit before it is killed
JOB_POLL_S = 0.5
JOB_STOP_S = 10.0


def _job_threads(jobs: int) -> str:
    """The CPU threads each of ``jobs`` processes gets (an equal share of
    :func:`~shared.runtime.cpu.cpu_budget`, at least one)."""
    return str(max(1, cpu_budget() // jobs))


def _run_jobs(
    spec: CompareSpec,
    out: Path,
    todo: list[tuple[int, Method, str]],
    jobs: int,
    *,
    evaluate: bool,
    progress: bool,
) -> dict[str, MethodRun]:
    """Run ``todo`` in up to ``jobs`` child processes (``estuary compare --only LABEL``) and
    read back their records; every child is stopped if this one is interrupted (Ctrl-C, or
    SIGTERM, which unwinds the same way)."""
    assert spec.source is not None
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, _job_threads(jobs))  # torch's default intra-op threads
    queue = list(todo)
    running: dict[subprocess.Popen[bytes], tuple[int, Method, str, Path, float]] = {}
    finished: dict[str, MethodRun] = {}
    failed: list[str] = []
    n = len(spec.methods)
    main = threading.current_thread() is threading.main_thread()  # signals are set there only
    with interrupts_as_keyboard() if main else contextlib.nullcontext():
        try:
            while queue or running:
                while queue and len(running) < jobs:
                    i, m, init = queue.pop(0)
                    log_path = out / m.slug / "compare.log"
                    log_path.parent.mkdir(parents=True, exist_ok=True)
                    cmd = [sys.executable, "-m", "estuary", "compare", str(spec.source),
                           "--out", str(out), "--only", m.label, "--fresh", "--no-table",
                           *(() if evaluate else ("--no-eval",))]  # fmt: skip
                    with log_path.open("wb") as log_file:
                        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=env,
                                                preexec_fn=die_with_parent_preexec())  # fmt: skip
                    running[proc] = (i, m, init, log_path, time.perf_counter())
                    if progress:
                        kind = "centralized" if m.centralized else m.cfg.algorithm.name
                        print(f"[{i}/{n}] {m.label} ({kind}, {m.cfg.run.rounds} rounds): "
                              f"started, output in {log_path}")  # fmt: skip
                time.sleep(JOB_POLL_S)
                for proc in [p for p in running if p.poll() is not None]:
                    i, m, init, log_path, t0 = running.pop(proc)
                    run, why = None, f"exit status {proc.returncode}"
                    if proc.returncode == 0:
                        run, why = load_record(m, out / m.slug, evaluate=evaluate, init=init)
                    if run is None:
                        failed.append(f"{m.label} ({why}; see {log_path})")
                        if progress:
                            took = time.perf_counter() - t0
                            print(f"[{i}/{n}] {m.label} FAILED after {took:.1f} s: {why}")
                        continue
                    finished[m.label] = run
                    if progress:
                        print(f"[{i}/{n}] {m.label} done in {run.wall_s:.1f} s")
        finally:
            stop_processes({m.label: p for p, (_, m, *_) in running.items()}, JOB_STOP_S)
    if failed:
        raise EstuaryError(
            f"{len(failed)} method(s) failed: {'; '.join(failed)}. The methods that finished "
            f"kept their records in {out}: the same command runs only the rest"
        )
    return finished


# -- the table -------------------------------------------------------------------------------
#: evaluations averaged in the "FID, mean of last k" column: one FID on a few hundred samples
#: swings by tens of points between neighbouring evaluations (up to 70 on 500 samples in
#: benchmarks/results/compare_cpu_tiny_xlong/), so a ranking read off the last one alone is
#: fragile where the curves have flattened
LAST_EVALS = 3
#: (key, header, decimals) of every table column; table.md, .csv and .json share the keys
COLUMNS: list[tuple[str, str, int]] = [
    ("method", "method", 0),
    ("algorithm", "algorithm", 0),
    ("fid", "FID", 2),
    ("fid_best", "best FID", 2),
    ("fid_last", f"FID, mean of last {LAST_EVALS}", 2),
    ("is", "IS", 2),
    ("params_m", "params (M)", 3),
    ("gmacs", "MACs (G)", 4),
    ("model_mib", "model MiB (V)", 3),
    ("cloud_mib_per_agg", "cloud-link MiB/agg", 3),
    ("cloud_mib_per_agg_analytic", "cloud-link MiB/agg (analytic)", 3),
    ("edge_mib_per_agg", "edge-link MiB/agg", 3),
    ("weighted_per_window", "weighted cost/window", 3),
    ("paper_cost_per_window", "Table IV rule/window", 3),
    ("total_mib", "total MiB", 2),
    ("rounds", "rounds", 0),
    ("central_aggs", "central aggs", 0),
    ("local_steps", "local steps", 0),
    ("wall_s", "wall s", 1),
]


def _quality(rows: list[dict[str, Any]]) -> dict[str, Any]:
    q = [r["quality"] for r in rows if r.get("quality")]
    if not q:
        return {
            "fid": None, "fid_best": None, "fid_last": None, "is": None, "extractor": None,
            "n_fake": None, "fid_level": None,
        }  # fmt: skip
    return {
        "fid": q[-1]["fid"],
        "fid_best": min(x["fid"] for x in q),
        "fid_last": statistics.fmean(x["fid"] for x in q[-LAST_EVALS:]),
        "is": q[-1].get("is_mean"),
        "extractor": q[-1].get("extractor"),
        "n_fake": q[-1].get("n_fake"),
        # "client": the mean over the devices' own models (device-local parts)
        "fid_level": q[-1].get("level", "global"),
    }


def _algorithm(m: Method) -> str:
    a, f = m.cfg.algorithm, m.cfg.federation
    if m.centralized:
        text = f"centralized ema={m.ema!r}" if m.ema else "centralized"
        return text + (f" s_p={a.prune_ratio} OS" if a.prune_ratio > 0 else "")
    text = f"{a.name} r_e={f.edge_every} r_g={f.cloud_every}"
    if a.name == "feddiffuse":
        text += f" {a.split}"
    if a.prune_ratio > 0 and a.name == "fedphd":
        text += f" s_p={a.prune_ratio} " + (
            "OS" if a.prune_at == "init" else f"R_s={a.sparse_rounds}"
        )
    return text


def _per_participant_steps(run: MethodRun) -> float:
    c = acc.participants_per_round(run.method.cfg.federation)
    return sum(run.steps) / (len(run.steps) * c)


def _comm(run: MethodRun, spec: CompareSpec, window: float, v: int) -> dict[str, Any]:
    """Byte and cost columns of a federated run (see :mod:`shared.metrics.accounting`)."""
    cfg, d = run.method.cfg, spec.distances
    fed, flat = cfg.federation, acc.is_flat(cfg.federation)
    ps = acc.periods(run.rows)
    mean = acc.mean_bytes(acc.steady_periods(ps, str(run.rows[-1].get("arch", "dense"))))
    cloud, edge = acc.long_link_bytes(mean, flat=flat)
    pl = acc.payloads(cfg, run.plan)
    predicted = acc.analytic_period(
        fed, down=pl.down, up=pl.up, edge_state=pl.edge_state, global_state=pl.global_state
    )
    everything = acc.split_received(run.traffic.get("bytes", {}))
    s = _per_participant_steps(run)
    k_c, k_e = acc.aggregations_per_window(fed, steps_per_round=s, window_steps=window)
    paper = acc.paper_comm_cost(
        acc.mib(v), acc.participants_per_round(fed), cloud_aggs=k_c, edge_aggs=k_e,
        payload=pl.payload, d=d,
    )  # fmt: skip
    return {
        "cloud_bytes_per_agg": cloud,
        "edge_bytes_per_agg": edge,
        "cloud_mib_per_agg": acc.mib(cloud),
        "cloud_mib_per_agg_analytic": acc.mib(acc.long_link_bytes(predicted, flat=flat)[0]),
        "edge_mib_per_agg": acc.mib(edge),
        "weighted_per_window": acc.weighted_cost(mean, flat=flat, d=d) * k_c,
        "paper_cost_per_window": paper,
        "payload": pl.payload,
        "total_bytes": everything.total,
        "total_mib": acc.mib(everything.total),
        "central_aggs": len(ps),
        "steady_periods": len(acc.steady_periods(ps, str(run.rows[-1].get("arch", "dense")))),
        "flat": flat,
    }


def _no_comm() -> dict[str, Any]:
    zero = ("cloud_bytes_per_agg", "edge_bytes_per_agg", "cloud_mib_per_agg", "total_bytes")
    rest = ("cloud_mib_per_agg_analytic", "edge_mib_per_agg", "weighted_per_window")
    return {
        **dict.fromkeys(zero + rest, 0),
        "paper_cost_per_window": 0.0,
        "total_mib": 0.0,
        "central_aggs": 0,
    }


def summarize(runs: list[MethodRun], spec: CompareSpec) -> list[dict[str, Any]]:
    """One table row per run; windows of equal compute are the reference's central
    aggregation period (per-participant local steps per round x its r_g)."""
    ref = next(r for r in runs if r.method.label == spec.reference)
    window = _per_participant_steps(ref) * ref.method.cfg.federation.cloud_every
    out = []
    for run in runs:
        cfg = run.method.cfg
        info = model_info(
            cfg.model.preset, model_fn=partial(build_model, cfg.model.preset, run.plan)
        )
        row: dict[str, Any] = {
            "method": run.method.label,
            "algorithm": _algorithm(run.method),
            "centralized": run.method.centralized,
            **_quality(run.rows),
            "params": info.params,
            "params_m": info.params / 1e6,
            "macs": info.macs,
            "gmacs": info.macs / 1e9,
            "model_bytes": acc.fp32_bytes(info.params),
            "model_mib": acc.mib(acc.fp32_bytes(info.params)),
            **(_no_comm() if run.method.centralized else _comm(run, spec, window, info.fp32_bytes)),
            "rounds": cfg.run.rounds,
            "local_steps": sum(run.steps),
            "wall_s": run.wall_s,
            "torch_threads": run.threads,
            "deterministic": run.deterministic,
            "run_dir": run.run_dir.name,
            "local_parts": not run.method.centralized and make_algorithm(cfg).local_parts,
        }
        out.append(row)
    return out


def _ratios(rows: list[dict[str, Any]], reference: str) -> list[dict[str, Any]]:
    ref = next(r for r in rows if r["method"] == reference)
    keys = ("cloud_mib_per_agg", "weighted_per_window", "paper_cost_per_window", "total_mib")
    out = []
    for r in rows:
        if r["method"] == reference or r["centralized"]:
            continue
        ratio = {k: (r[k] / ref[k] if ref[k] else None) for k in keys}
        out.append({"method": r["method"], **ratio})
    return out


def _fmt(value: Any, decimals: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{decimals}f}"
    return str(value)


def markdown(rows: list[dict[str, Any]], spec: CompareSpec) -> str:
    """``table.md``: the table, the ratios to the reference and what the columns mean."""
    lines = [
        f"# {spec.name}",
        "",
        "| " + " | ".join(h for _, h, _ in COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(k), n) for k, _, n in COLUMNS) + " |")
    lines += ["", f"Relative to {spec.reference}:", ""]
    lines += [
        "| method | cloud-link bytes/agg | weighted cost/window | Table IV rule | total bytes |"
    ]
    lines += ["|---|---|---|---|---|"]
    for q in _ratios(rows, spec.reference):
        cells = [_fmt(q[k], 3) for k in list(q)[1:]]
        lines.append(f"| {q['method']} | " + " | ".join(cells) + " |")
    ex = next((r for r in rows if r.get("extractor")), None)
    d = spec.distances
    lines += [
        "",
        f"FID / IS: last evaluation ({ex['extractor']} features, {ex['n_fake']} samples); "
        f"FID, mean of last {LAST_EVALS}: the mean over the last {LAST_EVALS} evaluations "
        "(fewer where fewer were made), steadier than one evaluation"
        if ex
        else "FID / IS: not evaluated",
        *(
            [
                "FID / IS of "
                + ", ".join(clients)
                + ": means over the devices' own models (global federated parts with each "
                "device's local parts; eval.clients devices), as the paper measures them"
            ]
            if (clients := [r["method"] for r in rows if r.get("fid_level") == "client"])
            else []
        ),
        *(
            [
                "Bytes of "
                + ", ".join(local)
                + ": measured includes each device's and edge's one whole-model download (the "
                "initial local parts); the analytic column is the steady state after it"
            ]
            if (local := [r["method"] for r in rows if r.get("local_parts")])
            else []
        ),
        *(
            [
                "torch threads: "
                + ", ".join(f"{r['method']} {r.get('torch_threads') or '?'}" for r in rows)
                + " (a CPU run repeats bit for bit at the same thread count, not across counts)"
            ]
            if any(r.get("torch_threads") for r in rows)
            else []
        ),
        *(
            [
                "deterministic kernels (compute.deterministic): "
                + ", ".join(r["method"] for r in rows if r.get("deterministic"))
                + " (a GPU run repeats bit for bit only with them)"
            ]
            if any(r.get("deterministic") for r in rows)
            else []
        ),
        "MiB = 2^20 bytes (the paper's MB). V = 4 B x params of the final model. "
        "agg = one central aggregation period; per-agg and per-window figures are means over the "
        "periods trained on the final architecture, totals cover the whole run. "
        "cloud-link = bytes over the link to the cloud (edge<->cloud when r_e < r_g; "
        "device<->edge when r_e = r_g, the edges being the cloud's ingress); "
        f"weighted cost = 0.02*d_c*MiB(cloud link) + 0.002*d_e*MiB(edge link), d_e = {d.d_e}, "
        f"d_c = {d.d_c}, per window = {spec.reference}'s central aggregation of local compute; "
        "Table IV rule = V*C*payload*(k_c*0.02*d_c + k_e*0.002*d_e) "
        "(shared/metrics/accounting.py). "
        "total = every byte received (models and control messages).",
        "",
    ]
    return "\n".join(lines)


def write_tables(rows: list[dict[str, Any]], spec: CompareSpec, out: Path) -> None:
    """``table.md``, ``table.csv`` and ``table.json`` in ``out``."""
    atomic_write(out / "table.md", markdown(rows, spec).encode())
    buf = io.StringIO()
    keys = [k for k, _, _ in COLUMNS]
    writer = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(out / "table.csv", buf.getvalue().encode())
    doc = {
        "name": spec.name,
        "reference": spec.reference,
        "distances": {"d_e": spec.distances.d_e, "d_c": spec.distances.d_c},
        "columns": {k: h for k, h, _ in COLUMNS},
        "rows": rows,
        "relative": _ratios(rows, spec.reference),
    }
    atomic_write(out / "table.json", json.dumps(doc, indent=2).encode())


# -- the plots -------------------------------------------------------------------------------
def _curves(run: MethodRun, d: acc.Distances) -> dict[str, list[float]]:
    done = np.cumsum(run.steps)
    flat = acc.is_flat(run.method.cfg.federation)
    x, mib, cost = [0.0], [0.0], [0.0]  # cumulative curves start at the origin
    fid_x, fid = [], []
    total = weighted = 0.0
    for row in run.rows:
        step = float(done[row["round"]])
        b = acc.split_received(row.get("bytes", {}))
        total += acc.mib(b.total)
        weighted += acc.weighted_cost(b, flat=flat, d=d) if not run.method.centralized else 0.0
        x.append(step)
        mib.append(total)
        cost.append(weighted)
        if row.get("quality"):
            fid_x.append(step)
            fid.append(row["quality"]["fid"])
    return {"x": x, "fid_x": fid_x, "fid": fid, "mib": mib, "cost": cost}


def write_plots(runs: list[MethodRun], out: Path, d: acc.Distances) -> None:
    """``quality.png`` (FID) and ``bytes.png`` (cumulative traffic and the weighted cost at
    distances ``d``, the comparison's ``d_e``/``d_c``), every method on each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [(run.method.label, _curves(run, d)) for run in runs]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, c in curves:
        if c["fid"]:
            ax.plot(c["fid_x"], c["fid"], marker="o", ms=3, label=label)
    if not any(c["fid"] for _, c in curves):
        ax.text(0.5, 0.5, "no quality evaluation in this comparison", ha="center", va="center")
    ax.set(xlabel="local training steps, all devices (equal-compute axis)", ylabel="FID")
    ax.set_title("sample quality (lower is better)")
    _finish(fig, ax, out / "quality.png")

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for label, c in curves:
        axes[0].plot(c["x"], c["mib"], label=label)
        axes[1].plot(c["x"], c["cost"], label=label)
    axes[0].set(title="cumulative traffic (every byte received)", ylabel="MiB")
    axes[1].set(title="cumulative weighted cost (C_ne, C_ce)", ylabel="cost (MiB-weighted)")
    for a in axes:
        a.set(xlabel="local training steps, all devices")
    _finish(fig, axes, out / "bytes.png")


def _finish(fig: Any, axes: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    for a in np.atleast_1d(axes):
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write(path, buf.getvalue())
