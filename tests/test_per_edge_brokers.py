"""A broker per edge site on real Mosquitto: provisioned cloud and site brokers, each site
bridged to the cloud with the bridge's own account. What a device may send the cloud crosses,
its updates and blob chunks never leave the site, its credentials work on its own site's
broker only, and ``estuary status`` reads each bridge's state."""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from estuary.cli import main as cli_main
from estuary.demo import run_demo
from estuary.launcher import Hierarchy
from estuary.provision import BRIDGE_CONF, bridge_conf, provision
from estuary.status import (
    BROKERS_FILE,
    BrokerView,
    bridge_state,
    broker_views,
    format_brokers,
)
from shared.config import RunConfig, config_from_dict
from shared.errors import ConfigError
from shared.evaluation.report import read_metrics
from shared.federation.topology import site_of, sites, topic_matches
from shared.naming import device_name
from shared.transport.local_broker import LocalBroker, amqtt_available, find_mosquitto, free_port
from shared.wire.messages import Topics, home_of
from tests.conftest import tiny_config
from tests.mqtt_probe import close, connect, login

needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")
SHA = "cd" * 32
BRIDGE_UP_S = 20.0


def _cfg() -> RunConfig:
    fed = {"num_devices": 4, "num_edges": 2, "brokers": "per-edge"}
    return config_from_dict({"run": {"name": "sites"}, "federation": fed}, source="test")


@dataclass
class Sites:
    """Provisioned cloud broker and one bridged broker per edge site."""

    cfg: RunConfig
    out: Path
    cloud: LocalBroker
    edges: dict[str, LocalBroker]

    def password(self, user: str) -> str:
        return (self.out / "credentials" / f"{user}.password").read_text()

    def login(self, broker: LocalBroker, user: str) -> mqtt.Client:
        return login(broker.host, broker.port, user, self.password(user))

    def observer_cfg(self, broker: LocalBroker) -> RunConfig:
        section = self.cfg.broker.model_copy(update={
            "host": broker.host, "port": broker.port, "username": "observer",
            "password_file": str(self.out / "credentials" / "observer.password"),
        })  # fmt: skip
        return self.cfg.model_copy(update={"broker": section})


def bridge_lines(out: Path, edge: str) -> list[str]:
    """The bridge stanza ``estuary provision`` wrote for site ``edge``."""
    return (out / "sites" / edge / "mosquitto" / BRIDGE_CONF).read_text().splitlines()


