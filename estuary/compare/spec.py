"""The comparison config (TOML, described in :mod:`estuary.compare`): its methods, the split
and seed they share, and what running them produces (:class:`MethodRun`,
:class:`CompareResult`)."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloud.service import sample_participants
from shared.config import RunConfig, apply_env_overrides, config_from_dict
from shared.config.algorithms import config_class
from shared.config.legacy import FLAT_KEYS
from shared.data.partition import split_dataset
from shared.diffusion.training import num_local_steps
from shared.errors import ConfigError
from shared.families import family_of
from shared.metrics.accounting import Distances
from shared.models.plan import ChannelPlan
from shared.naming import device_name

#: run-config keys every method shares (the data split and the seed), named in errors
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
    plan: ChannelPlan | None
    wall_s: float
    steps: list[int]  # local steps per round, all devices
    #: torch's intra-op threads in the process that ran it (None: a record from before this
    #: was kept). The float reduction order, hence the trajectory, depends on it: FedAvg (E=1)
    #: of compare_cpu_tiny_xlong.toml on one thread and on two differs by up to 30 FID
    threads: int | None = None
    #: whether it ran with deterministic kernels only (``compute.deterministic``; None: a
    #: record from before this was kept): a GPU run repeats bit for bit only then
    deterministic: bool | None = None
    #: the run's final figures (:attr:`estuary.simulate.SimulationResult.final`; a
    #: centralized classifier's from :func:`~estuary.compare.runner.run_centralized`): the
    #: product's ``preset``, its ``accuracy`` per domain and ``mean_accuracy`` (and FedDEO's
    #: ``accuracy_by_n``, ...); None when the run reports none
    final: dict[str, Any] | None = None


# -- config ----------------------------------------------------------------------------------
def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in table.items():
        key = f"{prefix}{k}"
        out.update(_flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def apply_overrides(base: dict[str, Any], overrides: dict[str, Any], label: str) -> dict[str, Any]:
    """A copy of ``base`` with dotted ``section.key`` overrides set (a method's settings:
    ``algorithm.<name>.key``); unknown keys are errors."""
    merged = copy.deepcopy(base)
    for key, value in _flatten(overrides).items():
        section, _, name = key.partition(".")
        fields = RunConfig.model_fields
        if section not in fields or not name:
            raise ConfigError(
                f"method {label!r}: unknown override key {key!r}; use 'section.key' with a "
                f"section of {sorted(fields)}"
            )
        target = merged.setdefault(section, {})
        table, _, table_key = name.partition(".")
        known = fields[section].annotation.model_fields  # type: ignore[union-attr]
        if section == "algorithm" and table_key and table in known:  # a method's table
            cls = config_class(table)
            if table_key not in cls.model_fields:
                raise ConfigError(
                    f"method {label!r}: unknown override key {key!r} (no {table_key!r} in "
                    f"[algorithm.{table}]; known: {', '.join(sorted(cls.model_fields))})"
                )
            target = target.setdefault(table, {})
            target[table_key] = value
            continue
        legacy = section == "algorithm" and name in FLAT_KEYS  # format 1's flat key
        if "." in name or (name not in known and not legacy):
            raise ConfigError(
                f"method {label!r}: unknown override key {key!r} (no {name!r} in [{section}]; "
                f"known: {', '.join(sorted(known))})"
            )
        target[name] = value
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
    settings = cfg.algorithm.config()  # a pruned ceiling takes its method's pruning
    classifier = family_of(cfg.model.preset).quality == "accuracy"
    if centralized and classifier and (ema or settings.prunes):
        raise ConfigError(
            f"{path}: method {label!r}: a centralized classifier (cross-entropy on the pooled "
            "data) takes no 'ema' and no pruning"
        )
    flat_ratio = data.get("algorithm", {}).get("prune_ratio", 0)  # format 1's flat key
    if centralized and not settings.prunes and isinstance(flat_ratio, (int, float)) and flat_ratio:
        raise ConfigError(
            f"{path}: method {label!r}: algorithm.prune_ratio is FedPhD's setting "
            "(algorithm.fedphd.prune_ratio): a pruned centralized ceiling names fedphd "
            '("algorithm.name" = "fedphd")'
        )
    if centralized:
        try:
            settings.check_centralized()
        except ValueError as err:
            raise ConfigError(f"{path}: method {label!r}: {err}") from None
    return Method(label, slug, cfg, centralized, float(ema))


def parse_compare(
    raw: dict[str, Any], path: Path, env: dict[str, str] | None = None
) -> CompareSpec:
    """Validate a comparison config (already parsed TOML); see :mod:`estuary.compare`."""
    unknown = set(raw) - {"compare", "base", "method"}
    if unknown & {"run", "federation", "model", "train"}:
        raise ConfigError(f"{path} is a run config; `estuary compare` takes a comparison "
                          "([compare], [base] and [[method]] tables, see configs/compare/), "
                          f"`estuary simulate {path}` runs this one")  # fmt: skip
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


# -- local steps -----------------------------------------------------------------------------
def steps_per_round(cfg: RunConfig, sizes: list[int]) -> list[int]:
    """Local steps of every round, summed over that round's participants (as the cloud
    samples them)."""
    names = [device_name(i) for i in range(len(sizes))]
    out = []
    for r in range(cfg.run.rounds):
        chosen = sample_participants(names, cfg.federation.participation, cfg.run.seed, r)
        out.append(sum(num_local_steps(sizes[names.index(d)], cfg.train) for d in chosen))
    return out


def device_sizes(cfg: RunConfig) -> list[int]:
    """How many samples each device holds under ``cfg``'s split."""
    return [len(p) for p in split_dataset(cfg, domains=False)[1]]  # sizes only: no transform


@dataclass
class CompareResult:
    """Where the comparison went and its table rows."""

    out: Path
    rows: list[dict[str, Any]]  # empty until every method has a record
    runs: list[MethodRun]
    missing: list[str] = field(default_factory=list)  # labels not run yet (``only``)
