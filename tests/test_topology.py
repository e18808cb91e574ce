"""Broker sites and bridge rules (shared.federation.topology) and the per-broker provisioning
of ``federation.brokers = "per-edge"`` (estuary.provision), checked against concrete topics
built by the protocol's own :class:`~shared.wire.messages.Topics`."""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path

import pytest

from estuary.acl import DEPLOYER, acl_text, device_writes, edge_writes
from estuary.provision import (
    BRIDGE_CONF,
    BROKER_CONF,
    bridge_conf,
    mosquitto_conf,
    provision,
)
from estuary.status import OBSERVER
from shared.config import RunConfig, config_from_dict
from shared.errors import ConfigError, EstuaryError
from shared.federation.topology import (
    CLOUD_SITE,
    bridge_in,
    bridge_out,
    bridge_state_topic,
    bridge_user,
    crosses,
    site_of,
    sites,
    topic_matches,
)
from shared.naming import device_name, edge_ids
from shared.wire.messages import DEPLOYER_HOME, Topics, cloud_only_home, home_of, private_home

SHA = "ab" * 32
CHUNK = 1 << 20


def _cfg(brokers: str = "per-edge", devices: int = 5, edges: int = 2, **fed: object) -> RunConfig:
    federation = {"num_devices": devices, "num_edges": edges, "brokers": brokers, **fed}
    return config_from_dict({"run": {"name": "topo"}, "federation": federation}, source="test")


def _device_private_topics(t: Topics, d: str) -> list[str]:
    """What a device publishes that must never leave its site: its update, its edge choice
    and the chunks of its blobs (a chunk, the 'missing' answer)."""
    own = home_of("device", d)
    return [
        t.device_up(d),
        t.device_join(d),
        t.blob_chunk(own, SHA, CHUNK, 0),
        t.blob_chunk(own, SHA, CHUNK, 17),
        t.blob_chunk(own, SHA, CHUNK, "missing"),
    ]


def test_topic_matches_follows_mqtt_filter_rules() -> None:
    assert topic_matches("a/b/#", "a/b")  # '#' also matches the parent level
    assert topic_matches("a/b/#", "a/b/c/d")
    assert topic_matches("a/+/c", "a/x/c")
    assert not topic_matches("a/+/c", "a/x/y/c")
    assert not topic_matches("a/+", "a")
    assert not topic_matches("a/b", "a/b/c")
    assert not topic_matches("#", "$SYS/broker/uptime")
    assert topic_matches("$SYS/broker/connection/+/state", "$SYS/broker/connection/b/state")


def test_sites_place_each_device_at_its_static_edge() -> None:
    cfg = _cfg(devices=5, edges=2)
    cloud, e0, e1 = sites(cfg)
    assert cloud.name == CLOUD_SITE and cloud.is_cloud and cloud.devices == ()
    assert (e0.edge, e0.devices) == ("edge0", ("dev000", "dev002", "dev004"))
    assert (e1.edge, e1.devices) == ("edge1", ("dev001", "dev003"))
    assert site_of(cfg, "device", "dev003") == "edge1"
    assert site_of(cfg, "edge", "edge0") == "edge0"
    assert site_of(cfg, "cloud", "cloud") == CLOUD_SITE
    assert site_of(cfg, "deployer", DEPLOYER) == CLOUD_SITE
    with pytest.raises(ConfigError, match="dev009"):
        site_of(cfg, "device", "dev009")


def test_per_edge_needs_static_assignment_and_keeps_the_digest() -> None:
    with pytest.raises(ConfigError, match=r"federation\.brokers.*federation\.assignment"):
        _cfg(assignment="select")
    with pytest.raises(ConfigError, match=r"federation\.brokers.*federation\.assignment"):
        _cfg(assignment="random")
    # where the roles connect is not the experiment: the same digest either way
    assert _cfg("per-edge").digest() == _cfg("one").digest()
    assert _cfg("one").federation.brokers == "one"


def test_no_device_update_or_blob_chunk_crosses_any_bridge() -> None:
    cfg = _cfg(devices=6, edges=3)
    t = Topics(cfg.run.name)
    devices = [device_name(i) for i in range(6)]
    for site in sites(cfg)[1:]:
        out, back = bridge_out(t, site), bridge_in(t, site)
        for d in devices:
            for topic in _device_private_topics(t, d):
                assert not crosses(out, topic), (site.name, topic)
                assert not crosses(back, topic), (site.name, topic)


