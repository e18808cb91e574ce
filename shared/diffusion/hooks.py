"""The hooks an algorithm gives local training (:func:`shared.diffusion.training.train_local`):
an extra loss term, a replacement loss, a gradient hook. Types only, so the eager loop and the
CUDA-graph loop can both name them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from diffusers import DDPMScheduler

#: added to the DDPM loss (FedProx's proximal term, FedPhD's group penalty)
ExtraLoss = Callable[[nn.Module], torch.Tensor]


#: replaces the DDPM loss: (model, x0 batch, scheduler, generator) -> scalar loss
LossFn = Callable[[nn.Module, torch.Tensor, "DDPMScheduler", torch.Generator], torch.Tensor]


#: runs between ``backward`` and the optimizer step (e.g. SCAFFOLD's gradient correction)
GradHook = Callable[[nn.Module], None]
