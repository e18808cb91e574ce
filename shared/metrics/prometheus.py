"""Prometheus metrics for one role instance (cloud, edge or device), served on ``/metrics``.

Every :class:`RoleMetrics` owns its own :class:`~prometheus_client.CollectorRegistry`, so
several roles can live in one process (tests, ``estuary simulate``) without colliding; the
global ``REGISTRY`` is never touched. Which role and instance a scrape came from is carried by
``estuary_info{role,instance} 1``; Prometheus adds ``job``/``instance`` target labels itself.

Traffic counters are not copied into prometheus objects on every message: a custom collector
reads :class:`~shared.transport.telemetry.Traffic` at scrape time and exposes

- ``estuary_bytes_total{direction,kind}`` and ``estuary_messages_total{direction,kind}``,
- ``estuary_rejected_messages_total{role,reason}``,
- ``estuary_transport_<name>_total`` for each transport counter (``wire_bytes_sent``, ...).

Names follow the Prometheus rules: counters end in ``_total``, units (``_seconds``,
``_bytes``) come before it.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from shared.errors import CodecError, ConfigError, TransportError
from shared.transport.telemetry import Traffic

log = logging.getLogger(__name__)

ROLES: Final = ("cloud", "edge", "device", "observer")  # observer: estuary status
PHASES: Final = (
    "idle", "scoring", "waiting", "training", "aggregating", "deploying", "done"
)  # fmt: skip
"""States of ``estuary_phase``; the first one is the state a fresh role starts in."""
UPDATE_OUTCOMES: Final = ("accepted", "rejected", "late", "duplicate")
DEPLOY_OUTCOMES: Final = ("loaded", "refused")
#: what a device did with its state file (``--state-dir``, :mod:`device_agent.state`)
STATE_EVENTS: Final = ("saved", "restored", "set_aside", "save_failed")

# Round, aggregation and training times range from a fraction of a second (tiny test models)
# to about an hour (a real local epoch on a slow device).
DURATION_BUCKETS: Final = (
    0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
)  # fmt: skip
AGGREGATION_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
)  # fmt: skip
# One sampled image: milliseconds for a pruned model on a GPU, minutes for many steps on a CPU.
SAMPLING_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0,
    600.0,
)  # fmt: skip

STOP_TIMEOUT_S: Final = 5.0
#: WSGI name of the header Prometheus sends with every scrape (health probes do not)
PROMETHEUS_SCRAPE_HEADER: Final = "HTTP_X_PROMETHEUS_SCRAPE_TIMEOUT_SECONDS"
_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


def metric_name_part(name: str) -> str:
    """``name`` reduced to ``[a-zA-Z0-9_]`` (other characters become ``_``)."""
    return _UNSAFE.sub("_", name)


def _split_key(key: str) -> tuple[str, str]:
    """``"a:b"`` to ``("a", "b")``; only the first colon splits, so ``b`` may contain colons."""
    first, sep, rest = key.partition(":")
    return (first, rest) if sep else ("", first)


class TrafficCollector(Collector):
    """Exposes a :class:`Traffic` as counter families, read fresh on every scrape."""

    def __init__(self, traffic: Traffic) -> None:
        self._traffic = traffic

    def collect(self) -> Iterable[Metric]:
        """Byte, message, rejection and transport counters as they stand now."""
        snap = self._traffic.snapshot()
        yield self._by_direction("estuary_bytes", "Payload bytes by direction and kind.", snap)
        yield self._by_direction("estuary_messages", "Messages by direction and kind.", snap)
        rejected = CounterMetricFamily(
            "estuary_rejected_messages",
            "Messages rejected, by rejecting role and reason.",
            labels=("role", "reason"),
        )
        for key, n in snap["rejected"].items():
            rejected.add_metric(list(_split_key(key)), n)
        yield rejected
        yield from self._transport()

    @staticmethod
    def _by_direction(name: str, doc: str, snap: dict[str, dict[str, int]]) -> Metric:
        family = CounterMetricFamily(name, doc, labels=("direction", "kind"))
        for key, n in snap[name.removeprefix("estuary_")].items():
            family.add_metric(list(_split_key(key)), n)
        return family

    def _transport(self) -> Iterator[Metric]:
        # Names that sanitise to the same metric are summed rather than exposed twice.
        merged: dict[str, float] = {}
        for raw, value in self._traffic.transport().items():
            part = metric_name_part(raw).removesuffix("_total")
            if not part:
                continue
            merged[part] = merged.get(part, 0.0) + value
        for part, value in sorted(merged.items()):
            # CounterMetricFamily appends ``_total`` itself on exposition.
            yield CounterMetricFamily(
                f"estuary_transport_{part}", f"Transport counter {part}.", value=value
            )


class RoleMetrics:
    """The metrics of one role instance, in a registry of its own.

    The attributes are plain prometheus_client objects for the service to update:
    ``round``, ``round_started`` and ``round_deadline`` (the cloud's open round: when it opened
    and how long it may stay open), ``phase`` (states :data:`PHASES`), ``round_seconds``,
    ``aggregation_seconds``, ``training_seconds``, ``devices`` (label ``edge``), ``sh_score``
    (label ``edge``), ``model_params``, ``model_bytes``, ``training_images``,
    ``skipped_image_files`` and ``device_state`` (label ``event``, :data:`STATE_EVENTS`)
    (devices only), ``images_generated``,
    ``sampling_seconds``, ``images_per_second``, ``deployments`` (label ``outcome``,
    :data:`DEPLOY_OUTCOMES`), ``deployed`` (label ``sha256``), ``deployment_version`` (the
    served deployment's version serial) and ``updates`` (label
    ``outcome``, one of :data:`UPDATE_OUTCOMES`). The registry also carries the traffic
    counters (:class:`TrafficCollector`) and the process's CPU time, memory, open files and
    start time (prometheus_client's ``process_*`` metrics).
    """

    def __init__(self, role: str, name: str, traffic: Traffic | None = None) -> None:
        if role not in ROLES:
            raise ConfigError(f"metrics role {role!r} is not one of {', '.join(ROLES)}")
        if not name:
            raise ConfigError("metrics instance name is empty; pass the role's id, e.g. 'edge0'")
        self.role = role
        self.name = name
        self.traffic = traffic if traffic is not None else Traffic()
        self.registry = CollectorRegistry()
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # Prometheus scrapes: sequence numbers of the last one begun and the last one answered
        self._scrapes = threading.Condition()
        self._scrape_begun = self._scrape_answered = 0
        reg = self.registry

        info = Gauge(
            "estuary_info", "Role and instance of this process.", ("role", "instance"), registry=reg
        )
        info.labels(role=role, instance=name).set(1)
        self.round = Gauge(
            "estuary_round",
            "Rounds completed (the 0-based index of the round in progress).",
            registry=reg,
        )
        self.round_started = Gauge(
            "estuary_round_start_time_seconds",
            "Unix time the current round opened (cloud).",
            registry=reg,
        )
        self.round_deadline = Gauge(
            "estuary_round_deadline_seconds",
            "How long the current round may stay open before it is closed (cloud).",
            registry=reg,
        )
        self.phase = Enum(
            "estuary_phase", "What the role is doing now.", states=list(PHASES), registry=reg
        )
        self.round_seconds = Histogram(
            "estuary_round_duration_seconds",
            "Wall time of one federated round.",
            buckets=DURATION_BUCKETS,
            registry=reg,
        )
        self.aggregation_seconds = Histogram(
            "estuary_aggregation_duration_seconds",
            "Time to aggregate one round's updates.",
            buckets=AGGREGATION_BUCKETS,
            registry=reg,
        )
        self.training_seconds = Histogram(
            "estuary_training_duration_seconds",
            "Time of one local training run.",
            buckets=DURATION_BUCKETS,
            registry=reg,
        )
        self.devices = Gauge(
            "estuary_connected_devices", "Devices connected, per edge.", ("edge",), registry=reg
        )
        self.sh_score = Gauge("estuary_sh_score", "SH score, per edge.", ("edge",), registry=reg)
        self.model_params = Gauge("estuary_model_params", "Model parameters.", registry=reg)
        self.model_bytes = Gauge("estuary_model_bytes", "Encoded model size.", registry=reg)
        self.algorithm_figure = Gauge(
            "estuary_algorithm_figure",
            "A figure the algorithm reports of the global state after each aggregation "
            "(PRISM: mask density, MADA lambda, privacy loss epsilon spent).",
            ("figure",),
            registry=reg,
        )
        device_reg = reg if role == "device" else None  # the next three exist on devices only
        self.training_images = Gauge(
            "estuary_training_images",
            "Images this device trains on (its share of the split, or its own folder).",
            registry=device_reg,
        )
        self.skipped_image_files = Gauge(
            "estuary_skipped_image_files",
            "Files in this device's image folder that are not readable images (skipped).",
            registry=device_reg,
        )
        self.device_state = Counter(
            "estuary_device_state",
            "This device's state file (--state-dir), by event (saved, restored, set_aside: "
            "unusable and moved aside, save_failed).",
            ("event",),
            registry=device_reg,
        )
        for event in STATE_EVENTS:
            self.device_state.labels(event=event)
        self.images_generated = Counter(
            "estuary_images_generated", "Images sampled from the model.", registry=reg
        )
        self.sampling_seconds = Histogram(
            "estuary_sampling_latency_seconds",
            "Latency of one sampling call.",
            buckets=SAMPLING_BUCKETS,
            registry=reg,
        )
        self.images_per_second = Gauge(
            "estuary_sampling_images_per_second",
            "Throughput of the last sampling call.",
            registry=reg,
        )
        self.deployments = Counter(
            "estuary_deployments",
            "Deployments received, by outcome (loaded, refused).",
            ("outcome",),
            registry=reg,
        )
        for outcome in DEPLOY_OUTCOMES:
            self.deployments.labels(outcome=outcome)
        self.deployed = Gauge(
            "estuary_deployed_model",
            "The model in service (1 for its sha256 prefix).",
            ("sha256",),
            registry=reg,
        )
        self.deployment_version = Gauge(
            "estuary_deployment_version",
            "Version (export serial, milliseconds since the epoch) of the deployment in "
            "service; 0: none, or one exported before deployments had versions.",
            registry=reg,
        )
        self.updates = Counter(
            "estuary_updates", "Model updates received, by outcome.", ("outcome",), registry=reg
        )
        for outcome in UPDATE_OUTCOMES:
            self.updates.labels(outcome=outcome)  # exposed as 0 before the first update
        reg.register(TrafficCollector(self.traffic))
        # the process's load: process_cpu_seconds_total, process_resident_memory_bytes,
        # process_open_fds / process_max_fds, process_start_time_seconds (Linux /proc)
        ProcessCollector(registry=reg)

    @property
    def port(self) -> int | None:
        """The port ``/metrics`` is served on, or ``None`` when not serving."""
        with self._lock:
            return None if self._server is None else int(self._server.server_port)

    def serve(self, port: int = 0, addr: str = "0.0.0.0") -> int:
        """Serve this registry over HTTP on ``addr:port`` (0 picks a free port); returns it."""
        with self._lock:
            if self._server is not None:
                raise ConfigError(
                    f"metrics of {self.name} already served on port {self._server.server_port};"
                    " call stop() first"
                )
            try:
                server = _make_server(addr, port, self._app())
            except OSError as exc:
                raise ConfigError(
                    f"cannot serve metrics on {addr}:{port} ({exc}); pick a free port or 0"
                ) from exc
            thread = threading.Thread(
                target=server.serve_forever, name=f"metrics-{self.name}", daemon=True
            )
            thread.start()
            self._server, self._thread = server, thread
            bound = int(server.server_port)
        log.info("%s %s metrics on http://%s:%d/metrics", self.role, self.name, addr, bound)
        return bound

    def _app(self) -> Callable[..., Iterable[bytes]]:
        """prometheus_client's WSGI app, noting which requests are Prometheus scrapes."""
        app = make_wsgi_app(self.registry)

        def noting(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            if PROMETHEUS_SCRAPE_HEADER not in environ:
                return app(environ, start_response)  # a health probe, a person, a test
            with self._scrapes:
                self._scrape_begun += 1
                mine = self._scrape_begun
            body = app(environ, start_response)  # the whole exposition, rendered now
            with self._scrapes:
                self._scrape_answered = max(self._scrape_answered, mine)
                self._scrapes.notify_all()
            return body

        return noting

    def wait_for_scrape(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until Prometheus has scraped a rendering made after
        this call, so the final state (phase ``done``, last counters) is recorded before the
        process exits; False on timeout or when not serving."""
        if self.port is None:
            return False
        with self._scrapes:
            mark = self._scrape_begun
            return self._scrapes.wait_for(lambda: self._scrape_answered > mark, timeout_s)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop serving and free the port; waits at most about ``timeout_s``. Idempotent."""
        with self._lock:
            server, thread = self._server, self._thread
            self._server = self._thread = None
        if server is None:
            return
        # shutdown() blocks until serve_forever next wakes (every 0.5 s); run it aside so the
        # wait is bounded, and wake the loop with a connection so stopping takes milliseconds.
        closer = threading.Thread(target=server.shutdown, daemon=True)
        closer.start()
        deadline = time.monotonic() + timeout_s
        while closer.is_alive() and time.monotonic() < deadline:
            _wake(server)
            closer.join(0.05)
        server.server_close()
        if thread is not None:
            thread.join(timeout_s)
        if closer.is_alive() or (thread is not None and thread.is_alive()):
            log.warning("metrics server of %s did not stop within %.1f s", self.name, timeout_s)

    def render(self) -> bytes:
        """The exposition text of this registry, as a scrape would return it."""
        return generate_latest(self.registry)


def _wake(server: WSGIServer) -> None:
    """Open and close one connection to ``server`` so its select() returns now."""
    host, port = server.server_address[:2]
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(str(host), str(host))
    try:
        with socket.create_connection((host, int(port)), timeout=0.2):
            pass
    except OSError:
        pass  # the server's own poll interval still ends the loop


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def sample_key(name: str, labels: dict[str, str]) -> str:
    """``name{a="x",b="y"}`` with labels sorted by name, or ``name`` when there are none."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def parse_exposition(text: str) -> dict[str, float]:
    """Prometheus text exposition to ``{sample_key: value}``."""
    try:
        return {
            sample_key(s.name, s.labels): float(s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
    except ValueError as exc:
        raise CodecError(f"not a Prometheus exposition: {exc}") from exc


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """GET a ``/metrics`` URL and return its samples as ``{'name{label="v",...}': value}``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8")
    except (urllib.error.URLError, OSError) as exc:
        raise TransportError(f"cannot scrape {url}: {exc}") from exc
    return parse_exposition(text)


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _make_server(addr: str, port: int, app: Callable[..., Iterable[bytes]]) -> WSGIServer:
    """A threading WSGI server for ``app`` on ``addr:port`` (IPv4 or IPv6, as ``addr`` is)."""
    info = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = info[0]

    class Server(ThreadingWSGIServer):
        address_family = family

    return make_server(str(sockaddr[0]), port, app, Server, handler_class=_QuietHandler)
