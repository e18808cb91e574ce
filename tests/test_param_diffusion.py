"""pFedGPA's parameter DM (shared/methods/pfedgpa/param_diffusion.py): the forward-chain maths in
float64, the sampler against an oracle denoiser, per-sample timesteps, shapes, files and
determinism, and, on a tiny DM trained with the production schedule (T = 1000), inversion
against direct generation at the shipped depth and at the whole chain."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from shared.errors import CodecError
from shared.methods.pfedgpa.config import PFedGPAConfig
from shared.methods.pfedgpa.param_diffusion import (
    LatentDenoiser,
    LinearParamAutoencoder,
    MLPDenoiser,
    ParamAutoencoder,
    ParamDM,
    ParamDMConfig,
    ParamNormalizer,
    betas_linear,
    flatten_params,
    forward_chain,
    generate,
    guide,
    invert,
    kept_signal,
    posterior_sigma,
    reconstruct,
    train_param_dm,
    unflatten_params,
)

# its module-scoped fixtures are built once: every test of the module on one pytest worker
pytestmark = pytest.mark.xdist_group("param_diffusion")

D = 150
#: a tiny DM on the production schedule: T = 1000 steps of the linear 1e-4 -> 2e-2 betas
TINY = ParamDMConfig(ae_steps=300, dm_steps=200, timesteps=1000, denoiser_width=16, batch_size=32)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _clusters(per: int = 16, dim: int = D, seed: int = 0) -> Tensor:
    """4 well separated clusters of ``per`` vectors each, rows grouped by cluster."""
    g = _gen(seed)
    centers = 2 * torch.randn(4, dim, generator=g)
    return centers.repeat_interleave(per, 0) + 0.1 * torch.randn(4 * per, dim, generator=g)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    # these tensors are tiny: a second OpenMP thread only adds spin-waits on a shared CPU
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _same(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def trained() -> tuple[ParamDM, Tensor, list[tuple[str, int, int]]]:
    store = _clusters()
    calls: list[tuple[str, int, int]] = []

    def progress(phase: str, step: int, total: int, loss: float) -> None:
        calls.append((phase, step, total))

    return train_param_dm(store, ["w"], [(D,)], TINY, _gen(1), progress=progress), store, calls


# --- configuration ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("ae_size", "large"),
        ("denoiser_width", 0),
        ("ae_steps", -1),
        ("dm_steps", 0),
        ("batch_size", 0),
        ("timesteps", 0),
        ("lr", 0.0),
        ("input_noise", 1.0),
        ("denoiser", "unet"),
        ("latent_noise", -0.1),
        ("ema", 1.0),
        ("ema", 0.0),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ParamDMConfig(**{field: value})  # type: ignore[arg-type]


# --- forward-chain maths (eqs. 6, 11, 12, 14) --------------------------------------------


def test_betas_and_posterior_sigma_by_hand() -> None:
    b = betas_linear(5)
    assert b.dtype == torch.float64
    assert b[0].item() == pytest.approx(1e-4) and b[-1].item() == pytest.approx(2e-2)
    sigma = posterior_sigma(torch.tensor([0.1, 0.2], dtype=torch.float64))
    # abar = 0.9, 0.72: sigma_2^2 = (1 - 0.9) / (1 - 0.72) * 0.2
    assert sigma[0].item() == 0.0
    assert sigma[1].item() == pytest.approx(math.sqrt(0.1 / 0.28 * 0.2), rel=1e-12)


def test_eq14_reconstructs_z0_exactly_in_float64() -> None:
    betas = betas_linear(1000)
    z0 = torch.rand(3, 2, 16, generator=_gen(0), dtype=torch.float64) * 2 - 1
    z_t, eps_tilde = forward_chain(z0, betas, _gen(7))
    assert eps_tilde.shape == (1000, 3, 2, 16)
    assert (reconstruct(z_t, eps_tilde, betas) - z0).abs().max().item() < 1e-10
    # eq. 12 recovers the noise that eq. 11 drew
    g = _gen(7)
    drawn = torch.stack(
        [torch.randn(z0.shape, generator=g, dtype=torch.float64) for _ in range(1000)]
    )
    assert (eps_tilde - drawn).abs().max().item() < 1e-9
    # a shorter chain reconstructs too, and t0 = 0 is the identity
    z_s, eps_s = forward_chain(z0, betas, _gen(8), t0=37)
    assert (reconstruct(z_s, eps_s, betas) - z0).abs().max().item() < 1e-12
    z_0, eps_0 = forward_chain(z0, betas, _gen(8), t0=0)
    assert torch.equal(z_0, z0) and eps_0.shape[0] == 0
    with pytest.raises(ValueError, match="t0"):
        forward_chain(z0, betas, _gen(8), t0=1001)


# --- modules -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("in_dim", "size", "latent"),
    [
        (1, "small", (2, 2)),
        (7, "small", (2, 2)),
        (83, "small", (2, 2)),
        (163, "small", (2, 3)),
        (1290, "small", (2, 16)),
        (1706, "small", (2, 22)),
        (301, "medium", (4, 2)),
        (2048, "medium", (4, 4)),
    ],
)
def test_autoencoder_shapes(in_dim: int, size: str, latent: tuple[int, int]) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ae = ParamAutoencoder(in_dim, size)  # type: ignore[arg-type]
    x = torch.randn(3, in_dim, generator=_gen(1))
    z = ae.encode(x)
    assert ae.latent_shape == latent and z.shape == (3, *latent)
    assert z.abs().max().item() <= 1.0
    assert ae.decode(z).shape == (3, in_dim)
    with pytest.raises(ValueError, match=str(in_dim)):
        ae.encode(torch.zeros(3, in_dim + 1))


@pytest.mark.parametrize("in_dim", [7, 1290, 11930])
def test_linear_autoencoder_has_the_small_latent(in_dim: int) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ae = LinearParamAutoencoder(in_dim)
        small = ParamAutoencoder(in_dim, "small")
    assert ae.latent_shape == small.latent_shape
    x = torch.randn(3, in_dim, generator=_gen(1))
    z = ae.encode(x)
    assert z.shape == (3, *small.latent_shape) and z.abs().max().item() <= 1.0
    assert ae.decode(z).shape == (3, in_dim)
    with pytest.raises(ValueError, match=str(in_dim)):
        ae.encode(torch.zeros(3, in_dim + 1))


def test_linear_autoencoder_learns_directions_the_conv_one_cannot() -> None:
    # 64 vectors on a random 3-d subspace of R^300: no pattern repeats along the vector
    g = _gen(0)
    x = torch.randn(64, 3, generator=g) @ torch.randn(3, 300, generator=g)
    x = (x - x.mean(0)) / x.std(0)
    cfg = dataclasses.replace(TINY, ae_steps=100, dm_steps=1, batch_size=64, lr=1e-2)
    mse = {}
    for size in ("small", "linear"):
        dm = train_param_dm(x, ["w"], [(300,)], dataclasses.replace(cfg, ae_size=size), _gen(1))
        with torch.no_grad():
            z = dm.normalizer.normalize(x)
            mse[size] = float(((dm.autoencoder(z) - z) ** 2).mean())  # 1: the mean
    assert mse["linear"] < 0.2 < mse["small"]  # 0.05 and 0.54 (0.05-0.06, 0.51-0.70 by seed)


@pytest.mark.parametrize("kind", ["conv", "mlp"])
def test_denoiser_conditions_each_sample_on_its_own_timestep(kind: str) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        den: nn.Module = (
            LatentDenoiser((2, 8), width=8, timesteps=50)
            if kind == "conv"
            else MLPDenoiser((2, 8), width=16, timesteps=50)
        ).eval()
    z = torch.randn(4, 2, 8, generator=_gen(1))
    t = torch.tensor([0, 13, 27, 49])
    with torch.no_grad():
        batch = den(z, t)
        single = torch.cat([den(z[i : i + 1], t[i : i + 1]) for i in range(4)])
        # p-diff's bug conditioned every row on t[0]: that is not what a mixed batch gives
        as_bug = den(z, t[:1].expand(4))
        same_z = den(z[:1].expand(2, -1, -1), torch.tensor([3, 40]))
    assert batch.shape == z.shape
    torch.testing.assert_close(batch, single, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(batch[0], as_bug[0])
    assert (batch[1:] - as_bug[1:]).abs().amax(dim=(1, 2)).min().item() > 1e-3
    assert (same_z[0] - same_z[1]).abs().max().item() > 1e-3


def test_normalizer_round_trip_and_std_floor() -> None:
    x = torch.randn(10, 6, generator=_gen(0)) * torch.tensor([1.0, 2, 3, 4, 5, 0])
    x[:, 5] = 0.25  # a constant coordinate
    norm = ParamNormalizer.fit(x)
    median = float(x.std(dim=0, correction=0).median())  # lower median, over all 6
    assert norm.std[5].item() == pytest.approx(1e-3 * median, rel=1e-5)
    y = norm.normalize(x)
    torch.testing.assert_close(y[:, :5].mean(dim=0), torch.zeros(5), atol=1e-6, rtol=0)
    torch.testing.assert_close(y[:, :5].std(dim=0, correction=0), torch.ones(5))
    torch.testing.assert_close(norm.denormalize(y), x)
    again = ParamNormalizer.from_state_dict(norm.state_dict())
    assert torch.equal(again.normalize(x), y)
    assert norm.normalize(x.double()).dtype == torch.float64


def test_flatten_unflatten_round_trip() -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        state = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).state_dict()
    names = ["1.bias", "0.weight", "1.weight"]  # any order, kept
    shapes = [tuple(state[n].shape) for n in names]
    vec = flatten_params(state, names)
    assert vec.shape == (2 + 12 + 8,) and vec.dtype == torch.float32
    assert torch.equal(vec[:2], state["1.bias"])
    back = unflatten_params(vec, names, shapes)
    assert list(back) == names and all(torch.equal(back[n], state[n]) for n in names)
    with pytest.raises(ValueError):
        unflatten_params(vec[:-1], names, shapes)
    with pytest.raises(KeyError):
        flatten_params(state, ["2.weight"])


# --- the sampler against an oracle -------------------------------------------------------


class _Oracle(LatentDenoiser):
    """The exact eps for a store of one latent z*: (z_t - sqrt(abar_t) z*) / sqrt(1 - abar_t)."""

    def __init__(self, target: Tensor, betas: Tensor) -> None:
        super().__init__(tuple(target.shape[1:]), width=1, timesteps=betas.shape[0])  # type: ignore[arg-type]
        self.target = target
        self.abar = torch.cumprod(1 - betas, 0).float()

    def forward(self, z: Tensor, t: Tensor) -> Tensor:
        a = self.abar[t][:, None, None]
        return (z - a.sqrt() * self.target) / (1 - a).sqrt()


def _oracle_dm(clamp: bool) -> tuple[ParamDM, Tensor]:
    store = _clusters(per=4, dim=40)
    cfg = dataclasses.replace(TINY, timesteps=60, clamp=clamp)
    norm = ParamNormalizer.fit(store)
    betas = betas_linear(cfg.timesteps)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(3)
        ae = ParamAutoencoder(40).eval()
        target = ae.encode(norm.normalize(store[:1]))
        expected = norm.denormalize(ae.decode(target))[0]
        oracle = _Oracle(target, betas)  # its unused conv weights are drawn here too
    return ParamDM(cfg, ["w"], [(40,)], norm, ae, oracle, betas), expected


@pytest.mark.parametrize("clamp", [False, True])
def test_sampling_with_an_oracle_denoiser_lands_on_the_stored_point(clamp: bool) -> None:
    dm, expected = _oracle_dm(clamp)
    out = generate(dm, 5, _gen(0))
    assert out.shape == (5, 40)
    torch.testing.assert_close(out, expected.expand(5, -1), rtol=1e-4, atol=1e-4)
    # eq. 15 ends with sigma_1 = 0 too, so inversion of anything lands there as well
    inv = invert(dm, _clusters(per=1, dim=40, seed=5), _gen(1))
    torch.testing.assert_close(inv, expected.expand(4, -1), rtol=1e-4, atol=1e-4)
    # strided steps with no guidance (omega = -1) as well
    far = torch.randn(40, generator=_gen(2))
    got = guide(dm, far, far, _gen(3), omega=-1.0, steps=7, start_t=50)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


# --- training, files, inversion, generation, guidance -----------------------------------


def test_training_is_deterministic_and_leaves_the_global_rng_alone() -> None:
    store = _clusters(per=3, dim=60)
    cfg = dataclasses.replace(TINY, ae_steps=15, dm_steps=15, batch_size=8)
    before = torch.get_rng_state()
    a = train_param_dm(store, ["a", "b"], [(10, 5), (10,)], cfg, _gen(4))
    b = train_param_dm(store, ["a", "b"], [(10, 5), (10,)], cfg, _gen(4))
    c = train_param_dm(store, ["a", "b"], [(10, 5), (10,)], cfg, _gen(5))
    assert torch.equal(torch.get_rng_state(), before)
    assert _same(a.state_dict(), b.state_dict())
    assert not _same(a.state_dict(), c.state_dict())
    with pytest.raises(ValueError, match="dimension"):
        train_param_dm(store, ["a"], [(10, 5)], cfg, _gen(4))


def test_progress_is_reported_per_phase(trained: tuple[ParamDM, Tensor, list]) -> None:
    _, _, calls = trained
    for phase, total in (("ae", TINY.ae_steps), ("dm", TINY.dm_steps)):
        steps = [s for p, s, n in calls if p == phase and n == total]
        assert 50 <= len(steps) <= 101 and steps[-1] == total


def test_save_load_round_trip(trained: tuple[ParamDM, Tensor, list], tmp_path: Path) -> None:
    dm, store, _ = trained
    path = tmp_path / "dm" / "latest.safetensors"
    dm.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["latest.safetensors"]
    back = ParamDM.load(path)
    assert _same(back.state_dict(), dm.state_dict()) and back.meta() == dm.meta()
    assert back.config == dm.config and back.shapes == [(D,)] and back.names == ["w"]
    assert torch.equal(
        invert(back, store[:3], _gen(9), t0=50), invert(dm, store[:3], _gen(9), t0=50)
    )
    assert torch.equal(generate(back, 2, _gen(9)), generate(dm, 2, _gen(9)))
    (tmp_path / "junk.safetensors").write_bytes(b"not a dm")
    with pytest.raises(CodecError):
        ParamDM.load(tmp_path / "junk.safetensors")


def test_invert_t0_zero_is_the_autoencoder_reconstruction(
    trained: tuple[ParamDM, Tensor, list],
) -> None:
    dm, store, _ = trained
    with torch.no_grad():
        expected = dm.normalizer.denormalize(
            dm.autoencoder.decode(dm.autoencoder.encode(dm.normalizer.normalize(store[:5])))
        )
    torch.testing.assert_close(invert(dm, store[:5], _gen(0), t0=0), expected)


def test_invert_is_deterministic_and_seeded(trained: tuple[ParamDM, Tensor, list]) -> None:
    dm, store, _ = trained
    a = invert(dm, store[:4], _gen(2), t0=50)
    assert a.shape == (4, D) and torch.isfinite(a).all()
    assert torch.equal(a, invert(dm, store[:4], _gen(2), t0=50))
    assert not torch.equal(a, invert(dm, store[:4], _gen(3), t0=50))


def test_kept_signal_of_the_linear_schedule() -> None:
    b = betas_linear(1000)
    assert kept_signal(b, 0) == 1.0
    assert kept_signal(b, 1000) == pytest.approx(0.0064, abs=1e-4)
    assert kept_signal(b, 200) == pytest.approx(0.81, abs=0.01)
    # the T = 100 schedule squeezes the same betas into 100 steps and keeps far more
    assert kept_signal(betas_linear(100), 100) == pytest.approx(0.603, abs=1e-3)
    with pytest.raises(ValueError, match="t0"):
        kept_signal(b, 1001)


def test_inversion_from_the_shipped_depth_keeps_its_input_at_t_1000(
    trained: tuple[ParamDM, Tensor, list],
) -> None:
    dm, store, _ = trained
    depth = PFedGPAConfig.model_fields["invert_from"].default
    assert 0 < depth < dm.betas.shape[0]  # the shipped inversion does go through the DM
    picks = store[torch.arange(16) * 4]  # 4 vectors of each cluster
    own = torch.arange(16) // 4
    centers = store.reshape(4, 16, D).mean(dim=1)

    def distance_and_kept(x: Tensor) -> tuple[float, float]:
        kept = (torch.cdist(x, centers).argmin(dim=1) == own).float().mean()
        return float((x - picks).norm(dim=1).mean()), float(kept)

    d_gen, _ = distance_and_kept(generate(dm, 16, _gen(12)))
    d_inv, kept_inv = distance_and_kept(invert(dm, picks, _gen(11), t0=depth))
    assert d_inv < 0.5 * d_gen and kept_inv >= 0.75  # 0.29 and 0.875 with these seeds
    # from the whole chain (T) the chain keeps 0.0064 of its input:
    # the result is a sample of the model, as far from its input as direct generation
    d_full, kept_full = distance_and_kept(invert(dm, picks, _gen(11), t0=1000))
    assert d_full > 0.7 * d_gen and kept_full <= 0.5  # 0.82 and 0.31 (chance: 0.25)


def test_posterior_inversion_retraces_the_chain_to_the_reconstruction(
    trained: tuple[ParamDM, Tensor, list],
) -> None:
    dm, store, _ = trained
    recon = invert(dm, store[:4], _gen(0), t0=0)
    for t0 in (1000, 37):
        exact = invert(dm, store[:4], _gen(t0), t0=t0, noise="posterior")
        torch.testing.assert_close(exact, recon, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="noise"):
        invert(dm, store[:4], _gen(0), noise="ddim")  # type: ignore[arg-type]


def test_generate_shapes_and_determinism(trained: tuple[ParamDM, Tensor, list]) -> None:
    dm, _, _ = trained
    out = generate(dm, 3, _gen(0))
    assert out.shape == (3, D) and torch.isfinite(out).all()
    assert torch.equal(out, generate(dm, 3, _gen(0)))
    with pytest.raises(ValueError):
        generate(dm, 0, _gen(0))


def test_guide_is_deterministic_and_finite(trained: tuple[ParamDM, Tensor, list]) -> None:
    dm, store, _ = trained
    kwargs = {"omega": 0.5, "steps": 5, "start_t": 40}
    a = guide(dm, store[0], store[1], _gen(6), **kwargs)  # type: ignore[arg-type]
    assert a.shape == (D,) and torch.isfinite(a).all()
    assert torch.equal(a, guide(dm, store[0], store[1], _gen(6), **kwargs))  # type: ignore[arg-type]
    assert not torch.equal(a, guide(dm, store[0], store[1], _gen(7), **kwargs))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start_t"):
        guide(dm, store[0], store[1], _gen(6), omega=0.5, steps=5, start_t=1001)
