"""``benchmarks/gpu/gpu_compare.py``: the comparison it writes is valid and equal in local
compute, its plan fits the budget it is given, and ``--methods`` keeps the tables asked for.
(The whole pipeline runs on a GPU within a time budget, or with ``--dry-run`` on the CPU in a
few minutes.)"""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from estuary.compare import parse_compare, steps_per_round
from shared.methods.feddiffuse.config import FedDiffuseConfig
from shared.methods.fedphd.config import FedPhDConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script() -> ModuleType:
    path = ROOT / "benchmarks" / "gpu" / "gpu_compare.py"
    spec = importlib.util.spec_from_file_location("gpu_compare", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_compare"] = module
    spec.loader.exec_module(module)
    return module


def _toml(script: ModuleType, rounds_e5: int = 4, every: int = 1) -> str:
    plan = {"rounds_e5": rounds_e5, "eval_every_e5": every}
    return str(script.compare_toml(plan, preset="fmnist-small", batch=128, lr=5e-4,
                                   num_samples=1000, num_reference=10000, sample_steps=50,
                                   clients=2))  # fmt: skip


def test_the_written_comparison_is_valid_and_equal_in_local_compute(
    script: ModuleType, tmp_path: Path
) -> None:
    spec = parse_compare(tomllib.loads(_toml(script)), tmp_path / "c.toml", env={})
    assert [m.label for m in spec.methods] == list(script.METHODS)
    sizes = [3000] * 20  # N = 20 devices of ~3000 images, 4 of them per round
    steps = {m.label: sum(steps_per_round(m.cfg, sizes)) for m in spec.methods}
    assert len(set(steps.values())) == 1, steps  # 4 E=5 rounds = 20 E=1 rounds
    evals = {m.label: m.cfg.run.rounds // m.cfg.eval.every for m in spec.methods}
    assert set(evals.values()) == {4}, evals  # the same equal-compute evaluation points
    by = {m.label: m.cfg for m in spec.methods}
    phd, phd_os = FedPhDConfig.of(by["FedPhD"]), FedPhDConfig.of(by["FedPhD (OS)"])
    assert phd.prune_at == "sparse" and phd.sparse_rounds == 5 and phd_os.prune_at == "init"
    assert phd.prune_ratio == phd_os.prune_ratio == 0.44
    assert FedDiffuseConfig.of(by["FedDiffuse (USPLIT)"]).split == "usplit"
    assert all(c.data.classes_per_device == 2 and c.federation.num_edges == 2
               for c in by.values())  # fmt: skip


def test_methods_filter_keeps_the_asked_tables_and_needs_the_reference(
    script: ModuleType, tmp_path: Path
) -> None:
    kept = script.keep_methods(_toml(script), ["FedAvg", "FedPhD"])
    spec = parse_compare(tomllib.loads(kept), tmp_path / "c.toml", env={})
    assert [m.label for m in spec.methods] == ["FedAvg", "FedPhD"]
    with pytest.raises(SystemExit, match="FedAvg"):
        script.keep_methods(_toml(script), ["FedPhD"])
    with pytest.raises(SystemExit, match="'MOON'"):
        script.keep_methods(_toml(script), ["FedAvg", "MOON"])


def test_the_plan_is_the_longest_run_predicted_to_fit(script: ModuleType) -> None:
    """Measured on an H100 (2026-11-26): 3.65 steps/s and 559 us per image-step for each of
    six processes; the plan was 2 FedAvg rounds, and the run took 361 s. On an H200
    (2026-11-27, fmnist-tiny): 13.1 steps/s and 102 us, 472 s to fill; 6 rounds took 310 s."""
    cal = {"steps_per_s": 3.65, "s_per_image_step": 559e-6}
    kw = {"num_samples": 1000, "sample_steps": 50, "max_rounds": 60}
    first = script.plan(cal, 394.0, **kw)
    assert first["rounds_e5"] == 2
    assert first["predicted_s"] == pytest.approx(361, rel=0.03)
    h200 = script.plan({"steps_per_s": 13.1, "s_per_image_step": 102e-6}, 472.0, **kw)
    assert script.plan(
        {"steps_per_s": 13.1, "s_per_image_step": 102e-6}, 472.0, **{**kw, "max_rounds": 6}
    )["predicted_s"] == pytest.approx(310, rel=0.03)
    assert h200["rounds_e5"] == 9  # the eval-time overcount left that run at 6
    fast = {"steps_per_s": 40.0, "s_per_image_step": 50e-6}
    p = script.plan(fast, 394.0, **kw)
    assert p["predicted_s"] <= script.FILL * 394.0
    longer = script.plan(fast, 394.0, **{**kw, "max_rounds": p["rounds_e5"] + 1})
    assert longer["rounds_e5"] == p["rounds_e5"]  # one more round would not have fitted
    assert script.plan(fast, 10_000.0, **kw)["rounds_e5"] == 60  # the cap


def test_the_plan_with_a_resident_capture_charges_the_per_call_rounds(script: ModuleType) -> None:
    """With reuse, every step runs at the resident rate, and each round that still captures
    per call (FedPhD's five sparse rounds on 4 devices, every SCAFFOLD round) adds a
    capture's fixed cost: the 24-step round time per call minus per replay. Without the
    per-call rate (no reuse) the plan is the one it always was."""
    kw = {"num_samples": 1000, "sample_steps": 50, "max_rounds": 10}
    base = {"steps_per_s": 30.0, "s_per_image_step": 1e-4}
    fixed = 24 / 15.0 - 24 / 30.0  # a capture's cost: 0.8 s
    plain = script.plan(base, 10_000.0, **kw)["predicted_s"]
    reuse = {**base, "percall_steps_per_s": 15.0}
    assert script.plan(reuse, 10_000.0, **kw)["predicted_s"] == pytest.approx(
        plain + 10 * 4 * fixed  # SCAFFOLD's 40 device rounds exceed FedPhD's 20
    )
    no_scaffold = [m for m in script.METHODS if m != "SCAFFOLD"]
    assert script.plan(reuse, 10_000.0, **kw, methods=no_scaffold)["predicted_s"] == pytest.approx(
        plain + 20 * fixed
    )
    only_resident = ["FedAvg", "FedAvg (E=1)", "FedDiffuse (USPLIT)"]
    assert script.plan(reuse, 10_000.0, **kw, methods=only_resident)["predicted_s"] == plain
