from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from estuary.cli import main
from shared.config import DiffusionSection, RunConfig
from shared.diffusion.schedule import ddim_sample, ddpm_loss, make_train_scheduler
from shared.errors import ConfigError
from shared.models.presets import build_unet, count_weight_macs, model_info


def test_ddpm_cifar10_matches_the_paper() -> None:
    info = model_info("ddpm-cifar10")
    assert info.params / 1e6 == pytest.approx(35.7, abs=0.05)
    assert info.macs / 1e9 == pytest.approx(6.06, rel=0.01)
    # Torch-Pruning's count adds bias additions and GroupNorm operations to the weight MACs
    assert info.weight_macs / 1e9 == pytest.approx(6.054, abs=0.0005)
    assert 0 < info.macs - info.weight_macs < 0.01 * info.macs
    assert info.fp32_bytes == info.params * 4


def test_weight_macs_by_hand() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)  # 4*8*8 outputs x 3*9 MACs
            self.dw = torch.nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)  # 256 x 9
            self.norm = torch.nn.GroupNorm(2, 4)  # not a weight multiply-accumulate
            self.fc = torch.nn.Linear(4, 5)  # 5 outputs x 4 MACs

        def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            h = self.norm(self.dw(self.conv(x)))
            return self.fc(h.mean((2, 3)))

    net = Net()
    assert count_weight_macs(net, torch.zeros(2, 3, 8, 8)) == 256 * 27 + 256 * 9 + 5 * 4
    assert not net.conv._forward_hooks  # hooks removed


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
    assert {"macs", "weight_macs", "fp32_bytes"} <= set(out)
    assert out["weight_macs"] == model_info("fmnist-tiny").weight_macs > 0
    assert out["fp32_mib"] == round(out["fp32_bytes"] / 2**20, 2) and "fp32_mb" not in out


def test_compute_device_resolution_and_every_algorithm_trains_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shared.config import config_from_dict
    from shared.diffusion.training import resolve_device
    from shared.methods import base
    from shared.methods.base import build_algorithm
    from shared.methods.registry import registered

    assert resolve_device("cpu").type == "cpu"
    # a per-process setting: GPU and CPU devices share one federation (same digest)
    assert (
        config_from_dict({"compute": {"device": "cuda"}}).digest() == config_from_dict({}).digest()
    )
    from shared.config.algorithms import config_class

    def config_of(name: str) -> RunConfig:  # an algorithm that trains no U-Nets: a classifier
        model = {} if "unet" in config_class(name).model_kinds else {"preset": "fmnist-cnn"}
        if name == "feddeo":  # one-shot, on a guidance generator
            return config_from_dict({"algorithm": {"name": name}, "run": {"rounds": 1},
                                     "model": {"preset": "fmnist-tiny-cfg"}})  # fmt: skip
        return config_from_dict({"algorithm": {"name": name}, "model": model})

    configs = {n: config_of(n) for n in registered()}
    algos = {n: build_algorithm(cfg) for n, cfg in configs.items()}
    assert {n for n, algo in algos.items() if not algo.supports_cuda} == set()
    assert {n: a.training_device for n, a in algos.items()} == dict.fromkeys(
        algos, resolve_device("auto")
    )
    # whatever compute.device resolves to reaches every algorithm, the hooked ones
    # (FedProx, SCAFFOLD, MOON) included; resolved once per algorithm ("meta" stands in
    # for a GPU here)
    calls: list[str] = []

    def stand_in(name: str) -> torch.device:
        calls.append(name)
        return torch.device("meta")

    monkeypatch.setattr(base, "resolve_device", stand_in)
    fresh = {n: build_algorithm(cfg) for n, cfg in configs.items()}
    assert {n: a.training_device.type for n, a in fresh.items()} == dict.fromkeys(fresh, "meta")
    assert {n: a.training_device.type for n, a in fresh.items()} == dict.fromkeys(fresh, "meta")
    assert calls == ["auto"] * len(fresh)
    # an algorithm that declares it cannot still falls back to the CPU
    cpu_only = type("CpuOnly", (type(fresh["fedavg"]),), {"supports_cuda": False})
    assert cpu_only(configs["fedavg"]).training_device == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("auto").type == "cuda"
    else:
        assert resolve_device("auto").type == "cpu"
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda")


