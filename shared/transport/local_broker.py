"""A private MQTT broker on a local port, for ``estuary demo`` and the integration tests.

:class:`LocalBroker` runs either

* **mosquitto** as a child process, from a ``mosquitto.conf`` it writes into a work directory
  (log, optional persistence database), listening on one ``host:port`` only; or
* **amqtt**, embedded in this process on a daemon thread with its own asyncio event loop —
  the fallback when no mosquitto binary is installed.

``kind="auto"`` picks mosquitto when :func:`find_mosquitto` finds it, else amqtt.

With a password file or an ACL the mosquitto config binds every client's id to its user name
(``use_username_as_clientid``): the broker ignores the id a client asks for and uses its user
name, so one account cannot disconnect another's connection or take over its session by
claiming its client id. An open broker (neither file) admits anyone under any id.

Caveats of the amqtt fallback: it speaks **MQTT 3.1.1 only** (a v5 CONNECT is refused with
"unsupported protocol version", or its socket is simply closed), so clients must use v3.1.1;
it keeps nothing (retained messages, sessions) across restarts; and it has no password or
ACL files, so ``persistence``, ``password_file`` and ``acl_file`` require mosquitto. It
admits every client through our own auth plugin so durable sessions queue QoS 1 messages
while their client is offline, as mosquitto does.

Start-up waits until the port accepts TCP connections *and* a CONNACK comes back to an MQTT
handshake; any failure raises :class:`~shared.errors.TransportError` carrying the tail of the
broker's log. A :class:`LocalBroker` is not thread-safe: drive it from one thread.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import itertools
import logging
import os
import random
import resource
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import paho.mqtt.client as mqtt

from shared.errors import ConfigError, TransportError
from shared.lifetime import die_with_parent_preexec
from shared.transport.connection import PACKET_OVERHEAD
from shared.transport.embedded_broker import EmbeddedAmqtt
from shared.wire.messages import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

BrokerKind = Literal["auto", "mosquitto", "amqtt"]
BROKER_KINDS: tuple[BrokerKind, ...] = ("auto", "mosquitto", "amqtt")

_SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin")
# Per client. A cloud or edge that (re)subscribes gets every device's retained hello and
# presence at once, 2 per device; beyond this many queued (plus those in flight) mosquitto
# drops the rest. 50,000 holds ~24,900 devices (max_queued_bytes still bounds the bytes);
# mosquitto's default 1,000 only ~500 (a cloud then registers ~1,020 of 2,000). See
# docs/operations.md, "Large federations".
_MAX_QUEUED_MESSAGES = 50_000
_MAX_QUEUED_BYTES = 512 << 20  # per client: bounds chunks queued for an offline subscriber
_MAX_PACKET_BYTES = 65 << 20  # the largest allowed chunk (64 MiB) plus headers: open brokers
#: The broker's heap limit (mosquitto ``memory_limit``) where no run config gives one
#: (:attr:`~shared.config.BrokerSection.broker_memory_bytes` is the setting)
DEFAULT_BROKER_MEMORY_BYTES = 1 << 30
# Outgoing QoS 1/2 messages in flight per client; 20 (mosquitto's default) throttles bursts of
# 1 MiB blobs, 0 (no limit) lets one slow client hoard memory.
_MAX_INFLIGHT_MESSAGES = 100
# With persistence on, how stale the on-disk database may be after a crash (kill()).
_AUTOSAVE_INTERVAL_S = 5
_LOG_TAIL_LINES = 30
_probe_ids = itertools.count()

BIND_CLIENT_ID = "use_username_as_clientid true"
"""The mosquitto.conf line, per listener (after its ``listener`` line: mosquitto 2 applies
it to that listener only), that makes a client's id its user name: no client can claim
another account's id. A client without a user name is refused."""


def secured_packet_bytes(chunk_bytes: int) -> int:
    """The broker's ``max_packet_size`` for a federation whose blob chunks are
    ``chunk_bytes``: the largest packet any role sends (a chunk or the largest message, plus
    headers), what each role also announces as its own Maximum Packet Size."""
    return max(chunk_bytes, MAX_MESSAGE_BYTES) + PACKET_OVERHEAD


