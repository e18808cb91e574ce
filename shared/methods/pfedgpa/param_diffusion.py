"""Latent diffusion over flattened client parameters: the server-side maths of pFedGPA.

pFedGPA (Lai et al., arXiv 2409.05701) trains a DDPM on the clients' uploaded parameters
(eqs. 3-6), personalizes by *parameter inversion* (eqs. 11-16) and guides new clients with
the local update as a classifier-style score (eq. 10, Alg. 1 lines 9-13). The architecture is
p-diff's (Wang et al. 2024): a 1-D conv autoencoder over the flattened parameter vector
(``ODEncoder2Decoder``) and a 1-D conv DDPM in its tanh-bounded latent (``AE_CNN_bottleneck``).

Diffusion steps are numbered as in the paper, t = 1..T, with ``betas[t - 1]`` = beta_t;
the denoiser's embedding index is t - 1. Deviations from p-diff, each on purpose:

- vectors are standardized per coordinate with statistics of the store (p-diff feeds raw
  parameters; layer scales differ by ~6x), and the statistics travel with the model;
- every conv pads ``k // 2`` so lengths are exact (latent length = padded length / f**4),
  and the padded length is at least 2 * f**4 (InstanceNorm needs two positions);
- the denoiser conditions sample j on t[j] (p-diff indexes ``time_encode(t)[0]``), has three
  levels of width * (1, 2, 4) instead of four of 64..512, and does not InstanceNorm its raw
  input (p-diff's first InstanceNorm discards the scale of z_t, which carries the noise level);
- posterior sigma_t (eq. 6) instead of p-diff's ``fixedlarge`` beta_t; EMA with the usual
  warm-up min(ema, (1 + s) / (10 + s)) so that short runs do not keep the initial weights;
- one safetensors file via the repository's codec and atomic write, never pickle.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from shared.atomic import atomic_write
from shared.errors import CodecError
from shared.methods.pfedgpa.param_nets import (
    AE_SIZES,
    Autoencoder,
    Denoiser,
    LatentDenoiser,
    LinearParamAutoencoder,
    MLPDenoiser,
    ParamAutoencoder,
    conv_latent_shape,
)
from shared.wire.codec import decode_tensors, encode_tensors, read_metadata

__all__ = [
    "Autoencoder",
    "Denoiser",
    "Inversion",
    "LatentDenoiser",
    "LinearParamAutoencoder",
    "MLPDenoiser",
    "ParamAutoencoder",
    "ParamDM",
    "ParamDMConfig",
    "ParamNormalizer",
    "betas_linear",
    "conv_latent_shape",
    "flatten_params",
    "forward_chain",
    "generate",
    "guide",
    "invert",
    "kept_signal",
    "posterior_sigma",
    "reconstruct",
    "train_param_dm",
    "unflatten_params",
]

FORMAT = "estuary-param-dm-v1"
Progress = Callable[[str, int, int, float], None]


@dataclass(frozen=True)
class ParamDMConfig:
    """Sizes and training settings of the parameter DM (defaults after p-diff)."""

    ae_size: Literal["tiny", "small", "medium", "linear"] = "small"
    denoiser: Literal["conv", "mlp"] = "conv"
    denoiser_width: int = 64
    ae_steps: int = 2000
    dm_steps: int = 2000
    batch_size: int = 64
    lr: float = 1e-3
    input_noise: float = 0.001
    latent_noise: float = 0.1
    timesteps: int = 1000
    ema: float = 0.999
    clamp: bool = False  # clamp z_t and x0-hat to [-1, 1] in generate/guide (never in invert)

    def __post_init__(self) -> None:
        if self.ae_size not in (*AE_SIZES, "linear"):
            raise ValueError(
                f"ae_size must be one of {[*sorted(AE_SIZES), 'linear']}, got {self.ae_size!r}"
            )
        if self.denoiser not in ("conv", "mlp"):
            raise ValueError(f"denoiser must be 'conv' or 'mlp', got {self.denoiser!r}")
        for name in ("denoiser_width", "ae_steps", "dm_steps", "batch_size", "timesteps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        for name, ok, rule in (
            ("lr", self.lr > 0, "> 0"),
            ("ema", 0 < self.ema < 1, "in (0, 1)"),
            ("input_noise", 0 <= self.input_noise < 1, "in [0, 1)"),
            ("latent_noise", 0 <= self.latent_noise < 1, "in [0, 1)"),
        ):
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)}")


@dataclass(frozen=True)
class ParamNormalizer:
    """Per-coordinate standardization with the store's mean and (floored) std."""

    mean: Tensor
    std: Tensor

    @classmethod
    def fit(cls, x: Tensor) -> ParamNormalizer:
        """Statistics of ``x`` [N, D]; the std is floored at max(1e-3 * median std, 1e-8) so
        that near-constant coordinates (e.g. weights nobody trains) do not blow up."""
        if x.ndim != 2 or x.shape[0] < 1:
            raise ValueError(f"expected vectors of shape [N, D], got {tuple(x.shape)}")
        x = x.detach().float()
        std = x.std(dim=0, correction=0)
        return cls(x.mean(dim=0), std.clamp_min(max(1e-3 * float(std.median()), 1e-8)))

    def normalize(self, x: Tensor) -> Tensor:
        """(x - mean) / std, in x's dtype and device."""
        return (x - self.mean.to(x)) / self.std.to(x)

    def denormalize(self, x: Tensor) -> Tensor:
        """Inverse of :meth:`normalize`."""
        return x * self.std.to(x) + self.mean.to(x)

    def state_dict(self) -> dict[str, Tensor]:
        """The two statistics."""
        return {"mean": self.mean, "std": self.std}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor]) -> ParamNormalizer:
        """Rebuild from :meth:`state_dict`."""
        if state["mean"].shape != state["std"].shape or state["mean"].ndim != 1:
            raise ValueError("normalizer mean and std must be 1-D of the same length")
        return cls(state["mean"], state["std"])


