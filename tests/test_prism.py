"""PRISM: bit packing, the key and what it derives, the gradient estimators, MADA, the
privacy mechanism and its budget, materialization and export, and a whole federation."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from shared.config import RunConfig, with_overrides
from shared.data.datasets import load_dataset, to_model_input
from shared.errors import CodecError, ConfigError
from shared.evaluation.evaluator import model_from_state
from shared.methods.base import DeviceContext, Update, build_algorithm
from shared.methods.prism.masking import (
    KEY_ENV,
    KEY_FILE_ENV,
    MaskedModule,
    MaskKey,
    bernoulli_mask,
    fan_in,
    frozen_weight,
    generate_key_file,
    initial_scores,
    load_key,
    masked_names,
)
from shared.methods.prism.method import (
    COUNT,
    MASK,
    RELEASES,
    STEP,
    THETA,
    Prism,
    mask_distance,
)
from shared.methods.prism.privacy import (
    dp_epsilon,
    dp_noise_for,
    dp_rounds,
    privatize,
    sensitivity,
)
from shared.models.plan import model_spec
from shared.models.presets import build_unet
from shared.transport.bus import MemoryBus
from shared.wire.codec import (
    Blob,
    TensorSpec,
    decode_tensors,
    encode_tensors,
    pack_bits,
    packed_spec,
    unpack_bits,
)
from tests.conftest import TEST_PRISM_KEY, synthetic_federation, tiny_config


def prism_config(**algorithm: Any) -> RunConfig:
    """Two rounds of 4 devices at 2 edges, two local iterations each."""
    return tiny_config(
        run={"rounds": 2},
        federation={"num_devices": 4, "num_edges": 2},
        data={"synthetic_size": 64},
        train={"batch_size": 4},
        algorithm={"name": "prism", "prism_local_iters": 2, **algorithm},
    )


# -- bit packing ------------------------------------------------------------------------------
def test_packing_round_trips_a_length_that_is_not_a_multiple_of_8() -> None:
    bits = torch.randint(0, 2, (45,), generator=torch.Generator().manual_seed(1))
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.shape == (6,)
    assert torch.equal(unpack_bits(packed, 45), bits.to(torch.uint8))
    # the documented order: element 8j + i is bit i of byte j (numpy's "little")
    ref = np.packbits(bits.numpy().astype(np.uint8), bitorder="little")
    assert packed.numpy().tolist() == ref.tolist()
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 1])).tolist() == [1, 1]
    assert pack_bits(torch.ones(45)).tolist()[-1] == 0b00011111


def test_a_set_padding_bit_is_refused_as_bad_input() -> None:
    packed = pack_bits(torch.ones(45))
    spec = {"m": packed_spec(45)}
    assert torch.equal(decode_tensors(encode_tensors({"m": packed}), expected=spec)["m"], packed)
    bad = packed.clone()
    bad[-1] |= 1 << 6  # bit 46: padding
    with pytest.raises(CodecError, match="padding bit"):
        decode_tensors(encode_tensors({"m": bad}), expected=spec)
    with pytest.raises(CodecError, match="padding bit"):
        unpack_bits(bad, 45)
    with pytest.raises(CodecError, match="6 uint8 bytes"):
        unpack_bits(packed[:5], 45)
    with pytest.raises(ValueError, match="0/1"):
        pack_bits(torch.tensor([0, 2]))


def test_the_edge_rejects_a_malformed_upload_counts_it_and_keeps_aggregating() -> None:
    """A device whose packed masks have the wrong length loses its own contribution only
    (every masked tensor of the U-Net presets is a multiple of 8 weights, so the padding
    check above is the codec's; this is the same rejection path end to end)."""
    cfg = prism_config()
    fed, bus, summaries = synthetic_federation(cfg)
    bad = fed.devices[0]
    honest = bad.algorithm.device_round

    def tampered(ctx: DeviceContext, model: nn.Module, round_: int, *, upload: bool) -> Any:
        result = honest(ctx, model, round_, upload=upload)
        assert result.tensors is not None
        name = next(iter(result.tensors))
        result.tensors[name] = result.tensors[name][:-1]  # one byte short
        return result

    bad.algorithm.device_round = tampered  # type: ignore[method-assign]
    fed.start()
    assert bus.run(lambda: fed.cloud.done)
    assert fed.cloud.round == 2
    assert [s.updates for s in summaries] == [3, 3]
    assert [s.rejected for s in summaries] == [1, 1]
    assert bus.traffic.snapshot()["rejected"], "the rejection was not counted"


# -- the key ------------------------------------------------------------------------------------
def test_the_key_comes_from_the_environment_or_a_file(tmp_path: Path) -> None:
    assert load_key({KEY_ENV: TEST_PRISM_KEY}).secret == bytes.fromhex(TEST_PRISM_KEY)
    path = tmp_path / "prism.key"
    key = generate_key_file(path)
    assert len(key.secret) == 32 and path.stat().st_mode & 0o777 == 0o600
    assert load_key({KEY_FILE_ENV: str(path)}).secret == key.secret
    with pytest.raises(ConfigError, match="never overwritten"):
        generate_key_file(path)
    with pytest.raises(ConfigError, match="estuary keygen"):
        load_key({})
    with pytest.raises(ConfigError, match="128 to"):
        load_key({KEY_ENV: "00" * 15})
    with pytest.raises(ConfigError, match="hex"):
        load_key({KEY_ENV: "not hex at all, not hex at all!!"})
    assert TEST_PRISM_KEY not in repr(key) and key.secret.hex() not in repr(key)


def test_demo_scores_start_a_run_under_the_public_demo_key_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from shared.methods.prism import masking
    from shared.wire.codec import write_asset

    cfg = prism_config(prism_init="demo")
    monkeypatch.setenv(KEY_ENV, masking.DEMO_KEY.secret.hex())
    spec = {k: v for k, v in model_spec(cfg.model.preset, None).items()}
    dense = {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in spec.items()}
    trained = {k: v for k, v in build_algorithm(prism_config()).init_global(dense).items()
               if k.startswith(THETA)}  # fmt: skip
    trained = {k: (v > 0.5).float() * 0.9 + 0.05 for k, v in trained.items()}  # "trained"
    digest = write_asset(tmp_path / "demo.safetensors", trained, {"seed": cfg.run.seed})
    monkeypatch.setattr(masking, "ASSETS", tmp_path)
    monkeypatch.setitem(masking.DEMO_SCORES, cfg.model.preset, ("demo.safetensors", digest))
    state = build_algorithm(cfg).init_global(dense)
    assert all(torch.equal(state[k], trained[k]) for k in trained)
    assert float(state[STEP]) == 0.0
    with pytest.raises(ConfigError, match=r"run\.seed = 0"):
        build_algorithm(with_overrides(cfg, {"run": {"seed": 1}})).init_global(dense)
    monkeypatch.setenv(KEY_ENV, TEST_PRISM_KEY)
    with pytest.raises(ConfigError, match="public demo key"):
        build_algorithm(cfg).init_global(dense)
    monkeypatch.setitem(masking.DEMO_SCORES, cfg.model.preset, ("demo.safetensors", "0" * 64))
    with pytest.raises(ConfigError, match="sha256"):
        build_algorithm(cfg).init_global(dense)
    # a run directory gets the demo key when no key is configured, a fresh one otherwise
    monkeypatch.delenv(KEY_ENV)
    monkeypatch.setenv(KEY_FILE_ENV, "")  # recorded: the key file a run names is undone
    monkeypatch.delenv(KEY_FILE_ENV)
    prepare = build_algorithm(cfg).preparation
    assert prepare is not None
    prepare.prepare(tmp_path / "demo-run", show=True)
    assert load_key().secret == masking.DEMO_KEY.secret
    assert "public demo key" in capsys.readouterr().out
    monkeypatch.delenv(KEY_FILE_ENV)
    prepare = build_algorithm(prism_config()).preparation
    assert prepare is not None
    prepare.prepare(tmp_path / "run", show=False)
    assert load_key().secret != masking.DEMO_KEY.secret


def test_frozen_weights_are_scaled_rademacher_signs_per_layer() -> None:
    key = MaskKey(bytes(range(16)))
    spec = model_spec("fmnist-tiny", None)
    names = masked_names(spec)
    assert len(names) > 20 and all(len(spec[n].shape) >= 2 for n in names)
    for name in names:
        shape = spec[name].shape
        w = frozen_weight(key, 0, name, shape)
        scale = math.sqrt(2.0 / fan_in(shape))
        assert torch.allclose(w.abs(), torch.full(shape, scale)), name
        n = w.numel()
        assert abs(float(torch.sign(w).mean())) < 5 / math.sqrt(n), name  # fair signs
    # the paper's first layer: a transposed convolution's fan_in is its output channels x k^2
    assert math.isclose(math.sqrt(2.0 / fan_in((128, 512, 4, 4))), 0.015625)
    first = names[0]
    w = frozen_weight(key, 0, first, spec[first].shape)
    assert torch.equal(w, frozen_weight(key, 0, first, spec[first].shape))
    assert not torch.equal(w, frozen_weight(MaskKey(bytes(range(1, 17))), 0, first, w.shape))
    assert not torch.equal(w, frozen_weight(key, 1, first, w.shape))  # the run seed counts
    s = initial_scores(key, 0, "big", (200_000,))
    assert abs(float(s.mean())) < 0.01 and abs(float(s.std()) - 1.0) < 0.01
    # independent streams: the scores the downlink reveals say nothing about the signs
    signs = torch.sign(frozen_weight(key, 0, "big", (200_000, 1)).reshape(-1))
    assert abs(float((signs * s).mean())) < 0.01


# -- the gradient -------------------------------------------------------------------------------
@pytest.mark.parametrize("estimator", ["scaled", "identity"])
def test_the_gradient_estimator_on_a_hand_computed_case(estimator: str) -> None:
    """L = sum(W * M) with W = (2, 3, 4): dL/dM = W. theta = sigmoid(s); the scaled
    estimator passes theta * dL/dM to theta, the identity passes dL/dM."""
    s = torch.tensor([0.0, math.log(3.0), -math.log(3.0)], requires_grad=True)
    w = torch.tensor([2.0, 3.0, 4.0])
    u = torch.tensor([0.3, 0.9, 0.1])  # theta = (1/2, 3/4, 1/4): M = (1, 0, 1)
    theta = torch.sigmoid(s)
    m = bernoulli_mask(theta, u, estimator)  # type: ignore[arg-type]
    assert m.tolist() == [1.0, 0.0, 1.0]
    (w * m).sum().backward()
    dsig = [1 / 4, 3 / 16, 3 / 16]  # theta (1 - theta)
    th = [1 / 2, 3 / 4, 1 / 4]
    want = [w[i].item() * dsig[i] * (th[i] if estimator == "scaled" else 1.0) for i in range(3)]
    assert s.grad is not None
    assert torch.allclose(s.grad, torch.tensor(want))
    # by hand, the first entry: 2 x 1/2 x 1/4 = 0.25 (scaled), 2 x 1/4 = 0.5 (identity)
    assert math.isclose(float(s.grad[0]), 0.25 if estimator == "scaled" else 0.5)


def test_one_mask_per_forward_shared_by_the_batch() -> None:
    base = nn.Linear(64, 1, bias=False)
    frozen = {"weight": torch.ones(1, 64)}
    net = MaskedModule(base, frozen, {"weight": torch.zeros(1, 64)}, estimator="scaled", seed=3)
    x = torch.eye(64)  # row i reads weight i: the batch sees the whole mask
    out1, out2 = net(x).reshape(-1), net(x).reshape(-1)
    assert set(out1.tolist()) <= {0.0, 1.0} and 10 < out1.sum() < 54
    assert not torch.equal(out1, out2)  # a fresh mask each forward
    assert [p for p in net.parameters() if p.requires_grad] == list(net.scores)


# -- MADA -----------------------------------------------------------------------------------
def test_mask_distances_by_hand() -> None:
    a = {"x": torch.tensor([1.0, 0.0, 1.0, 1.0])}
    b = {"x": torch.tensor([1.0, 1.0, 0.0, 1.0])}
    assert mask_distance(a, b, "hamming") == 0.5
    assert math.isclose(mask_distance(a, b, "cosine"), 1.0 - 2.0 / 3.0)


def _edge_report(theta: list[float], count: float) -> Update:
    t = {THETA + "w": torch.tensor(theta), COUNT: torch.tensor(count), STEP: torch.tensor(0.0)}
    return Update("edge", t, n_samples=1, label_counts=(1,) + (0,) * 9)


def test_the_cloud_averages_by_mask_counts_maps_into_eps_and_mixes_by_mada() -> None:
    current = {THETA + "w": torch.tensor([0.5, 0.5, 0.5, 0.5]), COUNT: torch.tensor(0.0),
               STEP: torch.tensor(4.0)}  # fmt: skip
    edges = [_edge_report([1.0, 0.0, 1.0, 0.0], 3.0), _edge_report([0.0, 0.0, 1.0, 1.0], 1.0)]
    off = build_algorithm(prism_config(prism_mada=False)).cloud_aggregate(edges, current)
    mean = torch.tensor([0.75, 0.0, 1.0, 0.25])  # (3 x first + 1 x second) / 4
    assert torch.allclose(off[THETA + "w"], 0.01 + 0.98 * mean)
    assert float(off[COUNT]) == 4.0 and float(off[STEP]) == 5.0

    algo = build_algorithm(prism_config(prism_mada_space="prob"))
    assert isinstance(algo, Prism)
    on = algo.cloud_aggregate(edges, current)
    # lambda: Hamming distance of two samples drawn with the documented seed
    rng = np.random.default_rng([algo.cfg.run.seed, 4, 0x4D414441])
    u, v = rng.random(4, dtype=np.float32), rng.random(4, dtype=np.float32)
    new = 0.01 + 0.98 * mean
    lam = float(np.mean((u < 0.5) != (v < new.numpy())))
    assert algo.last_lambda == lam
    assert torch.allclose(on[THETA + "w"], lam * new + (1 - lam) * 0.5)

    score = build_algorithm(prism_config()).cloud_aggregate(edges, current)
    logit = torch.log(new) - torch.log1p(-new)  # the previous scores are 0 (theta = 1/2)
    assert torch.allclose(score[THETA + "w"], torch.sigmoid(lam * logit), atol=1e-6)


def test_mada_lambda_tracks_mask_entropy_not_only_drift() -> None:
    """Even unchanged probabilities of 1/2 give lambda near 1/2 (the notes' caveat)."""
    algo = build_algorithm(prism_config(prism_mada_space="prob"))
    assert isinstance(algo, Prism)
    current = {THETA + "w": torch.full((10_000,), 0.5), COUNT: torch.tensor(1.0),
               STEP: torch.tensor(0.0)}  # fmt: skip
    report = {THETA + "w": torch.full((10_000,), 0.5), COUNT: torch.tensor(1.0),
              STEP: torch.tensor(0.0)}  # fmt: skip
    algo.cloud_aggregate([Update("e", report, 1, (1,) + (0,) * 9)], current)
    assert algo.last_lambda is not None and abs(algo.last_lambda - 0.5) < 0.03


def test_a_fixed_lambda_mixes_by_it_and_the_distance_is_still_measured() -> None:
    current = {THETA + "w": torch.tensor([0.5, 0.5, 0.5, 0.5]), COUNT: torch.tensor(0.0),
               STEP: torch.tensor(4.0)}  # fmt: skip
    edges = [_edge_report([1.0, 0.0, 1.0, 0.0], 3.0), _edge_report([0.0, 0.0, 1.0, 1.0], 1.0)]
    new = 0.01 + 0.98 * torch.tensor([0.75, 0.0, 1.0, 0.25])
    adaptive = build_algorithm(prism_config(prism_mada_space="prob"))
    fixed = build_algorithm(prism_config(prism_mada_space="prob", prism_mada_fixed_lambda=0.35))
    off = build_algorithm(prism_config(prism_mada=False))
    assert isinstance(adaptive, Prism) and isinstance(fixed, Prism) and isinstance(off, Prism)
    adaptive.cloud_aggregate(edges, current)
    out = fixed.cloud_aggregate(edges, current)
    assert torch.allclose(out[THETA + "w"], 0.35 * new + 0.65 * 0.5)
    assert fixed.last_lambda == 0.35 and fixed.last_distance == adaptive.last_lambda
    report = fixed.round_report(0, out)
    assert report["mada_lambda"] == 0.35 and report["mask_distance"] == adaptive.last_lambda
    off.cloud_aggregate(edges, current)  # MADA off: no lambda, the distance measured all the same
    assert off.last_lambda is None and off.last_distance == adaptive.last_lambda
    assert "mada_lambda" not in off.round_report(0, out) and "mask_distance" in off.round_report(
        0, out
    )


def test_the_local_divergence_is_the_devices_mean_expected_hamming_distance() -> None:
    theta = torch.tensor([0.9, 0.1, 0.5, 0.2])
    current = {THETA + "w": theta, COUNT: torch.tensor(0.0), STEP: torch.tensor(0.0)}
    # four devices: three at the first edge, one at the second
    masks = [[1, 0, 1, 0], [1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 1, 1]]
    edges = [
        _edge_report(torch.tensor(masks[:3], dtype=torch.float32).mean(0).tolist(), 3.0),
        _edge_report([float(b) for b in masks[3]], 1.0),
    ]
    algo = build_algorithm(prism_config(prism_mada=False))
    assert isinstance(algo, Prism)
    out = algo.cloud_aggregate(edges, current)
    # E hd(Bern(theta), m) = mean(theta (1 - m) + (1 - theta) m), averaged over the devices
    want = float(np.mean([
        np.mean([t * (1 - b) + (1 - t) * b for t, b in zip(theta.tolist(), m, strict=True)])
        for m in masks
    ]))  # fmt: skip
    assert algo.last_divergence is not None and math.isclose(algo.last_divergence, want,
                                                              rel_tol=1e-6)  # fmt: skip
    assert math.isclose(algo.round_report(0, out)["local_divergence"], want, rel_tol=1e-5)


# -- differential privacy -------------------------------------------------------------------
def test_the_accountant_sets_the_smallest_noise_that_fits_the_budget() -> None:
    z = dp_noise_for(10.0, 1e-5, 80)
    assert dp_epsilon(z, 80, 1e-5) <= 10.0 < dp_epsilon(z * 0.999, 80, 1e-5)
    assert dp_noise_for(1000.0, 1e-5, 80) < z  # a looser budget, less noise
    with pytest.raises(ConfigError, match="at least one release"):
        dp_noise_for(10.0, 1e-5, 0)
    cfg = with_overrides(
        prism_config(prism_dp_calibrate=True, prism_dp_epsilon=10.0, prism_dp_noise=0.0),
        {"run": {"rounds": 4}},
    )
    algo = build_algorithm(cfg)
    assert isinstance(algo, Prism)
    assert algo.dp_noise == dp_noise_for(10.0, 1e-5, 4) and algo.round_limit(4) == 4
    state = {THETA + "w": torch.full((100,), 0.5), COUNT: torch.tensor(1.0),
             STEP: torch.tensor(1.0)}  # fmt: skip
    report = algo.round_report(3, state)
    assert report["dp_noise"] == algo.dp_noise and report["dp_epsilon"] <= 10.0
    assert math.isclose(report["dp_sigma"], algo.dp_noise * 0.8 * 10.0, rel_tol=1e-5)


def test_privatized_probabilities_are_clipped_and_noised() -> None:
    theta = {"w": torch.full((1000,), 0.95)}
    gen = torch.Generator().manual_seed(0)
    out = privatize(theta, noise=0.001, clip=0.1, generator=gen)["w"]
    assert float(out.min()) >= 0.1 and float(out.max()) <= 0.9
    # sigma = z (1 - 2c) sqrt(D) = 0.001 x 0.8 x sqrt(1000): visible noise around 0.9
    assert math.isclose(sensitivity(0.1, 1000), 0.8 * math.sqrt(1000))
    assert float(out.std()) > 0.005 and float((out < 0.9).float().mean()) > 0.3


def _one_device_upload(cfg: RunConfig, seed: int) -> dict[str, torch.Tensor]:
    algo = build_algorithm(cfg)
    module = build_unet(cfg.model.preset, seed=0)
    state = algo.init_global(dict(module.state_dict()))
    for k in state:
        if k.startswith(THETA):
            state[k] = torch.full_like(state[k], 0.97)
    data = load_dataset("synthetic", size=8, seed=0)
    ctx = DeviceContext("dev000", to_model_input(data.images), torch.from_numpy(data.labels),
                        torch.Generator().manual_seed(seed))  # fmt: skip
    algo.device_load(ctx, module, state)
    result = algo.device_round(ctx, module, 0, upload=True)
    assert result.tensors is not None
    spec = algo.upload_spec(algo.global_spec(model_spec(cfg.model.preset, None)))
    out = {}
    for k, v in result.tensors.items():
        bits = spec[k].bits
        out[k] = unpack_bits(v, bits) if bits is not None else v
    return out


def test_the_uploaded_bits_depend_on_the_privacy_noise() -> None:
    cfg = prism_config(prism_local_iters=1)
    plain = _one_device_upload(cfg, 0)
    ones = sum(int(v.sum()) for v in plain.values()) / sum(v.numel() for v in plain.values())
    assert ones > 0.9  # theta near 0.97, one step of training
    noisy_cfg = with_overrides(
        cfg, {"algorithm": {"prism_dp_noise": 0.01, "prism_dp_epsilon": 1e6}}
    )
    noisy, again = _one_device_upload(noisy_cfg, 0), _one_device_upload(noisy_cfg, 1)
    frac = sum(int(v.sum()) for v in noisy.values()) / sum(v.numel() for v in noisy.values())
    # sigma = 0.01 x 0.8 x sqrt(680 992) = 6.6: theta~ is 0.1 or 0.9 by the noise's sign
    assert 0.45 < frac < 0.55
    assert any(not torch.equal(noisy[k], again[k]) for k in noisy)  # another noise draw


def test_the_accountant_and_the_budget() -> None:
    assert dp_epsilon(1.0, 0, 1e-5) == 0.0
    eps = [dp_epsilon(2.0, t, 1e-5) for t in (1, 10, 100)]
    assert eps[0] < eps[1] < eps[2]
    budget = (dp_epsilon(5.0, 2, 1e-5) + dp_epsilon(5.0, 3, 1e-5)) / 2
    assert dp_rounds(5.0, budget, 1e-5, 100) == 2
    assert dp_rounds(5.0, 1e9, 1e-5, 7) == 7


def test_the_run_stops_at_the_privacy_budget_and_devices_refuse_beyond_it() -> None:
    budget = (dp_epsilon(5.0, 2, 1e-5) + dp_epsilon(5.0, 3, 1e-5)) / 2
    cfg = with_overrides(
        prism_config(prism_dp_noise=5.0, prism_dp_epsilon=budget), {"run": {"rounds": 4}}
    )
    fed, bus, summaries = synthetic_federation(cfg)
    fed.start()
    assert bus.run(lambda: fed.cloud.done)
    assert fed.cloud.rounds == 2 and fed.cloud.round == 2 and len(summaries) == 2
    assert summaries[-1].final and not summaries[0].final
    spent = [s.algorithm["dp_epsilon"] for s in summaries]
    assert spent[0] < spent[1] <= budget
    # a device counts its own releases and refuses one past the budget
    device = fed.devices[0]
    assert device.algo_state[RELEASES] == 2
    algo = build_algorithm(cfg)
    module = build_unet(cfg.model.preset, seed=0)
    ctx = DeviceContext("dev000", torch.zeros(4, 1, 28, 28), torch.zeros(4, dtype=torch.long),
                        torch.Generator().manual_seed(0), state={RELEASES: 2})  # fmt: skip
    algo.device_load(ctx, module, fed.cloud.model)
    result = algo.device_round(ctx, module, 2, upload=True)
    assert result.tensors is None and result.train.steps == 0


# -- the secret stays secret ----------------------------------------------------------------
class RecordingBus(MemoryBus):
    """A MemoryBus that keeps every message and blob payload."""

    def __init__(self) -> None:
        super().__init__()
        self.payloads: list[bytes] = []

    def _publish(self, topic: str, payload: bytes, retain: bool) -> None:
        self.payloads.append(payload)
        super()._publish(topic, payload, retain)

    def _put_blob(self, data: Blob) -> str:
        self.payloads.append(bytes(data))
        return super()._put_blob(data)


def test_the_key_is_in_no_config_message_or_log(caplog: pytest.LogCaptureFixture) -> None:
    cfg = prism_config()
    secret = bytes.fromhex(TEST_PRISM_KEY)
    with caplog.at_level(logging.DEBUG):
        fed, bus, _ = synthetic_federation(cfg, RecordingBus())
        fed.start()
        assert bus.run(lambda: fed.cloud.done)
    assert len(bus.payloads) > 20
    for text in (TEST_PRISM_KEY, TEST_PRISM_KEY.upper()):
        assert text not in cfg.to_json() and text not in caplog.text
        assert not any(text.encode() in p for p in bus.payloads)
    assert not any(secret in p for p in bus.payloads)
    assert MaskKey(secret).fingerprint in caplog.text  # the fingerprint may be logged
    other = with_overrides(cfg, {}, source="x")
    assert other.digest() == cfg.digest()  # the key is not an input of the digest


def test_a_role_without_the_key_says_how_to_make_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV)
    algo = build_algorithm(prism_config())
    with pytest.raises(ConfigError, match="ESTUARY_PRISM_KEY_FILE"):
        algo.init_global(dict(build_unet("fmnist-tiny", seed=0).state_dict()))


