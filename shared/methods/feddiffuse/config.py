"""FedDiffuse's settings (torch-free, read by every process)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from shared.settings import AlgorithmConfig, Traffic

if TYPE_CHECKING:
    from shared.config import RunConfig


class FedDiffuseConfig(AlgorithmConfig):
    """FedDiffuse (seed 001): which parts of the U-Net are federated."""

    digest_defaults = True

    split: Literal["full", "usplit", "ulatdec", "udec"] = "full"

    def traffic(self) -> Traffic:
        """USPLIT devices upload parts; ULATDEC and UDEC keep parts on the devices."""
        if self.split in ("ulatdec", "udec"):
            return Traffic(device_keeps="local_parts")
        return Traffic(uplink="parts" if self.split == "usplit" else "state")

    def describe(self) -> str:
        return self.split

    def check_run(self, cfg: RunConfig) -> None:
        if self.split == "usplit" and cfg.federation.assignment != "static":
            # USPLIT pairs the devices of one edge; with devices choosing their edge during
            # the round, no edge knows its devices when it announces the round
            raise ValueError(
                "FedDiffuse USPLIT pairs the devices within each edge, which needs a fixed "
                f"assignment: federation.assignment = {cfg.federation.assignment!r} lets "
                "devices pick their edge during the round; use 'static'"
            )
