"""The contract every registered algorithm keeps, parametrized over the registry (so an
algorithm added later is held to it without a line here):

- its settings round-trip (the typed settings class and the whole run config, digest kept);
- the same seed gives the same result (two tiny federations over MemoryBus, bit for bit);
- aggregation is a weighted average of the model: weights sum to one and none is negative
  (equal updates aggregate to themselves; every aggregate lies between the updates);
- tensor names and shapes are kept from the global state to the upload and back;
- what a method declares holds: its traffic (what an upload carries), and each capability it
  has (a state view's files survive a save and a load; a final step makes the product its
  settings name).

``SETUP`` gives some methods settings that reach their distinctive paths (pruning, partial
uploads) or the run shape their settings require (a one-shot method's single round); any
other method runs with its defaults. Every other difference is a case per capability.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shared.config import RunConfig, config_from_dict, with_overrides
from shared.config.algorithms import config_class
from shared.data.datasets import NUM_CLASSES, load_dataset, to_model_input
from shared.methods.aggregation import fold_all
from shared.methods.api import DeviceContext, Method, Update
from shared.methods.base import build_algorithm
from shared.methods.prism.config import PrismConfig
from shared.methods.registry import registered
from shared.models.checkpoint import model_digest
from shared.models.plan import model_spec
from shared.models.presets import build_net
from shared.wire.codec import TensorSpec, check_spec, pack_bits, spec_of, unpack_bits
from tests.conftest import synthetic_federation, tiny_config

#: settings that exercise a method's own paths in a short run, and the run shape its
#: settings require (sections of the run config)
SETUP: dict[str, dict[str, dict[str, Any]]] = {
    "fedphd": {"algorithm": {"sparse_rounds": 1, "prune_ratio": 0.3, "lambda0": 1e-3}},
    "feddiffuse": {"algorithm": {"split": "usplit"}},
    "prism": {"algorithm": {"prism_local_iters": 1}},
    "pfedgpa": {"algorithm": {"pfedgpa_ae_steps": 2, "pfedgpa_dm_steps": 2,
                              "pfedgpa_timesteps": 10, "pfedgpa_invert_from": 2,
                              "pfedgpa_denoiser_width": 4, "pfedgpa_batch": 2}},
    "feddeo": {"algorithm": {"feddeo_desc_epochs": 1.0, "feddeo_images_per_class": 1,
                             "feddeo_sample_steps": 1, "feddeo_clf_epochs": 1,
                             "feddeo_grid_per_class": 0},
               "run": {"rounds": 1}, "model": {"preset": "fmnist-tiny-cfg"}},
}  # fmt: skip
#: the model and training of an algorithm that trains no U-Nets (a classifier's SGD)
CLASSIFIER: dict[str, dict[str, Any]] = {
    "model": {"preset": "fmnist-cnn"},
    "train": {"local_steps": 1, "batch_size": 4, "optimizer": "sgd", "lr": 0.01,
              "grad_clip": 0.0},
}  # fmt: skip
#: settings for the convexity check where an algorithm's defaults add a step after the
#: average (PRISM's MADA mixes in the previous state; FedAdam's cloud steps from the average,
#: which with no moments and eta = 2 tau is the average itself)
AVERAGE_ONLY: dict[str, dict[str, Any]] = {
    "prism": {"prism": {"mada": False}},
    "fedadam": {"fedadam": {"beta1": 0.0, "beta2": 1.0, "eta": 2e-3, "tau": 1e-3}},
}
NAMES = registered()


def contract_config(name: str) -> RunConfig:
    """Two rounds of 2 devices at one edge, one local step each, for algorithm ``name`` (a
    U-Net, or the classifier for an algorithm that trains no U-Nets)."""
    sections: dict[str, dict[str, Any]] = {
        "run": {"rounds": 2},
        "federation": {"num_devices": 2, "num_edges": 1},
        "data": {"synthetic_size": 32},
        "train": {"local_steps": 1, "batch_size": 4},
        "algorithm": {"name": name},
    }
    if "unet" not in config_class(name).model_kinds:
        sections |= CLASSIFIER
    for section, values in SETUP.get(name, {}).items():
        sections[section] = {**sections.get(section, {}), **values}
    return tiny_config(**sections)


def test_every_algorithm_is_registered_with_its_settings() -> None:
    assert {"fedavg", "fedphd", "feddiffuse", "fedprox", "scaffold", "moon"} <= set(NAMES)
    for name in NAMES:
        algo = build_algorithm(contract_config(name))
        assert algo.name == name and type(algo).config_class is config_class(name)
        assert isinstance(algo.settings, config_class(name))


@pytest.mark.parametrize("name", NAMES)
def test_settings_round_trip(name: str) -> None:
    cfg = contract_config(name)
    cls = config_class(name)
    settings = cls.of(cfg)
    assert cls.model_validate_json(settings.model_dump_json()) == settings
    assert cfg.algorithm.config() == settings == build_algorithm(cfg).settings
    stored = config_from_dict(json.loads(cfg.to_json()), stored=True)
    assert stored == cfg and stored.digest() == cfg.digest()
    with pytest.raises(Exception, match="frozen"):
        settings.__setattr__(next(iter(cls.model_fields), "x"), None)


def _run(cfg: RunConfig) -> tuple[str, dict[str, torch.Tensor], int]:
    """A whole federation over MemoryBus: the final model's sha256 and state, and the
    number of updates the edges aggregated."""
    fed, bus, summaries = synthetic_federation(cfg)
    fed.start()
    assert bus.run(lambda: fed.cloud.done)
    cloud = fed.cloud
    if cloud.final is not None:  # a one-shot algorithm's product is what it trained
        return (
            model_digest(cloud.final.model),
            dict(cloud.final.model),
            sum(s.updates for s in summaries),
        )
    return cloud.model_sha, dict(cloud.model), sum(s.updates for s in summaries)


@pytest.mark.parametrize("name", NAMES)
def test_the_same_seed_gives_the_same_model_on_memorybus(name: str) -> None:
    cfg = contract_config(name)
    initial = dict(build_net(cfg.model.preset, seed=cfg.run.seed).state_dict())
    sha, final, updates = _run(cfg)
    assert updates == cfg.run.rounds * cfg.federation.num_devices
    assert all(torch.isfinite(v).all() for v in final.values())
    algo = build_algorithm(cfg)
    # without uploads (Local-only) the global model never changes, by design; a product the
    # cloud makes is a new model (FedDEO's classifier), its generator frozen
    if algo.traffic.uplink != "none" and algo.finalizer is None:
        assert any(k not in final or not torch.equal(final[k], v) for k, v in initial.items())
    again, _, _ = _run(cfg)
    assert again == sha


def _update(tensors: dict[str, torch.Tensor], i: int) -> Update:
    # every class held (an upload may describe only the classes its device registered)
    counts = tuple(int(c) for c in np.random.default_rng(i).integers(1, 20, NUM_CLASSES))
    return Update(f"dev{i:03d}", tensors, n_samples=sum(counts) or 1, label_counts=counts)


def _zeros(spec: dict[str, TensorSpec]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(s.shape, dtype=s.dtype) for k, s in spec.items()}


Aggregate = Callable[[list[Update], dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def _edge(algo: Method) -> Aggregate:
    """The edge's aggregation of a round's updates, through the interface's fold."""
    return lambda updates, current: fold_all(algo.aggregation.edge_fold(current), updates)


