"""The adversarial suite's blob attacks: what one device's credentials can make the blob
servers of a federation send, and read of the other devices' uploads.

One run (``blob_run``): a pFedGPA federation (one edge, three devices, two rounds; the edge
forwards every upload to the cloud) on a Mosquitto that enforces ``estuary provision``'s
accounts and ACL, attacked with the credentials of dev003, a device of the same edge that
the run does not use. In the first round, before the honest devices train, it floods the
edge with 300 requests for the edge's model and the cloud with 300 for the global model;
through both rounds it listens wherever its account may read (the edge's blobs, every blob
request the cloud makes) and asks the edge for every blob the cloud asks the edge for.

- the edge sends at most a copy or two of its model, not one per request:
  ``test_a_request_flood_is_not_amplified_by_the_edge``
- the cloud sends a device none of the global model: ``test_the_cloud_serves_devices_no_model``
- a device of the edge receives no byte of another device's upload:
  ``test_a_device_receives_no_other_devices_upload``
- the run completes both rounds with every honest update:
  ``test_the_blob_run_completes``

On the open broker (cheap, no federation): a device's upload server answers no other device
(``test_a_device_serves_no_other_device``), and a requester's chunks stop at its byte budget
of the minute (``test_a_requesters_budget_bounds_what_it_is_sent``).

One more run on the open broker (``dead_edge_run``, FedAvg): the edge reports its model and
dies at once; the cloud handles the edge's will at once, closes the round without it and
gives the download up at the stall limit
(``test_a_dead_edge_does_not_freeze_the_cloud``,
``test_a_download_from_a_dead_edge_gives_up_at_the_stall_limit``).

The module runs in the default test run (about 40 s here: two federations of a few
seconds, the dead edge's 3 s stall limit, and the floods).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import pytest

from estuary.provision import provision
from shared.config import BrokerSection, RunConfig
from shared.transport.blob_server import BlobServer
from shared.transport.blob_transfer import BlobContext
from shared.transport.blobs import BlobStore
from shared.transport.local_broker import LocalBroker, find_mosquitto
from shared.transport.mqtt import MqttBus
from shared.transport.telemetry import Traffic
from shared.wire.messages import (
    BlobWant,
    DeviceUpdate,
    EdgeUpdate,
    RoundStart,
    Topics,
    decode,
    encode,
)
from tests.attack_tools import WAIT_S, Federation, Hostile, rejected, wait_for, watch_round
from tests.conftest import shared_broker, tiny_config

pytestmark = [
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed"),
    pytest.mark.xdist_group("attacks_blobs"),
]

EDGE = "edge0"
ATTACKER = "dev003"  # provisioned, of edge0, not run
FLOOD = 300


def config(name: str) -> RunConfig:
    """pFedGPA, one edge, three devices, two rounds (run ``name``)."""
    return tiny_config(
        run={"name": name, "rounds": 2},
        federation={"num_devices": 3, "num_edges": 1, "round_deadline_s": 60},
        data={"synthetic_size": 600, "partition": "dominant_groups", "samples_per_device": 50},
        model={"preset": "fmnist-cnn"},
        train={"optimizer": "sgd", "lr": 0.05, "batch_size": 25, "local_epochs": 1,
               "local_steps": 0, "grad_clip": 0.0, "threads": 1},
        algorithm={"name": "pfedgpa", "pfedgpa_store_rounds": 2, "pfedgpa_ae_steps": 2,
                   "pfedgpa_dm_steps": 2, "pfedgpa_timesteps": 10, "pfedgpa_invert_from": 2,
                   "pfedgpa_batch": 2, "pfedgpa_denoiser_width": 4},
    )  # fmt: skip


def want_all(sha: str, size: int, chunk_bytes: int) -> bytes:
    """A request for every chunk of a blob."""
    n = max(1, -(-size // chunk_bytes))
    return encode(BlobWant(sha256=sha, size=size, chunk_bytes=chunk_bytes, chunks=[(0, n - 1)]))


def flood(evil: Hostile, topic: str, payload: bytes) -> float:
    """Publish ``payload`` on ``topic`` :data:`FLOOD` times, paced (ten every 20 ms), as the
    requests of a fetcher that asks again and again; returns the seconds it took."""
    started = time.monotonic()
    for _ in range(FLOOD // 10):
        evil.send_many([(topic, payload)] * 10)
        time.sleep(0.02)
    return time.monotonic() - started


def sent_bytes(bus: MqttBus) -> int:
    """Payload bytes a role's bus has published so far."""
    return int(bus.traffic.transport().get("wire_bytes_sent", 0))


