"""Bad input over a real mosquitto broker, against the real services on MqttBus.

One edge server (``edge0``) runs its bus loop on a background thread. Per test, a test
"cloud" opens a round assigning a legitimate device (``dev000``) and an attacker (``dev001``);
the attacker sends one malformed message or serves one bad blob. Each test then checks that

* the edge's rejected counter for exactly that reason went up by exactly one (and nothing
  else was rejected or failed in a handler),
* a warning naming the reason was logged,
* the edge still serves: the legitimate device's update is fetched and aggregated, and the
  edge reports the round to the cloud.

Payloads that are pickles are never unpickled (a pickle that records its own detonation, and
``pickle.loads`` / ``torch.load`` replaced by tripwires). The cloud side is covered once.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
import pytest
import torch
from paho.mqtt.enums import CallbackAPIVersion

from cloud import CloudServer
from edge_node import EdgeServer
from shared.config import BrokerSection, RunConfig
from shared.errors import TransportError
from shared.methods.registry import make_algorithm
from shared.models.presets import build_unet
from shared.runtime.service import REJECT_LOG_BURST, LogLimiter
from shared.transport.bus import MemoryBus
from shared.transport.local_broker import LocalBroker, find_mosquitto
from shared.transport.mqtt import MqttBus
from shared.transport.telemetry import diff_counts
from shared.wire.codec import encode_tensors, encoded_size_limit, sha256_hex
from shared.wire.messages import (
    CLOUD_RECIPIENT,
    MAX_MESSAGE_BYTES,
    BlobRef,
    DeviceHello,
    DeviceUpdate,
    EdgeUpdate,
    Presence,
    RoundStart,
    Topics,
    cloud_only_home,
    decode,
    encode,
)
from tests.conftest import shared_broker, tiny_config

pytestmark = pytest.mark.skipif(
    find_mosquitto() is None,
    reason="mosquitto not installed (apt-get install mosquitto): these tests need a real broker",
)

WAIT_S = 10.0
SESSION = "5e55105e55105e55"
EDGE, GOOD, EVIL = "edge0", "dev000", "dev001"
TensorDict = dict[str, torch.Tensor]

DETONATIONS: list[str] = []


def _detonate(what: str) -> None:
    """Runs only if someone unpickles a payload built with :class:`_Boom`."""
    DETONATIONS.append(what)


class _Boom:
    def __reduce__(self) -> tuple[Callable[[str], None], tuple[str]]:
        return _detonate, ("unpickled",)


def wait_for(pred: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll ``pred`` until true; fail the test naming ``what`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(0.01)


def fed_state(cfg: RunConfig) -> TensorDict:
    """The model state of ``cfg``'s preset (seed 0)."""
    return dict(build_unet(cfg.model.preset, seed=0).state_dict())


def perturbed(state: TensorDict, delta: float) -> TensorDict:
    """``state`` with ``delta`` added to its first tensor (same names, shapes, size)."""
    name = next(iter(state))
    return {**state, name: state[name] + delta}


def connect(broker: LocalBroker, run: str, home: str, **limits: Any) -> MqttBus:
    """A connected MqttBus for ``home`` with test-friendly timeouts."""
    settings = BrokerSection(
        port=broker.port, connect_timeout_s=10, chunk_timeout_s=1, fetch_timeout_s=8, **limits
    )
    client_id = f"{run}-{home.replace('/', '-')}"
    return MqttBus(settings, run=run, client_id=client_id, home=home).connect()