def wait_bridge(s: Sites, edge: str, up: bool = True, timeout_s: float = BRIDGE_UP_S) -> None:
    """Wait until the site broker of ``edge`` says its bridge is ``up``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if bridge_state(s.observer_cfg(s.edges[edge]), edge, 1.0) is up:
            return
        time.sleep(0.2)
    raise AssertionError(f"bridge of {edge} not {'up' if up else 'down'} in {timeout_s:.0f} s")


@pytest.fixture
def bridged(tmp_path: Path) -> Iterator[Sites]:
    cfg = _cfg()
    port = free_port()
    out = tmp_path / "prov"
    provision(cfg, out, broker_user=None, cloud_broker=f"127.0.0.1:{port}")
    cloud = LocalBroker(port=port, kind="mosquitto", workdir=tmp_path / "cloud",
                        password_file=out / "mosquitto" / "passwd",
                        acl_file=out / "mosquitto" / "acl")  # fmt: skip
    edges: dict[str, LocalBroker] = {}
    try:
        cloud.start()
        for site in sites(cfg)[1:]:
            mq = out / "sites" / site.name / "mosquitto"
            edges[site.name] = LocalBroker(
                kind="mosquitto", workdir=tmp_path / site.name, password_file=mq / "passwd",
                acl_file=mq / "acl", extra_conf=bridge_lines(out, site.name),
            ).start()  # fmt: skip
        s = Sites(cfg, out, cloud, edges)
        for e in edges:
            wait_bridge(s, e)
        yield s
    finally:
        for b in edges.values():
            b.stop()
        cloud.stop()


def _collect(c: mqtt.Client, *patterns: str) -> queue.Queue[tuple[str, bytes]]:
    box: queue.Queue[tuple[str, bytes]] = queue.Queue()
    c.on_message = lambda cl, ud, msg: box.put((msg.topic, bytes(msg.payload)))
    for p in patterns:
        c.subscribe(p, qos=1)
    time.sleep(0.3)
    return box


def _drain(box: queue.Queue[tuple[str, bytes]], wait_s: float) -> list[tuple[str, bytes]]:
    end, got = time.monotonic() + wait_s, []
    while time.monotonic() < end:
        try:
            got.append(box.get(timeout=0.05))
        except queue.Empty:
            pass
    return got


@needs_mosquitto
def test_device_traffic_stays_at_its_site_and_what_the_cloud_needs_crosses(
    bridged: Sites,
) -> None:
    t = Topics(bridged.cfg.run.name)
    site0 = bridged.edges["edge0"]
    dev = "dev000"  # at edge0
    cloud = bridged.login(bridged.cloud, "cloud")
    edge = bridged.login(site0, "edge0")
    device = bridged.login(site0, dev)
    try:
        at_cloud = _collect(cloud, f"{t.base}/#")
        at_edge = _collect(edge, t.all_device_up, f"{t.base}/device/+/blob/#")
        chunk = t.blob_chunk(home_of("device", dev), SHA, 1 << 20, 0)
        for topic, payload in ((t.device_hello(dev), b"hello"), (t.device_up(dev), b"update"),
                               (chunk, b"x" * 4096)):  # fmt: skip
            device.publish(topic, payload, qos=1).wait_for_publish(5)
        got_edge = {topic for topic, _ in _drain(at_edge, 1.5)}
        got_cloud = _drain(at_cloud, 1.5)
        # the site's edge got the update and the chunk: they were published
        assert got_edge == {t.device_up(dev), chunk}
        # the cloud got the registration across the bridge, and nothing else of the device
        assert [topic for topic, _ in got_cloud] == [t.device_hello(dev)]
        # the cloud's round reaches the site's device
        at_device = _collect(device, t.cloud_round)
        cloud.publish(t.cloud_round, b"round", qos=1).wait_for_publish(5)
        assert [topic for topic, _ in _drain(at_device, 1.5)] == [t.cloud_round]
    finally:
        close(cloud, edge, device)


@needs_mosquitto
def test_a_devices_credentials_work_on_its_own_sites_broker_only(bridged: Sites) -> None:
    password = bridged.password("dev000")  # a device of edge0
    for broker, accepted in ((bridged.edges["edge0"], True), (bridged.edges["edge1"], False),
                             (bridged.cloud, False)):  # fmt: skip
        c, code = connect(broker.host, broker.port, "dev000", password)
        close(c)
        assert (code == 0) is accepted, (broker.url, code)
    # nor an edge's elsewhere, nor the bridge's own account on a site broker
    c, code = connect(bridged.cloud.host, bridged.cloud.port, "edge0", bridged.password("edge0"))
    close(c)
    assert code != 0
    site1 = bridged.edges["edge1"]
    c, code = connect(site1.host, site1.port, "bridge-edge1", bridged.password("bridge-edge1"))
    close(c)
    assert code != 0


@needs_mosquitto
def test_status_shows_each_broker_and_whether_its_bridge_is_up(bridged: Sites) -> None:
    where = {"cloud": {"host": bridged.cloud.host, "port": bridged.cloud.port}}
    where |= {e: {"host": b.host, "port": b.port} for e, b in bridged.edges.items()}
    views = broker_views(bridged.observer_cfg(bridged.cloud), where, 2.0)
    assert [(v.site, v.reachable, v.bridge_up) for v in views] == [
        ("cloud", True, None), ("edge0", True, True), ("edge1", True, True)]  # fmt: skip
    # the cloud broker stops: each site broker says its bridge is down
    bridged.cloud.stop()
    wait_bridge(bridged, "edge0", up=False)
    views = broker_views(bridged.observer_cfg(bridged.cloud), where, 2.0)
    assert [(v.site, v.reachable, v.bridge_up) for v in views] == [
        ("cloud", False, None), ("edge0", True, False), ("edge1", True, False)]  # fmt: skip
    text = format_brokers(views)
    assert "brokers 2 of 3 reachable" in text and "bridge DOWN" in text
    assert isinstance(views[0], BrokerView) and views[0].url.startswith("mqtt://127.0.0.1:")


class CloudTap:
    """An anonymous subscriber to every topic of a run on the cloud broker that ``estuary
    demo`` records in ``run_dir/brokers.json`` once it appears: what crossed to the cloud."""

    def __init__(self, run_dir: Path, base: str) -> None:
        self.run_dir, self.base = run_dir, base
        self.seen: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._client: mqtt.Client | None = None
        self._thread = threading.Thread(target=self._attach, daemon=True)
        self._thread.start()

    def _attach(self) -> None:
        record = self.run_dir / BROKERS_FILE
        while not record.is_file() and not self._stop.wait(0.02):
            pass
        if self._stop.is_set():
            return
        where = json.loads(record.read_text())["cloud"]
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="cloud-tap",
                        protocol=mqtt.MQTTv311)  # fmt: skip
        c.on_connect = lambda cl, ud, fl, rc, pr: cl.subscribe(f"{self.base}/#", qos=1)
        c.on_message = lambda cl, ud, msg: self.seen.append((msg.topic, len(msg.payload)))
        c.reconnect_delay_set(1, 2)  # the broker starts right after the record
        self._client = c
        c.connect_async(where["host"], int(where["port"]))
        c.loop_start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if self._client is not None:
            self._client.loop_stop()
            self._client.disconnect()

    def bytes_on(self, pattern: str) -> int:
        """Payload bytes seen on topics matching ``pattern``."""
        return sum(n for topic, n in self.seen if topic_matches(pattern, topic))


@needs_mosquitto
@pytest.mark.process
def test_demo_per_edge_ends_at_the_one_broker_model_and_keeps_updates_at_their_site(
    tmp_path: Path, reference_sha: Callable[[RunConfig], str]
) -> None:
    """``estuary demo --brokers per-edge`` on a tiny config: every role on its site's broker,
    the devices deploy and sample, the final model is the one-broker run's, and no device
    update or update blob reaches the cloud broker (a tap there sees the devices' hellos and
    the edges' reports: it listened all along)."""
    cfg = tiny_config(
        run={"name": "sites", "rounds": 2},
        federation={"num_devices": 4, "num_edges": 2, "round_deadline_s": 60},
        train={"local_steps": 2, "batch_size": 8, "threads": 1},
        deploy={"grid_size": 2, "sample_steps": 2},
    )
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    run_dir = tmp_path / "run"
    t = Topics(cfg.run.name)
    tap = CloudTap(run_dir, t.base)
    try:
        result = run_demo(run_dir, config=path, broker_kind="mosquitto", brokers="per-edge",
                          progress=False, evaluate=False)  # fmt: skip
    finally:
        tap.stop()
    assert result.final_model_sha256 == reference_sha(cfg)
    assert result.rounds == 2
    sampled = {d: r["event"] for d, r in result.deployment.items()}
    assert sampled == {device_name(i): "sampled" for i in range(4)}
    recorded = json.loads((run_dir / BROKERS_FILE).read_text())
    assert sorted(recorded) == ["cloud", "edge0", "edge1"]
    # what crossed: registrations and edge reports; never a device's update or its blob
    assert tap.bytes_on(t.all_device_hello) > 0 and tap.bytes_on(t.all_edge_up) > 0
    assert tap.bytes_on(t.all_device_up) == 0
    assert tap.bytes_on(f"{t.base}/device/+/blob/#") == 0
    assert tap.bytes_on(t.all_device_join) == 0
    # each role connected to its own site's broker only (the brokers log every connection)
    logs = {site: (run_dir / ("broker" if site == "cloud" else f"brokers/{site}")
                   / "mosquitto.log").read_text() for site in recorded}  # fmt: skip
    for role, name in [("cloud", "cloud"), ("edge", "edge0"), ("edge", "edge1"),
                       *(("device", device_name(i)) for i in range(4))]:  # fmt: skip
        client = f" as {cfg.run.name}-{name} "
        assert [s for s, text in logs.items() if client in text] == [site_of(cfg, role, name)]


class LinkCut:
    """A TCP relay between an edge site's bridge and the cloud broker whose link the test
    cuts and restores, as a WAN outage would: the site's own clients keep their broker."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.port = free_port()
        self._up = threading.Event()
        self._up.set()
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._server.settimeout(0.1)
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            if not self._up.is_set():
                conn.close()  # the link is down: the bridge's reconnects fail
                continue
            try:
                remote = socket.create_connection(self.upstream, timeout=2)
            except OSError:
                conn.close()
                continue
            for sock in (conn, remote):
                sock.settimeout(None)  # a quiet link is not a broken one
            with self._lock:
                self._socks += [conn, remote]
            for a, b in ((conn, remote), (remote, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Drop every connection through the link and refuse new ones."""
        self._up.clear()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def restore(self) -> None:
        """Let the bridge connect again."""
        self._up.set()

    def close(self) -> None:
        self.cut()
        self._stop.set()
        self._thread.join(2)
        self._server.close()


def _checkpoint_round(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "checkpoints" / "latest.json").read_text())["round"])
    except (OSError, ValueError, KeyError):
        return -1


