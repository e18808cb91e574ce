"""The private per-device downlink (pFedGPA's personal models): a blob the cloud puts for one
device travels only under ``device/<d>/down``, which the ACL of ``estuary provision`` lets only
that device and the cloud read, and the blob layer serves it there and nowhere else.

Broker tests run a real mosquitto under the generated ACL (the ``secured`` fixture of
tests/conftest.py) with each role logged in as itself; unit tests drive the blob server,
the in-memory bus and the ACL text directly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cloud import CloudServer
from estuary.acl import acl_text
from estuary.status import observer_topics
from shared.config import BrokerSection, RunConfig
from shared.errors import TransportError
from shared.methods.registry import make_algorithm
from shared.models.presets import build_unet
from shared.runtime.service import RoleService
from shared.transport.blob_server import BlobServer
from shared.transport.blob_transfer import BlobContext
from shared.transport.blobs import BlobStore
from shared.transport.bus import MemoryBus, topic_matches
from shared.transport.local_broker import LocalBroker, find_mosquitto
from shared.transport.mqtt import MqttBus
from shared.transport.telemetry import Traffic
from shared.wire.codec import sha256_hex
from shared.wire.messages import (
    BlobRef,
    BlobWant,
    PersonalModel,
    Topics,
    encode,
    private_home,
)
from tests.conftest import tiny_config
from tests.mqtt_probe import close, inbox, received
from tests.test_provision import BASE, _login

needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")

RUN = "acl"  # the run ``secured`` provisions (3 devices, 2 edges)
CHUNK = 4096
DOWN0 = f"{BASE}/device/dev000/down"


def _bus(broker: LocalBroker, out: Path, user: str, home: str, **limits: float) -> MqttBus:
    """A connected MqttBus for ``home``, logged in with ``user``'s provisioned password."""
    settings = BrokerSection(
        host=broker.host, port=broker.port, username=user,
        password_file=str(out / "credentials" / f"{user}.password"), connect_timeout_s=10,
        chunk_bytes=CHUNK, chunk_timeout_s=1, fetch_timeout_s=limits.get("fetch_timeout_s", 4),
    )  # fmt: skip
    return MqttBus(settings, run=RUN, client_id=f"{RUN}-{user}-bus", home=home).connect()


@pytest.fixture
def buses(secured: tuple[LocalBroker, Path]) -> Iterator[dict[str, MqttBus]]:
    """The cloud, dev000 and dev001 on MqttBuses, each logged in as itself."""
    broker, out = secured
    made: dict[str, MqttBus] = {}
    try:
        made["cloud"] = _bus(broker, out, "cloud", "cloud")
        for d in ("dev000", "dev001"):
            made[d] = _bus(broker, out, d, f"device/{d}", fetch_timeout_s=2)
        yield made
    finally:
        for bus in made.values():
            bus.close(timeout_s=2.0)


def _rejected(bus: MqttBus | MemoryBus, reason: str) -> int:
    return bus.traffic.snapshot()["rejected"].get(f"blob_server:{reason}", 0)


