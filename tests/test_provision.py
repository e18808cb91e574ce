"""``estuary provision`` on a real mosquitto: per-role passwords and ACLs are enforced by the
broker (a device cannot publish to the cloud's topics or read another device's updates), and
a whole federation, deployment included, runs with each process logged in as itself."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from estuary.cli import main as cli_main
from estuary.launcher import Hierarchy
from estuary.provision import mosquitto_hash, provision
from shared.errors import EstuaryError
from shared.transport.local_broker import LocalBroker, find_mosquitto
from tests.conftest import tiny_config
from tests.mqtt_probe import close, connect, inbox, login, received

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
BASE = "estuary/v1/acl"


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[LocalBroker, Path]]:
    """A mosquitto that requires the provisioned passwords and enforces the ACL.

    Its client ids are not bound to user names: the ACL tests (here and in
    test_private_downlink.py) log in spies with a role's own account beside that role, which
    a bound broker would not allow (the second connection would replace the first). The
    binding itself is tested in test_client_id_binding.py; the federations below run with it.
    """
    cfg = tiny_config(run={"name": "acl"}, federation={"num_devices": 3, "num_edges": 2})
    out = tmp_path / "prov"
    provision(cfg, out)
    broker = LocalBroker(
        kind="mosquitto", workdir=tmp_path / "broker",
        password_file=out / "mosquitto" / "passwd", acl_file=out / "mosquitto" / "acl",
        bind_client_ids=False,
    ).start()  # fmt: skip
    yield broker, out
    broker.stop()


def _login(broker: LocalBroker, out: Path, user: str) -> mqtt.Client:
    password = (out / "credentials" / f"{user}.password").read_text()
    return login(broker.host, broker.port, user, password)


def test_mosquitto_hash_format() -> None:
    h = mosquitto_hash("secret", salt=b"0123456789ab")
    kind, iters, salt, digest = h.split("$")[1:]
    assert (kind, iters, salt) == ("7", "101", "MDEyMzQ1Njc4OWFi") and len(digest) == 88


def test_broker_refuses_anonymous_and_wrong_passwords(secured: tuple[LocalBroker, Path]) -> None:
    broker, _ = secured
    for user, password in ((None, None), ("dev000", "wrong"), ("nobody", "x")):
        c, code = connect(broker.host, broker.port, user, password)
        close(c)
        assert code != 0, f"{user} logged in with {password!r}"


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


def test_acl_observer_reads_only_the_state_and_writes_nothing(
    secured: tuple[LocalBroker, Path],
) -> None:
    """The account of `estuary status` receives the retained state and presence topics, never
    updates, joins or blobs, and nothing it publishes reaches anyone."""
    broker, out = secured
    cloud, edge0 = _login(broker, out, "cloud"), _login(broker, out, "edge0")
    dev0, observer = _login(broker, out, "dev000"), _login(broker, out, "observer")
    at_observer, at_cloud = inbox(observer, f"{BASE}/#"), inbox(cloud, f"{BASE}/#")
    state = {f"{BASE}/cloud/state", f"{BASE}/cloud/status", f"{BASE}/edge/edge0/state",
             f"{BASE}/edge/edge0/status", f"{BASE}/device/dev000/hello",
             f"{BASE}/device/dev000/status", f"{BASE}/device/dev000/deploy"}  # fmt: skip
    private = {f"{BASE}/cloud/round", f"{BASE}/cloud/deploy", f"{BASE}/edge/edge0/round",
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
                     f"acl_file {mq / 'acl'}", "max_packet_size 68157440"):  # fmt: skip
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