def _wait_for(pred: Callable[[], bool], timeout_s: float, what: str, hier: Hierarchy) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        failed = hier.failed()
        if failed:
            pytest.fail(f"{failed[0].name} died: {failed[0].log_tail()}")
        if time.monotonic() > end:
            tails = "\n".join(f"--- {p.name}\n{p.log_tail(8)}" for p in hier.procs.values())
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}\n{tails}")
        time.sleep(0.05)


@needs_mosquitto
@pytest.mark.process
@pytest.mark.slow
def test_a_cut_bridge_and_a_killed_site_broker_end_at_the_undisturbed_model(
    tmp_path: Path, reference_sha: Callable[[RunConfig], str]
) -> None:
    """Per-edge brokers, one run disturbed twice within the round deadline: the link of
    edge0's bridge is cut for a few seconds during a round (its site keeps its broker; each
    side's broker holds what the other is sent meanwhile, cleansession false), then edge1's
    site broker is SIGKILLed and started again (its edge and devices reconnect and register
    again). The run completes at the model of an undisturbed run."""
    cfg = tiny_config(
        run={"name": "outage", "rounds": 5},
        federation={"num_devices": 4, "num_edges": 2, "round_deadline_s": 60},
        train={"local_steps": 2, "batch_size": 8, "threads": 1},
    )
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    cloud = LocalBroker(kind="mosquitto", workdir=tmp_path / "cloud").start()
    link = LinkCut((cloud.host, cloud.port))
    hier = Hierarchy(cfg, path, tmp_path / "run", cloud, evaluate=False)
    try:
        for site in sites(cfg)[1:]:
            address = f"127.0.0.1:{link.port if site.name == 'edge0' else cloud.port}"
            stanza = bridge_conf(cfg, site, address, None)
            hier.site_brokers[site.name] = LocalBroker(
                kind="mosquitto", workdir=tmp_path / site.name, extra_conf=stanza.splitlines()
            ).start()
        hier.start_all()
        _wait_for(lambda: _checkpoint_round(hier.run_dir) >= 0, 120, "round 1", hier)
        site0 = hier.site_brokers["edge0"]
        site0_cfg = cfg.model_copy(update={"broker": cfg.broker.model_copy(
            update={"host": site0.host, "port": site0.port})})  # fmt: skip
        link.cut()
        cut_at = time.monotonic()
        _wait_for(lambda: bridge_state(site0_cfg, "edge0", 0.5) is False, 30, "the cut", hier)
        # down longer than a chunk's re-ask interval, well within the round deadline
        time.sleep(max(0.0, 6.0 - (time.monotonic() - cut_at)))
        link.restore()
        _wait_for(lambda: bridge_state(site0_cfg, "edge0", 0.5) is True, 30, "the link", hier)
        _wait_for(lambda: _checkpoint_round(hier.run_dir) >= 2, 120, "round 3", hier)
        site1 = hier.site_brokers["edge1"]
        site1.kill()
        time.sleep(1.0)
        site1.start()
        code = hier.wait("cloud", 240)
        assert code == 0, hier.procs["cloud"].log_tail(30)
        summary = json.loads((hier.run_dir / "summary.json").read_text())
        rows = read_metrics(hier.run_dir / "metrics.jsonl")
    finally:
        hier.stop_all(timeout_s=10)
        for b in hier.site_brokers.values():
            b.stop()
        link.close()
        cloud.stop()
    assert summary["rounds"] == cfg.run.rounds
    assert [r["updates"] for r in rows] == [4] * cfg.run.rounds
    assert summary["final_model_sha256"] == reference_sha(cfg)