# -- over mosquitto, under the generated ACL ------------------------------------------------
@needs_mosquitto
def test_private_blob_reaches_its_device_only(
    secured: tuple[LocalBroker, Path], buses: dict[str, MqttBus]
) -> None:
    """dev000 fetches the blob the cloud put for it, on its downlink. dev001 cannot read that
    downlink, nor get the blob from the cloud's shared path, its own downlink or dev000's;
    edge0 cannot read the downlink either. The cloud's own view shows the chunks did travel
    there, and never under the cloud's shared blob path."""
    broker, out = secured
    cloud, dev0, dev1 = buses["cloud"], buses["dev000"], buses["dev001"]
    spies = {user: _login(broker, out, user) for user in ("cloud", "dev001", "edge0")}
    try:
        at_cloud = inbox(spies["cloud"], f"{BASE}/#")
        at_dev1 = inbox(spies["dev001"], f"{DOWN0}/#", f"{BASE}/device/+/down/#")
        at_edge = inbox(spies["edge0"], f"{DOWN0}/#", f"{BASE}/#")
        data = bytes(range(256)) * 40  # 10240 bytes: three chunks
        sha = cloud.endpoint("cloud").put_blob(data, kind="personal_model", recipient="dev000")

        got = dev0.endpoint("dev000", "device/dev000").get_blob(
            sha, len(data), kind="personal_model", src=private_home("dev000"), timeout_s=10
        )
        assert got == data
        chunks = {f"{DOWN0}/blob/{sha}/{CHUNK}/{i}" for i in range(3)}
        seen_by_cloud = received(at_cloud)
        assert chunks <= seen_by_cloud  # they travelled on the downlink...
        assert f"{BASE}/device/dev000/want/device/dev000/down" in seen_by_cloud
        assert not {t for t in received(at_edge, 0.1) if t.startswith(DOWN0)}  # ...unseen
        assert received(at_dev1, 0.1) == set()

        ep1 = dev1.endpoint("dev001", "device/dev001")
        for src in ("cloud", private_home("dev001"), private_home("dev000")):
            with pytest.raises(TransportError):
                ep1.get_blob(sha, len(data), kind="personal_model", src=src, timeout_s=3)
        assert _rejected(cloud, "private_blob_public_path") == 1
        assert _rejected(cloud, "private_blob_other_device") == 1
        # asking dev000's downlink (device/dev001/want/device/dev000/down) is not a topic
        # dev001 may write: the broker refuses it before the cloud hears of it
        assert _rejected(cloud, "private_want_mismatch") == 0
        # refused as a blob never put: only "missing" answers, nothing of the blob itself
        after = received(at_cloud)
        assert {t for t in after if f"/blob/{sha}/" in t} == {
            f"{BASE}/cloud/blob/{sha}/{CHUNK}/missing",
            f"{BASE}/device/dev001/down/blob/{sha}/{CHUNK}/missing",
        }
        # dev001 heard the "missing" on its own downlink, and nothing on dev000's; edge0
        # heard the one on the cloud's shared path, and nothing on any downlink
        assert received(at_dev1, 0.1) == {f"{BASE}/device/dev001/down/blob/{sha}/{CHUNK}/missing"}
        edge_seen = received(at_edge, 0.1)
        assert f"{BASE}/cloud/blob/{sha}/{CHUNK}/missing" in edge_seen
        assert not {t for t in edge_seen if "/down" in t}
        assert not dev1.store.has(sha)
    finally:
        close(*spies.values())


class _DeviceRole(RoleService):
    """The receiving half of a device agent: validated messages on its own topics."""

    role = "device"


class _CloudRole(RoleService):
    """The cloud's blob-putting half."""

    role = "cloud"


@needs_mosquitto
def test_personal_model_from_the_cloud_reaches_only_its_device(
    secured: tuple[LocalBroker, Path], buses: dict[str, MqttBus]
) -> None:
    """The real CloudServer sends dev000 and dev001 their personal models: dev000 receives
    its own on its downlink and loads the tensors from the ref's private source; a client
    logged in as dev001, subscribed to every downlink, receives its own and not dev000's."""
    broker, out = secured
    cfg: RunConfig = tiny_config(run={"name": RUN}, federation={"num_devices": 3, "num_edges": 2})
    state = dict(build_unet(cfg.model.preset, seed=0).state_dict())
    cloud = CloudServer(cfg, buses["cloud"], make_algorithm(cfg), initial_model=state)
    device = _DeviceRole("dev000", cfg, buses["dev000"])
    got: list[PersonalModel] = []
    device.on(device.topics.device_down("dev000"), PersonalModel, got.append,
              "msg_personal_model")  # fmt: skip
    spy = _login(broker, out, "dev001")
    try:
        at_dev1 = inbox(spy, f"{DOWN0}/#", f"{BASE}/device/+/down")
        personal = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
        assert cloud._send_personal({"dev000": personal, "dev001": {"w": torch.zeros(2)}})
        assert buses["dev000"].run(lambda: bool(got), timeout_s=10)
        (msg,) = got
        assert (msg.device, msg.round, msg.session) == ("dev000", cloud.round, cloud.session)
        assert msg.model_ref.src == "device/dev000/down"
        tensors = device.fetch_tensors(msg.model_ref, None, timeout_s=10)
        assert tensors is not None and torch.equal(tensors["w"], personal["w"])
        assert received(at_dev1) == {f"{BASE}/device/dev001/down"}
    finally:
        close(spy)


@needs_mosquitto
def test_device_cannot_fake_a_personal_model_for_another_device(
    secured: tuple[LocalBroker, Path], buses: dict[str, MqttBus]
) -> None:
    """Only the cloud writes another device's downlink: dev001 publishing a PersonalModel on
    dev000's reaches nobody (the cloud, reading everything, sees nothing)."""
    broker, out = secured
    spies = {user: _login(broker, out, user) for user in ("cloud", "dev001")}
    try:
        at_cloud = inbox(spies["cloud"], f"{BASE}/device/+/down/#")
        ref = BlobRef(sha256="ab" * 32, size=1, kind="personal_model", src="device/dev000/down")
        fake = PersonalModel(round=0, session="0" * 16, device="dev000", model_ref=ref,
                             mode="inversion")  # fmt: skip
        spies["dev001"].publish(DOWN0, encode(fake), qos=1)
        spies["dev001"].publish(f"{DOWN0}/blob/{'ab' * 32}/{CHUNK}/0", b"x", qos=1)
        assert received(at_cloud) == set()
    finally:
        close(*spies.values())


