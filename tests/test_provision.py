"""``estuary provision`` on a real mosquitto: per-role passwords and ACLs are enforced by the
broker (a device cannot publish to the cloud's topics or read another device's updates), and
a whole federation, deployment included, runs with each process logged in as itself, and
`estuary deploy` runs as its own account beside the cloud."""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from cloud.deploy import DeploymentPublisher, PublisherService
from estuary.cli import main as cli_main
from estuary.launcher import Hierarchy
from estuary.provision import DEPLOYER, mosquitto_hash, provision
from shared.config import RunConfig
from shared.deploy.signing import (
    MODEL_BLOB_KIND,
    key_id,
    load_private_key,
    make_manifest,
    sign_manifest,
    write_signed,
)
from shared.errors import EstuaryError
from shared.runtime.process import connect_bus
from shared.transport.local_broker import LocalBroker, find_mosquitto
from shared.transport.mqtt import MqttBus
from shared.wire.messages import (
    DEPLOYER_HOME,
    Deployment,
    DeploymentReport,
    Presence,
    Topics,
    decode,
    encode,
)
from tests.conftest import tiny_config
from tests.mqtt_probe import close, connect, inbox, login, received

needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
BASE = "estuary/v1/acl"


def _login(broker: LocalBroker, out: Path, user: str) -> mqtt.Client:
    password = (out / "credentials" / f"{user}.password").read_text()
    return login(broker.host, broker.port, user, password)


def test_mosquitto_hash_format() -> None:
    h = mosquitto_hash("secret", salt=b"0123456789ab")
    kind, iters, salt, digest = h.split("$")[1:]
    assert (kind, iters, salt) == ("7", "101", "MDEyMzQ1Njc4OWFi") and len(digest) == 88


@needs_mosquitto
def test_broker_refuses_anonymous_and_wrong_passwords(secured: tuple[LocalBroker, Path]) -> None:
    broker, _ = secured
    for user, password in ((None, None), ("dev000", "wrong"), ("nobody", "x")):
        c, code = connect(broker.host, broker.port, user, password)
        close(c)
        assert code != 0, f"{user} logged in with {password!r}"


@needs_mosquitto
def test_acl_device_cannot_write_cloud_or_read_other_devices(
    secured: tuple[LocalBroker, Path],
) -> None:
    broker, out = secured
    cloud, edge0 = _login(broker, out, "cloud"), _login(broker, out, "edge0")
    dev0, dev1 = _login(broker, out, "dev000"), _login(broker, out, "dev001")
    at_cloud = inbox(cloud, f"{BASE}/#")
    at_dev1 = inbox(dev1, f"{BASE}/device/dev000/up", f"{BASE}/device/+/up",
                     f"{BASE}/device/+/join", f"{BASE}/device/dev000/blob/#")  # fmt: skip
    at_dev0 = inbox(dev0, f"{BASE}/+/+/want/device/dev000", f"{BASE}/edge/+/round")
    for topic in (f"{BASE}/cloud/round", f"{BASE}/cloud/deploy", f"{BASE}/edge/edge0/round",
                  f"{BASE}/device/dev001/up", f"{BASE}/device/dev000/up",
                  f"{BASE}/device/dev000/join", f"{BASE}/device/dev000/blob/ab/1/0"):  # fmt: skip
        dev0.publish(topic, b"{}", qos=1)
    edge0.publish(f"{BASE}/edge/edge0/want/device/dev000", b"{}", qos=1)
    edge0.publish(f"{BASE}/edge/edge0/round", b"{}", qos=1)
    edge0.publish(f"{BASE}/edge/edge1/round", b"{}", qos=1)  # not its own subtree
    edge0.publish(f"{BASE}/cloud/state", b"{}", qos=1)
    got_cloud = received(at_cloud)
    # only what each sender may write reached the cloud, which reads everything
    assert got_cloud == {
        f"{BASE}/device/dev000/up", f"{BASE}/device/dev000/join",
        f"{BASE}/device/dev000/blob/ab/1/0", f"{BASE}/edge/edge0/want/device/dev000",
        f"{BASE}/edge/edge0/round",
    }  # fmt: skip
    # another device sees dev000's edge choice, never its update or its blobs
    assert received(at_dev1) == {f"{BASE}/device/dev000/join"}
    # dev000 gets requests for its own blobs and its edge's announcement
    assert received(at_dev0, 0.3) == {f"{BASE}/edge/edge0/want/device/dev000",
                                       f"{BASE}/edge/edge0/round"}  # fmt: skip
    close(cloud, edge0, dev0, dev1)


