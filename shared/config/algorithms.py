"""The ``[algorithm]`` section of a run config: ``name`` and one table per method.

Each method declares its settings as one frozen, typed class
(:class:`~shared.settings.AlgorithmConfig`) in its package's ``config.py``, named in the
method registry (:mod:`shared.methods.registry`); the method reads them as
``self.settings``. The section holds ``name`` (one of the registered names) and, under
``[algorithm.<name>]``, the named method's settings, each key without a prefix:

    [algorithm]
    name = "prism"

    [algorithm.prism]
    lr = 0.1

The named method's table is always there (its defaults where the config gives none); a
config may carry other methods' tables too (a comparison's base section), each validated by
its owner, but only the named method's cross-section rules apply
(:meth:`AlgorithmConfig.check_run`, :meth:`AlgorithmConfig.check_waste`) and only its table
counts in the digest. Format 1's flat, prefixed keys are still read
(:mod:`shared.config.legacy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import SerializerFunctionWrapHandler, create_model, model_serializer, model_validator

from shared.methods.registry import algorithm_names, config_class, config_classes
from shared.settings import AlgorithmConfig, Section

__all__ = [
    "AlgorithmConfig",
    "AlgorithmSection",
    "AlgorithmSectionBase",
    "algorithm_names",
    "config_class",
]

_CONFIGS = config_classes()


class AlgorithmSectionBase(Section):
    """The ``[algorithm]`` section: the method's registered name, and a table per method
    given (the class used at run time, :data:`AlgorithmSection`, declares one per
    registered method)."""

    name: str = "fedavg"

    @model_validator(mode="before")
    @classmethod
    def _named_table(cls, data: Any) -> Any:
        """The named method's table is always there (its defaults where none is given)."""
        if isinstance(data, dict):
            name = data.get("name", "fedavg")
            if isinstance(name, str) and name in _CONFIGS and data.get(name) is None:
                data = {**data, name: {}}
        return data

    @model_serializer(mode="wrap")
    def _tables_given(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """``name`` and the tables the config holds (no entry for the others)."""
        return {k: v for k, v in handler(self).items() if v is not None}

    def config(self) -> AlgorithmConfig:
        """The named method's settings."""
        return self.settings_of(self.name)

    def settings_of(self, name: str) -> AlgorithmConfig:
        """Method ``name``'s settings: its table, or its defaults where the config has none."""
        table = getattr(self, name, None)
        return table if table is not None else config_class(name)()


def _assemble() -> type[AlgorithmSectionBase]:
    """The section class: ``name`` as a choice of the registered names, then an optional
    table per registered method, in registration order."""
    fields: dict[str, Any] = {"name": (Literal[algorithm_names()], "fedavg")}
    for name, cls in _CONFIGS.items():
        fields[name] = (cls | None, None)
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
