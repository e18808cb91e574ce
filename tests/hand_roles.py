"""Hand-driven role endpoints for tests that exercise one real service on a MemoryBus."""

from __future__ import annotations

from typing import Any

from shared.messages import BlobRef, RoundStart
from shared.models import build_unet
from shared.service import RoleService

SESSION = "0123456789abcdef"


class Cloud(RoleService):
    """A cloud-role endpoint that opens rounds by hand."""

    role = "cloud"

    def open_round(
        self,
        r: int,
        devices: list[str],
        *,
        arch: dict[str, Any] | None = None,
        ref: BlobRef | None = None,
        new_global: bool = True,
        edge_counts: dict[str, list[int]] | None = None,
    ) -> None:
        """Send the RoundStart of round ``r`` assigning ``devices`` to edge0."""
        if ref is None:
            state = dict(build_unet(self.cfg.model.preset, seed=0).state_dict())
            ref = self.put_tensors(state, "global_model")
        msg = RoundStart(
            round=r,
            session=SESSION,
            assignment={"edge0": devices},
            global_ref=ref,
            new_global=new_global,
            deadline_s=60.0,
            config_digest=self.cfg.digest(),
            arch=arch,
            edge_counts=edge_counts or {},
        )
        self.send(self.topics.cloud_round, msg)