@dataclass
class ParamDM:
    """A trained parameter DM: what inversion, generation and guidance need, and its file."""

    config: ParamDMConfig
    names: list[str]
    shapes: list[tuple[int, ...]]
    normalizer: ParamNormalizer
    autoencoder: Autoencoder
    denoiser: Denoiser  # the EMA weights
    betas: Tensor  # float64 [T]

    def state_dict(self) -> dict[str, Tensor]:
        """Every tensor, prefixed ``normalizer.``, ``autoencoder.``, ``denoiser.``, ``betas``."""
        out = {"betas": self.betas}
        for prefix, part in (
            ("normalizer.", self.normalizer),
            ("autoencoder.", self.autoencoder),
            ("denoiser.", self.denoiser),
        ):
            out.update({prefix + k: v for k, v in part.state_dict().items()})
        return {k: v.detach().cpu().contiguous() for k, v in out.items()}

    def meta(self) -> dict[str, Any]:
        """JSON-able description: format, the config used, tensor names and shapes."""
        return {
            "format": FORMAT,
            "config": asdict(self.config),
            "names": list(self.names),
            "shapes": [list(s) for s in self.shapes],
            "in_dim": self.autoencoder.in_dim,
        }

    def save(self, path: Path) -> None:
        """Write one safetensors file atomically (a temp file in the same directory, then
        rename), with :meth:`meta` as JSON in its string metadata."""
        atomic_write(path, encode_tensors(self.state_dict(), {"estuary": json.dumps(self.meta())}))

    @classmethod
    def load(cls, path: Path) -> ParamDM:
        """Read a file written by :meth:`save` (never unpickles); CodecError if it is not one."""
        try:
            data = path.read_bytes()
            meta = json.loads(read_metadata(data).get("estuary", "{}"))
            if meta.get("format") != FORMAT:
                raise CodecError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
            tensors, cfg = decode_tensors(data), ParamDMConfig(**meta["config"])
            ae, den = _build_modules(int(meta["in_dim"]), cfg, seed=0)
            ae.load_state_dict(_sub(tensors, "autoencoder."))
            den.load_state_dict(_sub(tensors, "denoiser."))
            dm = cls(
                cfg,
                list(meta["names"]),
                [tuple(s) for s in meta["shapes"]],
                ParamNormalizer.from_state_dict(_sub(tensors, "normalizer.")),
                ae.eval(),
                den.eval(),
                tensors["betas"],
            )
        except (OSError, KeyError, ValueError, TypeError, RuntimeError) as err:
            raise CodecError(f"cannot load a parameter DM from {path}: {err}") from None
        if sum(math.prod(s) for s in dm.shapes) != ae.in_dim or dm.betas.shape != (cfg.timesteps,):
            raise CodecError(f"{path}: shapes or betas do not match the recorded config")
        return dm


