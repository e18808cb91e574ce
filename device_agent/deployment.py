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

import hashlib
import json
import logging
import math
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from device_agent.sampling import OWN_MODEL_FILE, OWN_RECORD_FILE, save_grid
from shared.atomic import atomic_write
from shared.config import RunConfig
from shared.deploy.onnx_classifier import (
    CARD_FILE,
    ClassifyResult,
    OnnxClassifier,
    read_image_folder,
)
from shared.deploy.onnx_sampler import OnnxGenerator, SampleStats
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
    write_signed,
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
    BlobRef,
    Deployment,
    DeploymentReport,
    SampleRequest,
    home_of,
)

log = logging.getLogger(__name__)

_SAFE = re.compile(r"[^A-Za-z0-9_-]")

#: where a device fetches a deployment's files: the subtree of the cloud, which publishes
#: deployments (the ``src`` of a blob reference is not covered by the signature)
DEPLOY_SOURCE = home_of("cloud", "cloud")
#: seconds (bus clock) between two looks at a fetch under way; the longest the first look
#: and the later ones wait for it on the role thread (a blob already here, or on an in-process
#: bus, is handed over at the first look, as if fetched on the role thread)
POLL_S = 0.25
FIRST_JOIN_S = 0.1
JOIN_S = 0.02
#: deployments that may wait while another one is fetched (beyond: the oldest is refused)
MAX_WAITING = 4
#: training images a deployed classifier classifies on a device without a test split (the
#: first ones), and the images read from a sampling-only device's folder
CLASSIFY_FALLBACK_IMAGES = 256
#: which of its images a device classified with a deployed classifier (the report's
#: ``request_id``)
TEST_SPLIT = "own-test-split"
TRAINING_IMAGES = "own-training-images"
IMAGE_FOLDER = "own-image-folder"
NO_IMAGES = "no-images"
#: the figures of the last classification, beside the deployed classifier
CLASSIFIED_FILE = "classified.json"


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
    device's own ONNX model) when the generator is the device's own; ``version``: the
    deployment's version (None: not known). A generator deployment has its ``generator``; a
    classifier deployment (task ``"classify"``) its ``classifier`` and no generator."""

    sha256: str
    generator: OnnxGenerator | None
    manifest: dict[str, Any]
    path: Path
    personal: str | None = None
    version: DeploymentVersion | None = None
    classifier: OnnxClassifier | None = None

    @property
    def provider(self) -> str:
        """The execution provider the model in service runs on."""
        model = self.generator if self.generator is not None else self.classifier
        return model.providers[0] if model is not None else ""


@dataclass(frozen=True)
class LocalImages:
    """The images a device classifies with a deployed classifier: uint8 (N, H, W) pixels or
    prepared floats (N, 1, 32, 32), their labels (None: unlabelled), and which set they are
    (:data:`TEST_SPLIT`, :data:`TRAINING_IMAGES`, :data:`IMAGE_FOLDER`)."""

    images: np.ndarray
    labels: np.ndarray | None
    source: str


def _as_numpy(x: Any) -> np.ndarray:
    """A torch tensor (without importing torch) or an array as a numpy array."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def local_images(service: RoleService) -> LocalImages | None:
    """What ``service`` (a device) classifies a deployed classifier on: its own test split
    (a training device's ``test_data`` / ``test_labels``), else the first
    :data:`CLASSIFY_FALLBACK_IMAGES` of its training images (``data`` / ``labels``), else the
    image folder ``data.local_dir`` (or its ``<device id>`` subfolder) read without torch,
    labelled by its class folders; None when it has none of them. A read that fails raises
    (:class:`~shared.errors.DataError`)."""
    test = getattr(service, "test_data", None)
    if test is not None:
        labels = getattr(service, "test_labels", None)
        return LocalImages(
            _as_numpy(test), None if labels is None else _as_numpy(labels), TEST_SPLIT
        )
    data = getattr(service, "data", None)
    if data is not None:
        labels = getattr(service, "labels", None)
        n = CLASSIFY_FALLBACK_IMAGES
        return LocalImages(
            _as_numpy(data[:n]), None if labels is None else _as_numpy(labels[:n]),
            TRAINING_IMAGES,
        )  # fmt: skip
    d = service.cfg.data
    if not d.local_dir:
        return None
    folder = Path(d.local_dir)
    if (folder / service.name).is_dir():
        folder = folder / service.name
    found = read_image_folder(folder, class_names=d.class_names, limit=CLASSIFY_FALLBACK_IMAGES)
    return LocalImages(found.images, found.labels, IMAGE_FOLDER)


