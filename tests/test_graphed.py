"""Local training replayed from a CUDA graph (``train.cuda_graph``, shared/diffusion/cuda_graph.py).

On the CPU: the staged loop the graph is captured from (static buffers, host draws, pinned
staging left out) takes the eager loop's steps bit for bit. On a GPU (``-m gpu``): the
graphed run tracks the eager run for every local term a graph captures.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shared.config import RunConfig
from shared.diffusion import cuda_graph as graphed
from shared.diffusion import training
from shared.diffusion.cuda_graph import (
    WARMUP_STEPS,
    _capturable,
    _restore,
    batch_indices,
    train_graphed,
)
from shared.diffusion.schedule import make_train_scheduler
from shared.diffusion.training import (
    WeightAverage,
    _graphable,
    autocast_for,
    make_optimizer,
    resident_settings,
    train_local,
)
from shared.methods.base import DeviceContext, build_algorithm, model_state
from shared.methods.baselines import scaffold as sc
from shared.methods.baselines.fedprox import proximal_term
from shared.models.presets import build_unet
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


def _resident(
    model: nn.Module, data: torch.Tensor, labels: torch.Tensor | None, cfg: RunConfig,
    steps: int, generator: torch.Generator, device: str = "cpu",
) -> float:  # fmt: skip
    """train_resident on ``device`` (without a capture on the CPU): the mean loss."""
    on = torch.device(device)
    total = graphed.train_resident(
        model, data, labels, batch_size=cfg.train.batch_size, grad_clip=cfg.train.grad_clip,
        steps=steps, scheduler=make_train_scheduler(cfg.diffusion), generator=generator,
        device=on, autocast=lambda: autocast_for(cfg.train.precision, on, cache=False),
        make_opt=lambda ps: make_optimizer(ps, cfg.train), settings=resident_settings(cfg.train),
        capture=on.type == "cuda",
    )  # fmt: skip
    return float(total) / steps


def _mean_into(models: list[nn.Module]) -> None:
    """An aggregation between rounds: every model set to the models' mean."""
    with torch.no_grad():
        for ps in zip(*(m.parameters() for m in models), strict=True):
            mean = torch.stack([p.detach() for p in ps]).mean(0)
            for p in ps:
                p.copy_(mean)


