"""Hardened deployments: a replayed older deployment, validly signed as it is, cannot replace
a newer one on a device (also after the device restarts), and a deployment whose blob source
never answers does not stop the device from answering its other messages meanwhile."""

from __future__ import annotations

import hashlib
import json
import queue
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloud.deploy import DeploymentPublisher, PublisherService
from device_agent.deployment import DEPLOY_SOURCE, SamplingAgent
from shared.config import RunConfig, config_from_dict
from shared.deploy.export import export_module, to_onnx
from shared.deploy.signing import (
    NOT_NEWER,
    DeploymentVersion,
    check_manifest,
    generate_keys,
    key_id,
    load_private_key,
    make_manifest,
    manifest_digest,
    new_version,
    refuse_older,
    sign_manifest,
    verify_manifest,
    version_of,
    write_signed,
)
from shared.errors import SignatureError, TransportError
from shared.models.presets import build_unet
from shared.transport.bus import MemoryBus
from shared.transport.local_broker import LocalBroker, find_mosquitto
from shared.transport.mqtt import MqttBus
from shared.wire.codec import Blob
from shared.wire.messages import Deployment, DeploymentReport, SampleRequest, decode, encode
from tests.mqtt_probe import close, connect

# its module-scoped fixtures are built once: every test of the module on one pytest worker
pytestmark = pytest.mark.xdist_group("deploy_hardening")

RUN = "dep"
CARD: dict[str, Any] = {
    "name": "tiny",
    "params": 1,
    "image_shape": [1, 32, 32],
    "num_classes": 0,
    "scheduler": {"num_train_timesteps": 1000, "steps_offset": 0},
}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return generate_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def models() -> list[bytes]:
    """Three different ONNX models of fmnist-tiny (untrained: only loading and sampling
    matter here)."""
    return [to_onnx(build_unet("fmnist-tiny", seed=s)) for s in range(3)]


def _export(
    out: Path, onnx: bytes, key: Ed25519PrivateKey, version: DeploymentVersion | None,
    run: str = RUN,
) -> Path:  # fmt: skip
    """A signed deployment directory of ``onnx`` with ``version`` (None: none, as exported
    before manifests had versions)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "model.onnx").write_bytes(onnx)
    card = {**CARD, "source": {"run": run}}
    manifest = make_manifest(hashlib.sha256(onnx).hexdigest(), len(onnx), card, version=version)
    if version is None:
        del manifest["version"]
    text, signature = sign_manifest(manifest, key)
    write_signed(out, text, signature, key_id(key.public_key()))
    return out


def _config(keys: tuple[Path, Path], **deploy: Any) -> RunConfig:
    return config_from_dict({
        "run": {"name": RUN},
        "broker": {"fetch_timeout_s": 60},
        "deploy": {"verify_key": str(keys[1]), "grid_size": 2, "sample_steps": 2, **deploy},
    })  # fmt: skip


class Federation:
    """A cloud that publishes deployments and a sampling device, over ``bus``; the device's
    latest deployment report as the cloud hears it."""

    def __init__(self, cfg: RunConfig, keys: tuple[Path, Path], bus: MemoryBus, out: Path) -> None:
        self.bus = bus
        self.cloud = PublisherService("cloud", cfg, bus)
        self.publisher = DeploymentPublisher(self.cloud, load_private_key(keys[0]))
        self.agent = SamplingAgent(cfg, bus, device_id="dev000", out_dir=out)
        self.agent.start()

    def send(self, msg: Any) -> DeploymentReport:
        """Publish ``msg`` (a deployment, retained, or a sample request) as the cloud would
        and return the device's next report."""
        self.publisher.reports.pop("dev000", None)
        topics = self.cloud.topics
        if isinstance(msg, Deployment):
            self.cloud.send(topics.cloud_deploy, msg, retain=True)
        else:
            self.cloud.send(topics.cloud_sample, msg)
        assert self.bus.run(lambda: "dev000" in self.publisher.reports)
        return self.publisher.reports["dev000"]

    def deploy(self, msg: Deployment) -> DeploymentReport:
        """:meth:`send` a deployment; once it is loaded, wait for its grid too."""
        report = self.send(msg)
        if report.event == "loaded":
            assert self.bus.run(lambda: self.publisher.reports["dev000"].event != "loaded")
            report = self.publisher.reports["dev000"]
        return report

    def serving(self) -> str | None:
        served = self.agent.receiver.served
        return None if served is None else served.sha256

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.agent.metrics.registry.get_sample_value(name, labels or {})


def _not_newer(fed: Federation) -> float | None:
    return fed.metric("estuary_rejected_messages_total", {"role": "device", "reason": NOT_NEWER})


# -- versions -----------------------------------------------------------------------------