def _sub(tensors: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def _build_modules(in_dim: int, cfg: ParamDMConfig, seed: int) -> tuple[Autoencoder, Denoiser]:
    # module init draws from the global RNG: scope it so that the caller's state is untouched
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ae: Autoencoder = (
            LinearParamAutoencoder(in_dim) if cfg.ae_size == "linear"
            else ParamAutoencoder(in_dim, cfg.ae_size)
        )  # fmt: skip
        if cfg.denoiser == "mlp":
            return ae, MLPDenoiser(ae.latent_shape, cfg.denoiser_width, cfg.timesteps)
        return ae, LatentDenoiser(ae.latent_shape, cfg.denoiser_width, cfg.timesteps)


def _seed(generator: torch.Generator) -> int:
    return int(torch.randint(0, 2**62, (1,), generator=generator))


def _derive(generator: torch.Generator, device: torch.device) -> torch.Generator:
    """A fresh generator on ``device`` seeded by one draw from ``generator``."""
    return torch.Generator(device=device).manual_seed(_seed(generator))


def _fit(
    model: nn.Module,
    loss_fn: Callable[[], Tensor],
    steps: int,
    cfg: ParamDMConfig,
    phase: str,
    progress: Progress | None,
    ema: nn.Module | None = None,
) -> None:
    """``steps`` AdamW steps (p-diff's lr and wd 2e-6) on ``loss_fn``, optionally with EMA."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=2e-6)
    for step in range(1, steps + 1):
        loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if ema is not None:
            decay = min(cfg.ema, (1 + step) / (10 + step))
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                    e.lerp_(p, 1 - decay)
        if progress is not None and (step % max(1, steps // 100) == 0 or step == steps):
            progress(phase, step, steps, float(loss.detach()))


def train_param_dm(
    vectors: Tensor,
    names: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    cfg: ParamDMConfig,
    generator: torch.Generator,
    *,
    device: torch.device | None = None,
    progress: Progress | None = None,
) -> ParamDM:
    """Fit the normalizer, train the AE (MSE, p-diff's noise augmentation), then the latent
    DDPM on clean encodings (eq. 5 with per-sample uniform t), keeping an EMA of it.

    Every random draw (init, minibatches, noise) comes from ``generator``: the same seed and
    input give a bit-identical ParamDM on CPU. ``progress(phase, step, total, loss)`` is
    called about every 1% of the steps of phase "ae" and of phase "dm".
    """
    if vectors.ndim != 2 or vectors.shape[0] < 1:
        raise ValueError(f"expected vectors [N, D], got {tuple(vectors.shape)}")
    if sum(math.prod(s) for s in shapes) != vectors.shape[1] or len(names) != len(shapes):
        raise ValueError(f"names/shapes do not describe vectors of dimension {vectors.shape[1]}")
    device = vectors.device if device is None else device
    normalizer = ParamNormalizer.fit(vectors)
    x = normalizer.normalize(vectors.detach().float()).to(device)
    ae, den = _build_modules(x.shape[1], cfg, _seed(generator))
    ae.to(device)
    den.to(device)
    gen = _derive(generator, device)
    n, bs = x.shape[0], min(cfg.batch_size, x.shape[0])

    def batch(data: Tensor) -> Tensor:
        return data if bs == n else data[torch.randperm(n, generator=gen, device=device)[:bs]]

    def noised(v: Tensor, xi: float) -> Tensor:  # p-diff's add_noise: an interpolation
        return (1 - xi) * v + xi * torch.randn(v.shape, generator=gen, device=device)

    def ae_loss() -> Tensor:
        xb = batch(x)
        z = noised(ae.encode(noised(xb, cfg.input_noise)), cfg.latent_noise)
        return F.mse_loss(ae.decode(z.clamp(-1, 1)), xb)

    _fit(ae, ae_loss, cfg.ae_steps, cfg, "ae", progress)
    ae.eval().requires_grad_(False)
    with torch.no_grad():
        z0_all = ae.encode(x)  # the DDPM learns clean latents; the AE is frozen from here
    betas = betas_linear(cfg.timesteps)
    abar = torch.cumprod(1 - betas, 0).float().to(device)

    def dm_loss() -> Tensor:
        z0 = batch(z0_all)
        t = torch.randint(0, cfg.timesteps, (z0.shape[0],), generator=gen, device=device)
        eps = torch.randn(z0.shape, generator=gen, device=device)
        a = abar[t][:, None, None]
        return F.mse_loss(den(a.sqrt() * z0 + (1 - a).sqrt() * eps, t), eps)

    ema = copy.deepcopy(den).requires_grad_(False)
    _fit(den, dm_loss, cfg.dm_steps, cfg, "dm", progress, ema=ema)
    return ParamDM(cfg, list(names), [tuple(s) for s in shapes], normalizer, ae, ema.eval(), betas)


def betas_linear(timesteps: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """DDPM's linear schedule beta_1..beta_T from 1e-4 to 2e-2."""
    if timesteps < 1:
        raise ValueError(f"timesteps must be positive, got {timesteps}")
    return torch.linspace(1e-4, 2e-2, timesteps, dtype=dtype)


def forward_chain(
    z0: Tensor, betas: Tensor, generator: torch.Generator, t0: int | None = None
) -> tuple[Tensor, Tensor]:
    """Eq. 11: z_t = sqrt(1 - b_t) z_{t-1} + sqrt(b_t) eps_t for t = 1..t0 (default T).

    Returns z_{t0} and eps_tilde [t0, *z0.shape], row t - 1 holding eq. 12's
    (z_t - sqrt(1 - b_t) z_{t-1}) / sqrt(b_t), recomputed from the chain as the paper does.
    """
    t0 = betas.shape[0] if t0 is None else t0
    if not 0 <= t0 <= betas.shape[0]:
        raise ValueError(f"t0 must be in [0, {betas.shape[0]}], got {t0}")
    b = betas.to(z0.dtype)
    z, eps_tilde = z0, torch.empty((t0, *z0.shape), dtype=z0.dtype, device=z0.device)
    for i in range(t0):
        noise = torch.randn(z0.shape, generator=generator, dtype=z0.dtype, device=z0.device)
        z_next = (1 - b[i]).sqrt() * z + b[i].sqrt() * noise
        eps_tilde[i] = (z_next - (1 - b[i]).sqrt() * z) / b[i].sqrt()
        z = z_next
    return z, eps_tilde


def reconstruct(z_t: Tensor, eps_tilde: Tensor, betas: Tensor) -> Tensor:
    """Eq. 14: z_{t-1} = (z_t - sqrt(b_t) eps_tilde_t) / sqrt(1 - b_t) for t = t0..1."""
    b, z = betas.to(z_t.dtype), z_t
    for i in reversed(range(eps_tilde.shape[0])):
        z = (z - b[i].sqrt() * eps_tilde[i]) / (1 - b[i]).sqrt()
    return z


def posterior_sigma(betas: Tensor) -> Tensor:
    """Eq. 6's sigma_t = sqrt((1 - abar_{t-1}) / (1 - abar_t) * b_t); sigma_1 = 0."""
    abar = torch.cumprod(1 - betas, 0)
    abar_prev = torch.cat([torch.ones_like(abar[:1]), abar[:-1]])
    return ((1 - abar_prev) / (1 - abar) * betas).sqrt()


def _prepare(
    dm: ParamDM, device: torch.device | None
) -> tuple[Autoencoder, Denoiser, torch.device, Tensor]:
    """The modules on ``device`` (copied, so the caller's stay put) and abar [T + 1] with
    abar[0] = 1, in float64 on the CPU."""
    ae, den = dm.autoencoder, dm.denoiser
    dev = next(ae.parameters()).device if device is None else device
    if next(ae.parameters()).device != dev:
        ae, den = copy.deepcopy(ae).to(dev), copy.deepcopy(den).to(dev)
    abar = torch.cumprod(1 - dm.betas.double().cpu(), 0)
    return ae.eval(), den.eval(), dev, torch.cat([torch.ones(1, dtype=torch.float64), abar])


def _step(
    den: Denoiser,
    z: Tensor,
    t: int,
    t_prev: int,
    abar: Tensor,
    noise: Tensor,
    clamp: bool,
    guidance: Tensor | None = None,
) -> Tensor:
    """One reverse step from t to t_prev < t: eqs. 6/16 (strided: DDPM respacing, with
    alpha = abar_t / abar_{t_prev}). ``noise`` is what sigma multiplies (random when
    sampling, -eps_tilde for eq. 15); ``guidance`` is added to eps_phi as in eq. 10."""
    a_t, a_p = float(abar[t]), float(abar[t_prev])
    alpha = a_t / a_p
    eps = den(z, torch.full((z.shape[0],), t - 1, dtype=torch.long, device=z.device))
    if guidance is not None:
        eps = eps + guidance
    if clamp:  # p-diff: clamp x0-hat, then take the posterior mean from it
        x0 = ((z - math.sqrt(1 - a_t) * eps) / math.sqrt(a_t)).clamp(-1, 1)
        mu = (math.sqrt(a_p) * (1 - alpha) * x0 + math.sqrt(alpha) * (1 - a_p) * z) / (1 - a_t)
    else:
        mu = (z - (1 - alpha) / math.sqrt(1 - a_t) * eps) / math.sqrt(alpha)
    out = mu + math.sqrt((1 - a_p) / (1 - a_t) * (1 - alpha)) * noise
    return out.clamp(-1, 1) if clamp else out


def _decode(dm: ParamDM, ae: Autoencoder, z: Tensor) -> Tensor:
    # the decoder only ever saw latents in [-1, 1] (tanh, and clamped after augmentation)
    return dm.normalizer.denormalize(ae.decode(z.clamp(-1, 1)))


#: how :func:`invert` picks the noise of its reverse pass
Inversion = Literal["chain", "posterior"]


def kept_signal(betas: Tensor, t0: int) -> float:
    """sqrt(abar_t0): the share of z_0 that z_t0 still carries (1 at t0 = 0). Below ~0.1 an
    inversion from t0 keeps almost nothing of its input (0.0064 at t0 = T = 1000)."""
    if not 0 <= t0 <= betas.shape[0]:
        raise ValueError(f"t0 must be in [0, {betas.shape[0]}], got {t0}")
    return math.sqrt(float(torch.prod(1 - betas.double()[:t0])))


@torch.no_grad()
def invert(
    dm: ParamDM,
    theta: Tensor,
    generator: torch.Generator,
    *,
    t0: int | None = None,
    noise: Inversion = "chain",
    device: torch.device | None = None,
) -> Tensor:
    """Parameter inversion in latent space, batched over the rows of ``theta``.

    z0 = E(norm(theta)) [N, C, L]; the forward chain of eq. 11 runs to t0 (default T) and the
    reverse pass starts from z~_{t0} = z_{t0}. ``noise`` says what drives the reverse pass:

    - ``"chain"`` (eqs. 12-16, the paper's): z~_{t-1} = mu_phi(z~_t, t) - sigma_t eps_tilde_t
      with eq. 12's forward noises (posterior sigma, never clamped). eps_tilde is independent
      of z0, so z0 reaches the output only through z_{t0}, which keeps sqrt(abar_t0) of it
      (:func:`kept_signal`): from t0 = T = 1000 the result is a sample of the model
      uncorrelated with theta (direct generation in distribution); from t0 <= 200 it stays
      close to theta, how close depending on the denoiser.
    - ``"posterior"`` (the DDPM-inversion / edit-friendly noise of Wu & De la Torre 2023 and
      Huberman-Spiegelglas et al. 2024): the residuals r_t = z_{t-1} - mu_phi(z_t, t) of the
      recorded chain drive z~_{t-1} = mu_phi(z~_t, t) + r_t, which retraces the chain step by
      step. The result is the autoencoder's reconstruction of theta at every t0, up to float
      rounding: the exact-reconstruction control, where nothing but the autoencoder changes
      the upload.

    Returns denorm(D(z~_0)) [N, D]. t0 = 0 gives the autoencoder's reconstruction. Rows get
    independent noise from ``generator``.
    """
    if noise not in ("chain", "posterior"):
        raise ValueError(f"noise must be 'chain' or 'posterior', got {noise!r}")
    ae, den, dev, abar = _prepare(dm, device)
    z0 = ae.encode(dm.normalizer.normalize(theta.float().to(dev)))
    gen = _derive(generator, dev)
    if noise == "chain":
        z, eps_tilde = forward_chain(z0, dm.betas.to(dev), gen, t0)
        for t in range(eps_tilde.shape[0], 0, -1):
            z = _step(den, z, t, t - 1, abar, -eps_tilde[t - 1], clamp=False)
        return _decode(dm, ae, z)
    # float64: the pass retraces the chain through t0 denoiser calls, each of which may
    # amplify a rounding error; in float32 that drifts by a few % of the scale over 1000 steps
    den64 = copy.deepcopy(den).double()
    chain = _chain_states(z0.double(), dm.betas.to(dev), gen, t0)
    z = chain[-1]
    zero = torch.zeros_like(z)
    for t in range(len(chain) - 1, 0, -1):
        residual = chain[t - 1] - _step(den64, chain[t], t, t - 1, abar, zero, clamp=False)
        z = _step(den64, z, t, t - 1, abar, zero, clamp=False) + residual
    return _decode(dm, ae, z.float())


def _chain_states(
    z0: Tensor, betas: Tensor, generator: torch.Generator, t0: int | None
) -> list[Tensor]:
    """[z_0, z_1, ..., z_t0] of eq. 11's chain (the noises :func:`forward_chain` draws)."""
    t0 = betas.shape[0] if t0 is None else t0
    if not 0 <= t0 <= betas.shape[0]:
        raise ValueError(f"t0 must be in [0, {betas.shape[0]}], got {t0}")
    b, states = betas.to(z0.dtype), [z0]
    for i in range(t0):
        noise = torch.randn(z0.shape, generator=generator, dtype=z0.dtype, device=z0.device)
        states.append((1 - b[i]).sqrt() * states[-1] + b[i].sqrt() * noise)
    return states


@torch.no_grad()
def generate(
    dm: ParamDM, n: int, generator: torch.Generator, *, device: torch.device | None = None
) -> Tensor:
    """Direct generation (Table 2 "w/o inversion"): z_T ~ N(0, I), ancestral sampling with
    eq. 6 and fresh noise each step (clamped when ``config.clamp``), decoded to [n, D]."""
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    ae, den, dev, abar = _prepare(dm, device)
    gen = _derive(generator, dev)
    z = torch.randn((n, *ae.latent_shape), generator=gen, device=dev)
    for t in range(dm.betas.shape[0], 0, -1):
        noise = torch.randn(z.shape, generator=gen, device=dev)
        z = _step(den, z, t, t - 1, abar, noise, dm.config.clamp)
    return _decode(dm, ae, z)


@torch.no_grad()
def guide(
    dm: ParamDM,
    theta_prev: Tensor,
    theta_now: Tensor,
    generator: torch.Generator,
    *,
    omega: float,
    steps: int,
    start_t: int,
    device: torch.device | None = None,
) -> Tensor:
    """Global guidance for a new client (eq. 10; Alg. 1 lines 9-13) in our reading.

    The two operators of Alg. 1 line 11 were lost in extraction. We read it through eq. 10:
    one local update gives grad log P ~ (theta_l - theta_{l-1}) / lambda, so with
    classifier-guidance scaling eps~ = eps_phi(z_t, t) + (1 + omega) sqrt(1 - abar_t)
    (z_prev - z_now), z_prev and z_now being E(norm(theta_prev)) and E(norm(theta_now)).
    z_now is noised to ``start_t`` with q(z_t | z_0), then ``steps`` ancestral steps spaced
    evenly down to 0 give the guided parameters [D].
    """
    if theta_prev.shape != theta_now.shape or theta_now.ndim != 1:
        raise ValueError(
            f"expected two [D] vectors, got {tuple(theta_prev.shape)} and {tuple(theta_now.shape)}"
        )
    if not 1 <= steps <= start_t <= dm.betas.shape[0]:
        raise ValueError(
            f"need 1 <= steps ({steps}) <= start_t ({start_t}) <= T ({dm.betas.shape[0]})"
        )
    ae, den, dev, abar = _prepare(dm, device)
    gen = _derive(generator, dev)
    pair = dm.normalizer.normalize(torch.stack([theta_prev, theta_now]).float().to(dev))
    z_prev, z_now = ae.encode(pair).split(1)
    a = float(abar[start_t])
    z = math.sqrt(a) * z_now + math.sqrt(1 - a) * torch.randn(
        z_now.shape, generator=gen, device=dev
    )
    ts = torch.linspace(start_t, 0, steps + 1, dtype=torch.float64).round().long().tolist()
    for t, t_prev in itertools.pairwise(ts):
        shift = (1 + omega) * math.sqrt(1 - float(abar[t])) * (z_prev - z_now)
        noise = torch.randn(z.shape, generator=gen, device=dev)
        z = _step(den, z, t, t_prev, abar, noise, dm.config.clamp, guidance=shift)
    return _decode(dm, ae, z)[0]


def flatten_params(state: Mapping[str, Tensor], names: Sequence[str]) -> Tensor:
    """1-D float32 concatenation of ``state[name]`` in the order of ``names``."""
    missing = [n for n in names if n not in state]
    if missing:
        raise KeyError(f"state has no tensors named {missing}")
    return torch.cat([state[n].detach().reshape(-1).float().cpu() for n in names])


def unflatten_params(
    vec: Tensor, names: Sequence[str], shapes: Sequence[tuple[int, ...]]
) -> dict[str, Tensor]:
    """Inverse of :func:`flatten_params`: split ``vec`` into tensors of ``shapes``."""
    sizes = [math.prod(s) for s in shapes]
    if len(names) != len(shapes) or vec.ndim != 1 or vec.numel() != sum(sizes):
        raise ValueError(
            f"a vector of {vec.numel()} values does not split into {len(names)} "
            f"tensors of {sum(sizes)} values"
        )
    parts = vec.split(sizes)
    return {n: p.reshape(s).clone() for n, p, s in zip(names, parts, shapes, strict=True)}
