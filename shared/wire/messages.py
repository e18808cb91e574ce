"""Versioned wire messages (DESIGN section 2) and the topic layout.

Every message is a small JSON document with ``v`` (schema version) and ``kind``; tensors never
travel inside it, only :class:`BlobRef` s to content-addressed safetensors blobs. ``decode``
turns bytes into the right model or raises :class:`~shared.errors.MessageError` whose
``reason`` is a short label for the rejected-messages metric.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from shared.errors import MessageError

VERSION: Literal[1] = 1
MAX_MESSAGE_BYTES = 256 * 1024
ROOT = "estuary/v1"

Id = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
Round = Annotated[int, Field(ge=0, le=10_000_000)]
MAX_COUNT = 10**12  # largest sample or label count a message may carry
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
LabelCounts = Annotated[list[Count], Field(max_length=1000)]
#: a model part's name in :attr:`EdgeUpdate.part_samples` (FedDiffuse: encoder, bottleneck, ...)
PartName = Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[a-z_]+$")]
Session = Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
#: a share in [0, 1] (an accuracy)
Fraction = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
#: a pruned architecture's JSON channel plan (shared.models.pruning); validated again by its user
Plan = Annotated[dict[str, Any], Field(max_length=100_000)]
#: where a blob is served: a role's subtree, ``estuary deploy``'s (:data:`DEPLOYER_HOME`), a
#: device's private downlink (:func:`private_home`) or an edge's path to the cloud alone
#: (:func:`cloud_only_home`)
Home = Annotated[
    str,
    Field(
        max_length=80,
        pattern=r"^(cloud(/deployer)?|edge/[A-Za-z0-9_-]{1,64}(/cloud)?"
        r"|device/[A-Za-z0-9_-]{1,64}(/down)?)$",
    ),
]

#: the recipient of a blob served to the cloud alone (:func:`cloud_only_home`)
CLOUD_RECIPIENT = "cloud"


def home_of(role: str, name: str) -> str:
    """Topic subtree a role instance may write under: ``cloud``, ``edge/{e}``, ``device/{d}``."""
    return "cloud" if role == "cloud" else f"{role}/{name}"


#: blob kinds of a deployment's files on the wire (the traffic metrics' labels)
MODEL_BLOB_KIND = "onnx_model"
SHARED_BLOB_KIND = "shared_weights"
#: the subtree ``estuary deploy`` serves a deployment's files from: its own, inside the
#: cloud's (which only the cloud's and the deployer's accounts write), so that a running
#: cloud, which does not hold those files, never answers for them
DEPLOYER_HOME = "cloud/deployer"
#: where a device fetches a deployment's files from: the cloud, or ``estuary deploy``
DEPLOY_SOURCES = ("cloud", DEPLOYER_HOME)


def private_home(device: str) -> str:
    """A device's private downlink, ``device/{d}/down``: under the ACL of ``estuary provision``
    only that device and the cloud read it. The cloud serves the blobs meant for that device
    alone there (a :class:`BlobRef` with this ``src``), never under its shared ``cloud``."""
    return f"device/{device}/down"


def cloud_only_home(home: str) -> str:
    """Where role ``home`` (an edge) serves blobs meant for the cloud alone, ``{home}/cloud``:
    the devices' uploads an edge forwards. Under the ACL of ``estuary provision`` no device
    reads it (a device reads its edge's ``blob/#`` only), and only the cloud may ask there
    (:meth:`Topics.cloud_only_want`)."""
    return f"{home}/cloud"


class Topics:
    """Topic names for one run; the only place topic strings are spelled."""

    def __init__(self, run: str) -> None:
        self.base = f"{ROOT}/{run}"

    @property
    def cloud_state(self) -> str:
        """Retained cloud state (round, phase, model ref)."""
        return f"{self.base}/cloud/state"

    @property
    def cloud_round(self) -> str:
        """Cloud -> everyone: round start with device assignment."""
        return f"{self.base}/cloud/round"

    def edge_state(self, edge: str) -> str:
        """Retained edge state (accumulated label counts, load)."""
        return f"{self.base}/edge/{edge}/state"

    def edge_round(self, edge: str) -> str:
        """Edge -> its devices: round start with the model to train."""
        return f"{self.base}/edge/{edge}/round"

    def edge_up(self, edge: str) -> str:
        """Edge -> cloud: edge result for a round."""
        return f"{self.base}/edge/{edge}/up"

    def device_hello(self, device: str) -> str:
        """Retained device registration."""
        return f"{self.base}/device/{device}/hello"

    def device_up(self, device: str) -> str:
        """Device -> edge: update for a round."""
        return f"{self.base}/device/{device}/up"

    def device_down(self, device: str) -> str:
        """Cloud -> one device: its personal model (pFedGPA); only that device reads it."""
        return f"{self.base}/device/{device}/down"

    def device_join(self, device: str) -> str:
        """Device -> edges: the edge this device picked for a round."""
        return f"{self.base}/device/{device}/join"

    @property
    def cloud_deploy(self) -> str:
        """Retained signed deployment manifest of the generator the devices should serve."""
        return f"{self.base}/cloud/deploy"

    @property
    def cloud_sample(self) -> str:
        """Cloud -> devices: a request to sample from the deployed model."""
        return f"{self.base}/cloud/sample"

    def device_deploy(self, device: str) -> str:
        """Retained: the deployment a device serves or refused, and its sampling speed."""
        return f"{self.base}/device/{device}/deploy"

    @property
    def all_device_deploy(self) -> str:
        """Subscription pattern for every device's deployment reports."""
        return f"{self.base}/device/+/deploy"

    def status(self, home: str) -> str:
        """Retained presence of one role instance (LWT publishes ``online: false``)."""
        return f"{self.base}/{home}/status"

    @property
    def all_device_status(self) -> str:
        """Subscription pattern for every device's presence."""
        return f"{self.base}/device/+/status"

    @property
    def all_edge_status(self) -> str:
        """Subscription pattern for every edge's presence."""
        return f"{self.base}/edge/+/status"

    @property
    def all_edge_state(self) -> str:
        """Subscription pattern for every edge's retained state."""
        return f"{self.base}/edge/+/state"

    def blob_chunk(self, src: str, sha256: str, chunk_bytes: int, index: int | str) -> str:
        """Chunk ``index`` of a blob served by ``src`` (``index`` may be ``+`` or ``missing``)."""
        return f"{self.base}/{src}/blob/{sha256}/{chunk_bytes}/{index}"

    def blob_chunks(self, src: str) -> str:
        """Pattern of every chunk of every blob ``src`` serves (:meth:`blob_chunk`; ``src``
        may hold a ``+``): what an ACL grants the role that serves there."""
        return f"{self.base}/{src}/blob/+/+/+"

    def blob_want(self, requester: str, src: str) -> str:
        """A request from ``requester`` for chunks of a blob served by ``src``."""
        return f"{self.base}/{requester}/want/{src}"

    def private_want(self, device: str) -> str:
        """The only topic on which ``device`` may ask for a blob of its private downlink: its
        own subtree asking :func:`private_home` of itself."""
        return self.blob_want(home_of("device", device), private_home(device))

    def cloud_only_want(self, home: str) -> str:
        """The only topic on which blobs served by ``home`` to the cloud alone are asked
        for: the cloud's subtree asking :func:`cloud_only_home` of ``home``."""
        return self.blob_want("cloud", cloud_only_home(home))

    @property
    def all_private_want(self) -> str:
        """Subscription pattern for requests on every device's private downlink (the cloud
        checks that requester and downlink are the same device)."""
        return f"{self.base}/device/+/want/device/+/down"

    @property
    def blob_chunk_sweep(self) -> list[str]:
        """Filters that match every blob-chunk topic of the run (:meth:`blob_chunk` under
        each subtree: ``cloud``, ``cloud/deployer``, ``edge/<e>``, ``device/<d>``, an edge's
        path to the cloud alone ``edge/<e>/cloud`` and a device's private downlink
        ``device/<d>/down``); the cloud's sweep of retained chunks looks there."""
        return [f"{self.base}/+/blob/#", f"{self.base}/+/+/blob/#", f"{self.base}/+/+/+/blob/#"]

    def blob_want_patterns(self, src: str) -> list[str]:
        """Subscriptions a blob server ``src`` needs to see every request addressed to it."""
        return [f"{self.base}/cloud/want/{src}", f"{self.base}/+/+/want/{src}"]

    def origin(self, msg: BaseModel) -> str | None:
        """The only topic ``msg`` may arrive on: its sender's own subtree, which the broker
        ACL ties to the sender's credentials (None for kinds without a fixed origin)."""
        if isinstance(msg, DeviceHello):
            return self.device_hello(msg.device)
        if isinstance(msg, DeviceUpdate):
            return self.device_up(msg.device)
        if isinstance(msg, DeviceJoin):
            return self.device_join(msg.device)
        if isinstance(msg, PersonalModel):
            return self.device_down(msg.device)
        if isinstance(msg, EdgeRound):
            return self.edge_round(msg.edge)
        if isinstance(msg, EdgeUpdate):
            return self.edge_up(msg.edge)
        if isinstance(msg, EdgeState):
            return self.edge_state(msg.edge)
        if isinstance(msg, Presence):
            return self.status(home_of(msg.role, msg.name))
        if isinstance(msg, RoundStart):
            return self.cloud_round
        if isinstance(msg, CloudState):
            return self.cloud_state
        if isinstance(msg, Deployment):
            return self.cloud_deploy
        if isinstance(msg, SampleRequest):
            return self.cloud_sample
        if isinstance(msg, DeploymentReport):
            return self.device_deploy(msg.device)
        return None

    @property
    def all_edge_up(self) -> str:
        """Subscription pattern for every edge's results."""
        return f"{self.base}/edge/+/up"

    @property
    def all_device_up(self) -> str:
        """Subscription pattern for every device's updates."""
        return f"{self.base}/device/+/up"

    @property
    def all_device_join(self) -> str:
        """Subscription pattern for every device's edge choice."""
        return f"{self.base}/device/+/join"

    @property
    def all_device_hello(self) -> str:
        """Subscription pattern for every device's registration."""
        return f"{self.base}/device/+/hello"


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    v: Literal[1] = VERSION


class BlobRef(BaseModel):
    """Pointer to a content-addressed blob: sha256, size in bytes, and who serves it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0, le=2**40)
    kind: str = Field(min_length=1, max_length=32, pattern=r"^[a-z_]+$")
    src: Home | None = None


class BlobWant(BaseModel):
    """A request for chunks of a blob (``chunks``: [first, last] index ranges, inclusive)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    v: Literal[1] = VERSION
    kind: Literal["blob_want"] = "blob_want"
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0, le=2**40)
    chunk_bytes: int = Field(ge=4096, le=64 << 20)
    chunks: list[tuple[int, int]] = Field(min_length=1, max_length=4096)


