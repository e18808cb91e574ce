from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from estuary.cli import main
from shared.config import RunConfig
from shared.errors import CodecError
from shared.models.checkpoint import latest_checkpoint_path, load_checkpoint, save_checkpoint
from shared.models.plan import ChannelPlan, dense_plan
from shared.models.presets import build_unet
from shared.models.pruning import prune_unet
from tests.conftest import tiny_config


def test_checkpoint_round_trip_and_tamper(tmp_path: Path) -> None:
    cfg = RunConfig()
    model = dict(build_unet(cfg.model.preset, seed=0).state_dict())
    save_checkpoint(tmp_path, 0, model, cfg)
    ones = {k: torch.ones_like(v) for k, v in model.items()}
    path = save_checkpoint(tmp_path, 1, ones, cfg, {"c": torch.zeros(2)})
    assert latest_checkpoint_path(tmp_path) == path
    ck = load_checkpoint(path)
    assert ck.round == 1 and ck.config == cfg and torch.equal(ck.algo_state["c"], torch.zeros(2))
    assert not list(tmp_path.glob("*.tmp"))
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01  # flip a low bit inside the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(CodecError, match="hash"):
        load_checkpoint(path)


def test_checkpoint_weights_must_fit_the_architecture(tmp_path: Path) -> None:
    """Weights that do not fit the preset, or the recorded channel plan, are refused on load
    (they used to surface later as a raw load_state_dict error, or as weights every edge
    rejects); a pointer naming a file outside the directory is ignored."""
    cfg = tiny_config()
    dense = dict(build_unet(cfg.model.preset, seed=0).state_dict())
    plan = ChannelPlan.of_module(prune_unet(build_unet(cfg.model.preset, seed=0), 0.3))
    path = save_checkpoint(tmp_path, 0, dense, cfg, plan=plan)  # dense weights, pruned plan
    with pytest.raises(CodecError, match="do not fit its channel plan of 'fmnist-tiny'"):
        load_checkpoint(path)
    path = save_checkpoint(tmp_path, 1, {"w": torch.zeros(4)}, cfg)
    with pytest.raises(CodecError, match="do not fit dense of 'fmnist-tiny'"):
        load_checkpoint(path)
    bad = dict(dense_plan(cfg.model.preset), preset="fmnist-small")
    # written unchecked (as another build, or a corrupted file, could have written it)
    path = save_checkpoint(tmp_path, 2, dense, cfg, plan=ChannelPlan(cfg.model.preset, bad))
    with pytest.raises(CodecError, match="bad architecture plan"):
        load_checkpoint(path)
    (tmp_path / "latest.json").write_text(json.dumps({"file": "../round_000002.safetensors"}))
    assert latest_checkpoint_path(tmp_path) == path  # the newest round file instead


