"""The bases of typed settings: :class:`Section`, every configuration section's, and
:class:`AlgorithmConfig`, one method's settings (its keys under ``[algorithm]``).

They live apart from the run config (:mod:`shared.config`) so that each method's own
settings (``shared/methods/<name>/config.py``), which the run config assembles, import
nothing of it. Torch-free: every process, a sampling-only device included, reads them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Self

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # the run config holds the algorithm section; checks receive the whole of it
    from shared.config import RunConfig


class Section(BaseModel):
    """A typed, frozen group of settings: a typo is an error naming the key, never a
    silently ignored setting."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class AlgorithmConfig(Section):
    """Base of one algorithm's settings (its keys under ``[algorithm]``)."""

    #: whether this algorithm's keys count in the config digest even at their defaults:
    #: True for the algorithms whose keys digests have always held, False (keys left out at
    #: their defaults) for every algorithm added since
    digest_defaults: ClassVar[bool] = False
    #: the kinds of generator (``model.preset``) the algorithm trains: ``unet``, and
    #: ``oneshot`` where its local step is the plain loss on the module (no U-Net parts)
    model_kinds: ClassVar[tuple[str, ...]] = ("unet",)

    @classmethod
    def of(cls, cfg: RunConfig) -> Self:
        """This algorithm's settings as ``cfg`` holds them (whichever algorithm it names)."""
        section = cfg.algorithm
        return cls.model_validate({key: getattr(section, key) for key in cls.model_fields})

    @property
    def prunes(self) -> bool:
        """Whether the cloud may change the model's architecture during the run (prune it):
        round announcements then carry a channel plan from the start."""
        return False

    def check_run(self, cfg: RunConfig) -> None:
        """Rules these settings impose on the rest of ``cfg`` when this algorithm is the one
        named; raise ValueError saying what to change. Checked whenever a config is read."""

    def check_waste(self, cfg: RunConfig) -> None:
        """Settings that would train work the run throws away, when this algorithm is the
        one named (raise ValueError). Checked when a run is configured, not when a stored
        config (a checkpoint's) is read back."""
