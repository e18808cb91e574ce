"""The cloud side of deployment (DESIGN section 5): export the final generator, sign its
manifest, publish it retained, serve the ONNX model through the blob layer, and collect the
devices' reports (loaded / refused, images/s).

Used by the cloud process after the last round and by ``estuary deploy`` on demand.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.atomic import atomic_write
from shared.config import model_kind
from shared.deploy.signing import (
    MODEL_BLOB_KIND,
    SHARED_BLOB_KIND,
    check_model_bytes,
    key_id,
    new_version,
    read_signed,
    sign_manifest,
    verify_manifest,
    version_of,
)
from shared.errors import EstuaryError, ExportError
from shared.runtime.service import RoleService
from shared.wire.messages import BlobRef, Deployment, DeploymentReport, SampleRequest

log = logging.getLogger(__name__)


class PublisherService(RoleService):
    """A cloud-role connection that only publishes deployments (``estuary deploy``), for
    when the cloud process itself is not running."""

    role = "cloud"

    def start(self) -> None:
        """Nothing to subscribe to beyond what :class:`DeploymentPublisher` adds."""


class DeploymentPublisher:
    """Publishes signed deployments as ``service`` (which must be the cloud) and keeps the
    latest report of every device."""

    def __init__(self, service: RoleService, signing_key: Any) -> None:
        self.service = service
        self.key = signing_key
        self.current: Deployment | None = None
        self.reports: dict[str, DeploymentReport] = {}
        self.on_report: Callable[[DeploymentReport], None] | None = None
        t = service.topics
        service.on(t.all_device_deploy, DeploymentReport, self._on_report, "msg_deploy_report")

    def _on_report(self, msg: DeploymentReport) -> None:
        self.reports[msg.device] = msg
        if msg.event == "refused":
            log.warning("%s refused deployment %s: %s", msg.device,
                        (msg.model_sha256 or "?")[:12], msg.reason)  # fmt: skip
        elif msg.event == "sampled":
            log.info("%s sampled %d images at %.2f images/s (%s)", msg.device, msg.n,
                     msg.images_per_s, msg.provider)  # fmt: skip
        if self.on_report is not None:
            self.on_report(msg)

    def publish(self, export_dir: Path) -> Deployment:
        """:meth:`prepare` ``export_dir``'s deployment and publish it, retained."""
        msg = self.prepare(export_dir)
        self.service.send(self.service.topics.cloud_deploy, msg, retain=True)
        self.current = msg
        version = version_of(json.loads(msg.manifest))
        log.info("published deployment %s (%d bytes), version %d of run %s",
                 msg.model_ref.sha256[:12], msg.model_ref.size, version.serial,
                 version.run)  # fmt: skip
        return msg

    def prepare(self, export_dir: Path) -> Deployment:
        """Sign ``export_dir``'s manifest (re-using a signature that verifies with our key)
        and upload its model as a blob; the deployment message, not yet sent.

        A manifest exported before manifests carried a version gets one now (a new serial
        of its card's source run) and is signed again: devices refuse deployments of a run
        that are not newer than the one they served. The version of a manifest that has one
        is kept: publishing an older export again is refused by devices serving a newer one
        (export it again to make it the newest)."""
        text, signature = read_signed(export_dir)
        manifest = json.loads(text)
        pub = self.key.public_key()
        if signature is not None:
            try:
                verify_manifest(text, signature, pub)
            except EstuaryError:
                signature = None  # signed by another key: sign again with ours
        if "version" not in manifest:
            manifest["version"] = new_version(version_of(manifest).run).to_dict()
            signature = None
            log.info("%s has no deployment version; publishing it as %s", export_dir,
                     manifest["version"])  # fmt: skip
        if signature is None:
            text, signature = sign_manifest(manifest, self.key)
        refs = {}
        for entry, kind in (("model", MODEL_BLOB_KIND), ("shared", SHARED_BLOB_KIND)):
            if entry not in manifest:
                continue
            data = (export_dir / manifest[entry]["file"]).read_bytes()
            check_model_bytes(data, manifest, entry)
            sha = self.service.ep.put_blob(data, kind=kind)
            # devices fetch from the cloud's subtree whatever src says (it is not signed)
            refs[entry] = BlobRef(sha256=sha, size=len(data), kind=kind, src=self.service.home)
        return Deployment(
            manifest=text, signature=signature, key_id=key_id(pub), model_ref=refs["model"],
            shared_ref=refs.get("shared"),
        )  # fmt: skip

    def request_samples(
        self, request_id: str, *, devices: list[str] | None = None, n: int = 16, steps: int = 50,
        seed: int = 0,
    ) -> None:  # fmt: skip
        """Ask ``devices`` (all when empty) to sample ``n`` images."""
        req = SampleRequest(
            request_id=request_id, devices=devices or [], n=n, steps=steps, seed=seed
        )
        self.service.send(self.service.topics.cloud_sample, req)

    def settled(self, devices: list[str]) -> bool:
        """Whether every device in ``devices`` has sampled from or refused the current
        deployment."""
        if self.current is None:
            return False
        sha = self.current.model_ref.sha256
        for d in devices:
            r = self.reports.get(d)
            if r is None or r.model_sha256 != sha or r.event == "loaded":
                return False
        return True

    def summary(self) -> dict[str, Any]:
        """JSON form of the latest report of every device."""
        return {d: r.model_dump(exclude={"v", "kind"}) for d, r in sorted(self.reports.items())}


