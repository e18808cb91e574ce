"""The networks of pFedGPA's parameter diffusion model (:mod:`.param_diffusion`): p-diff's
1-D conv autoencoder over a flattened parameter vector and a linear one, and the two
denoisers of its latent (p-diff's 1-D conv DDPM and a residual MLP)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F

#: p-diff sizes: (fold rate f = kernel k, encoder channels, decoder channels)
AE_SIZES: dict[str, tuple[int, tuple[int, ...], tuple[int, ...]]] = {
    "tiny": (3, (2, 2, 2, 2), (2, 32, 32, 8)),  # small with its decoder halved (a CPU size)
    "small": (3, (2, 2, 2, 2), (2, 64, 64, 8)),
    "medium": (5, (4, 4, 4, 4), (4, 256, 256, 8)),
}


class ParamAutoencoder(nn.Module):
    """p-diff's ``ODEncoder2Decoder``: a 1-D conv AE from [N, D] to a tanh latent [N, C, L]."""

    def __init__(self, in_dim: int, size: Literal["tiny", "small", "medium"] = "small") -> None:
        super().__init__()
        if in_dim < 1:
            raise ValueError(f"in_dim must be positive, got {in_dim}")
        f, enc, dec = AE_SIZES[size]
        self.in_dim = in_dim
        self.real_dim = max(in_dim // f**4 + 1, 2) * f**4
        self.latent_shape = (enc[-1], self.real_dim // f**4)
        ch = [1, *enc]
        self.encoder = nn.Sequential(
            *(self._enc_block(ch[i], ch[i + 1], f, last=i == len(enc) - 1) for i in range(len(enc)))
        )
        ch = [*dec, 1]
        self.decoder = nn.Sequential(
            *(self._dec_block(ch[i], ch[i + 1], f) for i in range(len(dec)))
        )

    @staticmethod
    def _enc_block(c_in: int, c_out: int, f: int, last: bool) -> nn.Sequential:
        mid = c_out if c_in == 1 else c_in  # p-diff: block 1 lifts 1 -> c_out before folding
        return nn.Sequential(
            nn.InstanceNorm1d(c_in),
            nn.Conv1d(c_in, mid, f, padding=f // 2),
            nn.LeakyReLU(),
            nn.InstanceNorm1d(mid),
            nn.Conv1d(mid, c_out, f, stride=f),
            nn.Tanh() if last else nn.LeakyReLU(),
        )

    @staticmethod
    def _dec_block(c_in: int, c_out: int, f: int) -> nn.Sequential:
        return nn.Sequential(
            nn.LeakyReLU(),
            nn.InstanceNorm1d(c_in),
            nn.ConvTranspose1d(c_in, c_in, f, stride=f),
            nn.LeakyReLU(),
            nn.InstanceNorm1d(c_in),
            nn.Conv1d(c_in, c_out, f, padding=f // 2),
        )

    def encode(self, x: Tensor) -> Tensor:
        """[N, D] -> [N, C, L] in [-1, 1] (zero-padded to ``real_dim`` first)."""
        if x.ndim != 2 or x.shape[1] != self.in_dim:
            raise ValueError(f"expected [N, {self.in_dim}], got {tuple(x.shape)}")
        return self.encoder(F.pad(x, (0, self.real_dim - self.in_dim)).unsqueeze(1))

    def decode(self, z: Tensor) -> Tensor:
        """[N, C, L] -> [N, D] (the padding is cropped off)."""
        return self.decoder(z)[:, 0, : self.in_dim]

    def forward(self, x: Tensor) -> Tensor:
        """Clean reconstruction decode(encode(x))."""
        return self.decode(self.encode(x))


def conv_latent_shape(
    in_dim: int, size: Literal["tiny", "small", "medium"] = "small"
) -> tuple[int, int]:
    """The latent shape [C, L] of p-diff's autoencoder of ``size`` over ``in_dim`` values."""
    f, enc, _ = AE_SIZES[size]
    return enc[-1], max(in_dim // f**4 + 1, 2)


class LinearParamAutoencoder(nn.Module):
    """One linear map from the standardized vector to a tanh latent [N, C, L] and one back,
    the latent as large as p-diff's ``small`` one (:func:`conv_latent_shape`).

    p-diff's 1-D convolutions apply the same filters at every position of the flattened
    vector, so they can only reproduce patterns that repeat along it; what tells devices apart
    is a direction over all the parameters (on Fashion-MNIST's dominant groups, 20 principal
    components of 400 stored uploads hold 94 % of their standardized variance). A linear map
    learns those directions, at a seventh of the small convolutional autoencoder's cost.
    """

    def __init__(self, in_dim: int) -> None:
        super().__init__()
        if in_dim < 1:
            raise ValueError(f"in_dim must be positive, got {in_dim}")
        self.in_dim = in_dim
        self.latent_shape = conv_latent_shape(in_dim)
        width = self.latent_shape[0] * self.latent_shape[1]
        self.encoder = nn.Linear(in_dim, width)
        self.decoder = nn.Linear(width, in_dim)

    def encode(self, x: Tensor) -> Tensor:
        """[N, D] -> [N, C, L] in [-1, 1]."""
        if x.ndim != 2 or x.shape[1] != self.in_dim:
            raise ValueError(f"expected [N, {self.in_dim}], got {tuple(x.shape)}")
        return torch.tanh(self.encoder(x)).reshape(x.shape[0], *self.latent_shape)

    def decode(self, z: Tensor) -> Tensor:
        """[N, C, L] -> [N, D]."""
        return self.decoder(z.reshape(z.shape[0], -1))

    def forward(self, x: Tensor) -> Tensor:
        """Clean reconstruction decode(encode(x))."""
        return self.decode(self.encode(x))


#: either autoencoder
Autoencoder = ParamAutoencoder | LinearParamAutoencoder


class LatentDenoiser(nn.Module):
    """eps_phi(z_t, t) after p-diff's ``AE_CNN_bottleneck``: the latent flattened to one
    channel of length C*L, stride-1 conv blocks of width * (1, 2, 4) with InstanceNorm and
    LeakyReLU, U-skips, and a learned time embedding added before every block, *per sample*.
    """

    def __init__(
        self, latent_shape: tuple[int, int], width: int = 64, timesteps: int = 1000
    ) -> None:
        super().__init__()
        self.latent_shape = latent_shape
        w = (width, 2 * width, 4 * width)
        self.time_embed = nn.Embedding(timesteps, latent_shape[0] * latent_shape[1])
        block = self._block
        self.enc = nn.ModuleList([block(1, w[0], False), block(w[0], w[1]), block(w[1], w[2])])
        self.dec = nn.ModuleList([block(w[2], w[1]), block(w[1], w[0]), block(w[0], 1)])

    @staticmethod
    def _block(c_in: int, c_out: int, norm_input: bool = True) -> nn.Sequential:
        head: list[nn.Module] = [nn.LeakyReLU(), nn.InstanceNorm1d(c_in)] if norm_input else []
        return nn.Sequential(
            *head,
            nn.Conv1d(c_in, c_out, 3, padding=1),
            nn.LeakyReLU(),
            nn.InstanceNorm1d(c_out),
            nn.Conv1d(c_out, c_out, 3, padding=1),
        )

    def forward(self, z: Tensor, t: Tensor) -> Tensor:
        """Predicted noise for ``z`` [N, C, L] at embedding indices ``t`` [N] (0..T-1)."""
        if z.ndim != 3 or tuple(z.shape[1:]) != self.latent_shape or t.shape != (z.shape[0],):
            raise ValueError(
                f"expected z [N, {self.latent_shape}] and t [N], got "
                f"{tuple(z.shape)} and {tuple(t.shape)}"
            )
        emb = self.time_embed(t)[:, None, :]  # [N, 1, C*L]: row j sees t[j] only
        h = z.reshape(z.shape[0], 1, -1)
        skips = []
        for blk in self.enc:
            h = blk(h + emb)
            skips.append(h)
        skips.pop()
        for blk in self.dec:
            h = blk(h + emb) + (skips.pop() if skips else 0)
        return h.reshape(z.shape)


class MLPDenoiser(nn.Module):
    """eps_phi(z_t, t) as a residual MLP over the flattened latent (for the linear
    autoencoder's latent, whose positions are not neighbours): a learned embedding of each
    sample's own t added before every block, LayerNorm (per sample) and SiLU."""

    def __init__(
        self, latent_shape: tuple[int, int], width: int = 256, timesteps: int = 1000,
        blocks: int = 3,
    ) -> None:  # fmt: skip
        super().__init__()
        self.latent_shape = latent_shape
        dim = latent_shape[0] * latent_shape[1]
        self.time_embed = nn.Embedding(timesteps, width)
        self.inp = nn.Linear(dim, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.SiLU(), nn.Linear(width, width))
            for _ in range(blocks)
        )
        self.out = nn.Sequential(nn.LayerNorm(width), nn.SiLU(), nn.Linear(width, dim))

    def forward(self, z: Tensor, t: Tensor) -> Tensor:
        """Predicted noise for ``z`` [N, C, L] at embedding indices ``t`` [N] (0..T-1)."""
        if z.ndim != 3 or tuple(z.shape[1:]) != self.latent_shape or t.shape != (z.shape[0],):
            raise ValueError(
                f"expected z [N, {self.latent_shape}] and t [N], got "
                f"{tuple(z.shape)} and {tuple(t.shape)}"
            )
        emb = self.time_embed(t)
        h = self.inp(z.reshape(z.shape[0], -1))
        for blk in self.blocks:
            h = h + blk(h + emb)
        return self.out(h).reshape(z.shape)


#: either denoiser
Denoiser = LatentDenoiser | MLPDenoiser
