"""``estuary status CONFIG``: where a federation stands, read from the broker.

Every role keeps its current state retained on the broker: the cloud's phase, round and
global model (``cloud/state``), every role's presence (``.../status``, which the broker turns
to offline as the last will of a role that drops), each edge's state (``edge/{e}/state``),
each device's registration (``device/{d}/hello``) and its last deployment report
(``device/{d}/deploy``). This command subscribes to those topics for ``--wait-s`` seconds
and prints them, so an operator sees a live federation from any machine that reaches the
broker, without Prometheus, and changes nothing: it publishes no presence and has no last
will, and it listens under a home of its own (``observer/...``), so it never answers a role's
blob requests. Every message is validated like the roles do; one that does not parse or
comes from the wrong sender is counted and named, and the rest are shown.

With a broker per edge site (``federation.brokers = "per-edge"``) the federation is read from
the cloud broker, where the bridges bring every edge's and device's retained state; given a
run directory of ``estuary demo`` (its :data:`BROKERS_FILE`) it also lists every broker and
whether each edge site's bridge is up (:func:`broker_views`).

It needs read access to those topics (:func:`observer_topics`): on a provisioned broker run it
as the ``observer`` account, which may read them and nothing else (no updates, no model
blobs), never with a role's credentials: the broker binds each client id to its
account, so a second login with a running role's account would disconnect that role.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from shared.config import RunConfig
from shared.errors import EstuaryError
from shared.logs import printable
from shared.naming import device_name, edge_ids
from shared.runtime.service import RoleService
from shared.transport.mqtt import MqttBus
from shared.wire.messages import (
    CloudState,
    Deployment,
    DeploymentReport,
    DeviceHello,
    EdgeState,
    Presence,
    Topics,
)

#: the account ``estuary provision`` makes for this command: it may read only these topics
OBSERVER = "observer"


#: what the status command reads, as (topic of :class:`Topics`, message type, handler of
#: :class:`StatusObserver`, traffic kind): its subscriptions and the observer account's ACL
_READS: list[tuple[Callable[[Topics], str], type[BaseModel], str, str]] = [
    (lambda t: t.cloud_state, CloudState, "_cloud", "msg_cloud_state"),
    (lambda t: t.status("cloud"), Presence, "_presence", "msg_presence"),
    (lambda t: t.all_edge_status, Presence, "_presence", "msg_presence"),
    (lambda t: t.all_device_status, Presence, "_presence", "msg_presence"),
    (lambda t: t.all_edge_state, EdgeState, "_edge_state", "msg_edge_state"),
    (lambda t: t.all_device_hello, DeviceHello, "_hello", "msg_hello"),
    (lambda t: t.all_device_deploy, DeploymentReport, "_report", "msg_deploy_report"),
    (lambda t: t.cloud_deploy, Deployment, "_deployment", "msg_deployment"),
]


def observer_topics(topics: Topics) -> list[str]:
    """Every topic (pattern) the status command reads: the ACL of the observer account."""
    return [topic(topics) for topic, *_ in _READS]


#: seconds a broker that is up takes at most to accept a TCP connection
CONNECT_CHECK_S = 3.0
#: seconds to listen for retained messages, by default
DEFAULT_WAIT_S = 2.0
#: the most seconds one may ask to listen
MAX_WAIT_S = 600.0
#: ``--watch``: seconds between reports by default, and the fewest one may ask for
DEFAULT_EVERY_S = 5.0
MIN_EVERY_S = 0.2
#: ``--for-s``: how long ``--watch`` keeps watching by default, and at most (a week)
DEFAULT_WATCH_S = 3600.0
MAX_WATCH_S = 7 * 24 * 3600.0


@dataclass
class EdgeView:
    """What the broker holds for one edge."""

    online: bool | None = None  # None: no presence retained
    state: EdgeState | None = None


@dataclass
class DeviceView:
    """What the broker holds for one device."""

    online: bool | None = None
    hello: DeviceHello | None = None
    report: DeploymentReport | None = None


@dataclass
class FederationStatus:
    """A federation as its retained messages describe it."""

    run: str
    digest: str  # of the config this command was given
    rounds: int
    cloud: CloudState | None = None
    cloud_online: bool | None = None
    edges: dict[str, EdgeView] = field(default_factory=dict)
    devices: dict[str, DeviceView] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> count
    #: the retained deployment's :attr:`~Deployment.ident` (None: none retained)
    deployment: str | None = None

    def current_report(self, view: DeviceView) -> DeploymentReport | None:
        """``view``'s report if it is about the deployment retained now, or, about no
        deployment (a device's own classifier), if it names the session of the cloud state
        retained now and no deployment is retained; a report of an earlier run under this
        name is not shown."""
        r = view.report
        if r is None or r.deployment != self.deployment:
            return None
        if r.deployment is None and (self.cloud is None or r.session != self.cloud.session):
            return None
        return r

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``--json``)."""

        def dump(msg: Any) -> Any:
            return None if msg is None else msg.model_dump(mode="json")

        return {
            "run": self.run,
            "config_digest": self.digest,
            "same_config": None if self.cloud is None else self.cloud.config_digest == self.digest,
            "rounds": self.rounds,
            "cloud": {"online": self.cloud_online, "state": dump(self.cloud)},
            "edges": {
                e: {"online": v.online, "state": dump(v.state)} for e, v in self.edges.items()
            },
            "devices": {
                d: {
                    "online": v.online,
                    "hello": dump(v.hello),
                    "deploy": dump(self.current_report(v)),
                }
                for d, v in self.devices.items()
            },
            "rejected": self.rejected,
        }


class StatusObserver(RoleService):
    """A read-only endpoint that records the retained state of one run."""

    role = "observer"

    def __init__(self, name: str, cfg: RunConfig, bus: Any) -> None:
        super().__init__(name, cfg, bus)
        self.status = FederationStatus(
            cfg.run.name, cfg.digest(), cfg.run.rounds,
            edges={e: EdgeView() for e in edge_ids(cfg)},
            devices={device_name(i): DeviceView() for i in range(cfg.federation.num_devices)},
        )  # fmt: skip

    def start(self) -> None:
        """Subscribe to every retained topic of the run (no presence of its own)."""
        for topic, msg_type, handler, kind in _READS:
            cleared = self._deployment_cleared if msg_type is Deployment else None
            self.on(topic(self.topics), msg_type, getattr(self, handler), kind, on_clear=cleared)

    # Only this config's edges and devices are shown: the views stay bounded whatever names
    # the broker holds, and the others are counted as rejected.
    def _edge(self, name: str) -> EdgeView | None:
        view = self.status.edges.get(name)
        if view is None:
            self.reject("unknown_instance", f"edge {name!r} is not in this config")
        return view

    def _device(self, name: str) -> DeviceView | None:
        view = self.status.devices.get(name)
        if view is None:
            self.reject("unknown_instance", f"device {name!r} is not in this config")
        return view

    def _edge_state(self, msg: EdgeState) -> None:
        if (view := self._edge(msg.edge)) is not None:
            view.state = msg

    def _hello(self, msg: DeviceHello) -> None:
        if (view := self._device(msg.device)) is not None:
            view.hello = msg

    def _report(self, msg: DeploymentReport) -> None:
        if (view := self._device(msg.device)) is not None:
            view.report = msg

    def _deployment(self, msg: Deployment) -> None:
        self.status.deployment = msg.ident

    def _deployment_cleared(self, _topic: str) -> None:
        self.status.deployment = None

    def _cloud(self, msg: CloudState) -> None:
        self.status.cloud = msg

    def _presence(self, msg: Presence) -> None:
        st = self.status
        if msg.role == "cloud":
            st.cloud_online = msg.online
        elif msg.role == "edge" and (edge := self._edge(msg.name)) is not None:
            edge.online = msg.online
        elif msg.role == "device" and (device := self._device(msg.name)) is not None:
            device.online = msg.online


def _count_rejected(observer: StatusObserver, bus: MqttBus) -> None:
    """Copy the bus's rejection counts for the observer into its status (by reason)."""
    prefix = f"{observer.role}:"
    observer.status.rejected = {
        key.removeprefix(prefix): n
        for key, n in bus.traffic.snapshot()["rejected"].items()
        if key.startswith(prefix)
    }


def collect_status(
    cfg: RunConfig, bus: MqttBus, wait_s: float, *, name: str = "status"
) -> FederationStatus:
    """Listen on ``bus`` (an :class:`~shared.transport.mqtt.MqttBus`, connected) for
    ``wait_s`` seconds and return what the run's retained messages say."""
    return watch_status(cfg, bus, wait_s, wait_s, wait_s, lambda *_: None, name=name)


def watch_status(
    cfg: RunConfig,
    bus: MqttBus,
    wait_s: float,
    every_s: float,
    for_s: float,
    show: Callable[[FederationStatus, bool], None],
    *,
    until_done: bool = False,
    name: str = "status",
    clock: Callable[[], float] = time.monotonic,
) -> FederationStatus:
    """Listen on ``bus`` and call ``show(status, connected)`` after ``wait_s`` seconds and then
    every ``every_s`` seconds, until ``for_s`` seconds have passed, or (``until_done``) the
    cloud running this config says its run is done. The observer stays subscribed the whole
    time, so every retained message a role publishes meanwhile updates the view; Ctrl-C
    (KeyboardInterrupt) is left to the caller. Returns the last status."""
    observer = StatusObserver(name, cfg, bus)
    observer.start()
    st = observer.status
    deadline = clock() + for_s
    step, finished = wait_s, False
    while not finished:  # bounded by the deadline: each pump ends at it at the latest
        bus.pump(max(0.0, min(step, deadline - clock())))
        _count_rejected(observer, bus)
        show(st, bus.connected)
        finished = (until_done and _done(st)) or clock() >= deadline
        step = every_s
    return st


def _done(st: FederationStatus) -> bool:
    """Whether the cloud running this config (not another one) says the run is done."""
    return st.cloud is not None and st.cloud.done_for(st.digest)


def _online(flag: bool | None) -> str:
    return {True: "online", False: "offline", None: "unknown"}[flag]


def _sha(sha: str | None) -> str:
    return sha[:12] if sha else "-"


def _round_clock(c: CloudState, now: float) -> str:
    """How long the open round has been open, against the cloud's deadline for it."""
    if c.phase != "training" or c.opened_at is None or c.deadline_s is None:
        return ""
    open_s = max(0.0, now - c.opened_at)
    late = "  OVERDUE" if open_s > c.deadline_s else ""
    return f" (open {open_s:.0f} s of {c.deadline_s:.0f} s{late})"


def format_status(st: FederationStatus, where: str, now: float | None = None) -> str:
    """The human-readable report; ``now`` (Unix time, default the clock) dates the open
    round against the cloud's clock, so a skew between the two machines shows in it."""
    lines = [f'run "{st.run}" on {where}']
    c = st.cloud
    if c is None:
        lines.append(
            f"cloud   {_online(st.cloud_online)}; no cloud state retained: no run with this name "
            "has started on this broker"
        )
    else:
        same = (
            "this config"
            if c.config_digest == st.digest
            else (f"ANOTHER config (digest {c.config_digest[:12]}, this file {st.digest[:12]})")
        )
        model = _sha(c.model_ref.sha256 if c.model_ref else None)
        clock = _round_clock(c, time.time() if now is None else now)
        # the state counts rounds done (the 0-based index of the one in progress); people
        # read the round in progress from 1, and a finished run as "round N of N"
        shown = min(c.round + 1, st.rounds) if c.phase in ("waiting", "training") else c.round
        lines.append(
            f"cloud   {_online(st.cloud_online):8} {c.phase:9} round {shown} of {st.rounds}"
            f"{clock}   global model {model}   running {same}"
        )
    online = sum(v.online is True for v in st.edges.values())
    lines.append(f"edges   {online} of {len(st.edges)} online")
    for name, e in sorted(st.edges.items()):
        if e.state is None:
            what = "no state retained"
        else:
            last = "none yet" if e.state.round is None else str(e.state.round + 1)
            what = (f"last closed round {last}: {e.state.devices_last_round} devices; "
                    f"{e.state.n_samples} samples since the last cloud aggregation")  # fmt: skip
        lines.append(f"  {name:8} {_online(e.online):8} {what}")
    online = sum(v.online is True for v in st.devices.values())
    lines.append(f"devices {online} of {len(st.devices)} online")
    for name, d in sorted(st.devices.items()):
        report = st.current_report(d)
        if d.hello is None and d.online is None and report is None:
            lines.append(f"  {name:8} never seen")
            continue
        home = f"home {d.hello.home_edge}, {d.hello.n_samples} samples" if d.hello else "no hello"
        lines.append(f"  {name:8} {_online(d.online):8} {home}   {_report(report)}")
    if st.rejected:
        named = ", ".join(f"{r} x{n}" for r, n in sorted(st.rejected.items()))
        lines.append(f"rejected {sum(st.rejected.values())} message(s): {named} "
                     "(run with -v to see each)")  # fmt: skip
    # every line holds text from the wire (reports, ids): escaped, one line each
    return "\n".join(printable(line) for line in lines)


def _report(r: DeploymentReport | None) -> str:
    if r is None:
        return "no deployment report"
    if r.event == "refused":
        return f"REFUSED {_sha(r.model_sha256)}: {r.reason}"
    serving = f"serving {_sha(r.serving or r.model_sha256)}"
    provider = r.provider or "unknown provider"
    if r.event == "sampled":
        return (f"{serving}; sampled {r.n} in {r.steps} steps at {r.images_per_s:.2f} images/s "
                f"({provider})")  # fmt: skip
    if r.event == "classified":
        return f"{serving}; classified, {classified_figures(r.model_dump())} ({provider})"
    return f"{serving} (loaded)"


def classified_figures(report: dict[str, Any]) -> str:
    """What a ``classified`` deployment report (in JSON form: :class:`DeploymentReport`'s
    fields) measured: the accuracy on the device's own images (``request_id`` names them: its
    test split or its image folder; none when they have no labels), their number and the
    speed, e.g. ``accuracy 0.8125 on 80 images (own-test-split) at 9261.30 images/s``."""
    accuracy = report.get("accuracy")
    score = "no accuracy (unlabelled)" if accuracy is None else f"accuracy {accuracy:.4f}"
    images = f"{report.get('n', 0)} images"
    if report.get("request_id"):
        images += f" ({report['request_id']})"
    return f"{score} on {images} at {report.get('images_per_s', 0.0):.2f} images/s"


class _Printer:
    """Prints each watched status: on a terminal it redraws the screen every time; otherwise
    (a log, a pipe) it prints a report only when something changed, and with ``--json`` one
    compact JSON document per line (JSON Lines)."""

    def __init__(self, where: str, as_json: bool, every_s: float, tty: bool) -> None:
        self.where, self.as_json, self.every_s, self.tty = where, as_json, every_s, tty
        self._last: str | None = None

    def __call__(self, st: FederationStatus, connected: bool) -> None:
        doc = st.as_dict()
        key = json.dumps(doc, sort_keys=True) + str(connected)
        redraw = self.tty and not self.as_json  # every time: the round's clock moves
        if key == self._last and not redraw:
            return
        self._last = key
        if self.as_json:
            print(json.dumps({"at": time.time(), "connected": connected, **doc}), flush=True)
            return
        head = (f"at {time.strftime('%H:%M:%S')}: watching every {self.every_s:g} s, "
                "Ctrl-C to stop"
                + ("" if connected else "; BROKER CONNECTION LOST, reconnecting: "
                   "what follows may be stale"))  # fmt: skip
        clear = "\033[H\033[2J" if self.tty else ""
        print(f"{clear}{head}\n{format_status(st, self.where)}\n", flush=True)


def run_config_path(path: Path) -> Path:
    """``path``, or for a run directory the config its processes were started with
    (``launch_config.json``, which carries the broker's real address; else ``config.json``)."""
    if not path.is_dir():
        return path
    for name in ("launch_config.json", "config.json"):
        if (path / name).is_file():
            return path / name
    raise EstuaryError(f"{path} is a folder without launch_config.json or config.json; give "
                       "a run config or the run directory of `estuary demo`")  # fmt: skip


def check_listening(host: str, port: int, timeout_s: float = CONNECT_CHECK_S) -> None:
    """Fail at once, with a sentence, when nothing accepts TCP connections on ``host:port``
    (the MQTT client would retry until its connect timeout instead)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as err:
        why = err.strerror or type(err).__name__
        raise EstuaryError(
            f"no broker at {host}:{port} ({why}); is the run up? Point --broker HOST:PORT at "
            "it, or give the run directory of `estuary demo` (its launch_config.json has the "
            "broker's address)"
        ) from None


#: ``estuary demo``'s record of its brokers in the run directory (a broker per edge site)
BROKERS_FILE = "brokers.json"


@dataclass
class BrokerView:
    """One broker of a federation with a broker per edge site, as ``estuary status`` saw it."""

    site: str
    host: str
    port: int
    reachable: bool
    #: an edge site's bridge to the cloud broker: up (True), down (False), not read (None)
    bridge_up: bool | None = None

    @property
    def url(self) -> str:
        """``mqtt://host:port``."""
        return f"mqtt://{self.host}:{self.port}"


def listening(host: str, port: int, timeout_s: float = CONNECT_CHECK_S) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def bridge_state(cfg: RunConfig, edge: str, wait_s: float, *, name: str = "status") -> bool | None:
    """Whether edge site ``edge``'s bridge to the cloud broker is up, as the site broker of
    ``cfg.broker`` (host, port, credentials: the observer's) says in its retained
    ``$SYS/broker/connection/bridge-<e>/state`` (``1`` up, ``0`` down); None when no state
    arrived within ``wait_s`` seconds (no such bridge, or no read access)."""
    from shared.federation.topology import bridge_state_topic
    from shared.runtime.process import connect_bus

    seen: list[bytes] = []
    bus = connect_bus(cfg, OBSERVER, name, None, will=False)
    try:
        bus.endpoint(name, home=f"{OBSERVER}/{name}").subscribe(
            bridge_state_topic(edge), lambda _t, payload: seen.append(payload), kind="bridge_state"
        )
        deadline = time.monotonic() + wait_s
        while not seen and time.monotonic() < deadline:
            bus.pump(min(0.1, max(0.0, deadline - time.monotonic())))
    finally:
        bus.close()
    return None if not seen else seen[-1].strip() == b"1"


def broker_views(
    cfg: RunConfig, brokers: dict[str, dict[str, Any]], wait_s: float, *, name: str = "status"
) -> list[BrokerView]:
    """Every broker of ``brokers`` (site -> ``{"host", "port"}``, what ``estuary demo``
    records in :data:`BROKERS_FILE`): whether it is reachable and, for an edge site's, whether
    its bridge is up (:func:`bridge_state`, logged in as ``cfg.broker``'s account)."""
    views = []
    for site, where in brokers.items():
        host, port = str(where["host"]), int(where["port"])
        view = BrokerView(site, host, port, listening(host, port))
        if site != "cloud" and view.reachable:
            section = cfg.broker.model_copy(update={"host": host, "port": port})
            site_cfg = cfg.model_copy(update={"broker": section})
            view.bridge_up = bridge_state(site_cfg, site, wait_s, name=f"{name}-{site}")
        views.append(view)
    return views


def format_brokers(views: list[BrokerView]) -> str:
    """One line per broker: its site, address, whether it answers and its bridge's state."""
    lines = [f"brokers {sum(v.reachable for v in views)} of {len(views)} reachable"]
    for v in views:
        bridge = {True: "bridge up", False: "bridge DOWN", None: "bridge state unknown"}
        what = "" if v.site == "cloud" else f"   {bridge[v.bridge_up]}"
        state = "reachable" if v.reachable else "UNREACHABLE"
        lines.append(f"  {v.site:8} {v.url:24} {state}{what}")
    return "\n".join(lines)


def read_brokers(path: Path) -> dict[str, dict[str, Any]] | None:
    """The brokers a run directory records (:data:`BROKERS_FILE`), None when it has none."""
    file = path / BROKERS_FILE if path.is_dir() else None
    if file is None or not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise EstuaryError(f"cannot read {file}: {err}") from None
    if not isinstance(data, dict):
        raise EstuaryError(f"{file} is not a JSON object of sites")
    return data


def cmd_status(args: argparse.Namespace) -> int:
    """``estuary status``: 0 when the run's cloud state was found, 1 when not; with
    ``--watch --until-done``, 3 when the run was not done within ``--for-s``."""
    from shared.runtime.process import connect_bus, load_role_config

    if not 0 < args.wait_s <= MAX_WAIT_S:
        raise EstuaryError(f"--wait-s must be in (0, {MAX_WAIT_S:g}], got {args.wait_s:g}")
    watching = args.watch is not None
    if watching and not MIN_EVERY_S <= args.watch <= MAX_WAIT_S:
        raise EstuaryError(
            f"--watch must be in [{MIN_EVERY_S:g}, {MAX_WAIT_S:g}] seconds, got {args.watch:g}"
        )
    if not 0 < args.for_s <= MAX_WATCH_S:
        raise EstuaryError(f"--for-s must be in (0, {MAX_WATCH_S:g}], got {args.for_s:g}")
    if args.until_done and not watching:
        raise EstuaryError("--until-done needs --watch")
    brokers = read_brokers(Path(args.config))
    args.config = str(run_config_path(Path(args.config)))
    cfg = load_role_config(args)
    views: list[BrokerView] = []
    if brokers and not watching:  # the cloud broker is cfg's: the federation's view is there
        views = broker_views(cfg, brokers, args.wait_s)
        if not args.json:
            print(format_brokers(views))
    b, name = cfg.broker, f"status-{os.getpid()}"
    where = f"{b.host}:{b.port}"
    check_listening(b.host, b.port)
    bus = connect_bus(cfg, OBSERVER, name, None, will=False)  # home observer/<name>
    try:
        if not watching:
            st = collect_status(cfg, bus, args.wait_s, name=name)
        else:
            printer = _Printer(where, args.json, args.watch, sys.stdout.isatty())
            try:
                st = watch_status(cfg, bus, args.wait_s, args.watch, args.for_s, printer,
                                  until_done=args.until_done, name=name)  # fmt: skip
            except KeyboardInterrupt:  # the user stopped watching: a normal end
                return 0
            if args.until_done:
                return 0 if _done(st) else 3
            return 0 if st.cloud is not None else 1
    finally:
        bus.close()
    if args.json:
        doc = st.as_dict()
        if brokers and not watching:
            doc["brokers"] = [{**asdict(v), "url": v.url} for v in views]
        print(json.dumps(doc, indent=2))
    else:
        print(format_status(st, where))
    return 0 if st.cloud is not None else 1


def add_parser(sub: Any) -> None:
    """The ``status`` subcommand."""
    s = sub.add_parser("status", help="where a running federation stands (from the broker)")
    s.add_argument("config", help="run config (run name, broker address and credentials), or a "
                   "run directory of `estuary demo`")  # fmt: skip
    s.add_argument("--broker", help="HOST:PORT (overrides broker.host/port)")
    s.add_argument("--wait-s", type=float, default=DEFAULT_WAIT_S,
                   help=f"seconds to listen (default {DEFAULT_WAIT_S:g})")  # fmt: skip
    s.add_argument(
        "--json",
        action="store_true",
        help="machine-readable output (with --watch: one JSON document per line)",
    )
    s.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=DEFAULT_EVERY_S,
        metavar="SECONDS",
        help="keep watching: report again every SECONDS (default "
        f"{DEFAULT_EVERY_S:g}; when not on a terminal, only when something changed)",
    )
    s.add_argument(
        "--for-s",
        type=float,
        default=DEFAULT_WATCH_S,
        help=f"with --watch, stop after this long (default {DEFAULT_WATCH_S:g})",
    )
    s.add_argument(
        "--until-done",
        action="store_true",
        help="with --watch, stop when the cloud says the run is done (exit status "
        "3 when it is not done within --for-s)",
    )
    s.set_defaults(func=cmd_status, metrics_port=-1)
