"""Masked generators over frozen random weights (PRISM, seed 002): the secret key, the frozen
weights and initial scores it derives, the Bernoulli mask with its gradient estimators, a
module wrapper that trains scores, and the dense model a fixed mask gives.

Which weights are masked: every weight of two or more dimensions (convolutions, transposed
convolutions, linear layers) -- in a spec, names ending in ``.weight`` with ``ndim >= 2``.
Every other parameter is a frozen constant that no role sends: normalization weights
(1-D ``.weight``) are 1, biases 0 (the paper's generator has no biases).

The key
    At least 128 bits, read from ``ESTUARY_PRISM_KEY`` (hex) or the file named by
    ``ESTUARY_PRISM_KEY_FILE`` (hex text; ``estuary keygen`` writes one, mode 0600). It is
    never part of the run config, its digest, a message or a log line; its fingerprint
    (an HMAC of a fixed label, 16 hex digits) may be. Each tensor's values come from their
    own random stream, seeded by ``HMAC-SHA256(key, purpose/run seed/tensor name)`` (256 bits
    into NumPy's PCG64): frozen signs (``winit``), initial scores (``scores``) and the final
    mask (``final``) are independent streams, so the initial probabilities the downlink
    reveals say nothing about the signs.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import math
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from shared.atomic import atomic_write
from shared.errors import CodecError, ConfigError
from shared.models.presets import build_net, forward_inputs, image_shape, is_weight
from shared.wire.codec import TensorSpec, pack_bits, unpack_bits

KEY_ENV = "ESTUARY_PRISM_KEY"
KEY_FILE_ENV = "ESTUARY_PRISM_KEY_FILE"
MIN_KEY_BYTES = 16  # 128 bits
MAX_KEY_BYTES = 1024
Estimator = Literal["scaled", "identity"]


@dataclass(frozen=True, repr=False, eq=False)
class MaskKey:
    """The secret the frozen weights and initial scores derive from (never printed)."""

    secret: bytes

    def __post_init__(self) -> None:
        if not MIN_KEY_BYTES <= len(self.secret) <= MAX_KEY_BYTES:
            raise ConfigError(
                f"a PRISM key holds {MIN_KEY_BYTES * 8} to {MAX_KEY_BYTES * 8} bits, "
                f"not {len(self.secret) * 8}"
            )

    def __repr__(self) -> str:
        return f"MaskKey(fingerprint={self.fingerprint})"

    @property
    def fingerprint(self) -> str:
        """16 hex digits naming the key without revealing it."""
        return hmac.new(self.secret, b"estuary/prism/fingerprint", hashlib.sha256).hexdigest()[:16]

    def rng(self, purpose: str, seed: int, name: str) -> np.random.Generator:
        """The random stream of one tensor for one purpose under run seed ``seed``."""
        label = f"{purpose}/{seed}/{name}".encode()
        digest = hmac.new(self.secret, label, hashlib.sha256).digest()
        return np.random.Generator(np.random.PCG64(int.from_bytes(digest, "little")))


def parse_key(text: str, where: str) -> MaskKey:
    """A key from its hex text (surrounding whitespace ignored)."""
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise ConfigError(f"{where}: a PRISM key is hex text") from None
    try:
        return MaskKey(secret)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


def load_key(environ: Mapping[str, str] | None = None) -> MaskKey:
    """The key from ``ESTUARY_PRISM_KEY`` or the file ``ESTUARY_PRISM_KEY_FILE`` names."""
    env = os.environ if environ is None else environ
    if env.get(KEY_ENV):
        return parse_key(env[KEY_ENV], KEY_ENV)
    path = env.get(KEY_FILE_ENV)
    if not path:
        raise ConfigError(
            f"PRISM needs a secret key: set {KEY_FILE_ENV} to a key file (`estuary keygen "
            f"PATH` writes one) or {KEY_ENV} to at least {MIN_KEY_BYTES * 2} hex digits"
        )
    try:
        with open(path, "rb") as fh:
            raw = fh.read(4 * MAX_KEY_BYTES)
    except OSError as err:
        raise ConfigError(f"{KEY_FILE_ENV}: cannot read the key file: {err.strerror}") from None
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ConfigError(f"{KEY_FILE_ENV}: a PRISM key file holds hex text") from None
    return parse_key(text, f"{KEY_FILE_ENV} ({Path(path).name})")


def generate_key_file(path: Path) -> MaskKey:
    """Write a fresh 256-bit key to ``path`` (hex, mode 0600, atomically); refuses to
    overwrite a file that exists."""
    key = MaskKey(secrets.token_bytes(32))
    write_key_file(path, key)
    return key


def write_key_file(path: Path, key: MaskKey) -> None:
    """Write ``key`` to ``path`` (hex, mode 0600, atomically); refuses to overwrite a file
    that exists."""
    if path.exists():
        raise ConfigError(f"{path} exists; a key file is never overwritten")
    atomic_write(path, key.secret.hex().encode() + b"\n")
    os.chmod(path, 0o600)


def provide_key_file(
    directory: Path, environ: dict[str, str] | None = None, *, key: MaskKey | None = None
) -> Path | None:
    """Where neither ``ESTUARY_PRISM_KEY`` nor ``ESTUARY_PRISM_KEY_FILE`` is set, name the
    key file ``directory/prism.key`` in ``environ`` (``os.environ`` by default; processes
    started afterwards inherit it), writing a fresh key there (or ``key``: the public
    :data:`DEMO_KEY` of a run that starts from the demo scores) unless one exists: so a run
    directory keeps the key its run was trained with. Returns that path (None: a key was
    already configured)."""
    env: Any = os.environ if environ is None else environ
    if env.get(KEY_ENV) or env.get(KEY_FILE_ENV):
        return None
    path = (directory / "prism.key").resolve()
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        if key is None:
            generate_key_file(path)
        else:
            write_key_file(path, key)
    env[KEY_FILE_ENV] = str(path)
    return path


# -- the demo's scores ----------------------------------------------------------------------------
#: a public key, derived from a fixed label: the frozen weights of the shipped demo scores.
#: Anyone can derive it, so a run under it keeps nothing secret: for demonstrations only.
DEMO_KEY = MaskKey(hashlib.sha256(b"estuary/prism/public demo key").digest())
ASSETS = Path(__file__).resolve().parents[2] / "assets"
#: probabilities trained under :data:`DEMO_KEY` by ``scripts/pretrain_prism_scores.py`` and
#: shipped in shared/assets (``algorithm.prism.init = "demo"``): preset -> (file, sha256).
#: A retrained file needs its new hash here.
DEMO_SCORES: dict[str, tuple[str, str]] = {
    "resnetg-fmnist-16": (
        "prism_resnetg_fmnist_16_demo.safetensors",
        "4cd14ce257602f134df72a5d14690dc17550d5c40c1b49755cd51942f8ee7d15",
    ),
}
DEMO_HINT = "Retrain them with `python scripts/pretrain_prism_scores.py`"


def load_demo_scores(preset: str, key: MaskKey, seed: int) -> dict[str, torch.Tensor]:
    """The shipped demo probabilities of ``preset`` (``prism.theta/<weight>``, float32),
    checked against their recorded sha256 and against what they were trained with: the
    public :data:`DEMO_KEY` and run seed ``seed`` (the frozen weights derive from both).
    ConfigError when any of that does not hold."""
    from shared.wire.codec import decode_tensors, read_metadata, sha256_hex

    if preset not in DEMO_SCORES:
        raise ConfigError(
            f"algorithm.prism.init = 'demo': no demo scores ship for preset {preset!r} "
            f"(available: {sorted(DEMO_SCORES)}); use init = 'key'"
        )
    name, expected = DEMO_SCORES[preset]
    path = ASSETS / name
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(
            f"cannot read the demo scores {path}: {err.strerror}. {DEMO_HINT}."
        ) from None
    if sha256_hex(data) != expected:
        raise ConfigError(
            f"the demo scores {path} have sha256 {sha256_hex(data)[:16]}…, expected "
            f"{expected[:16]}…; {DEMO_HINT} and update DEMO_SCORES in "
            "shared/methods/prism/masking.py."
        )
    try:
        info = json.loads(read_metadata(data).get("estuary", "{}"))
    except json.JSONDecodeError:
        info = {}
    if key.fingerprint != DEMO_KEY.fingerprint:
        raise ConfigError(
            f"the demo scores belong to the public demo key (fingerprint "
            f"{DEMO_KEY.fingerprint}), not to the configured key ({key.fingerprint}): unset "
            f"{KEY_ENV} and {KEY_FILE_ENV} (a run then writes the demo key into its directory), "
            "or train from the configured key's own scores (init = 'key')"
        )
    if info.get("seed") != seed:
        raise ConfigError(
            f"the demo scores were trained at run.seed = {info.get('seed')}, and the frozen "
            f"weights depend on it: set run.seed = {info.get('seed')} (this run has {seed})"
        )
    return decode_tensors(data)


# -- the state that stands for a masked model ---------------------------------------------------
#: the global (and edge) state of a masked model: one probability per masked weight, the masks
#: (or samples) behind them and the cloud's aggregations so far
THETA = "prism.theta/"
COUNT = "prism.masks"
STEP = "prism.step"


def state_spec(model_spec: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
    """The names and shapes of the state standing for a model of ``model_spec``."""
    out = {
        THETA + n: TensorSpec(model_spec[n].shape, torch.float32) for n in masked_names(model_spec)
    }
    out[COUNT] = TensorSpec((), torch.float32)
    out[STEP] = TensorSpec((), torch.float32)
    return out


# -- which tensors are masked, and the frozen rest ---------------------------------------------
def is_masked(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the parameter ``name`` of ``shape`` carries a mask (module docstring): every
    weight matrix and kernel (:func:`~shared.models.presets.is_weight`)."""
    return is_weight(name, shape)


