"""Real Mosquitto processes on the shipped broker configs (docker/, k8s/) for tests: a config's
container paths moved into a scratch directory, its listener onto a free local port, and the
process started and stopped. Used to check that what `estuary provision` writes for a site
works in the configs the compose file and the Kubernetes overlay run it with."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from estuary.status import bridge_state
from shared.config import RunConfig

MQTT_PORT = 1883
BRIDGE_UP_S = 20.0


def local_conf(conf: str, port: int, moves: dict[str, Path]) -> str:
    """``conf`` listening on 127.0.0.1:``port`` instead of 1883, with every path prefix of
    ``moves`` (a container path, ending in "/") replaced by its scratch directory; as root,
    the broker stays root (it would drop to a user that cannot read the scratch files)."""
    if f"listener {MQTT_PORT}\n" not in conf:
        raise ValueError(f"no 'listener {MQTT_PORT}' line to move")
    conf = conf.replace(f"listener {MQTT_PORT}\n", f"listener {port} 127.0.0.1\n")
    for old, new in moves.items():
        conf = conf.replace(old, f"{new}/")
    if os.geteuid() == 0:
        conf += "user root\n"
    return conf


@contextmanager
def mosquitto(binary: str, conf_path: Path, port: int) -> Iterator[subprocess.Popen[str]]:
    """Mosquitto on ``conf_path``, once it accepts connections on ``port``; stopped (SIGTERM,
    which makes it save its persistence file) on exit."""
    proc = subprocess.Popen(
        [binary, "-c", str(conf_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 10
        while proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        if proc.poll() is not None:
            raise AssertionError(f"mosquitto exited:\n{proc.communicate()[0]}")
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=10)


def observer_cfg(cfg: RunConfig, out: Path, port: int) -> RunConfig:
    """``cfg`` as the provisioned observer account on 127.0.0.1:``port``."""
    section = cfg.broker.model_copy(
        update={
            "host": "127.0.0.1",
            "port": port,
            "username": "observer",
            "password_file": str(out / "credentials" / "observer.password"),
        }
    )
    return cfg.model_copy(update={"broker": section})


def wait_bridge_up(cfg: RunConfig, out: Path, edge: str, port: int) -> None:
    """Until the site broker of ``edge`` on ``port`` says its bridge to the cloud is up."""
    deadline = time.monotonic() + BRIDGE_UP_S
    while time.monotonic() < deadline:
        if bridge_state(observer_cfg(cfg, out, port), edge, 1.0) is True:
            return
        time.sleep(0.2)
    raise AssertionError(f"the bridge of {edge} is not up after {BRIDGE_UP_S:.0f} s")
