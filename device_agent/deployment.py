"""The device side of deployment (DESIGN section 5): verify, load and serve the generator the
cloud deploys, and sample from it on each new deployment and on request.

A deployment is refused, counted (``estuary_deployments_total{outcome="refused"}`` and
``estuary_rejected_messages_total{reason=...}``), logged and reported back when its
signature does not verify with the device's key, its manifest is malformed or disagrees
with the blob reference, the model's bytes do not match the manifest's hash, or ONNX
Runtime cannot load it; the model in service stays in service.

When devices keep local model parts (FedDiffuse ULATDEC/UDEC), the deployment also
carries the global model's federated tensors; a training device then serves its own model
built from those and its local parts (:mod:`device_agent.personalize`, passed in as
``personalize``), and a device that holds no local parts serves the global model.

Torch-free: the sampling-only agent (``estuary device --sample-only``) runs on onnxruntime,
numpy, pillow, paho-mqtt and prometheus-client alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from device_agent.sampling import OWN_MODEL_FILE, OWN_RECORD_FILE, save_grid
from shared.atomic import atomic_write
from shared.config import RunConfig
from shared.deploy.onnx_sampler import OnnxGenerator, SampleStats
from shared.deploy.signing import (
    MODEL_BLOB_KIND,
    SHARED_BLOB_KIND,
    check_model_bytes,
    load_public_key,
    verify_manifest,
    write_signed,
)
from shared.errors import (
    CodecError,
    EstuaryError,
    PersonalizeError,
    SignatureError,
    TransportError,
)
from shared.runtime.service import RoleService
from shared.transport.bus import Bus
from shared.wire.messages import BlobRef, Deployment, DeploymentReport, SampleRequest

log = logging.getLogger(__name__)

_SAFE = re.compile(r"[^A-Za-z0-9_-]")


def grid_seed(seed: int, device: str) -> int:
    """The seed of the grid a device samples when a deployment arrives: from the run's seed
    and the device's name, so that each device draws its own images (one seed for all draws
    the same grid on every device running the same model)."""
    name = int.from_bytes(hashlib.sha256(device.encode()).digest()[:8], "big")
    return int(np.random.SeedSequence([seed, name, 0x6121D]).generate_state(1)[0])


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


@dataclass
class Served:
    """The model in service: the deployment ``sha256``, and ``personal`` (the sha256 of the
    device's own ONNX model) when the generator is the device's own."""

    sha256: str
    generator: OnnxGenerator
    manifest: dict[str, Any]
    path: Path
    personal: str | None = None


class DeploymentReceiver:
    """Handles deployments and sample requests for ``service`` (a device)."""

    def __init__(
        self, service: RoleService, out_dir: Path, *, personalize: Personalize | None = None
    ) -> None:
        self.service = service
        self.personalize = personalize
        self.cfg = service.cfg.deploy
        self.out_dir = out_dir
        self.served: Served | None = None
        self.key = load_public_key(self.cfg.verify_key) if self.cfg.verify_key else None
        self.last_stats: SampleStats | None = None
        self.grids: list[Path] = []

    def start(self) -> None:
        """Subscribe to the retained deployment and to sample requests."""
        t = self.service.topics
        self.service.on(t.cloud_deploy, Deployment, self.on_deployment, "msg_deployment")
        self.service.on(t.cloud_sample, SampleRequest, self.on_sample_request, "msg_sample")
        if self.key is None:
            log.warning("%s: deploy.verify_key is not set; every deployment will be refused",
                        self.service.name)  # fmt: skip

    # -- deployments ---------------------------------------------------------------------
    def on_deployment(self, msg: Deployment) -> None:
        """Verify, fetch, check and load a deployment; then sample a grid from it."""
        sha = msg.model_ref.sha256
        if self.served is not None and self.served.sha256 == sha:
            return  # already serving it (retained replay after a reconnect)
        try:
            served = self._load(msg)
        except SignatureError as err:
            self._refuse(sha, err.reason, err.detail)
            return
        except (CodecError, TransportError) as err:
            self._refuse(sha, err.reason, str(err))
            return
        except PersonalizeError as err:
            self._refuse(sha, "personalize_failed", str(err))
            return
        except EstuaryError as err:
            self._refuse(sha, "bad_model", str(err))
            return
        except Exception as err:  # whatever a signed but broken model raises: refuse, report
            log.exception("%s: deployment %s failed to load", self.service.name, sha[:12])
            self._refuse(sha, "bad_model", f"{type(err).__name__}: {err}")
            return
        old = self.served
        self.served = served
        m = self.service.metrics
        m.deployments.labels(outcome="loaded").inc()
        if old is not None:
            m.deployed.remove(old.sha256[:16])
        m.deployed.labels(sha256=sha[:16]).set(1)
        card = served.manifest["card"]
        m.model_params.set(card.get("params", 0))
        m.model_bytes.set(served.manifest["model"]["size"])
        log.info("%s: serving %s%s (%s, %s params) on %s", self.service.name, sha[:12],
                 " as its own model" if served.personal else "", card.get("name"),
                 card.get("params"), served.generator.providers[0])  # fmt: skip
        self._report("loaded", sha)
        steps = self.cfg.sample_steps
        seed = grid_seed(self.service.cfg.run.seed, self.service.name)
        self._sample(self.cfg.grid_size, steps, seed, f"deploy-{sha[:12]}")

    def _load(self, msg: Deployment) -> Served:
        if self.key is None:
            raise SignatureError("no_verify_key", "deploy.verify_key is not configured")
        manifest = verify_manifest(msg.manifest, msg.signature, self.key)
        want = manifest["model"]
        if want["file"] in (OWN_MODEL_FILE, OWN_RECORD_FILE):
            raise SignatureError("bad_manifest", f"model.file {want['file']!r} is reserved")
        data = self._fetch(manifest, "model", msg.model_ref, MODEL_BLOB_KIND)
        card = manifest["card"]
        generator = OnnxGenerator(data, card, provider=self.cfg.provider, threads=self.cfg.threads)
        own = self._own_model(msg, manifest)
        path = self.out_dir / "models" / want["sha256"][:16]
        path.mkdir(parents=True, exist_ok=True)
        atomic_write(path / want["file"], data)
        write_signed(path, msg.manifest, msg.signature, msg.key_id)
        if own is None:  # an own model of an earlier load (before a restart) is not served
            for name in (OWN_MODEL_FILE, OWN_RECORD_FILE):
                (path / name).unlink(missing_ok=True)
            return Served(want["sha256"], generator, manifest, path)
        own_sha = hashlib.sha256(own.onnx).hexdigest()
        atomic_write(path / OWN_MODEL_FILE, own.onnx)
        record = {"sha256": own_sha, "size": len(own.onnx), "deployment": want["sha256"],
                  "shared": manifest["shared"]["sha256"], "parity": own.parity}  # fmt: skip
        atomic_write(path / OWN_RECORD_FILE, (json.dumps(record, indent=2) + "\n").encode())
        generator = OnnxGenerator(
            own.onnx, card, provider=self.cfg.provider, threads=self.cfg.threads
        )
        return Served(want["sha256"], generator, manifest, path, personal=own_sha)

    def _fetch(self, manifest: dict[str, Any], entry: str, ref: BlobRef | None, kind: str) -> bytes:
        """The manifest's ``entry`` file through the blob layer, from the reference ``ref``
        (which must name the signed file), checked against the manifest."""
        want = manifest[entry]
        if ref is None or (ref.sha256, ref.size) != (want["sha256"], want["size"]):
            raise SignatureError("bad_manifest", f"the {entry} blob reference is not the "
                                 "signed file")  # fmt: skip
        broker = self.service.cfg.broker
        if want["size"] > broker.max_blob_bytes:
            raise SignatureError("too_large", f"{entry} of {want['size']} bytes")
        data = self.service.ep.get_blob(
            want["sha256"], want["size"], kind=kind, src=ref.src, timeout_s=broker.fetch_timeout_s
        )
        check_model_bytes(data, manifest, entry)  # the blob layer checked; the file is what runs
        return data

    def _own_model(self, msg: Deployment, manifest: dict[str, Any]) -> PersonalModel | None:
        """The device's own model when the deployment carries shared tensors and this
        device holds local parts (see the module docstring); None: serve the deployed one.
        A device without local parts never fetches the shared tensors."""
        if "shared" not in manifest:
            return None
        if self.personalize is None or not self.personalize.holds_local_parts():
            log.warning("%s: deployment %s keeps parts on the training devices and this device "
                        "holds none: serving the global model, whose local parts are at their "
                        "initialization", self.service.name, msg.model_ref.sha256[:12])  # fmt: skip
            return None
        data = self._fetch(manifest, "shared", msg.shared_ref, SHARED_BLOB_KIND)
        return self.personalize(data, manifest["card"])

    def _refuse(self, sha: str, reason: str, detail: str) -> None:
        self.service.reject(reason, f"deployment {sha[:12]}: {detail}")
        self.service.metrics.deployments.labels(outcome="refused").inc()
        self._report("refused", sha, reason=f"{reason}: {detail}"[:500])

    # -- sampling ------------------------------------------------------------------------
    def on_sample_request(self, msg: SampleRequest) -> None:
        """Sample for a request addressed to this device (or to every device)."""
        if msg.devices and self.service.name not in msg.devices:
            return
        if self.served is None:
            self._report("refused", None, reason="no_model: no deployment in service",
                         request_id=msg.request_id)  # fmt: skip
            return
        n = min(msg.n, self.cfg.max_request_images)
        self._sample(n, msg.steps, msg.seed, msg.request_id)

    def _sample(self, n: int, steps: int, seed: int, tag: str) -> None:
        served = self.served
        if served is None:
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

    def _report(
        self, event: str, sha: str | None, *, reason: str = "", request_id: str = "",
        stats: SampleStats | None = None, grid: str = "",
    ) -> None:  # fmt: skip
        served = self.served
        report = DeploymentReport(
            device=self.service.name,
            event=event,  # type: ignore[arg-type]
            model_sha256=sha,
            serving=served.sha256 if served is not None else None,
            personal=served.personal if served is not None else None,
            reason=reason,
            request_id=request_id[:64],
            n=stats.n if stats else 0,
            steps=stats.steps if stats else 0,
            images_per_s=round(stats.images_per_s, 4) if stats else 0.0,
            latency_s=round(stats.latency_s, 5) if stats else 0.0,
            provider=served.generator.providers[0] if served is not None else "",
            grid=grid[-500:],
        )
        self.service.send(self.service.topics.device_deploy(self.service.name), report, retain=True)


class SamplingAgent(RoleService):
    """A device that only serves deployed generators (no training, no torch)."""

    role = "device"

    def __init__(self, cfg: RunConfig, bus: Bus, *, device_id: str, out_dir: Path) -> None:
        super().__init__(device_id, cfg, bus)
        self.receiver = DeploymentReceiver(self, out_dir)

    def start(self) -> None:
        """Announce presence and wait for deployments."""
        self.announce_presence(True)
        self.receiver.start()


def device_out_dir(cfg: RunConfig, device_id: str) -> Path:
    """Where a device keeps deployed models and grids: ``deploy.out_dir/<id>``."""
    return Path(cfg.deploy.out_dir or "deploy") / device_id
