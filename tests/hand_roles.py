"""Hand-driven role endpoints for tests that exercise one real service on a MemoryBus."""

from __future__ import annotations

import functools
from typing import Any

import torch

from cloud import CloudServer
from shared.config import RunConfig
from shared.methods.registry import make_algorithm
from shared.models.init import initial_model
from shared.models.presets import build_unet
from shared.runtime.service import RoleService
from shared.transport.bus import Endpoint, MemoryBus
from shared.wire.messages import BlobRef, DeviceHello, RoundStart, Topics, encode

SESSION = "0123456789abcdef"


@functools.cache
def _model_state(preset: str, seed: int) -> dict[str, torch.Tensor]:
    return dict(build_unet(preset, seed=seed).state_dict())


def registered_cloud(cfg: RunConfig) -> tuple[MemoryBus, CloudServer, Endpoint, Topics]:
    """A cloud of ``cfg`` on a MemoryBus that counts handler errors (as MqttBus does), with
    device ``dev00i`` registered at edge ``i`` for each edge, its first round open; the bus,
    the cloud, an endpoint to speak to it from, and the run's topics."""
    bus = MemoryBus(raise_errors=False)
    state = dict(initial_model(cfg.model.preset, cfg.model.init, seed=0).state_dict())
    cloud = CloudServer(cfg, bus, make_algorithm(cfg), initial_model=state)
    cloud.start()
    topics, ep = Topics(cfg.run.name), bus.endpoint("tester")
    for i in range(cfg.federation.num_edges):
        hello = DeviceHello(device=f"dev00{i}", home_edge=f"edge{i}", n_samples=10,
                            label_counts=[1] * 10)  # fmt: skip
        ep.publish(topics.device_hello(f"dev00{i}"), encode(hello), kind="m")
    assert bus.run(lambda: cloud.started)
    return bus, cloud, ep, topics


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
