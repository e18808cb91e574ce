"""The base of every configuration section: frozen, unknown keys refused, no inf or NaN."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A typed, frozen group of settings: a typo is an error naming the key, never a
    silently ignored setting."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