def test_bridge_carries_what_cloud_and_site_exchange() -> None:
    cfg = _cfg(devices=4, edges=2)
    t = Topics(cfg.run.name)
    site = sites(cfg)[1]  # edge0 with dev000, dev002
    out, back = bridge_out(t, site), bridge_in(t, site)
    edge = home_of("edge", "edge0")
    must_out = [
        t.edge_state("edge0"), t.status(edge), t.edge_round("edge0"), t.edge_up("edge0"),
        t.blob_chunk(cloud_only_home(edge), SHA, CHUNK, 0), t.blob_want(edge, "cloud"),
        t.device_hello("dev002"), t.status(home_of("device", "dev002")),
        t.device_deploy("dev002"), t.blob_want(home_of("device", "dev002"), "cloud"),
        t.blob_want(home_of("device", "dev002"), DEPLOYER_HOME), t.private_want("dev002"),
    ]  # fmt: skip
    must_in = [
        t.cloud_state, t.cloud_round, t.cloud_deploy, t.cloud_sample, t.status("cloud"),
        t.blob_chunk("cloud", SHA, CHUNK, 0), t.blob_chunk(DEPLOYER_HOME, SHA, CHUNK, 1),
        t.blob_want("cloud", edge), t.cloud_only_want(edge),
        t.device_down("dev000"), t.blob_chunk(private_home("dev000"), SHA, CHUNK, 0),
    ]  # fmt: skip
    for topic in must_out:
        assert crosses(out, topic) and not crosses(back, topic), topic
    for topic in must_in:
        assert crosses(back, topic) and not crosses(out, topic), topic
    # what the edge serves its own devices (the round's model) stays at the site: the cloud
    # broker carries one edge model per edge and round, whatever the devices per edge
    assert not crosses(out, t.blob_chunk(edge, SHA, CHUNK, 3))
    # another site's instances are not this bridge's business
    other = [
        t.device_hello("dev001"),
        t.edge_up("edge1"),
        t.device_down("dev001"),
        t.blob_chunk(private_home("dev001"), SHA, CHUNK, 0),
        t.private_want("dev001"),
    ]
    for topic in other:
        assert not crosses(out, topic) and not crosses(back, topic), topic


def test_one_mode_provisioning_is_unchanged(tmp_path: Path) -> None:
    """ACL and broker config of a one-broker federation, byte for byte as before brokers
    per edge site existed (sha256 pinned from that code), and the same files."""
    pinned = {
        "static": "e60193bf2cc6920dd737e0f6c5e101c28b55df003be7fb217884eb3742a00628",
        "select": "e73cfd2585259f79956e499f0a6be41a7c639176eb35afc4248e061e56635735",
    }
    for assignment, sha in pinned.items():
        fed = {"num_devices": 5, "num_edges": 2, "assignment": assignment}
        cfg = config_from_dict({"run": {"name": "pin"}, "federation": fed}, source="test")
        acl = acl_text(cfg, devices=[device_name(i) for i in range(5)], edges=edge_ids(cfg))
        assert hashlib.sha256(acl.encode()).hexdigest() == sha, assignment
    conf = mosquitto_conf("pin", Path("/srv/estuary"), broker=cfg.broker)
    assert hashlib.sha256(conf.encode()).hexdigest() == (
        "604c4c490ee9e328ba337667d44aaa365e2ed8003b64a49cc8c54edb795f9482"
    )
    conf = mosquitto_conf("pin", Path("/srv/estuary"), tls=True, broker=cfg.broker)
    assert hashlib.sha256(conf.encode()).hexdigest() == (
        "4ff7e2e12218d28599ee7d0b5df5355117b2e4eaf14fa1928003a51bf1493532"
    )
    cfg = _cfg("one", devices=3, edges=1)
    out = tmp_path / "p"
    info = provision(cfg, out, broker_user=None)
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    names = ["cloud", "edge0", "dev000", "dev001", "dev002", OBSERVER, DEPLOYER]
    assert files == sorted(
        [
            *(f"credentials/{n}.password" for n in names),
            "keys/deploy_ed25519.pem",
            "keys/deploy_ed25519.pub.pem",
            "mosquitto/acl",
            "mosquitto/mosquitto.conf",
            "mosquitto/passwd",
            "provision.json",
        ]
    )
    assert sorted(info) == ["acl", "broker_conf", "passwd", "run", "signing_key", "users",
                            "verify_key"]  # fmt: skip
    assert info["users"] == names
    assert (out / "mosquitto" / "acl").read_text() == acl_text(
        cfg, devices=["dev000", "dev001", "dev002"], edges=["edge0"]
    ) + "\n"


def _users(passwd: Path) -> list[str]:
    return [line.split(":", 1)[0] for line in passwd.read_text().splitlines()]


