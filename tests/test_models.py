from __future__ import annotations

import json

import pytest
import torch

from estuary.cli import main
from shared.config import DiffusionSection
from shared.diffusion import ddim_sample, ddpm_loss, make_train_scheduler
from shared.errors import ConfigError
from shared.models import build_unet, model_info


def test_ddpm_cifar10_matches_the_paper() -> None:
    info = model_info("ddpm-cifar10")
    assert info.params / 1e6 == pytest.approx(35.7, abs=0.05)
    assert info.macs / 1e9 == pytest.approx(6.06, rel=0.01)
    assert info.fp32_bytes == info.params * 4


def test_tiny_is_well_under_a_million() -> None:
    assert model_info("fmnist-tiny").params < 800_000


def test_same_seed_same_init() -> None:
    a = build_unet("fmnist-tiny", seed=3).state_dict()
    b = build_unet("fmnist-tiny", seed=3).state_dict()
    c = build_unet("fmnist-tiny", seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_unknown_preset() -> None:
    with pytest.raises(ConfigError, match="fmnist-tiny"):
        build_unet("nope")


def test_loss_and_sampler_shapes() -> None:
    model = build_unet("fmnist-tiny")
    cfg = DiffusionSection()
    gen = torch.Generator().manual_seed(0)
    loss = ddpm_loss(model, torch.zeros(2, 1, 32, 32), make_train_scheduler(cfg), gen)
    assert loss.ndim == 0 and torch.isfinite(loss)
    x = ddim_sample(model, (2, 1, 32, 32), cfg, torch.Generator().manual_seed(1), steps=3)
    y = ddim_sample(model, (2, 1, 32, 32), cfg, torch.Generator().manual_seed(1), steps=3)
    assert x.shape == (2, 1, 32, 32) and torch.equal(x, y)
    assert x.min() >= -1 and x.max() <= 1


def test_model_info_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model-info", "--preset", "fmnist-tiny", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == model_info("fmnist-tiny").params
    assert {"macs", "fp32_bytes"} <= set(out)
