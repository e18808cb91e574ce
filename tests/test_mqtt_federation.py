"""The same federation over a real mosquitto (one MqttBus per role, one thread each) and over
MemoryBus: same final model, same messages and blob bytes; plus MqttBus blob-layer behaviour
(chunking, resume after lost chunks, coalesced fan-out, limits)."""

from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cloud import CloudServer
from device_agent import DeviceAgent
from edge_node import EdgeServer
from estuary.simulate import build_federation
from shared.config import BrokerSection, RunConfig
from shared.data.datasets import load_dataset, to_model_input
from shared.data.partition import make_partition
from shared.errors import CodecError, TransportError
from shared.methods.registry import make_algorithm
from shared.models.init import initial_model
from shared.naming import device_name, edge_ids, home_edge
from shared.transport import blobs
from shared.transport.blob_transfer import chunk_count
from shared.transport.blobs import BlobStore
from shared.transport.bus import MemoryBus
from shared.transport.local_broker import LocalBroker, find_mosquitto
from shared.transport.mqtt import MqttBus
from shared.transport.telemetry import Traffic
from shared.wire.codec import Blob, MappedBlob
from shared.wire.messages import Presence, encode, home_of
from tests.conftest import shared_broker, tiny_config

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")

TIMING_KINDS = {"msg_device_update", "msg_edge_update"}  # carry wall-clock train_seconds


#: the session's open mosquitto (this module's runs have names of their own)
broker = pytest.fixture(scope="module")(shared_broker)


def _bus(
    broker: LocalBroker, run: str, role: str, name: str, traffic: Traffic, **settings: int
) -> MqttBus:
    home = home_of(role, name)
    will = encode(Presence(name=name, role=role, online=False))  # type: ignore[arg-type]
    s = BrokerSection(port=broker.port, **settings)  # type: ignore[arg-type]
    return MqttBus(
        s, run=run, client_id=f"{run}-{name}", home=home, will=will, traffic=traffic
    ).connect()


def _run_over_mqtt(cfg: RunConfig, broker: LocalBroker) -> tuple[str, Traffic]:
    """Every role on its own MqttBus and thread; returns (final model sha, shared traffic)."""
    traffic = Traffic()
    data = load_dataset("synthetic", size=cfg.data.synthetic_size, seed=cfg.run.seed)
    parts = make_partition(data.labels, cfg.federation.num_devices, cfg.data, cfg.run.seed)
    buses: list[MqttBus] = []
    try:
        cbus = _bus(broker, cfg.run.name, "cloud", "cloud", traffic)
        buses.append(cbus)
        cloud = CloudServer(
            cfg,
            cbus,
            make_algorithm(cfg),
            initial_model=dict(initial_model(cfg.model.preset, seed=cfg.run.seed).state_dict()),
        )
        services: list[tuple[object, MqttBus]] = [(cloud, cbus)]
        for e in edge_ids(cfg):
            b = _bus(broker, cfg.run.name, "edge", e, traffic)
            buses.append(b)
            services.append((EdgeServer(cfg, b, make_algorithm(cfg), edge_id=e), b))
        for i, p in enumerate(parts):
            b = _bus(broker, cfg.run.name, "device", device_name(i), traffic)
            buses.append(b)
            dev = DeviceAgent(
                cfg,
                b,
                make_algorithm(cfg),
                device_id=device_name(i),
                index=i,
                home_edge=home_edge(i, cfg),
                data=to_model_input(data.images[p]),
                labels=torch.from_numpy(data.labels[p]),
            )
            services.append((dev, b))
        stop = threading.Event()
        threads = [
            threading.Thread(
                target=b.run, args=(lambda: stop.is_set(),), kwargs={"timeout_s": 180}, daemon=True
            )
            for _, b in services[1:]
        ]
        for svc, _ in services:
            svc.start()  # type: ignore[attr-defined]
        for t in threads:
            t.start()
        assert cbus.run(lambda: cloud.done, timeout_s=180), "cloud did not finish"
        stop.set()
        for t in threads:
            t.join(10)
        return cloud.model_sha, traffic
    finally:
        for b in buses:
            b.close()