def deploy_when_trained(
    cloud: Any, run_dir: Path, *, quality: Callable[[], dict[str, Any] | None] = lambda: None
) -> None:
    """Arm ``cloud`` (a :class:`~cloud.service.CloudServer`) to export, sign and publish the
    final generator once training ends, then wait (``deploy.wait_s`` at most) for every
    registered online device to sample from it or refuse it before declaring the run done.

    Without ``deploy.signing_key`` (or with ``deploy.enabled = false``) the run completes
    without a deployment; a refused export (parity) is logged and the run completes.
    """
    cfg = cloud.cfg
    if not cfg.deploy.enabled:
        return
    if model_kind(cfg.model.preset) == "classifier":
        collect_own_classifiers(cloud, run_dir)
        return
    if not cfg.deploy.signing_key:
        log.warning("deploy.signing_key is not set: the trained model will not be deployed "
                    "(generate keys with `estuary keys`)")  # fmt: skip
        return
    from shared.deploy.signing import load_private_key

    key = load_private_key(cfg.deploy.signing_key)
    publisher = DeploymentPublisher(cloud, key)
    out = run_dir / "deploy"

    def write_reports() -> None:
        atomic_write(out / "reports.json", (json.dumps(publisher.summary(), indent=2)).encode())

    def finish() -> None:
        write_reports()
        cloud.complete()

    def waiting_for() -> list[str]:
        return sorted(d for d in cloud.devices if d not in cloud.offline)

    def on_report(_: DeploymentReport) -> None:
        if not cloud.done and publisher.settled(waiting_for()):
            finish()

    def on_trained() -> None:
        from shared.deploy.export import export_module

        try:
            result = export_module(
                cfg, cloud.global_module(), cloud.plan, out,
                round_=cloud.round, source=str(run_dir / "checkpoints"), fp16=cfg.deploy.fp16,
                opset=cfg.deploy.opset, threshold=cfg.deploy.parity_threshold,
                parity_steps=cfg.deploy.parity_steps, signing_key=key, quality=quality(),
                algorithm=cloud.algorithm,
            )  # fmt: skip
        except ExportError as err:
            log.error("%s; the run ends without a deployment", err)
            cloud.complete()
            return
        p = result.parity
        log.info("exported %s: parity %.2g (random) / %.2g (%d-step trajectory), %d bytes",
                 result.model_path, p.random_max_abs, p.trajectory_max_abs, p.trajectory_steps,
                 result.card["onnx_bytes"])  # fmt: skip
        publisher.publish(out)
        publisher.on_report = on_report
        if not waiting_for() or cfg.deploy.wait_s == 0:
            finish()
            return
        cloud.ep.call_later(cfg.deploy.wait_s, lambda: None if cloud.done else finish())

    cloud.on_trained = on_trained


def collect_own_classifiers(cloud: Any, run_dir: Path) -> None:
    """A classifier run's deployment: each device exports and serves its own model (the
    cloud never held it: pFedGPA's devices fine-tune their personal parameters last) and
    reports it (``classified``, with its test accuracy, or ``refused``). Once training ends
    the cloud waits (``deploy.wait_s`` at most) for every registered online device's report,
    writes them to ``deploy/reports.json`` and declares the run done."""
    cfg = cloud.cfg
    reports: dict[str, DeploymentReport] = {}
    out = run_dir / "deploy"

    def waiting_for() -> list[str]:
        return sorted(d for d in cloud.devices if d not in cloud.offline and d not in reports)

    def finish() -> None:
        if cloud.done:
            return
        summary = {d: r.model_dump(exclude={"v", "kind"}) for d, r in sorted(reports.items())}
        atomic_write(out / "reports.json", json.dumps(summary, indent=2).encode())
        got = [r.accuracy for r in reports.values() if r.accuracy is not None]
        log.info("%d device(s) serve their own classifier%s", len(got),
                 f", mean test accuracy {sum(got) / len(got):.4f}" if got else "")  # fmt: skip
        cloud.complete()

    def on_report(msg: DeploymentReport) -> None:
        if msg.event not in ("classified", "refused"):
            return
        reports[msg.device] = msg
        if cloud.on_trained is None and not waiting_for():  # training is over
            finish()

    cloud.on(cloud.topics.all_device_deploy, DeploymentReport, on_report, "msg_deploy_report")

    def on_trained() -> None:
        cloud.on_trained = None
        if not waiting_for() or cfg.deploy.wait_s == 0:
            finish()
            return
        cloud.ep.call_later(cfg.deploy.wait_s, finish)

    cloud.on_trained = on_trained
