"""FedPhD's settings (torch-free, read by every process)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from shared.settings import AlgorithmConfig

if TYPE_CHECKING:
    from shared.config import RunConfig


class FedPhDConfig(AlgorithmConfig):
    """FedPhD (seed 000): SH-weighted aggregation (eqs. 22, 24), sparse training (eqs.
    16-17) and structured pruning. The SH weights' ``a``, ``b`` and target are the
    federation's (``federation.sh_a``, ``sh_b``, ``sh_target``), which edge selection (eq.
    25) reads for every method."""

    digest_defaults = True

    sparse_rounds: int = Field(0, ge=0, description="R_s: sparse training for rounds < R_s")
    lambda0: float = Field(1e-4, ge=0.0, description="lambda_0 of the group penalty")
    prune_ratio: float = Field(0.0, ge=0.0, lt=0.95, description="s_p: params removed")
    prune_at: Literal["sparse", "init"] = Field(
        "sparse", description="sparse: at r = R_s (after sparse training); init: OS at r = 0"
    )
    prune_method: Literal["l2", "random"] = "l2"

    @model_validator(mode="after")
    def _check(self) -> FedPhDConfig:
        if self.prune_ratio > 0 and self.prune_at == "sparse" and self.sparse_rounds == 0:
            raise ValueError(
                "algorithm.fedphd.prune_at = 'sparse' prunes at r = R_s: set "
                "algorithm.fedphd.sparse_rounds >= 1"
            )
        return self

    @property
    def prunes(self) -> bool:
        return self.prune_ratio > 0

    def describe(self) -> str:
        if not self.prunes:
            return ""
        return f"s_p={self.prune_ratio} " + (
            "OS" if self.prune_at == "init" else f"R_s={self.sparse_rounds}"
        )

    def check_centralized(self) -> None:
        if self.prunes and self.prune_at != "init":
            raise ValueError(
                "centralized training has no sparse rounds, so it prunes only before its first "
                "step: set algorithm.fedphd.prune_at = 'init' (and sparse_rounds = 0)"
            )

    def check_waste(self, cfg: RunConfig) -> None:
        if self.prune_ratio <= 0:
            return
        rounds, r_g, r_s = cfg.run.rounds, cfg.federation.cloud_every, self.sparse_rounds
        if self.prune_at == "init" and r_s:
            raise ValueError(
                f"algorithm.fedphd.prune_at = 'init' (FedPhD-OS) prunes before the first round, so "
                f"sparse_rounds (R_s={r_s}) would add the group penalty to the pruned "
                "model and never prune again; set sparse_rounds = 0"
            )
        if self.prune_at == "sparse" and r_s % r_g:
            raise ValueError(
                f"algorithm.fedphd.sparse_rounds (R_s={r_s}) is not a multiple of "
                f"federation.cloud_every (r_g={r_g}): the cloud prunes after a central "
                f"aggregation, so rounds {r_s + 1}..{r_s - r_s % r_g + r_g} would train "
                "the dense model without the penalty; use a multiple of r_g"
            )
        if self.prune_at == "sparse" and r_s >= rounds:
            raise ValueError(
                f"algorithm.fedphd.sparse_rounds (R_s={r_s}) must be below run.rounds ({rounds}): "
                "the pruned model would never be trained (or never pruned)"
            )
