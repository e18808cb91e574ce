"""Local training with each step replayed from a CUDA graph (``train.cuda_graph``).

On a GPU, eager training of the small U-Nets federated here is bound by the host: a step of
``fmnist-tiny`` launches about 2000 kernels, and an H100 waits for Python between them (22
steps/s with two processes sharing it, 11.6 with six). A CUDA graph records the whole step
once (forward, loss, regularizer, backward, gradient hook, clipping, optimizer) and then
launches it as one unit, following PyTorch's "whole network capture" recipe:

1. the batch, its timesteps and noise are drawn on the host from the device's own seeded
   generator, in the order the eager loop draws them (so a graphed run sees the same
   numbers), staged through pinned buffers and copied into static device buffers;
2. a few warm-up steps run eagerly on a side stream (real steps: they count);
3. the step is captured once and replayed for every remaining step.

Captured once per :func:`~shared.diffusion.training.train_local` call, so tensors the hooks hold
(FedProx's anchor, SCAFFOLD's correction, FedPhD's penalty coefficients) stay fixed for a
capture's life, as a graph needs. The optimizer runs with ``capturable=True`` (its step
count on the GPU) during the call and is given back as it came. Not graphed: a custom
``loss_fn`` (MOON draws its own noise inside), fewer steps than the warm-up plus two.
``capture=False`` runs the same staged loop without a graph (every step through the eager
body): how its plumbing is tested on the CPU.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shared.diffusion.hooks import ExtraLoss, GradHook
from shared.diffusion.schedule import denoising_loss, draw_noise

if TYPE_CHECKING:
    from diffusers import DDPMScheduler

#: eager steps before the capture (PyTorch's recipe: lets lazily built state, such as the
#: optimizer's moments and cuBLAS workspaces, exist before the graph records addresses)
WARMUP_STEPS = 3
#: pinned host buffers per tensor: the host fills one while the GPU copies from the other
STAGES = 2


def batch_indices(
    n: int, batch: int, steps: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """The image indices of each of ``steps`` batches: a shuffled order, reshuffled when
    fewer than ``batch`` images are left in it (all ``n`` per batch when ``n < batch``).
    Lazy: each reshuffle draws from ``generator`` just before the batch that needs it, so
    draws a step makes after taking its indices come after the reshuffle, as in one loop."""
    order = torch.randperm(n, generator=generator)
    cursor = 0
    for _ in range(steps):
        if cursor + batch > n and cursor > 0:  # epoch boundary: reshuffle
            order, cursor = torch.randperm(n, generator=generator), 0
        yield order[cursor : cursor + batch]
        cursor += batch


class _Stager:
    """Copies host tensors into fixed device buffers through a ring of pinned buffers, so
    the copy is asynchronous and the host never overwrites one still being read."""

    def __init__(self, targets: list[torch.Tensor], pinned: bool) -> None:
        self.targets = targets
        self.pinned = pinned
        self.slot = 0
        self.rings = [
            [torch.empty_like(t, device="cpu").pin_memory() for t in targets]
            for _ in range(STAGES if pinned else 0)
        ]
        self.events = [torch.cuda.Event() for _ in range(STAGES)] if pinned else []

    def put(self, sources: list[torch.Tensor]) -> None:
        """Enqueue ``sources`` (host or device tensors) into the targets on the current
        stream; ordered after whatever that stream ran before (the previous step)."""
        if not self.pinned:
            for dst, src in zip(self.targets, sources, strict=True):
                dst.copy_(src)
            return
        k = self.slot
        # the copy out of this slot, two steps ago, is done (at once for a fresh event)
        self.events[k].synchronize()
        for dst, ring, src in zip(self.targets, self.rings[k], sources, strict=True):
            if src.device.type == "cpu":
                ring.copy_(src)
                dst.copy_(ring, non_blocking=True)
            else:
                dst.copy_(src)
        self.events[k].record()
        self.slot = (k + 1) % STAGES


def _capturable(opt: torch.optim.Optimizer, device: torch.device) -> list[object]:
    """Switch ``opt`` to ``capturable`` (Adam/AdamW: the step count moved to ``device``);
    the groups' previous flags, for :func:`_restore`."""
    before = [g.get("capturable") for g in opt.param_groups]
    if "capturable" not in opt.defaults:  # SGD: graph-safe as it is
        return before
    for group in opt.param_groups:
        group["capturable"] = True
        _move_steps(opt, group, device)
    return before


