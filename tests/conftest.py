"""Shared fixtures: tiny configs, a check for the Fashion-MNIST files, and what many test
modules would otherwise each build again: one open Mosquitto per test session, the final
models of reference runs (computed once per configuration, shared by the pytest workers)
and ONNX exports of the tiny U-Net (made once per seed)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.config import RunConfig, config_from_dict
from shared.data.datasets import DataError, find_fashion_mnist
from shared.transport.local_broker import LocalBroker, find_mosquitto
from tests.mqtt_probe import clear_retained

#: the pytest-xdist worker this process is ("gw0", ...), None in a plain run
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER is not None:
    # the workers share the cores: one torch thread each, and in the processes they start
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))

#: the PRISM key every test process (and the processes they start) uses; a test of the
#: missing-key error removes it with monkeypatch
TEST_PRISM_KEY = "00112233445566778899aabbccddeeff"
os.environ["ESTUARY_PRISM_KEY"] = TEST_PRISM_KEY
os.environ.pop("ESTUARY_PRISM_KEY_FILE", None)

needs_mosquitto = pytest.mark.skipif(
    find_mosquitto() is None, reason="mosquitto not installed: apt-get install mosquitto"
)


def have_fmnist() -> bool:
    """Whether the Fashion-MNIST IDX files can be found."""
    try:
        find_fashion_mnist()
    except DataError:
        return False
    return True


needs_fmnist = pytest.mark.skipif(
    not have_fmnist(), reason="Fashion-MNIST missing: apt-get install dataset-fashion-mnist"
)


def tiny_config(**overrides: dict[str, Any]) -> RunConfig:
    """2 edges x 4 devices x 3 rounds, a few steps each, no evaluation."""
    base: dict[str, dict[str, Any]] = {
        "run": {"name": "test", "seed": 0, "rounds": 3},
        "federation": {"num_devices": 8, "num_edges": 2, "round_deadline_s": 60},
        "data": {"dataset": "synthetic", "synthetic_size": 256, "partition": "iid"},
        "model": {"preset": "fmnist-tiny"},
        "train": {"local_steps": 2, "batch_size": 8, "lr": 2e-3},
        "eval": {"every": 0, "sample_every": 0, "checkpoint_every": 1},
    }
    for section, values in overrides.items():
        base.setdefault(section, {}).update(values)
    return config_from_dict(base)


@pytest.fixture
def tiny_cfg() -> RunConfig:
    """The default tiny config."""
    return tiny_config()


def synthetic_federation(cfg: RunConfig, bus: Any = None) -> tuple[Any, Any, list[Any]]:
    """The federation ``cfg`` describes, over ``bus`` (a fresh MemoryBus by default) on its
    synthetic data split by its partition, not started yet: (federation, bus, the list the
    round summaries collect in)."""
    from estuary.simulate import build_federation
    from shared.data.datasets import load_dataset
    from shared.data.partition import make_partition
    from shared.transport.bus import MemoryBus

    data = load_dataset("synthetic", size=cfg.data.synthetic_size, seed=cfg.run.seed)
    parts = make_partition(data.labels, cfg.federation.num_devices, cfg.data, cfg.run.seed)
    bus = bus if bus is not None else MemoryBus()
    summaries: list[Any] = []
    fed = build_federation(cfg, bus, data, parts, on_round_end=summaries.append)
    return fed, bus, summaries


# -- one open Mosquitto per session ---------------------------------------------------------
@pytest.fixture(scope="session")
def session_broker() -> Iterator[LocalBroker]:
    """An open Mosquitto (no accounts) on a free port for the whole test session (one per
    pytest worker). Topics are rooted per run (``estuary/v1/<run>/``), so tests share it by
    using run names of their own; use :func:`shared_broker` in a module, which also clears
    what the module left retained."""
    if find_mosquitto() is None:
        pytest.skip("mosquitto not installed: apt-get install mosquitto")
    with LocalBroker(kind="mosquitto") as broker:
        yield broker


def shared_broker(session_broker: LocalBroker) -> Iterator[LocalBroker]:
    """The session's open Mosquitto for one test module, with every retained message cleared
    after the module (its run names then leave nothing behind for later modules). Declare it
    in a module as ``broker = pytest.fixture(scope="module")(shared_broker)``."""
    yield session_broker
    clear_retained(session_broker.host, session_broker.port)


# -- the provisioned broker of the ACL tests -----------------------------------------------
@pytest.fixture(scope="session")
def acl_provisioning(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``estuary provision`` of run "acl" (3 devices, 2 edges), made once per session: the
    folder with its password file, ACL and credentials."""
    from estuary.provision import provision

    cfg = tiny_config(run={"name": "acl"}, federation={"num_devices": 3, "num_edges": 2})
    out = tmp_path_factory.mktemp("acl") / "prov"
    provision(cfg, out)
    return out


