"""The cloud side of deployment (DESIGN section 5): export the final generator, sign its
manifest, publish it retained, serve the ONNX model through the blob layer, and collect the
devices' reports (loaded / refused, images/s).

A one-shot algorithm (FedDEO) deploys its product instead of the generator it trained with:
the classifier in ``cloud.final`` (:func:`export_final_classifier`), signed and published the
same way with ``task = "classify"``; the devices classify their own test split with it and
report their accuracy (``classified``).

Used by the cloud process after the last round and by ``estuary deploy`` on demand.
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.atomic import atomic_write
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
from shared.families import family_of
from shared.logs import printable
from shared.runtime.service import RoleService
from shared.wire.messages import BlobRef, Deployment, DeploymentReport, SampleRequest

if TYPE_CHECKING:  # torch, which `estuary deploy` does not need to import
    import torch

    from shared.config import RunConfig
    from shared.deploy.classifier_export import ClassifierExport
    from shared.methods.api import FinalResult

log = logging.getLogger(__name__)

#: images of the test split a deployed classifier's parity check runs on (the first ones)
PARITY_IMAGES = 256
#: deployments of a run whose reports a publisher keeps counting (the newest ones)
KNOWN_DEPLOYMENTS = 16
#: the most bytes of JSON the final report takes in a deployed classifier's card (the signed
#: manifest carrying the card is at most 64 KiB); its largest entries are left out beyond
REPORT_CARD_BYTES = 16 * 1024


class PublisherService(RoleService):
    """A cloud-role connection that only publishes deployments (``estuary deploy``), beside
    a running cloud or without one: it serves the files from its own subtree
    (``home = DEPLOYER_HOME``), where the cloud never answers."""

    role = "cloud"

    def start(self) -> None:
        """Nothing to subscribe to beyond what :class:`DeploymentPublisher` adds."""


class DeploymentPublisher:
    """Publishes signed deployments as ``service`` (which must be the cloud) and keeps the
    latest report of every device about a deployment of this run: one it published or saw
    on the deployment topic since the retained deployment was last cleared (a report names
    its deployment: :attr:`DeploymentReport.deployment`). Reports about any other
    deployment, such as those an earlier run under the same name left retained (a fresh
    cloud clears its deployment), are only counted (``deploy_report_other_deployment``)."""

    def __init__(self, service: RoleService, signing_key: Any) -> None:
        self.service = service
        self.key = signing_key
        self.current: Deployment | None = None
        self.reports: dict[str, DeploymentReport] = {}
        self.on_report: Callable[[DeploymentReport], None] | None = None
        #: the deployments (their :attr:`~Deployment.ident`) whose reports count, newest last
        self.known: deque[str] = deque(maxlen=KNOWN_DEPLOYMENTS)
        t = service.topics
        service.on(t.all_device_deploy, DeploymentReport, self._on_report, "msg_deploy_report")
        service.on(t.cloud_deploy, Deployment, self._on_deployment, "msg_deployment",
                   on_clear=self._on_cleared)  # fmt: skip

    def _on_deployment(self, msg: Deployment) -> None:
        if msg.ident not in self.known:
            self.known.append(msg.ident)

    def _on_cleared(self, _topic: str) -> None:
        """The retained deployment was cleared: no earlier deployment's report counts."""
        self.known.clear()
        if self.current is not None:
            self.known.append(self.current.ident)
        self.reports = {d: r for d, r in self.reports.items() if r.deployment in self.known}

    def _on_report(self, msg: DeploymentReport) -> None:
        if msg.deployment is None or msg.deployment not in self.known:
            # a report about another deployment: an earlier run's, retained on the broker
            # under the same run name, or one this publisher did not publish
            self.service.traffic.note("deploy_report_other_deployment")
            return
        self.reports[msg.device] = msg
        # a device's free text (reason, provider, request id) is escaped before it is logged
        if msg.event == "refused":
            log.warning("%s refused deployment %s: %s", msg.device,
                        (msg.model_sha256 or "?")[:12], printable(msg.reason))  # fmt: skip
        elif msg.event == "sampled":
            log.info("%s sampled %d images at %.2f images/s (%s)", msg.device, msg.n,
                     msg.images_per_s, printable(msg.provider))  # fmt: skip
        elif msg.event == "classified":
            log.info("%s classified %d images (%s): accuracy %s at %.0f images/s (%s)",
                     msg.device, msg.n, printable(msg.request_id or "?"),
                     "-" if msg.accuracy is None else f"{msg.accuracy:.4f}", msg.images_per_s,
                     printable(msg.provider))  # fmt: skip
        if self.on_report is not None:
            self.on_report(msg)

    def publish(self, export_dir: Path) -> Deployment:
        """:meth:`prepare` ``export_dir``'s deployment and publish it, retained."""
        msg = self.prepare(export_dir)
        self.current = msg  # before it is sent: the first reports about it count
        self._on_deployment(msg)
        self.service.send(self.service.topics.cloud_deploy, msg, retain=True)
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
        """Whether every device in ``devices`` has sampled from (a generator), classified
        with (a classifier) or refused the current deployment."""
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


