"""Resuming an interrupted in-process run (``estuary simulate``, ``estuary compare``) after
its latest checkpoint, with the devices' kept state: the same final model as a run that
was never interrupted."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from device_agent.service import DeviceAgent
from estuary.compare import CompareSpec, load_compare, run_compare
from estuary.resume import STATE_DIR, ResumeRefused, round_state_dir
from estuary.simulate import SimulationResult, simulate
from shared.config import RunConfig
from shared.evaluation.recorder import RunRecorder
from tests.conftest import tiny_config

ROUNDS = 4
STOP_AFTER = 2  # the 1-based round after which the interrupted runs stop


def fedavg_keep() -> RunConfig:
    """FedAvg whose devices keep their Adam moments from round to round."""
    return tiny_config(
        run={"rounds": ROUNDS},
        federation={"num_devices": 4, "num_edges": 2},
        data={"synthetic_size": 64},
        train={"local_steps": 2, "batch_size": 4, "lr": 2e-3, "optimizer_state": "keep"},
    )


def prism_small() -> RunConfig:
    """PRISM on 4 devices (its cloud state and the devices' score optimizers)."""
    return tiny_config(
        run={"rounds": ROUNDS},
        federation={"num_devices": 4, "num_edges": 2},
        data={"synthetic_size": 64},
        train={"batch_size": 4},
        algorithm={"name": "prism", "prism": {"local_iters": 2}},
    )


def pfedgpa_small() -> RunConfig:
    """pFedGPA on 3 devices: the cloud personalizes each round's uploads (held across the
    checkpoint) into the devices' next models."""
    return tiny_config(
        run={"rounds": ROUNDS},
        federation={"num_devices": 3, "num_edges": 1},
        data={"synthetic_size": 300},
        model={"preset": "fmnist-cnn"},
        train={"optimizer": "sgd", "lr": 0.05, "batch_size": 25, "local_epochs": 1,
               "local_steps": 0, "grad_clip": 0.0, "threads": 1},
        algorithm={"name": "pfedgpa", "pfedgpa_store_rounds": 2, "pfedgpa_ae_steps": 2,
                   "pfedgpa_dm_steps": 2, "pfedgpa_timesteps": 10, "pfedgpa_invert_from": 2,
                   "pfedgpa_batch": 2, "pfedgpa_denoiser_width": 4},
    )  # fmt: skip


CONFIGS: dict[str, Callable[[], RunConfig]] = {
    "fedavg-keep": fedavg_keep,
    "prism": prism_small,
    "pfedgpa": pfedgpa_small,
}
#: where the devices' kept state decides the resumed rounds (pFedGPA's devices keep
#: nothing that matters: its cloud's held uploads do)
DEVICE_STATE = ["fedavg-keep", "prism"]
#: the tests that compare with the uninterrupted runs share them on one pytest worker
shares_uninterrupted = pytest.mark.xdist_group("resume-uninterrupted")


@pytest.fixture
def interrupt(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], None]]:
    """``interrupt(run_dir)``: the next run into ``run_dir`` stops (KeyboardInterrupt, as
    Ctrl-C) once round :data:`STOP_AFTER` is recorded, after its checkpoint."""
    targets: set[Path] = set()
    original = RunRecorder.on_round_end

    def on_round_end(self: RunRecorder, s: Any) -> None:
        original(self, s)
        if self.run_dir in targets and s.round + 1 == STOP_AFTER:
            targets.discard(self.run_dir)
            raise KeyboardInterrupt

    monkeypatch.setattr(RunRecorder, "on_round_end", on_round_end)
    yield targets.add


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SimulationResult]:
    """Each config run once without interruption."""
    root = tmp_path_factory.mktemp("uninterrupted")
    return {
        name: simulate(make(), root / name, progress=False, evaluate=False)
        for name, make in CONFIGS.items()
    }


def _cut(cfg: RunConfig, run_dir: Path, interrupt: Callable[[Path], None]) -> None:
    """Run ``cfg`` into ``run_dir`` until it is interrupted after round STOP_AFTER."""
    interrupt(run_dir)
    with pytest.raises(KeyboardInterrupt):
        simulate(cfg, run_dir, progress=False, evaluate=False)
    assert not (run_dir / "summary.json").exists()