# -- the final model ------------------------------------------------------------------------
def test_materialize_draws_one_fixed_mask_and_exports_with_parity(tmp_path: Path) -> None:
    from shared.deploy.export import export_module

    cfg = prism_config()
    algo = build_algorithm(cfg)
    state = algo.init_global(dict(build_unet(cfg.model.preset, seed=0).state_dict()))
    dense = algo.materialize(state)
    assert torch.equal(dense["conv_in.weight"], algo.materialize(state)["conv_in.weight"])
    key = load_key()
    w0 = frozen_weight(key, cfg.run.seed, "conv_in.weight", tuple(dense["conv_in.weight"].shape))
    kept = dense["conv_in.weight"] != 0
    assert torch.equal(dense["conv_in.weight"][kept], w0[kept])
    density = float(kept.float().mean())
    assert abs(density - float(state[THETA + "conv_in.weight"].mean())) < 0.1
    stepped = dict(state, **{STEP: torch.tensor(1.0)})
    assert not torch.equal(algo.materialize(stepped)["conv_in.weight"], dense["conv_in.weight"])
    assert all(float(v.abs().sum()) == 0 for k, v in dense.items() if k.endswith(".bias"))
    module = model_from_state(cfg, state)
    assert torch.equal(module.state_dict()["conv_in.weight"], dense["conv_in.weight"])
    result = export_module(cfg, module, None, tmp_path, round_=1, source="test", parity_steps=4)
    card = json.loads((tmp_path / "card.json").read_text())
    assert result.parity.passed and result.parity.worst < 1e-4
    assert card["prism"]["bits_per_weight"] == 1 and card["prism"]["key_fingerprint"] == (
        key.fingerprint
    )
    assert abs(card["prism"]["density"] - density) < 0.05