def test_version_rule_and_manifest_checks() -> None:
    v = new_version(RUN)
    assert v.run == RUN and v.serial > 1_600_000_000_000  # milliseconds since the epoch
    assert new_version(RUN, after=v.serial + 10**9).serial == v.serial + 10**9 + 1  # clock back
    manifest = make_manifest("ab" * 32, 10, {"source": {"run": RUN}}, version=v)
    check_manifest(manifest)
    assert version_of(manifest) == v
    digest = manifest_digest(manifest)
    assert refuse_older(v, digest, None) is None
    assert refuse_older(v, digest, (v.serial, digest)) is None  # the same deployment again
    assert refuse_older(v, digest, (v.serial - 1, "x")) is None  # newer
    assert "not newer" in str(refuse_older(v, digest, (v.serial + 1, "x")))  # older
    assert refuse_older(v, digest, (v.serial, "x")) is not None  # same serial, other manifest
    legacy = {k: val for k, val in manifest.items() if k != "version"}
    assert version_of(legacy) == DeploymentVersion(RUN, 0)
    assert refuse_older(DeploymentVersion(RUN, 0), "y", (v.serial, digest)) is not None
    assert refuse_older(v, digest, (0, "y")) is None  # after an unversioned deployment
    for bad in ({"run": RUN}, {"run": 5, "serial": 1}, {"run": RUN, "serial": 0},
                {"run": RUN, "serial": True}, {"run": RUN, "serial": 2**60},
                {"run": RUN, "serial": 1, "extra": 1}, [RUN, 1]):  # fmt: skip
        with pytest.raises(SignatureError, match="version") as err:
            check_manifest({**manifest, "version": bad})
        assert err.value.reason == "bad_manifest"


def test_exports_number_after_the_deployment_they_replace(
    keys: tuple[Path, Path], tmp_path: Path
) -> None:
    """The cloud exports into its run directory: its next export is numbered after the
    manifest there even when its clock went back (a restored machine, a resumed cloud)."""
    cfg = config_from_dict({"run": {"name": RUN}})
    key = load_private_key(keys[0])
    unet = build_unet("fmnist-tiny", seed=0)
    out = tmp_path / "deploy"

    def export() -> dict[str, Any]:
        result = export_module(cfg, unet, None, out, round_=1, source="test", threshold=1.0,
                               parity_steps=2, signing_key=key)  # fmt: skip
        manifest = json.loads((out / "manifest.json").read_text())
        assert result.to_dict()["version"] == manifest["version"]
        return manifest

    first = export()
    assert first["version"]["run"] == RUN
    # the manifest in place says a serial far in the future of this clock
    ahead = {**first, "version": {"run": RUN, "serial": first["version"]["serial"] + 10**9}}
    text, signature = sign_manifest(ahead, key)
    write_signed(out, text, signature, key_id(key.public_key()))
    assert export()["version"]["serial"] == ahead["version"]["serial"] + 1


def test_publisher_versions_an_export_made_before_versions(
    keys: tuple[Path, Path], models: list[bytes], tmp_path: Path
) -> None:
    key = load_private_key(keys[0])
    d = _export(tmp_path / "old", models[0], key, None)
    assert "version" not in json.loads((d / "manifest.json").read_text())
    cfg = _config(keys)
    publisher = DeploymentPublisher(PublisherService("cloud", cfg, MemoryBus()), key)
    msg = publisher.prepare(d)
    manifest = verify_manifest(msg.manifest, msg.signature, key.public_key())
    assert manifest["version"]["run"] == RUN and manifest["version"]["serial"] > 0


# -- defect A: replayed older deployments ---------------------------------------------------