def settle(bus: MqttBus, quiet_s: float = 1.0, timeout_s: float = WAIT_S) -> None:
    """Wait until ``bus`` has published nothing for ``quiet_s`` (its answers are out)."""
    end = time.monotonic() + timeout_s
    last, since = sent_bytes(bus), time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.1)
        now = sent_bytes(bus)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
    raise AssertionError("the bus kept sending")


@dataclass
class BlobRun:
    """What the blob run did and saw."""

    completed: bool
    updates: list[int]
    model_bytes: int
    edge_sent: int  # bytes the edge published while the flood was answered
    flood_s: float  # how long the flood of the edge took
    cloud_sent: int
    edge_rejected: dict[str, int]
    cloud_rejected: dict[str, int]
    uploads: set[str]  # sha256 of every device upload and every forwarded copy
    forwarded: int  # forwarded copies the edge reported
    leaked: int  # bytes of those blobs the attacker received
    seen_cloud_wants: int  # requests of the cloud the attacker saw (and asked again)


@pytest.fixture(scope="module")
def blob_run(tmp_path_factory: pytest.TempPathFactory) -> BlobRun:
    cfg = config("atk-blobs")
    topics = Topics(cfg.run.name)
    out = tmp_path_factory.mktemp("blobs") / "prov"
    prov = cfg.model_copy(update={"federation": cfg.federation.model_copy(
        update={"num_devices": 4})})  # fmt: skip
    provision(prov, out)
    uploads: set[str] = set()
    forwarded = 0
    with LocalBroker(kind="mosquitto", workdir=out.parent / "broker",
                     password_file=out / "mosquitto" / "passwd",
                     acl_file=out / "mosquitto" / "acl") as secured:  # fmt: skip
        password = (out / "credentials" / f"{ATTACKER}.password").read_text().strip()
        with (
            contextlib.ExitStack() as stack,
            Federation(cfg, secured.host, secured.port, accounts=out, gated_rounds=[0]) as fed,
        ):
            edge, edge_bus, cloud_bus = fed.edges[EDGE], fed.bus(EDGE), fed.bus("cloud")
            chunk = edge_bus.settings.chunk_bytes

            def edge_send(topic: str, msg: Any, *, retain: bool = False) -> None:
                nonlocal forwarded
                if isinstance(msg, EdgeUpdate):
                    for f in msg.forwarded or []:
                        uploads.add(f.update_ref.sha256)
                        forwarded += 1
                type(edge).send(edge, topic, msg, retain=retain)

            edge.send = edge_send  # type: ignore[method-assign]
            for dev in fed.devices.values():

                def dev_send(topic: str, msg: Any, *, retain: bool = False, d: Any = dev) -> None:
                    if isinstance(msg, DeviceUpdate) and msg.update_ref is not None:
                        uploads.add(msg.update_ref.sha256)
                    type(d).send(d, topic, msg, retain=retain)

                dev.send = dev_send  # type: ignore[method-assign]
            evil = Hostile(secured.host, secured.port, ATTACKER, user=ATTACKER, password=password)
            stack.callback(evil.close)
            asked = f"{topics.base}/device/{ATTACKER}/want/edge/{EDGE}"
            seen: set[bytes] = set()

            def ask_again(topic: str, payload: bytes) -> None:
                # every blob the cloud asks the edge for, the attacker asks the edge for too,
                # and each honest device (its upload has the same bytes)
                ours = topic.startswith(f"{topics.base}/cloud/want/edge/{EDGE}")
                if ours and payload not in seen:
                    seen.add(payload)
                    evil.client.publish(asked, payload, qos=1)
                    for d in fed.devices:
                        evil.client.publish(
                            topics.blob_want(f"device/{ATTACKER}", f"device/{d}"), payload, qos=1
                        )

            evil.on_message = ask_again
            # what its account may read, and what it may not (the broker refuses the latter)
            evil.subscribe(topics.edge_round(EDGE), f"{topics.base}/edge/{EDGE}/blob/#",
                           f"{topics.base}/cloud/#", f"{topics.base}/edge/{EDGE}/cloud/#",
                           f"{topics.base}/device/+/blob/#")  # fmt: skip
            announced = watch_round(evil, topics, EDGE)
            fed.start()
            model = announced(0).model_ref
            # the edge's model, 300 times
            before = sent_bytes(edge_bus)
            flood_s = flood(evil, asked, want_all(model.sha256, model.size, chunk))
            settle(edge_bus)
            edge_sent = sent_bytes(edge_bus) - before
            # the cloud's global model, 300 times
            start = next(decode(p, RoundStart) for t, p in evil.received(topics.cloud_round))
            glob = start.global_ref
            before = sent_bytes(cloud_bus)
            flood(
                evil,
                f"{topics.base}/device/{ATTACKER}/want/cloud",
                want_all(glob.sha256, glob.size, chunk),
            )
            settle(cloud_bus)
            cloud_sent = sent_bytes(cloud_bus) - before
            fed.release(0)
            outcome = fed.wait()
            time.sleep(1.0)  # the answers to the last requests seen
            leaked = sum(
                len(p) for t, p in evil.received("/blob/")
                if t.split("/blob/", 1)[1].split("/", 1)[0] in uploads
            )  # fmt: skip
            result = BlobRun(
                completed=outcome.completed, updates=[r.updates for r in outcome.rounds],
                model_bytes=model.size, edge_sent=edge_sent, flood_s=flood_s,
                cloud_sent=cloud_sent,
                edge_rejected=rejected(edge_bus.traffic),
                cloud_rejected=rejected(cloud_bus.traffic), uploads=set(uploads),
                forwarded=forwarded, leaked=leaked, seen_cloud_wants=len(seen),
            )  # fmt: skip
    print(f"blob run: {result}")  # the figures docs/reliability.md quotes (pytest -rP)
    return result