def test_a_whole_federation_trains_scores_and_uploads_bits() -> None:
    cfg = prism_config()
    fed, bus, summaries = synthetic_federation(cfg)
    start = {k: v.clone() for k, v in fed.cloud.model.items()}
    fed.start()
    assert bus.run(lambda: fed.cloud.done)
    final = fed.cloud.model
    assert float(final[STEP]) == 2.0 and float(final[COUNT]) == 4.0
    assert any(not torch.equal(final[k], start[k]) for k in start if k.startswith(THETA))
    # MADA mixes with the previous scores, which start N(0, 1): in (0, 1), not [eps, 1 - eps]
    assert all(0 < float(v.min()) and float(v.max()) < 1
               for k, v in final.items() if k.startswith(THETA))  # fmt: skip
    assert all(0 < s.algorithm["mada_lambda"] < 1 for s in summaries)
    counts = bus.traffic.snapshot()["bytes"]
    masked = sum(final[k].numel() for k in final if k.startswith(THETA))
    up = counts["received:device_update"]
    # 8 uploads (4 devices x 2 rounds) of one bit per masked weight plus the header
    assert masked / 8 * 8 <= up <= (masked / 8 + 200) * 8
    assert list(build_algorithm(cfg).upload_spec(fed.cloud.spec)) == [MASK]