@needs_mosquitto
def test_acl_observer_reads_only_the_state_and_writes_nothing(
    secured: tuple[LocalBroker, Path],
) -> None:
    """The account of `estuary status` receives the retained state and presence topics, never
    updates, joins or blobs, and nothing it publishes reaches anyone."""
    broker, out = secured
    cloud, edge0 = _login(broker, out, "cloud"), _login(broker, out, "edge0")
    dev0, observer = _login(broker, out, "dev000"), _login(broker, out, "observer")
    at_observer, at_cloud = inbox(observer, f"{BASE}/#"), inbox(cloud, f"{BASE}/#")
    state = {f"{BASE}/cloud/state", f"{BASE}/cloud/status", f"{BASE}/cloud/deploy",
             f"{BASE}/edge/edge0/state", f"{BASE}/edge/edge0/status",
             f"{BASE}/device/dev000/hello", f"{BASE}/device/dev000/status",
             f"{BASE}/device/dev000/deploy"}  # fmt: skip
    private = {f"{BASE}/cloud/round", f"{BASE}/edge/edge0/round",
               f"{BASE}/edge/edge0/up", f"{BASE}/edge/edge0/blob/ab/1/0",
               f"{BASE}/device/dev000/up", f"{BASE}/device/dev000/join",
               f"{BASE}/device/dev000/blob/ab/1/0"}  # fmt: skip
    for topic in sorted(state | private):
        sender = cloud if "/cloud/" in topic else edge0 if "/edge/" in topic else dev0
        sender.publish(topic, b"{}", qos=1)
    assert received(at_observer) == state
    received(at_cloud)  # drain
    observer.publish(f"{BASE}/cloud/state", b"{}", qos=1)
    observer.publish(f"{BASE}/observer/status", b"{}", qos=1)
    assert received(at_cloud) == set()
    close(cloud, edge0, dev0, observer)


SHA = "ab" * 32  # a blob hash, for topics


def _export(out: Path, key: Path, size: int = 50_000) -> bytes:
    """A signed export as `estuary export` leaves it (random model bytes: nothing here loads
    the model); returns the model's bytes."""
    out.mkdir(parents=True)
    data = secrets.token_bytes(size)
    (out / "model.onnx").write_bytes(data)
    private = load_private_key(key)
    manifest = make_manifest(hashlib.sha256(data).hexdigest(), len(data),
                             {"name": "fake", "source": {"run": "acl"}})  # fmt: skip
    text, signature = sign_manifest(manifest, private)
    write_signed(out, text, signature, key_id(private.public_key()))
    return data


def _as(cfg: RunConfig, broker: LocalBroker, out: Path, user: str) -> RunConfig:
    """``cfg`` logging in to ``broker`` as ``user`` with its provisioned password (small
    chunks: a blob moves in several)."""
    settings = cfg.broker.model_copy(update={
        "host": broker.host, "port": broker.port, "username": user,
        "password_file": str(out / "credentials" / f"{user}.password"), "chunk_bytes": 4096,
    })  # fmt: skip
    return cfg.model_copy(update={"broker": settings})