def parity_batch(cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """The fixed images a deployed classifier's export is parity-checked on: the first
    :data:`PARITY_IMAGES` of the configured dataset's test split with their labels (the
    card then records ONNX Runtime's accuracy on them), or, where there is no test split
    (image folders, a dataset that cannot be read here), as many seeded random images in
    [-1, 1] without labels; and a line saying which."""
    import torch

    from shared.data.datasets import load_dataset, to_model_input

    d = cfg.data
    why = "image folders have no test split"
    if d.dataset != "folder":
        try:
            test = load_dataset(
                d.dataset, d.path, split="test", size=d.synthetic_size, seed=cfg.run.seed,
                class_names=d.class_names,
            )  # fmt: skip
            images = to_model_input(test.images[:PARITY_IMAGES], 1)
            labels = torch.from_numpy(test.labels[:PARITY_IMAGES].astype("int64"))
            return images, labels, f"the first {len(images)} images of {d.dataset}'s test split"
        except EstuaryError as err:
            why = str(err)
            log.warning("parity images: %s; using seeded random images instead", err)
    gen = torch.Generator().manual_seed(cfg.run.seed)
    images = torch.rand((PARITY_IMAGES, 1, 32, 32), generator=gen) * 2 - 1
    return images, None, f"{PARITY_IMAGES} seeded random images in [-1, 1] ({why[:200]})"


def _json_safe(value: Any) -> Any:
    """``value`` as plain JSON: non-finite floats as None, unknown objects as strings."""
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    try:  # numpy and torch scalars
        return _json_safe(value.item())
    except (AttributeError, TypeError, ValueError):
        return str(value)


def report_for_card(report: dict[str, Any], budget: int = REPORT_CARD_BYTES) -> dict[str, Any]:
    """A one-shot algorithm's final report (``cloud.final.report``: FedDEO's accuracy per
    domain, ...) as the deployed card carries it: plain JSON, its largest entries left out
    (and named under ``omitted``) until it fits in ``budget`` bytes."""
    out: dict[str, Any] = _json_safe(dict(report))
    omitted: list[str] = []
    while out and len(json.dumps(out)) > budget:
        largest = max(out, key=lambda k: len(json.dumps(out[k])))
        omitted.append(largest)
        del out[largest]
    if omitted:
        out["omitted"] = sorted(omitted)
    return out


def export_final_classifier(
    cfg: RunConfig,
    final: FinalResult,
    out_dir: Path,
    *,
    signing_key: Any,
    round_: int | None,
    source: str,
) -> ClassifierExport:
    """Export a one-shot run's product, the classifier ``final`` (state and preset, from
    :meth:`~shared.methods.api.Finalizer.finalize`), into ``out_dir`` for deployment:
    the parity-gated ONNX export (:func:`parity_batch`'s images, ``deploy.parity_threshold``
    on the logits, every argmax the same), a card naming the source run and carrying the
    final report (:func:`report_for_card`), and a manifest signed with ``signing_key``
    whose ``task`` is ``"classify"``
    (:func:`~shared.deploy.classifier_export.export_signed_classifier`). ``round_``: the
    run's last round, counted from 1. Raises :class:`ExportError` (nothing deployable
    written) when the state is not a classifier of its preset or the export is refused."""
    from shared.deploy.classifier_export import export_signed_classifier
    from shared.models.classifier import build_classifier

    try:
        model = build_classifier(final.preset, seed=cfg.run.seed)
        model.load_state_dict(final.model)
    except (EstuaryError, RuntimeError, KeyError, TypeError) as err:
        raise ExportError(
            f"{cfg.algorithm.name}'s final model is not a {final.preset!r} classifier: {err}"
        ) from None
    images, labels, what = parity_batch(cfg)
    origin = {"run": cfg.run.name, "round": round_, "algorithm": cfg.algorithm.name}
    card = {
        "name": f"{cfg.run.name}-{final.preset}",
        "source": {**origin, "path": source, "config_digest": cfg.digest()},
        "parity_images": what,
        "final": report_for_card(final.report),
    }
    return export_signed_classifier(
        model.eval(), out_dir, images=images, labels=labels, signing_key=signing_key,
        run=cfg.run.name, opset=cfg.deploy.opset, tolerance=cfg.deploy.parity_threshold,
        origin=origin, card=card,
    )  # fmt: skip


def deploy_when_trained(
    cloud: Any, run_dir: Path, *, quality: Callable[[], dict[str, Any] | None] = lambda: None
) -> None:
    """Arm ``cloud`` (a :class:`~cloud.service.CloudServer`) to export, sign and publish the
    final generator once training ends, then wait (``deploy.wait_s`` at most) for every
    registered online device to sample from it or refuse it before declaring the run done.

    A method whose cloud makes the product (a finalizer, ``traffic.product = "cloud_made"``:
    FedDEO) deploys the classifier its final step made (``cloud.final``,
    :func:`export_final_classifier`) instead, through the
    same signed path; the devices classify their own test split with it and report
    (``classified``, with their accuracy, or ``refused``).

    Without ``deploy.signing_key`` (or with ``deploy.enabled = false``) the run completes
    without a deployment; a refused export (parity) is logged and the run completes.
    """
    cfg = cloud.cfg
    if not cfg.deploy.enabled:
        return
    if family_of(cfg.model.preset).served_by == "devices":
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
        got = [r.accuracy for r in publisher.reports.values()
               if r.event == "classified" and r.accuracy is not None]  # fmt: skip
        if got:
            log.info("%d device(s) classified their own images with the deployed classifier: "
                     "mean accuracy %.4f", len(got), sum(got) / len(got))  # fmt: skip
        cloud.complete()

    def waiting_for() -> list[str]:
        return sorted(d for d in cloud.devices if d not in cloud.offline)

    def on_report(_: DeploymentReport) -> None:
        if not cloud.done and publisher.settled(waiting_for()):
            finish()

    def export_generator() -> None:
        from shared.deploy.export import export_module

        result = export_module(
            cfg, cloud.global_module(), cloud.plan, out,
            round_=cloud.round, source=str(run_dir / "checkpoints"), fp16=cfg.deploy.fp16,
            opset=cfg.deploy.opset, threshold=cfg.deploy.parity_threshold,
            parity_steps=cfg.deploy.parity_steps, signing_key=key, quality=quality(),
            algorithm=cloud.algorithm,
        )  # fmt: skip
        p = result.parity
        log.info("exported %s: parity %.2g (random) / %.2g (%d-step trajectory), %d bytes",
                 result.model_path, p.random_max_abs, p.trajectory_max_abs, p.trajectory_steps,
                 result.card["onnx_bytes"])  # fmt: skip

    def export_classifier() -> None:
        final = cloud.final
        if final is None:
            raise ExportError(f"{cfg.algorithm.name} is one-shot but its final step made no "
                              "model to deploy")  # fmt: skip
        result = export_final_classifier(
            cfg, final, out, signing_key=key, round_=cloud.round,
            source=str(run_dir / "checkpoints"),
        )  # fmt: skip
        p = result.parity
        log.info("exported the %s classifier %s: parity %.2g (logits), argmax %.3f on %s; "
                 "%d bytes", final.preset, result.model_path, p.max_abs, p.argmax_agreement,
                 result.card["parity_images"], result.card["onnx_bytes"])  # fmt: skip

    def on_trained() -> None:
        try:
            if cloud.algorithm.finalizer is not None:
                export_classifier()
            else:
                export_generator()
        except ExportError as err:
            log.error("%s; the run ends without a deployment", err)
            cloud.complete()
            return
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
        if msg.session != cloud.session:  # an earlier run's, retained under this name
            cloud.traffic.note("deploy_report_other_deployment")
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