def test_the_blob_run_completes(blob_run: BlobRun) -> None:
    """Under the attacks both rounds complete with the three honest updates, and the edge
    forwarded each of them to the cloud."""
    assert blob_run.completed
    assert blob_run.updates == [3, 3]
    assert blob_run.forwarded == 6


def test_a_request_flood_is_not_amplified_by_the_edge(blob_run: BlobRun) -> None:
    """300 requests (~170 bytes each) for the edge's model from one device over a few
    seconds: the edge sends it once per ``serve_repeat_s`` (4 s) at most, not once per
    request, and counts the repeats (``blob_server:repeated_request``)."""
    copies = 1 + math.ceil(blob_run.flood_s / BrokerSection().serve_repeat_s)
    assert blob_run.edge_sent <= copies * blob_run.model_bytes + 4096, (
        blob_run.edge_sent, blob_run.model_bytes, blob_run.flood_s)  # fmt: skip
    assert blob_run.edge_rejected.get("blob_server:repeated_request", 0) >= FLOOD - copies


def test_the_cloud_serves_devices_no_model(blob_run: BlobRun) -> None:
    """300 requests for the global model from a device (which fetches its model from its
    edge): the cloud sends none of it and counts each (``blob_server:not_for_requester``)."""
    assert blob_run.cloud_sent < 4096, blob_run.cloud_sent
    assert blob_run.cloud_rejected.get("blob_server:not_for_requester") == FLOOD


def test_a_device_receives_no_other_devices_upload(blob_run: BlobRun) -> None:
    """pFedGPA's forwarded uploads travel where no device reads: a device of the same edge,
    listening on every blob topic its account may read and asking the edge and each device
    for every blob the cloud asks the edge for, receives not one byte of another device's
    upload."""
    assert blob_run.uploads, "no upload recorded"
    assert blob_run.seen_cloud_wants >= 1  # it did see the cloud's requests
    assert blob_run.leaked == 0, f"{blob_run.leaked} bytes of other devices' uploads"


# -- the open broker ---------------------------------------------------------------------------

broker = pytest.fixture(scope="module")(shared_broker)


def _bus(broker: LocalBroker, run: str, home: str, **settings: Any) -> MqttBus:
    s = BrokerSection(host=broker.host, port=broker.port, connect_timeout_s=10,
                      chunk_bytes=4096, **settings)  # fmt: skip
    return MqttBus(s, run=run, client_id=f"{run}-{home.replace('/', '-')}", home=home).connect()