def test_a_replayed_older_deployment_is_refused_also_after_a_restart(
    keys: tuple[Path, Path], models: list[bytes], tmp_path: Path
) -> None:
    key = load_private_key(keys[0])
    cfg = _config(keys)
    fed = Federation(cfg, keys, MemoryBus(), tmp_path / "dev000")
    v1, v2 = (fed.publisher.prepare(_export(tmp_path / f"v{i}", models[i - 1], key,
                                            DeploymentVersion(RUN, 1000 * i)))
              for i in (1, 2))  # fmt: skip
    assert fed.deploy(v1).event == "sampled" and fed.serving() == v1.model_ref.sha256
    assert fed.deploy(v2).event == "sampled" and fed.serving() == v2.model_ref.sha256
    assert fed.metric("estuary_deployment_version") == 2000
    assert not _not_newer(fed)

    # the older deployment replayed as it was published, then with every unsigned field
    # changed: refused, counted, reported; the newer model stays in service
    replays = [
        v1,
        v1.model_copy(update={"key_id": "0" * 16}),
        v1.model_copy(update={"model_ref": v1.model_ref.model_copy(update={"src": "edge/e9"})}),
    ]
    for n, replay in enumerate(replays, start=1):
        report = fed.send(replay)
        assert report.event == "refused" and report.reason.startswith(NOT_NEWER), report.reason
        assert report.model_sha256 == v1.model_ref.sha256
        assert report.serving == v2.model_ref.sha256 == fed.serving()
        assert _not_newer(fed) == n
    assert fed.metric("estuary_deployments_total", {"outcome": "refused"}) == len(replays)
    assert fed.metric("estuary_deployment_version") == 2000

    # an export of the same run made before versions existed is older than any version
    legacy = json.loads(v1.manifest)
    del legacy["version"]
    text, signature = sign_manifest(legacy, key)
    report = fed.send(v1.model_copy(update={"manifest": text, "signature": signature}))
    assert report.event == "refused" and report.reason.startswith(NOT_NEWER)

    # a version cannot be raised without the key
    forged = v1.manifest.replace('"serial":1000', '"serial":9000')
    assert forged != v1.manifest
    report = fed.send(v1.model_copy(update={"manifest": forged}))
    assert report.event == "refused" and report.reason.startswith("bad_signature")

    # the device restarts with the same directory: the replay is still refused, and the
    # deployment it served is loaded again
    fed = Federation(cfg, keys, MemoryBus(), tmp_path / "dev000")
    fed.publisher.prepare(tmp_path / "v1")  # the blobs on the new bus
    fed.publisher.prepare(tmp_path / "v2")
    assert fed.agent.receiver.last_served[RUN][0] == 2000
    report = fed.send(v1)
    assert report.event == "refused" and report.reason.startswith(NOT_NEWER)
    assert fed.serving() is None
    assert fed.deploy(v2).event == "sampled" and fed.serving() == v2.model_ref.sha256

    # another run's deployment is judged on its own (as before versions), and serving it
    # does not open the door to this run's older deployments
    other = fed.publisher.prepare(
        _export(tmp_path / "other", models[2], key, DeploymentVersion("other-run", 1))
    )
    assert fed.deploy(other).event == "sampled" and fed.serving() == other.model_ref.sha256
    report = fed.send(v1)
    assert report.event == "refused" and report.reason.startswith(NOT_NEWER)
    assert fed.deploy(v2).event == "sampled" and fed.serving() == v2.model_ref.sha256
    assert fed.bus.traffic.snapshot()["rejected"] == {f"device:{NOT_NEWER}": 2}


# -- defect B: a blob source that never answers ------------------------------------------------


class StallingBus(MemoryBus):
    """A MemoryBus on which nobody answers requests for the blobs in ``stalled``: a fetch
    waits out its timeout (wall clock, on the fetching thread) and fails as an MqttBus fetch
    does. Records the source every fetch asked."""

    def __init__(self) -> None:
        super().__init__()
        self.stalled: set[str] = set()
        self.sources: list[str | None] = []
        self.fetch_threads: set[str] = set()

    def _get_blob(
        self,
        sha256: str,
        size: int,
        timeout_s: float,
        src: str | None,
        requester: str,
        *,
        cache: bool = True,
        stall_s: float | None = None,
    ) -> Blob:
        self.sources.append(src)
        if sha256 in self.stalled:
            self.fetch_threads.add(threading.current_thread().name)
            time.sleep(timeout_s)
            raise TransportError(f"blob {sha256[:12]}… from {src}: no chunk before the "
                                 "fetch timeout", reason="timeout")  # fmt: skip
        return super()._get_blob(
            sha256, size, timeout_s, src, requester, cache=cache, stall_s=stall_s
        )


