"""Start a whole hierarchy as separate processes on one machine (``estuary demo``, tests).

Each role runs as ``python -m cloud`` / ``-m edge_node`` / ``-m device_agent`` with its own
log file and Prometheus port; the launcher can kill (SIGKILL) and restart any of them, and
always stops everything it started: SIGTERM first, SIGKILL after a bounded wait. Children
also ask the kernel to SIGTERM them if the launcher dies, so nothing is orphaned.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shared.config import RunConfig
from shared.errors import EstuaryError
from shared.metrics.prometheus import scrape
from shared.naming import device_name, edge_ids
from shared.transport.local_broker import LocalBroker, free_port

log = logging.getLogger(__name__)

MODULES = {"cloud": "cloud", "edge": "edge_node", "device": "device_agent"}


@dataclass
class RoleProcess:
    """One running (or finished) role process."""

    name: str
    role: str
    argv: list[str]
    log_path: Path
    metrics_port: int | None
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0

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

    def __post_init__(self) -> None:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def _argv(self, role: str, name: str) -> list[str]:
        argv = [sys.executable, "-m", MODULES[role], str(self.config_path)]
        argv += ["--broker", f"{self.broker.host}:{self.broker.port}"]
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
        if self.broker.kind == "amqtt":
            env["ESTUARY__BROKER__PROTOCOL"] = "3.1.1"  # amqtt speaks MQTT 3.1.1 only
        if self.credentials is not None:
            env["ESTUARY__BROKER__USERNAME"] = proc.name
            password = self.credentials / "credentials" / f"{proc.name}.password"
            env["ESTUARY__BROKER__PASSWORD_FILE"] = str(password)
        argv = list(proc.argv)
        argv += ["--metrics-port", str(proc.metrics_port if proc.metrics_port else -1)]
        with proc.log_path.open("ab") as fh:
            proc.popen = subprocess.Popen(
                argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )

    def start(self, role: str, name: str) -> RoleProcess:
        """Start (or restart) one role process."""
        old = self.procs.get(name)
        if old is not None and old.alive:
            raise EstuaryError(f"{name} is already running")
        port = (old.metrics_port if old else None) or (free_port() if self.metrics else None)
        proc = RoleProcess(
            name=name,
            role=role,
            argv=self._argv(role, name),
            log_path=self.run_dir / "logs" / f"{name}.log",
            metrics_port=port,
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


def stop_processes(procs: Mapping[str, subprocess.Popen[bytes]], timeout_s: float) -> None:
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
