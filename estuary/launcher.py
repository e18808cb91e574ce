"""Start a whole hierarchy as separate processes on one machine (``estuary demo``, tests).

Each role runs as its own process, the equivalent of ``python -m cloud`` / ``-m edge_node`` /
``-m device_agent``, with its own log file and Prometheus port; the launcher can kill
(SIGKILL) and restart any of them, and always stops everything it started: SIGTERM first,
SIGKILL after a bounded wait. Children also ask the kernel to SIGTERM them if the launcher
dies, so nothing is orphaned.

How a role process starts (``launch``, default from ``ESTUARY_LAUNCH``):

- ``"fork"`` (default): forked from a server process (:mod:`multiprocessing`'s forkserver)
  that imported torch, diffusers and the three roles' code once, before any of them ran. A
  role then starts in milliseconds instead of the ~5 CPU-seconds each ``python -m`` spends
  importing, and the read-only pages of those modules are shared between the roles. The
  server itself is a fresh interpreter (not a fork of the launcher, which may run threads),
  it never runs a role's code, and it exits with the launcher. A role whose environment
  differs from the launcher's in anything but ``ESTUARY*`` variables (``OMP_NUM_THREADS``,
  ``PYTHONPATH``: read when libraries load) is started with ``"exec"`` instead.
- ``"exec"``: ``python -m <role>`` in a new interpreter, as in a container.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import multiprocessing.process
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from shared.config import RunConfig
from shared.errors import ConfigError, EstuaryError
from shared.federation.topology import CLOUD_SITE, site_of, sites
from shared.metrics.prometheus import scrape
from shared.naming import device_name, edge_ids
from shared.transport.local_broker import LocalBroker

log = logging.getLogger(__name__)

MODULES = {"cloud": "cloud", "edge": "edge_node", "device": "device_agent"}
LAUNCH_MODES = ("fork", "exec")
#: what the fork server imports once, before it forks any role
PRELOAD = ["torch", "diffusers", "cloud.main", "edge_node.main", "device_agent.main"]
_FORK_LOCK = threading.Lock()


class Child(Protocol):
    """What the launcher needs of a started process (a :class:`subprocess.Popen` or a
    :class:`ForkedRole`)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def _run_forked_role(
    module: str, argv: list[str], log_path: str, env: dict[str, str], cwd: str
) -> None:
    """Body of a forked role process: its log file as stdout and stderr, the launcher's
    environment and working directory as they were at start, then the role's ``main``."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [module, *argv]
    main = importlib.import_module(f"{module}.main").main
    sys.exit(main(argv))


class ForkedRole:
    """A role process forked from the fork server, with :class:`subprocess.Popen`'s
    interface (``poll``, ``wait`` raising :class:`subprocess.TimeoutExpired`, signals)."""

    def __init__(self, module: str, argv: list[str], log_path: Path, env: dict[str, str]):
        ctx = multiprocessing.get_context("forkserver")
        with _FORK_LOCK:
            ctx.set_forkserver_preload(PRELOAD)
            self._proc = ctx.Process(
                target=_run_forked_role,
                args=(module, argv, str(log_path), env, os.getcwd()),
                name=f"estuary-{module}",
                daemon=True,  # stopped (SIGTERM) when the launcher exits without stop_all
            )
            self._proc.start()
        self.args = [module, *argv]

    @property
    def pid(self) -> int:
        """Process id."""
        return int(self._proc.pid or 0)

    def poll(self) -> int | None:
        """Exit code once finished (negative: killed by that signal), else None."""
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit; :class:`subprocess.TimeoutExpired` after ``timeout`` s."""
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` unless the process has already exited."""
        if self._proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


@dataclass
class RoleProcess:
    """One running (or finished) role process."""

    name: str
    role: str
    argv: list[str]
    log_path: Path
    #: where the process writes the port it serves ``/metrics`` on (None: metrics off). It
    #: binds port 0 itself: a port picked here and bound later by the child could be taken
    #: in between by any other process on the machine.
    metrics_port_file: Path | None
    popen: Child | None = None
    restarts: int = 0
    _metrics_port: int | None = field(default=None, repr=False)

    @property
    def metrics_port(self) -> int | None:
        """The port this process serves ``/metrics`` on; None until it has bound one (and
        with metrics off)."""
        if self._metrics_port is None and self.metrics_port_file is not None:
            with contextlib.suppress(OSError, ValueError):
                self._metrics_port = int(self.metrics_port_file.read_text())
        return self._metrics_port

    @property
    def alive(self) -> bool:
        """Whether the process is running."""
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        """Exit code once finished (negative: killed by that signal)."""
        return None if self.popen is None else self.popen.poll()

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of this process's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class Hierarchy:
    """Cloud, edges and devices of ``cfg`` as processes talking through ``broker``."""

    cfg: RunConfig
    config_path: Path
    run_dir: Path
    broker: LocalBroker
    metrics: bool = True
    evaluate: bool = True
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, RoleProcess] = field(default_factory=dict)
    #: ``estuary provision`` output: each process logs in as itself with its own password
    credentials: Path | None = None
    #: extra command-line arguments of the cloud process (e.g. ``["--stay"]``)
    cloud_args: list[str] = field(default_factory=list)
    #: ``estuary split-data`` output: each device gets ``--data DIR/<its id>``, the cloud
    #: ``--reference DIR/cloud`` (a config with ``data.dataset = "folder"``)
    data_dir: Path | None = None
    #: how role processes start: "fork" or "exec" (module docstring)
    launch: str = field(default_factory=lambda: os.environ.get("ESTUARY_LAUNCH", "fork"))
    #: ``federation.brokers = "per-edge"``: each edge site's broker by site name
    #: (:func:`site_brokers`); its edge and devices are told that broker, the cloud ``broker``
    site_brokers: dict[str, LocalBroker] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.launch not in LAUNCH_MODES:
            raise EstuaryError(f"launch must be one of {LAUNCH_MODES}, got {self.launch!r}")
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def broker_of(self, role: str, name: str) -> LocalBroker:
        """The broker instance ``name`` of ``role`` talks through: its site's
        (:func:`~shared.federation.topology.site_of`) with a broker per edge site, else the
        one broker."""
        if not self.site_brokers:
            return self.broker
        site = site_of(self.cfg, role, name)
        return self.site_brokers[site] if site != CLOUD_SITE else self.broker

    def brokers(self) -> dict[str, LocalBroker]:
        """Every broker of the hierarchy by site (``"cloud"`` for the one broker)."""
        return {CLOUD_SITE: self.broker, **self.site_brokers}

    def _argv(self, role: str, name: str) -> list[str]:
        argv = [sys.executable, "-m", MODULES[role], str(self.config_path)]
        broker = self.broker_of(role, name)
        argv += ["--broker", f"{broker.host}:{broker.port}"]
        if role == "cloud":
            argv += ["--out", str(self.run_dir)]
            if not self.evaluate:
                argv.append("--no-eval")
            argv += self.cloud_args
        else:
            argv += ["--id", name, "--cache-dir", str(self.run_dir / "cache" / name)]
            if role == "device":
                argv += ["--state-dir", str(self.run_dir / "state")]
        if self.data_dir is not None and role in ("cloud", "device"):
            argv += ["--reference" if role == "cloud" else "--data", str(self.data_dir / name)]
        return argv

    def _spawn(self, proc: RoleProcess) -> None:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        if self.broker_of(proc.role, proc.name).kind == "amqtt":
            env["ESTUARY__BROKER__PROTOCOL"] = "3.1.1"  # amqtt speaks MQTT 3.1.1 only
        if self.credentials is not None:
            env["ESTUARY__BROKER__USERNAME"] = proc.name
            password = self.credentials / "credentials" / f"{proc.name}.password"
            env["ESTUARY__BROKER__PASSWORD_FILE"] = str(password)
        argv = list(proc.argv)
        if proc.metrics_port_file is None:
            argv += ["--metrics-port", "-1"]
        else:
            proc.metrics_port_file.unlink(missing_ok=True)  # a restarted process's old port
            argv += ["--metrics-port", "0", "--metrics-port-file", str(proc.metrics_port_file)]
        if self._forks(env):
            proc.popen = ForkedRole(MODULES[proc.role], argv[3:], proc.log_path, env)
            return
        with proc.log_path.open("ab") as fh:
            proc.popen = subprocess.Popen(
                argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )

    def _forks(self, env: Mapping[str, str]) -> bool:
        """Whether a role with environment ``env`` is forked (see the module docstring)."""
        if self.launch != "fork":
            return False
        changed = {k for k in env.keys() | os.environ.keys() if env.get(k) != os.environ.get(k)}
        return all(k.startswith("ESTUARY") or k == "PYTHONUNBUFFERED" for k in changed)

    def start(self, role: str, name: str) -> RoleProcess:
        """Start (or restart) one role process."""
        old = self.procs.get(name)
        if old is not None and old.alive:
            raise EstuaryError(f"{name} is already running")
        logs = self.run_dir / "logs"
        proc = RoleProcess(
            name=name,
            role=role,
            argv=self._argv(role, name),
            log_path=logs / f"{name}.log",
            metrics_port_file=logs / f"{name}.metrics-port" if self.metrics else None,
            restarts=old.restarts + 1 if old else 0,
        )
        self._spawn(proc)
        self.procs[name] = proc
        log.info("started %s (pid %s)", name, proc.popen.pid if proc.popen else "?")
        return proc

    def start_all(self) -> None:
        """Cloud, then edges, then devices (any order would work: state is retained)."""
        self.start("cloud", "cloud")
        for e in edge_ids(self.cfg):
            self.start("edge", e)
        for i in range(self.cfg.federation.num_devices):
            self.start("device", device_name(i))

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one process and reap it (bounded)."""
        proc = self.procs[name]
        if proc.popen is not None and proc.alive:
            proc.popen.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(10)

    def wait(self, name: str, timeout_s: float) -> int | None:
        """Wait for one process to exit; its return code, or None on timeout."""
        proc = self.procs[name]
        if proc.popen is None:
            return None
        try:
            return proc.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def failed(self) -> list[RoleProcess]:
        """Processes that exited with an error (not killed by us, not clean)."""
        return [p for p in self.procs.values() if p.returncode not in (None, 0, -9, -15, 130)]

    def metrics_ports(self, timeout_s: float) -> dict[str, int | None]:
        """Every process's ``/metrics`` port by name, waiting at most ``timeout_s`` for the
        live ones that serve metrics to bind theirs (None: not bound in time, or off)."""
        deadline = time.monotonic() + timeout_s
        while True:
            ports = {p.name: p.metrics_port for p in self.procs.values()}
            pending = [
                p for p in self.procs.values()
                if p.metrics_port_file is not None and p.alive and ports[p.name] is None
            ]  # fmt: skip
            if not pending or time.monotonic() >= deadline:
                return ports
            time.sleep(0.05)

    def scrape_all(self, timeout_s: float = 2.0) -> dict[str, dict[str, float]]:
        """Current ``/metrics`` of every live process that serves them."""
        out: dict[str, dict[str, float]] = {}
        for p in self.procs.values():
            if p.metrics_port and p.alive:
                with contextlib.suppress(EstuaryError):
                    out[p.name] = scrape(f"http://127.0.0.1:{p.metrics_port}/metrics", timeout_s)
        return out

    def stop_all(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every live process, then SIGKILL whatever is left after ``timeout_s``."""
        stop_processes(
            {p.name: p.popen for p in self.procs.values() if p.alive and p.popen}, timeout_s
        )


def site_brokers(cfg: RunConfig, cloud: LocalBroker, workdir: Path) -> dict[str, LocalBroker]:
    """One mosquitto per edge site of ``cfg`` (not started), each bridged to ``cloud``
    (:func:`estuary.provision.bridge_conf` without accounts: local, open brokers), its work
    directory ``workdir/<site>``.

    Raises:
        ConfigError: ``cloud`` is not a mosquitto (amqtt has no bridges).
    """
    from estuary.provision import bridge_conf

    if cloud.kind != "mosquitto":
        raise ConfigError(
            "federation.brokers = 'per-edge' needs mosquitto (amqtt has no bridges); install "
            "mosquitto (apt-get install mosquitto)"
        )
    out = {}
    for site in sites(cfg)[1:]:
        stanza = bridge_conf(cfg, site, f"{cloud.host}:{cloud.port}", None)
        out[site.name] = LocalBroker(
            kind="mosquitto",
            host=cloud.host,
            workdir=workdir / site.name,
            memory_bytes=cfg.broker.broker_memory_bytes,
            extra_conf=stanza.splitlines(),
        )
    return out


def stop_processes(procs: Mapping[str, Child], timeout_s: float) -> None:
    """SIGTERM every process of ``procs`` (by name), then SIGKILL whatever is left after
    ``timeout_s``; each is reaped (a kill waits at most 5 s more)."""
    for popen in procs.values():
        with contextlib.suppress(ProcessLookupError):
            popen.terminate()
    deadline = time.monotonic() + timeout_s
    for name, popen in procs.items():
        try:
            popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s ignored SIGTERM; killing it", name)
            popen.kill()
            popen.wait(5)
