"""Hand-driven role endpoints for tests that exercise one real service on a MemoryBus."""

from __future__ import annotations

import functools
from typing import Any

import torch

from shared.models.presets import build_unet
from shared.runtime.service import RoleService
from shared.wire.messages import BlobRef, RoundStart

SESSION = "0123456789abcdef"


@functools.cache
def _model_state(preset: str, seed: int) -> dict[str, torch.Tensor]:
    return dict(build_unet(preset, seed=seed).state_dict())


def put_model(service: RoleService, kind: str, *, seed: int = 0) -> BlobRef:
    """Offer the ``seed``-initialized model of the service's preset as a blob of ``kind``."""
    return service.put_tensors(_model_state(service.cfg.model.preset, seed), kind)


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
            ref = put_model(self, "global_model")
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