def test_a_device_serves_no_other_device(broker: LocalBroker) -> None:
    """dev002 asks dev001 for its upload (on the open broker, with the hash in hand): dev001
    sends nothing and counts ``blob_server:not_for_requester``; its edge is served."""
    run = "blobs-dev"
    topics = Topics(run)
    server = _bus(broker, run, "device/dev001")
    evil = Hostile(broker.host, broker.port, f"{run}-evil")
    try:
        data = os.urandom(5 * 4096)
        sha = server.endpoint("dev001", "device/dev001").put_blob(data, kind="device_update")
        evil.subscribe(f"{topics.base}/device/dev001/blob/#")
        want = want_all(sha, len(data), 4096)
        evil.send(topics.blob_want("device/dev002", "device/dev001"), want)
        wait_for(lambda: bool(rejected(server.traffic)), "the refusal")
        assert rejected(server.traffic) == {"blob_server:not_for_requester": 1}
        evil.send(topics.blob_want("edge/edge0", "device/dev001"), want)
        wait_for(lambda: len(evil.received("/blob/")) >= 5, "the edge's five chunks")
        assert sorted(t.rsplit("/", 1)[1] for t, _ in evil.received("/blob/")) == [
            "0", "1", "2", "3", "4"]  # fmt: skip
    finally:
        evil.close()
        server.close(timeout_s=1.0)


def test_a_requesters_budget_bounds_what_it_is_sent(broker: LocalBroker) -> None:
    """With a budget of 8 chunks a minute, an edge asking for 20 different chunks is sent 8;
    the rest is counted (``blob_server:over_budget``, ``chunks_over_budget``)."""
    run = "blobs-budget"
    topics = Topics(run)
    server = _bus(broker, run, "device/dev001", serve_budget_bytes_per_min=8 * 4096)
    evil = Hostile(broker.host, broker.port, f"{run}-evil")
    try:
        data = os.urandom(20 * 4096)
        sha = server.endpoint("dev001", "device/dev001").put_blob(data, kind="device_update")
        evil.subscribe(f"{topics.base}/device/dev001/blob/#")
        evil.send(topics.blob_want("edge/edge0", "device/dev001"), want_all(sha, len(data), 4096))
        wait_for(lambda: len(evil.received("/blob/")) >= 8, "eight chunks")
        time.sleep(0.5)
        assert len(evil.received("/blob/")) == 8
        assert rejected(server.traffic) == {"blob_server:over_budget": 1}
        assert server.traffic.transport().get("chunks_over_budget") == 12
    finally:
        evil.close()
        server.close(timeout_s=1.0)


# -- an edge that dies right after it reports ---------------------------------------------------

HANDLED_WITHIN_S = 20.0


@dataclass
class DeadEdgeRun:
    """What the cloud did once its edge died right after reporting."""

    offline_seen_in: float  # seconds from the edge's death to the cloud handling its will
    gave_up_in: float  # seconds from its death to the cloud counting the download's timeout
    stall_s: float
    cloud_rejected: dict[str, int]
    rounds: int  # rounds the cloud closed


def sever(bus: MqttBus) -> None:
    """The process owning ``bus`` dies (as under SIGKILL): it serves nothing more and its
    connection drops without a DISCONNECT, so the broker publishes its will."""
    bus._closing.set()  # its I/O worker and its role loop stop
    bus.client.loop_stop()
    sock = bus.client.socket()
    if sock is not None:
        sock.close()