def test_the_compact_artifact_round_trips_and_a_resume_needs_the_same_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """pack: a checkpoint's deployed mask in 1 bit per weight and the scales (no key);
    unpack: the same dense weights, given the key; another key is refused."""
    from estuary.cli import main as cli
    from estuary.simulate import simulate
    from shared.models.checkpoint import latest_checkpoint_path, load_checkpoint

    cfg = with_overrides(prism_config(), {"run": {"rounds": 1}})
    simulate(cfg, tmp_path / "run", progress=False, evaluate=False)
    compact, dense_out = tmp_path / "m.prism.safetensors", tmp_path / "dense.safetensors"
    assert cli(["prism", "pack", str(tmp_path / "run"), "--out", str(compact)]) == 0
    assert cli(["prism", "unpack", str(compact), "--out", str(dense_out)]) == 0
    path = latest_checkpoint_path(tmp_path / "run" / "checkpoints")
    assert path is not None
    want = build_algorithm(cfg).materialize(load_checkpoint(path).model)
    got = decode_tensors(dense_out.read_bytes())
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    masked = sum(v.numel() for k, v in want.items() if k in masked_names(
        {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in want.items()}))  # fmt: skip
    assert compact.stat().st_size < masked / 8 + 8_000  # 1 bit per weight, plus the header
    assert TEST_PRISM_KEY.encode() not in compact.read_bytes()
    model_from_state(cfg, got)  # a whole model of the preset
    from cloud.main import resume_point
    from shared.errors import EstuaryError

    assert resume_point(cfg, tmp_path / "run") is not None  # the same key resumes
    monkeypatch.setenv(KEY_ENV, "ff" * 16)
    assert cli(["prism", "unpack", str(compact), "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "packed under key" in capsys.readouterr().err
    with pytest.raises(EstuaryError, match="was not trained from prism-key:"):
        resume_point(cfg, tmp_path / "run")  # another key: another model, refused


def test_prism_star_sends_the_output_side_layers_as_probabilities() -> None:
    """alpha = 80: the last 80 % of the layers in depth order upload float32 probabilities
    (averaged as they are, clamped into [0, 1]); the rest upload mask bits."""
    from shared.methods.prism.masking import depth_order, output_side
    from shared.methods.prism.method import PROB

    order = depth_order("fmnist-tiny")
    assert order[-1] == "conv_out.weight" and order.index("conv_in.weight") < 5
    # registration order is not depth: the U-Net registers mid_block after up_blocks
    mid = order.index(next(n for n in order if n.startswith("mid_block")))
    assert mid < order.index(next(n for n in order if n.startswith("up_blocks")))
    late = output_side("fmnist-tiny", 80)
    assert len(late) == round(0.8 * len(order)) and "conv_out.weight" in late
    assert "conv_in.weight" not in late
    cfg = prism_config(prism_alpha=80.0, prism_local_iters=1)
    algo = build_algorithm(cfg)
    gspec = algo.global_spec(model_spec("fmnist-tiny", None))
    uspec = algo.upload_spec(gspec)
    assert {k[len(PROB) :] for k in uspec if k.startswith(PROB)} == late
    assert uspec[MASK].bits == sum(
        math.prod(gspec[THETA + n].shape) for n in order if n not in late
    )
    sent = _one_device_upload(cfg, 0)  # every entry of the spec, decodable
    assert set(sent) == set(uspec)
    current = {k: torch.zeros(s.shape) for k, s in gspec.items()}
    name = "conv_out.weight"
    ups = []
    for i, value in enumerate((0.2, 0.6, 7.0)):  # 7.0: a device's garbage counts as 1
        t = {k: torch.zeros(s.shape) for k, s in uspec.items() if k != MASK}
        t[PROB + name] = torch.full(gspec[THETA + name].shape, value)
        t[MASK] = pack_bits(torch.full((uspec[MASK].bits or 0,), i % 2))
        ups.append(Update(f"d{i}", t, 10, (10,) + (0,) * 9))
    out = algo.edge_aggregate(ups, current)
    assert torch.allclose(out[THETA + name], torch.full_like(out[THETA + name], 0.6))
    first = next(n for n in order if n not in late)
    assert torch.allclose(out[THETA + first], torch.full_like(out[THETA + first], 1 / 3))