@dataclass
class Harness:
    """The edge under attack, the buses around it, and the test's view of the round."""

    cfg: RunConfig
    state: TensorDict
    edge: EdgeServer
    edge_bus: MqttBus
    cloud_bus: MqttBus
    good_bus: MqttBus
    evil_bus: MqttBus
    raw: mqtt.Client
    global_ref: BlobRef
    topics: Topics = field(init=False)
    reports: list[EdgeUpdate] = field(default_factory=list)
    next_round: int = 0

    def __post_init__(self) -> None:
        self.topics = Topics(self.cfg.run.name)

    def rejected(self) -> dict[str, int]:
        """The edge process's rejected counters (``who:reason`` -> count)."""
        return self.edge_bus.traffic.snapshot()["rejected"]

    def open_round(self) -> int:
        """Cloud opens the next round for GOOD and EVIL; returns it once the edge has it."""
        r = self.next_round
        self.next_round += 1
        start = RoundStart(
            round=r,
            session=SESSION,
            assignment={EDGE: [GOOD, EVIL]},
            global_ref=self.global_ref,
            new_global=r == 0,
            deadline_s=self.cfg.federation.round_deadline_s,
            config_digest=self.cfg.digest(),
        )
        self.cloud_bus.endpoint("cloud").publish(
            self.topics.cloud_round, encode(start), kind="round_start"
        )
        wait_for(lambda: self.edge.round == r and not self.edge.closed, f"edge to open round {r}")
        return r

    def serve(self, data: bytes) -> BlobRef:
        """The attacker puts ``data`` in its own blob store and points at it."""
        sha = self.evil_bus.endpoint(EVIL, f"device/{EVIL}").put_blob(data, kind="device_update")
        return BlobRef(sha256=sha, size=len(data), kind="device_update", src=f"device/{EVIL}")

    def update(self, r: int, device: str, ref: BlobRef | None, loss: float = 9.0) -> DeviceUpdate:
        """A well-formed update of ``device`` for round ``r``."""
        return DeviceUpdate(
            round=r,
            session=SESSION,
            device=device,
            edge=EDGE,
            update_ref=ref,
            n_samples=10,
            label_counts=[1] * 10,
            train_loss=loss,
            steps=2,
            train_seconds=0.1,
        )

    def evil_send(self, msg: DeviceUpdate) -> None:
        """The attacker sends a well-formed message through its own MqttBus."""
        ep = self.evil_bus.endpoint(EVIL, f"device/{EVIL}")
        ep.publish(self.topics.device_up(EVIL), encode(msg), kind="msg_device_update")

    def evil_raw(self, payload: bytes) -> None:
        """The attacker publishes raw bytes on its update topic with a bare paho client."""
        info = self.raw.publish(self.topics.device_up(EVIL), payload, qos=1)
        info.wait_for_publish(WAIT_S)
        assert info.is_published()

    def finish_round(self, r: int) -> tuple[EdgeUpdate, str]:
        """GOOD uploads a fresh update and EVIL leaves; returns the edge's report and the
        sha256 of GOOD's update."""
        data = encode_tensors(perturbed(self.state, 1e-3 * (r + 1)))
        ep = self.good_bus.endpoint(GOOD, f"device/{GOOD}")
        sha = ep.put_blob(data, kind="device_update")
        ref = BlobRef(sha256=sha, size=len(data), kind="device_update", src=f"device/{GOOD}")
        ep.publish(
            self.topics.device_up(GOOD), encode(self.update(r, GOOD, ref, loss=0.25)), kind="up"
        )
        bye = Presence(name=EVIL, role="device", online=False)
        self.evil_bus.endpoint(EVIL, f"device/{EVIL}").publish(
            self.topics.status(f"device/{EVIL}"), encode(bye), kind="msg_presence"
        )
        closed = self.cloud_bus.run(
            lambda: any(u.round == r for u in self.reports), timeout_s=WAIT_S
        )
        assert closed, f"edge did not report round {r} to the cloud within {WAIT_S:g}s"
        return next(u for u in self.reports if u.round == r), sha


#: the session's open mosquitto (this module's runs have names of their own)
broker = pytest.fixture(scope="module")(shared_broker)


@pytest.fixture(scope="module")
def fed(broker: LocalBroker) -> Iterator[Harness]:
    """edge0 running on its own bus thread, plus test cloud, good device and attacker."""
    cfg = tiny_config(
        run={"name": "badinput"},
        federation={"num_devices": 2, "num_edges": 1, "round_deadline_s": 30},
    )
    state = dict(build_unet(cfg.model.preset, seed=0).state_dict())
    data = encode_tensors(state)
    run = cfg.run.name
    # The edge accepts blobs up to one model plus a little: room for every legitimate blob.
    edge_bus = connect(broker, run, f"edge/{EDGE}", max_blob_bytes=len(data) + 4096)
    buses = [edge_bus]
    stop = threading.Event()
    loop: threading.Thread | None = None
    raw = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"{run}-raw")
    try:
        cloud_bus = connect(broker, run, "cloud")
        good_bus = connect(broker, run, f"device/{GOOD}")
        evil_bus = connect(broker, run, f"device/{EVIL}")
        buses += [cloud_bus, good_bus, evil_bus]
        sha = cloud_bus.endpoint("cloud").put_blob(data, kind="global_model")
        global_ref = BlobRef(sha256=sha, size=len(data), kind="global_model", src="cloud")
        raw.connect(broker.host, broker.port)
        raw.loop_start()
        edge = EdgeServer(cfg, edge_bus, make_algorithm(cfg), edge_id=EDGE)
        edge.start()
        harness = Harness(
            cfg, state, edge, edge_bus, cloud_bus, good_bus, evil_bus, raw, global_ref
        )
        cloud_bus.endpoint("cloud").subscribe(
            harness.topics.edge_up(EDGE),
            lambda _t, p: harness.reports.append(decode(p, EdgeUpdate)),
            kind="msg_edge_update",
        )
        loop = threading.Thread(
            target=edge_bus.run, args=(lambda: False,), kwargs={"stop": stop}, daemon=True
        )
        loop.start()
        yield harness
    finally:
        stop.set()
        if loop is not None:
            loop.join(WAIT_S)
        raw.disconnect()
        raw.loop_stop()
        for bus in buses:
            bus.close(timeout_s=2.0)


