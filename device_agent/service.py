"""The device agent service: register, train on the edge's model when assigned, upload.

Raw data never leaves this object; only model tensors (through blobs) and the label
histogram in the registration message do.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from shared.algorithms import Algorithm, DeviceContext
from shared.bus import Bus
from shared.codec import spec_of
from shared.config import RunConfig
from shared.data import NUM_CLASSES
from shared.messages import DeviceHello, DeviceUpdate, EdgeRound
from shared.models import build_unet
from shared.service import RoleService

log = logging.getLogger(__name__)


def device_seed(seed: int, index: int, round_: int) -> int:
    """Per-device, per-round seed for the device's torch.Generator."""
    return int(np.random.SeedSequence([seed, index, round_, 0xDE71CE]).generate_state(1)[0])


class DeviceAgent(RoleService):
    """One device: private ``data`` (float images in [-1, 1]) and ``labels``."""

    role = "device"

    def __init__(
        self,
        cfg: RunConfig,
        bus: Bus,
        algorithm: Algorithm,
        *,
        device_id: str,
        index: int,
        home_edge: str,
        data: torch.Tensor,
        labels: torch.Tensor,
    ) -> None:
        super().__init__(device_id, cfg, bus)
        self.index = index
        self.home_edge = home_edge
        self.algorithm = algorithm
        self.data = data
        self.labels = labels
        self.model = build_unet(cfg.model.preset, seed=cfg.run.seed)
        self.spec = spec_of(self.model.state_dict())
        self.label_counts = np.bincount(labels.numpy(), minlength=NUM_CLASSES).tolist()
        self.last_update: DeviceUpdate | None = None
        self.kept_local: tuple[int, str] | None = None

    def start(self) -> None:
        """Subscribe to edge round announcements and publish the retained registration."""
        self.on(f"{self.topics.base}/edge/+/round", EdgeRound, self.on_edge_round, "msg_edge_round")
        self.announce_presence(True)
        hello = DeviceHello(
            device=self.name,
            home_edge=self.home_edge,
            n_samples=len(self.labels),
            label_counts=self.label_counts,
        )
        self.send(self.topics.device_hello(self.name), hello, retain=True)

    def on_edge_round(self, msg: EdgeRound) -> None:
        """Train on the announced model if this device is assigned to the round."""
        if self.name not in msg.devices:
            return
        last = self.last_update
        if last is not None and (last.session, last.round) == (msg.session, msg.round):
            # Announced again (the edge restarted, or a retained replay after a reconnect):
            # send the same update again; the edge ignores it if it already has it.
            log.info(
                "%s: round %d announced again by %s; resending", self.name, msg.round, msg.edge
            )
            self.send(self.topics.device_up(self.name), last)
            return
        if last is not None and last.session == msg.session and msg.round < last.round:
            self.reject("late", f"round {msg.round} announced after round {last.round}")
            return
        # Between edge aggregations (r_e > 1) the device keeps training its own model.
        continuing = self.kept_local == (msg.round - 1, msg.model_ref.sha256)
        if not continuing:
            state = self.fetch_tensors(msg.model_ref, self.spec)
            if state is None:
                return  # rejected and counted; the edge's deadline covers the missing update
            self.model.load_state_dict(state)
        self.kept_local = None if msg.upload else (msg.round, msg.model_ref.sha256)
        gen = torch.Generator().manual_seed(device_seed(self.cfg.run.seed, self.index, msg.round))
        ctx = DeviceContext(self.name, self.data, self.labels, gen)
        result = self.algorithm.device_round(ctx, self.model, msg.round, upload=msg.upload)
        ref = None
        if result.tensors is not None:
            ref = self.put_tensors(result.tensors, "device_update")
        update = DeviceUpdate(
            round=msg.round,
            session=msg.session,
            device=self.name,
            edge=msg.edge,
            update_ref=ref,
            n_samples=len(self.labels),
            label_counts=self.label_counts,
            train_loss=result.train.mean_loss,
            steps=result.train.steps,
            train_seconds=result.train.seconds,
        )
        self.last_update = update
        self.metrics.round.set(msg.round)
        self.metrics.training_seconds.observe(result.train.seconds)
        self.send(self.topics.device_up(self.name), update)
        log.debug("%s round %d loss %.4f", self.name, msg.round, result.train.mean_loss)