def mosquitto_limits(
    *, max_packet_bytes: int = _MAX_PACKET_BYTES, memory_bytes: int = DEFAULT_BROKER_MEMORY_BYTES
) -> list[str]:
    """The mosquitto.conf lines (with comments) that bound packet size, the broker's heap,
    per-client queues and in-flight messages and turn Nagle off: what the local broker, the
    config ``estuary provision`` writes and the shipped compose and Kubernetes configs all
    use (a secured broker with ``max_packet_bytes`` from :func:`secured_packet_bytes`)."""
    return [
        "# a (re)subscribing cloud or edge is sent 2 retained messages per device at once: at",
        "# least 2 x devices + 200 (docs/operations.md, Large federations)",
        f"max_queued_messages {_MAX_QUEUED_MESSAGES}",
        f"max_queued_bytes {_MAX_QUEUED_BYTES}",
        "# the largest packet a role sends (one blob chunk + topic); bigger ones are refused",
        f"max_packet_size {max_packet_bytes}",
        "# the broker's heap: an allocation past it is refused (the publisher disconnected), not",
        "# the host's memory exhausted (docs/reliability.md, Broker)",
        f"memory_limit {memory_bytes}",
        f"max_inflight_messages {_MAX_INFLIGHT_MESSAGES}",
        "# small packets (SUBACK, PUBACK, blob requests) leave at once, no delayed-ACK wait",
        "set_tcp_nodelay true",
    ]


