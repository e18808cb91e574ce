"""The device side of deployment (DESIGN section 5): verify, load and serve the generator the
cloud deploys, and sample from it on each new deployment and on request; or, when the signed
manifest's ``task`` is ``"classify"`` (FedDEO's product), load the classifier it deploys and
classify the device's own images with it.

A deployment is refused, counted (``estuary_deployments_total{outcome="refused"}`` and
``estuary_rejected_messages_total{reason=...}``), logged and reported back when its
signature does not verify with the device's key, its manifest is malformed or disagrees
with the blob reference, it is not newer than the deployment of its run the device served
last (``deployment_not_newer``), its files cannot be fetched in ``deploy.fetch_timeout_s``,
the model's bytes do not match the manifest's hash, or ONNX Runtime cannot load it; the
model in service stays in service.

Versions: every manifest carries the run it was exported from and a serial inside the signed
bytes (:func:`shared.deploy.signing.new_version`). A device serves a deployment of a run
only if its serial is greater than that of the run's deployment it served last, or if it is
that very deployment again (:func:`shared.deploy.signing.refuse_older`). What it served last
of each run is read back at start from its verified copies under ``out_dir/models``, so a
replayed older deployment is refused after a restart too. A deployment of another run is
judged against that run's own history.

Fetching: a deployment's files are fetched from the cloud's subtree (a blob reference's
``src`` is not signed and is ignored) in a worker thread, within ``deploy.fetch_timeout_s``,
while the device goes on handling its messages (training rounds, sample requests); the role
thread polls the worker and loads the result (:class:`FetchJob`). One deployment is fetched
at a time; up to :data:`MAX_WAITING` more wait their turn and are checked again when it comes.

When devices keep local model parts (FedDiffuse ULATDEC/UDEC), the deployment also
carries the global model's federated tensors; a training device then serves its own model
built from those and its local parts (:mod:`device_agent.personalize`, passed in as
``personalize``), and a device that holds no local parts serves the global model.

Classifiers: a ``"classify"`` deployment passes the same checks (signature, manifest,
version, references, the fetched bytes' sha256), then its card must be a classifier's
(:func:`shared.deploy.onnx_classifier.check_card`) naming the signed file's sha256, and ONNX
Runtime must load it (:meth:`~shared.deploy.onnx_classifier.OnnxClassifier.from_bytes`);
else it is refused like any other. Once in service it classifies the device's own test split
(``test_data`` / ``test_labels`` of a training device), else the first
:data:`CLASSIFY_FALLBACK_IMAGES` of its training images with their labels, else (a
sampling-only device) the labelled image folder ``data.local_dir`` (``--data``) when it has
one, and reports ``classified`` with the accuracy, the images classified and which set they
were (``request_id``: :data:`TEST_SPLIT`, :data:`TRAINING_IMAGES`, :data:`IMAGE_FOLDER` or
:data:`NO_IMAGES`); the figures are written to ``classified.json`` beside the model. A sample
request to a device serving a classifier is answered ``refused`` (``no_generator``).

Torch-free: the sampling-only agent (``estuary device --sample-only``) runs on onnxruntime,
numpy, pillow, paho-mqtt and prometheus-client alone, classifiers included.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from device_agent.deploy_classify import (
    CLASSIFIED_FILE,
    CLASSIFY_FALLBACK_IMAGES,
    IMAGE_FOLDER,
    NO_IMAGES,
    TEST_SPLIT,
    TRAINING_IMAGES,
    ClassifyTask,
    LocalImages,
    local_images,
)
from device_agent.deploy_sample import Personalize, PersonalModel, SampleTask, grid_seed
from device_agent.sampling import OWN_MODEL_FILE, OWN_RECORD_FILE
from device_agent.served import Admitted, Fetched, Served
from shared.config import RunConfig
from shared.deploy.onnx_classifier import (
    ClassifyResult,
)
from shared.deploy.onnx_sampler import SampleStats
from shared.deploy.signing import (
    CLASSIFY_TASK,
    MODEL_BLOB_KIND,
    NOT_NEWER,
    SHARED_BLOB_KIND,
    DeploymentVersion,
    check_model_bytes,
    load_public_key,
    manifest_digest,
    read_signed,
    refuse_older,
    task_of,
    verify_manifest,
    version_of,
)
from shared.errors import (
    CodecError,
    EstuaryError,
    PersonalizeError,
    SignatureError,
    TransportError,
)
from shared.runtime.jobs import WorkerJob
from shared.runtime.service import RoleService
from shared.transport.bus import Bus
from shared.wire.messages import (
    DEPLOY_SOURCES,
    BlobRef,
    Deployment,
    DeploymentReport,
    Presence,
    SampleRequest,
    home_of,
)

__all__ = [  # each task's handler is its module's; their names are read here too
    "CLASSIFIED_FILE",
    "CLASSIFY_FALLBACK_IMAGES",
    "DEPLOY_SOURCE",
    "IMAGE_FOLDER",
    "NO_IMAGES",
    "TEST_SPLIT",
    "TRAINING_IMAGES",
    "DeploymentReceiver",
    "LocalImages",
    "PersonalModel",
    "Personalize",
    "SamplingAgent",
    "Served",
    "device_out_dir",
    "grid_seed",
    "local_images",
]

log = logging.getLogger(__name__)

#: where a device fetches a deployment's files unless its reference names the other source
#: of :data:`~shared.wire.messages.DEPLOY_SOURCES` (the subtree ``estuary deploy`` serves
#: from): the cloud's, which publishes deployments. The ``src`` of a blob reference is not
#: covered by the signature, so no other source is ever asked; the files are checked
#: against the signed manifest whichever served them
DEPLOY_SOURCE = home_of("cloud", "cloud")


def deploy_source(ref: BlobRef | None) -> str:
    """The subtree a deployment's file is fetched from: ``ref``'s own source when it is one
    of :data:`~shared.wire.messages.DEPLOY_SOURCES`, else :data:`DEPLOY_SOURCE`."""
    return ref.src if ref is not None and ref.src in DEPLOY_SOURCES else DEPLOY_SOURCE


#: seconds (bus clock) between two looks at a fetch under way; the longest the first look
#: and the later ones wait for it on the role thread (a blob already here, or on an in-process
#: bus, is handed over at the first look, as if fetched on the role thread)
POLL_S = 0.25
FIRST_JOIN_S = 0.1
JOIN_S = 0.02
#: deployments that may wait while another one is fetched (beyond: the oldest is refused)
MAX_WAITING = 4


class FetchJob(WorkerJob[Fetched]):
    """Fetching ``item``'s files (``work``) in a worker thread, off the role's message
    thread; ``done(result, error)`` runs on the role thread once it is over."""

    def __init__(
        self,
        item: Admitted,
        work: Callable[[], Fetched],
        call_later: Callable[[float, Callable[[], None]], Any],
        done: Callable[[Fetched | None, BaseException | None], None],
    ) -> None:
        self.item = item
        super().__init__(
            work, call_later, done, name=f"deploy-{item.sha256[:12]}", poll_s=POLL_S,
            join_s=JOIN_S, first_join_s=FIRST_JOIN_S,
        )  # fmt: skip


class DeploymentReceiver(SampleTask, ClassifyTask):
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
        #: the deployment being fetched, and those waiting for their turn
        self.job: FetchJob | None = None
        self.waiting: deque[Admitted] = deque()
        #: per run name, (version serial, manifest digest) of the run's deployment served
        #: last: read back from the verified copies under ``out_dir/models``
        self.last_served: dict[str, tuple[int, str]] = self._read_last_served()
        #: the :attr:`~Deployment.ident` of the deployment in service (reports name it)
        self.served_ident: str | None = None
        #: the cloud's retained presence (None: none seen), and a deployment to be fetched
        #: from the cloud held while the cloud is known to be offline
        self.cloud_online: bool | None = None
        self.held: Admitted | None = None

    def start(self) -> None:
        """Subscribe to the retained deployment and to sample requests."""
        t = self.service.topics
        # the cloud's presence first: the broker hands over its retained copy before the
        # retained deployment, so an earlier run's deployment, whose cloud is gone, is held
        self.service.on(t.status(DEPLOY_SOURCE), Presence, self._on_cloud_presence,
                        "msg_presence")  # fmt: skip
        self.service.on(t.cloud_deploy, Deployment, self.on_deployment, "msg_deployment",
                        on_clear=self._on_cleared)  # fmt: skip
        self.service.on(t.cloud_sample, SampleRequest, self.on_sample_request, "msg_sample")
        if self.key is None:
            log.warning("%s: deploy.verify_key is not set; every deployment will be refused",
                        self.service.name)  # fmt: skip

    def _read_last_served(self) -> dict[str, tuple[int, str]]:
        """The newest version of each run among this device's verified copies of the
        deployments it served (``out_dir/models/*``); a copy that does not verify is
        skipped."""
        found: dict[str, tuple[int, str]] = {}
        models = self.out_dir / "models"
        if self.key is None or not models.is_dir():
            return found
        for path in sorted(models.iterdir()):
            if not (path / "manifest.json").is_file():
                continue
            try:
                text, signature = read_signed(path)
                if signature is None:
                    continue
                manifest = verify_manifest(text, signature, self.key)
            except SignatureError as err:
                log.warning("%s: %s is not a verified deployment (%s: %s); ignored",
                            self.service.name, path, err.reason, err.detail)  # fmt: skip
                continue
            version = version_of(manifest)
            best = found.get(version.run)
            if best is None or version.serial > best[0]:
                found[version.run] = (version.serial, manifest_digest(manifest))
        for run, (serial, _) in sorted(found.items()):
            log.info("%s: served version %d of run %s before; older deployments of it will "
                     "be refused", self.service.name, serial, run)  # fmt: skip
        return found

    # -- deployments ---------------------------------------------------------------------
    def _on_cloud_presence(self, msg: Presence) -> None:
        if msg.role != "cloud":
            return
        self.cloud_online = msg.online
        if msg.online and self.held is not None:
            item, self.held = self.held, None
            log.info("%s: the cloud is online: fetching deployment %s", self.service.name,
                     item.sha256[:12])  # fmt: skip
            self._queue(item)

    def _on_cleared(self, _topic: str) -> None:
        """The retained deployment was cleared (a new run's cloud starting under this run
        name): nothing held or waiting is fetched any more."""
        dropped = [*self.waiting, *([self.held] if self.held is not None else [])]
        self.waiting.clear()
        self.held = None
        if dropped:
            log.info("%s: the retained deployment was cleared: %d deployment(s) not fetched",
                     self.service.name, len(dropped))  # fmt: skip
        self.service.traffic.note("deployments_withdrawn", len(dropped))

    def on_deployment(self, msg: Deployment) -> None:
        """Check a deployment (signature, manifest, version, references), then fetch its
        files off this thread (:class:`FetchJob`); it is loaded and sampled from when they
        are here."""
        sha = msg.model_ref.sha256
        if self.served is not None and self.served.sha256 == sha:
            return  # already serving it (retained replay after a reconnect)
        try:
            item = self._admit(msg)
        except SignatureError as err:
            self._refuse(sha, err.reason, err.detail, msg.ident)
            return
        if deploy_source(msg.model_ref) == DEPLOY_SOURCE and self.cloud_online is False:
            # its files are the cloud's, and the cloud is gone: an earlier run's deployment
            # (a new cloud clears it) or one whose cloud stopped; fetched if it comes back
            if self.held is None or self.held.digest != item.digest:
                log.info("%s: deployment %s waits for the cloud, which is offline",
                         self.service.name, sha[:12])  # fmt: skip
            self.held = item
            return
        self._queue(item)

    def _queue(self, item: Admitted) -> None:
        """Fetch ``item`` now, or after the deployment being fetched."""
        under_way = [self.job.item] if self.job is not None else []
        if any(i.digest == item.digest for i in [*under_way, *self.waiting]):
            return  # the same deployment again (a retained copy) while it is on its way
        if self.job is None:
            self._start(item)
            return
        if len(self.waiting) >= MAX_WAITING:
            dropped = self.waiting.popleft()
            self._refuse(dropped.msg.model_ref.sha256, "deployment_queue_full",
                         f"{MAX_WAITING} deployments waited for the one being fetched",
                         dropped.msg.ident)  # fmt: skip
        self.waiting.append(item)
        log.info("%s: deployment %s waits for %s to be fetched", self.service.name,
                 item.sha256[:12], self.job.item.sha256[:12])  # fmt: skip

    def _admit(self, msg: Deployment) -> Admitted:
        """The checks made before fetching anything: the signature, the manifest, the
        version (against the run's deployment served last) and the blob references."""
        if self.key is None:
            raise SignatureError("no_verify_key", "deploy.verify_key is not configured")
        manifest = verify_manifest(msg.manifest, msg.signature, self.key)
        want = manifest["model"]
        if want["file"] in (OWN_MODEL_FILE, OWN_RECORD_FILE):
            raise SignatureError("bad_manifest", f"model.file {want['file']!r} is reserved")
        version = version_of(manifest)
        digest = manifest_digest(manifest)
        self._check_newer(version, digest)
        self._check_ref(manifest, "model", msg.model_ref)
        shared = self._wants_shared(manifest, want["sha256"])
        if shared:
            self._check_ref(manifest, "shared", msg.shared_ref)
        return Admitted(msg, manifest, version, digest, shared)

    def _check_newer(self, version: DeploymentVersion, digest: str) -> None:
        """Raise ``SignatureError("deployment_not_newer")`` unless a deployment of
        ``version`` may replace the deployment of its run served last."""
        why = refuse_older(version, digest, self.last_served.get(version.run))
        if why is not None:
            raise SignatureError(NOT_NEWER, why)

    def _check_ref(self, manifest: dict[str, Any], entry: str, ref: BlobRef | None) -> None:
        """The reference ``ref`` must name the manifest's ``entry`` file, within the size
        limit; its ``src`` is not signed, so the file is fetched from the cloud or from
        ``estuary deploy``'s subtree whatever it says (:func:`deploy_source`: another one is
        counted as ``deploy_source_ignored``)."""
        want = manifest[entry]
        if ref is None or (ref.sha256, ref.size) != (want["sha256"], want["size"]):
            raise SignatureError("bad_manifest", f"the {entry} blob reference is not the "
                                 "signed file")  # fmt: skip
        if want["size"] > self.service.cfg.broker.max_blob_bytes:
            raise SignatureError("too_large", f"{entry} of {want['size']} bytes")
        if ref.src not in (None, *DEPLOY_SOURCES):
            self.service.traffic.note("deploy_source_ignored")
            log.warning("%s: the %s blob reference names %r as its source; fetching it from %r",
                        self.service.name, entry, ref.src, DEPLOY_SOURCE)  # fmt: skip

    def _wants_shared(self, manifest: dict[str, Any], sha: str) -> bool:
        """Whether the deployment's shared tensors are fetched: it carries them and this
        device holds local parts to build its own model with (see the module docstring).
        A device without local parts never fetches them."""
        if "shared" not in manifest:
            return False
        if self.personalize is None or not self.personalize.holds_local_parts():
            log.warning("%s: deployment %s keeps parts on the training devices and this device "
                        "holds none: serving the global model, whose local parts are at their "
                        "initialization", self.service.name, sha[:12])  # fmt: skip
            return False
        return True

    def _start(self, item: Admitted) -> None:
        """Fetch ``item``'s files in a worker; :meth:`_fetched` takes over when they are in."""
        self.job = FetchJob(
            item,
            lambda: self._fetch_files(item),
            self.service.ep.call_later,
            lambda result, error: self._fetched(item, result, error),
        )
        self.job.start()

    def _fetch_files(self, item: Admitted) -> Fetched:
        """The worker: fetch the model (and the shared tensors) and check them against the
        manifest. Touches nothing of the device."""
        msg = item.msg
        model = self._fetch(item.manifest, "model", MODEL_BLOB_KIND, deploy_source(msg.model_ref))
        shared = (
            self._fetch(item.manifest, "shared", SHARED_BLOB_KIND, deploy_source(msg.shared_ref))
            if item.shared
            else None
        )
        return Fetched(model, shared)

    def _fetch(self, manifest: dict[str, Any], entry: str, kind: str, src: str) -> bytes:
        """The manifest's ``entry`` file from ``src`` (:func:`deploy_source`), within
        ``deploy.fetch_timeout_s``, checked against the manifest."""
        want = manifest[entry]
        data = self.service.ep.get_blob(
            want["sha256"], want["size"], kind=kind, src=src, timeout_s=self.cfg.fetch_timeout_s,
        )  # fmt: skip
        check_model_bytes(data, manifest, entry)  # the blob layer checked; the file is what runs
        return data if isinstance(data, bytes) else bytes(data)  # a large one came mapped

    def _fetched(self, item: Admitted, result: Fetched | None, error: BaseException | None) -> None:
        """On the role thread: serve the fetched deployment (or refuse it), then start the
        next one waiting."""
        self.job = None
        try:
            served = None
            if error is None and result is not None:
                try:
                    served = self._install(item, result)
                except Exception as err:  # refused below like an error of the fetch
                    error = err
            if served is None:
                self._refuse_error(item.msg, error or EstuaryError("no result"))
            else:
                self._in_service(item, served)
        finally:
            self._next()

    def _next(self) -> None:
        """Start the next waiting deployment that may still replace the one in service."""
        while self.job is None and self.waiting:
            item = self.waiting.popleft()
            if self.served is not None and self.served.sha256 == item.msg.model_ref.sha256:
                continue
            try:
                self._check_newer(item.version, item.digest)
            except SignatureError as err:
                self._refuse(item.msg.model_ref.sha256, err.reason, err.detail, item.msg.ident)
                continue
            self._start(item)

    def _refuse_error(self, msg: Deployment, err: BaseException) -> None:
        """Refuse deployment ``msg`` for what fetching or loading it raised."""
        sha, ident = msg.model_ref.sha256, msg.ident
        if isinstance(err, SignatureError):
            self._refuse(sha, err.reason, err.detail, ident)
        elif isinstance(err, (CodecError, TransportError)):
            self._refuse(sha, err.reason, str(err), ident)
        elif isinstance(err, PersonalizeError):
            self._refuse(sha, "personalize_failed", str(err), ident)
        elif isinstance(err, EstuaryError):
            self._refuse(sha, "bad_model", str(err), ident)
        else:  # whatever a signed but broken model raises: refuse, report
            log.error("%s: deployment %s failed to load", self.service.name, sha[:12],
                      exc_info=err)  # fmt: skip
            self._refuse(sha, "bad_model", f"{type(err).__name__}: {err}", ident)

    def _install(self, item: Admitted, fetched: Fetched) -> Served:
        """The deployment's model to serve, installed by the handler of its task (the
        signed manifest's ``task``): a generator's (:class:`~device_agent.deploy_sample.SampleTask`)
        or a classifier's (:class:`~device_agent.deploy_classify.ClassifyTask`)."""
        if task_of(item.manifest) == CLASSIFY_TASK:
            return self._install_classifier(item, fetched)
        return self._install_generator(item, fetched)

    def _in_service(self, item: Admitted, served: Served) -> None:
        """Put ``served`` in service: remember its version, update the metrics, report it
        and sample a grid from it (a classifier: classify the device's own images)."""
        self.last_served[item.version.run] = (item.version.serial, item.digest)
        old = self.served
        self.served = served
        self.served_ident = item.msg.ident
        sha, card = served.sha256, served.manifest["card"]
        m = self.service.metrics
        m.deployments.labels(outcome="loaded").inc()
        if old is not None:
            m.deployed.remove(old.sha256[:16])
        m.deployed.labels(sha256=sha[:16]).set(1)
        m.deployment_version.set(item.version.serial)
        m.model_params.set(card.get("params", 0))
        m.model_bytes.set(served.manifest["model"]["size"])
        log.info("%s: serving %s%s (%s, %s params, version %d of run %s) on %s",
                 self.service.name, sha[:12], " as its own model" if served.personal else "",
                 card.get("name"), card.get("params"), item.version.serial, item.version.run,
                 served.provider)  # fmt: skip
        self._report("loaded", sha)
        if served.classifier is not None:
            self._classify()
            return
        steps = self.cfg.sample_steps
        seed = grid_seed(self.service.cfg.run.seed, self.service.name)
        self._sample(self.cfg.grid_size, steps, seed, f"deploy-{sha[:12]}")

    def _refuse(self, sha: str, reason: str, detail: str, deployment: str | None = None) -> None:
        """Refuse deployment ``deployment`` (its :attr:`~Deployment.ident`; model ``sha``):
        counted, and reported about that deployment."""
        self.service.reject(reason, f"deployment {sha[:12]}: {detail}")
        self.service.metrics.deployments.labels(outcome="refused").inc()
        self._report("refused", sha, reason=f"{reason}: {detail}"[:500], deployment=deployment)

    # -- sampling ------------------------------------------------------------------------

    # -- classifying ----------------------------------------------------------------------

    def _report(
        self, event: str, sha: str | None, *, reason: str = "", request_id: str = "",
        stats: SampleStats | None = None, grid: str = "",
        classified: ClassifyResult | None = None, accuracy: float | None = None,
        deployment: str | None = None,
    ) -> None:  # fmt: skip
        served = self.served
        if deployment is None and served is not None and sha == served.sha256:
            deployment = self.served_ident  # a report about the model in service
        n, rate, latency = 0, 0.0, 0.0
        if stats is not None:
            n, rate, latency = stats.n, stats.images_per_s, stats.latency_s
        elif classified is not None:
            n, rate = len(classified.predictions), classified.images_per_s
            latency = classified.seconds
        report = DeploymentReport(
            device=self.service.name,
            event=event,  # type: ignore[arg-type]
            model_sha256=sha,
            deployment=deployment,
            session=self.service.joined_session(),
            serving=served.sha256 if served is not None else None,
            personal=served.personal if served is not None else None,
            reason=reason,
            request_id=request_id[:64],
            n=n,
            steps=stats.steps if stats else 0,
            images_per_s=round(rate, 4) if math.isfinite(rate) else 0.0,
            latency_s=round(latency, 5) if math.isfinite(latency) else 0.0,
            provider=served.provider[:64] if served is not None else "",
            grid=grid[-500:],
            accuracy=accuracy,
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
