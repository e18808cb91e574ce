"""Local training replayed from a CUDA graph (``train.cuda_graph``, shared/graphed.py).

On the CPU: the staged loop the graph is captured from (static buffers, host draws, pinned
staging left out) takes the eager loop's steps bit for bit. On a GPU (``-m gpu``): the
graphed run tracks the eager run for every local term a graph captures.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shared import training
from shared.algorithms import DeviceContext, make_algorithm
from shared.algorithms import scaffold as sc
from shared.algorithms.base import model_state
from shared.algorithms.fedprox import proximal_term
from shared.config import RunConfig
from shared.diffusion import make_train_scheduler
from shared.graphed import WARMUP_STEPS, _capturable, _restore, batch_indices, train_graphed
from shared.models import build_unet
from shared.training import WeightAverage, _graphable, autocast_for, make_optimizer, train_local
from tests.conftest import tiny_config

Hooks = dict[str, Any]


def _cfg(**train: Any) -> RunConfig:
    return tiny_config(train={"batch_size": 8, "lr": 1e-3, "grad_clip": 1.0, **train})


def _data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 32, 32, generator=gen) * 2 - 1, torch.arange(n) % 10


def _hooks(kind: str, model: nn.Module, device: str = "cpu") -> Hooks:
    """The local terms a graph captures: FedProx's proximal term (extra_loss), SCAFFOLD's
    correction (grad_hook), a weight average after each step (after_step)."""
    if kind == "prox":
        anchor = {k: (v.detach() + 0.01).to(device) for k, v in model.named_parameters()}
        return {"extra_loss": lambda m: proximal_term(m, anchor, 0.5)}
    if kind == "scaffold":
        gen = torch.Generator().manual_seed(5)
        corr = {k: 1e-3 * torch.randn(v.shape, generator=gen).to(device)
                for k, v in model.named_parameters()}  # fmt: skip
        return {"grad_hook": sc.correction_hook(corr)}
    if kind == "average":
        return {"after_step": WeightAverage(model, 0.99).update}
    return {}


def _staged(
    model: nn.Module, data: torch.Tensor, labels: torch.Tensor | None, cfg: RunConfig,
    steps: int, seed: int, hooks: Hooks,
) -> float:  # fmt: skip
    """train_graphed's loop without the capture, on the CPU: the mean loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, cfg.train)
    model.train()
    total = train_graphed(
        model, opt, params, data, labels, batch_size=cfg.train.batch_size,
        grad_clip=cfg.train.grad_clip, steps=steps, scheduler=make_train_scheduler(cfg.diffusion),
        generator=torch.Generator().manual_seed(seed), device=torch.device("cpu"),
        autocast=lambda: autocast_for(cfg.train.precision, torch.device("cpu"), cache=False),
        capture=False, **hooks,
    )  # fmt: skip
    return float(total) / steps


@pytest.mark.parametrize(
    ("kind", "n", "conditional", "optimizer"),
    [
        ("plain", 20, False, "adam"),  # 2 batches per shuffle: reshuffles at steps 2, 4, 6
        ("prox", 20, False, "adam"),
        ("scaffold", 20, False, "sgd"),
        ("average", 20, False, "adamw"),
        ("plain", 20, True, "adam"),  # class-conditional: labels staged with the images
        ("plain", 5, False, "adam"),  # fewer images than a batch: all of them every step
    ],
)
def test_the_staged_loop_takes_the_eager_loops_steps_bit_for_bit(
    kind: str, n: int, conditional: bool, optimizer: str
) -> None:
    """The loop a graph is captured from draws the same shuffles, timesteps and noise from
    the device's generator in the same order as train_local's eager loop and applies the
    same local terms, so on the CPU both end on the same weights and loss, bit for bit."""
    cfg = _cfg(optimizer=optimizer)
    data, labels = _data(n)
    preset = "fmnist-tiny-cond" if conditional else "fmnist-tiny"
    eager, staged = build_unet(preset, seed=0), build_unet(preset, seed=0)
    steps = 7
    got = train_local(
        eager, data, cfg.train, make_train_scheduler(cfg.diffusion),
        torch.Generator().manual_seed(3), steps=steps, labels=labels, **_hooks(kind, eager),
    )  # fmt: skip
    loss = _staged(staged, data, labels if conditional else None, cfg, steps, 3,
                   _hooks(kind, staged))  # fmt: skip
    assert loss == got.mean_loss
    for (name, p), q in zip(eager.named_parameters(), staged.parameters(), strict=True):
        assert torch.equal(p, q), name
    start = build_unet(preset, seed=0)
    assert not torch.equal(next(start.parameters()), next(eager.parameters()))  # it trained


