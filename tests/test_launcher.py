"""How the launcher starts role processes: forked from the fork server (default) or as
``python -m <role>``; both give a role its own log, arguments, environment and exit code.
(The process tests and the rerun test of test_adversarial.py run whole hierarchies each
way and compare their models.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from estuary.launcher import ForkedRole, Hierarchy
from shared.errors import EstuaryError
from shared.transport.local_broker import LocalBroker
from tests.conftest import needs_mosquitto, shared_broker, tiny_config

pytestmark = [needs_mosquitto]

broker = pytest.fixture(scope="module")(shared_broker)


def _hierarchy(tmp_path: Path, broker: LocalBroker, launch: str) -> Hierarchy:
    cfg = tiny_config(run={"name": f"launch-{launch}"})
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    return Hierarchy(cfg, path, tmp_path / "run", broker, evaluate=False, launch=launch)


@pytest.mark.parametrize("launch", ["fork", "exec"])
def test_a_role_gets_its_arguments_environment_log_and_exit_code(
    tmp_path: Path, broker: LocalBroker, launch: str
) -> None:
    """A cloud started with an unknown option exits with argparse's status 2 and says why in
    its own log file; an ``ESTUARY*`` variable of the hierarchy reaches it (its log level)."""
    hier = _hierarchy(tmp_path, broker, launch)
    hier.cloud_args = ["--no-such-option"]
    hier.env = {"ESTUARY_LOG_LEVEL": "DEBUG"}
    proc = hier.start("cloud", "cloud")
    assert isinstance(proc.popen, ForkedRole) == (launch == "fork")
    try:
        assert hier.wait("cloud", 60) == 2, proc.log_tail()
    finally:
        hier.stop_all(timeout_s=5)
    log = proc.log_path.read_text()
    assert "unrecognized arguments: --no-such-option" in log, log
    assert not proc.alive and hier.failed() == [proc]


def test_a_role_environment_read_at_library_load_is_started_with_exec(
    tmp_path: Path, broker: LocalBroker
) -> None:
    """Forked roles share the fork server's loaded libraries, so a variable that those read
    when they load (OMP_NUM_THREADS, PYTHONPATH, ...) makes the launcher exec the role; a
    run's own settings (ESTUARY__*) do not; an unknown launch mode is refused."""
    hier = _hierarchy(tmp_path, broker, "fork")
    base = {**os.environ, "PYTHONUNBUFFERED": "1"}
    assert hier._forks({**base, "ESTUARY__BROKER__USERNAME": "dev000"})
    assert not hier._forks({**base, "OMP_NUM_THREADS": "3"})
    assert not hier._forks({**base, "PYTHONPATH": "/elsewhere"})
    assert not _hierarchy(tmp_path, broker, "exec")._forks(base)
    with pytest.raises(EstuaryError, match="launch must be one of"):
        _hierarchy(tmp_path, broker, "spawn")


def test_a_killed_forked_role_reports_the_signal(tmp_path: Path, broker: LocalBroker) -> None:
    """SIGKILL of a forked role reads back as -9, as for a child process of the launcher,
    and a second start of a running role is refused."""
    hier = _hierarchy(tmp_path, broker, "fork")
    proc = hier.start("edge", "edge00")
    try:
        with pytest.raises(EstuaryError, match="already running"):
            hier.start("edge", "edge00")
        hier.kill("edge00")
        assert proc.returncode == -9
        assert hier.failed() == []
    finally:
        hier.stop_all(timeout_s=5)


def test_a_role_binds_its_own_metrics_port_and_tells_the_launcher(
    tmp_path: Path, broker: LocalBroker
) -> None:
    """A role serves ``/metrics`` on a port it binds itself and writes it to its port file,
    so no other process can take the port between the launcher's pick and the role's bind;
    a restarted role binds a fresh one and the launcher scrapes that."""
    hier = _hierarchy(tmp_path, broker, "fork")
    try:
        proc = hier.start("edge", "edge0")
        assert proc.metrics_port_file is not None
        first = hier.metrics_ports(timeout_s=60)["edge0"]
        assert first is not None and first > 0, proc.log_tail()
        assert proc.metrics_port_file.read_text().strip() == str(first)
        assert any(k.startswith("estuary_") for k in hier.scrape_all()["edge0"])
        hier.kill("edge0")
        again = hier.start("edge", "edge0")
        second = hier.metrics_ports(timeout_s=60)["edge0"]
        assert second is not None and again.restarts == 1, again.log_tail()
        assert "edge0" in hier.scrape_all()
    finally:
        hier.stop_all(timeout_s=5)
    (tmp_path / "off").mkdir()
    off = _hierarchy(tmp_path / "off", broker, "fork")
    off.metrics = False
    try:
        quiet = off.start("edge", "edge0")
        assert quiet.metrics_port_file is None
        assert off.metrics_ports(timeout_s=1) == {"edge0": None}
    finally:
        off.stop_all(timeout_s=5)
