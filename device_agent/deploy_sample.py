"""The ``generate`` task of a deployment on a device: serve the generator (or the device's own,
built from the deployment's shared tensors and the parts it keeps) and sample grids from it,
on each new deployment and on request."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from device_agent.sampling import OWN_MODEL_FILE, OWN_RECORD_FILE, save_grid
from device_agent.served import Admitted, DeploymentTask, Fetched, Served
from shared import seeds
from shared.atomic import atomic_write
from shared.deploy.onnx_sampler import OnnxGenerator, SampleStats
from shared.deploy.signing import (
    write_signed,
)
from shared.errors import (
    EstuaryError,
)
from shared.wire.messages import (
    SampleRequest,
)

log = logging.getLogger(__name__)

#: what a sample request's tag may keep in a grid's file name
_SAFE = re.compile(r"[^A-Za-z0-9_-]")


def grid_seed(seed: int, device: str) -> int:
    """The seed of the grid a device samples when a deployment arrives: from the run's seed
    and the device's name, so that each device draws its own images (one seed for all draws
    the same grid on every device running the same model)."""
    return seeds.integer("device.grid", seed, device=seeds.name_key(device))


@dataclass(frozen=True)
class PersonalModel:
    """A device's own generator: ONNX bytes and the parity check they passed."""

    onnx: bytes
    parity: dict[str, Any]


class Personalize(Protocol):
    """Builds the device's own model (:class:`device_agent.personalize.Personalizer`)."""

    def holds_local_parts(self) -> bool:
        """Whether the device holds local parts (else the global model is its model)."""

    def __call__(self, shared: bytes, card: dict[str, Any]) -> PersonalModel:
        """The own model from a deployment's verified shared tensors and its card; raises
        :class:`PersonalizeError` when it cannot be built or fails parity."""


class SampleTask(DeploymentTask):
    """A deployment receiver's handling of generators."""

    personalize: Personalize | None
    grids: list[Path]
    last_stats: SampleStats | None

    def _install_generator(self, item: Admitted, fetched: Fetched) -> Served:
        """A ``"generate"`` deployment: load the model into ONNX Runtime, build the
        device's own model when the shared tensors came, and keep a verified copy of the
        deployment under ``out_dir/models/<sha16>``; the model to serve."""
        msg, manifest, want = item.msg, item.manifest, item.manifest["model"]
        card = manifest["card"]
        generator = OnnxGenerator(
            fetched.model, card, provider=self.cfg.provider, threads=self.cfg.threads
        )
        own, own_sha = None, None
        if fetched.shared is not None and self.personalize is not None:
            own = self.personalize(fetched.shared, card)
            own_sha = hashlib.sha256(own.onnx).hexdigest()
            generator = OnnxGenerator(
                own.onnx, card, provider=self.cfg.provider, threads=self.cfg.threads
            )
        path = self.out_dir / "models" / want["sha256"][:16]
        path.mkdir(parents=True, exist_ok=True)
        atomic_write(path / want["file"], fetched.model)
        if own is None:  # an own model of an earlier load (before a restart) is not served
            for name in (OWN_MODEL_FILE, OWN_RECORD_FILE):
                (path / name).unlink(missing_ok=True)
        else:
            atomic_write(path / OWN_MODEL_FILE, own.onnx)
            record = {"sha256": own_sha, "size": len(own.onnx), "deployment": want["sha256"],
                      "shared": manifest["shared"]["sha256"], "parity": own.parity}  # fmt: skip
            atomic_write(path / OWN_RECORD_FILE, (json.dumps(record, indent=2) + "\n").encode())
        # the signed manifest last: the copy that says which version was served (read back
        # after a restart) is complete once it is there
        write_signed(path, msg.manifest, msg.signature, msg.key_id)
        return Served(
            want["sha256"], generator, manifest, path, personal=own_sha, version=item.version
        )

    def on_sample_request(self, msg: SampleRequest) -> None:
        """Sample for a request addressed to this device (or to every device)."""
        if msg.devices and self.service.name not in msg.devices:
            return
        if self.served is None:
            self._report("refused", None, reason="no_model: no deployment in service",
                         request_id=msg.request_id)  # fmt: skip
            return
        if self.served.generator is None:
            reason = "no_generator: the deployment in service is a classifier"
            self._report("refused", self.served.sha256, reason=reason, request_id=msg.request_id)
            return
        n = min(msg.n, self.cfg.max_request_images)
        self._sample(n, msg.steps, msg.seed, msg.request_id)

    def _sample(self, n: int, steps: int, seed: int, tag: str) -> None:
        served = self.served
        if served is None or served.generator is None:
            return
        try:
            images, stats = served.generator.sample(n, steps=steps, seed=seed)
        except Exception as err:  # EstuaryError, or anything else: the requester hears why
            detail = str(err) if isinstance(err, EstuaryError) else f"{type(err).__name__}: {err}"
            self._report("refused", served.sha256, reason=f"sampling failed: {detail}"[:500],
                         request_id=tag)  # fmt: skip
            return
        grid = save_grid(images, self.out_dir / "samples" / f"{_SAFE.sub('_', tag)}.png")
        self.grids.append(grid)
        self.last_stats = stats
        m = self.service.metrics
        m.images_generated.inc(n)
        m.sampling_seconds.observe(stats.latency_s)
        m.images_per_second.set(stats.images_per_s)
        log.info(
            "%s: %d images, %d steps: %.2f images/s, %.3f s per batch -> %s",
            self.service.name, n, steps, stats.images_per_s, stats.latency_s, grid,
        )  # fmt: skip
        self._report("sampled", served.sha256, request_id=tag, stats=stats, grid=str(grid))