def _restore(opt: torch.optim.Optimizer, before: list[object]) -> None:
    """Undo :func:`_capturable`: a non-capturable optimizer keeps its step count on the CPU."""
    if "capturable" not in opt.defaults:
        return
    for group, flag in zip(opt.param_groups, before, strict=True):
        group["capturable"] = flag
        if not flag:
            _move_steps(opt, group, torch.device("cpu"))


def _move_steps(opt: torch.optim.Optimizer, group: dict[str, Any], device: torch.device) -> None:
    """Move the step counts of ``group``'s parameters (those that have one) to ``device``."""
    for p in group["params"]:
        step = opt.state.get(p, {}).get("step")
        if isinstance(step, torch.Tensor):
            opt.state[p]["step"] = step.to(device)


def finish_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    params: list[nn.Parameter],
    loss: torch.Tensor,
    total: torch.Tensor,
    *,
    grad_clip: float,
    extra_loss: ExtraLoss | None,
    grad_hook: GradHook | None,
    backward: bool = True,
) -> None:
    """One training step after its data loss ``loss`` (gradients cleared, or to be written by
    a graph): ``loss`` added to the running ``total`` (before any regularizer), plus
    ``extra_loss``, backward, ``grad_hook`` on the gradients, clipping, the optimizer step.
    The eager loop and the graphed body both end their steps here. With ``backward`` False
    the data loss's gradients are in place already (micro-batches): only ``extra_loss``'s
    are added."""
    total.add_(loss.detach())
    if not backward:
        if extra_loss is not None:
            extra_loss(model).backward()
    else:
        if extra_loss is not None:
            loss = loss + extra_loss(model)
        loss.backward()
    if grad_hook is not None:
        grad_hook(model)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()


class _Step:
    """One training step on static buffers: a batch of ``data`` (with ``labels``, if given),
    its noise and timesteps live at fixed addresses, filled by :meth:`stage` from the host's
    draws, and :meth:`body` runs the step on them (what a graph records). ``total`` sums the
    step losses."""

    def __init__(
        self,
        model: nn.Module,
        opt: torch.optim.Optimizer,
        params: list[nn.Parameter],
        data: torch.Tensor,
        labels: torch.Tensor | None,
        batch_size: int,
        *,
        scheduler: DDPMScheduler,
        device: torch.device,
        autocast: Callable[[], AbstractContextManager[object]],
        grad_clip: float,
        extra_loss: ExtraLoss | None = None,
        grad_hook: GradHook | None = None,
        pinned: bool,
    ) -> None:
        self.model, self.opt, self.params = model, opt, params
        self.scheduler, self.autocast, self.grad_clip = scheduler, autocast, grad_clip
        self.extra_loss, self.grad_hook = extra_loss, grad_hook
        b = min(batch_size, data.shape[0])
        self.x0 = torch.empty((b, *data.shape[1:]), dtype=data.dtype, device=device)
        self.noise = torch.empty_like(self.x0)
        self.t = torch.empty(b, dtype=torch.long, device=device)
        self.y = None if labels is None else torch.empty(b, dtype=labels.dtype, device=device)
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.stager = _Stager([self.x0, self.noise, self.t] + ([] if self.y is None else [self.y]),
                              pinned=pinned)  # fmt: skip

    def stage(
        self,
        data: torch.Tensor,
        labels: torch.Tensor | None,
        idx: torch.Tensor,
        generator: torch.Generator,
    ) -> None:
        """Draw one eager step's timesteps and noise (in its order) and enqueue its batch."""
        ts, eps = draw_noise(self.x0.shape, self.x0.dtype, self.scheduler, generator)
        self.stager.put([data[idx], eps, ts] + ([] if labels is None else [labels[idx]]))

    def body(self) -> None:
        """One step on the static buffers: no draws, no host copies."""
        with self.autocast():
            loss = denoising_loss(self.model, self.x0, self.noise, self.t, self.scheduler,
                                  class_labels=self.y)  # fmt: skip
        finish_step(self.model, self.opt, self.params, loss, self.total,
                    grad_clip=self.grad_clip, extra_loss=self.extra_loss,
                    grad_hook=self.grad_hook)  # fmt: skip

    def eager(
        self,
        data: torch.Tensor,
        labels: torch.Tensor | None,
        idx: torch.Tensor,
        generator: torch.Generator,
        after_step: Callable[[nn.Module], None] | None = None,
    ) -> None:
        """One whole step without a graph: staged, gradients cleared, run, ``after_step``."""
        self.stage(data, labels, idx, generator)
        self.opt.zero_grad(set_to_none=True)
        self.body()
        if after_step is not None:
            after_step(self.model)