@shares_uninterrupted
@pytest.mark.parametrize("name", list(CONFIGS))
def test_an_interrupted_simulation_resumes_to_the_same_final_model(
    name: str,
    tmp_path: Path,
    uninterrupted: dict[str, SimulationResult],
    interrupt: Callable[[Path], None],
) -> None:
    cfg, run_dir = CONFIGS[name](), tmp_path / "run"
    _cut(cfg, run_dir, interrupt)
    kept = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(kept) == STOP_AFTER
    states = round_state_dir(run_dir, STOP_AFTER - 1)
    assert sorted(p.name for p in states.glob("dev*.safetensors")) == [
        f"dev{i:03d}.safetensors" for i in range(cfg.federation.num_devices)
    ]
    resumed = simulate(cfg, run_dir, progress=False, evaluate=False)
    full = uninterrupted[name]
    assert resumed.resumed_after_round == STOP_AFTER
    assert resumed.final_model_sha256 == full.final_model_sha256
    assert [r["model_sha256"] for r in resumed.rows] == [r["model_sha256"] for r in full.rows]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert lines[:STOP_AFTER] == kept and len(lines) == ROUNDS  # appended after the kept rows
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_after_round"] == STOP_AFTER
    assert summary["final_model_sha256"] == full.final_model_sha256
    # what the devices uploaded adds up over both parts as over the uninterrupted run
    blob = "received:" + cfg.algorithm.config().traffic().blob_kind
    assert resumed.traffic["bytes"][blob] == full.traffic["bytes"][blob]
    personal = "received:personal_model"  # pFedGPA: the resumed round got its models too
    assert resumed.traffic["bytes"].get(personal) == full.traffic["bytes"].get(personal)
    # only the states of the latest checkpoints are kept
    assert len(list((run_dir / STATE_DIR).iterdir())) <= 2
    # a finished run run again trains nothing and reports the same (a compare whose method
    # finished but was stopped before its record was written)
    again = simulate(cfg, run_dir, progress=False, evaluate=False)
    assert again.resumed_after_round == ROUNDS
    assert again.final_model_sha256 == full.final_model_sha256
    assert (run_dir / "metrics.jsonl").read_text().splitlines() == lines