class Presence(BaseModel):
    """Retained online/offline flag; the broker publishes ``online: false`` as the LWT."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    v: Literal[1] = VERSION
    kind: Literal["presence"] = "presence"
    name: Id
    role: Literal["cloud", "edge", "device", "observer"]
    online: bool


class DeviceHello(_Msg):
    """A device registers: its data size, label histogram and home edge."""

    kind: Literal["hello"] = "hello"
    device: Id
    home_edge: Id
    n_samples: Count
    label_counts: LabelCounts


class RoundStart(_Msg):
    """Cloud opens a round: who trains where, and the new global model when there is one."""

    kind: Literal["round_start"] = "round_start"
    round: Round
    session: Session
    assignment: dict[Id, list[Id]] = Field(max_length=10_000)
    global_ref: BlobRef
    new_global: bool
    # the global state's shared tensors only (Algorithm.shared_spec), for an edge that holds
    # the rest; it checks the merge against global_ref's sha256
    shared_ref: BlobRef | None = None
    # device-selected edges (federation.assignment "select"/"random"): who trains this
    # round, and each edge's label counts since the last cloud aggregation (eq. 19), from
    # which every participant picks its edge (eq. 25)
    participants: list[Id] = Field(default_factory=list, max_length=100_000)
    edge_counts: dict[Id, LabelCounts] = Field(default_factory=dict, max_length=10_000)
    arch: Plan | None = None  # channel plan of a pruned model; None = the dense preset
    deadline_s: float = Field(gt=0, le=86_400)
    config_digest: str = Field(max_length=64)
    #: the cloud sent participants personal models for this round (PersonalModel)
    personal: bool = False


class EdgeRound(_Msg):
    """Edge tells its assigned devices which model to train this round."""

    kind: Literal["edge_round"] = "edge_round"
    round: Round
    session: Session
    edge: Id
    devices: list[Id] = Field(max_length=100_000)
    model_ref: BlobRef
    # the edge state's shared tensors only (Algorithm.shared_spec), for a device that holds
    # the rest (FedDiffuse's local parts)
    shared_ref: BlobRef | None = None
    upload: bool = True
    deadline_s: float = Field(gt=0, le=86_400)
    select: bool = False  # devices in ``devices`` may join (DeviceJoin) rather than must
    arch: Plan | None = None
    #: devices train the personal model the cloud sent them (PersonalModel), not this one
    personal: bool = False


class PersonalModel(_Msg):
    """Cloud -> one device (``Topics.device_down``): the model that device alone trains in
    ``round`` instead of its edge's (pFedGPA's personalized parameters)."""

    kind: Literal["personal_model"] = "personal_model"
    round: Round
    session: Session
    device: Id
    model_ref: BlobRef
    mode: Literal["inversion", "generation", "guidance"]


class DeviceJoin(_Msg):
    """A participant tells the edges and the later participants which edge it picked for
    the round (eq. 25)."""

    kind: Literal["join"] = "join"
    round: Round
    session: Session
    device: Id
    edge: Id
    label_counts: LabelCounts  # so participants after this one count it in (eq. 25)


class DeviceUpdate(_Msg):
    """A device's result for a round (``update_ref`` is None when nothing is uploaded)."""

    kind: Literal["device_update"] = "device_update"
    round: Round
    session: Session
    device: Id
    edge: Id
    update_ref: BlobRef | None
    n_samples: Count
    label_counts: LabelCounts
    train_loss: float = Field(allow_inf_nan=False)
    steps: Count
    train_seconds: float = Field(ge=0, allow_inf_nan=False)
    #: a classifier's accuracy on the device's own test split, on the model it received
    #: (None: not measured) and after its local round
    acc_before: Fraction | None = None
    acc_after: Fraction | None = None


