"""One-shot generators (PRISM's ResNet generator): the preset's size, batch-norm
recalibration, the feature-matching objective with moving averages, FedAvg and PRISM
federations on it, export with parity and the devices' ONNX sampler."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shared.config import RunConfig
from shared.deploy.onnx_sampler import OnnxGenerator
from shared.errors import EstuaryError
from shared.evaluation.evaluator import model_from_state, sample_images
from shared.methods.base import DeviceContext, build_algorithm
from shared.methods.prism.masking import fan_in, is_masked
from shared.methods.prism.method import MASK, STEP, THETA
from shared.models.oneshot import (
    MATCH_STATE,
    FeatureMatch,
    ResnetG,
    _ama_step,
    build_oneshot,
    match_net_on,
    recalibrate_bn,
)
from shared.models.presets import count_weight_macs, kind_of, model_info, state_spec
from tests.conftest import synthetic_federation, tiny_config


def oneshot_config(algorithm: str, *, device: str = "auto", **extra: Any) -> RunConfig:
    """Two rounds of 4 devices at 2 edges on the smallest ResNet generator."""
    return tiny_config(
        compute={"device": device},
        run={"rounds": 2},
        federation={"num_devices": 4, "num_edges": 2},
        data={"synthetic_size": 64},
        model={"preset": "resnetg-fmnist-16"},
        train={"batch_size": 8, "local_steps": 2},
        algorithm={"name": algorithm, "prism_local_iters": 2, **extra},
    )


# -- the generator ------------------------------------------------------------------------------
def test_the_paper_generator_has_its_size_and_cost() -> None:
    spec = state_spec("resnetg-fmnist-64")
    masked = {n: s for n, s in spec.items() if is_masked(n, s.shape)}
    assert len(masked) == 11
    assert sum(math.prod(s.shape) for s in masked.values()) == 3_543_616
    assert kind_of("resnetg-fmnist-64") == "oneshot" and kind_of("fmnist-tiny") == "unet"
    info = model_info("resnetg-fmnist-64")
    assert round(info.weight_macs / 1e9, 3) == 0.348  # Table 8: "0.34 B"
    assert info.params == 3_543_616  # no biases, BN without affine parameters
    # PRISM's scales: sqrt(2 / fan_in), torch's fan_in (a transposed conv: its out channels)
    scales = {n: math.sqrt(2 / fan_in(s.shape)) for n, s in masked.items()}
    assert scales["first.weight"] == pytest.approx(0.015625)
    assert scales["blocks.0.bypass.weight"] == pytest.approx(0.0625)
    assert scales["last.weight"] == pytest.approx(0.058926, abs=1e-6)
    assert state_spec("resnetg-cifar10-64")["last.weight"].shape == (3, 64, 3, 3)


def test_weight_macs_count_transposed_convolutions() -> None:
    model = ResnetG(nz=8, ngf=2, nc=1).eval()
    z = torch.zeros(1, 1, 32, 32)  # only the batch size is read for a one-shot generator
    first = 8 * (8 * 2) * 16  # in elements x out channels x kernel area
    assert count_weight_macs(model, z) > first


def test_recalibrated_batch_norm_maps_each_latent_to_one_image() -> None:
    model = build_oneshot("resnetg-fmnist-16", seed=0)
    recalibrate_bn(model, seed=3)
    assert not model.training
    z = torch.randn(6, 128, 1, 1, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole, part = model(z), model(z[:2])
    assert torch.allclose(whole[:2], part, atol=1e-5)
    assert whole.shape == (6, 1, 32, 32) and float(whole.abs().max()) <= 1.0
    again = recalibrate_bn(build_oneshot("resnetg-fmnist-16", seed=0), seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), again.buffers(), strict=True))


# -- the objective ------------------------------------------------------------------------------
def test_the_moving_average_takes_an_adam_step_towards_delta() -> None:
    m = torch.zeros(2, 3)
    target = torch.tensor([[1.0, -2.0, 0.0], [0.5, 0.5, 0.5]])
    moments = [torch.zeros(2, 3), torch.zeros(2, 3)]
    _ama_step(m, target, moments, 1, lr=0.1)
    # the first Adam step moves each coordinate by lr towards the target (sign of -(m - t))
    assert torch.allclose(m, torch.tensor([[0.1, -0.1, 0.0], [0.1, 0.1, 0.1]]), atol=1e-6)


class _Linear(torch.nn.Module):
    """A tiny 'feature network': features = x flattened (ReLU of nothing: identity)."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)

    def relu_features(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)


class _Gen(torch.nn.Module):
    nz = 2

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(3))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z.flatten(1)[:, :1] * 0 + self.bias  # a constant image: the bias


