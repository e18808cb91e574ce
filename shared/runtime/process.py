"""Plumbing every role process shares: arguments, logging, the MQTT connection, the
Prometheus endpoint, signals, and a clean goodbye.

``python -m cloud``, ``python -m edge_node`` and ``python -m device_agent`` (and the
``estuary cloud|edge|device`` subcommands, which call the same functions) are configured by a
TOML/JSON config file plus ``ESTUARY__SECTION__KEY`` environment variables; the few command
line options here override the deployment settings (broker address, metrics port). Each
role's ``main()`` is :func:`run_role` with the role's own parser and start function.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

from shared.atomic import atomic_write
from shared.config import BrokerSection, RunConfig, load_config, with_overrides
from shared.errors import EstuaryError
from shared.lifetime import die_with_parent
from shared.logs import escaping_handler
from shared.runtime.service import RoleService
from shared.transport.mqtt import MqttBus
from shared.wire.codec import spec_bytes
from shared.wire.messages import CloudState, Presence, encode, home_of

log = logging.getLogger(__name__)

EXIT_OK, EXIT_ERROR, EXIT_INTERRUPTED = 0, 2, 130

Serve = Callable[[], int]
"""A role's serving body: runs until the role is done and returns the exit code."""


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Options shared by the three role processes."""
    p.add_argument("config", help="run config (TOML, or the config.json of a run)")
    p.add_argument("--broker", help="HOST:PORT of the MQTT broker (overrides broker.host/port)")
    p.add_argument(
        "--metrics-port", type=int, help="Prometheus /metrics port (0 = any free port, -1 = off)"
    )
    p.add_argument(
        "--metrics-port-file",
        help="write the bound /metrics port to this file once serving (with --metrics-port 0)",
    )
    p.add_argument("--log-level", default=os.environ.get("ESTUARY_LOG_LEVEL", "INFO"))
    p.add_argument(
        "--stay",
        action="store_true",
        help="keep running after the run is done, until stopped (the cloud keeps serving its "
        "state and the deployed model's blobs; edges and devices stay connected)",
    )


def load_role_config(args: argparse.Namespace) -> RunConfig:
    """The config file plus environment overrides, then the command-line overrides."""
    cfg = load_config(args.config)
    updates: dict[str, dict[str, object]] = {}
    if args.broker:
        host, _, port = args.broker.rpartition(":")
        if not host or not port.isdigit():
            raise EstuaryError(f"--broker must be HOST:PORT, got {args.broker!r}")
        updates["broker"] = {"host": host, "port": int(port)}
    for flag, section, key in (
        ("data", "data", "local_dir"),
        ("reference", "eval", "reference_dir"),
    ):
        if getattr(args, flag, None):
            if cfg.data.dataset != "folder":
                raise EstuaryError(
                    f"--{flag} names an image folder of this process's own, but the run's "
                    f"config says data.dataset = {cfg.data.dataset!r}; every role must run "
                    "with data.dataset = 'folder' for that"
                )
            updates[section] = {key: getattr(args, flag)}
    if args.metrics_port is not None:
        if args.metrics_port < -1:
            raise EstuaryError(f"--metrics-port must be >= -1, got {args.metrics_port}")
        updates["metrics"] = {"enabled": args.metrics_port >= 0, "port": max(0, args.metrics_port)}
    if getattr(args, "metrics_port_file", None):
        updates.setdefault("metrics", {})["port_file"] = args.metrics_port_file
    return with_overrides(cfg, updates, source="command line") if updates else cfg


def setup_logging(level: str, name: str) -> None:
    """Timestamped log lines tagged with the instance name."""
    fmt = f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s"
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        handlers=[escaping_handler(sys.stdout, fmt)],  # wire text never breaks a line
        force=True,
    )


def run_role(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    instance: Callable[[argparse.Namespace], str],
    start: Callable[[argparse.Namespace, RunConfig], Serve],
    role_log: logging.Logger,
) -> int:
    """A role process from its arguments to its exit code.

    Parses ``argv`` with ``parser``, logs as ``instance(args)`` (the instance name), dies
    with its parent, loads the role config, then calls ``start(args, cfg)``: the role's own
    checks and set-up, up to connecting its bus, returning the serving body. An EstuaryError
    from loading or starting is logged on ``role_log`` and exits with EXIT_ERROR; otherwise
    the exit code is the serving body's.
    """
    args = parser.parse_args(argv)
    setup_logging(args.log_level, instance(args))
    die_with_parent()
    try:
        cfg = load_role_config(args)
        serve = start(args, cfg)
    except EstuaryError as err:
        role_log.error("%s", err)
        return EXIT_ERROR
    return serve()


@contextlib.contextmanager
def interrupts_as_keyboard() -> Iterator[None]:
    """SIGTERM and SIGINT raise KeyboardInterrupt (also when SIGINT was inherited as ignored,
    as in background jobs), so every shutdown path runs the same ``finally``."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def blob_bytes(cfg: RunConfig) -> tuple[int, bool]:
    """The largest blob a round of ``cfg`` moves (bytes of the algorithm's global state or
    of a device's upload, for the dense model), and whether a round moves one blob per
    device through the cloud (forwarded uploads, personal models). Falls back to the dense
    model's bytes when the algorithm cannot be made here (a tool on a machine without the
    run's GPU)."""
    from shared.methods.registry import make_algorithm
    from shared.models.plan import model_spec

    dense = model_spec(cfg.model.preset, None)
    try:
        algorithm = make_algorithm(cfg)
        state = algorithm.format.global_spec(dense)
        upload = algorithm.format.upload_spec(state)
    except EstuaryError as err:
        log.debug("blob limits from the model alone (%s)", err)
        return spec_bytes(dense), False
    largest = max(spec_bytes(dense), spec_bytes(state), spec_bytes(upload))
    traffic = algorithm.traffic
    return largest, traffic.cloud_sees == "every_upload" or traffic.downlink == "per_device"