def test_a_stalled_blob_source_does_not_stop_the_device(
    keys: tuple[Path, Path], models: list[bytes], tmp_path: Path
) -> None:
    """A signed deployment whose blob never comes: the device keeps answering sample
    requests from the model in service meanwhile, gives up after ``deploy.fetch_timeout_s``
    (not the transport's 60 s), fetches from the cloud whatever the unsigned ``src`` says,
    and then serves the newer deployment that arrived while it waited."""
    key = load_private_key(keys[0])
    cfg = _config(keys, fetch_timeout_s=2.0)
    bus = StallingBus()
    fed = Federation(cfg, keys, bus, tmp_path / "dev000")
    v1, v2, v3 = (fed.publisher.prepare(_export(tmp_path / f"v{i}", models[i - 1], key,
                                                DeploymentVersion(RUN, 1000 * i)))
                  for i in (1, 2, 3))  # fmt: skip
    assert fed.deploy(v1).event == "sampled"
    bus.stalled.add(v2.model_ref.sha256)
    bus.sources.clear()
    stalled = v2.model_copy(update={"model_ref": v2.model_ref.model_copy(
        update={"src": "device/dev666"})})  # fmt: skip
    fed.cloud.send(fed.cloud.topics.cloud_deploy, stalled, retain=True)
    fed.cloud.send(fed.cloud.topics.cloud_deploy, v3, retain=True)  # waits for its turn

    start = time.monotonic()
    report = fed.send(SampleRequest(request_id="while-fetching", n=1, steps=1))
    answered = time.monotonic() - start
    assert answered < 1.5, f"the sample request waited {answered:.1f}s"
    assert report.event == "sampled" and report.request_id == "while-fetching"
    assert report.serving == v1.model_ref.sha256
    receiver = fed.agent.receiver
    assert receiver.job is not None and receiver.job.item.sha256 == v2.model_ref.sha256
    assert [w.sha256 for w in receiver.waiting] == [v3.model_ref.sha256]
    assert bus.fetch_threads and threading.current_thread().name not in bus.fetch_threads

    # the stalled deployment is refused at the deploy timeout; the waiting one is served
    assert bus.run(lambda: fed.publisher.reports["dev000"].model_sha256 == v2.model_ref.sha256)
    refused = fed.publisher.reports["dev000"]
    gave_up = time.monotonic() - start
    assert refused.event == "refused" and refused.reason.startswith("timeout")
    assert 1.5 < gave_up < 10, f"gave up after {gave_up:.1f}s"
    assert bus.run(lambda: fed.serving() == v3.model_ref.sha256)
    assert bus.run(lambda: fed.publisher.reports["dev000"].event == "sampled")
    assert set(bus.sources) == {DEPLOY_SOURCE}  # never the unsigned "device/dev666"
    assert bus.traffic.transport()["deploy_source_ignored"] == 1
    assert bus.traffic.snapshot()["rejected"] == {"device:timeout": 1}


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
def test_a_stalled_blob_source_over_mqtt(
    keys: tuple[Path, Path], models: list[bytes], tmp_path: Path
) -> None:
    """The same over a real broker: the cloud is gone when its deployment arrives, so no
    chunk ever comes; the device answers a sample request within a second or two and
    refuses the deployment after ``deploy.fetch_timeout_s``."""
    key = load_private_key(keys[0])
    broker = LocalBroker(kind="mosquitto", workdir=tmp_path / "broker").start()
    cfg = config_from_dict({
        "run": {"name": RUN},
        "broker": {"host": broker.host, "port": broker.port, "fetch_timeout_s": 60,
                   "chunk_timeout_s": 1},
        "deploy": {"verify_key": str(keys[1]), "fetch_timeout_s": 2.0},
    })  # fmt: skip
    bus = MqttBus(cfg.broker, run=RUN, client_id=f"{RUN}-dev000", home="device/dev000")
    agent = SamplingAgent(cfg, bus.connect(), device_id="dev000", out_dir=tmp_path / "dev000")
    stop = threading.Event()
    device = threading.Thread(target=bus.run, args=(stop.is_set,), kwargs={"timeout_s": 60})
    probe, code = connect(broker.host, broker.port, None, None)
    assert code == 0
    reports: queue.Queue[DeploymentReport] = queue.Queue()
    probe.on_message = lambda c, u, m: reports.put(decode(bytes(m.payload), DeploymentReport))
    try:
        agent.start()
        device.start()
        probe.subscribe(agent.topics.device_deploy("dev000"), qos=1)
        time.sleep(0.3)
        # signed by the cloud, but the cloud that would serve its blob is gone
        publisher = DeploymentPublisher(PublisherService("cloud", cfg, MemoryBus()), key)
        msg = publisher.prepare(_export(tmp_path / "v1", models[0], key, new_version(RUN)))
        probe.publish(agent.topics.cloud_deploy, encode(msg), qos=1, retain=True)
        time.sleep(0.3)
        start = time.monotonic()
        request = SampleRequest(request_id="while-fetching", n=1, steps=1)
        probe.publish(agent.topics.cloud_sample, encode(request), qos=1)
        report = reports.get(timeout=30)
        answered = time.monotonic() - start
        assert report.request_id == "while-fetching", report
        assert report.event == "refused" and report.reason.startswith("no_model")
        assert answered < 1.5, f"the sample request waited {answered:.1f}s"
        report = reports.get(timeout=30)
        gave_up = time.monotonic() - start
        assert report.event == "refused" and report.reason.startswith("timeout"), report
        assert report.model_sha256 == msg.model_ref.sha256 and gave_up < 10
    finally:
        stop.set()
        device.join(timeout=10)
        close(probe)
        bus.close(timeout_s=2.0)
        broker.stop()