@needs_mosquitto
def test_acl_deployer_publishes_deployments_and_nothing_else(
    secured: tuple[LocalBroker, Path], tmp_path: Path
) -> None:
    """The account of `estuary deploy` writes the deployment, sample requests and the chunks
    of the blobs it serves from its own subtree inside the cloud's, and reads the devices'
    presence and reports and the requests for its blobs: no other cloud topic (nor the
    cloud's blobs), no device's or edge's topic, no update, blob or private downlink. A
    device receives its deployment and fetches the model from it through the broker."""
    broker, out = secured
    cloud, edge0 = _login(broker, out, "cloud"), _login(broker, out, "edge0")
    dev0, deployer = _login(broker, out, "dev000"), _login(broker, out, DEPLOYER)
    at_cloud, at_dev0 = inbox(cloud, f"{BASE}/#"), inbox(dev0, f"{BASE}/cloud/#")
    at_deployer = inbox(deployer, f"{BASE}/#", f"{BASE}/device/dev000/down/#")
    may_write = {f"{BASE}/cloud/deploy", f"{BASE}/cloud/sample",
                 f"{BASE}/cloud/deployer/blob/{SHA}/4096/0"}  # fmt: skip
    may_not = {f"{BASE}/cloud/state", f"{BASE}/cloud/round", f"{BASE}/cloud/status",
               f"{BASE}/cloud/blob/{SHA}/4096/0",
               f"{BASE}/cloud/want/cloud", f"{BASE}/cloud/deploy/x",
               f"{BASE}/device/dev000/up", f"{BASE}/device/dev000/status",
               f"{BASE}/device/dev000/deploy", f"{BASE}/device/dev000/want/cloud",
               f"{BASE}/device/dev000/down", f"{BASE}/device/dev000/down/blob/{SHA}/4096/0",
               f"{BASE}/edge/edge0/round", f"{BASE}/edge/edge0/state",
               f"{BASE}/edge/edge0/want/cloud"}  # fmt: skip
    for topic in sorted(may_write | may_not):
        deployer.publish(topic, b"{}", qos=1)
    assert received(at_cloud) == may_write  # the cloud reads everything
    assert received(at_dev0, 0.3) == may_write
    # of what it writes it reads only the retained deployment (whose reports count)
    assert received(at_deployer, 0.1) == {f"{BASE}/cloud/deploy"}
    sent = {
        cloud: ["cloud/state", "cloud/round", "device/dev000/down",
                f"device/dev000/down/blob/{SHA}/4096/0"],
        dev0: ["device/dev000/hello", "device/dev000/up", "device/dev000/join",
               "device/dev000/status", "device/dev000/deploy", f"device/dev000/blob/{SHA}/4096/0",
               "device/dev000/want/cloud", "device/dev000/want/cloud/deployer",
               "device/dev000/want/device/dev000/down"],
        edge0: ["edge/edge0/state", "edge/edge0/up", f"edge/edge0/blob/{SHA}/4096/0",
                "edge/edge0/want/cloud", "edge/edge0/want/cloud/deployer",
                "edge/edge0/want/device/dev000"],
    }  # fmt: skip
    for sender, topics in sent.items():
        for topic in topics:
            sender.publish(f"{BASE}/{topic}", b"{}", qos=1)
    assert received(at_deployer) == {
        f"{BASE}/device/dev000/status", f"{BASE}/device/dev000/deploy",
        f"{BASE}/device/dev000/want/cloud/deployer",  # an edge never fetches a deployment
    }  # fmt: skip
    close(cloud, edge0, dev0, deployer)

    # a deployment as `estuary deploy` publishes it, and the device fetching its model
    cfg = tiny_config(run={"name": "acl"}, federation={"num_devices": 3, "num_edges": 2})
    model = _export(tmp_path / "export", out / "keys" / "deploy_ed25519.pem")
    buses: list[MqttBus] = []
    try:
        buses.append(connect_bus(_as(cfg, broker, out, DEPLOYER), "cloud", "cloud-deploy", None,
                                 will=False, home=DEPLOYER_HOME))  # fmt: skip
        buses.append(connect_bus(_as(cfg, broker, out, "dev000"), "device", "dev000", None))
        device = buses[1].endpoint("dev000", "device/dev000")
        got: list[Deployment] = []
        device.subscribe(f"{BASE}/cloud/deploy", lambda _t, p: got.append(decode(p, Deployment)),
                         kind="msg_deployment")  # fmt: skip
        key = load_private_key(out / "keys" / "deploy_ed25519.pem")
        publisher = DeploymentPublisher(
            PublisherService("cloud", cfg, buses[0], home=DEPLOYER_HOME), key
        )
        sent_msg = publisher.publish(tmp_path / "export")
        assert buses[1].run(lambda: bool(got), timeout_s=10)
        ref = got[0].model_ref
        assert ref.sha256 == sent_msg.model_ref.sha256 and ref.size == len(model)
        assert ref.src == DEPLOYER_HOME
        data = device.get_blob(ref.sha256, ref.size, kind=MODEL_BLOB_KIND, src=ref.src,
                               timeout_s=20)  # fmt: skip
        assert data == model
    finally:
        for bus in buses:
            bus.close()