FEDPHD = {
    "run": {"name": "agree-phd", "rounds": 2},
    "federation": {"num_devices": 4, "num_edges": 2, "assignment": "select"},
    "algorithm": {"name": "fedphd", "a": 200.0, "sparse_rounds": 1, "lambda0": 1e-3},
}


PRISM = {
    "run": {"name": "agree-prism", "rounds": 2},
    "federation": {"num_devices": 4, "num_edges": 2},
    "algorithm": {"name": "prism", "prism_local_iters": 2},
}


#: pFedGPA: edges forward each upload, the cloud trains its diffusion model after round 1 and
#: sends each device its own classifier on its private downlink for round 2
PFEDGPA = {
    "run": {"name": "agree-pfedgpa", "rounds": 3},
    "federation": {"num_devices": 4, "num_edges": 2},
    "data": {"synthetic_size": 2000, "partition": "dominant_groups", "samples_per_device": 100},
    "model": {"preset": "fmnist-cnn"},
    "train": {"optimizer": "sgd", "lr": 0.05, "batch_size": 50, "local_epochs": 1,
              "local_steps": 0, "grad_clip": 0.0},
    "algorithm": {"name": "pfedgpa", "pfedgpa_store_rounds": 2, "pfedgpa_ae_steps": 10,
                  "pfedgpa_dm_steps": 10, "pfedgpa_timesteps": 20, "pfedgpa_invert_from": 4,
                  "pfedgpa_batch": 8, "pfedgpa_denoiser_width": 8},
}  # fmt: skip


@pytest.mark.parametrize(
    "overrides",
    [{"run": {"name": "agree", "rounds": 2}, "federation": {"num_devices": 4, "num_edges": 2}},
     FEDPHD, PRISM, PFEDGPA],
    ids=["fedavg-static", "fedphd-select", "prism-bits", "pfedgpa-personal"],
)  # fmt: skip
def test_mqtt_and_memory_bus_agree(broker: LocalBroker, overrides: dict) -> None:  # type: ignore[type-arg]
    """Same config and seed: identical final model, message counts and blob bytes (FedAvg on
    home edges, FedPhD with devices choosing their edges in participant order, pFedGPA with
    each device's own model on its private downlink)."""
    train = {"threads": 1, **overrides.get("train", {})}
    cfg = tiny_config(**{**overrides, "train": train})
    mem = MemoryBus()
    data = load_dataset("synthetic", size=cfg.data.synthetic_size, seed=cfg.run.seed)
    parts = make_partition(data.labels, cfg.federation.num_devices, cfg.data, cfg.run.seed)
    fed = build_federation(cfg, mem, data, parts)
    fed.start()
    assert mem.run(lambda: fed.cloud.done)

    sha, traffic = _run_over_mqtt(cfg, broker)
    assert sha == fed.cloud.model_sha  # bitwise: same aggregation order on both buses

    m, q = mem.traffic.snapshot(), traffic.snapshot()
    if overrides is PFEDGPA:
        # In the personal round no device fetches its edge's model (the global one, put by
        # the edge as "edge_model"): MemoryBus's one store holds those bytes once, put by the
        # cloud too, and counts the edge's fetch of the global under the later put's kind.
        for snap in (m, q):
            for counts in (snap["messages"], snap["bytes"]):
                counts.pop("sent:edge_model", None)
    # the devices follow the cloud's state (they register again while it waits); whether
    # its last one, "done", reaches them before either run stops them is timing: not compared.
    # Nor are the registrations: a device repeats its hello when the cloud still waits
    # REANNOUNCE_FIRST_S after it first did, which a loaded machine can make happen
    assert m["messages"]["sent:msg_hello"] == cfg.federation.num_devices
    assert q["messages"]["sent:msg_hello"] >= cfg.federation.num_devices
    for snap in (m, q):
        for counts in (snap["messages"], snap["bytes"]):
            for key in ("received:msg_cloud_state", "sent:msg_hello", "received:msg_hello"):
                counts.pop(key, None)
    assert q["messages"] == m["messages"]
    assert q["rejected"] == m["rejected"] == {}
    for key, nbytes in m["bytes"].items():
        kind = key.split(":", 1)[1]
        if kind in TIMING_KINDS:  # durations are floats whose JSON length varies by a few bytes
            assert abs(q["bytes"][key] - nbytes) <= 16 * m["messages"][key], key
        else:
            assert q["bytes"][key] == nbytes, key
    transport = traffic.transport()
    assert transport["blobs_fetched"] > 0 and transport["wire_bytes_sent"] > 0