#: graphs captured in this process (each a warm-up plus one recording): what a reused
#: capture saves shows here
CAPTURES = 0


def _warm_and_capture(
    step: _Step,
    data: torch.Tensor,
    labels: torch.Tensor | None,
    batches: Iterator[torch.Tensor],
    generator: torch.Generator,
    steps: int,
    device: torch.device,
    after_step: Callable[[nn.Module], None] | None = None,
) -> torch.cuda.CUDAGraph | None:
    """The first :data:`WARMUP_STEPS` of ``steps`` run eagerly on a side stream (real steps,
    from ``batches``), then the step is recorded, not run: the graph, or None when no step
    is left to replay. The optimizer must already be capturable."""
    global CAPTURES
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(min(WARMUP_STEPS, steps)):
            step.eager(data, labels, next(batches), generator, after_step)
    torch.cuda.current_stream(device).wait_stream(side)
    if steps <= WARMUP_STEPS:
        return None
    graph = torch.cuda.CUDAGraph()
    step.opt.zero_grad(set_to_none=True)  # gradients are allocated inside the graph's pool
    try:
        # thread_local: a device agent's other threads (MQTT, metrics) may run
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            step.body()  # recorded, not run
    except RuntimeError as err:
        raise RuntimeError(
            f"capturing the training step as a CUDA graph failed ({err}); set "
            "train.cuda_graph = false to train eagerly"
        ) from err
    CAPTURES += 1
    return graph


def train_graphed(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    params: list[nn.Parameter],
    data: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    batch_size: int,
    grad_clip: float,
    steps: int,
    scheduler: DDPMScheduler,
    generator: torch.Generator,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager[object]],
    extra_loss: ExtraLoss | None = None,
    grad_hook: GradHook | None = None,
    after_step: Callable[[nn.Module], None] | None = None,
    capture: bool = True,
) -> torch.Tensor:
    """``steps`` DDPM training steps of ``model`` (already on ``device``, in train mode)
    on ``data``, the same steps as :func:`~shared.diffusion.training.train_local`'s eager loop, with
    all but the first :data:`WARMUP_STEPS` replayed from one CUDA graph. ``labels`` given:
    class-conditional. ``autocast()`` makes the forward pass's autocast context (without
    its weight cache under a graph). Returns the summed DDPM loss (float64, on ``device``)."""
    step = _Step(
        model, opt, params, data, labels, batch_size, scheduler=scheduler, device=device,
        autocast=autocast, grad_clip=grad_clip, extra_loss=extra_loss, grad_hook=grad_hook,
        pinned=capture,
    )  # fmt: skip
    batches = batch_indices(data.shape[0], batch_size, steps, generator)
    if not capture:  # the staged loop on any device, every step eager
        for idx in batches:
            step.eager(data, labels, idx, generator, after_step)
        return step.total

    before = _capturable(opt, device)
    graph: torch.cuda.CUDAGraph | None = None
    try:
        graph = _warm_and_capture(step, data, labels, batches, generator, steps, device,
                                  after_step)  # fmt: skip
        if graph is not None:  # None: the warm-up steps were all of them
            for idx in batches:
                step.stage(data, labels, idx, generator)
                graph.replay()
                if after_step is not None:
                    after_step(model)
    finally:
        opt.zero_grad(set_to_none=True)  # before the graph's memory pool goes
        del graph
        _restore(opt, before)
    return step.total