def test_batch_indices_shuffle_per_pass_and_keep_full_batches() -> None:
    """Full batches from one shuffled order, reshuffled when fewer than a batch is left (the
    remainder is skipped for this pass); all images per step when there are fewer."""
    got = list(batch_indices(10, 4, 5, torch.Generator().manual_seed(0)))
    assert [len(b) for b in got] == [4] * 5
    for first, second in ((0, 1), (2, 3)):  # each pass: 8 distinct of the 10
        assert len(set(got[first].tolist()) | set(got[second].tolist())) == 8
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(10, generator=gen)
    assert torch.equal(got[0], order[:4]) and torch.equal(got[1], order[4:8])
    assert torch.equal(got[2], torch.randperm(10, generator=gen)[:4])
    small = list(batch_indices(3, 8, 2, torch.Generator().manual_seed(1)))
    assert [sorted(b.tolist()) for b in small] == [[0, 1, 2], [0, 1, 2]]


def test_graphs_are_used_only_where_configured_and_worth_it(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.cuda_graph on a CUDA device with the DDPM loss and enough steps; otherwise the
    eager loop, and a configured graph that is not used is said once per reason."""
    on, off = _cfg(cuda_graph=True).train, _cfg().train
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    enough = WARMUP_STEPS + 2

    monkeypatch.setattr(training, "_SAID", set())

    def moon(*_: Any) -> torch.Tensor:
        return torch.zeros(())

    assert _graphable(on, cuda, None, enough)
    assert not _graphable(off, cuda, None, enough)
    assert not _graphable(on, None, None, enough) and not _graphable(on, cpu, None, enough)
    with caplog.at_level("INFO", logger="shared.training"):
        assert not _graphable(on, cuda, moon, enough)
        assert not _graphable(on, cuda, moon, enough)
        assert not _graphable(on, cuda, None, enough - 1)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2  # once per reason
    assert "custom loss (MOON)" in said[0] and "4 steps do not pay for the capture" in said[1]


def test_the_optimizer_is_switched_to_capturable_and_back() -> None:
    """Adam runs capturable during a graphed call (its step count where the weights are)
    and is handed back as it came: not capturable, step counts on the CPU; SGD has no such
    switch and is left alone."""
    model = build_unet("fmnist-tiny", seed=0)
    params = list(model.parameters())
    adam = make_optimizer(params, _cfg(optimizer="adam").train)
    model(torch.zeros(1, 1, 32, 32), torch.zeros(1, dtype=torch.long)).sample.sum().backward()
    adam.step()
    before = _capturable(adam, torch.device("cpu"))
    assert before == [False] and all(g["capturable"] for g in adam.param_groups)
    _restore(adam, before)
    assert not adam.param_groups[0]["capturable"]
    assert {adam.state[p]["step"].device.type for p in params} == {"cpu"}
    sgd = make_optimizer(params, _cfg(optimizer="sgd").train)
    assert _capturable(sgd, torch.device("cpu")) == [None]
    assert "capturable" not in sgd.param_groups[0]


# -- on a GPU -------------------------------------------------------------------------------
def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().cpu() for p in model.parameters()])


def _exact_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """TF32 off and cuDNN's deterministic kernels: on an H200 two eager runs of the FedProx
    rounds below differ by 2.4e-3 of the distance trained with cuDNN's default
    (nondeterministic) backward kernels, more than the bound; with these, by nothing."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)


def _cuda_local(
    kind: str, conditional: bool, optimizer: str, precision: str, graph: bool,
    nudge: float = 0.0,
) -> tuple[torch.Tensor, float]:  # fmt: skip
    """12 local steps on the GPU from the seed-0 U-Net (its weights scaled by 1 + nudge * N(0,
    1) where ``nudge`` is set); the final weights and the mean loss. Checks what the call
    hands back: the model on the CPU without gradients, the optimizer not capturable."""
    data, labels = _data(40)
    preset = "fmnist-tiny-cond" if conditional else "fmnist-tiny"
    cfg = _cfg(optimizer=optimizer, precision=precision, cuda_graph=graph)
    model = build_unet(preset, seed=0)
    if nudge:
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + nudge * torch.randn(p.shape, generator=gen))
    hooks = _hooks(kind, model, "cuda")
    opt = make_optimizer([p for p in model.parameters()], cfg.train)
    got = train_local(
        model, data, cfg.train, make_train_scheduler(cfg.diffusion),
        torch.Generator().manual_seed(3), steps=12, labels=labels, device=torch.device("cuda"),
        optimizer=opt, **hooks,
    )  # fmt: skip
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert all(p.grad is None for p in model.parameters())
    assert all(not g.get("capturable", False) for g in opt.param_groups)
    return _flat(model), got.mean_loss


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("kind", "conditional", "optimizer"),
    [
        ("plain", False, "adam"),
        ("prox", False, "adam"),
        ("scaffold", False, "sgd"),
        ("average", False, "adamw"),
        ("plain", True, "adam"),
    ],
)
def test_graphed_training_on_cuda_tracks_the_eager_run(
    kind: str, conditional: bool, optimizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 steps replayed from a graph (after 3 eager ones) end where 12 eager steps on the
    same GPU do, to float noise (TF32 off) far below the distance trained; the model, its
    gradients and the optimizer are handed back as the eager path leaves them."""
    _exact_cuda(monkeypatch)
    eager, eager_loss = _cuda_local(kind, conditional, optimizer, "fp32", graph=False)
    graph, graph_loss = _cuda_local(kind, conditional, optimizer, "fp32", graph=True)
    preset = "fmnist-tiny-cond" if conditional else "fmnist-tiny"
    moved = (eager - _flat(build_unet(preset, seed=0))).norm()
    assert (graph - eager).norm() <= 1e-3 * moved
    assert graph_loss == pytest.approx(eager_loss, rel=1e-3)


@pytest.mark.gpu
def test_graphed_bf16_training_departs_from_eager_less_than_a_1e_7_nudge_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bf16 training amplifies rounding: on an H200, scaling the starting weights by
    1 + 1e-7 * N(0, 1) moves the end of 12 eager Adam steps by 7 % of the distance trained,
    while the graphed run ends 2 % away from eager (deterministically: eager against eager
    and graph against graph differ by nothing), so a fixed 1e-3 bound measures rounding
    (kernels picked under capture, or capturable Adam's float32 bias corrections), not the
    graph. The graph must stay closer to eager than that nudge does; a
    stale weight, a lost term or a skipped step lands far outside it."""
    _exact_cuda(monkeypatch)
    eager, eager_loss = _cuda_local("plain", False, "adam", "bf16", graph=False)
    graph, graph_loss = _cuda_local("plain", False, "adam", "bf16", graph=True)
    nudged, _ = _cuda_local("plain", False, "adam", "bf16", graph=False, nudge=1e-7)
    assert (graph - eager).norm() < (nudged - eager).norm()
    assert graph_loss == pytest.approx(eager_loss, rel=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fedphd", "scaffold", "fedprox"])
def test_graphed_device_rounds_on_cuda_track_the_eager_rounds(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two device rounds per algorithm (a fresh capture each, FedPhD's group penalty in
    sparse training, SCAFFOLD's control variates, FedProx's anchor) with graphs follow the
    same rounds without, and Adam's kept state (train.optimizer_state = "keep") travels
    between graphed rounds on the CPU."""
    _exact_cuda(monkeypatch)
    data, labels = _data(48)
    ends = {}
    for graph in (False, True):
        cfg = tiny_config(
            train={"local_steps": 8, "batch_size": 8, "lr": 1e-3, "optimizer_state": "keep",
                   "cuda_graph": graph},
            algorithm={"name": name, "sparse_rounds": 2, "lambda0": 1e-2},
            compute={"device": "cuda"},
        )  # fmt: skip
        algo = make_algorithm(cfg)
        model = build_unet("fmnist-tiny", seed=0)
        ctx = DeviceContext("dev000", data, labels, torch.Generator().manual_seed(7))
        state = algo.init_global(model_state(model))
        if name == "scaffold":  # c and c_i away from zero, so the correction acts
            gen = torch.Generator().manual_seed(1)
            weights, c = sc.split_state(state)
            c = {k: 1e-3 * torch.randn(v.shape, generator=gen) for k, v in c.items()}
            state = {**weights, **{sc.C_PREFIX + k: v for k, v in c.items()}}
            ctx.state[sc.C_LOCAL] = {k: -v for k, v in c.items()}
        for r in range(2):
            algo.device_load(ctx, model, state)
            out = algo.device_round(ctx, model, r, upload=True)
            assert out.tensors is not None
            assert {t.device.type for t in out.tensors.values()} == {"cpu"}
        ends[graph] = _flat(model)
    moved = (ends[False] - _flat(build_unet("fmnist-tiny", seed=0))).norm()
    assert (ends[True] - ends[False]).norm() <= 1e-3 * moved


@pytest.mark.gpu
def test_a_graphed_fedphd_federation_prunes_and_trains_on_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path a graphed comparison takes, end to end in one process on the GPU: four devices
    choosing edges train FedPhD's sparse round from graphs, the cloud prunes, and the pruned
    U-Net (a new architecture: a new capture) trains from graphs in every later round, with
    finite losses and nothing rejected."""
    from estuary.simulate import simulate

    calls: list[int] = []  # parameter count of each graphed round's model

    def spy(model: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(sum(p.numel() for p in model.parameters()))
        return train_graphed(model, *args, **kwargs)

    monkeypatch.setattr(training, "train_graphed", spy)
    cfg = tiny_config(
        run={"name": "phd-graph", "rounds": 3},
        federation={"num_devices": 4, "num_edges": 2, "assignment": "select"},
        train={"local_steps": 8, "batch_size": 8, "cuda_graph": True},
        algorithm={"name": "fedphd", "a": 200.0, "sparse_rounds": 1, "lambda0": 1e-3,
                   "prune_ratio": 0.44},
        compute={"device": "cuda"},
    )  # fmt: skip
    res = simulate(cfg, tmp_path / "run", progress=False, evaluate=False)
    rows = res.rows
    assert [r["updates"] for r in rows] == [4, 4, 4]
    assert sum(r["rejected"] for r in rows) == 0
    assert all(math.isfinite(r["train_loss"]) for r in rows)
    assert res.plan is not None and rows[0]["arch"] != "dense"
    dense = 686_769  # fmnist-tiny
    assert calls[:4] == [dense] * 4  # round 0: the sparse (dense-shaped) round, graphed
    assert len(calls) == 12 and set(calls[4:]) == {rows[2]["model_params"]} != {dense}