# -- the blob server on its own ---------------------------------------------------------------
@pytest.fixture
def server() -> tuple[BlobServer, list[tuple[str, bytes]], Traffic]:
    """The cloud's blob server publishing into a list."""
    sent: list[tuple[str, bytes]] = []

    def publish(topic: str, payload: bytes) -> int:
        sent.append((topic, payload))
        return len(sent)

    traffic = Traffic()
    ctx = BlobContext(BrokerSection(chunk_bytes=CHUNK), BlobStore(None), Topics("unit"), "cloud",
                      traffic, publish, "cloud")  # fmt: skip
    return BlobServer(ctx, on_served=lambda _sha: None), sent, traffic


def _ask(server: BlobServer, sha: str, size: int, device: str | None = None) -> None:
    payload = encode(BlobWant(sha256=sha, size=size, chunk_bytes=CHUNK, chunks=[(0, 9)]))
    assert server.admit_want(payload)
    # asked publicly by an edge (which may fetch the cloud's blobs), privately by the device
    server.handle_want(payload, "edge/edge0" if device is None else f"device/{device}", device)


def test_blob_server_answers_missing_to_a_private_blob_asked_for_publicly(
    server: tuple[BlobServer, list[tuple[str, bytes]], Traffic],
) -> None:
    """Asked on the shared path, a private blob gets exactly the answer of a blob never put
    (and the refusal is counted); on another device's downlink likewise; on its recipient's
    it is served there, chunk by chunk."""
    blobs, sent, traffic = server
    data = b"p" * (CHUNK + 10)
    sha = blobs.put_private(data, "dev000")
    unknown = sha256_hex(b"never put")
    base = "estuary/v1/unit"

    _ask(blobs, unknown, len(data))
    _ask(blobs, sha, len(data))
    assert sent == [(f"{base}/cloud/blob/{unknown}/{CHUNK}/missing", b""),
                    (f"{base}/cloud/blob/{sha}/{CHUNK}/missing", b"")]  # fmt: skip
    assert traffic.snapshot()["rejected"] == {"blob_server:private_blob_public_path": 1}
    assert traffic.transport()["blob_requests_missing"] == 2
    assert not blobs.ready()

    sent.clear()
    _ask(blobs, sha, len(data), "dev001")
    assert sent == [(f"{base}/device/dev001/down/blob/{sha}/{CHUNK}/missing", b"")]
    assert traffic.snapshot()["rejected"]["blob_server:private_blob_other_device"] == 1

    sent.clear()
    _ask(blobs, sha, len(data), "dev000")
    while blobs.ready():
        blobs.send_next()
    down = f"{base}/device/dev000/down/blob/{sha}/{CHUNK}"
    assert sent == [(f"{down}/0", data[:CHUNK]), (f"{down}/1", data[CHUNK:])]


def test_a_forgotten_recipient_leaves_the_blob_served_to_nobody(
    server: tuple[BlobServer, list[tuple[str, bytes]], Traffic],
) -> None:
    """Past ``max_private_blobs`` the oldest private blob is refused on every path, its own
    device's included, and never falls back to the shared path."""
    blobs, sent, _ = server
    blobs.max_private_blobs = 1
    first = blobs.put_private(b"first", "dev000")
    blobs.put_private(b"second", "dev001")
    assert blobs.recipients(first) == frozenset()
    _ask(blobs, first, 5, "dev000")
    _ask(blobs, first, 5)
    assert [t.rsplit("/", 1)[1] for t, _ in sent] == ["missing", "missing"]
    assert not blobs.ready()


