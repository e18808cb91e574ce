"""Typed run configuration: a TOML file plus ``ESTUARY__SECTION__KEY`` environment overrides.

Every section is a frozen pydantic model that forbids unknown keys, so a typo is an error
that names the key, not a silently ignored setting. ``load_config`` returns a validated
:class:`RunConfig`; ``RunConfig.to_json`` is what gets saved beside every checkpoint.

Example override: ``ESTUARY__TRAIN__LR=3e-4 estuary simulate configs/fedavg_iid_tiny.toml``.

The ``[algorithm]`` section is assembled from each method's own settings class
(:mod:`shared.config.algorithms`); the experiment's other sections are in
:mod:`shared.config.sections`, the deployment ones in :mod:`shared.config.deployment`, all
importable from here.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import ValidationError, ValidationInfo, model_validator

from shared.config import legacy
from shared.config.algorithms import AlgorithmSection, algorithm_names, config_class
from shared.config.deployment import (
    AUTO,
    AutoBytes,
    BrokerSection,
    ComputeSection,
    DeploySection,
    MetricsSection,
)
from shared.config.sections import (
    CLASSIFIER_PRESETS,
    FEDPAC_GROUPS,
    KIND_NAMES,
    KIND_PLURALS,
    ONESHOT_PRESETS,
    DataSection,
    DiffusionSection,
    DomainName,
    EvalSection,
    FederationSection,
    ModelSection,
    PartitionName,
    RunSection,
    TrainSection,
    classifies,
    model_kind,
)
from shared.errors import ConfigError, did_you_mean
from shared.settings import Section

__all__ = [  # the sections live in shared.config.sections and shared.config.deployment
    "AUTO",
    "CLASSIFIER_PRESETS",
    "DEPLOYMENT_SECTIONS",
    "ENV_PREFIX",
    "FEDPAC_GROUPS",
    "FORMAT",
    "KIND_NAMES",
    "KIND_PLURALS",
    "ONESHOT_PRESETS",
    "PER_PROCESS_KEYS",
    "TOPOLOGY_KEYS",
    "AlgorithmSection",
    "AutoBytes",
    "BrokerSection",
    "ComputeSection",
    "DataSection",
    "DeploySection",
    "DiffusionSection",
    "DomainName",
    "EvalSection",
    "FederationSection",
    "MetricsSection",
    "ModelSection",
    "PartitionName",
    "RunConfig",
    "RunSection",
    "TrainSection",
    "algorithm_names",
    "apply_env_overrides",
    "classifies",
    "config_class",
    "config_from_dict",
    "load_config",
    "model_kind",
    "with_overrides",
]

ENV_PREFIX = "ESTUARY__"


DEPLOYMENT_SECTIONS = ("broker", "metrics", "deploy", "compute")
#: settings of other sections that are per process too (counted at their defaults)
PER_PROCESS_KEYS = (
    ("train", "threads"),
    ("train", "precision"),
    ("train", "activation_checkpointing"),
    ("train", "micro_batch"),
    ("train", "cuda_graph"),
    ("train", "cuda_graph_reuse"),
    ("data", "local_dir"),
    ("eval", "reference_dir"),
)
#: per-process keys added after format 2's digests were first recorded: left out of the
#: digest altogether, so every stored run and every role of an older version keeps its digest
LATER_PER_PROCESS_KEYS = (("train", "activation_checkpointing"), ("train", "micro_batch"))
#: settings of the experiment's sections that say where the roles connect, not what they
#: compute: left out of the digest (a run keeps its digest whichever broker layout carries it)
TOPOLOGY_KEYS = (("federation", "brokers"),)
#: the config format this code writes (:mod:`shared.config.legacy` reads format 1)
FORMAT: Literal[2] = 2


class RunConfig(Section):
    """The whole configuration of one federated run."""

    #: the config's format: 2 (``[algorithm.<name>]`` tables), or 1 (one flat, prefixed
    #: ``[algorithm]`` table, read by :mod:`shared.config.legacy`; its digest is format 1's).
    #: A config that does not say is format 1 when its ``[algorithm]`` holds a flat key,
    #: else 2.
    format: Literal[1, 2] = FORMAT
    run: RunSection = RunSection()
    federation: FederationSection = FederationSection()
    data: DataSection = DataSection()
    model: ModelSection = ModelSection()
    diffusion: DiffusionSection = DiffusionSection()
    train: TrainSection = TrainSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    eval: EvalSection = EvalSection()
    broker: BrokerSection = BrokerSection()
    metrics: MetricsSection = MetricsSection()
    deploy: DeploySection = DeploySection()
    compute: ComputeSection = ComputeSection()

    @model_validator(mode="before")
    @classmethod
    def _nest(cls, data: Any, info: ValidationInfo) -> Any:
        """Format 1's flat ``[algorithm]`` keys moved to their tables (said once per key,
        not for a stored config); ``format`` inferred where the config does not say."""
        if not isinstance(data, dict):
            return data
        algorithm = data.get("algorithm")
        flat = isinstance(algorithm, dict) and bool(legacy.flat_keys_of(algorithm))
        note = not (info.context or {}).get("stored")
        out = legacy.nest(data, note=note) if flat else dict(data)
        out.setdefault("format", 1 if flat else FORMAT)
        if out["format"] == 1:
            legacy.whole_chain(out)  # format 1's pFedGPA inverted from the whole chain
        return out

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> RunConfig:
        settings = self.algorithm.config()
        kind = model_kind(self.model.preset)
        if kind not in settings.model_kinds:
            trains = " and ".join(KIND_PLURALS[k] for k in settings.model_kinds)
            raise ValueError(
                f"algorithm {self.algorithm.name!r} trains {trains}, and model.preset = "
                f"{self.model.preset!r} is {KIND_NAMES[kind]}; train it with "
                f"{[n for n in algorithm_names() if kind in config_class(n).model_kinds]}"
            )
        settings.check_run(self)
        if self.federation.cloud_every > self.run.rounds:
            raise ValueError(
                f"federation.cloud_every (r_g={self.federation.cloud_every}) exceeds "
                f"run.rounds ({self.run.rounds}): the cloud would never aggregate and the run "
                "would end with the initial model"
            )
        if not (info.context or {}).get("stored"):
            self._check_waste()
        steps = self.diffusion.num_train_timesteps
        for section, value in (
            ("eval", self.eval.sample_steps),
            ("deploy", self.deploy.sample_steps),
        ):
            if value > steps:
                raise ValueError(
                    f"{section}.sample_steps ({value}) exceeds diffusion.num_train_timesteps "
                    f"({steps})"
                )
        return self

    def _check_waste(self) -> None:
        """Settings that would train work the run throws away. Checked when a run is
        configured, not when a stored config is read back (a checkpoint or record of a run
        made before a rule existed stays readable)."""
        rounds, r_g = self.run.rounds, self.federation.cloud_every
        if rounds % r_g:
            raise ValueError(
                f"run.rounds ({rounds}) is not a multiple of federation.cloud_every "
                f"(r_g={r_g}): the last {rounds % r_g} round(s) would train without ever "
                f"reaching the cloud's model; use {rounds - rounds % r_g} or "
                f"{rounds - rounds % r_g + r_g} rounds"
            )
        if self.data.dataset == "folder" and self.data.path and self.data.local_dir:
            raise ValueError(
                "data.path (one image folder split across the devices) and data.local_dir "
                "(each device's own folder) exclude each other; set one"
            )
        if self.data.own_folders and self.data.partition != "iid":
            raise ValueError(
                f"data.partition = {self.data.partition!r} splits one dataset across the "
                "devices, but with data.dataset = 'folder' and no data.path each device trains "
                "on its own folder as it is; leave data.partition unset (or set data.path to "
                "one image folder to split)"
            )
        self.algorithm.config().check_waste(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every value (defaults included)."""
        return self.model_dump(mode="json")

    def to_json(self) -> str:
        """Canonical JSON (sorted keys), the form saved with checkpoints."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    def digest(self) -> str:
        """Short sha256 of the canonical JSON without the deployment sections (broker,
        metrics, deploy, compute) and with the per-process keys (``train.threads``,
        ``data.local_dir``, ``eval.reference_dir``, ...) at their defaults, of which
        ``[algorithm]`` counts only the named method's table: identifies the experiment on
        the wire, wherever each role connects from and whatever it runs on. A format 1
        config keeps format 1's digest (:func:`shared.config.legacy.legacy_digest`)."""
        data = {
            k: v
            for k, v in self.to_dict().items()
            if k not in DEPLOYMENT_SECTIONS and k != "format"
        }
        # per-process keys count at their defaults, whatever this process set
        for section, key in PER_PROCESS_KEYS:
            data[section] = {**data[section], key: _default(self, section, key)}
        for section, key in (*TOPOLOGY_KEYS, *LATER_PER_PROCESS_KEYS):
            data[section] = {k: v for k, v in data[section].items() if k != key}
        if self.format == 1:
            return legacy.legacy_digest(self, data)
        name = self.algorithm.name
        data["algorithm"] = {"name": name, name: data["algorithm"][name]}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _default(cfg: RunConfig, section: str, key: str) -> Any:
    """The default of ``section.key`` (from the section's class, not from ``cfg``)."""
    return type(getattr(cfg, section)).model_fields[key].get_default(call_default_factory=True)


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The field names of the section that ``loc`` (a path of keys) sits in."""
    model: Any = RunConfig
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
        # a method's table is optional: its model is the union's member that has fields
        model = next((m for m in get_args(model) if hasattr(m, "model_fields")), model)
    return list(getattr(model, "model_fields", {}))


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        value = e.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        hint = ""
        if e["type"] == "extra_forbidden" and e["loc"]:
            hint = did_you_mean(str(e["loc"][-1]), _fields_at(tuple(e["loc"])))
        elif e["type"] == "literal_error" and isinstance(value, str):
            expected = (e.get("ctx") or {}).get("expected", "")
            hint = did_you_mean(value, re.findall(r"'([^']*)'", str(expected)))
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  - {loc}: {msg}{shown}{hint}")
    return "\n".join(lines)


def _parse_env_value(raw: str) -> Any:
    """Parse an override as a TOML value (numbers, booleans, arrays), else keep the string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_env_overrides(data: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """Return a copy of ``data`` with ``ESTUARY__SECTION__KEY`` values applied (a method's
    table: ``ESTUARY__ALGORITHM__<NAME>__KEY``)."""
    merged: dict[str, Any] = copy.deepcopy(dict(data))
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        table = len(parts) == 3 and parts[0] == "algorithm"  # a method's table
        if not (len(parts) == 2 or table) or not all(parts):
            raise ConfigError(
                f"environment override {name} must look like {ENV_PREFIX}SECTION__KEY (or "
                f"{ENV_PREFIX}ALGORITHM__<METHOD>__KEY)"
            )
        *path, key = parts
        target = merged
        for part in path:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"environment override {name}: {part} is not a section")
        target[key] = _parse_env_value(raw)
    return merged