def test_with_converged_averages_the_gradient_is_that_of_half_the_squared_distance() -> None:
    real_mean, real_var = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.0, 0.0, 0.0])
    match = FeatureMatch(_Linear(), 2, (real_mean, real_var), lr=1e-12)
    gen = _Gen()
    delta = real_mean - gen.bias.detach()
    match.m = torch.stack([delta, torch.zeros(3)])  # m already equals Delta
    loss = match(gen, torch.zeros(4, 1), None, torch.Generator().manual_seed(0))
    loss.backward()
    # d/d bias of 1/2 ||real_mean - bias||^2 = -(real_mean - bias)
    assert gen.bias.grad is not None
    assert torch.allclose(gen.bias.grad, -delta, atol=1e-5)
    # the value is eq. (1) on the batch (here the variance term is 0: a constant image)
    assert float(loss.detach()) == pytest.approx(float(delta @ delta), rel=1e-5)
    kept = match.state()
    again = FeatureMatch(_Linear(), 2, (real_mean, real_var), lr=1e-12, kept=kept)
    assert torch.equal(again.m, match.m) and again.step == match.step == 1


# -- federations ------------------------------------------------------------------------------
def _federate(cfg: RunConfig) -> tuple[Any, Any]:
    fed, bus, _ = synthetic_federation(cfg)
    fed.start()
    assert bus.run(lambda: fed.cloud.done)
    return fed, bus


def test_fedavg_trains_the_generator_by_feature_matching_and_devices_keep_the_averages() -> None:
    cfg = oneshot_config("fedavg")
    start = build_oneshot(cfg.model.preset, seed=cfg.run.seed).state_dict()
    fed, _ = _federate(cfg)
    final = fed.cloud.model
    assert not torch.equal(final["first.weight"], start["first.weight"])
    kept = fed.devices[0].algo_state[MATCH_STATE]
    assert kept["real_mean"].ndim == 1 and int(kept["ama"]["step"]) == 4  # 2 rounds x 2 steps
    images = sample_images(cfg, model_from_state(cfg, final), 5, steps=1)
    assert images.shape == (5, 1, 32, 32) and torch.isfinite(images).all()


@pytest.mark.parametrize("name", ["fedprox", "scaffold"])
def test_the_other_weight_training_algorithms_train_a_one_shot_generator(name: str) -> None:
    cfg = oneshot_config(name)
    start = build_oneshot(cfg.model.preset, seed=cfg.run.seed).state_dict()
    fed, _ = _federate(cfg)
    assert not torch.equal(fed.cloud.model["first.weight"], start["first.weight"])
    assert all(torch.isfinite(v).all() for v in fed.cloud.model.values() if v.is_floating_point())


def test_prism_masks_the_generator_and_uploads_one_bit_per_weight(tmp_path: Path) -> None:
    from shared.deploy.export import export_module

    cfg = oneshot_config("prism")
    fed, bus = _federate(cfg)
    final = fed.cloud.model
    assert float(final[STEP]) == 2.0
    masked = sum(v.numel() for k, v in final.items() if k.startswith(THETA))
    assert masked == 418_192
    up = bus.traffic.snapshot()["bytes"]["received:device_update"]
    assert masked / 8 * 8 <= up <= (masked / 8 + 200) * 8  # 8 uploads of a packed mask
    assert list(build_algorithm(cfg).upload_spec(fed.cloud.spec)) == [MASK]
    assert MATCH_STATE in fed.devices[0].algo_state
    # the deployed model: one fixed mask, BN recalibrated on latents, exported with parity
    module = model_from_state(cfg, final)
    result = export_module(cfg, module, None, tmp_path, round_=2, source="test")
    card = json.loads((tmp_path / "card.json").read_text())
    assert result.parity.passed and result.parity.trajectory_steps == 1
    assert card["kind"] == "oneshot" and card["latent_dim"] == 128 and "scheduler" not in card
    assert card["prism"]["masked_weights"] == masked
    onnx = OnnxGenerator(tmp_path / "model.onnx", card, provider="cpu")
    images, stats = onnx.sample(10, steps=50, seed=7, batch_size=4)
    assert images.shape == (10, 1, 32, 32) and stats.n == 10
    with torch.no_grad():
        want = module(torch.from_numpy(onnx.noise(10, 7))).numpy()
    assert float(np.abs(images - want).max()) < 1e-4
    bad = {**card, "latent_dim": 64}
    with pytest.raises(EstuaryError, match="latent_dim"):
        OnnxGenerator(tmp_path / "model.onnx", bad, provider="cpu")
    with pytest.raises(EstuaryError, match="kind"):
        OnnxGenerator(tmp_path / "model.onnx", {**card, "kind": "gan"}, provider="cpu")
    unet_card = {k: v for k, v in card.items() if k != "kind"}  # read as a U-Net's
    with pytest.raises(EstuaryError, match="sample"):
        OnnxGenerator(tmp_path / "model.onnx", unet_card, provider="cpu")


