"""One-shot generators: an image from a latent ``z`` in a single forward pass, beside the
U-Nets that denoise step by step.

:class:`ResnetG` is the generator of PRISM's main experiments (seed 002; the authors'
``ResnetG``): a transposed convolution from ``z`` (``nz`` x 1 x 1) to ``8 ngf`` x 4 x 4, three
residual up-blocks halving the width and doubling the side (4 -> 8 -> 16 -> 32), then
BN-ReLU-conv3x3-tanh to ``nc`` channels::

    z [B, nz, 1, 1] -> ConvT(nz, 8g, 4) -> Res(8g, 4g) -> Res(4g, 2g) -> Res(2g, g)
                    -> BN(g) -> ReLU -> conv3x3(g, nc) -> tanh  -> image [B, nc, 32, 32]
    Res(i, o): BN(i) ReLU Up2 conv3x3(i, o) BN(o) ReLU conv3x3(o, o)  +  conv1x1(i, o) Up2

No layer has a bias, and batch norm has no affine part (the reference keeps BN's affine
parameters frozen at 1 and 0, which is the same function). At ``ngf = 64`` and ``nc = 1`` it
has 3,543,616 weights in 11 tensors and costs 0.348 GMACs per image (the paper's Table 8:
"0.34 B").

Batch norm trains on batch statistics. Before a model is evaluated, exported or deployed its
running statistics are recomputed from latents alone (:func:`recalibrate_bn`: no data
involved), so that an eval-mode module, and the ONNX graph traced from it, maps each ``z`` to
one image whatever the batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shared import seeds

#: preset -> (nz, ngf, nc); Fashion-MNIST images are padded 28 -> 32 as for the U-Nets
ONESHOT_PRESETS: dict[str, dict[str, int]] = {
    "resnetg-fmnist-16": {"nz": 128, "ngf": 16, "nc": 1},
    "resnetg-fmnist-32": {"nz": 128, "ngf": 32, "nc": 1},
    "resnetg-fmnist-64": {"nz": 128, "ngf": 64, "nc": 1},
    "resnetg-cifar10-64": {"nz": 128, "ngf": 64, "nc": 3},
}
#: latent draws that recompute batch-norm statistics (batches x size)
RECALIBRATION = (4, 128)


class _Res(nn.Module):
    """One residual up-block (see the module docstring)."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(c_in, affine=False)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out, affine=False)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bypass = nn.Conv2d(c_in, c_out, 1, bias=False)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual branch plus the up-sampled 1x1 bypass."""
        h = self.conv1(self.up(torch.relu(self.bn1(x))))
        h = self.conv2(torch.relu(self.bn2(h)))
        return h + self.up(self.bypass(x))


class ResnetG(nn.Module):
    """PRISM's ResNet generator: ``forward(z [B, nz, 1, 1]) -> images [B, nc, 32, 32]`` in
    [-1, 1]."""

    #: what the roles key on to tell a one-shot generator from a U-Net
    kind = "oneshot"

    def __init__(self, nz: int = 128, ngf: int = 64, nc: int = 1) -> None:
        super().__init__()
        if min(nz, ngf, nc) < 1:
            raise ValueError(f"nz, ngf and nc must be >= 1, got {nz}, {ngf}, {nc}")
        self.nz, self.ngf, self.nc = nz, ngf, nc
        self.first = nn.ConvTranspose2d(nz, 8 * ngf, 4, 1, 0, bias=False)
        self.blocks = nn.Sequential(
            _Res(8 * ngf, 4 * ngf), _Res(4 * ngf, 2 * ngf), _Res(2 * ngf, ngf)
        )
        self.bn = nn.BatchNorm2d(ngf, affine=False)
        self.last = nn.Conv2d(ngf, nc, 3, padding=1, bias=False)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of an output image."""
        return (self.nc, 32, 32)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] from latents ``z`` of shape (B, nz, 1, 1) (or (B, nz))."""
        if z.ndim == 2:
            z = z[:, :, None, None]
        h = self.blocks(self.first(z))
        return torch.tanh(self.last(torch.relu(self.bn(h))))