def _acl_sections(acl: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    user = None
    for line in acl.splitlines():
        if line.startswith("user "):
            user = line.split()[1]
            sections[user] = []
        elif user and line.startswith("topic "):
            sections[user].append(line)
    return sections


def test_per_edge_provisioning_writes_each_brokers_accounts_and_bridge(tmp_path: Path) -> None:
    cfg = _cfg(devices=5, edges=2)
    out = tmp_path / "p"
    info = provision(cfg, out, broker_user=None, cloud_broker="cloud.example:1883")
    t = Topics(cfg.run.name)
    # the cloud broker: cloud, operator tools and one bridge account per site, nobody else
    assert _users(out / "mosquitto" / "passwd") == [
        "cloud",
        OBSERVER,
        DEPLOYER,
        "bridge-edge0",
        "bridge-edge1",
    ]
    acl = _acl_sections((out / "mosquitto" / "acl").read_text())
    assert set(acl) == {"cloud", OBSERVER, DEPLOYER, "bridge-edge0", "bridge-edge1"}
    for site in sites(cfg)[1:]:
        granted = acl[bridge_user(site.name)]
        assert granted == [
            *(f"topic write {x}" for x in bridge_out(t, site)),
            *(f"topic read {x}" for x in bridge_in(t, site)),
        ]
        mq = out / "sites" / site.name / "mosquitto"
        # a device's and an edge's account exist on their own site's broker only
        assert _users(mq / "passwd") == [site.name, *site.devices, OBSERVER]
        assert set(_acl_sections((mq / "acl").read_text())) == {site.name, *site.devices, OBSERVER}
        assert f"topic read {bridge_state_topic(site.name)}" in (mq / "acl").read_text()
        bridge = (mq / BRIDGE_CONF).read_text()
        password = (out / "credentials" / f"bridge-{site.name}.password").read_text()
        assert f"remote_password {password}\n" in bridge
        assert f"connection bridge-{site.name}\n" in bridge
        assert "address cloud.example:1883\n" in bridge and "cleansession false\n" in bridge
        assert "notifications_local_only true\n" in bridge
        assert (mq / BROKER_CONF).read_text().endswith(bridge)
        for name in (BRIDGE_CONF, BROKER_CONF, "passwd", "acl"):
            assert stat.S_IMODE((mq / name).stat().st_mode) == 0o640, name
        assert info["sites"][site.name]["users"] == [site.name, *site.devices, OBSERVER]
        assert info["sites"][site.name]["files"]["bridge_conf"] == str(mq / BRIDGE_CONF)
    for d in (device_name(i) for i in range(5)):
        holders = [
            s for s in ("edge0", "edge1") if d in _users(out / "sites" / s / "mosquitto" / "passwd")
        ]
        assert holders == [site_of(cfg, "device", d)]
    assert info["brokers"] == "per-edge" and info["cloud_broker"] == "cloud.example:1883"
    assert json.loads((out / "provision.json").read_text()) == info
    # --keep reuses it; --force to one broker drops the sites
    assert provision(cfg, out, keep=True, broker_user=None)["kept"] is True
    (out / "sites" / "edge1" / "mosquitto" / BRIDGE_CONF).unlink()
    with pytest.raises(EstuaryError, match="edge1's bridge_conf"):
        provision(cfg, out, keep=True, broker_user=None)
    provision(_cfg("one"), out, force=True, broker_user=None)
    assert not (out / "sites").exists()
    assert "bridge-edge0" not in _users(out / "mosquitto" / "passwd")


def test_bridge_address_defaults_to_the_configs_broker(tmp_path: Path) -> None:
    cfg = _cfg(devices=2, edges=1)
    info = provision(cfg, tmp_path / "p", broker_user=None)
    b = cfg.broker
    assert info["cloud_broker"] == f"{b.host}:{b.port}"
    site = sites(cfg)[1]
    assert f"address {b.host}:{b.port}\n" in bridge_conf(cfg, site, f"{b.host}:{b.port}", "pw")
    with pytest.raises(EstuaryError, match="--cloud-broker"):
        provision(_cfg("one"), tmp_path / "q", broker_user=None, cloud_broker="h:1")


def test_a_bridge_sends_only_what_its_sites_accounts_may_publish() -> None:
    """Every rule of a bridge's ``out`` list is one of the write rules of its site's edge or
    devices (estuary.provision's per-role write lists): the bridge adds no topic of its own,
    and none of another site's."""
    cfg = _cfg(devices=5, edges=2)
    t = Topics(cfg.run.name)
    for site in sites(cfg)[1:]:
        edge = str(site.edge)
        allowed = set(edge_writes(t, edge, list(site.devices)))
        for d in site.devices:
            allowed |= set(device_writes(t, d, [edge]))
        assert set(bridge_out(t, site)) <= allowed, site.name