def check_rejected(
    fed: Harness,
    caplog: pytest.LogCaptureFixture,
    reason: str,
    attack: Callable[[int], None],
    *,
    after_reject: Callable[[], None] | None = None,
    role: str = "edge",
    logged_as: str | None = None,
) -> EdgeUpdate:
    """Open a round, run ``attack``, and check the rejection (counted under ``role``, logged
    with ``logged_as`` in the line, by default the edge's "rejected input (reason)") and
    that the round completes (``after_reject`` runs once the rejection is counted, before
    the good update)."""
    caplog.set_level(logging.WARNING)
    fed.edge.reject_log = LogLimiter()  # each test sees its own lines (the edge lives on)
    r = fed.open_round()
    before = fed.rejected()
    caplog.clear()
    attack(r)
    key = f"{role}:{reason}"
    wait_for(lambda: fed.rejected().get(key, 0) > before.get(key, 0), f"rejection {key}")
    if after_reject is not None:
        after_reject()
    report, good_sha = fed.finish_round(r)
    assert diff_counts(fed.rejected(), before) == {key: 1}
    logged = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING]
    text = logged_as or f"{EDGE} rejected input ({reason})"
    assert any(text in m for m in logged), logged
    # the edge kept serving: the good update alone was aggregated and reported
    assert report.devices == [GOOD]
    assert report.mean_loss == 0.25
    assert report.model_ref is not None and report.model_ref.sha256 == good_sha
    return report


# -- malformed messages ----------------------------------------------------------------------


def _update_dict(r: int) -> dict[str, Any]:
    ref = {"sha256": "ab" * 32, "size": 10, "kind": "device_update", "src": f"device/{EVIL}"}
    return {
        "v": 1,
        "kind": "device_update",
        "round": r,
        "session": SESSION,
        "device": EVIL,
        "edge": EDGE,
        "update_ref": ref,
        "n_samples": 10,
        "label_counts": [1] * 10,
        "train_loss": 0.5,
        "steps": 2,
        "train_seconds": 0.1,
    }


def _with(**changes: Any) -> Callable[[int], bytes]:
    """A DeviceUpdate document with ``changes`` (a value of ``...`` drops the key)."""

    def build(r: int) -> bytes:
        doc = _update_dict(r)
        for k, v in changes.items():
            if v is ...:
                del doc[k]
            else:
                doc[k] = v
        return json.dumps(doc).encode()

    return build


MESSAGE_CASES: list[tuple[str, Callable[[int], bytes]]] = [
    ("bad_json", lambda r: b'{"v": 1, "kind": "device_update", "round": '),
    ("bad_json", lambda r: b"\xff\xfe not utf-8 \x00"),
    ("bad_json", lambda r: b"[1, 2, 3]"),
    ("bad_json", lambda r: pickle.dumps({"update": _update_dict(r), "boom": _Boom()})),
    ("bad_version", _with(v=2)),
    ("bad_version", _with(v=...)),
    ("missing_field", _with(session=...)),
    ("missing_field", _with(update_ref=...)),
    ("bad_field", _with(n_samples="lots")),
    ("bad_field", _with(round=-1)),
    ("bad_field", _with(train_loss=float("nan"))),  # json.dumps writes a bare NaN
    ("bad_field", _with(exec="import os")),  # unknown keys are refused
    ("bad_field", _with(update_ref={"sha256": "../../etc/passwd", "size": 1, "kind": "x"})),
    (
        "wrong_kind",
        lambda r: encode(DeviceHello(device=EVIL, home_edge=EDGE, n_samples=0, label_counts=[])),
    ),
]