@pytest.mark.gpu
def test_training_on_cuda_hands_back_cpu_tensors_and_tracks_the_cpu_run() -> None:
    """Batches and noise come from the same CPU generator, so the GPU run follows the CPU
    run's trajectory (up to float differences: TF32 convolutions, kernel order)."""
    from shared.config import config_from_dict
    from shared.diffusion.schedule import make_train_scheduler
    from shared.diffusion.training import train_local

    cfg = config_from_dict({"train": {"local_steps": 5, "batch_size": 8}})
    x = torch.rand(32, 1, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    sched = make_train_scheduler(cfg.diffusion)
    on_gpu, on_cpu = build_unet("fmnist-tiny", seed=0), build_unet("fmnist-tiny", seed=0)
    r_gpu = train_local(on_gpu, x, cfg.train, sched, torch.Generator().manual_seed(1),
                        device=torch.device("cuda"))  # fmt: skip
    r_cpu = train_local(on_cpu, x, cfg.train, sched, torch.Generator().manual_seed(1))
    assert all(p.device.type == "cpu" for p in on_gpu.parameters())
    assert r_gpu.mean_loss == pytest.approx(r_cpu.mean_loss, rel=0.05)
    init = build_unet("fmnist-tiny", seed=0).state_dict()
    moved = [not torch.equal(init[k], v) for k, v in on_gpu.state_dict().items()]
    assert sum(moved) > len(moved) // 2


@pytest.mark.gpu
@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_conditional_ddim_sampling_on_cuda_follows_the_cpu(
    eta: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A class-conditional model on the GPU samples from the same CPU-drawn start noise
    (and, with eta > 0, step noise) and the same labels as on the CPU, given or default;
    the images come back on the CPU, and the model stays where it is."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    cfg = DiffusionSection(eta=eta)
    on_cpu = build_unet("fmnist-tiny-cond", seed=1)
    on_gpu = build_unet("fmnist-tiny-cond", seed=1).to("cuda")

    def sample(model: torch.nn.Module, labels: torch.Tensor | None) -> torch.Tensor:
        gen = torch.Generator().manual_seed(2)
        return ddim_sample(
            model, (12, 1, 32, 32), cfg, gen, steps=3, batch_size=5, class_labels=labels
        )

    by_label = {}
    for labels in (None, torch.full((12,), 3)):
        want, got = sample(on_cpu, labels), sample(on_gpu, labels)
        assert got.device.type == "cpu" and got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-2), (got - want).abs().max()
        by_label[labels is None] = got
    assert not torch.allclose(by_label[True], by_label[False], atol=1e-2)  # labels matter
    assert {p.device.type for p in on_gpu.parameters()} == {"cuda"}


def _precision_run(
    precision: str, device: str = "cpu", *, conditional: bool = False
) -> tuple[float, set[torch.dtype], torch.nn.Module]:
    """Five local steps at ``precision``: mean loss, the dtypes ``conv_in`` put out, model."""
    from shared.config import config_from_dict
    from shared.diffusion.training import train_local

    cfg = config_from_dict({"train": {"local_steps": 5, "batch_size": 8, "precision": precision}})
    x = torch.rand(32, 1, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    model = build_unet("fmnist-tiny-cond" if conditional else "fmnist-tiny", seed=0)
    seen: set[torch.dtype] = set()
    model.conv_in.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    labels = torch.arange(32) % 10 if conditional else None
    result = train_local(model, x, cfg.train, make_train_scheduler(cfg.diffusion),
                         torch.Generator().manual_seed(1), labels=labels,
                         device=torch.device(device))  # fmt: skip
    return result.mean_loss, seen, model


@pytest.mark.parametrize("conditional", [False, True])
def test_bf16_precision_runs_the_forward_passes_in_bf16_and_keeps_fp32_weights(
    conditional: bool,
) -> None:
    """``train.precision = "bf16"``: the U-Net's activations are bf16 (autocast), the loss
    follows the fp32 run's, and the weights (what is uploaded) stay fp32 and move."""
    loss32, seen32, m32 = _precision_run("fp32", conditional=conditional)
    loss16, seen16, m16 = _precision_run("bf16", conditional=conditional)
    assert seen32 == {torch.float32} and seen16 == {torch.bfloat16}
    assert loss16 == pytest.approx(loss32, rel=0.05)
    assert {t.dtype for t in m16.state_dict().values()} == {torch.float32}
    init = build_unet("fmnist-tiny-cond" if conditional else "fmnist-tiny", seed=0)
    pairs = zip(init.parameters(), m16.parameters(), strict=True)
    moved = [not torch.equal(a, b) for a, b in pairs]
    assert sum(moved) > len(moved) // 2
    # bf16 rounding makes a different (nearby) run, not the fp32 one
    pairs = zip(m32.parameters(), m16.parameters(), strict=True)
    assert any(not torch.equal(a, b) for a, b in pairs)


def test_activation_checkpointing_makes_the_same_steps() -> None:
    """``train.activation_checkpointing``: the U-Net recomputes its blocks' activations in
    the backward pass; the five steps' loss and weights are those of the plain run (fp32 on
    the CPU: the same operations, recomputed), and the setting follows the config."""
    from shared.config import config_from_dict
    from shared.diffusion.training import train_local

    x = torch.rand(32, 1, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    runs = []
    for on in (False, True):
        cfg = config_from_dict({"train": {"local_steps": 5, "batch_size": 8,
                                          "activation_checkpointing": on}})  # fmt: skip
        model = build_unet("fmnist-tiny", seed=0)
        result = train_local(model, x, cfg.train, make_train_scheduler(cfg.diffusion),
                             torch.Generator().manual_seed(1))  # fmt: skip
        assert model.is_gradient_checkpointing == on
        runs.append((result.mean_loss, model.state_dict()))
    (loss, plain), (loss_ckpt, ckpt) = runs
    assert loss_ckpt == pytest.approx(loss, rel=1e-5)
    assert all(torch.allclose(plain[k], ckpt[k], atol=1e-6) for k in plain)


def test_micro_batches_make_the_same_steps_a_slice_at_a_time() -> None:
    """``train.micro_batch``: each step's batch of 8 goes through the U-Net as 3 + 3 + 2
    images, the gradient accumulated; the same draws (the generator ends where the plain
    run's does) and the plain run's loss and weights up to float rounding (SGD: the weights
    follow the gradients; Adam's normalized steps magnify rounding in near-zero gradients)."""
    from shared.config import config_from_dict
    from shared.diffusion.training import train_local

    x = torch.rand(32, 1, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    runs = []
    for micro in (0, 3):
        cfg = config_from_dict({"train": {"local_steps": 5, "batch_size": 8, "optimizer": "sgd",
                                          "micro_batch": micro}})  # fmt: skip
        model = build_unet("fmnist-tiny", seed=0)
        seen: list[int] = []
        model.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(args[0].shape[0]))
        g = torch.Generator().manual_seed(1)
        result = train_local(model, x, cfg.train, make_train_scheduler(cfg.diffusion), g)
        runs.append((result.mean_loss, model.state_dict(), seen, g.get_state()))
    (loss, plain, seen, state), (loss_m, micro_sd, seen_m, state_m) = runs
    assert seen == [8] * 5 and seen_m == [3, 3, 2] * 5
    assert torch.equal(state, state_m)
    assert loss_m == pytest.approx(loss, rel=1e-5)
    assert all(torch.allclose(plain[k], micro_sd[k], atol=1e-6) for k in plain)


def test_bf16_is_refused_on_a_gpu_without_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before Ampere, CUDA would emulate bf16 (slower than fp32): refused with the reason.
    (The GPU's answers are stood in for; the refusal is this module's own logic.)"""
    from shared.diffusion.training import autocast_for

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    with pytest.raises(ConfigError, match=r"Tesla V100 has no native bf16.*Ampere"):
        autocast_for("bf16", torch.device("cuda"))
    autocast_for("fp32", torch.device("cuda"))  # fp32 asks nothing of the GPU
    with pytest.raises(ConfigError, match=r"unknown train\.precision 'fp16'"):
        autocast_for("fp16", torch.device("cpu"))


@pytest.mark.gpu
def test_bf16_training_on_cuda_follows_the_fp32_run() -> None:
    """On a GPU with bf16, the forward passes run in bf16 and the loss follows fp32's."""
    loss32, _, _ = _precision_run("fp32", "cuda")
    loss16, seen16, m16 = _precision_run("bf16", "cuda")
    assert seen16 == {torch.bfloat16}
    assert loss16 == pytest.approx(loss32, rel=0.05)
    assert {(t.dtype, t.device.type) for t in m16.state_dict().values()} == {(torch.float32, "cpu")}


def test_weight_average_warms_up_and_follows_the_weights() -> None:
    """EMA with decay min(d, (1 + t) / (10 + t)) after step t, as the pretrain script and
    the paper's centralized baseline use it; the average is a separate module on the CPU."""
    from shared.diffusion.training import WeightAverage

    net = torch.nn.Linear(2, 1)
    torch.nn.init.zeros_(net.weight)
    torch.nn.init.zeros_(net.bias)
    avg = WeightAverage(net, 0.9)
    assert isinstance(avg.model, torch.nn.Linear)
    torch.nn.init.ones_(net.weight)
    avg.update(net)  # decay min(0.9, 1/10) = 0.1
    assert avg.model.weight.detach().flatten().tolist() == pytest.approx([0.9, 0.9])
    avg.update(net)  # decay 2/11
    assert float(avg.model.weight[0, 0]) == pytest.approx(0.9 + (1 - 2 / 11) * 0.1)
    for _ in range(200):  # the warm-up ends at 0.9
        avg.update(net)
    before = float(avg.model.weight[0, 0])
    torch.nn.init.constant_(net.weight, 2.0)
    avg.update(net)  # capped: decay 0.9, not (1 + t) / (10 + t) ~ 0.96
    assert float(avg.model.weight[0, 0]) == pytest.approx(before + 0.1 * (2.0 - before))
    assert avg.averaged() is avg.model and not avg.model.training
    assert not avg.model.weight.requires_grad and float(net.bias.detach()) == 0.0
    with pytest.raises(ConfigError, match="decay must be in"):
        WeightAverage(net, 1.0)


def test_train_local_can_keep_one_optimizer_and_watch_each_step() -> None:
    """A caller training in pieces (centralized training between evaluations) passes its
    optimizer, whose state carries over; ``after_step`` runs after every optimizer step."""
    from shared.config import config_from_dict
    from shared.diffusion.training import make_optimizer, train_local

    cfg = config_from_dict({"train": {"local_steps": 3, "batch_size": 4}})
    x = torch.rand(8, 1, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    model = build_unet("fmnist-tiny", seed=0)
    opt = make_optimizer(list(model.parameters()), cfg.train)
    seen: list[int] = []
    sched = make_train_scheduler(cfg.diffusion)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        train_local(model, x, cfg.train, sched, gen, optimizer=opt,
                    after_step=lambda m: seen.append(id(m)))  # fmt: skip
    assert seen == [id(model)] * 6
    first = next(iter(model.parameters()))
    assert int(opt.state[first]["step"]) == 6  # one Adam for both calls


def test_shipped_preset_table_matches_the_presets() -> None:
    """``estuary model-info`` answers from shared/assets/preset_info.json; it must be what
    the presets measure now."""
    from shared.models.info_table import compute_table, load_table

    assert load_table() == compute_table(), (
        "a preset changed: python -m shared.models.info_table writes the table again"
    )


def test_shipped_unet_specs_match_the_presets() -> None:
    """An edge and the cloud check uploads against shared/assets/unet_specs.json instead of
    building the U-Net: it must be what every U-Net preset builds now, in state-dict order."""
    from shared.models.info_table import compute_unet_specs
    from shared.models.presets import (
        ALL_PRESETS,
        construct_spec,
        kind_of,
        shipped_unet_specs,
        state_spec,
    )

    assert shipped_unet_specs() == compute_unet_specs(), (
        "a U-Net preset changed: python -m shared.models.info_table writes the specs again"
    )
    for preset in sorted(ALL_PRESETS):
        if kind_of(preset) == "unet":
            assert list(state_spec(preset).items()) == list(construct_spec(preset).items())


def test_a_role_that_moves_tensors_never_imports_diffusers() -> None:
    """The edge and the cloud import no diffusers at start, and checking a U-Net upload
    against its preset loads none either (about 165 MiB resident per role)."""
    code = (
        "import sys, edge_node.main, cloud.main\n"
        "from shared.models.plan import model_spec\n"
        "spec = model_spec('ddpm-cifar10', None)\n"
        "assert len(spec) > 100\n"
        "print('diffusers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    assert out.stdout.strip() == "False", out.stderr