def test_local_broker_extra_conf_is_one_line_per_item_and_needs_mosquitto() -> None:
    with pytest.raises(ConfigError, match="line break"):
        LocalBroker(kind="auto", extra_conf=["connection b\naddress x:1"])
    if amqtt_available():
        with pytest.raises(ConfigError, match="extra_conf"):
            LocalBroker(kind="amqtt", extra_conf=["connection b"])


@needs_mosquitto
def test_local_broker_appends_extra_conf_after_its_own(tmp_path: Path) -> None:
    """The lines come last (after every global option) and can be replaced for a restart."""
    conf = tmp_path / "mosquitto.conf"
    with LocalBroker(kind="mosquitto", workdir=tmp_path, extra_conf=["# bridge below"]) as b:
        lines = conf.read_text().splitlines()
        assert lines[-1] == "# bridge below" and lines[1].startswith("listener ")
        b.extra_conf = []
        b.restart()
        assert "# bridge below" not in conf.read_text() and b.running


@needs_mosquitto
def test_status_of_a_run_directory_lists_its_brokers_first(
    bridged: Sites, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``estuary status RUN_DIR`` with a ``brokers.json`` (as the per-edge demo writes it)
    lists every broker and bridge, then the federation read from the cloud broker; with
    ``--json`` under ``"brokers"``."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "launch_config.json").write_text(bridged.observer_cfg(bridged.cloud).to_json())
    where = {"cloud": bridged.cloud, **bridged.edges}
    record = {s: {"host": b.host, "port": b.port} for s, b in where.items()}
    (run_dir / BROKERS_FILE).write_text(json.dumps(record))
    assert cli_main(["status", str(run_dir), "--wait-s", "1"]) == 1  # no cloud state: no run
    out = capsys.readouterr().out
    assert out.startswith("brokers 3 of 3 reachable\n")
    assert f"edge1    mqtt://127.0.0.1:{bridged.edges['edge1'].port}" in out
    assert out.count("bridge up") == 2 and f'run "sites" on 127.0.0.1:{bridged.cloud.port}' in out
    cli_main(["status", str(run_dir), "--wait-s", "1", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert [(b["site"], b["reachable"], b["bridge_up"]) for b in doc["brokers"]] == [
        ("cloud", True, None), ("edge0", True, True), ("edge1", True, True)]  # fmt: skip
