"""The ``[algorithm]`` section of a run config, assembled from every method's settings.

Each method declares its settings as one frozen, typed class
(:class:`~shared.config.method.AlgorithmConfig`) in its package's ``config.py``, named in
the method registry (:mod:`shared.methods.registry`); the method reads them as
``self.settings``. The section (:data:`AlgorithmSection`) is ``name`` (one of the
registered names) plus every method's keys, each validated by its owner, so a config written
for one method may carry another's keys (a comparison's base section, for example). Only
the named method's cross-section rules apply (:meth:`AlgorithmConfig.check_run`,
:meth:`AlgorithmConfig.check_waste`). A key belongs to one method: two classes declaring the
same key is an error at import time. A method's keys count in the config digest only when
set away from their defaults (:attr:`AlgorithmConfig.digest_defaults`), so adding one
changes no earlier run's digest.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ValidationError, create_model, model_validator

from shared.methods.registry import algorithm_names, config_class, config_classes
from shared.settings import AlgorithmConfig, Section

__all__ = [
    "AlgorithmConfig",
    "AlgorithmSection",
    "AlgorithmSectionBase",
    "algorithm_names",
    "config_class",
    "digest_later_keys",
]


def _check_keys_unique() -> dict[str, type[AlgorithmConfig]]:
    """Every method's settings class, after checking that no two declare the same key."""
    classes = config_classes()
    owner: dict[str, str] = {}
    for name, cls in classes.items():
        for key in cls.model_fields:
            if key in owner:
                raise TypeError(f"{cls.__name__} declares {key!r}, a key of {owner[key]!r}")
            owner[key] = name
    return classes


_CONFIGS = _check_keys_unique()


# -- the [algorithm] section ------------------------------------------------------------------


class AlgorithmSectionBase(Section):
    """The ``[algorithm]`` section: the algorithm's registered name, plus every registered
    algorithm's keys (the class used at run time, :data:`AlgorithmSection`, adds them)."""

    name: str = "fedavg"

    def config(self) -> AlgorithmConfig:
        """The named algorithm's settings."""
        cls = config_class(self.name)
        return cls.model_validate({key: getattr(self, key) for key in cls.model_fields})

    @model_validator(mode="after")
    def _check_each(self) -> AlgorithmSectionBase:
        """Every registered algorithm's own checks on its keys (they hold whichever
        algorithm is named, so a config never carries settings its owner would refuse)."""
        for cls in _CONFIGS.values():
            try:
                cls.model_validate({key: getattr(self, key) for key in cls.model_fields})
            except ValidationError as err:
                first = err.errors()[0]
                cause = first.get("ctx", {}).get("error")
                raise ValueError(str(cause) if cause is not None else first["msg"]) from None
        return self


def digest_later_keys() -> tuple[str, ...]:
    """The ``[algorithm]`` keys a config digest leaves out at their defaults: those of every
    algorithm whose :attr:`~AlgorithmConfig.digest_defaults` is False."""
    return tuple(
        key for cls in _CONFIGS.values() if not cls.digest_defaults for key in cls.model_fields
    )


def _assemble() -> type[AlgorithmSectionBase]:
    """The section class: ``name`` as a choice of the registered names, then each registered
    algorithm's keys in registration order (so errors list in that order too)."""
    fields: dict[str, Any] = {"name": (Literal[algorithm_names()], "fedavg")}
    for cls in _CONFIGS.values():
        for key, info in cls.model_fields.items():
            fields[key] = (info.annotation, copy.copy(info))
    model: type[AlgorithmSectionBase] = create_model(
        "AlgorithmSection",
        __base__=AlgorithmSectionBase,
        __doc__=AlgorithmSectionBase.__doc__,
        __module__=__name__,
        **fields,
    )
    return model


if TYPE_CHECKING:
    AlgorithmSection = AlgorithmSectionBase
else:
    AlgorithmSection = _assemble()