def build_oneshot(preset: str, *, seed: int = 0) -> ResnetG:
    """A freshly initialized generator of ``preset`` (torch's default init, drawn from
    ``seed`` only; the caller's RNG is untouched)."""
    devices: list[int] = []
    with torch.random.fork_rng(devices=devices):
        torch.random.manual_seed(seed)
        return ResnetG(**ONESHOT_PRESETS[preset])


def is_oneshot(model: nn.Module) -> bool:
    """Whether ``model`` maps a latent to an image in one pass (a :class:`ResnetG`)."""
    return getattr(model, "kind", None) == "oneshot"


def latent_dim(model: nn.Module) -> int:
    """The latent size ``nz`` of a one-shot generator."""
    return int(getattr(model, "nz"))  # noqa: B009 - set by ResnetG, not declared on nn.Module


def latents(n: int, nz: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` latents N(0, I) of shape (n, nz, 1, 1), drawn on the CPU from ``generator``."""
    return torch.randn(n, nz, 1, 1, generator=generator)


@torch.no_grad()
def recalibrate_bn(
    model: nn.Module, seed: int, *, batches: tuple[int, int] = RECALIBRATION
) -> nn.Module:
    """Recompute every batch norm's running statistics as the plain average over
    ``batches`` (count, size) of latent batches drawn from ``seed`` -- no data involved --
    and leave ``model`` in eval mode. A no-op for a model without batch norm."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return model.eval()
    momenta: list[Any] = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the calibration batches
    gen = torch.Generator().manual_seed(seeds.integer("oneshot.bn", seed))
    first = next(model.parameters())
    model.train()
    count, size = batches
    try:
        for _ in range(count):
            model(latents(size, latent_dim(model), gen).to(first.device))
    finally:
        for m, momentum in zip(norms, momenta, strict=True):
            m.momentum = momentum
    return model.eval()


# -- the training objective: feature matching with moving averages ------------------------------
#: where a device keeps its objective's state between rounds (``DeviceContext.state``)
MATCH_STATE = "feature_match"
#: Adam betas of the moving averages (Santos et al. 2019, whose AMA the paper uses)
AMA_BETAS = (0.5, 0.999)
AMA_EPS = 1e-8


def _ama_step(m: torch.Tensor, target: torch.Tensor, moments: list[torch.Tensor], step: int,
              lr: float) -> None:  # fmt: skip
    """One Adam step of ``m`` on ``1/2 ||m - target||^2`` (gradient ``m - target``), in place;
    ``moments`` = [first, second] moment, also updated in place; ``step`` counts from 1."""
    b1, b2 = AMA_BETAS
    g = m - target
    moments[0].mul_(b1).add_(g, alpha=1 - b1)
    moments[1].mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (moments[1] / (1 - b2**step)).sqrt_().add_(AMA_EPS)
    m.addcdiv_(moments[0], denom, value=-lr / (1 - b1**step))


class FeatureMatch:
    """PRISM's generator loss (eq. 1) with moving-average matching (AMA, eqs. 7-8), as a
    ``loss_fn`` for :func:`~shared.diffusion.training.train_local`.

    Features are the concatenated ReLU outputs of the frozen matching network
    (:class:`~shared.models.feature_match.MatchNet`, not the FID network). The device's real
    statistics -- per-feature mean and variance over its whole local set -- are computed once
    and kept. Every call draws one batch of latents (as many as the real batch it is given:
    ``train.batch_size``), and with ``Delta`` the real minus fake statistic, moves the moving
    averages ``m`` one Adam step towards ``Delta`` (lr ``train.ama_lr``), then returns
    a loss whose gradient is that of ``m . (mu_real - mu_fake) + m_v . (var_real - var_fake)``
    -- the gradient of ``1/2 ||Delta||^2`` with ``Delta`` replaced by its running average,
    which damps the noise of one batch's statistics -- and whose value is eq. (1) on this
    batch, ``||Delta_mu||^2 + ||Delta_var||^2`` (what the run reports as its loss).
    The variance is the diagonal one, as the authors' code computes it.

    :meth:`state` is what the device keeps between rounds (the authors' code keeps the
    moving averages across rounds too); :meth:`from_state` rebuilds the objective from it.
    """

    def __init__(
        self,
        net: nn.Module,
        nz: int,
        real: tuple[torch.Tensor, torch.Tensor],
        *,
        lr: float,
        kept: dict[str, Any] | None = None,
    ) -> None:
        self.net, self.nz, self.lr = net, nz, lr
        device = next(net.parameters()).device
        self.real_mean, self.real_var = (t.to(device) for t in real)
        d = self.real_mean.shape[0]
        if kept is not None and tuple(kept["m"].shape) == (2, d):
            self.m = kept["m"].to(device).clone()
            self.moments = [t.to(device).clone() for t in kept["moments"]]
            self.step = int(kept["step"])
        else:
            self.m = torch.zeros(2, d, device=device)
            self.moments = [torch.zeros(2, d, device=device), torch.zeros(2, d, device=device)]
            self.step = 0

    @classmethod
    def for_device(
        cls, state: dict[str, Any], data: torch.Tensor, nz: int, lr: float, device: torch.device
    ) -> FeatureMatch:
        """The objective of one device: its real statistics and moving averages from
        ``state`` (a device's ``DeviceContext.state``) when they are there, else the statistics
        computed from ``data`` (and kept in ``state``)."""
        net = match_net_on(device)
        kept = state.get(MATCH_STATE)
        if not (isinstance(kept, dict) and int(kept.get("n", -1)) == data.shape[0]):
            mean, var = real_statistics(net, data)
            kept = {"n": data.shape[0], "real_mean": mean, "real_var": var}
            state[MATCH_STATE] = kept
        ama = kept.get("ama")
        return cls(net, nz, (kept["real_mean"], kept["real_var"]), lr=lr,
                   kept=ama if isinstance(ama, dict) else None)  # fmt: skip

    def state(self) -> dict[str, Any]:
        """The moving averages and their Adam moments, on the CPU."""
        return {"m": self.m.cpu(), "moments": [t.cpu() for t in self.moments], "step": self.step}

    def keep(self, state: dict[str, Any]) -> None:
        """Store :meth:`state` in a device's ``DeviceContext.state``."""
        state[MATCH_STATE]["ama"] = self.state()

    def __call__(
        self, model: nn.Module, x: torch.Tensor, _scheduler: Any, generator: torch.Generator
    ) -> torch.Tensor:
        """The loss on one batch of ``x.shape[0]`` fakes (``x``, the real batch, only sets the
        batch size and device: the real side is the kept statistics)."""
        z = latents(x.shape[0], self.nz, generator).to(x.device)
        feats = self.net.relu_features(model(z))  # type: ignore[operator]
        mean = feats.mean(0)
        var = feats.var(0, unbiased=False)
        with torch.no_grad():
            self.step += 1
            target = torch.stack([self.real_mean - mean, self.real_var - var])
            _ama_step(self.m, target, self.moments, self.step, self.lr)
            # the value reported: eq. (1) on this batch
            value = (target * target).sum()
        surrogate = (self.m[0] * (self.real_mean - mean)).sum() + (
            self.m[1] * (self.real_var - var)
        ).sum()
        # the surrogate's gradient with eq. (1)'s value
        return surrogate + (value - surrogate).detach()


@torch.no_grad()
def real_statistics(
    net: nn.Module, data: torch.Tensor, batch_size: int = 500
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature mean and (biased) variance of ``net.relu_features`` over ``data``, in
    float64 sums (one pass; on the network's device); returned float32 on the CPU."""
    n = data.shape[0]
    if n == 0:
        raise ValueError("real statistics need at least one image")
    device = next(net.parameters()).device
    sums, squares = [], []
    for batch in data.split(batch_size):
        f = net.relu_features(batch.to(device)).double()  # type: ignore[operator]
        sums.append(f.sum(0))
        squares.append((f * f).sum(0))
    total, sq = torch.stack(sums).sum(0), torch.stack(squares).sum(0)
    mean = total / n
    var = (sq / n - mean * mean).clamp_min(0)
    return mean.float().cpu(), var.float().cpu()


_NETS: dict[str, nn.Module] = {}


def match_net_on(device: torch.device) -> nn.Module:
    """The shipped matching network (sha256 checked), frozen, one copy per device and
    process (the extractor's own cached CPU instance is never moved)."""
    import copy

    from shared.models.feature_match import load_match_extractor

    key = str(device)
    if key not in _NETS:
        _NETS[key] = copy.deepcopy(load_match_extractor()).to(device).eval()
    return _NETS[key]