@pytest.fixture
def secured(acl_provisioning: Path, tmp_path: Path) -> Iterator[tuple[LocalBroker, Path]]:
    """A mosquitto that requires the provisioned passwords and enforces the ACL of
    :func:`acl_provisioning`. Each test gets a broker of its own from the session's files
    (it starts in about 0.1 s): no test then sees another's retained messages or the
    persistent sessions of its client ids.

    Its client ids are not bound to user names: the ACL tests (test_provision.py and
    test_private_downlink.py) log in spies with a role's own account beside that role, which
    a bound broker would not allow (the second connection would replace the first). The
    binding itself is tested in test_client_id_binding.py; the federations there run with it.
    """
    if find_mosquitto() is None:
        pytest.skip("mosquitto not installed: apt-get install mosquitto")
    broker = LocalBroker(
        kind="mosquitto", workdir=tmp_path / "broker",
        password_file=acl_provisioning / "mosquitto" / "passwd",
        acl_file=acl_provisioning / "mosquitto" / "acl", bind_client_ids=False,
    ).start()  # fmt: skip
    yield broker, acl_provisioning
    broker.stop()


# -- reference runs, computed once ----------------------------------------------------------
def _shared_dir(factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder every pytest worker of this run sees (beside the workers' own temp roots)."""
    root = factory.getbasetemp()
    if WORKER is not None:
        root = root.parent
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    return path


class Once:
    """Values computed once per key for the whole test run: the first worker to ask computes
    and stores the value (JSON) while holding a file lock; the others, and later asks, read it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.local: dict[str, Any] = {}

    def get(self, key: str, make: Callable[[], Any]) -> Any:
        """The value stored under ``key``, made by ``make()`` the first time."""
        if key in self.local:
            return self.local[key]
        path = self.folder / f"{key}.json"
        with (self.folder / f"{key}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.is_file():
                value = json.loads(path.read_text())["value"]
            else:
                value = make()
                path.write_text(json.dumps({"value": value}))
        self.local[key] = value
        return value


@pytest.fixture(scope="session")
def once(tmp_path_factory: pytest.TempPathFactory) -> Once:
    """Values (reference model hashes and the like) computed once per test run."""
    return Once(_shared_dir(tmp_path_factory, "once"))


@pytest.fixture(scope="session")
def reference_sha(
    once: Once, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[RunConfig], str]:
    """The final model sha256 of ``estuary simulate`` on a config (without evaluation),
    computed once per configuration: the reference a process or broker run must end at."""
    from estuary.simulate import simulate

    def sha(cfg: RunConfig) -> str:
        def run() -> str:
            out = tmp_path_factory.mktemp("reference")
            return simulate(cfg, out, progress=False, evaluate=False).final_model_sha256

        # the whole config (per-process keys too), not only its digest
        key = hashlib.sha256(cfg.to_json().encode()).hexdigest()[:20]
        return str(once.get(f"simulate-{key}", run))

    return sha


# -- ONNX exports, made once ----------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_unet_onnx() -> Callable[[int], bytes]:
    """The ONNX bytes of an untrained ``fmnist-tiny`` U-Net built with a seed, exported once
    per seed in this process."""
    from shared.deploy.export import to_onnx
    from shared.models.presets import build_unet

    made: dict[int, bytes] = {}

    def onnx(seed: int) -> bytes:
        if seed not in made:
            made[seed] = to_onnx(build_unet("fmnist-tiny", seed=seed))
        return made[seed]

    return onnx


#: the slowest tests outside the ``process`` marker (docs/testing.md, measured 2026-11-29),
#: longest first: handed out right after the process-level ones
LONG_FIRST = (
    "test_adversarial.py::test_a_rerun_on_a_broker_holding_a_finished_run",
    "test_folder_data.py::test_devices_reading_only_their_own_folders",
    "test_simulate.py::test_smoke_fmnist_tiny",
    "test_provision.py::test_federation_runs_with_per_role_credentials",
    "test_device_state.py::test_devices_restarted_mid_run",
    "test_compare.py::",
    "test_folder_data.py::test_simulate_and_compare",
    "test_attack_suite.py::",
    "test_simulate.py::test_duplicate_and_late_updates_are_ignored",
    "test_prometheus_rules.py::",
    "test_deployment.py::",
    "test_status.py::",
    "test_onnx_export.py::",
    "test_own_model_deployment.py::",
    # mostly waiting (on a broker, a deadline, a scrape): run beside the long ones above,
    # not at the end, where they would leave the cores idle
    "test_mqtt_bad_input.py::",
    "test_mqtt_federation.py::",
    "test_mqtt_robustness.py::",
    "test_client_id_binding.py::",
    "test_private_downlink.py::",
    "test_large_federation.py::",
    "test_provision.py::",
)


def _order(item: pytest.Item) -> int:
    """0 for process-level tests, then the rank in :data:`LONG_FIRST`, then the rest."""
    if item.get_closest_marker("process") is not None:
        return 0
    return next((i + 1 for i, key in enumerate(LONG_FIRST) if key in item.nodeid),
                len(LONG_FIRST) + 1)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Hand out the longest tests first (those starting process hierarchies, then
    :data:`LONG_FIRST`), so that the pytest workers do not end the run with one of them
    still at a long test while the others are idle."""
    items.sort(key=_order)