@pytest.fixture(scope="module")
def dead_edge_run(broker: LocalBroker) -> DeadEdgeRun:
    """FedAvg, one edge, three devices: the edge reports its first round's model, and dies
    (it no longer serves that model) the moment the broker has the report."""
    cfg = tiny_config(run={"name": "atk-dead-edge", "rounds": 2},
                      federation={"num_devices": 3, "num_edges": 1, "round_deadline_s": 60},
                      train={"local_steps": 2, "batch_size": 8, "threads": 1},
                      broker={"chunk_timeout_s": 1.0})  # fmt: skip
    died = [0.0]
    with Federation(cfg, broker.host, broker.port) as fed:
        edge, edge_bus, cloud = fed.edges[EDGE], fed.bus(EDGE), fed.cloud

        def send_then_die(topic: str, msg: Any, *, retain: bool = False) -> None:
            if not isinstance(msg, EdgeUpdate) or msg.model_ref is None:
                type(edge).send(edge, topic, msg, retain=retain)
                return
            edge_bus._closing.set()  # from now on it answers no blob request
            type(edge).send(edge, topic, msg, retain=retain)
            info = edge_bus._last_info
            if info is not None:
                info.wait_for_publish(WAIT_S)
            sever(edge_bus)
            died[0] = time.monotonic()

        edge.send = send_then_die  # type: ignore[method-assign]
        fed.start()
        wait_for(lambda: died[0] > 0, "the edge's report")
        offline_in = gave_up_in = float("inf")
        with contextlib.suppress(AssertionError):
            wait_for(lambda: EDGE in cloud.offline, "the cloud to handle the edge's will",
                     timeout_s=HANDLED_WITHIN_S)  # fmt: skip
            offline_in = time.monotonic() - died[0]
        with contextlib.suppress(AssertionError):
            wait_for(lambda: rejected(fed.traffic("cloud")).get("cloud:timeout", 0) >= 1,
                     "the cloud to give up the download", timeout_s=HANDLED_WITHIN_S)  # fmt: skip
            gave_up_in = time.monotonic() - died[0]
        result = DeadEdgeRun(offline_seen_in=offline_in, gave_up_in=gave_up_in,
                             stall_s=getattr(cloud, "stall_s", float("nan")),
                             cloud_rejected=rejected(fed.traffic("cloud")),
                             rounds=len(fed.summaries))  # fmt: skip
    print(f"dead edge run: {result}")  # the figures docs/reliability.md quotes (pytest -rP)
    return result


def test_a_dead_edge_does_not_freeze_the_cloud(dead_edge_run: DeadEdgeRun) -> None:
    """The cloud downloads an edge's model off its message thread: the dead edge's will
    (offline) is handled within a second or two, not after the download's 600 s timeout,
    and the round closes without it."""
    assert dead_edge_run.offline_seen_in < 5.0, dead_edge_run
    assert dead_edge_run.rounds >= 1, dead_edge_run


def test_a_download_from_a_dead_edge_gives_up_at_the_stall_limit(
    dead_edge_run: DeadEdgeRun,
) -> None:
    """The download that receives nothing gives up after the stall limit (3 x
    ``chunk_timeout_s``), counted once as ``cloud:timeout``, and nothing else is refused."""
    assert dead_edge_run.gave_up_in < dead_edge_run.stall_s + 5.0, dead_edge_run
    assert dead_edge_run.cloud_rejected == {"cloud:timeout": 1}, dead_edge_run


# -- the repeat window on its own ---------------------------------------------------------------


def test_a_repeated_chunk_is_sent_again_once_the_window_is_over() -> None:
    """A requester asking again within ``serve_repeat_s`` is sent nothing (counted); once
    the window is over it is sent the chunks again (an honest receiver's re-request after a
    loss), and another requester is served meanwhile."""
    sent: list[str] = []

    def publish(topic: str, _payload: bytes) -> int:
        sent.append(topic.rsplit("/", 1)[1])
        return len(sent)

    traffic = Traffic()
    ctx = BlobContext(BrokerSection(chunk_bytes=4096, serve_repeat_s=4.0), BlobStore(None),
                      Topics("unit"), "device/dev001", traffic, publish, "dev001")  # fmt: skip
    server = BlobServer(ctx, on_served=lambda _sha: None)
    now = [100.0]
    server.clock = lambda: now[0]
    data = os.urandom(3 * 4096)
    sha = ctx.store.put(data)
    want = want_all(sha, len(data), 4096)

    def ask(requester: str) -> list[str]:
        sent.clear()
        assert server.admit_want(want)
        server.handle_want(want, requester)
        while server.ready():
            server.send_next()
        return list(sent)

    assert ask("edge/edge0") == ["0", "1", "2"]
    now[0] += 3.9
    assert ask("edge/edge0") == []
    assert rejected(traffic) == {"blob_server:repeated_request": 1}
    assert ask("cloud") == ["0", "1", "2"]
    now[0] += 0.2
    assert ask("edge/edge0") == ["0", "1", "2"]