def test_blob_roundtrip_resume_and_fanout(broker: LocalBroker) -> None:
    """Chunked transfer of a 5.5-chunk blob; lost chunks are asked for again; two receivers
    fetching at once share the sender's stream (at most 2 x count chunks sent for them). The
    two ask again only after 10 s of silence, so a slow machine adds no second asking."""
    traffic = Traffic()
    cs = 64 * 1024
    sender = _bus(broker, "blob", "cloud", "cloud", traffic, chunk_bytes=cs, chunk_timeout_s=1)
    receivers = [
        _bus(broker, "blob", "edge", f"e{i}", Traffic(), chunk_bytes=cs, chunk_timeout_s=t)
        for i, t in enumerate((1, 10, 10))
    ]
    try:
        data = os.urandom(cs * 5 + cs // 2)
        sha = sender.endpoint("cloud", "cloud").put_blob(data, kind="x")
        n = chunk_count(len(data), cs)

        # drop the first two chunks the first receiver sees: it must ask again and finish
        r0 = receivers[0]
        original = r0._blob_fetcher.route_chunk
        dropped: list[str] = []

        def lossy(topic: str, payload: bytes) -> None:
            if len(dropped) < 2:
                dropped.append(topic)
                return
            original(topic, payload)

        r0._blob_fetcher.route_chunk = lossy  # type: ignore[method-assign]
        got = r0.endpoint("e0", "edge/e0").get_blob(sha, len(data), kind="x", src="cloud")
        assert got == data
        assert r0.traffic.transport()["chunks_rerequested"] >= 2

        # fan-out: the other two fetch concurrently, once the first's chunks are all out (its
        # asking again may have queued some the sender still sends)
        sent_before, deadline = -1.0, time.monotonic() + 10
        while traffic.transport()["chunks_sent"] != sent_before and time.monotonic() < deadline:
            sent_before = traffic.transport()["chunks_sent"]
            time.sleep(0.5)
        results: dict[int, Blob] = {}

        def fetch(i: int) -> None:
            ep = receivers[i].endpoint(f"e{i}", f"edge/e{i}")
            results[i] = ep.get_blob(sha, len(data), kind="x", src="cloud")

        threads = [threading.Thread(target=fetch, args=(i,)) for i in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == {1: data, 2: data}
        assert traffic.transport()["chunks_sent"] - sent_before <= 2 * n

        # a second fetch is served from the receiver's cache
        ep = receivers[1].endpoint("e1", "edge/e1")
        assert ep.get_blob(sha, len(data), kind="x", src="cloud") == data
        assert receivers[1].traffic.transport()["blob_cache_hits"] == 1
    finally:
        for b in [sender, *receivers]:
            b.close()


def test_a_large_blob_is_received_into_a_file_and_mapped(
    broker: LocalBroker, tmp_path: Path
) -> None:
    """A blob the receiver's store would spill arrives in a staged file, never whole in
    memory: the fetch returns a map of it (the same bytes); the file of an uncached fetch is
    kept once its map goes and the next fetch is written over it, a kept blob's file becomes
    the disk copy (renamed, not copied) that the receiver then serves from, and a blob whose
    bytes are not the ones asked for leaves nothing behind."""
    cs = 64 * 1024
    sender = _bus(broker, "recv", "cloud", "cloud", Traffic(), chunk_bytes=cs)
    store = BlobStore(tmp_path / "edge", spill_bytes=4 * cs)
    receiver = MqttBus(
        BrokerSection(port=broker.port, chunk_bytes=cs, chunk_timeout_s=1),
        run="recv", client_id="recv-e0", home="edge/e0", traffic=Traffic(), store=store,
    ).connect()  # fmt: skip
    staged = tmp_path / "edge" / blobs.STAGING_DIR
    try:
        big, other, small = os.urandom(cs * 6 + 100), os.urandom(cs * 5), os.urandom(cs)
        put = sender.endpoint("cloud", "cloud").put_blob
        sha, sha_other, sha_small = put(big, kind="x"), put(other, kind="x"), put(small, kind="x")
        ep = receiver.endpoint("e0", "edge/e0")

        got = ep.get_blob(sha_other, len(other), kind="x", src="cloud", cache=False)
        assert isinstance(got, MappedBlob) and got[:] == other and got.sha256 == sha_other
        assert not store.has(sha_other) and len(list(staged.iterdir())) == 1
        (first,) = staged.iterdir()
        del got
        gc.collect()
        # an uncached blob's file stays, to write the next one over
        assert [p.stat().st_size for p in staged.iterdir()] == [len(other)]

        small_got = ep.get_blob(sha_small, len(small), kind="x", src="cloud", cache=False)
        assert isinstance(small_got, bytes) and small_got == small  # below the spill size

        got = ep.get_blob(sha, len(big), kind="x", src="cloud", cache=False)
        assert isinstance(got, MappedBlob) and got.path == first  # written over the kept file
        ep.keep_blob(got, sha, kind="x")  # validated: kept, its file renamed into the store
        assert not list(staged.iterdir()) and sha not in store._mem
        assert (tmp_path / "edge" / sha[:2] / sha).read_bytes() == big
        assert store.chunk(sha, 1, cs) == big[cs : 2 * cs]
        again = store.get(sha)  # from disk: mapped, not read whole
        assert isinstance(again, MappedBlob) and again[:] == big
        del got, again
        gc.collect()
        assert (tmp_path / "edge" / sha[:2] / sha).is_file()  # the store's copy stays

        # a sender whose blob is not what the hash names: refused, and no file stays
        lie = os.urandom(len(big))
        fake = "0" * 64
        sender.store.put(lie, fake)
        with pytest.raises((CodecError, TransportError)):
            ep.get_blob(fake, len(lie), kind="x", src="cloud", cache=False, timeout_s=10)
        assert not store.has(fake) and not list(staged.iterdir())
    finally:
        receiver.close()
        sender.close()


def test_blob_limits_and_missing(broker: LocalBroker) -> None:
    """Oversized blobs are refused before any byte moves; an unknown hash fails fast."""
    sender = _bus(broker, "lim", "cloud", "cloud", Traffic())
    small = _bus(broker, "lim", "edge", "e0", Traffic(), max_blob_bytes=1000, chunk_timeout_s=1)
    try:
        data = np.arange(1000, dtype=np.float32).tobytes()
        sha = sender.endpoint("cloud", "cloud").put_blob(data, kind="x")
        ep = small.endpoint("e0", "edge/e0")
        with pytest.raises(TransportError) as err:
            ep.get_blob(sha, len(data), kind="x", src="cloud")
        assert err.value.reason == "blob_too_large"
        with pytest.raises(TransportError, match="does not have"):
            ep.get_blob("ab" * 32, 10, kind="x", src="cloud", timeout_s=10)
        with pytest.raises(TransportError) as err:
            small.endpoint("e0", "edge/e0").put_blob(data, kind="x")
        assert err.value.reason == "blob_too_large"
    finally:
        sender.close()
        small.close()


def test_connect_timeout_names_the_broker() -> None:
    """No broker on the port: a bounded wait and an error that says where it looked."""
    from shared.transport.local_broker import free_port

    port = free_port()
    bus = MqttBus(
        BrokerSection(port=port, connect_timeout_s=1.0), run="x", client_id="x", home="cloud"
    )
    with pytest.raises(TransportError, match=f"127.0.0.1:{port}"):
        bus.connect()