@pytest.fixture
def no_resident(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """An empty table of resident steps for the test (restored after it)."""
    table: dict[str, Any] = {}
    monkeypatch.setattr(graphed, "_RESIDENT", table)
    return table


@pytest.mark.parametrize(
    ("conditional", "optimizer", "momentum"),
    [(False, "adam", 0.0), (True, "adamw", 0.0), (False, "sgd", 0.9)],
)
def test_a_resident_step_takes_the_eager_rounds_bit_for_bit(
    conditional: bool, optimizer: str, momentum: float, no_resident: dict[str, Any]
) -> None:
    """Three rounds of two devices (their own data, generators and starting weights, averaged
    between rounds) through one resident copy of the model give the eager rounds' weights
    and losses bit for bit: the weights copied in and out, the optimizer's moments and step
    count zeroed to a fresh optimizer's, the loss sum reset per call."""
    cfg = _cfg(optimizer=optimizer, momentum=momentum)
    preset = "fmnist-tiny-cond" if conditional else "fmnist-tiny"
    sched = make_train_scheduler(cfg.diffusion)
    sets = [_data(20, seed=0), _data(12, seed=1)]
    runs = {mode: [build_unet(preset, seed=s) for s in (0, 1)] for mode in ("eager", "resident")}
    gens = {mode: [torch.Generator().manual_seed(s) for s in (3, 4)] for mode in runs}
    captures = graphed.CAPTURES
    for _ in range(3):
        for i, (data, labels) in enumerate(sets):
            got = train_local(runs["eager"][i], data, cfg.train, sched, gens["eager"][i],
                              steps=5, labels=labels)  # fmt: skip
            loss = _resident(runs["resident"][i], data, labels if conditional else None, cfg,
                             5, gens["resident"][i])  # fmt: skip
            assert loss == got.mean_loss
        for models in runs.values():
            _mean_into(models)
    for model in runs["resident"]:
        assert model.training and all(p.grad is None for p in model.parameters())
    for e, r in zip(runs["eager"][0].parameters(), runs["resident"][0].parameters(), strict=True):
        assert torch.equal(e, r)
    assert list(no_resident) == ["cpu"] and graphed.CAPTURES == captures  # one copy, no graph
    assert not torch.equal(
        next(runs["eager"][0].parameters()), next(build_unet(preset, seed=0).parameters())
    )  # it trained


def test_a_resident_step_is_kept_per_device_and_rebuilt_when_its_key_changes(
    no_resident: dict[str, Any],
) -> None:
    """Same architecture and settings: the same resident copy serves another model. Another
    architecture (a pruned or conditional U-Net), batch size or learning rate: a new copy
    replaces it, so one is held per device whatever the run trains."""
    cfg = _cfg()
    data, labels = _data(16)
    gen = torch.Generator().manual_seed(0)
    _resident(build_unet("fmnist-tiny", seed=0), data, None, cfg, 1, gen)
    first = no_resident["cpu"]
    _resident(build_unet("fmnist-tiny", seed=1), data, None, cfg, 1, gen)
    assert no_resident["cpu"] is first
    _resident(build_unet("fmnist-tiny-cond", seed=0), data, labels, cfg, 1, gen)
    assert no_resident["cpu"] is not first and len(no_resident) == 1
    for other in (_cfg(batch_size=4), _cfg(lr=2e-3)):
        before = no_resident["cpu"]
        _resident(build_unet("fmnist-tiny", seed=0), data, None, other, 1, gen)
        assert no_resident["cpu"] is not before
    # the round's length is not part of the key
    key = no_resident["cpu"].key
    longer = _cfg(lr=2e-3, local_steps=9)
    assert graphed.resident_key(build_unet("fmnist-tiny", seed=0), data, None, 8,
                                make_train_scheduler(cfg.diffusion),
                                resident_settings(longer.train)) == key  # fmt: skip


def test_train_local_uses_the_resident_step_only_for_a_fresh_optimizer_without_terms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With train.cuda_graph_reuse a round goes to train_resident unless it has a kept
    optimizer or a local term (those capture per call, as without reuse)."""
    calls: list[str] = []

    def record(kind: str) -> Any:
        def called(*_: Any, **__: Any) -> torch.Tensor:
            calls.append(kind)
            return torch.zeros((), dtype=torch.float64)

        return called

    monkeypatch.setattr(training, "_graphable", lambda *a: True)
    monkeypatch.setattr(training, "train_resident", record("resident"))
    monkeypatch.setattr(training, "train_graphed", record("graphed"))
    monkeypatch.setattr(training, "placed", lambda m, d: contextlib.nullcontext(m))
    data, _ = _data(16)
    cuda = torch.device("cuda")
    sched = make_train_scheduler(_cfg().diffusion)
    for reuse in (False, True):
        cfg = _cfg(cuda_graph=True, cuda_graph_reuse=reuse)
        model = build_unet("fmnist-tiny", seed=0)
        train_local(model, data, cfg.train, sched, torch.Generator(), steps=6, device=cuda)
        opt = make_optimizer(list(model.parameters()), cfg.train)
        train_local(model, data, cfg.train, sched, torch.Generator(), steps=6, device=cuda,
                    optimizer=opt)  # fmt: skip
        for kind in ("prox", "scaffold", "average"):
            train_local(model, data, cfg.train, sched, torch.Generator(), steps=6, device=cuda,
                        **_hooks(kind, model))  # fmt: skip
    assert calls == ["graphed"] * 5 + ["resident"] + ["graphed"] * 4


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
    with caplog.at_level("INFO", logger="shared.diffusion.training"):
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
        algo = build_algorithm(cfg)
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
@pytest.mark.parametrize("conditional", [False, True])
def test_a_resident_graph_on_cuda_tracks_the_eager_rounds(
    conditional: bool, no_resident: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three rounds of two devices (weights averaged between rounds) from one resident
    capture end where the same rounds trained eagerly on the GPU do, to float noise far
    below the distance trained; one capture serves all six rounds, and the models stay on
    the CPU without gradients."""
    _exact_cuda(monkeypatch)
    cfg = _cfg()
    preset = "fmnist-tiny-cond" if conditional else "fmnist-tiny"
    sched = make_train_scheduler(cfg.diffusion)
    sets = [_data(40, seed=0), _data(24, seed=1)]
    runs = {mode: [build_unet(preset, seed=s) for s in (0, 1)] for mode in ("eager", "resident")}
    gens = {mode: [torch.Generator().manual_seed(s) for s in (3, 4)] for mode in runs}
    cuda = torch.device("cuda")
    captures = graphed.CAPTURES
    for _ in range(3):
        for i, (data, labels) in enumerate(sets):
            got = train_local(runs["eager"][i], data, cfg.train, sched, gens["eager"][i],
                              steps=10, labels=labels, device=cuda)  # fmt: skip
            loss = _resident(runs["resident"][i], data, labels if conditional else None, cfg,
                             10, gens["resident"][i], device="cuda")  # fmt: skip
            assert loss == pytest.approx(got.mean_loss, rel=1e-3)
        for models in runs.values():
            _mean_into(models)
    assert graphed.CAPTURES - captures == 1
    for model in runs["resident"]:
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        assert all(p.grad is None for p in model.parameters())
    eager, resident = _flat(runs["eager"][0]), _flat(runs["resident"][0])
    moved = (eager - _flat(build_unet(preset, seed=0))).norm()
    assert (resident - eager).norm() <= 1e-3 * moved


@pytest.mark.gpu
@pytest.mark.parametrize("reuse", [False, True], ids=["per-call", "resident"])
def test_a_graphed_fedphd_federation_prunes_and_trains_on_after_it(
    reuse: bool, no_resident: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path a graphed comparison takes, end to end in one process on the GPU: four devices
    choosing edges train FedPhD's sparse round from graphs (its penalty: a capture per call),
    the cloud prunes, and the pruned U-Net trains from graphs in every later round (a new
    capture per call, or with train.cuda_graph_reuse one resident capture for all eight
    rounds of the four devices), with finite losses and nothing rejected."""
    from estuary.simulate import simulate

    calls: list[tuple[str, int]] = []  # the path and parameter count of each graphed round

    def spy(path: str, real: Any) -> Any:
        def called(model: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
            calls.append((path, sum(p.numel() for p in model.parameters())))
            return real(model, *args, **kwargs)  # type: ignore[no-any-return]

        return called

    monkeypatch.setattr(training, "train_graphed", spy("graphed", graphed.train_graphed))
    monkeypatch.setattr(training, "train_resident", spy("resident", graphed.train_resident))
    captures = graphed.CAPTURES
    cfg = tiny_config(
        run={"name": "phd-graph", "rounds": 3},
        federation={"num_devices": 4, "num_edges": 2, "assignment": "select"},
        train={"local_steps": 8, "batch_size": 8, "cuda_graph": True, "cuda_graph_reuse": reuse},
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
    dense, pruned = 686_769, rows[2]["model_params"]  # fmnist-tiny, and after pruning
    later = "resident" if reuse else "graphed"
    assert calls == [("graphed", dense)] * 4 + [(later, pruned)] * 8
    assert graphed.CAPTURES - captures == (5 if reuse else 12)
