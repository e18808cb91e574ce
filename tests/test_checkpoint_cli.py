from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from estuary.cli import main
from shared.checkpoint import latest_checkpoint_path, load_checkpoint, save_checkpoint
from shared.config import RunConfig
from shared.errors import CodecError
from tests.conftest import tiny_config


def test_checkpoint_round_trip_and_tamper(tmp_path: Path) -> None:
    cfg = RunConfig()
    model = {"w": torch.arange(4.0)}
    save_checkpoint(tmp_path, 0, model, cfg)
    path = save_checkpoint(tmp_path, 1, {"w": torch.ones(4)}, cfg, {"c": torch.zeros(2)})
    assert latest_checkpoint_path(tmp_path) == path
    ck = load_checkpoint(path)
    assert ck.round == 1 and ck.config == cfg and torch.equal(ck.algo_state["c"], torch.zeros(2))
    assert not list(tmp_path.glob("*.tmp"))
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01  # flip a low bit inside the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(CodecError, match="hash"):
        load_checkpoint(path)


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
    assert metrics["extractor"] == "fmnist-cnn-v1" and metrics["round"] == 0
    assert metrics["fid"] > 0 and metrics["n_fake"] == 20


def test_cli_errors_are_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlr = -3\n")
    assert main(["simulate", str(bad)]) == 2
    assert "train.lr" in capsys.readouterr().err
    assert main(["eval", str(tmp_path)]) == 2