def role_broker_settings(
    cfg: RunConfig, service_role: str, cache_dir: Path | None = None
) -> BrokerSection:
    """``cfg.broker`` as a ``service_role`` process uses it: the blob-store limits left
    ``"auto"`` sized from the run's model (:meth:`~shared.config.BrokerSection.with_blob_limits`;
    the cloud and the edges of an algorithm with a blob per device, pFedGPA's personal
    models and the uploads an edge forwards, get room for one per device of the federation
    besides) and ``cache_dir`` as the disk cache unless the config names one."""
    settings = cfg.broker
    if settings.blob_limits_auto:
        unit, per_device = blob_bytes(cfg)
        holds_per_device = per_device and service_role in ("cloud", "edge")
        settings = settings.with_blob_limits(
            unit, cfg.federation.num_devices if holds_per_device else 0
        )
    if cache_dir is not None and not settings.cache_dir:
        settings = settings.model_copy(update={"cache_dir": str(cache_dir)})
    return settings


def connect_bus(
    cfg: RunConfig,
    service_role: str,
    name: str,
    cache_dir: Path | None,
    *,
    will: bool = True,
    home: str | None = None,
) -> MqttBus:
    """The MQTT connection of one role instance, with its presence as the last will (unless
    ``will`` is False: a tool speaking for a role, like ``estuary deploy``, must not mark
    that role offline when the tool itself drops), serving blobs under ``home`` (default
    the role's, :func:`home_of`); its settings are :func:`role_broker_settings`."""
    settings = role_broker_settings(cfg, service_role, cache_dir)
    log.debug("%s: blob store limits %d bytes in memory, %d on disk", name,
              settings.memory_limit_bytes, settings.cache_limit_bytes)  # fmt: skip
    home = home if home is not None else home_of(service_role, name)
    last_will = (
        encode(Presence(name=name, role=service_role, online=False))  # type: ignore[arg-type]
        if will
        else None
    )
    bus = MqttBus(
        settings, run=cfg.run.name, client_id=f"{cfg.run.name}-{name}", home=home, will=last_will
    )
    return bus.connect()