def test_cli_simulate_then_eval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny_config(
        run={"rounds": 1}, eval={"num_samples": 20, "num_reference": 40, "sample_steps": 2}
    )
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(cfg.to_json())
    out = tmp_path / "run"
    assert main(["simulate", str(cfg_path), "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["eval", str(out), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["extractor"] == "fmnist-cnn-v1" and metrics["round"] == 1  # the first
    ckpt = load_checkpoint(latest_checkpoint_path(out / "checkpoints"))  # type: ignore[arg-type]
    assert ckpt.init == "random"  # the cloud records what the run started from
    assert metrics["fid"] > 0 and metrics["n_fake"] == 20
    assert main(["eval", str(out), "--json", "--num-samples", "12"]) == 0
    assert json.loads(capsys.readouterr().out)["n_fake"] == 12
    for bad in ("0", "-5"):  # validated like eval.num_samples in a config file
        assert main(["eval", str(out), "--num-samples", bad]) == 2
        assert "eval.num_samples" in capsys.readouterr().err


def test_cli_errors_are_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlr = -3\n")
    assert main(["simulate", str(bad)]) == 2
    assert "train.lr" in capsys.readouterr().err
    assert main(["eval", str(tmp_path)]) == 2


def test_a_refused_resume_leaves_the_run_directory_as_it_was(tmp_path: Path) -> None:
    """The cloud refuses to resume another config's checkpoints before it writes anything:
    the run's config.json still describes its checkpoints (it used to be overwritten)."""
    from cloud.main import main as cloud_main

    old, new = tiny_config(run={"seed": 1}), tiny_config(run={"seed": 2})
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints", 0, build_unet("fmnist-tiny").state_dict(), old)
    (run / "config.json").write_text(old.to_json())
    new_path = tmp_path / "new.json"
    new_path.write_text(new.to_json())
    assert cloud_main([str(new_path), "--out", str(run), "--metrics-port", "-1"]) == 2
    assert (run / "config.json").read_text() == old.to_json()


def test_resume_follows_a_moved_init_file_but_not_other_weights(tmp_path: Path) -> None:
    """The config digest keys ``model.init`` by its path, but resuming reads only the
    checkpoint: a run whose init file was moved resumes when the file at the new path holds
    the weights the checkpoint recorded, and is refused (with the reason) when it holds
    others, when the checkpoint predates the record, or when anything else changed."""
    from cloud.main import resume_point
    from shared.errors import EstuaryError
    from shared.models.init import init_fingerprint

    state = build_unet("fmnist-tiny", seed=3).state_dict()
    old_path, new_path = tmp_path / "a.safetensors", tmp_path / "moved" / "b.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, old_path)
    old = tiny_config(model={"init": str(old_path)})
    fingerprint = init_fingerprint("fmnist-tiny", str(old_path))
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints", 4, dict(state), old, init=fingerprint)
    new_path.parent.mkdir()
    old_path.rename(new_path)
    new = tiny_config(model={"init": str(new_path)})
    assert new.digest() != old.digest()
    point = resume_point(new, run)
    assert point is not None and point.next_round == 5 and point.init == fingerprint
    assert all(torch.equal(point.model[k], v) for k, v in state.items())

    other = {k: v + 1 for k, v in state.items()}  # other weights at the new path
    save_file({k: v.contiguous() for k, v in other.items()}, new_path)
    with pytest.raises(EstuaryError, match="is not what the run started from"):
        resume_point(new, run)
    save_checkpoint(run / "checkpoints", 5, dict(state), old)  # no recorded init
    with pytest.raises(EstuaryError, match="does not record what the run started from"):
        resume_point(new, run)
    save_checkpoint(run / "checkpoints", 6, dict(state), old, init=fingerprint)
    changed = tiny_config(model={"init": str(new_path)}, run={"seed": 9})
    with pytest.raises(EstuaryError, match=r"different config \(\w+ != \w+\); use another"):
        resume_point(changed, run)
    assert resume_point(old, run) is not None  # the same config resumes without the file


def test_the_cloud_records_the_init_it_started_from(tmp_path: Path) -> None:
    """A fresh cloud records model.init's fingerprint; a resumed one carries its checkpoint's
    record, and None stays None (fingerprinting the file now could record other weights than
    the run started from)."""
    from cloud.main import fresh_start
    from cloud.service import CloudServer
    from shared.methods.registry import make_algorithm
    from shared.models.init import init_fingerprint
    from shared.transport.bus import MemoryBus

    state = build_unet("fmnist-tiny", seed=3).state_dict()
    path = tmp_path / "init.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, path)
    cfg = tiny_config(model={"init": str(path)})
    start = fresh_start(cfg)
    assert start.init == init_fingerprint("fmnist-tiny", str(path)) and start.next_round == 0
    assert all(torch.equal(start.model[k], v) for k, v in state.items())

    def cloud(**kw: object) -> CloudServer:
        return CloudServer(cfg, MemoryBus(), make_algorithm(cfg), initial_model=dict(state), **kw)  # type: ignore[arg-type]

    assert cloud().init == start.init  # the default: model.init as it is now
    assert cloud(init=None, start_round=4).init is None
    assert cloud(init="sha256:ab", start_round=4).init == "sha256:ab"
    path.unlink()
    assert cloud().init is None  # an unreadable file is not recorded


def test_starting_over_moves_an_earlier_runs_checkpoints_aside(tmp_path: Path) -> None:
    """A run that starts over in a directory with checkpoints (simulate, or the cloud with
    ``--fresh``) moves them to ``checkpoints.replaced-*``: kept, but never resumed from."""
    from shared.evaluation.recorder import prepare_run_dir

    cfg = tiny_config()
    run = tmp_path / "run"
    older = save_checkpoint(run / "checkpoints", 6, build_unet("fmnist-tiny").state_dict(), cfg)
    stale = save_checkpoint(run / "checkpoints", 7, build_unet("fmnist-tiny").state_dict(), cfg)
    assert prepare_run_dir(cfg, run, resuming=True) == run and stale.is_file()  # resumed: kept
    prepare_run_dir(cfg, run)
    assert latest_checkpoint_path(run / "checkpoints") is None
    (aside,) = run.glob("checkpoints.replaced-*")
    assert (aside / stale.name).is_file() and (aside / "latest.json").is_file()
    assert not (aside / older.name).exists()  # only the earlier run's latest is kept
    save_checkpoint(run / "checkpoints", 0, build_unet("fmnist-tiny").state_dict(), cfg)
    prepare_run_dir(cfg, run)  # again within the same second: a second, distinct folder
    assert len(list(run.glob("checkpoints.replaced-*"))) == 2


def test_demo_says_when_a_rerun_trained_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A demo rerun on a finished run directory resumes after its last round; the summary
    says nothing was trained instead of looking like a fresh run."""
    from estuary.demo import DemoResult, print_demo_result

    result = DemoResult(tmp_path, 6, "ab" * 32, 3.0, resumed_after_round=6)
    print_demo_result(result)
    assert "nothing was trained" in capsys.readouterr().out
    print_demo_result(DemoResult(tmp_path, 6, "ab" * 32, 3.0, resumed_after_round=3))
    assert "resumed from the checkpoint of round 3" in capsys.readouterr().out
    print_demo_result(DemoResult(tmp_path, 6, "ab" * 32, 3.0))
    out = capsys.readouterr().out
    assert "nothing was trained" not in out and "resumed" not in out
