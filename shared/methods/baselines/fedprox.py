"""FedProx (Li et al., MLSys 2020, eq. 2) for DDPM training.

A device minimizes ``h(w) = L_DDPM(w) + mu/2 ||w - w_g||^2``, where ``w_g`` is the model it
received from its edge (the anchor of the proximal term) and ``mu = algorithm.mu``
(FedPhD's appendix: mu = 1, the FedProx paper's recommendation). Aggregation at edge and
cloud is FedAvg. The anchor is taken when the device loads a received state
(:meth:`FedProx.device_load`) and kept in ``DeviceContext.state``, so between edge
aggregations (``r_e > 1``, the device continues its own model without a new download) the
term still pulls towards the last model received, not towards the device's own previous
round. Only trainable parameters are anchored (buffers are not optimized).

The anchor is kept on the CPU; each device round copies it once to the training device
(``compute.device``), so the term is computed where the parameters are.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from shared.methods.base import DeviceContext, LocalResult, TensorDict, model_state
from shared.methods.baselines.config import FedProxConfig
from shared.methods.baselines.fedavg import FedAvg
from shared.models.presets import module_device

#: ``DeviceContext.state`` key of the received parameters (the proximal anchor)
ANCHOR = "fedprox.anchor"


def trainable_snapshot(model: nn.Module) -> TensorDict:
    """Detached copies of the module's trainable parameters."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def proximal_term(model: nn.Module, anchor: Mapping[str, torch.Tensor], mu: float) -> torch.Tensor:
    """``mu/2 * sum_p ||p - anchor[p]||^2`` over the anchored parameters; its gradient with
    respect to each parameter is ``mu * (p - anchor[p])``. The sum lives on the parameters'
    device (each ``anchor[p]`` must be on its parameter's)."""
    total: torch.Tensor | None = None
    for name, p in model.named_parameters():
        ref = anchor.get(name)
        if ref is not None:
            term = (p - ref).pow(2).sum()
            total = term if total is None else total + term
    if total is None:  # nothing anchored: a zero on the parameters' device
        total = torch.zeros((), device=module_device(model))
    return 0.5 * mu * total


class FedProx(FedAvg):
    """FedAvg aggregation; DDPM loss plus the proximal term on devices."""

    name = "fedprox"
    config_class = FedProxConfig
    settings: FedProxConfig

    def device_load(self, ctx: DeviceContext, model: nn.Module, state: TensorDict) -> None:
        model.load_state_dict(state)
        ctx.state[ANCHOR] = trainable_snapshot(model)

    def device_round(
        self, ctx: DeviceContext, model: nn.Module, round_: int, *, upload: bool
    ) -> LocalResult:
        # a caller that put the edge model into ``model`` without device_load: anchor on it
        if ANCHOR not in ctx.state:
            ctx.state[ANCHOR] = trainable_snapshot(model)
        mu = self.settings.mu
        # the anchor where training runs: copied once per round (``to`` copies nothing on
        # the CPU); the one in ``ctx.state`` stays on the CPU
        device = self.training_device
        anchor = {k: v.to(device) for k, v in ctx.state[ANCHOR].items()} if mu > 0 else {}
        result = self.train(
            ctx, model, extra_loss=(lambda m: proximal_term(m, anchor, mu)) if mu > 0 else None
        )
        if not upload:
            return LocalResult(None, result)
        del ctx.state[ANCHOR]  # the next round loads a fresh state
        return LocalResult(model_state(model), result)