def follow_cloud(service: RoleService, on_done: Callable[[], None]) -> None:
    """Call ``on_done`` (once) when the cloud says the run of this config is over.

    A "done" counts when this process took part in that session (it did a round's work in
    it: :meth:`~shared.runtime.service.RoleService.worked_in_session`) or while the cloud is
    online (its retained presence). A finished run's retained "done", with its cloud gone,
    is stale: a process started to run the config again waits for the new cloud, which
    replaces that state with its own before it says it is online, instead of leaving at
    once (and leaving the new cloud to run every round with no one)."""
    digest = service.cfg.digest()
    state: CloudState | None = None  # the cloud's latest
    online = ended = False
    told: set[str] = set()  # the stale sessions already logged

    def check() -> None:
        nonlocal ended
        if ended or state is None or not state.done_for(digest):
            return
        if online or state.session == service.worked_in_session():
            ended = True
            on_done()
        elif state.session not in told and len(told) < 16:
            told.add(state.session)
            log.info(
                "%s: the broker holds a finished run's state (session %s) and no cloud is "
                "online: waiting for this run's cloud", service.name, state.session,
            )  # fmt: skip

    def on_state(msg: CloudState) -> None:
        nonlocal state
        state = msg
        check()

    def on_presence(msg: Presence) -> None:
        nonlocal online
        if msg.role == "cloud":
            online = msg.online
            check()

    service.on(service.topics.cloud_state, CloudState, on_state, "msg_cloud_state")
    service.on(service.topics.status(home_of("cloud", "cloud")), Presence, on_presence,
               "msg_presence")  # fmt: skip


def serve_metrics(service: RoleService, cfg: RunConfig) -> int | None:
    """Start ``/metrics`` for ``service`` when enabled; returns the bound port, which is
    also written to ``metrics.port_file`` when the config names one."""
    if not cfg.metrics.enabled:
        return None
    port = service.metrics.serve(cfg.metrics.port, cfg.metrics.addr)  # it logs the address
    if cfg.metrics.port_file:
        try:
            atomic_write(Path(cfg.metrics.port_file), f"{port}\n".encode())
        except OSError as exc:
            raise EstuaryError(
                f"cannot write the metrics port to {cfg.metrics.port_file}: {exc}"
            ) from exc
    return port


def serve_until_cloud_done(service: RoleService, bus: MqttBus, *, stay: bool) -> int:
    """Edge/device process body: metrics, start, dispatch until the cloud reports the run
    done (forever with ``stay``); returns the exit code."""
    finished: list[bool] = []
    if not stay:
        follow_cloud(service, lambda: finished.append(True))
    serve_metrics(service, service.cfg)
    service.start()
    log.info("%s serving", service.name)
    return run_until_done(service, bus, lambda: bool(finished))


def run_until_done(
    service: RoleService,
    bus: MqttBus,
    done: Callable[[], bool],
    *,
    linger_s: float = 1.0,
) -> int:
    """Dispatch until ``done()``; on any exit say goodbye, flush and disconnect.

    Returns the process exit code (0 done, 130 interrupted, 2 error).
    """
    code = EXIT_OK
    try:
        with interrupts_as_keyboard():
            bus.run(done)
            if linger_s > 0:  # let last messages (reports, retained state) go out
                bus.pump(linger_s)
    except KeyboardInterrupt as why:
        log.warning("%s: interrupted (%s); shutting down", service.name, why or "SIGINT")
        code = EXIT_INTERRUPTED
    except EstuaryError as err:
        log.error("%s: %s", service.name, err)
        code = EXIT_ERROR
    finally:
        with contextlib.suppress(Exception):
            service.stop()
        t0 = time.monotonic()
        bus.close()
        closed_s = time.monotonic() - t0
        wait_s = service.cfg.metrics.final_scrape_s
        if code == EXIT_OK and wait_s > 0 and service.metrics.port is not None:
            # the alerts tell a finished run from a crash by the last phase Prometheus saw
            seen = service.metrics.wait_for_scrape(wait_s)
            log.info("%s: final state %s", service.name,
                     "scraped" if seen else f"not scraped within {wait_s:g} s")  # fmt: skip
        service.metrics.stop()
        log.info("%s: disconnected (%.2fs)", service.name, closed_s)
    return code
