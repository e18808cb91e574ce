"""The bases of typed settings: :class:`Section`, every configuration section's, and
:class:`AlgorithmConfig`, one method's settings (its keys under ``[algorithm]``), with what a
method declares without any of its code: what travels (:class:`Traffic`), the model its run
delivers, and how it is described in tables and progress bars.

They live apart from the run config (:mod:`shared.config`) so that each method's own
settings (``shared/methods/<name>/config.py``), which the run config assembles, import
nothing of it. Torch-free: every process, a sampling-only device included, reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # the run config holds the algorithm section; checks receive the whole of it
    from shared.config import RunConfig


class Section(BaseModel):
    """A typed, frozen group of settings: a typo is an error naming the key, never a
    silently ignored setting."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


@dataclass(frozen=True)
class Traffic:
    """What a method's rounds move, declared as data: the roles switch on it, never on the
    method's name.

    - ``uplink``: ``"state"`` (each upload holds the whole upload spec), ``"parts"`` (a part
      of it, the edges counting samples per part: FedDiffuse USPLIT) or ``"none"`` (devices
      report without an upload: Local-only);
    - ``blob_kind``: the kind an upload's blob is counted under (accounting);
    - ``cloud_sees``: ``"edge_aggregates"``, or ``"every_upload"``: at a cloud round the
      edges forward each device's own upload, which the cloud hands to the method;
    - ``downlink``: ``"broadcast"`` (devices train their edge's model) or ``"per_device"``
      (the cloud may send a device a model of its own, on the device's private topic);
    - ``device_keeps``: ``"local_parts"`` where part of the model never leaves the devices;
    - ``product``: what the run delivers: the cloud's ``"global_model"``, the devices' own
      ``"device_models"``, or a model the cloud makes after the last round
      (``"cloud_made"``)."""

    uplink: Literal["state", "parts", "none"] = "state"
    blob_kind: str = "device_update"
    cloud_sees: Literal["edge_aggregates", "every_upload"] = "edge_aggregates"
    downlink: Literal["broadcast", "per_device"] = "broadcast"
    device_keeps: Literal["nothing", "local_parts"] = "nothing"
    product: Literal["global_model", "device_models", "cloud_made"] = "global_model"


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
        """This method's settings as ``cfg`` holds them (its table, or its defaults),
        whichever method ``cfg`` names."""
        section = cfg.algorithm
        for name in type(section).model_fields:
            table = getattr(section, name)
            if type(table) is cls:
                return table
        return cls()

    #: what the demo's progress bar says while the cloud is in a phase (``aggregating``,
    #: ``deploying``) doing this method's own work; other phases get the generic text
    phase_text: ClassVar[dict[str, str]] = {}

    def traffic(self) -> Traffic:
        """What this method's rounds move (:class:`Traffic`)."""
        return Traffic()

    def product_preset(self, cfg: RunConfig) -> str:
        """The preset of the model the run delivers: ``model.preset``, unless the method's
        product is another model (FedDEO: the classifier its cloud trains)."""
        return cfg.model.preset

    def describe(self) -> str:
        """The settings that set this run apart, in a few words for the comparison tables
        (after the method's name and schedule); "" for none."""
        return ""

    def check_centralized(self) -> None:
        """Rules for a centralized ceiling trained under these settings (the pooled data,
        no rounds); raise ValueError saying what to change."""

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
