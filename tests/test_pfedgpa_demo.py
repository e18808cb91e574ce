"""pFedGPA's demo end to end, every role a process over mosquitto: each device exports its own
classifier and the cloud counts every device's report (of this run's session) before the
deployment wait runs out."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from estuary.demo import run_demo
from shared.config import load_config, with_overrides
from shared.naming import device_name
from tests.conftest import needs_fmnist, needs_mosquitto

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "pfedgpa_demo.toml"
WAIT_S = 120.0  # the deployment wait: a run that needs it has missed a device's report


@needs_fmnist
@needs_mosquitto
@pytest.mark.slow
def test_pfedgpa_demo_devices_deploy_their_own_classifiers(tmp_path: Path) -> None:
    cfg = with_overrides(
        load_config(CONFIG),
        {
            "run": {"rounds": 3},
            "federation": {"num_devices": 3},
            "data": {"samples_per_device": 200, "test_samples_per_device": 200},
            "train": {"local_epochs": 1},
            "algorithm": {"pfedgpa": {"store_rounds": 2, "ae_steps": 40, "dm_steps": 40}},
            "deploy": {"wait_s": WAIT_S},
        },
    )
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    start = time.monotonic()
    result = run_demo(tmp_path / "run", config=path, broker_kind="mosquitto", progress=False,
                      evaluate=False)  # fmt: skip
    took = time.monotonic() - start
    devices = [device_name(i) for i in range(3)]
    assert {d: r["event"] for d, r in result.deployment.items()} == dict.fromkeys(
        devices, "classified"
    )
    reports = json.loads((tmp_path / "run" / "deploy" / "reports.json").read_text())
    assert sorted(reports) == devices
    assert all(0.0 < reports[d]["accuracy"] <= 1.0 for d in devices)
    assert took < WAIT_S  # the cloud finished on the last report, not on its wait
