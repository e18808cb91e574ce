"""MOON, model-contrastive federated learning (Li, He and Song, CVPR 2021, eqs. 1-3), for
DDPM training.

Device loss: ``L_DDPM + mu * l_con`` with (eq. 2)

    l_con = -log( exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) )

``sim`` is cosine similarity, ``mu = algorithm.mu`` (FedPhD's appendix grid:
0.01, 0.1, 1, 10), ``tau = algorithm.tau``.

Which features: the U-Net has no projection head, so ``z`` is the output of the U-Net's
bottleneck (``model.mid_block``: resnet - attention - resnet at the lowest resolution,
shape (B, C_mid, H/2^(L-1), W/2^(L-1))), global-average pooled over space to (B, C_mid).
It is captured by a forward hook during the very forward pass that computes the DDPM
loss (:func:`moon_ddpm_loss` draws t and the noise exactly as ``ddpm_loss`` does); the
frozen models see the same noisy batch and timesteps, and run only up to the mid block.

Which models: ``z_glob`` from the model received from the edge (a frozen copy, taken when
the device loads a state), ``z_prev`` from the device's own model as it uploaded it last
time (kept in ``DeviceContext.state``). A MOON "round" is one download-to-upload period,
so with ``r_e > 1`` both stay fixed over the rounds in which the device continues its own
model. Before the device's first upload there is no previous model and the contrastive
term is skipped (MOON's reference code uses the global model instead, which makes the
term the constant log 2 with zero gradient: the same training).

Both states are kept on the CPU; the frozen copies built from them for a round live on the
device that trains (``compute.device``) and are dropped when the round ends.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shared.diffusion.hooks import LossFn
from shared.diffusion.schedule import noise_batch
from shared.errors import ConfigError
from shared.methods.base import DeviceContext, LocalResult, TensorDict, model_state
from shared.methods.baselines.config import MoonConfig
from shared.methods.baselines.fedavg import FedAvg

if TYPE_CHECKING:
    from diffusers import DDPMScheduler

# DeviceContext.state keys
GLOBAL = "moon.global"  # the state received last (the positive pair's model)
PREVIOUS = "moon.prev"  # the device's model at its last upload (the negative pair's model)


class _Stop(Exception):
    """Raised by a hook to end a forward pass once the features are captured."""


def _feature_module(model: nn.Module) -> nn.Module:
    mid = getattr(model, "mid_block", None)
    if not isinstance(mid, nn.Module):
        raise ConfigError("MOON needs a U-Net with a mid_block (its features are the z of l_con)")
    return mid


@contextmanager
def capture_features(model: nn.Module, *, stop: bool = False) -> Iterator[list[torch.Tensor]]:
    """Collect ``z``: the mid block's output, averaged over space, (B, C_mid), once per
    forward pass inside the block. With ``stop`` the forward pass ends there (raising
    :class:`_Stop`, which the caller catches)."""
    captured: list[torch.Tensor] = []

    def hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
        captured.append(output.mean(dim=(2, 3)))
        if stop:
            raise _Stop

    handle = _feature_module(model).register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


@torch.no_grad()
def frozen_features(model: nn.Module, noisy: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``z`` of a frozen model for the given noisy batch and timesteps (up to the mid block)."""
    with capture_features(model, stop=True) as captured:
        try:
            model(noisy, t)
        except _Stop:
            pass
    return captured[0]


def contrastive_loss(
    z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor | None, tau: float
) -> torch.Tensor:
    """MOON's l_con (eq. 2), averaged over the batch; zero without a previous model."""
    if z_prev is None:
        return z.new_zeros(())
    pos = F.cosine_similarity(z, z_glob, dim=1) / tau
    neg = F.cosine_similarity(z, z_prev, dim=1) / tau
    logits = torch.stack([pos, neg], dim=1)
    # -log softmax(logits)[:, 0], i.e. cross-entropy with the positive pair as the class
    return F.cross_entropy(logits, torch.zeros(z.shape[0], dtype=torch.long, device=z.device))


def moon_ddpm_loss(glob: nn.Module | None, prev: nn.Module | None, mu: float, tau: float) -> LossFn:
    """The DDPM loss (same draws as ``shared.diffusion.schedule.ddpm_loss``) plus ``mu * l_con`` on
    the features of that same forward pass; just the DDPM loss without both models."""

    def loss(
        model: nn.Module, x0: torch.Tensor, scheduler: DDPMScheduler, generator: torch.Generator
    ) -> torch.Tensor:
        noisy, noise, t = noise_batch(x0, scheduler, generator)
        with capture_features(model) as captured:
            pred = model(noisy, t).sample
        total = F.mse_loss(pred, noise)
        if glob is not None and prev is not None and mu > 0:
            z_glob = frozen_features(glob, noisy, t)
            z_prev = frozen_features(prev, noisy, t)
            total = total + mu * contrastive_loss(captured[0], z_glob, z_prev, tau)
        return total

    return loss


def frozen_copy(
    model: nn.Module, state: Mapping[str, torch.Tensor], device: torch.device | None = None
) -> nn.Module:
    """A copy of ``model``'s architecture holding ``state``, in eval mode, without grads,
    on ``device`` (default: where ``model`` is)."""
    twin = copy.deepcopy(model)
    twin.load_state_dict(state)
    twin.requires_grad_(False)
    if device is not None:
        twin.to(device)
    return twin.eval()


class Moon(FedAvg):
    """FedAvg aggregation; DDPM loss plus the model-contrastive loss on devices."""

    name = "moon"
    config_class = MoonConfig
    settings: MoonConfig

    def device_load(self, ctx: DeviceContext, model: nn.Module, state: TensorDict) -> None:
        model.load_state_dict(state)
        ctx.state[GLOBAL] = model_state(model)

    def device_round(
        self, ctx: DeviceContext, model: nn.Module, round_: int, *, upload: bool
    ) -> LocalResult:
        if GLOBAL not in ctx.state:  # loaded without device_load: the model is the received one
            ctx.state[GLOBAL] = model_state(model)
        cfg = self.settings
        prev_state: TensorDict | None = ctx.state.get(PREVIOUS)
        glob = prev = None
        if prev_state is not None and cfg.mu > 0:  # else l_con is skipped: no copies
            # built once per round where training runs (the CPU states stay in ctx.state)
            device = self.training_device
            glob = frozen_copy(model, ctx.state[GLOBAL], device)
            prev = frozen_copy(model, prev_state, device)
        result = self.train(ctx, model, loss_fn=moon_ddpm_loss(glob, prev, cfg.mu, cfg.tau))
        glob = prev = None  # free the frozen copies (GPU memory) before the upload's copies
        if not upload:
            return LocalResult(None, result)
        tensors = model_state(model)
        ctx.state[PREVIOUS] = {k: v.clone() for k, v in tensors.items()}
        del ctx.state[GLOBAL]  # the next round loads a fresh one
        return LocalResult(tensors, result)