class _Resident:
    """A training step kept across :func:`train_resident` calls: its own copy of the model
    and its optimizer on the GPU, the static buffers, and the graph once captured."""

    def __init__(self, key: str, step: _Step) -> None:
        self.key = key
        self.step = step
        self.graph: torch.cuda.CUDAGraph | None = None


#: the resident step of each device (``str(device)``): one each, a new key replaces it
_RESIDENT: dict[str, _Resident] = {}
_RESIDENT_LOCK = threading.Lock()


def resident_key(
    model: nn.Module, data: torch.Tensor, labels: torch.Tensor | None, batch: int,
    scheduler: DDPMScheduler, settings: str,
) -> str:  # fmt: skip
    """What a resident step must match to serve a call: the architecture (module tree,
    parameter and buffer shapes, dtypes and trainability, attention heads), the batch and
    sample shapes, labels or not, the scheduler's config and the caller's ``settings`` (the
    training section: optimizer, learning rate, clipping, precision)."""
    return json.dumps(
        [
            repr(model),
            [(n, list(p.shape), str(p.dtype), p.requires_grad)
             for n, p in model.named_parameters()],
            [(n, list(b.shape), str(b.dtype)) for n, b in model.named_buffers()],
            [getattr(m, "heads", None) for m in model.modules()],
            dict(getattr(model, "config", {})),
            min(batch, data.shape[0]), list(data.shape[1:]), str(data.dtype),
            None if labels is None else str(labels.dtype),
            dict(scheduler.config), settings,
        ],
        sort_keys=True, default=str,
    )  # fmt: skip


def train_resident(
    model: nn.Module,
    data: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    batch_size: int,
    grad_clip: float,
    steps: int,
    scheduler: DDPMScheduler,
    generator: torch.Generator,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager[object]],
    make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    settings: str,
    capture: bool = True,
) -> torch.Tensor:
    """:func:`train_graphed`'s steps for a round without local terms and with a fresh
    optimizer, from one capture reused across calls: ``model``'s weights are copied into a
    copy of it that stays on ``device`` with its own optimizer (its state zeroed, as a fresh
    one starts) and static buffers, every step is replayed (after the first call's warm-up
    and capture), and the trained weights are copied back into ``model``, which stays where
    it is. The copy is rebuilt when :func:`resident_key` changes (a pruned architecture,
    another batch or optimizer); one is kept per device. Returns the summed DDPM loss."""
    key = resident_key(model, data, labels, batch_size, scheduler, settings)
    with _RESIDENT_LOCK:
        res = _RESIDENT.get(str(device))
        if res is None or res.key != key:
            _RESIDENT.pop(str(device), None)  # its graph and memory pool go with it
            twin = copy.deepcopy(model).to(device).train()
            params = [p for p in twin.parameters() if p.requires_grad]
            opt = make_opt(params)
            if capture:
                _capturable(opt, device)
            res = _Resident(key, _Step(
                twin, opt, params, data, labels, batch_size, scheduler=scheduler,
                device=device, autocast=autocast, grad_clip=grad_clip, pinned=capture,
            ))  # fmt: skip
            _RESIDENT[str(device)] = res
        step = res.step
        with torch.no_grad():
            # in place (load_state_dict copies into the existing tensors): the addresses the
            # graph recorded stay valid
            step.model.load_state_dict(model.state_dict())
            for state in step.opt.state.values():  # a fresh optimizer's moments and count
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        value.zero_()
            step.total.zero_()
        batches = batch_indices(data.shape[0], batch_size, steps, generator)
        if capture and res.graph is None:
            res.graph = _warm_and_capture(step, data, labels, batches, generator, steps, device)
        for idx in batches:
            if res.graph is None:  # the staged loop without a graph (capture=False: the CPU's)
                step.eager(data, labels, idx, generator)
            else:
                step.stage(data, labels, idx, generator)
                res.graph.replay()
        model.load_state_dict(step.model.state_dict())
        return step.total.clone()
