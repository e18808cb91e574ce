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

Captured once per :func:`~shared.training.train_local` call, so tensors the hooks hold
(FedProx's anchor, SCAFFOLD's correction, FedPhD's penalty coefficients) stay fixed for a
capture's life, as a graph needs. The optimizer runs with ``capturable=True`` (its step
count on the GPU) during the call and is given back as it came. Not graphed: a custom
``loss_fn`` (MOON draws its own noise inside), fewer steps than the warm-up plus two.
``capture=False`` runs the same staged loop without a graph (every step through the eager
body): how its plumbing is tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from diffusers import DDPMScheduler
from torch import nn

from shared.diffusion import denoising_loss, draw_noise

if TYPE_CHECKING:
    from shared.training import ExtraLoss, GradHook

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
) -> None:
    """One training step after its data loss ``loss`` (gradients cleared, or to be written by
    a graph): ``loss`` added to the running ``total`` (before any regularizer), plus
    ``extra_loss``, backward, ``grad_hook`` on the gradients, clipping, the optimizer step.
    The eager loop and the graphed body both end their steps here."""
    total.add_(loss.detach())
    if extra_loss is not None:
        loss = loss + extra_loss(model)
    loss.backward()
    if grad_hook is not None:
        grad_hook(model)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()


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
    on ``data``, the same steps as :func:`~shared.training.train_local`'s eager loop, with
    all but the first :data:`WARMUP_STEPS` replayed from one CUDA graph. ``labels`` given:
    class-conditional. ``autocast()`` makes the forward pass's autocast context (without
    its weight cache under a graph). Returns the summed DDPM loss (float64, on ``device``)."""
    n = data.shape[0]
    b = min(batch_size, n)
    x0 = torch.empty((b, *data.shape[1:]), dtype=data.dtype, device=device)
    noise = torch.empty_like(x0)
    t = torch.empty(b, dtype=torch.long, device=device)
    y = None if labels is None else torch.empty(b, dtype=labels.dtype, device=device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    stager = _Stager([x0, noise, t] + ([] if y is None else [y]), pinned=capture)

    def body() -> None:  # one step on the static buffers: no draws, no host copies
        with autocast():
            loss = denoising_loss(model, x0, noise, t, scheduler, class_labels=y)
        finish_step(model, opt, params, loss, total, grad_clip=grad_clip,
                    extra_loss=extra_loss, grad_hook=grad_hook)  # fmt: skip

    def stage(idx: torch.Tensor) -> None:  # the draws of one eager step, in its order
        ts, eps = draw_noise(x0.shape, x0.dtype, scheduler, generator)
        sources = [data[idx], eps, ts] + ([] if labels is None else [labels[idx]])
        stager.put(sources)

    batches = batch_indices(n, batch_size, steps, generator)
    if not capture:  # the staged loop on any device, every step eager
        for idx in batches:
            stage(idx)
            opt.zero_grad(set_to_none=True)
            body()
            if after_step is not None:
                after_step(model)
        return total

    before = _capturable(opt, device)
    graph: torch.cuda.CUDAGraph | None = None
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(min(WARMUP_STEPS, steps)):
                stage(next(batches))
                opt.zero_grad(set_to_none=True)
                body()
                if after_step is not None:
                    after_step(model)
        torch.cuda.current_stream(device).wait_stream(side)
        if steps > WARMUP_STEPS:
            graph = torch.cuda.CUDAGraph()
            opt.zero_grad(set_to_none=True)  # gradients are allocated inside the graph's pool
            try:
                # thread_local: a device agent's other threads (MQTT, metrics) may run
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    body()  # recorded, not run
            except RuntimeError as err:
                raise RuntimeError(
                    f"capturing the training step as a CUDA graph failed ({err}); set "
                    "train.cuda_graph = false to train eagerly"
                ) from err
            for idx in batches:
                stage(idx)
                graph.replay()
                if after_step is not None:
                    after_step(model)
    finally:
        opt.zero_grad(set_to_none=True)  # before the graph's memory pool goes
        del graph
        _restore(opt, before)
    return total
