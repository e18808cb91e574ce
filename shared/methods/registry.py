"""The methods Estuary runs, by name: each one's settings class and its builder.

Torch-free: importing this module imports only the methods' settings (``config.py`` of each
method package, pydantic), so every process, a sampling-only device without torch included,
reads the whole run config and computes the same digest. The method itself (its maths, its
models, torch) is imported only when :func:`make_algorithm` makes one.

Adding a method is one line in :data:`METHODS`: its name, its settings class and its
builder, each as ``"module:attribute"`` inside this package, and optionally the module of its
command-line verbs (with ``add_parsers(subparsers)``). The order of :data:`METHODS` is the
order errors list the names in.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.config import RunConfig
    from shared.methods.api import Method
    from shared.settings import AlgorithmConfig


@dataclass(frozen=True)
class Entry:
    """One method: where its settings class and its builder are (``"module:attribute"``),
    and the module of its command-line verbs ("" when it has none)."""

    config: str
    builder: str
    cli: str = ""


#: every method, by name (one line each; paths relative to ``shared.methods``)
METHODS: dict[str, Entry] = {
    "fedavg": Entry("baselines.config:FedAvgConfig", "baselines.fedavg:FedAvg"),
    "fedphd": Entry("fedphd.config:FedPhDConfig", "fedphd.method:FedPhD"),
    "feddiffuse": Entry("feddiffuse.config:FedDiffuseConfig", "feddiffuse.method:FedDiffuse"),
    "fedprox": Entry("baselines.config:FedProxConfig", "baselines.fedprox:FedProx"),
    "scaffold": Entry("baselines.config:ScaffoldConfig", "baselines.scaffold:Scaffold"),
    "moon": Entry("baselines.config:MoonConfig", "baselines.moon:Moon"),
    "prism": Entry("prism.config:PrismConfig", "prism.method:Prism", cli="prism.cli"),
    "local": Entry("baselines.config:LocalConfig", "baselines.local:Local"),
    "pfedgpa": Entry("pfedgpa.config:PFedGPAConfig", "pfedgpa.method:PFedGPA"),
    "feddeo": Entry("feddeo.config:FedDEOConfig", "feddeo.method:FedDEO"),
    "fedadam": Entry("fedadam.config:FedAdamConfig", "fedadam.method:FedAdam"),
}


def _load(path: str) -> Any:
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), attribute)


def algorithm_names() -> tuple[str, ...]:
    """The methods' names, in :data:`METHODS` order."""
    return tuple(METHODS)


@functools.cache
def config_class(name: str) -> type[AlgorithmConfig]:
    """The settings class of method ``name`` (KeyError when there is none)."""
    return _load(METHODS[name].config)  # type: ignore[no-any-return]


def config_classes() -> dict[str, type[AlgorithmConfig]]:
    """Every method's settings class, by name, in :data:`METHODS` order."""
    return {name: config_class(name) for name in METHODS}


def registered() -> list[str]:
    """The methods' names, sorted."""
    return sorted(METHODS)


def cli_modules() -> list[Any]:
    """The modules of the methods' own command-line verbs (each has ``add_parsers``)."""
    return [importlib.import_module(f"{__package__}.{e.cli}") for e in METHODS.values() if e.cli]


def make_algorithm(cfg: RunConfig) -> Method:
    """The method ``cfg.algorithm.name`` names, made for ``cfg`` (imports its package)."""
    from shared.errors import ConfigError

    entry = METHODS.get(cfg.algorithm.name)
    if entry is None:
        raise ConfigError(
            f"unknown algorithm {cfg.algorithm.name!r}; registered: {sorted(METHODS)}"
        )
    method: Method = _load(entry.builder)(cfg)
    return method