@pytest.mark.parametrize(
    ("reason", "build"),
    MESSAGE_CASES,
    ids=[f"{reason}-{i}" for i, (reason, _) in enumerate(MESSAGE_CASES)],
)
def test_malformed_update_message_is_rejected(
    fed: Harness,
    caplog: pytest.LogCaptureFixture,
    reason: str,
    build: Callable[[int], bytes],
) -> None:
    """A malformed DeviceUpdate on the wire: rejected by reason, counted once, logged."""
    DETONATIONS.clear()
    check_rejected(fed, caplog, reason, lambda r: fed.evil_raw(build(r)))
    assert DETONATIONS == []


def test_oversized_message_is_rejected(fed: Harness, caplog: pytest.LogCaptureFixture) -> None:
    """A message above MAX_MESSAGE_BYTES is dropped in the network thread, before it is
    queued for the role (counted under the bus)."""
    padding = "x" * (MAX_MESSAGE_BYTES + 1)
    check_rejected(
        fed,
        caplog,
        "too_large",
        lambda r: fed.evil_raw(_with(pad=padding)(r)),
        role="bus",
        logged_as="dropped a message of",
    )


def test_a_flood_of_bad_messages_is_counted_whole_and_logged_in_a_few_lines(
    fed: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """2,000 malformed messages from one device: every one counted, a handful of log lines
    (the last one saying that further ones are counted only), and the round completes."""
    caplog.set_level(logging.WARNING)
    fed.edge.reject_log = LogLimiter()
    r = fed.open_round()
    before = fed.rejected()
    caplog.clear()
    flood = 2000
    infos = [fed.raw.publish(fed.topics.device_up(EVIL), b"{not json", qos=1) for _ in range(flood)]
    for info in infos:
        info.wait_for_publish(WAIT_S)
    wait_for(lambda: fed.rejected().get("edge:bad_json", 0) - before.get("edge:bad_json", 0)
             >= flood, "every flooded message counted", timeout_s=60)  # fmt: skip
    report, _ = fed.finish_round(r)
    assert diff_counts(fed.rejected(), before) == {"edge:bad_json": flood}
    lines = [
        rec.getMessage()
        for rec in caplog.records
        if "rejected input (bad_json)" in rec.getMessage()
    ]
    assert len(lines) == REJECT_LOG_BURST, len(lines)
    assert "are counted, not logged" in lines[-1]
    assert report.devices == [GOOD]


# -- well-formed updates that fail the edge's own checks ----------------------------------------


@pytest.mark.parametrize(
    ("reason", "changes"),
    [
        pytest.param("bad_label_counts", {"label_counts": [1] * 9 + [2]}, id="label_sum"),
        pytest.param("bad_label_counts", {"label_counts": [1] * 5, "n_samples": 5}, id="classes"),
        pytest.param("stale_session", {"session": "0" * 16}, id="stale_session"),
        pytest.param("unexpected_round", {"round": 10**6}, id="future_round"),
        pytest.param("missing_update", {}, id="missing_update"),
    ],
)
def test_update_failing_edge_checks_is_rejected(
    fed: Harness, caplog: pytest.LogCaptureFixture, reason: str, changes: dict[str, Any]
) -> None:
    """Valid JSON the edge must still refuse: counted once, logged, reported to the cloud."""

    def attack(r: int) -> None:
        fed.evil_send(fed.update(r, EVIL, None).model_copy(update=changes))

    report = check_rejected(fed, caplog, reason, attack)
    assert report.rejected == 1


def test_update_claiming_another_device_is_not_accepted(fed: Harness) -> None:
    """dev001 publishes, on its own topic, an update that names dev000 as its sender."""
    r = fed.open_round()
    before = fed.rejected()
    forged = fed.serve(encode_tensors(perturbed(fed.state, 5.0)))
    fed.evil_send(fed.update(r, GOOD, forged))
    wait_for(
        lambda: GOOD in fed.edge.reported or fed.rejected() != before,
        "the edge to handle the forged update",
    )
    assert GOOD not in fed.edge.reported, "dev001's update was accepted as dev000's"
    report, good_sha = fed.finish_round(r)
    assert diff_counts(fed.rejected(), before) == {"edge:wrong_sender": 1}
    assert report.model_ref is not None and report.model_ref.sha256 == good_sha


# -- bad blobs behind well-formed updates ----------------------------------------------------


def _first_matrix(state: TensorDict) -> str:
    return next(k for k, v in state.items() if v.dim() > 1)


def _renamed(s: TensorDict) -> TensorDict:
    k = _first_matrix(s)
    out = {n: v for n, v in s.items() if n != k}
    return {**out, f"{k}_evil": s[k]}


def _extra(s: TensorDict) -> TensorDict:
    return {**s, "backdoor": torch.zeros(3)}


def _reshaped(s: TensorDict) -> TensorDict:
    k = _first_matrix(s)
    return {**s, k: s[k].reshape(-1)}


def _half(s: TensorDict) -> TensorDict:
    k = _first_matrix(s)
    return {**s, k: s[k].half()}


def _poke(value: float) -> Callable[[TensorDict], TensorDict]:
    """One element of one weight set to ``value`` (NaN, Inf)."""

    def poke(s: TensorDict) -> TensorDict:
        k = _first_matrix(s)
        t = s[k].clone()
        t.view(-1)[3] = value
        return {**s, k: t}

    return poke


TENSOR_CASES: dict[str, Callable[[TensorDict], TensorDict]] = {
    "renamed": _renamed,
    "extra": _extra,
    "shape": _reshaped,
    "dtype": _half,
    "nan": _poke(float("nan")),
    "inf": _poke(float("inf")),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_update_with_bad_tensors_is_rejected(
    fed: Harness, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    """Wrong names, shapes, dtypes or non-finite values in an uploaded blob: bad_tensors.
    The blob, downloaded and refused, is kept in none of the edge's caches."""
    data = encode_tensors(TENSOR_CASES[case](fed.state))
    report = check_rejected(
        fed,
        caplog,
        "bad_tensors",
        lambda r: fed.evil_send(fed.update(r, EVIL, fed.serve(data))),
    )
    assert report.rejected == 1
    assert not fed.edge_bus.store.has(sha256_hex(data))


def _pickled() -> bytes:
    return pickle.dumps({"w": torch.zeros(3), "boom": _Boom()})


def _torch_saved() -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(3), "boom": _Boom()}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("make", [_pickled, _torch_saved], ids=["pickle", "torch_save"])
def test_pickle_blob_is_rejected_and_never_unpickled(
    fed: Harness,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    make: Callable[[], bytes],
) -> None:
    """A pickle served under its own correct hash is refused as bad_tensors, unread."""
    data = make()
    calls: list[str] = []

    def tripwire(name: str) -> Callable[..., Any]:
        def refuse(*_a: Any, **_k: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} called on network input")

        return refuse

    monkeypatch.setattr(pickle, "loads", tripwire("pickle.loads"))
    monkeypatch.setattr(pickle, "load", tripwire("pickle.load"))
    monkeypatch.setattr(torch, "load", tripwire("torch.load"))
    DETONATIONS.clear()
    served = fed.evil_bus.traffic.transport().get("blob_requests_served", 0)
    report = check_rejected(
        fed,
        caplog,
        "bad_tensors",
        lambda r: fed.evil_send(fed.update(r, EVIL, fed.serve(data))),
    )
    assert report.rejected == 1
    assert calls == [] and DETONATIONS == []
    # it was fetched (the edge asked for it) and refused by the decoder, not the transport
    assert fed.evil_bus.traffic.transport().get("blob_requests_served", 0) > served


def test_blob_whose_bytes_do_not_match_its_hash_is_rejected(
    fed: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """The attacker advertises A's sha256 but serves B (valid safetensors, same length)."""
    a = encode_tensors(perturbed(fed.state, 7.0))
    b = encode_tensors(perturbed(fed.state, 8.0))
    assert len(a) == len(b) and a != b

    def attack(r: int) -> None:
        ref = fed.serve(a)
        fed.evil_bus.store._mem[ref.sha256] = b  # serves B under A's hash
        fed.evil_send(fed.update(r, EVIL, ref))

    report = check_rejected(fed, caplog, "blob_hash_mismatch", attack)
    assert report.rejected == 1
    assert not fed.edge_bus.store.has(sha256_hex(a))
    assert not fed.edge_bus.store.has(sha256_hex(b))


def test_oversized_blob_is_rejected_before_download(
    fed: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A BlobRef larger than the edge's max_blob_bytes is refused without asking for it."""
    data = encode_tensors({**fed.state, "padding": torch.zeros(16 * 1024)})
    assert len(data) > fed.edge_bus.max_blob_bytes
    served = fed.evil_bus.traffic.transport().get("blob_requests_served", 0)
    report = check_rejected(
        fed,
        caplog,
        "blob_too_large",
        lambda r: fed.evil_send(fed.update(r, EVIL, fed.serve(data))),
    )
    assert report.rejected == 1
    assert fed.evil_bus.traffic.transport().get("blob_requests_served", 0) == served


def test_blob_of_another_size_than_advertised_is_rejected(
    fed: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A BlobRef one byte short of the served blob: the first chunk of the wrong length ends
    the fetch at once (no waiting for the timeout) and the edge serves on."""
    data = encode_tensors(perturbed(fed.state, 3.0))
    invalid = fed.edge_bus.traffic.transport().get("chunks_invalid", 0)
    started = time.monotonic()

    def attack(r: int) -> None:
        ref = fed.serve(data)
        fed.evil_send(fed.update(r, EVIL, ref.model_copy(update={"size": ref.size - 1})))

    report = check_rejected(fed, caplog, "blob_size_mismatch", attack)
    assert report.rejected == 1
    assert fed.edge_bus.traffic.transport().get("chunks_invalid", 0) > invalid
    assert not fed.edge_bus.store.has(sha256_hex(data))
    assert time.monotonic() - started < fed.edge_bus.settings.fetch_timeout_s


def test_an_update_served_from_another_subtree_is_refused_without_a_download(
    fed: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """An update whose blob source is not the sender's own subtree (another device's, the
    cloud's, a silent client's) is refused before anything is asked of that source."""
    data = encode_tensors(perturbed(fed.state, 5.0))
    asked = fed.good_bus.traffic.transport().get("blob_requests_missing", 0)

    def attack(r: int) -> None:
        ref = fed.serve(data).model_copy(update={"src": f"device/{GOOD}"})
        fed.evil_send(fed.update(r, EVIL, ref))

    report = check_rejected(fed, caplog, "foreign_source", attack)
    assert report.rejected == 1
    assert fed.good_bus.traffic.transport().get("blob_requests_missing", 0) == asked


def test_a_silent_blob_source_holds_up_no_one_else(
    fed: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attacker reports an update and never answers the edge's requests for its blob.
    The edge downloads it off its message thread: the honest update that comes after it is
    fetched and accepted at once, the round closes as soon as the attacker is gone, and
    nothing honest is counted late."""
    server = fed.evil_bus._blob_server
    monkeypatch.setattr(
        server,
        "handle_want",
        lambda payload, _requester, device=None: server.release_want(payload),
    )
    before = fed.rejected()
    r = fed.open_round()
    data = encode_tensors(perturbed(fed.state, 6.0))
    fed.evil_send(fed.update(r, EVIL, fed.serve(data)))
    wait_for(lambda: EVIL in fed.edge.fetching, "the edge to start fetching the silent blob")
    started = time.monotonic()
    report, good_sha = fed.finish_round(r)  # GOOD uploads, then EVIL says it is offline
    assert time.monotonic() - started < fed.edge_bus.settings.chunk_timeout_s + 5
    assert report.devices == [GOOD]
    assert report.model_ref is not None and report.model_ref.sha256 == good_sha
    rejected = diff_counts(fed.rejected(), before)
    assert "edge:late" not in rejected, rejected
    wait_for(lambda: EVIL not in fed.edge.fetching, "the silent fetch to end")


def test_a_blob_declared_larger_than_its_tensors_can_encode_is_refused_unfetched() -> None:
    """The declared size is checked against the upload spec before a byte is downloaded."""
    cfg = tiny_config()
    bus = MemoryBus()
    edge = EdgeServer(cfg, bus, make_algorithm(cfg), edge_id=EDGE)
    data = encode_tensors(fed_state(cfg))
    sha = bus.endpoint(GOOD, f"device/{GOOD}").put_blob(data, kind="device_update")
    limit = encoded_size_limit(edge.update_spec)
    assert len(data) <= limit
    ok = BlobRef(sha256=sha, size=len(data), kind="device_update", src=f"device/{GOOD}")
    assert set(edge.load_tensors(ok, edge.update_spec)) == set(edge.update_spec)
    fetched = bus.traffic.snapshot()
    with pytest.raises(TransportError) as err:
        edge.load_tensors(ok.model_copy(update={"size": limit + 1}), edge.update_spec)
    assert err.value.reason == "blob_too_large"
    assert bus.traffic.snapshot() == fetched  # nothing was asked for


def test_a_message_over_the_packet_size_the_role_announced_never_reaches_it(
    fed: Harness,
) -> None:
    """Each role announces an MQTT 5 Maximum Packet Size (a chunk or a message, plus
    headers): the broker drops a bigger publish instead of sending it, so a flood of 10 MiB
    messages costs the role nothing to read."""
    received = fed.edge_bus.traffic.transport().get("wire_bytes_received", 0)
    for _ in range(5):
        fed.evil_raw(b"x" * (10 << 20))
    probe = encode(fed.update(10_000, EVIL, None))
    fed.evil_raw(probe)  # in order behind the big ones: once it is counted, they are past
    key = "edge:unexpected_round"
    before = fed.rejected().get(key, 0)
    fed.evil_raw(probe)
    wait_for(lambda: fed.rejected().get(key, 0) > before, "the probe after the flood")
    grown = fed.edge_bus.traffic.transport().get("wire_bytes_received", 0) - received
    assert grown < 1 << 20, grown


def test_the_inbound_queue_is_bounded_in_bytes_as_well_as_messages() -> None:
    """Messages waiting for the role's thread hold at most ``max_queue_bytes``; more are
    dropped and counted (``bus:queue_full``), and taking one out frees its bytes."""
    settings = BrokerSection(max_queue_bytes=1 << 20)
    bus = MqttBus(settings, run="q", client_id="q-edge-edge0", home="edge/edge0")
    payload = b"x" * (300 << 10)
    for _ in range(4):
        bus._enqueue_inbound("estuary/v1/q/device/dev000/up", payload)
    assert bus._inbound.qsize() == 3
    assert bus.traffic.snapshot()["rejected"] == {"bus:queue_full": 1}
    assert bus._next_inbound(0) is not None
    bus._enqueue_inbound("estuary/v1/q/device/dev000/up", payload)
    assert bus._inbound.qsize() == 3


def test_messages_that_arrived_before_a_deadline_are_handled_before_it_fires() -> None:
    """A due timer waits while a message that arrived before its due time is queued: a
    round's deadline never turns updates that reached the edge in time into late ones."""
    bus = MqttBus(BrokerSection(), run="q", client_id="q-edge-edge0", home="edge/edge0")
    order: list[str] = []
    topic = "estuary/v1/q/device/dev000/up"
    bus.endpoint("edge0", "edge/edge0").subscribe(topic, lambda _t, p: order.append(p.decode()))
    bus._enqueue_inbound(topic, b"first")
    bus._enqueue_inbound(topic, b"second")
    time.sleep(0.01)
    bus.call_later(0.0, lambda: order.append("deadline"))
    bus._enqueue_inbound(topic, b"after")  # arrived after the timer was due
    bus.run(lambda: len(order) == 4, timeout_s=2.0)
    assert order == ["first", "second", "deadline", "after"]


def test_blob_the_source_does_not_have_is_rejected(
    fed: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A BlobRef to bytes its source never had: the source says "missing", edge moves on."""
    ghost = b"never stored anywhere"
    ref = BlobRef(
        sha256=sha256_hex(ghost), size=len(ghost), kind="device_update", src=f"device/{EVIL}"
    )
    report = check_rejected(
        fed, caplog, "blob_unavailable", lambda r: fed.evil_send(fed.update(r, EVIL, ref))
    )
    assert report.rejected == 1


# -- the cloud side --------------------------------------------------------------------------


def test_cloud_rejects_bad_edge_reports_and_keeps_serving(
    broker: LocalBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """Malformed EdgeUpdates, a report whose model is served anywhere but under the edge's
    cloud-only path (where its devices could read it, or another client serves it) and a NaN
    edge model are counted under ``cloud:``; the cloud still runs its round to completion
    with a good report."""
    caplog.set_level(logging.WARNING)
    cfg = tiny_config(
        run={"name": "badcloud", "rounds": 1},
        federation={"num_devices": 1, "num_edges": 1, "round_deadline_s": 30},
    )
    state = dict(build_unet(cfg.model.preset, seed=0).state_dict())
    topics = Topics(cfg.run.name)
    cloud_bus = connect(broker, cfg.run.name, "cloud")
    buses = [cloud_bus]
    try:
        edge_bus = connect(broker, cfg.run.name, f"edge/{EDGE}")
        buses.append(edge_bus)
        cloud = CloudServer(cfg, cloud_bus, make_algorithm(cfg), initial_model=dict(state))
        cloud.start()
        edge_ep = edge_bus.endpoint(EDGE, f"edge/{EDGE}")

        def rejected() -> dict[str, int]:
            return cloud_bus.traffic.snapshot()["rejected"]

        def pump_until(pred: Callable[[], bool], what: str) -> None:
            assert cloud_bus.run(pred, timeout_s=WAIT_S), f"cloud: no {what} in {WAIT_S:g}s"

        before = rejected()
        edge_ep.publish(topics.edge_up(EDGE), b"{definitely not json", kind="x")
        edge_ep.publish(topics.edge_up(EDGE), b'{"v": 1, "kind": "edge_update"}', kind="x")
        pump_until(lambda: len(diff_counts(rejected(), before)) == 2, "message rejections")

        hello = DeviceHello(device=GOOD, home_edge=EDGE, n_samples=10, label_counts=[1] * 10)
        edge_ep.publish(topics.device_hello(GOOD), encode(hello), kind="x")
        pump_until(lambda: cloud.started and cloud.timer is not None, "round start")

        def report(tensors: TensorDict, *, cloud_only: bool = True) -> bytes:
            data = encode_tensors(tensors)
            if cloud_only:
                sha = edge_ep.put_blob(data, kind="edge_update", recipient=CLOUD_RECIPIENT)
                src = cloud_only_home(f"edge/{EDGE}")
            else:  # the edge's own subtree, which its devices read
                sha, src = edge_ep.put_blob(data, kind="edge_update"), f"edge/{EDGE}"
            ref = BlobRef(sha256=sha, size=len(data), kind="edge_update", src=src)
            msg = EdgeUpdate(
                round=0,
                session=cloud.session,
                edge=EDGE,
                model_ref=ref,
                n_samples=10,
                label_counts=[1] * 10,
                devices=[GOOD],
                mean_loss=0.5,
                train_seconds=0.1,
            )
            return encode(msg)

        served = edge_bus.traffic.transport().get("blob_requests_served", 0)
        edge_ep.publish(topics.edge_up(EDGE), report(perturbed(state, 0.5), cloud_only=False),
                        kind="x")  # fmt: skip
        pump_until(lambda: rejected().get("cloud:foreign_source", 0) == 1, "foreign_source")
        assert edge_bus.traffic.transport().get("blob_requests_served", 0) == served  # not asked
        edge_ep.publish(topics.edge_up(EDGE), report(_poke(float("nan"))(state)), kind="x")
        pump_until(lambda: rejected().get("cloud:bad_tensors", 0) == 1, "bad_tensors rejection")
        edge_ep.publish(topics.edge_up(EDGE), report(perturbed(state, 0.5)), kind="x")
        pump_until(lambda: cloud.done, "round completion")

        assert diff_counts(rejected(), before) == {
            "cloud:bad_json": 1,
            "cloud:missing_field": 1,
            "cloud:foreign_source": 1,
            "cloud:bad_tensors": 1,
        }
        assert cloud.aggregations == 1
        first = next(iter(state))
        assert torch.equal(cloud.model[first], perturbed(state, 0.5)[first])
        logged = " ".join(rec.getMessage() for rec in caplog.records)
        for reason in ("bad_json", "missing_field", "foreign_source", "bad_tensors"):
            assert f"cloud rejected input ({reason})" in logged
    finally:
        for bus in buses:
            bus.close(timeout_s=2.0)


def test_a_download_silent_for_its_stall_time_gives_up_early(broker: LocalBroker) -> None:
    """An edge's upload download gives up its turn after ``stall_s`` of silence, long before
    the round's deadline: a device that never answers holds no turn for long."""
    bus = connect(broker, "stall", f"edge/{EDGE}")
    try:
        ep = bus.endpoint(EDGE, f"edge/{EDGE}")
        started = time.monotonic()
        with pytest.raises(TransportError) as err:
            ep.get_blob("ab" * 32, 1000, kind="device_update", src="device/dev009",
                        timeout_s=30, stall_s=1.5)  # fmt: skip
        assert err.value.reason == "timeout" and "nothing for" in str(err.value)
        assert 1.4 <= time.monotonic() - started < 6
    finally:
        bus.close()