def config_from_dict(
    data: Mapping[str, Any],
    *,
    env: Mapping[str, str] | None = None,
    source: str = "dict",
    stored: bool = False,
) -> RunConfig:
    """Validate a mapping (plus optional env overrides) into a :class:`RunConfig`;
    ``stored``: the config of a run already made (a checkpoint's), read back without the
    rules against wasted work (:meth:`RunConfig._check_waste`)."""
    merged = apply_env_overrides(data, env or {})
    try:
        return RunConfig.model_validate(merged, context={"stored": stored})
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def with_overrides(
    cfg: RunConfig,
    updates: Mapping[str, Mapping[str, Any]],
    *,
    source: str = "overrides",
    stored: bool = False,
) -> RunConfig:
    """``cfg`` with ``{section: {key: value}}`` replaced (a method's table merged key by key:
    ``{"algorithm": {"prism": {"lr": 0.2}}}``), validated like a loaded config (a
    ConfigError naming ``source`` if a value is out of range); ``stored`` as in
    :func:`config_from_dict`."""
    data = cfg.to_dict()
    for section, values in updates.items():
        target = data.setdefault(section, {})
        for key, value in values.items():
            old = target.get(key)
            merge = isinstance(value, Mapping) and isinstance(old, dict)
            target[key] = {**old, **value} if merge else value
    return config_from_dict(data, source=source, stored=stored)


def load_config(path: str | Path, *, env: Mapping[str, str] | None = None) -> RunConfig:
    """Load a TOML (or a saved JSON) config; ``env`` defaults to ``os.environ``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot parse {p}: {err}") from None
    return config_from_dict(data, env=os.environ if env is None else env, source=str(p))