def masked_names(spec: Mapping[str, TensorSpec]) -> list[str]:
    """The masked tensors of a model spec, in its order."""
    return [name for name, s in spec.items() if is_masked(name, s.shape)]


def frozen_constant(name: str, spec: TensorSpec) -> torch.Tensor:
    """The value of an unmasked parameter or buffer: 1 for normalization weights and batch
    norms' running variances, 0 otherwise."""
    fill = 1.0 if name.endswith((".weight", ".running_var")) else 0.0
    return torch.full(spec.shape, fill, dtype=spec.dtype)


def fan_in(shape: tuple[int, ...]) -> int:
    """torch's ``fan_in`` of a weight (``size(1) x kernel``: for a transposed convolution
    that is its *output* channels, as the paper's code computes it)."""
    return shape[1] * math.prod(shape[2:])


def frozen_weight(key: MaskKey, seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``W_init``: Rademacher signs times ``sqrt(2 / fan_in)`` (paper section 4.1, App. E)."""
    n = math.prod(shape)
    signs = key.rng("winit", seed, name).integers(0, 2, size=n, dtype=np.int8) * 2 - 1
    scale = math.sqrt(2.0 / fan_in(shape))
    return torch.from_numpy(signs.astype(np.float32) * np.float32(scale)).reshape(shape)


def initial_scores(key: MaskKey, seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``s0 ~ N(0, 1)`` of one tensor."""
    values = key.rng("scores", seed, name).standard_normal(math.prod(shape), dtype=np.float32)
    return torch.from_numpy(values).reshape(shape)


def final_mask(key: MaskKey, seed: int, step: int, name: str, theta: torch.Tensor) -> torch.Tensor:
    """``M* ~ Bern(theta)``: the fixed mask of the deployed model, from the key, the run seed
    and the cloud's aggregation count (the same state always gives the same mask)."""
    u = key.rng("final", seed, f"{step}/{name}").random(theta.numel(), dtype=np.float32)
    return (torch.from_numpy(u).reshape(theta.shape) < theta).to(torch.float32)


def logit(theta: torch.Tensor, eps: float) -> torch.Tensor:
    """Scores of probabilities clamped to ``[eps, 1 - eps]`` (finite for 0 and 1)."""
    t = theta.clamp(eps, 1.0 - eps)
    return torch.log(t) - torch.log1p(-t)


# -- the mask and its gradient -----------------------------------------------------------------
class _Bernoulli(torch.autograd.Function):
    """``M = [u < theta]`` forward; backward ``theta * g`` (scaled) or ``g`` (identity)."""

    @staticmethod
    def forward(ctx: Any, theta: torch.Tensor, u: torch.Tensor, scaled: bool) -> torch.Tensor:
        ctx.scaled = scaled
        ctx.save_for_backward(theta)
        return (u < theta).to(theta.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (theta,) = ctx.saved_tensors
        return (grad * theta if ctx.scaled else grad), None, None


def bernoulli_mask(theta: torch.Tensor, u: torch.Tensor, estimator: Estimator) -> torch.Tensor:
    """A mask drawn from ``theta`` with uniforms ``u``, differentiable in ``theta`` by
    ``estimator``: ``scaled`` passes ``theta * dL/dM`` (the authors' ``Bern``), ``identity``
    passes ``dL/dM`` (plain straight-through)."""
    mask: torch.Tensor = _Bernoulli.apply(theta, u, estimator == "scaled")
    return mask


class MaskedModule(nn.Module):
    """Train scores over a frozen module: every forward draws one mask per masked tensor
    (shared by the whole batch) and calls ``base`` with ``W_init * M`` in place of its
    weights. The scores are this module's only trainable parameters."""

    def __init__(
        self,
        base: nn.Module,
        frozen: Mapping[str, torch.Tensor],
        scores: Mapping[str, torch.Tensor],
        *,
        estimator: Estimator,
        seed: int,
    ) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.names = list(frozen)
        self.scores = nn.ParameterList(
            [nn.Parameter(scores[n].detach().clone().float()) for n in self.names]
        )
        for i, name in enumerate(self.names):
            self.register_buffer(f"frozen_{i}", frozen[name].detach().clone(), persistent=False)
        self.estimator = estimator
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    @property
    def config(self) -> Any:
        """The base model's config (what training code inspects)."""
        return getattr(self.base, "config", None)

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def masked_weights(self) -> dict[str, torch.Tensor]:
        """``W_init * M`` for one fresh mask per tensor."""
        out = {}
        for i, (name, s) in enumerate(zip(self.names, self.scores, strict=True)):
            u = torch.rand(s.shape, generator=self._generator(s.device), device=s.device)
            frozen: torch.Tensor = getattr(self, f"frozen_{i}")
            out[name] = frozen * bernoulli_mask(torch.sigmoid(s), u, self.estimator)
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(self.base, self.masked_weights(), args, kwargs)

    def probabilities(self) -> dict[str, torch.Tensor]:
        """``theta = sigmoid(s)`` per masked tensor, detached, on the CPU."""
        return {
            n: torch.sigmoid(s.detach()).cpu() for n, s in zip(self.names, self.scores, strict=True)
        }


# -- the compact artifact ----------------------------------------------------------------------
COMPACT_FORMAT = "estuary-prism-compact-v1"
COMPACT_MASK = "mask"
COMPACT_SCALE = "scale/"


def compact_tensors(dense: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A masked model without its key: one bit per masked weight (kept or not; the tensors
    in sorted name order, each flattened in C order, packed little bit order as
    :func:`~shared.wire.codec.pack_bits`) and each tensor's scale ``sqrt(2 / fan_in)``.
    The signs are not in it: only the key regenerates them (:func:`expand_compact`)."""
    names = sorted(n for n, v in dense.items() if is_masked(n, tuple(v.shape)))
    bits = torch.cat([(dense[n] != 0).reshape(-1) for n in names])
    out = {COMPACT_MASK: pack_bits(bits)}
    for n in names:
        out[COMPACT_SCALE + n] = torch.tensor(math.sqrt(2.0 / fan_in(tuple(dense[n].shape))))
    return out


def expand_compact(
    tensors: Mapping[str, torch.Tensor], spec: Mapping[str, TensorSpec], key: MaskKey, seed: int
) -> dict[str, torch.Tensor]:
    """The dense model of a compact artifact for a model of ``spec``: the key's signs times
    each tensor's scale where its bit is set, the frozen constants elsewhere. CodecError when
    the artifact does not fit ``spec``."""
    names = sorted(masked_names(spec))
    sizes = [math.prod(spec[n].shape) for n in names]
    if COMPACT_MASK not in tensors or any(COMPACT_SCALE + n not in tensors for n in names):
        raise CodecError("not a compact PRISM artifact of this preset (tensors missing)")
    flat = unpack_bits(tensors[COMPACT_MASK], sum(sizes)).to(torch.float32)
    out: dict[str, torch.Tensor] = {}
    for n, bits in zip(names, flat.split(sizes), strict=True):
        shape = spec[n].shape
        scale = float(tensors[COMPACT_SCALE + n])
        if not math.isclose(scale, math.sqrt(2.0 / fan_in(shape)), rel_tol=1e-6):
            raise CodecError(f"{n}: scale {scale} is not sqrt(2 / fan_in) of {list(shape)}")
        out[n] = frozen_weight(key, seed, n, shape) * bits.reshape(shape)
    for n, s in spec.items():
        if n not in out:
            out[n] = frozen_constant(n, s)
    return out


@functools.lru_cache(maxsize=8)
def depth_order(preset: str) -> tuple[str, ...]:
    """The masked weights of ``preset`` in the order their modules first run in a forward
    pass (input side first). Registration order is not depth: a diffusers U-Net registers
    ``mid_block`` after ``up_blocks``. Measured once per preset on a batch of one."""
    model = build_net(preset, seed=0).eval()
    owner = {id(m): name for name, m in model.named_modules()}
    order: list[str] = []

    def hook(module: nn.Module, *_: Any) -> None:
        name = owner[id(module)]
        weight = f"{name}.weight" if name else "weight"
        param = getattr(module, "weight", None)
        if weight not in order and param is not None and is_masked(weight, tuple(param.shape)):
            order.append(weight)

    handles = [m.register_forward_pre_hook(hook) for m in model.modules()]
    try:
        with torch.no_grad():
            inputs = forward_inputs(model, torch.zeros(1, *image_shape(preset)), 0)
            model(*inputs.values())
    finally:
        for h in handles:
            h.remove()
    spec = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = [n for n in spec if is_masked(n, spec[n]) and n not in order]
    return tuple(order + missing)  # a weight no forward reaches goes last


def output_side(preset: str, alpha: float) -> frozenset[str]:
    """PRISM*'s layers that send probabilities: the last ``alpha`` % of the masked weights
    in depth order (rounded to the nearest layer)."""
    order = depth_order(preset)
    n = round(len(order) * alpha / 100.0)
    return frozenset(order[len(order) - n :]) if n else frozenset()
