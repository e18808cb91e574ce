"""Tools for the adversarial suite (``tests/test_attack_suite.py``): a small real federation
in this process (every role on its own :class:`~shared.transport.mqtt.MqttBus` and thread,
edges and devices leaving on the cloud's "done" as their processes do), and a hostile client
written the way an attacker would write one: plain paho-mqtt, no Estuary transport.

The federation can hold its devices back at a round (:class:`GatedDevice`) until the
attacker has done its work, so that which message reaches a role first is decided by the
test, not by the scheduler: every count the suite asserts is exact.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import torch
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from cloud import CloudServer, RoundSummary
from device_agent import DeviceAgent
from edge_node import EdgeServer
from shared.config import BrokerSection, RunConfig
from shared.data.datasets import load_dataset, to_model_input
from shared.data.partition import make_partition
from shared.methods.registry import make_algorithm
from shared.models.init import initial_model
from shared.naming import device_name, edge_ids, home_edge
from shared.runtime.process import follow_cloud
from shared.runtime.service import RoleService
from shared.transport.mqtt import MqttBus
from shared.transport.telemetry import Traffic
from shared.wire.messages import EdgeRound, Presence, Topics, decode, encode, home_of

log = logging.getLogger(__name__)

TensorDict = dict[str, torch.Tensor]

WAIT_S = 30.0
"""How long a test waits for one thing to happen before it fails (generous: a loaded CI
host; a passing run waits only as long as the thing takes)."""

RUN_TIMEOUT_S = 150.0
"""How long a whole federation may take before the test fails."""

NOT_AUTHORIZED = 0x87
"""MQTT 5 reason code of a PUBACK the broker sends for a publish its ACL refuses."""


def wait_for(pred: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll ``pred`` until it holds; raise AssertionError naming ``what`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(0.005)


def rejected(traffic: Traffic) -> dict[str, int]:
    """A role's rejected-message counters (``who:reason`` -> count), what
    ``estuary_rejected_messages_total{role,reason}`` exports."""
    return traffic.snapshot()["rejected"]


def total_rejected(traffic: Traffic) -> int:
    """All rejections a role counted so far."""
    return sum(rejected(traffic).values())


# -- the hostile client ------------------------------------------------------------------------


class Hostile:
    """A bare paho MQTT 5 client: publishes anything anywhere (as far as its broker lets it),
    records what it receives on its subscriptions and the broker's answer to each publish."""

    def __init__(
        self,
        host: str,
        port: int,
        client_id: str,
        *,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self.messages: list[tuple[str, bytes]] = []
        self.on_message: Callable[[str, bytes], None] | None = None
        self._acks: dict[int, int] = {}
        self._subacks: dict[int, threading.Event] = {}
        self._connack: queue.Queue[tuple[int, bool]] = queue.Queue()
        self.disconnects = 0
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        if user is not None:
            c.username_pw_set(user, password)
        c.max_inflight_messages_set(1000)
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        c.on_publish = self._on_publish
        c.on_subscribe = self._on_subscribe
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 0
        c.connect(host, port, clean_start=True, properties=props)
        c.loop_start()
        self.client = c
        code, _ = self.connack()
        if code != 0:
            self.close()
            raise AssertionError(f"the broker refused {client_id} ({user}): reason {code}")

    def _on_connect(self, _c: Any, _u: Any, flags: Any, rc: Any, _p: Any) -> None:
        self._connack.put((rc.value, bool(getattr(flags, "session_present", False))))

    def _on_disconnect(self, _c: Any, _u: Any, _f: Any, _rc: Any, _p: Any) -> None:
        self.disconnects += 1

    def _on_message(self, _c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        payload = bytes(msg.payload)
        with self._lock:
            self.messages.append((msg.topic, payload))
        if self.on_message is not None:
            self.on_message(msg.topic, payload)

    def _on_publish(self, _c: Any, _u: Any, mid: int, rc: Any, _p: Any) -> None:
        with self._lock:
            self._acks[mid] = int(rc.value) if rc is not None else 0

    def _on_subscribe(self, _c: Any, _u: Any, mid: int, _rcs: Any, _p: Any) -> None:
        with self._lock:
            event = self._subacks.setdefault(mid, threading.Event())
        event.set()

    def connack(self) -> tuple[int, bool]:
        """The next CONNACK: (reason code, session present)."""
        return self._connack.get(timeout=WAIT_S)

    def subscribe(self, *patterns: str) -> None:
        """Subscribe (QoS 1) and wait for the broker to acknowledge."""
        for pattern in patterns:
            _rc, mid = self.client.subscribe(pattern, qos=1)
            assert mid is not None
            with self._lock:
                event = self._subacks.setdefault(mid, threading.Event())
            assert event.wait(WAIT_S), f"no SUBACK for {pattern}"

    def send(self, topic: str, payload: bytes, *, retain: bool = False) -> int:
        """Publish at QoS 1 and wait for the broker's PUBACK; its reason code (0 or 0x10:
        accepted; :data:`NOT_AUTHORIZED`: refused by the ACL)."""
        return self.send_many([(topic, payload)], retain=retain)[0]

    def send_many(self, items: Collection[tuple[str, bytes]], *, retain: bool = False) -> list[int]:
        """Publish every (topic, payload) at QoS 1 at once, then wait for all the PUBACKs."""
        infos = [self.client.publish(t, p, qos=1, retain=retain) for t, p in items]
        end = time.monotonic() + WAIT_S + len(infos) / 500
        codes = []
        for info in infos:
            assert info.rc == mqtt.MQTT_ERR_SUCCESS, mqtt.error_string(info.rc)
            while True:
                with self._lock:
                    code = self._acks.pop(info.mid, None)
                if code is not None:
                    break
                assert time.monotonic() < end, "the broker did not acknowledge a publish"
                time.sleep(0.002)
            codes.append(code)
        return codes

    def received(self, pattern: str | None = None) -> list[tuple[str, bytes]]:
        """What arrived so far (on topics matching ``pattern``, a plain substring)."""
        with self._lock:
            return [(t, p) for t, p in self.messages if pattern is None or pattern in t]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def serve_retained(hostile: Hostile, topics: Topics, src: str, sha: str, data: bytes,
                   chunk_bytes: int) -> None:  # fmt: skip
    """Put ``data`` on the broker as the retained chunks of blob ``sha`` served by ``src``: a
    fetcher gets them with its subscription, before the real ``src`` (which has no such blob
    and answers "missing") hears the request."""
    n = max(1, -(-len(data) // chunk_bytes))
    items = [
        (topics.blob_chunk(src, sha, chunk_bytes, i), data[i * chunk_bytes : (i + 1) * chunk_bytes])
        for i in range(n)
    ]
    codes = hostile.send_many(items, retain=True)
    assert all(c < 0x80 for c in codes), codes


SENTINEL = b"{not json either"
"""What :func:`flood_from_another_process` sends last: a small bad message (``bad_json``)."""

FLOODER = """
import sys, time
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
host, port, topic, count, size, sentinel_topic = sys.argv[1:7]
c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="flooder-" + str(time.time_ns()))
c.connect(host, int(port))
c.loop_start()
payload = b"x" * int(size)
for _ in range(int(count)):
    info = c.publish(topic, payload, qos=1)
    info.wait_for_publish(60)
    assert info.is_published()
info = c.publish(sentinel_topic, sys.argv[7].encode(), qos=1)
info.wait_for_publish(60)
assert info.is_published()
c.disconnect()
c.loop_stop()
"""


def flood_from_another_process(host: str, port: int, topic: str, count: int, size: int,
                               sentinel_topic: str) -> None:  # fmt: skip
    """Publish ``count`` messages of ``size`` bytes on ``topic`` from a separate process (its
    memory is not this process's), then :data:`SENTINEL` on ``sentinel_topic``."""
    args = [host, str(port), topic, str(count), str(size), sentinel_topic, SENTINEL.decode()]
    subprocess.run([sys.executable, "-c", FLOODER, *args], check=True, timeout=120)


class PeakRss:
    """The most resident memory this process held while the context was open, over what it
    held when it opened (sampled every few milliseconds from ``/proc/self/statm``)."""

    def __init__(self) -> None:
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            self._stop.wait(0.002)

    def __enter__(self) -> PeakRss:
        self.start = self.peak = self._rss()
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def growth(self) -> int:
        """Bytes of the peak over the start."""
        return self.peak - self.start


# -- the federation ----------------------------------------------------------------------------


class GatedDevice(DeviceAgent):
    """A device that, when its own edge announces a round listed in :attr:`gates`, waits
    for that gate before it trains (the honest devices train only once the attacker has
    done its work in that round)."""

    gates: dict[int, threading.Event]

    def on_edge_round(self, msg: EdgeRound) -> None:
        gate = self.gates.get(msg.round)
        if gate is not None and msg.edge == self.home_edge and self.name in msg.devices:
            if not gate.wait(WAIT_S * 2):
                log.error("%s: gate of round %d never opened", self.name, msg.round + 1)
        super().on_edge_round(msg)


@dataclass
class Outcome:
    """How a federation run ended."""

    sha: str  # the cloud's final global model digest ("" if it did not finish)
    completed: bool  # the cloud finished and every edge and device left on its "done"
    rounds: list[RoundSummary]
    traffic: dict[str, Traffic]  # each role instance's counters, by name
    seconds: float
    failed: str | None = None
    left: dict[str, bool] = field(default_factory=dict)  # role -> left on the cloud's done


class Federation:
    """The federation of ``cfg`` in this process over a real broker: one cloud, the edges
    and the devices (less ``absent``: an attacker speaks for those), each on its own
    MqttBus and thread. With ``accounts`` (``estuary provision``'s output directory) every
    role logs in with its own credentials. The cloud's sweep of retained blob chunks
    (``broker.retained_sweep_s``) runs only when ``retained_sweep_s`` asks for it: several
    attacks serve their blobs as retained chunks (:func:`serve_retained`), which the sweep
    would clear under them.
    """

    def __init__(
        self,
        cfg: RunConfig,
        host: str,
        port: int,
        *,
        accounts: Path | None = None,
        absent: Collection[str] = (),
        gated_rounds: Collection[int] = (),
        retained_sweep_s: float = 0.0,
    ) -> None:
        self.cfg = cfg
        self.retained_sweep_s = retained_sweep_s
        self.host, self.port, self.accounts = host, port, accounts
        self.topics = Topics(cfg.run.name)
        names = [device_name(i) for i in range(cfg.federation.num_devices)]
        self.gates = {d: {r: threading.Event() for r in gated_rounds} for d in names}
        self.summaries: list[RoundSummary] = []
        self.buses: dict[str, MqttBus] = {}
        self.threads: list[threading.Thread] = []
        self.left: dict[str, bool] = {}
        self._stop = threading.Event()
        self._started = 0.0
        self.devices: dict[str, GatedDevice] = {}
        try:  # every bus connected so far is closed if one of them cannot connect
            self._build(absent)
        except BaseException:
            for bus in self.buses.values():
                bus.close(timeout_s=1.0)
            raise

    def _build(self, absent: Collection[str]) -> None:
        cfg = self.cfg
        initial = initial_model(cfg.model.preset, cfg.model.init, seed=cfg.run.seed)
        self.cloud = CloudServer(cfg, self._bus("cloud", "cloud"), make_algorithm(cfg),
                                 initial_model=dict(initial.state_dict()),
                                 on_round_end=self.summaries.append)  # fmt: skip
        self.edges = {
            e: EdgeServer(cfg, self._bus("edge", e), make_algorithm(cfg), edge_id=e)
            for e in edge_ids(cfg)
        }
        data = load_dataset("synthetic", size=cfg.data.synthetic_size, seed=cfg.run.seed)
        parts = make_partition(data.labels, cfg.federation.num_devices, cfg.data, cfg.run.seed)
        for i, p in enumerate(parts):
            name = device_name(i)
            if name in absent:
                continue
            dev = GatedDevice(
                cfg, self._bus("device", name), make_algorithm(cfg), device_id=name, index=i,
                home_edge=home_edge(i, cfg), data=to_model_input(data.images[p]),
                labels=torch.from_numpy(data.labels[p]),
            )  # fmt: skip
            dev.gates = self.gates[name]
            self.devices[name] = dev

    def _bus(self, role: str, name: str) -> MqttBus:
        creds: dict[str, Any] = {}
        if self.accounts is not None:
            password = self.accounts / "credentials" / f"{name}.password"
            creds = {"username": name, "password_file": str(password)}
        settings = BrokerSection(
            host=self.host,
            port=self.port,
            connect_timeout_s=10,
            chunk_timeout_s=1.0,
            retained_sweep_s=self.retained_sweep_s,
            **creds,
        )
        will = encode(Presence(name=name, role=role, online=False))  # type: ignore[arg-type]
        bus = MqttBus(settings, run=self.cfg.run.name, client_id=f"{self.cfg.run.name}-{name}",
                      home=home_of(role, name), will=will)  # fmt: skip
        self.buses[name] = bus.connect()
        return bus

    def bus(self, name: str) -> MqttBus:
        """The bus of role instance ``name`` (``cloud``, ``edge0``, ``dev001``)."""
        return self.buses[name]

    def traffic(self, name: str) -> Traffic:
        """The counters of role instance ``name``."""
        return self.buses[name].traffic

    def start(self) -> Federation:
        """Start every role on its own thread (the cloud first, as the launcher does)."""
        self._started = time.monotonic()
        self._spawn("cloud", self.cloud, self._cloud_done)
        for name, svc in [*self.edges.items(), *self.devices.items()]:
            finished = threading.Event()
            follow_cloud(svc, finished.set)
            self._spawn(name, svc, finished.is_set)
        return self

    def start_members(self) -> Federation:
        """Start the edges and devices only (the cloud later, :meth:`start_cloud`): what a
        cloud that restarts after its devices registered sees."""
        self._started = time.monotonic()
        for name, svc in [*self.edges.items(), *self.devices.items()]:
            finished = threading.Event()
            follow_cloud(svc, finished.set)
            self._spawn(name, svc, finished.is_set)
        return self

    def start_cloud(self) -> Federation:
        """Start the cloud after :meth:`start_members`."""
        self._spawn("cloud", self.cloud, self._cloud_done)
        return self

    def _cloud_done(self) -> bool:
        return self.cloud.done or self.cloud.failed is not None

    def _spawn(self, name: str, svc: RoleService, done: Callable[[], bool]) -> None:
        svc.start()
        bus = self.buses[name]

        def serve() -> None:
            self.left[name] = bus.run(done, timeout_s=RUN_TIMEOUT_S, stop=self._stop)
            if name == "cloud":  # the cloud stays (serving its state) until the rest left
                bus.run(lambda: False, stop=self._stop)

        thread = threading.Thread(target=serve, name=f"role-{name}", daemon=True)
        thread.start()
        self.threads.append(thread)

    def release(self, round_: int, devices: Collection[str] | None = None) -> None:
        """Let ``devices`` (default: all) train round ``round_``."""
        for name in self.gates if devices is None else devices:
            gate = self.gates[name].get(round_)
            if gate is not None:
                gate.set()

    def wait(self, timeout_s: float = RUN_TIMEOUT_S) -> Outcome:
        """Wait for the run to end (the cloud done, every other role gone on its "done")."""
        others = [n for n in self.buses if n != "cloud"]
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if all(n in self.left for n in others) and "cloud" in self.left:
                break
            time.sleep(0.02)
        seconds = time.monotonic() - self._started
        completed = self.cloud.done and all(self.left.get(n, False) for n in self.buses)
        return Outcome(
            sha=self.cloud.model_sha if self.cloud.done else "",
            completed=completed,
            rounds=list(self.summaries),
            traffic={n: b.traffic for n, b in self.buses.items()},
            seconds=seconds,
            failed=self.cloud.failed,
            left=dict(self.left),
        )

    def close(self) -> None:
        """Stop every role's loop, open every gate and disconnect."""
        self._stop.set()
        for gates in self.gates.values():
            for gate in gates.values():
                gate.set()
        for thread in self.threads:
            thread.join(10)
        for bus in self.buses.values():
            bus.close(timeout_s=2.0)

    def __enter__(self) -> Federation:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def watch_round(hostile: Hostile, topics: Topics, edge: str) -> Callable[[int], EdgeRound]:
    """A function that waits for ``edge``'s announcement of a round (as the hostile client
    sees it on the broker) and returns it; the client must subscribe to the edge's round."""

    def announced(round_: int) -> EdgeRound:
        def find() -> EdgeRound | None:
            for _t, p in hostile.received(topics.edge_round(edge)):
                msg = decode(p, EdgeRound)
                if msg.round == round_:
                    return msg
            return None

        wait_for(lambda: find() is not None, f"{edge}'s announcement of round {round_ + 1}")
        found = find()
        assert found is not None
        return found

    return announced


@dataclass
class LogLines:
    """Log records of WARNING and above, collected while installed on the root logger."""

    lines: list[str] = field(default_factory=list)

    def install(self) -> Iterator[LogLines]:
        """Collect until the generator is closed (use with ``contextlib.contextmanager``)."""
        handler = _Collect(self.lines)
        root = logging.getLogger()
        root.addHandler(handler)
        try:
            yield self
        finally:
            root.removeHandler(handler)

    def matching(self, text: str) -> list[str]:
        """The lines containing ``text``."""
        return [line for line in list(self.lines) if text in line]


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.into.append(record.getMessage())
        except Exception:  # a log record must never break a role's thread
            pass


# -- brokers run as an operator runs them ----------------------------------------------------


class MosquittoProcess:
    """Mosquitto started the way an operator starts it: ``mosquitto -c <conf>`` on the config
    ``estuary provision`` wrote (its listener moved to a free loopback port), or
    ``mosquitto -p <port>`` with stock settings (``conf=None``: the open broker of
    docs/operations.md). Run as root it drops to its own user, as the Debian package does.
    :meth:`rss` is its resident memory, what a flood makes it hold."""

    def __init__(self, conf: Path | None, workdir: Path) -> None:
        from shared.transport.local_broker import find_mosquitto, free_port

        binary = find_mosquitto()
        if binary is None:
            raise AssertionError("mosquitto is not installed")
        self.host, self.port = "127.0.0.1", free_port()
        self.log = workdir / f"mosquitto-{self.port}.log"
        if conf is None:
            args = [binary, "-p", str(self.port)]
        else:
            text = conf.read_text().replace("\nlistener 1883\n",
                                            f"\nlistener {self.port} {self.host}\n")  # fmt: skip
            if f"listener {self.port}" not in text:
                raise AssertionError(f"{conf} has no 'listener 1883' line to move")
            run_conf = workdir / f"mosquitto-{self.port}.conf"
            run_conf.write_text(text)
            run_conf.chmod(0o644)
            args = [binary, "-c", str(run_conf)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT)  # fmt: skip
        end = time.monotonic() + WAIT_S
        while not self._accepts():
            if self.proc.poll() is not None or time.monotonic() > end:
                self.close()
                raise AssertionError(f"mosquitto did not start: {self.log_text()[-2000:]}")
            time.sleep(0.05)

    def _accepts(self) -> bool:
        import socket

        try:
            with socket.create_connection((self.host, self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def rss(self) -> int:
        """The broker's resident memory in bytes (``VmRSS``)."""
        with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def log_text(self) -> str:
        """What the broker logged so far."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> MosquittoProcess:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def retained_under(
    host: str, port: int, pattern: str, *, user: str | None = None,
    password: str | None = None, settle_s: float = 0.5,
) -> list[tuple[str, int]]:  # fmt: skip
    """(topic, payload bytes) of the retained messages the broker holds under ``pattern``,
    as a client that subscribes now receives them."""
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()
    probe = Hostile(host, port, f"probe-{time.time_ns()}", user=user, password=password)
    try:

        def keep(topic: str, payload: bytes) -> None:
            with lock:
                seen.append((topic, len(payload)))

        probe.on_message = keep
        probe.subscribe(pattern)
        time.sleep(settle_s)
    finally:
        probe.close()
    with lock:
        return list(seen)