def test_deploy_refuses_the_clouds_account(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Logged in as the cloud, `estuary deploy` would disconnect a running cloud (one account,
    one connection): it refuses before connecting, naming the deployer account."""
    cfg = tiny_config(run={"name": "acl"})
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    monkeypatch.setenv("ESTUARY__BROKER__USERNAME", "cloud")
    monkeypatch.setenv("ESTUARY__BROKER__CONNECT_TIMEOUT_S", "1")  # nothing listens there
    capsys.readouterr()
    argv = ["deploy", str(tmp_path / "export"), str(path), "--broker", "127.0.0.1:1",
            "--key", str(tmp_path / "none.pem"), "--wait-s", "0"]  # fmt: skip
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("estuary: error: ")
    assert "ESTUARY__BROKER__USERNAME=deployer" in err and "deployer.password" in err


@needs_mosquitto
def test_deploy_as_deployer_leaves_a_running_cloud_connected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With client ids bound to accounts, `estuary deploy` logged in as the deployer account
    publishes its deployment while the cloud (its own account and id, presence and last
    will) stays connected, and exits 0 once the online device reported on it."""
    cfg = tiny_config(run={"name": "acl"}, federation={"num_devices": 2, "num_edges": 1})
    out = tmp_path / "prov"
    provision(cfg, out)
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    key = out / "keys" / "deploy_ed25519.pem"
    _export(tmp_path / "export", key)
    broker = LocalBroker(kind="mosquitto", workdir=tmp_path / "broker",
                         password_file=out / "mosquitto" / "passwd",
                         acl_file=out / "mosquitto" / "acl").start()  # binds ids  # fmt: skip
    buses: list[MqttBus] = []
    stop = threading.Event()
    worker: threading.Thread | None = None
    try:
        buses.append(connect_bus(_as(cfg, broker, out, "cloud"), "cloud", "cloud", None))
        cloud = buses[0]
        buses.append(connect_bus(_as(cfg, broker, out, "dev000"), "device", "dev000", None))
        device, topics = buses[1].endpoint("dev000", "device/dev000"), Topics("acl")
        device.publish(topics.status("device/dev000"),
                       encode(Presence(name="dev000", role="device", online=True)),
                       kind="msg_presence", retain=True)  # fmt: skip

        def on_deploy(_topic: str, payload: bytes) -> None:
            # the model's transfer through this ACL is tested above; here the report only
            msg = decode(payload, Deployment)
            report = DeploymentReport(device="dev000", event="sampled", n=4, images_per_s=1.0,
                                      model_sha256=msg.model_ref.sha256,
                                      deployment=msg.ident)  # fmt: skip
            device.publish(topics.device_deploy("dev000"), encode(report),
                           kind="msg_deploy_report", retain=True)  # fmt: skip

        device.subscribe(topics.cloud_deploy, on_deploy, kind="msg_deployment")
        worker = threading.Thread(target=buses[1].run, args=(stop.is_set,),
                                  kwargs={"timeout_s": 90}, daemon=True)  # fmt: skip
        worker.start()
        monkeypatch.setenv("ESTUARY__BROKER__USERNAME", DEPLOYER)
        monkeypatch.setenv("ESTUARY__BROKER__PASSWORD_FILE",
                           str(out / "credentials" / f"{DEPLOYER}.password"))  # fmt: skip
        capsys.readouterr()
        argv = ["deploy", str(tmp_path / "export"), str(path), "--broker",
                f"{broker.host}:{broker.port}", "--key", str(key), "--wait-s", "30"]  # fmt: skip
        assert cli_main(argv) == 0, capsys.readouterr()
        assert "dev000:  sampled" in capsys.readouterr().out
        cloud.pump(0.5)
        assert cloud.connected and cloud.traffic.transport().get("disconnects", 0) == 0
    finally:
        stop.set()
        if worker is not None:
            worker.join(10)
        for bus in buses:
            bus.close()
        broker.stop()


@pytest.mark.process
@needs_mosquitto
@pytest.mark.parametrize("assignment", ["static", "select"])
def test_federation_runs_with_per_role_credentials(
    tmp_path: Path,
    assignment: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every process logs in as itself through the provisioned ACL; training and the signed
    deployment complete (a too-strict ACL would stall a round or the deployment), and the
    observer account reads the outcome."""
    cfg = tiny_config(
        run={"name": "acl", "rounds": 2},
        federation={"num_devices": 2, "num_edges": 2, "round_deadline_s": 60,
                    "assignment": assignment, "join_timeout_s": 30},
        train={"local_steps": 2, "batch_size": 8, "threads": 1},
    )  # fmt: skip
    prov = tmp_path / "prov"
    (tmp_path / "base.json").write_text(cfg.to_json())
    assert cli_main(["provision", str(tmp_path / "base.json"), "--out", str(prov)]) == 0
    keys = prov / "keys"
    cfg = cfg.model_copy(update={"deploy": cfg.deploy.model_copy(update={
        "signing_key": str(keys / "deploy_ed25519.pem"),
        "verify_key": str(keys / "deploy_ed25519.pub.pem"),
        "out_dir": str(tmp_path / "devices"), "grid_size": 2, "sample_steps": 2,
        "parity_steps": 3, "threads": 1})})  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    broker = LocalBroker(kind="mosquitto", workdir=tmp_path / "broker",
                         password_file=prov / "mosquitto" / "passwd",
                         acl_file=prov / "mosquitto" / "acl").start()  # fmt: skip
    hier = Hierarchy(cfg, path, tmp_path / "run", broker, evaluate=False, credentials=prov)
    try:
        hier.start_all()
        code = hier.wait("cloud", 240)
        assert code == 0, hier.procs["cloud"].log_tail(30)
        reports = json.loads((tmp_path / "run" / "deploy" / "reports.json").read_text())
        assert {d: r["event"] for d, r in reports.items()} == {"dev000": "sampled",
                                                                 "dev001": "sampled"}  # fmt: skip
        # `estuary status` as the read-only observer account sees the finished run
        password = (prov / "credentials" / "observer.password").read_text()
        monkeypatch.setenv("ESTUARY_MQTT_PASSWORD", password)
        monkeypatch.setenv("ESTUARY__BROKER__USERNAME", "observer")
        capsys.readouterr()
        argv = ["status", str(path), "--broker", f"{broker.host}:{broker.port}", "--json"]
        assert cli_main(argv) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["cloud"]["state"]["phase"] == "done" and doc["rejected"] == {}
        assert {d: v["deploy"]["event"] for d, v in doc["devices"].items()} == {
            "dev000": "sampled", "dev001": "sampled"}  # fmt: skip
    finally:
        hier.stop_all(timeout_s=10)
        broker.stop()


def test_provision_writes_a_broker_config_that_binds_client_ids(tmp_path: Path) -> None:
    """mosquitto/mosquitto.conf uses the provisioned password file and ACL, refuses anonymous
    clients and binds the client id to the user name on its one listener (plain, or TLS with
    the provisioned certificate); a kept provisioning made before it gets one."""
    cfg = tiny_config(run={"name": "conf"}, federation={"num_devices": 2, "num_edges": 1})
    for tls, out in ((None, tmp_path / "plain"), (["broker.example"], tmp_path / "tls")):
        info = provision(cfg, out, tls_hosts=tls)
        conf = out / "mosquitto" / "mosquitto.conf"
        assert info["broker_conf"] == str(conf)
        lines = [ln for ln in conf.read_text().splitlines() if ln and not ln.startswith("#")]
        listeners = [i for i, ln in enumerate(lines) if ln.startswith("listener ")]
        assert [lines[i] for i in listeners] == ["listener 8883" if tls else "listener 1883"]
        assert all(lines[i + 1] == "use_username_as_clientid true" for i in listeners)
        mq = out.resolve() / "mosquitto"
        for line in ("allow_anonymous false", f"password_file {mq / 'passwd'}",
                     f"acl_file {mq / 'acl'}", "max_packet_size 1120256",
                     "memory_limit 1073741824"):  # fmt: skip
            assert line in lines, line
        certs = {f"cafile {out.resolve() / 'tls' / 'ca.pem'}",
                 f"certfile {out.resolve() / 'tls' / 'server.pem'}",
                 f"keyfile {out.resolve() / 'tls' / 'server.key'}"}  # fmt: skip
        assert certs <= set(lines) if tls else not certs & set(lines)
    conf = tmp_path / "plain" / "mosquitto" / "mosquitto.conf"
    conf.unlink()  # what an older estuary left
    kept = provision(cfg, tmp_path / "plain", keep=True)
    assert kept["kept"] and "use_username_as_clientid true" in conf.read_text()


def test_provision_keep_reuses_matching_and_refuses_other_federations(tmp_path: Path) -> None:
    cfg = tiny_config(run={"name": "keep"}, federation={"num_devices": 2, "num_edges": 1})
    out = tmp_path / "prov"
    first = provision(cfg, out)
    password = (out / "credentials" / "dev001.password").read_text()
    with pytest.raises(EstuaryError, match="already provisioned"):
        provision(cfg, out)
    kept = provision(cfg, out, keep=True)  # what `docker compose up` does on every start
    assert kept["kept"] and kept["users"] == first["users"]
    assert (out / "credentials" / "dev001.password").read_text() == password
    bigger = tiny_config(run={"name": "keep"}, federation={"num_devices": 3, "num_edges": 1})
    with pytest.raises(EstuaryError, match="not for run 'keep'"):
        provision(bigger, out, keep=True)
    (out / "credentials" / "dev000.password").unlink()
    with pytest.raises(EstuaryError, match="missing dev000"):
        provision(cfg, out, keep=True)


def test_provision_keep_accepts_one_made_before_the_observer_account(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``docker compose up`` runs ``provision --keep`` on a volume an older estuary may have
    filled: without the observer account, it is kept as it is (with a warning)."""
    cfg = tiny_config(run={"name": "old"}, federation={"num_devices": 2, "num_edges": 1})
    out = tmp_path / "prov"
    first = provision(cfg, out)
    record = json.loads((out / "provision.json").read_text())
    record["users"] = [u for u in record["users"] if u != "observer"]
    (out / "provision.json").write_text(json.dumps(record))
    (out / "credentials" / "observer.password").unlink()
    kept = provision(cfg, out, keep=True)
    assert kept["kept"] and "observer" not in kept["users"] and first["run"] == kept["run"]
    assert "has no observer account" in caplog.text
    record["users"].append("dev002")  # anything else that differs is still refused
    (out / "provision.json").write_text(json.dumps(record))
    with pytest.raises(EstuaryError, match="pass --force"):
        provision(cfg, out, keep=True)


@pytest.mark.parametrize("lacking", [["deployer"], ["observer", "deployer"]])
def test_provision_keep_accepts_one_made_before_the_deployer_account(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, lacking: list[str]
) -> None:
    """A provisioning made before the deployer account (or before both tool accounts) is
    kept as it is, with a warning naming each missing account and what it is for."""
    cfg = tiny_config(run={"name": "old"}, federation={"num_devices": 2, "num_edges": 1})
    out = tmp_path / "prov"
    provision(cfg, out)
    record = json.loads((out / "provision.json").read_text())
    record["users"] = [u for u in record["users"] if u not in lacking]
    (out / "provision.json").write_text(json.dumps(record))
    for name in lacking:
        (out / "credentials" / f"{name}.password").unlink()
    with caplog.at_level("WARNING", logger="estuary.provision"):
        kept = provision(cfg, out, keep=True)
    assert kept["kept"] and kept["users"] == record["users"]
    for name in lacking:
        assert f"has no {name} account" in caplog.text
    assert "`estuary deploy`" in caplog.text
    assert ("`estuary status`" in caplog.text) == ("observer" in lacking)


def test_provision_keep_finishes_a_provisioning_killed_before_its_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """provision.json is moved in last, so a password file without it is a provisioning
    killed between the final moves: ``keep`` provisions again (it used to refuse, and every
    ``docker compose up`` after it failed) instead of reusing half of one."""
    cfg = tiny_config(run={"name": "killed"}, federation={"num_devices": 2, "num_edges": 1})
    out = tmp_path / "prov"
    provision(cfg, out)
    password = (out / "credentials" / "dev001.password").read_text()
    (out / "provision.json").unlink()  # what a SIGKILL before the last move leaves,
    stage = out / ".provisioning-killed"  # with its staging folder (old secrets in it)
    (stage / "credentials.replaced").mkdir(parents=True)
    (stage / "credentials.replaced" / "dev000.password").write_text("old secret")
    with pytest.raises(EstuaryError, match="already provisioned"):
        provision(cfg, out)  # without keep, still refused
    with caplog.at_level("WARNING", logger="estuary.provision"):
        info = provision(cfg, out, keep=True)
    assert "never finished" in caplog.text and not info.get("kept")
    assert not stage.exists() and "left by a provisioning that was killed" in caplog.text
    assert (out / "provision.json").is_file()
    assert (out / "credentials" / "dev001.password").read_text() != password
    assert sorted(p.name for p in out.iterdir()) == [
        "credentials", "keys", "mosquitto", "provision.json",
    ]  # fmt: skip
    assert provision(cfg, out, keep=True)["kept"]
    (out / "provision.json").write_text("{torn")  # present but unreadable: still refused
    with pytest.raises(EstuaryError, match=r"no readable provision\.json"):
        provision(cfg, out, keep=True)


def test_provision_is_all_or_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure part-way (here: the TLS step) leaves the earlier provisioning as it was, or
    none, never a password file without provision.json; existing keys are refused before
    anything is written; --force swaps every part in and leaves no staging folder."""
    import estuary.provision as prov
    from shared.deploy.signing import generate_keys

    cfg = tiny_config(run={"name": "atomic"}, federation={"num_devices": 2, "num_edges": 1})
    out = tmp_path / "prov"

    def broken_tls(stage: Path, hosts: list[str]) -> dict[str, str]:
        raise OSError("disk full")

    with monkeypatch.context() as mp:
        mp.setattr(prov, "_tls", broken_tls)
        with pytest.raises(OSError, match="disk full"):
            provision(cfg, out, tls_hosts=["broker"])
    assert list(out.iterdir()) == []

    keys_only = tmp_path / "keys_only"
    generate_keys(keys_only / "keys")
    with pytest.raises(EstuaryError, match="exists; pass --force"):
        provision(cfg, keys_only)
    assert sorted(p.name for p in keys_only.iterdir()) == ["keys"]

    provision(cfg, out)
    password = (out / "credentials" / "dev001.password").read_text()
    passwd = (out / "mosquitto" / "passwd").read_text()
    with monkeypatch.context() as mp:
        mp.setattr(prov, "_tls", broken_tls)
        with pytest.raises(OSError, match="disk full"):
            provision(cfg, out, tls_hosts=["broker"], force=True)
    assert (out / "credentials" / "dev001.password").read_text() == password
    assert (out / "mosquitto" / "passwd").read_text() == passwd
    real_rename = Path.rename

    def rename_fails_on_mosquitto(self: Path, target: Path) -> Path:
        if self.name == "mosquitto" and self.parent.name.startswith(".provisioning-"):
            raise OSError("device busy")
        return real_rename(self, target)

    with monkeypatch.context() as mp:  # a failure while moving in: every part goes back
        mp.setattr(Path, "rename", rename_fails_on_mosquitto)
        with pytest.raises(OSError, match="device busy"):
            provision(cfg, out, force=True)
    assert (out / "credentials" / "dev001.password").read_text() == password
    assert (out / "mosquitto" / "passwd").read_text() == passwd
    assert provision(cfg, out, keep=True)["kept"]
    info = provision(cfg, out, tls_hosts=["broker"], force=True)
    assert (out / "credentials" / "dev001.password").read_text() != password
    assert Path(info["tls"]["ca"]) == out / "tls" / "ca.pem" and (out / "tls" / "ca.pem").is_file()
    assert Path(info["signing_key"]).is_file()
    assert sorted(p.name for p in out.iterdir()) == [
        "credentials", "keys", "mosquitto", "provision.json", "tls",
    ]  # fmt: skip
    assert provision(cfg, out, keep=True)["kept"]