def _cloud(algo: Method) -> Aggregate:
    """The cloud's aggregation of the edges' states, through the interface's fold."""
    return lambda updates, current: fold_all(algo.aggregation.cloud_fold(current), updates)


def _specs(algo: Method, preset: str) -> tuple[dict[str, TensorSpec], dict[str, TensorSpec]]:
    mspec = model_spec(preset, None)
    return mspec, algo.format.global_spec(mspec)


def _draw(spec: dict[str, TensorSpec], gen: torch.Generator, fill: float | None) -> dict[str, Any]:
    """Tensors of ``spec``: ``fill`` everywhere (or uniform draws in [0, 1)); bit-packed
    entries get bits (all ones for a fill, random otherwise) with zero padding."""
    out: dict[str, Any] = {}
    for k, s in spec.items():
        if s.bits is not None:
            bits = (
                torch.ones(s.bits)
                if fill is not None
                else torch.randint(0, 2, (s.bits,), generator=gen)
            )
            out[k] = pack_bits(bits)
        else:
            out[k] = (
                torch.full(s.shape, fill)
                if fill is not None
                else torch.rand(s.shape, generator=gen)
            )
    return out


def _averaged(
    tensors: dict[str, Any],
    spec: dict[str, TensorSpec],
    gspec: dict[str, TensorSpec],
    averaged: set[str],
) -> dict[str, torch.Tensor]:
    """What an aggregation averages, by global-state name, flat: the float tensors as they
    are; bit-packed masks unpacked, named by the probability they update (PRISM)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        bits = spec[k].bits
        if bits is not None:  # PRISM's masks: the probabilities' tensors in sorted order
            flat = unpack_bits(v, bits).float()
            names = sorted(n for n in averaged if n.startswith("prism.theta/"))
            sizes = [math.prod(gspec[n].shape) for n in names]
            out.update(zip(names, flat.split(sizes), strict=True))
        elif v.is_floating_point() and v.dim() > 0:
            out[k] = v.reshape(-1)
    return out


def _aggregate_of(algo: Method, tier: str, out: dict[str, torch.Tensor], k: str) -> torch.Tensor:
    """The aggregate of ``k`` in the updates' terms, flat (PRISM's cloud maps the mean into
    [eps, 1 - eps]; undone here)."""
    v = out[k].reshape(-1)
    if isinstance(algo.settings, PrismConfig) and tier == "cloud":
        eps = algo.settings.mask_eps
        v = (v - eps) / (1 - 2 * eps)
    return v


@pytest.mark.parametrize("name", NAMES)
def test_aggregation_weights_are_convex(name: str) -> None:
    cfg = contract_config(name)
    if name in AVERAGE_ONLY:
        cfg = with_overrides(cfg, {"algorithm": AVERAGE_ONLY[name]})
    algo = build_algorithm(cfg)
    if algo.traffic.uplink == "none":
        pytest.skip(f"{name} uploads and aggregates nothing (Local-only)")
    if algo.traffic.cloud_sees == "every_upload" and algo.finalizer is not None:
        pytest.skip(f"{name}'s cloud keeps each upload, never averages (tests/test_feddeo.py)")
    mspec, gspec = _specs(algo, cfg.model.preset)
    # what is averaged: the model's tensors, or the probabilities PRISM's state holds in
    # their place (SCAFFOLD's control variate is a sum, not an average)
    averaged = set(mspec) | {k for k in gspec if k.startswith("prism.theta/")}
    gen = torch.Generator().manual_seed(0)
    # devices send their uploads to the edges; edges send the cloud their edge state
    for tier, aggregate, spec in (
        ("edge", _edge(algo), algo.format.upload_spec(gspec)),
        ("cloud", _cloud(algo), gspec),
    ):
        same = _draw(spec, gen, 0.25)
        out = aggregate([_update(same, i) for i in range(3)], _zeros(gspec))
        expect = {k: v for k, v in _averaged(same, spec, gspec, averaged).items() if k in averaged}
        assert expect, "nothing averaged: the check would pass vacuously"
        for k in expect:  # equal updates: the weights sum to one
            assert torch.allclose(_aggregate_of(algo, tier, out, k), expect[k], atol=1e-6), k
        varied = [_draw(spec, gen, None) for _ in range(3)]
        out = aggregate([_update(t, i) for i, t in enumerate(varied)], _zeros(gspec))
        views = [_averaged(t, spec, gspec, averaged) for t in varied]
        for k in expect:  # no weight is negative: every aggregate lies between the updates
            stack = torch.stack([v[k] for v in views])
            got = _aggregate_of(algo, tier, out, k)
            assert (got >= stack.min(0).values - 1e-5).all(), k
            assert (got <= stack.max(0).values + 1e-5).all(), k


def _same_spec(tensors: dict[str, torch.Tensor], spec: dict[str, TensorSpec]) -> bool:
    """Same names, shapes and dtypes (and bit-packed entries pass the codec's check)."""
    check_spec(tensors, spec)
    return {k: (s.shape, s.dtype) for k, s in spec_of(tensors).items()} == {
        k: (s.shape, s.dtype) for k, s in spec.items()
    }


@pytest.mark.parametrize("name", NAMES)
def test_names_and_shapes_are_kept(name: str) -> None:
    cfg = contract_config(name)
    algo = build_algorithm(cfg)
    module = build_net(cfg.model.preset, seed=cfg.run.seed)
    mspec, gspec = _specs(algo, cfg.model.preset)
    state = algo.format.init_global(dict(module.state_dict()))
    assert _same_spec(state, gspec)
    if algo.traffic.uplink == "none":
        pytest.skip(f"{name} uploads nothing (Local-only)")
    data = load_dataset("synthetic", size=8, seed=0)
    ctx = DeviceContext(
        "dev000", to_model_input(data.images), torch.from_numpy(data.labels),
        torch.Generator().manual_seed(0), peers=["dev000", "dev001"],
    )  # fmt: skip
    step = build_algorithm(cfg).device
    step.device_load(ctx, module, state)
    result = step.device_round(ctx, module, 0, upload=True)
    assert result.tensors is not None and result.train.steps == 1
    uspec = algo.format.upload_spec(gspec)
    sent = {k: uspec[k] for k in result.tensors}
    assert _same_spec(result.tensors, sent)
    if algo.traffic.uplink == "state":
        assert set(result.tensors) == set(uspec)
    full = {k: result.tensors.get(k, torch.zeros(s.shape)) for k, s in uspec.items()}
    edge = _edge(algo)([_update(full, 0), _update(full, 1)], state)
    assert _same_spec(edge, gspec)
    assert _same_spec(_cloud(algo)([_update(edge, 0)], state), gspec)
    # the state stands for a whole model (PRISM's probabilities materialize into one)
    assert set(mspec) <= set(algo.format.materialize(state))


@pytest.mark.parametrize("name", NAMES)
def test_a_device_sends_what_its_traffic_declares(name: str) -> None:
    """uplink "none": nothing; "state": every tensor of the upload spec; "parts": some."""
    cfg = contract_config(name)
    algo = build_algorithm(cfg)
    module = build_net(cfg.model.preset, seed=cfg.run.seed)
    state = algo.format.init_global(dict(module.state_dict()))
    data = load_dataset("synthetic", size=8, seed=0)
    ctx = DeviceContext(
        "dev000", to_model_input(data.images), torch.from_numpy(data.labels),
        torch.Generator().manual_seed(0), peers=["dev000", "dev001"],
    )  # fmt: skip
    algo.device.device_load(ctx, module, state)
    sent = algo.device.device_round(ctx, module, 0, upload=True).tensors
    uspec = algo.format.upload_spec(algo.format.global_spec(model_spec(cfg.model.preset, None)))
    if algo.traffic.uplink == "none":
        assert sent is None
        return
    assert sent is not None and set(sent) <= set(uspec) and sent
    if algo.traffic.uplink == "state":
        assert set(sent) == set(uspec)


CAPABLE = [
    name for name in NAMES
    if (lambda m: m.state_view is not None or m.finalizer is not None)(
        build_algorithm(contract_config(name))
    )
]  # fmt: skip


@pytest.mark.parametrize("name", CAPABLE)
def test_each_capability_keeps_its_word(name: str, tmp_path: Path) -> None:
    """After a run: a final step made the product the settings name; a state view's files
    come back as they were written (a save, a load into a fresh cloud, a save again), with
    the same origin."""
    cfg = contract_config(name)
    fed, bus, _ = synthetic_federation(cfg)
    fed.start()
    assert bus.run(lambda: fed.cloud.done)
    algo = fed.cloud.algorithm
    if algo.finalizer is not None:
        assert fed.cloud.final is not None
        assert fed.cloud.final.preset == algo.settings.product_preset(cfg)
    view = algo.state_view
    if view is None:
        return
    for sub in ("first", "again"):
        (tmp_path / sub).mkdir()
    view.save_cloud_state(tmp_path / "first", fed.cloud.round - 1)
    fresh = build_algorithm(cfg).state_view
    assert fresh is not None
    fresh.load_cloud_state(tmp_path / "first", fed.cloud.round - 1)
    fresh.save_cloud_state(tmp_path / "again", fed.cloud.round - 1)
    files = sorted(p.relative_to(tmp_path / "first") for p in (tmp_path / "first").rglob("*"))
    again = sorted(p.relative_to(tmp_path / "again") for p in (tmp_path / "again").rglob("*"))
    assert files == again and bool(files) == view.keeps_files
    for f in files:
        if (tmp_path / "first" / f).is_file():
            assert (tmp_path / "first" / f).read_bytes() == (tmp_path / "again" / f).read_bytes()
    assert fresh.origin() == view.origin()