def test_algorithms_with_u_net_parts_refuse_a_one_shot_generator() -> None:
    for name in ("fedphd", "feddiffuse", "moon"):
        with pytest.raises(EstuaryError, match="one-shot generator"):
            oneshot_config(name)


def test_a_device_objective_is_computed_once_and_kept() -> None:
    cfg = oneshot_config("fedavg")
    algo = build_algorithm(cfg)
    data = torch.rand(12, 1, 32, 32) * 2 - 1
    ctx = DeviceContext("d0", data, torch.zeros(12, dtype=torch.long), torch.Generator())
    model = build_oneshot(cfg.model.preset)
    first = algo.objective(ctx, model, torch.device("cpu"))
    assert first is not None and ctx.state[MATCH_STATE]["n"] == 12
    mean = ctx.state[MATCH_STATE]["real_mean"]
    second = algo.objective(ctx, model, torch.device("cpu"))
    assert second is not None and ctx.state[MATCH_STATE]["real_mean"] is mean


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["prism", "fedavg"])
def test_two_rounds_train_on_a_gpu(algorithm: str) -> None:
    """A device's second round on CUDA: PRISM loads its kept Adam moments where the scores
    train, and the feature-matching state comes back to the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cfg = oneshot_config(algorithm, device="cuda")
    fed, _ = _federate(cfg)
    kept = fed.devices[0].algo_state[MATCH_STATE]
    assert kept["real_mean"].device.type == "cpu" and kept["ama"]["m"].device.type == "cpu"
    assert all(v.device.type == "cpu" for v in fed.cloud.model.values())


@pytest.mark.parametrize("algorithm", ["fedavg", "prism"])
def test_the_centralized_ceiling_trains_a_one_shot_generator_by_feature_matching(
    algorithm: str, tmp_path: Path
) -> None:
    from estuary.compare.runner import run_centralized
    from shared.models.checkpoint import latest_checkpoint_path, load_checkpoint

    cfg = oneshot_config(algorithm, prism_mada=False)
    rows, steps, plan, _ = run_centralized(cfg, tmp_path, evaluate=False, progress=False)
    assert [r["round"] for r in rows] == [2] and plan is None
    assert rows[0]["steps"] == sum(steps) == 16 and math.isfinite(rows[0]["train_loss"])
    path = latest_checkpoint_path(tmp_path / "checkpoints")
    assert path is not None
    # the checkpoint holds what a federated run's does (PRISM: the probabilities)
    saved = model_from_state(cfg, load_checkpoint(path).model).state_dict()
    start = build_oneshot(cfg.model.preset, seed=cfg.run.seed).state_dict()
    assert not torch.equal(saved["first.weight"], start["first.weight"])
    if algorithm == "prism":  # the dense model of one fixed mask over the frozen signs
        for name, w in saved.items():
            if is_masked(name, tuple(w.shape)):
                scale = math.sqrt(2.0 / fan_in(tuple(w.shape)))
                kept = w != 0
                assert torch.allclose(w[kept].abs(), torch.full_like(w[kept], scale))
                assert 0.2 < float(kept.float().mean()) < 0.8


def test_centralized_prism_trains_the_scores_and_draws_each_rounds_mask_once() -> None:
    from shared.diffusion.schedule import make_train_scheduler
    from shared.diffusion.training import train_local

    cfg = oneshot_config("prism")
    model = build_oneshot(cfg.model.preset, seed=cfg.run.seed)
    own = build_algorithm(cfg).central
    assert own is not None
    central = own.centralized(model, seed=3)
    assert central.train.grad_clip == 0.0
    assert central.optimizer.param_groups[0]["betas"] == (0.5, 0.999)
    scores = [p for p in central.net.parameters() if p.requires_grad]
    before = [s.detach().clone() for s in scores]
    real = (torch.zeros(106_496), torch.ones(106_496))
    match = FeatureMatch(match_net_on(torch.device("cpu")), 128, real, lr=0.005)
    train_local(central.net, torch.rand(16, 1, 32, 32) * 2 - 1, central.train,
                make_train_scheduler(cfg.diffusion), torch.Generator().manual_seed(0), steps=2,
                optimizer=central.optimizer, loss_fn=match)  # fmt: skip
    assert any(not torch.equal(a, b) for a, b in zip(scores, before, strict=True))
    one, again, other = (central.model(r).state_dict()["first.weight"] for r in (0, 0, 1))
    assert torch.equal(one, again) and not torch.equal(one, other)
