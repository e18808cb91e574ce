"""Run configs of format 1, mapped once onto format 2.

Format 1 held every method's keys in one flat ``[algorithm]`` table, prefixed by method
(``prism_lr``, ``pfedgpa_mode``, ``feddeo_w_d``, ``moon_mu``, ...), with FedPhD's
statistical-homogeneity settings (``a``, ``b``, ``target_distribution``) among them. Format 2
gives each method a table of its own, ``[algorithm.<name>]``, keys without prefixes, and
moves those three to ``[federation]`` (``sh_a``, ``sh_b``, ``sh_target``), where edge
selection (eq. 25) reads them for every method.

Format 1 configs are still read: :func:`nest` moves each flat key to its place, with a
one-line note naming the new key. Their digest stays the one format 1 computed
(:func:`legacy_digest`), so the configs stored with committed results, and checkpoints of
earlier runs, keep theirs: it covered every format-1 method's keys (the first six methods'
even at their defaults, the later ones' only when set) and left out some keys of other
sections at their defaults (:data:`LATER_KEYS`). A format 2 digest covers the named
method's table only, and every other key.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shared.methods.registry import config_class

if TYPE_CHECKING:
    from shared.config import RunConfig

log = logging.getLogger(__name__)
#: the format 1 keys already noted in this process (each is said once)
_NOTED: set[str] = set()

#: the methods of format 1, in order, each with whether a digest counted its keys at their
#: defaults (True for the first six, False for those added later)
LEGACY_METHODS: dict[str, bool] = {
    "fedavg": True, "fedphd": True, "feddiffuse": True, "fedprox": True, "scaffold": True,
    "moon": True, "prism": False, "local": False, "pfedgpa": False, "feddeo": False,
}  # fmt: skip

#: format 1's flat [algorithm] keys -> where format 2 keeps them (section, table, key; the
#: table "" for a key of the section itself)
_PREFIXED = {
    "prism": (
        "estimator", "lr", "beta1", "beta2", "local_iters", "mask_eps", "mada", "mada_space",
        "mada_distance", "alpha", "weighting", "dp_noise", "dp_epsilon", "dp_delta", "dp_clip",
        "mada_fixed_lambda", "dp_calibrate", "init",
    ),
    "pfedgpa": (
        "store_rounds", "dm_every", "mode", "layers", "ae_size", "denoiser", "denoiser_width",
        "ae_steps", "dm_steps", "batch", "lr", "timesteps", "invert_from", "inversion",
        "guide_rounds", "guide_omega", "guide_steps", "guide_from",
    ),
    "feddeo": (
        "use_descriptions", "w_t", "w_d", "images_per_class", "eval_n", "sample_steps",
        "sample_batch", "desc_epochs", "desc_lr", "desc_batch", "min_class_images",
        "classifier", "clf_epochs", "clf_lr", "clf_batch", "grid_per_class",
    ),
}  # fmt: skip
FLAT_KEYS: dict[str, tuple[str, str, str]] = {
    "a": ("federation", "", "sh_a"),
    "b": ("federation", "", "sh_b"),
    "target_distribution": ("federation", "", "sh_target"),
    **{k: ("algorithm", "fedphd", k)
       for k in ("sparse_rounds", "lambda0", "prune_ratio", "prune_at", "prune_method")},
    "split": ("algorithm", "feddiffuse", "split"),
    "prox_mu": ("algorithm", "fedprox", "mu"),
    "moon_mu": ("algorithm", "moon", "mu"),
    "moon_tau": ("algorithm", "moon", "tau"),
    **{f"{m}_{k}": ("algorithm", m, k) for m, keys in _PREFIXED.items() for k in keys},
}  # fmt: skip

#: pFedGPA's inversion depth: format 1's pfedgpa_invert_from = 0, its default, was the whole
#: chain; format 2 counts the depth in diffusion steps (0: no diffusion, timesteps: the whole
#: chain, default 200). A format 1 config reads 0, or no value, as the run's timesteps, and
#: its digest leaves the whole chain out, as format 1's left its default out
WHOLE_CHAIN_KEY = ("pfedgpa", "invert_from")

#: keys of other sections that format 1's digest left out at their defaults (added after
#: digests were first recorded)
LATER_KEYS = (
    ("train", "ama_lr"),
    ("train", "adam_betas"),
    ("train", "precision"),
    ("train", "cuda_graph"),
    ("train", "cuda_graph_reuse"),
    ("data", "local_dir"),
    ("data", "class_names"),
    ("data", "gray_to_rgb"),
    ("data", "domains"),
    ("data", "public_size"),
    ("eval", "reference_dir"),
)
#: keys format 2 added to other sections (left out of a format 1 digest)
NEW_KEYS = (("federation", "sh_a"), ("federation", "sh_b"), ("federation", "sh_target"))


def flat_keys_of(algorithm: Mapping[str, Any]) -> list[str]:
    """The format 1 keys an ``[algorithm]`` table holds."""
    return [k for k in algorithm if k in FLAT_KEYS]


def nest(data: Mapping[str, Any], *, note: bool = True) -> dict[str, Any]:
    """``data`` (a run config's sections) with every format 1 key of ``[algorithm]`` moved to
    its format 2 place; ``note``: say so, one line per key. A key given in both places takes
    the format 1 value (an override of a stored config's full tables)."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}
    algorithm = out.get("algorithm")
    if not isinstance(algorithm, dict):
        return out
    chain = False  # format 1's pfedgpa_invert_from = 0: the whole chain
    for key in flat_keys_of(algorithm):
        value = algorithm.pop(key)
        section, table, name = FLAT_KEYS[key]
        target = out.setdefault(section, {})
        if not isinstance(target, dict):
            continue  # a section that is not a table: validation says so
        if table:
            target[table] = dict(target.get(table) or {})
            target = target[table]
        target[name] = value
        chain = chain or ((table, name) == WHOLE_CHAIN_KEY and value == 0)
        if note and key not in _NOTED:
            _NOTED.add(key)
            where = f"{section}.{table}.{name}" if table else f"{section}.{name}"
            log.warning("config: algorithm.%s is read as %s (the key's name since format 2)",
                        key, where)  # fmt: skip
    if chain:
        whole_chain(out, missing_only=False)
    return out


def whole_chain(data: dict[str, Any], *, missing_only: bool = True) -> None:
    """Set pFedGPA's inversion depth in ``data`` (nested sections, changed in place) to the
    whole chain, its ``timesteps``: where the depth is not given (``missing_only``, a format 1
    config), or in any case."""
    algorithm = data.get("algorithm", {})
    table, name = WHOLE_CHAIN_KEY
    settings = algorithm.get(table, {}) if isinstance(algorithm, Mapping) else None
    if not isinstance(settings, Mapping) or (missing_only and name in settings):
        return  # not tables: validation says so
    default = config_class(table).model_fields["timesteps"].get_default()
    settings = {**settings, name: settings.get("timesteps", default)}
    data["algorithm"] = {**algorithm, table: settings}


def _default(cfg: RunConfig, section: str, key: str) -> Any:
    """The default of ``section.key`` (from the section's class, not from ``cfg``)."""
    return type(getattr(cfg, section)).model_fields[key].get_default(call_default_factory=True)


def legacy_digest(cfg: RunConfig, data: dict[str, Any]) -> str:
    """The digest format 1 computed for ``cfg`` (``data``: its sections without the
    deployment ones, per-process keys already at their defaults)."""
    federation = data["federation"]
    algorithm: dict[str, Any] = {"name": cfg.algorithm.name}
    for key, (section, table, name) in FLAT_KEYS.items():
        if section == "federation":
            algorithm[key] = federation[name]
            continue
        settings = cfg.algorithm.settings_of(table)
        value = settings.model_dump(mode="json")[name]
        default = type(settings).model_fields[name].get_default(call_default_factory=True)
        if (table, name) == WHOLE_CHAIN_KEY:  # format 1's default: the whole chain
            default = settings.model_dump()["timesteps"]
        if LEGACY_METHODS[table] or value != default:
            algorithm[key] = value
    for section, key in NEW_KEYS:
        data[section] = {k: v for k, v in data[section].items() if k != key}
    data["algorithm"] = algorithm
    for section, key in LATER_KEYS:
        # compared as JSON, as ``data`` holds it (a tuple default is a list there)
        if data[section][key] == json.loads(json.dumps(_default(cfg, section, key))):
            data[section] = {k: v for k, v in data[section].items() if k != key}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