@dataclass(frozen=True)
class Admitted:
    """A deployment that passed the checks made before its files are fetched: signature,
    manifest, version and blob references; ``shared``: whether the shared tensors are
    fetched too (the device builds its own model from them)."""

    msg: Deployment
    manifest: dict[str, Any]
    version: DeploymentVersion
    digest: str
    shared: bool

    @property
    def sha256(self) -> str:
        """The signed model's sha256."""
        return str(self.manifest["model"]["sha256"])


@dataclass(frozen=True)
class Fetched:
    """A deployment's files, checked against its manifest."""

    model: bytes
    shared: bytes | None


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
        #: the deployment being fetched, and those waiting for their turn
        self.job: FetchJob | None = None
        self.waiting: deque[Admitted] = deque()
        #: per run name, (version serial, manifest digest) of the run's deployment served
        #: last: read back from the verified copies under ``out_dir/models``
        self.last_served: dict[str, tuple[int, str]] = self._read_last_served()

    def start(self) -> None:
        """Subscribe to the retained deployment and to sample requests."""
        t = self.service.topics
        self.service.on(t.cloud_deploy, Deployment, self.on_deployment, "msg_deployment")
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
            self._refuse(sha, err.reason, err.detail)
            return
        under_way = [self.job.item] if self.job is not None else []
        if any(i.digest == item.digest for i in [*under_way, *self.waiting]):
            return  # the same deployment again (a retained copy) while it is on its way
        if self.job is None:
            self._start(item)
            return
        if len(self.waiting) >= MAX_WAITING:
            dropped = self.waiting.popleft()
            self._refuse(dropped.msg.model_ref.sha256, "deployment_queue_full",
                         f"{MAX_WAITING} deployments waited for the one being fetched")  # fmt: skip
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
        limit; its ``src`` is not signed, so the file is fetched from the cloud whatever it
        says (a different one is counted as ``deploy_source_ignored``)."""
        want = manifest[entry]
        if ref is None or (ref.sha256, ref.size) != (want["sha256"], want["size"]):
            raise SignatureError("bad_manifest", f"the {entry} blob reference is not the "
                                 "signed file")  # fmt: skip
        if want["size"] > self.service.cfg.broker.max_blob_bytes:
            raise SignatureError("too_large", f"{entry} of {want['size']} bytes")
        if ref.src not in (None, DEPLOY_SOURCE):
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
        model = self._fetch(item.manifest, "model", MODEL_BLOB_KIND)
        shared = self._fetch(item.manifest, "shared", SHARED_BLOB_KIND) if item.shared else None
        return Fetched(model, shared)

    def _fetch(self, manifest: dict[str, Any], entry: str, kind: str) -> bytes:
        """The manifest's ``entry`` file from the cloud, within ``deploy.fetch_timeout_s``,
        checked against the manifest."""
        want = manifest[entry]
        data = self.service.ep.get_blob(
            want["sha256"], want["size"], kind=kind, src=DEPLOY_SOURCE,
            timeout_s=self.cfg.fetch_timeout_s,
        )  # fmt: skip
        check_model_bytes(data, manifest, entry)  # the blob layer checked; the file is what runs
        return data

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
                self._refuse_error(item.msg.model_ref.sha256, error or EstuaryError("no result"))
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
                self._refuse(item.msg.model_ref.sha256, err.reason, err.detail)
                continue
            self._start(item)

    def _refuse_error(self, sha: str, err: BaseException) -> None:
        """Refuse deployment ``sha`` for what fetching or loading it raised."""
        if isinstance(err, SignatureError):
            self._refuse(sha, err.reason, err.detail)
        elif isinstance(err, (CodecError, TransportError)):
            self._refuse(sha, err.reason, str(err))
        elif isinstance(err, PersonalizeError):
            self._refuse(sha, "personalize_failed", str(err))
        elif isinstance(err, EstuaryError):
            self._refuse(sha, "bad_model", str(err))
        else:  # whatever a signed but broken model raises: refuse, report
            log.error("%s: deployment %s failed to load", self.service.name, sha[:12],
                      exc_info=err)  # fmt: skip
            self._refuse(sha, "bad_model", f"{type(err).__name__}: {err}")

    def _install(self, item: Admitted, fetched: Fetched) -> Served:
        """Load the model into ONNX Runtime, build the device's own model when the shared
        tensors came, and keep a verified copy of the deployment under
        ``out_dir/models/<sha16>``; the model to serve. A classifier deployment goes to
        :meth:`_install_classifier`."""
        if task_of(item.manifest) == CLASSIFY_TASK:
            return self._install_classifier(item, fetched)
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

    def _install_classifier(self, item: Admitted, fetched: Fetched) -> Served:
        """A ``"classify"`` deployment: its card must be a classifier's naming the signed
        file's sha256 (else ``bad_manifest``) and ONNX Runtime must load the bytes (else
        ``bad_model``); a verified copy (the model, ``card.json``, the signed manifest) is
        kept under ``out_dir/models/<sha16>``, which ``estuary classify`` reads. No torch."""
        msg, manifest, want = item.msg, item.manifest, item.manifest["model"]
        card = manifest["card"]
        if card.get("sha256") != want["sha256"]:
            named = str(card.get("sha256"))[:16]
            raise SignatureError("bad_manifest", f"the classifier's card names another model "
                                 f"({named}) than the signed file")  # fmt: skip
        if fetched.shared is not None:
            raise SignatureError("bad_manifest", "a classifier deployment carries no shared "
                                 "tensors")  # fmt: skip
        classifier = OnnxClassifier.from_bytes(
            fetched.model, card, provider=self.cfg.provider, threads=self.cfg.threads
        )
        path = self.out_dir / "models" / want["sha256"][:16]
        path.mkdir(parents=True, exist_ok=True)
        atomic_write(path / want["file"], fetched.model)
        atomic_write(path / CARD_FILE, (json.dumps(card, indent=2) + "\n").encode())
        for name in (OWN_MODEL_FILE, OWN_RECORD_FILE, CLASSIFIED_FILE):
            (path / name).unlink(missing_ok=True)
        write_signed(path, msg.manifest, msg.signature, msg.key_id)  # last, as for generators
        return Served(
            want["sha256"], None, manifest, path, version=item.version, classifier=classifier
        )

    def _in_service(self, item: Admitted, served: Served) -> None:
        """Put ``served`` in service: remember its version, update the metrics, report it
        and sample a grid from it (a classifier: classify the device's own images)."""
        self.last_served[item.version.run] = (item.version.serial, item.digest)
        old = self.served
        self.served = served
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

    # -- classifying ----------------------------------------------------------------------
    def _classify(self) -> None:
        """Classify the device's own images (:func:`local_images`) with the classifier in
        service and report ``classified`` (accuracy when they are labelled), or ``refused``
        with the reason when that fails; the device goes on either way."""
        served = self.served
        if served is None or served.classifier is None:
            return
        sha = served.sha256
        try:
            local = local_images(self.service)
            if local is None:
                log.warning("%s: no images of its own to classify with %s", self.service.name,
                            sha[:12])  # fmt: skip
                self._report("classified", sha, request_id=NO_IMAGES,
                             reason="no images: no test split, training images or "
                             "data.local_dir")  # fmt: skip
                return
            result = served.classifier.classify(local.images, local.labels)
        except Exception as err:  # EstuaryError, or anything else: the cloud hears why
            detail = str(err) if isinstance(err, EstuaryError) else f"{type(err).__name__}: {err}"
            log.error("%s: classifying with %s failed: %s", self.service.name, sha[:12], detail)
            self._report("refused", sha, reason=f"classifying failed: {detail}"[:500],
                         request_id=f"classify-{sha[:12]}")  # fmt: skip
            return
        acc = result.accuracy
        accuracy = None if math.isnan(acc) else acc
        figures = {"deployment": sha, "set": local.source, **result.to_dict()}
        figures.pop("predictions")
        try:
            text = json.dumps(figures, indent=2) + "\n"
            atomic_write(served.path / CLASSIFIED_FILE, text.encode())
        except OSError as err:  # the figures are reported all the same
            log.warning("%s: cannot write %s: %s", self.service.name, CLASSIFIED_FILE, err)
        log.info("%s: classified %d images (%s) with %s: accuracy %s, %.0f images/s",
                 self.service.name, len(result.predictions), local.source, sha[:12],
                 "-" if accuracy is None else f"{accuracy:.4f}", result.images_per_s)  # fmt: skip
        self._report("classified", sha, request_id=local.source, classified=result,
                     accuracy=accuracy)  # fmt: skip

    def _report(
        self, event: str, sha: str | None, *, reason: str = "", request_id: str = "",
        stats: SampleStats | None = None, grid: str = "",
        classified: ClassifyResult | None = None, accuracy: float | None = None,
    ) -> None:  # fmt: skip
        served = self.served
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