# -- the in-process bus and the runtime ------------------------------------------------------
def test_memory_bus_refuses_a_private_blob_to_every_other_endpoint() -> None:
    """On the in-process bus a private blob reaches its recipient and its owner; any other
    endpoint is told it is not on the bus (and that is counted). Bytes also put in the open
    are no secret."""
    bus = MemoryBus()
    cloud = bus.endpoint("cloud")
    sha = cloud.put_blob(b"secret", kind="personal_model", recipient="dev000")
    src = private_home("dev000")
    for name, home in (("dev000", "device/dev000"), ("cloud", "cloud")):
        got = bus.endpoint(name, home).get_blob(sha, 6, kind="personal_model", src=src)
        assert got == b"secret"
    for name, home in (("dev001", "device/dev001"), ("edge0", "edge/edge0")):
        with pytest.raises(TransportError, match="not on the bus"):
            bus.endpoint(name, home).get_blob(sha, 6, kind="personal_model", src=src)
    assert _rejected(bus, "private_blob_other_device") == 2
    assert cloud.put_blob(b"secret", kind="global_model") == sha
    assert bus.endpoint("edge0", "edge/edge0").get_blob(sha, 6, kind="m", src="cloud")
    with pytest.raises(TransportError, match="no device id"):
        cloud.put_blob(b"x", kind="personal_model", recipient="dev000/#")


def test_put_private_tensors_names_the_private_downlink() -> None:
    """The ref the cloud sends points at the device's downlink, and only it loads it."""
    cfg = tiny_config()
    bus = MemoryBus()
    cloud = _CloudRole("cloud", cfg, bus)
    ref = cloud.put_private_tensors({"w": torch.ones(2)}, "personal_model", "dev000")
    assert ref.src == "device/dev000/down" and ref.kind == "personal_model"
    assert BlobRef.model_validate_json(ref.model_dump_json()) == ref
    mine, other = _DeviceRole("dev000", cfg, bus), _DeviceRole("dev001", cfg, bus)
    tensors = mine.fetch_tensors(ref, None)
    assert tensors is not None and torch.equal(tensors["w"], torch.ones(2))
    assert other.fetch_tensors(ref, None) is None
    assert other.traffic.snapshot()["rejected"]["device:blob_unavailable"] == 1


# -- the ACL ---------------------------------------------------------------------------------
def test_acl_keeps_downlinks_from_edges_and_other_devices() -> None:
    """In the generated ACL only the cloud writes a downlink; no edge read and no read of
    another device matches any of its topics; an edge still reads everything ``estuary
    status`` shows."""
    cfg = tiny_config(run={"name": RUN}, federation={"num_devices": 3, "num_edges": 2})
    users: dict[str, list[tuple[str, str]]] = {}
    user = ""
    for line in acl_text(cfg, devices=["dev000", "dev001", "dev002"],
                         edges=["edge0", "edge1"]).splitlines():  # fmt: skip
        if line.startswith("user "):
            user = line.split()[1]
            users[user] = []
        elif line.startswith("topic "):
            _, access, pattern = line.split()
            users[user].append((access, pattern))
    downlink = [DOWN0, f"{DOWN0}/blob/{'ab' * 32}/{CHUNK}/0"]
    for name, rules in users.items():
        writes = [p for access, p in rules if "write" in access]
        wrote = all(any(topic_matches(p, t) for p in writes) for t in downlink)
        assert wrote == (name == "cloud"), name
        reads = [p for access, p in rules if "read" in access]
        if name not in ("cloud", "dev000"):
            assert not [(p, t) for p in reads for t in downlink if topic_matches(p, t)], name
        if name.startswith("edge"):
            for topic in observer_topics(Topics(RUN)):
                assert any(topic_matches(p, topic.replace("+", "x")) for p in reads), topic
    assert all(any(topic_matches(p, t) for _, p in users["dev000"]) for t in downlink)


@needs_mosquitto
def test_private_want_from_another_device_is_dropped_unanswered(
    secured: tuple[LocalBroker, Path], buses: dict[str, MqttBus]
) -> None:
    """dev001 asking on dev000's downlink (from its own subtree) gets no answer at all:
    a ``missing`` there would only cut short dev000's own fetch. The provisioned ACL lets a
    device ask only on its own downlink, so the broker drops the request before the cloud
    (whose own check, ``private_want_mismatch``, is for brokers without that ACL) hears it."""
    broker, out = secured
    cloud = buses["cloud"]
    sha = cloud.endpoint("cloud").put_blob(b"d" * 100, kind="personal_model", recipient="dev000")
    spies = {user: _login(broker, out, user) for user in ("cloud", "dev001")}
    try:
        at_cloud = inbox(spies["cloud"], f"{BASE}/device/+/down/#", f"{BASE}/cloud/blob/#")
        want = BlobWant(sha256=sha, size=100, chunk_bytes=CHUNK, chunks=[(0, 0)])
        spies["dev001"].publish(f"{BASE}/device/dev001/want/device/dev000/down", encode(want),
                                qos=1)  # fmt: skip
        assert received(at_cloud) == set()
        assert _rejected(cloud, "private_want_mismatch") == 0
    finally:
        close(*spies.values())