class DeviceAccuracy(BaseModel):
    """A device's classifier accuracy before and after its local round (its test split)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    before: Fraction | None = None
    after: Fraction


class Forwarded(BaseModel):
    """One device's upload as its edge forwards it, for algorithms that keep every
    device's model (pFedGPA): the edge serves the blob to the cloud alone
    (:func:`cloud_only_home`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    device: Id
    update_ref: BlobRef
    n_samples: Count


class EdgeUpdate(_Msg):
    """An edge's result for a round; ``model_ref`` only on cloud-aggregation rounds."""

    kind: Literal["edge_update"] = "edge_update"
    round: Round
    session: Session
    edge: Id
    model_ref: BlobRef | None
    n_samples: Count
    label_counts: LabelCounts
    devices: list[Id] = Field(max_length=100_000)
    mean_loss: float | None = Field(default=None, allow_inf_nan=False)
    train_seconds: float = Field(ge=0, allow_inf_nan=False)
    rejected: Count = 0
    #: for algorithms whose devices upload parts of the model (FedDiffuse USPLIT): the
    #: samples behind each part of ``model_ref`` since the last cloud aggregation, so the
    #: cloud averages every part over the devices that reported it; None: ``n_samples``
    part_samples: Annotated[dict[PartName, Count], Field(max_length=16)] | None = None
    #: the contributors' classifier accuracies (classifier runs), by device
    accuracy: Annotated[dict[Id, DeviceAccuracy], Field(max_length=10_000)] | None = None
    #: each contributor's own upload (algorithms with per-device updates), sorted by device
    forwarded: Annotated[list[Forwarded], Field(max_length=10_000)] | None = None


class EdgeState(_Msg):
    """Retained edge state: label counts served since the last cloud aggregation, and load."""

    kind: Literal["edge_state"] = "edge_state"
    edge: Id
    round: Round | None  # last closed round; None before the first
    n_samples: Count
    label_counts: LabelCounts
    devices_last_round: Count


class CloudState(_Msg):
    """Retained cloud state so late joiners know where the run is. ``model_ref`` is the
    global model the edges were last sent, and once the run is done (or deploying), the
    final model; its ``sha256`` is the model's digest (``summary.json``'s
    ``final_model_sha256``)."""

    kind: Literal["cloud_state"] = "cloud_state"
    round: Round
    session: Session
    phase: Literal["waiting", "training", "deploying", "done"]
    model_ref: BlobRef | None = None
    config_digest: str = Field(max_length=64)
    #: while training: when the open round opened (Unix time in whole seconds, the cloud's
    #: clock: a fixed-length field, so the message's size does not depend on the moment) and
    #: the seconds after which the cloud closes it with whatever reports it has
    opened_at: int | None = Field(None, ge=0, le=10**11)
    deadline_s: float | None = Field(None, gt=0.0, le=1e8)

    def done_for(self, config_digest: str) -> bool:
        """Whether this says the run of the config with ``config_digest`` is over (a cloud
        running another config under the same run name does not count)."""
        return self.phase == "done" and self.config_digest == config_digest


class Deployment(_Msg):
    """A signed deployment: ``manifest`` is the canonical JSON text the Ed25519
    ``signature`` covers (shared.deploy.signing); the ONNX model travels as the blob ``model_ref``,
    and, when devices keep local model parts (FedDiffuse ULATDEC/UDEC), the global model's
    federated tensors (the manifest's ``shared`` file, safetensors) as ``shared_ref``."""

    kind: Literal["deployment"] = "deployment"
    manifest: str = Field(min_length=2, max_length=64 * 1024)
    signature: str = Field(pattern=r"^[0-9a-f]{128}$")
    key_id: str = Field(pattern=r"^[0-9a-f]{16}$")
    model_ref: BlobRef
    shared_ref: BlobRef | None = None

    @property
    def ident(self) -> str:
        """sha256 (hex) of the signed manifest's text: what names this deployment in the
        devices' reports about it. Every export carries a new version serial in its
        manifest, so a rerun's deployment of the very same model has another one."""
        return hashlib.sha256(self.manifest.encode()).hexdigest()


class SampleRequest(_Msg):
    """Cloud asks devices (all when ``devices`` is empty) to sample from their model."""

    kind: Literal["sample_request"] = "sample_request"
    request_id: Id
    devices: list[Id] = Field(default_factory=list, max_length=100_000)
    n: int = Field(16, ge=1, le=100_000)
    steps: int = Field(50, ge=1, le=1000)
    seed: int = Field(0, ge=0, le=2**63 - 1)


class DeploymentReport(_Msg):
    """A device's deployment event: a model loaded or refused, a grid sampled, or its own
    classifier exported and its test split classified (``accuracy``)."""

    kind: Literal["deploy_report"] = "deploy_report"
    device: Id
    event: Literal["loaded", "refused", "sampled", "classified"]
    model_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    #: the deployment the report is about (:attr:`Deployment.ident`): the refused one, or
    #: the one in service; None when there is none (a device's own classifier, a sample
    #: request with nothing in service). The cloud and ``estuary status`` count a report only
    #: for the deployment currently retained, so those of an earlier run are not read as
    #: this run's.
    deployment: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    #: the cloud session whose rounds the device took part in last (None: none, such as a
    #: device that only serves deployments): what ties a report about no deployment (a
    #: device's own classifier) to its run
    session: Session | None = None
    serving: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")  # model in service
    #: the model in service is the device's own (global federated parts over its local
    #: parts, exported on the device); its ONNX file's sha256
    personal: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    reason: str = Field("", max_length=500)
    request_id: str = Field("", max_length=64)
    n: Count = 0
    steps: Count = 0
    images_per_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    latency_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    provider: str = Field("", max_length=64)
    grid: str = Field("", max_length=500)
    #: a classifier's accuracy on the device's own test split, with ONNX Runtime
    accuracy: Fraction | None = None


Message = (
    DeviceHello
    | RoundStart
    | EdgeRound
    | DeviceUpdate
    | DeviceJoin
    | PersonalModel
    | EdgeUpdate
    | EdgeState
    | CloudState
    | Presence
    | BlobWant
    | Deployment
    | SampleRequest
    | DeploymentReport
)
_ADAPTER: TypeAdapter[Any] = TypeAdapter(Annotated[Message, Field(discriminator="kind")])


def encode(msg: BaseModel) -> bytes:
    """Compact JSON bytes of ``msg``."""
    return msg.model_dump_json().encode()


def decode(payload: bytes, expect: type[BaseModel] | None = None) -> Any:
    """Validate ``payload``; raise MessageError(reason) on anything unexpected."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise MessageError("too_large", f"{len(payload)} bytes > {MAX_MESSAGE_BYTES}")
    try:
        raw = json.loads(payload)
    except (ValueError, RecursionError) as err:
        # ValueError covers JSONDecodeError, UnicodeDecodeError and Python's limit on the
        # digits of an integer; RecursionError a payload of deeply nested arrays
        raise MessageError("bad_json", f"{type(err).__name__}: {str(err)[:200]}") from None
    if not isinstance(raw, dict):
        raise MessageError("bad_json", "top level must be an object")
    if raw.get("v") != VERSION:
        raise MessageError("bad_version", f"v={raw.get('v')!r}, this build speaks v={VERSION}")
    try:
        msg = _ADAPTER.validate_python(raw)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        reason = "missing_field" if first["type"] == "missing" else "bad_field"
        raise MessageError(reason, f"{loc}: {first['msg']}") from None
    if expect is not None and not isinstance(msg, expect):
        raise MessageError("wrong_kind", f"expected {expect.__name__}, got {raw.get('kind')!r}")
    return msg