def _broker_preexec(then: Callable[[], None] | None) -> Callable[[], None]:
    """A ``preexec_fn`` that raises the broker's open-file limit to its hard limit (one
    descriptor per client: at the usual soft limit of 1,024 mosquitto refuses the 1,017th
    device), then runs ``then``."""

    def preexec() -> None:
        with contextlib.suppress(Exception):
            _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        if then is not None:
            then()

    return preexec


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_FREE_PORT_TRIES = 64
#: ports :func:`free_port` handed out lately, never handed out twice (their users may not
#: have bound them yet); bounded
_handed_ports: collections.deque[int] = collections.deque(maxlen=4096)
_handed_lock = threading.Lock()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports of outgoing connections (Linux default 32768-60999)."""
    try:
        lo, hi = (int(v) for v in _EPHEMERAL_RANGE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago, for a process started later.

    Taken below the kernel's ephemeral range when there is room: a port the OS hands out for
    ``bind(0)`` can be handed out again, meanwhile, as the local port of some process's
    outgoing connection (every role connects to the broker), and then the process meant to
    listen on it fails with "address already in use". Falls back to ``bind(0)``.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    lo, _ = _ephemeral_range()
    pool = range(max(1024, lo - 16384), lo)
    pick = random.SystemRandom()  # not a reproducibility concern: any free port will do
    for _ in range(_FREE_PORT_TRIES if len(pool) >= 1024 else 0):
        port = pick.choice(pool)
        with _handed_lock, socket.socket(family, socket.SOCK_STREAM) as sock:
            if port in _handed_ports:
                continue
            try:
                sock.bind((host, port))
            except OSError:
                continue
            _handed_ports.append(port)
            return port
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def find_mosquitto() -> str | None:
    """Path of the mosquitto binary on ``PATH`` or in /usr/sbin, /usr/local/sbin, else None."""
    found = shutil.which("mosquitto")
    if found:
        return found
    for folder in _SBIN_DIRS:
        candidate = Path(folder) / "mosquitto"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def amqtt_available() -> bool:
    """Whether the embedded amqtt fallback can be imported."""
    try:
        return importlib.util.find_spec("amqtt") is not None
    except (ImportError, ValueError):  # a broken install, or sys.modules["amqtt"] = None
        return False


class LocalBroker:
    """A broker on ``host:port`` for the lifetime of this object; see the module docstring.

    Args:
        port: TCP port; 0 picks a free one now and keeps it across restarts.
        host: address to listen on (only this one).
        kind: ``"mosquitto"``, ``"amqtt"``, or ``"auto"`` (mosquitto when installed).
        workdir: where mosquitto's config, log and database go; a temporary directory when
            None, removed by :meth:`stop` (but kept by :meth:`kill` and :meth:`restart`).
        persistence: mosquitto saves retained messages and durable sessions on shutdown
            and every few seconds, and reloads them on start.
        password_file: mosquitto password file; anonymous clients are refused when set.
        acl_file: mosquitto ACL file; anonymous clients are refused when set.
        bind_client_ids: with ``password_file`` or ``acl_file``, make each client's id its
            user name (:data:`BIND_CLIENT_ID`), so no account can take over another's
            connection or session. False only for tests that log in beside a running role
            with that role's own credentials to watch what it may read.
        chunk_bytes: the federation's blob chunk size; with ``password_file`` or
            ``acl_file`` the broker refuses packets larger than one chunk plus headers
            (:func:`secured_packet_bytes`), as ``estuary provision``'s broker does. An open
            broker admits anyone anyway and keeps the 64 MiB chunk's limit.
        memory_bytes: the broker's heap limit (mosquitto ``memory_limit``).
        extra_conf: mosquitto.conf lines appended to the config (a bridge stanza to another
            broker: :func:`estuary.provision.bridge_conf`); mosquitto only.

    Use as a context manager (``with LocalBroker() as broker:``) to start and stop it.

    Raises:
        ConfigError: a bad argument, or the requested kind is not installed.
    """

    def __init__(
        self,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        kind: BrokerKind = "auto",
        workdir: Path | None = None,
        persistence: bool = False,
        password_file: Path | None = None,
        acl_file: Path | None = None,
        bind_client_ids: bool = True,
        chunk_bytes: int = 1 << 20,
        memory_bytes: int = DEFAULT_BROKER_MEMORY_BYTES,
        extra_conf: Sequence[str] = (),
    ) -> None:
        if kind not in BROKER_KINDS:
            raise ConfigError(f"broker kind {kind!r} is unknown; use one of {BROKER_KINDS}")
        if not 0 <= port <= 65535:
            raise ConfigError(f"broker port {port} is out of range; use 1-65535, or 0 for any")
        for name, path in (
            ("workdir", workdir),
            ("password_file", password_file),
            ("acl_file", acl_file),
        ):
            if path is not None and any(c in str(path) for c in "\r\n"):
                raise ConfigError(f"broker {name} {str(path)!r} contains a line break")
        if not 4096 <= chunk_bytes <= 64 << 20:
            raise ConfigError(f"broker chunk_bytes {chunk_bytes} is out of range (4 KiB-64 MiB)")
        if memory_bytes < 64 << 20:
            raise ConfigError(f"broker memory_bytes {memory_bytes} is below 64 MiB")
        if any(c in line for line in extra_conf for c in "\r\n"):
            raise ConfigError("broker extra_conf holds a line break inside a line; pass one "
                              "config line per item")  # fmt: skip
        self._extra_conf = list(extra_conf)
        self._chunk_bytes, self._memory_bytes = chunk_bytes, memory_bytes
        self._mosquitto_bin = find_mosquitto()
        self._kind = self._resolve_kind(kind)
        if self._kind == "amqtt" and (persistence or password_file or acl_file or extra_conf):
            raise ConfigError(
                "persistence, password_file, acl_file and extra_conf (a bridge) need mosquitto, "
                "but the broker kind is "
                "amqtt; install mosquitto (apt-get install mosquitto) or drop those options"
            )
        self._host = host
        self._port = port or free_port(host)
        self._workdir_arg = workdir
        self._persistence = persistence
        self._password_file = password_file
        self._acl_file = acl_file
        self._bind_client_ids = bind_client_ids
        self._workdir: Path | None = None
        self._owns_workdir = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._amqtt: EmbeddedAmqtt | None = None

    def _resolve_kind(self, kind: BrokerKind) -> Literal["mosquitto", "amqtt"]:
        if kind in ("auto", "mosquitto") and self._mosquitto_bin:
            return "mosquitto"
        if kind in ("auto", "amqtt") and amqtt_available():
            return "amqtt"
        if kind == "mosquitto":
            raise ConfigError(
                "broker kind 'mosquitto' but no mosquitto binary on PATH or in "
                f"{', '.join(_SBIN_DIRS)}; install it (apt-get install mosquitto) or use 'amqtt'"
            )
        if kind == "amqtt":
            raise ConfigError("broker kind 'amqtt' but amqtt is not installed; pip install amqtt")
        raise ConfigError(
            "no MQTT broker available: install mosquitto (apt-get install mosquitto) "
            "or amqtt (pip install amqtt)"
        )

    @property
    def host(self) -> str:
        """Address the broker listens on."""
        return self._host

    @property
    def port(self) -> int:
        """TCP port the broker listens on (fixed for the object's lifetime)."""
        return self._port

    @property
    def kind(self) -> Literal["mosquitto", "amqtt"]:
        """Which broker runs: ``"mosquitto"`` or ``"amqtt"`` (never ``"auto"``)."""
        return self._kind

    @property
    def url(self) -> str:
        """``mqtt://host:port``."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"mqtt://{host}:{self._port}"

    @property
    def running(self) -> bool:
        """Whether the broker process (or embedded broker thread) is alive."""
        if self._proc is not None:
            return self._proc.poll() is None
        return self._amqtt is not None and self._amqtt.alive

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The latest mosquitto child process, kept after it exits; None for amqtt."""
        return self._proc

    @property
    def log_path(self) -> Path | None:
        """mosquitto's log file while the work directory exists, else None."""
        return self._workdir / "mosquitto.log" if self._workdir else None

    def start(self, timeout_s: float = 10.0) -> LocalBroker:
        """Start the broker and wait until it answers an MQTT CONNECT; no-op when running.

        Raises:
            TransportError: the port is taken, the broker exited, or it did not answer
                within ``timeout_s``; the message holds the tail of the broker's log.
        """
        if self.running:
            return self
        if not _port_is_free(self._host, self._port):
            raise TransportError(
                f"cannot start {self._kind} broker: {self._host}:{self._port} is already in "
                "use; stop whatever holds it or pass another port (port=0 picks a free one)"
            )
        if self._kind == "mosquitto":
            self._start_mosquitto(timeout_s)
        else:
            self._start_amqtt(timeout_s)
        log.info("%s broker ready at %s", self._kind, self.url)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop gracefully (SIGTERM, then SIGKILL after ``timeout_s``); idempotent.

        Removes the work directory when it is a temporary one.
        """
        self._halt(timeout_s)
        if self._workdir is not None and self._owns_workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def kill(self) -> None:
        """Crash the broker (SIGKILL, no shutdown save); amqtt is simply stopped.

        The work directory is kept so a later :meth:`start` sees what a restarted broker
        would see after a crash.
        """
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            _wait_quietly(self._proc, 5.0)
            log.info("mosquitto at %s killed", self.url)
        self._stop_amqtt(5.0)

    def restart(self, timeout_s: float = 10.0) -> LocalBroker:
        """Stop gracefully and start again on the same port and work directory."""
        self._halt(min(timeout_s, 5.0))
        return self.start(timeout_s)

    def __enter__(self) -> LocalBroker:
        try:
            return self.start()
        except BaseException:
            self.stop()  # __exit__ will not run: drop the temporary workdir here
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"LocalBroker(kind={self._kind!r}, url={self.url!r}, {state})"

    def _halt(self, timeout_s: float) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning(
                    "mosquitto at %s ignored SIGTERM for %.1fs; killing", self.url, timeout_s
                )
                proc.kill()
                _wait_quietly(proc, 5.0)
            log.info("mosquitto at %s stopped (exit code %s)", self.url, proc.returncode)
        self._stop_amqtt(timeout_s)

    # -- mosquitto ---------------------------------------------------------------------------

    def _start_mosquitto(self, timeout_s: float) -> None:
        if self._mosquitto_bin is None:  # unreachable: _resolve_kind checked it
            raise ConfigError("mosquitto binary not found")
        workdir = self._ensure_workdir()
        conf = workdir / "mosquitto.conf"
        conf.write_text(self._mosquitto_conf(workdir), encoding="utf-8")
        # Errors before the log file opens (bad config) go to stderr: keep them too.
        with open(workdir / "mosquitto.out", "ab") as out:
            self._proc = subprocess.Popen(
                [self._mosquitto_bin, "-c", str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                start_new_session=False,
                preexec_fn=_broker_preexec(die_with_parent_preexec()),
            )
        proc = self._proc
        log.debug("mosquitto pid %d starting with %s", proc.pid, conf)
        try:
            _wait_ready(self._host, self._port, timeout_s, lambda: proc.poll() is None)
        except TransportError as exc:
            if proc.poll() is None:
                proc.kill()
                _wait_quietly(proc, 5.0)
            raise TransportError(
                f"mosquitto at {self.url} (exit code {proc.returncode}): {exc}\n{self._log_tail()}"
            ) from None

    def _ensure_workdir(self) -> Path:
        if self._workdir is None:
            if self._workdir_arg is not None:
                self._workdir_arg.mkdir(parents=True, exist_ok=True)
                self._workdir, self._owns_workdir = self._workdir_arg.resolve(), False
            else:
                self._workdir = Path(tempfile.mkdtemp(prefix="estuary-mosquitto-"))
                self._owns_workdir = True
        return self._workdir

    def _mosquitto_conf(self, workdir: Path) -> str:
        secured = self._password_file is not None or self._acl_file is not None
        lines = [
            "# Written by estuary shared/transport/local_broker.py on every start; edits are lost.",
            f"listener {self._port} {self._host}",
        ]
        if secured and self._bind_client_ids:
            lines.append(BIND_CLIENT_ID)  # after its listener line: it is a listener option
        lines.append(f"allow_anonymous {'false' if secured else 'true'}")
        if self._password_file is not None:
            lines.append(f"password_file {self._password_file.resolve()}")
        if self._acl_file is not None:
            lines.append(f"acl_file {self._acl_file.resolve()}")
        packet = secured_packet_bytes(self._chunk_bytes) if secured else _MAX_PACKET_BYTES
        lines += [
            *mosquitto_limits(max_packet_bytes=packet, memory_bytes=self._memory_bytes),
            f"persistence {'true' if self._persistence else 'false'}",
            f"persistence_location {workdir}/",
            "persistence_file mosquitto.db",
            f"autosave_interval {_AUTOSAVE_INTERVAL_S}",
            f"log_dest file {workdir / 'mosquitto.log'}",
            *(f"log_type {t}" for t in ("error", "warning", "notice", "information")),
            "log_timestamp true",
            "connection_messages true",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            # As root mosquitto drops to user "mosquitto", which cannot write our workdir.
            lines.append("user root")
        lines += self._extra_conf  # a bridge stanza: after every global option
        return "\n".join(lines) + "\n"

    @property
    def extra_conf(self) -> list[str]:
        """The config lines appended to the generated config (a bridge stanza)."""
        return list(self._extra_conf)

    @extra_conf.setter
    def extra_conf(self, lines: Sequence[str]) -> None:
        """Replace the appended lines; they apply from the next :meth:`start` or
        :meth:`restart` (a site broker restarted without its bridge, and with it again)."""
        if self._kind != "mosquitto" and lines:
            raise ConfigError("extra_conf (a bridge) needs mosquitto")
        self._extra_conf = list(lines)

    def _log_tail(self) -> str:
        if self._workdir is None:
            return "(no broker log)"
        parts = []
        for name in ("mosquitto.out", "mosquitto.log"):
            path = self._workdir / name
            with contextlib.suppress(OSError):
                tail = path.read_text(encoding="utf-8", errors="replace").splitlines()
                if tail:
                    parts.append(f"--- {path} (last lines) ---")
                    parts.extend(tail[-_LOG_TAIL_LINES:])
        return "\n".join(parts) if parts else "(broker log is empty)"

    # -- amqtt -------------------------------------------------------------------------------

    def _start_amqtt(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        embedded = EmbeddedAmqtt(self._host, self._port)
        self._amqtt = embedded
        try:
            embedded.start(timeout_s)
            _wait_ready(self._host, self._port, deadline - time.monotonic(), lambda: embedded.alive)
        except TransportError as exc:
            self._stop_amqtt(2.0)
            raise TransportError(f"amqtt at {self.url}: {exc}") from None

    def _stop_amqtt(self, timeout_s: float) -> None:
        if self._amqtt is not None:
            self._amqtt.stop(timeout_s)
            self._amqtt = None
            log.info("amqtt at %s stopped", self.url)


# -- helpers -----------------------------------------------------------------------------------


def _port_is_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (SO_REUSEADDR, as brokers bind)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _wait_ready(host: str, port: int, timeout_s: float, alive: Callable[[], bool]) -> None:
    """Poll until the port accepts TCP and answers MQTT; raise TransportError otherwise."""
    deadline = time.monotonic() + max(timeout_s, 0.0)
    while True:
        if not alive():
            raise TransportError("broker exited during start-up")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransportError(f"no CONNACK within {timeout_s:.1f}s of starting")
        # paho's connect() is the TCP check; a bare TCP probe only adds broker log noise.
        if _mqtt_connack(host, port, min(remaining, 2.0)) and alive():
            return  # alive(): a CONNACK from someone else's broker does not count
        time.sleep(0.05)


def _mqtt_connack(host: str, port: int, timeout_s: float) -> bool:
    """Whether a v3.1.1 CONNECT gets a CONNACK (any reason code: the broker is up)."""
    if timeout_s <= 0:
        return False
    got_connack = threading.Event()

    def on_connect(*_: Any) -> None:
        got_connack.set()

    client = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id=f"estuary-broker-probe-{os.getpid()}-{next(_probe_ids)}",
        protocol=mqtt.MQTTv311,
    )
    client.on_connect = on_connect
    client.connect_timeout = timeout_s
    deadline = time.monotonic() + timeout_s
    try:
        client.connect(host, port, keepalive=10)
        while not got_connack.is_set() and time.monotonic() < deadline:
            if client.loop(timeout=0.05) != mqtt.MQTT_ERR_SUCCESS:
                break
        if got_connack.is_set():
            client.disconnect()
    except (OSError, ValueError):
        return False
    finally:
        sock = client.socket()
        if sock is not None:
            sock.close()
    return got_connack.is_set()


def _wait_quietly(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.error("broker pid %d still alive %.1fs after SIGKILL", proc.pid, timeout_s)