@shares_uninterrupted
@pytest.mark.parametrize("name", DEVICE_STATE)
def test_a_resume_without_the_devices_states_ends_elsewhere(
    name: str,
    tmp_path: Path,
    uninterrupted: dict[str, SimulationResult],
    interrupt: Callable[[Path], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control: the same resume with every device restored to nothing (the checkpoint
    and the cloud's state only) trains the resumed rounds differently, so the test above
    sees the devices' states."""
    cfg, run_dir = CONFIGS[name](), tmp_path / "run"
    _cut(cfg, run_dir, interrupt)
    monkeypatch.setattr(DeviceAgent, "restore_state", lambda self, path=None: True)
    resumed = simulate(cfg, run_dir, progress=False, evaluate=False)
    assert resumed.resumed_after_round == STOP_AFTER
    assert resumed.final_model_sha256 != uninterrupted[name].final_model_sha256


@shares_uninterrupted
def test_another_configs_checkpoints_are_refused_and_fresh_starts_over(
    tmp_path: Path, uninterrupted: dict[str, SimulationResult], interrupt: Callable[[Path], None]
) -> None:
    cfg, run_dir = fedavg_keep(), tmp_path / "run"
    _cut(cfg, run_dir, interrupt)
    other = fedavg_keep().model_copy(update={"train": cfg.train.model_copy(update={"lr": 1e-3})})
    with pytest.raises(ResumeRefused, match="different config"):
        simulate(other, run_dir, progress=False, evaluate=False)
    assert (run_dir / "config.json").read_text() == cfg.to_json()  # refused before any change
    # --fresh: the run starts over, the earlier checkpoints set aside, its states dropped
    again = simulate(cfg, run_dir, progress=False, evaluate=False, fresh=True)
    assert again.resumed_after_round is None
    assert again.final_model_sha256 == uninterrupted["fedavg-keep"].final_model_sha256
    assert len(list(run_dir.glob("checkpoints.replaced-*"))) == 1
    # states of the checkpoints a run left without them (the MQTT cloud's): starts over
    for d in (run_dir / STATE_DIR).iterdir():
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    assert simulate(cfg, run_dir, progress=False, evaluate=False).resumed_after_round is None


COMPARE = """
[compare]
name = "resume"

[base.run]
seed = 0
rounds = 4
[base.federation]
num_devices = 4
num_edges = 2
round_deadline_s = 60
[base.data]
dataset = "synthetic"
synthetic_size = 64
partition = "iid"
[base.model]
preset = "fmnist-tiny"
[base.train]
local_steps = 2
batch_size = 4
lr = {lr}
optimizer_state = "keep"
threads = 1
[base.eval]
every = 0
sample_every = 0
checkpoint_every = 1

[[method]]
label = "FedAvg"
overrides = {{"algorithm.name" = "fedavg"}}

[[method]]
label = "SCAFFOLD"
overrides = {{"algorithm.name" = "scaffold"}}
"""


def _compare_file(path: Path, lr: float = 2e-3) -> Path:
    path.write_text(COMPARE.format(lr=lr))
    return path


def _final_sha(run_dir: Path) -> str:
    return str(json.loads((run_dir / "summary.json").read_text())["final_model_sha256"])


def _interrupted_fedavg(
    tmp_path: Path, interrupt: Callable[[Path], None]
) -> tuple[CompareSpec, Path, Path, str]:
    """A compare spec whose FedAvg run into ``tmp_path/out`` was interrupted after round
    :data:`STOP_AFTER`: (the spec, the output folder, FedAvg's run folder, the final model
    of an uninterrupted run of the same config)."""
    spec = load_compare(_compare_file(tmp_path / "c.toml"))
    fedavg = spec.methods[0]
    reference = simulate(fedavg.cfg, tmp_path / "reference", progress=False, evaluate=False)
    out = tmp_path / "out"
    interrupt(out / fedavg.slug)
    with pytest.raises(KeyboardInterrupt):
        run_compare(spec, out, evaluate=False, only=["FedAvg"], tables=False)
    return spec, out, out / fedavg.slug, reference.final_model_sha256


def test_compare_resumes_an_interrupted_method(
    tmp_path: Path, interrupt: Callable[[Path], None], capsys: pytest.CaptureFixture[str]
) -> None:
    spec, out, run_dir, reference = _interrupted_fedavg(tmp_path, interrupt)
    capsys.readouterr()
    done = run_compare(spec, out, evaluate=False, only=["FedAvg"], tables=False)
    assert f"resuming {run_dir} after round {STOP_AFTER}" in capsys.readouterr().out
    (run,) = done.runs
    assert [r["round"] for r in run.rows] == list(range(1, ROUNDS + 1))
    assert _final_sha(run_dir) == reference

    # the same method under another config: its checkpoints are not resumed, said once
    other = load_compare(_compare_file(tmp_path / "other.toml", lr=1e-3))
    interrupt(run_dir)
    with pytest.raises(KeyboardInterrupt):
        run_compare(other, out, evaluate=False, only=["FedAvg"], tables=False)
    capsys.readouterr()
    run_compare(spec, out, evaluate=False, only=["FedAvg"], tables=False)
    said = capsys.readouterr().out
    assert said.count("not resuming") == 1 and "starting over" in said
    assert _final_sha(run_dir) == reference


@pytest.mark.slow  # CI's slow stage: --jobs children take the in-process path's resume
def test_compare_jobs_resume_an_interrupted_method(
    tmp_path: Path, interrupt: Callable[[Path], None], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--jobs 2``: the child process that runs the interrupted method resumes it."""
    spec, out, run_dir, reference = _interrupted_fedavg(tmp_path, interrupt)
    done = run_compare(spec, out, evaluate=False, jobs=2)
    assert [r.method.label for r in done.runs] == ["FedAvg", "SCAFFOLD"] and done.rows
    log = (run_dir / "compare.log").read_text()
    assert f"after round {STOP_AFTER}" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_after_round"] == STOP_AFTER
    assert summary["final_model_sha256"] == reference
    scaffold = json.loads((out / spec.methods[1].slug / "summary.json").read_text())
    assert scaffold["resumed_after_round"] is None
