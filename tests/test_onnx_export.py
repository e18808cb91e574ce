"""ONNX export with the parity gate, the numpy DDIM sampler against diffusers', the model
card and ``estuary export`` / ``estuary sample``.

Models are briefly trained first (40 steps): an untrained U-Net's DDIM trajectory is chaotic
(it amplifies float rounding by orders of magnitude), a trained one is not, and trained
models are what gets deployed.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from device_agent.sampling import load_generator
from estuary.cli import main as cli_main
from shared.config import RunConfig, config_from_dict
from shared.data.datasets import load_dataset, to_model_input
from shared.deploy.export import export_module, model_card, to_onnx
from shared.deploy.onnx_sampler import DdimSchedule, OnnxGenerator
from shared.deploy.onnx_sampler import ddim_sample as numpy_ddim
from shared.diffusion.schedule import ddim_sample, make_train_scheduler
from shared.diffusion.training import train_local
from shared.errors import EstuaryError, ExportError
from shared.models.checkpoint import save_checkpoint
from shared.models.plan import ChannelPlan
from shared.models.presets import build_unet
from shared.models.pruning import prune_unet

# its module-scoped fixtures are built once: every test of the module on one pytest worker
pytestmark = pytest.mark.xdist_group("onnx_export")

PARITY = 1e-4  # fp32: max abs error of ONNX Runtime against torch (the bar)
SAMPLER = 1e-5  # numpy DDIM loop against diffusers' DDIMScheduler, same eps model


def _cfg(preset: str) -> RunConfig:
    return config_from_dict(
        {
            "run": {"name": "onnx", "seed": 0},
            "model": {"preset": preset},
            "data": {"dataset": "synthetic", "synthetic_size": 256},
            "train": {"local_steps": 40, "batch_size": 16, "lr": 2e-3},
        }
    )


@functools.cache
def trained(preset: str, sp: float = 0.0) -> nn.Module:
    """``preset`` (pruned by ``sp``) after 40 Adam steps on synthetic images."""
    cfg = _cfg(preset)
    data = load_dataset("synthetic", size=256, seed=0)
    x, y = to_model_input(data.images), torch.from_numpy(data.labels).long()
    model = build_unet(preset, seed=0)
    if sp:
        model = prune_unet(model, sp)
    gen = torch.Generator().manual_seed(0)
    train_local(model, x, cfg.train, make_train_scheduler(cfg.diffusion), gen, labels=y)
    return model.eval()


def _eps_fn(model: nn.Module):
    def eps(x: np.ndarray, t: np.ndarray, labels: np.ndarray | None) -> np.ndarray:
        lab = torch.from_numpy(labels) if labels is not None else None
        with torch.no_grad():
            return model(torch.from_numpy(x), torch.from_numpy(t), class_labels=lab).sample.numpy()

    return eps


@pytest.mark.parametrize("steps", [1, 10, 50])
def test_numpy_ddim_matches_diffusers_scheduler(steps: int) -> None:
    model = trained("fmnist-tiny")
    cfg = _cfg("fmnist-tiny")
    noise = torch.randn(4, 1, 32, 32, generator=torch.Generator().manual_seed(1))
    want = ddim_sample(model, (4, 1, 32, 32), cfg.diffusion, torch.Generator(), steps=steps,
                       noise=noise).numpy()  # fmt: skip
    got = numpy_ddim(_eps_fn(model), noise.numpy(), DdimSchedule(), steps)
    assert got.dtype == np.float32
    assert np.abs(got - want).max() <= SAMPLER


def test_schedule_timesteps_match_diffusers() -> None:
    from diffusers import DDIMScheduler

    ref = DDIMScheduler(num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02)
    for steps in (1, 7, 50, 100, 1000):
        ref.set_timesteps(steps)
        assert (DdimSchedule().timesteps(steps) == ref.timesteps.numpy()).all()
    assert np.abs(DdimSchedule().alphas_cumprod() - ref.alphas_cumprod.numpy()).max() < 1e-6


@pytest.mark.parametrize("steps", [0, -3, 1001])
def test_numpy_ddim_refuses_step_counts_outside_the_schedule(steps: int) -> None:
    """A bad step count is an EstuaryError with a reason, not a ZeroDivisionError."""
    noise = np.zeros((1, 1, 32, 32), dtype=np.float32)
    with pytest.raises(EstuaryError, match=r"steps must be in 1\.\.1000"):
        numpy_ddim(lambda x, t, labels: x, noise, DdimSchedule(), steps)


@pytest.mark.parametrize(
    ("preset", "sp"),
    [("fmnist-tiny", 0.0), ("fmnist-tiny", 0.44), ("fmnist-tiny-cond", 0.0),
     ("fmnist-tiny-cond", 0.3)],
)  # fmt: skip
def test_export_parity_dense_pruned_conditional(preset: str, sp: float, tmp_path: Path) -> None:
    model = trained(preset, sp)
    cfg = _cfg(preset)
    plan = ChannelPlan.of_module(model) if sp else None
    result = export_module(
        cfg, model, plan, tmp_path, round_=3, source="test", threshold=PARITY, parity_steps=20
    )
    p = result.parity
    assert p.passed and p.random_max_abs <= PARITY and p.trajectory_max_abs <= PARITY
    card = json.loads((tmp_path / "card.json").read_text())
    assert card["pruned"] == bool(sp) and card["num_classes"] == (10 if "cond" in preset else 0)
    assert card["params"] == sum(q.numel() for q in model.parameters())
    assert card["parity"]["trajectory_max_abs"] == p.trajectory_max_abs
    # dynamic batch: another batch size than the traced one, same numbers as torch
    gen = OnnxGenerator(tmp_path / "model.onnx", card, provider="cpu")
    x = torch.randn(5, 1, 32, 32, generator=torch.Generator().manual_seed(3))
    t = torch.tensor([999, 500, 10, 0, 250])
    labels = torch.tensor([0, 1, 2, 3, 9]) if card["num_classes"] else None
    with torch.no_grad():
        want = model(x, t, class_labels=labels).sample.numpy()
    got = gen.eps(x.numpy(), t.numpy(), labels.numpy() if labels is not None else None)
    assert np.abs(got - want).max() <= PARITY


def test_conditional_sampler_uses_the_labels(tmp_path: Path) -> None:
    model = trained("fmnist-tiny-cond")
    export_module(_cfg("fmnist-tiny-cond"), model, None, tmp_path, round_=0, source="t")
    gen, _ = load_generator(tmp_path)
    noise = gen.noise(2, seed=0)
    same = np.repeat(noise[:1], 2, axis=0)
    a, _ = gen.sample(2, steps=5, noise=same, labels=np.array([0, 0]))
    b, _ = gen.sample(2, steps=5, noise=same, labels=np.array([0, 7]))
    assert np.abs(a[0] - a[1]).max() == 0
    assert np.abs(b[0] - b[1]).max() > 1e-3
    with pytest.raises(Exception, match="labels"):
        gen.sample(2, steps=2, labels=np.array([0, 10]))


def test_export_refused_above_threshold_writes_nothing(tmp_path: Path) -> None:
    model = trained("fmnist-tiny")
    with pytest.raises(ExportError, match="refused"):
        export_module(_cfg("fmnist-tiny"), model, None, tmp_path / "x", round_=0, source="t",
                      threshold=1e-12)  # fmt: skip
    assert not (tmp_path / "x" / "model.onnx").exists()


@pytest.mark.parametrize("threshold", [-1.0, float("nan"), float("inf")])
def test_export_refuses_a_meaningless_threshold(tmp_path: Path, threshold: float) -> None:
    with pytest.raises(ExportError, match="threshold must be"):
        export_module(_cfg("fmnist-tiny"), build_unet("fmnist-tiny"), None, tmp_path / "x",
                      round_=0, source="t", threshold=threshold)  # fmt: skip
    assert not (tmp_path / "x").exists()


def test_to_onnx_refuses_old_opset() -> None:
    with pytest.raises(ExportError, match="opset"):
        to_onnx(build_unet("fmnist-tiny"), opset=13)


def test_fp16_export_keeps_fp32_io(tmp_path: Path) -> None:
    model = trained("fmnist-tiny")
    cfg = _cfg("fmnist-tiny")
    data = to_onnx(model, fp16=True)
    card = model_card(cfg, model, None, onnx_bytes=data, round_=0, source="t", fp16=True,
                      opset=17, quality=None)  # fmt: skip
    try:
        gen = OnnxGenerator(data, card, provider="cpu")
    except Exception as err:  # an onnxruntime build without fp16 CPU kernels
        pytest.skip(f"this onnxruntime cannot run fp16 on the CPU: {err}")
    x = np.random.default_rng(0).standard_normal((2, 1, 32, 32), dtype=np.float32)
    eps = gen.eps(x, np.array([10, 900]), None)
    with torch.no_grad():
        want = model(torch.from_numpy(x), torch.tensor([10, 900])).sample.numpy()
    assert eps.dtype == np.float32
    assert np.abs(eps - want).max() < 5e-2


def test_export_and_sample_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _cfg("fmnist-tiny")
    model = trained("fmnist-tiny", 0.44)
    plan = ChannelPlan.of_module(model)
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints", 7, dict(model.state_dict()), cfg, plan=plan)
    # the checkpoint after index 7 is the eighth round: file, metrics row and card say 8
    assert (run / "checkpoints" / "round_000008.safetensors").is_file()
    rows = [{"round": 8, "quality": {"fid": 123.0}}, {"round": 9, "quality": {"fid": 99.0}}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli_main(["keys", "--out", str(tmp_path / "keys")]) == 0
    key = tmp_path / "keys" / "deploy_ed25519.pem"
    pub = tmp_path / "keys" / "deploy_ed25519.pub.pem"
    out = tmp_path / "export"
    capsys.readouterr()
    assert cli_main(["export", str(run), "--out", str(out), "--key", str(key), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    card = report["card"]
    assert report["signed"] and report["parity"]["passed"]
    assert card["source"]["round"] == 8 and card["quality"] == {"round": 8, "fid": 123.0}
    assert card["pruned"] and card["image_shape"] == [1, 32, 32] and card["macs"] > 0
    assert card["scheduler"]["num_train_timesteps"] == 1000
    args = ["sample", "--model", str(out), "--n", "6", "--steps", "5", "--batch-size", "4",
            "--out", str(tmp_path / "g.png"), "--verify-key", str(pub), "--json"]  # fmt: skip
    assert cli_main(args) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["n"] == 6 and stats["images_per_s"] > 0 and stats["signature"] == "verified"
    assert (tmp_path / "g.png").stat().st_size > 100
    for bad, reason in ((["--steps", "0"], "steps must be in 1..1000"),
                        (["--threads", "-1"], "threads must be >= 0")):  # fmt: skip
        bad_args = ["sample", "--model", str(out), "--out", str(tmp_path / "bad.png"), *bad]
        assert cli_main(bad_args) == 2
        assert reason in capsys.readouterr().err
    assert not (tmp_path / "bad.png").exists()
