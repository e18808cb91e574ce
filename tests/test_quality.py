"""Tests for shared.evaluation.quality: metric maths on hand-made inputs, and the shipped
extractor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch

from shared.config import RunConfig
from shared.errors import CodecError, DataError
from shared.evaluation import quality
from shared.evaluation.evaluator import Evaluator, sample_images, write_grid
from shared.evaluation.quality import (
    ReferenceStats,
    density_coverage,
    evaluate,
    extract,
    fid,
    frechet_distance,
    inception_score,
    knn_radii,
    load_feature_extractor,
    precision_recall,
)
from shared.models.presets import build_unet
from shared.wire.codec import file_sha256
from tests.conftest import tiny_config

# ------------------------------------------------------------------------------------ FID


def test_fid_of_identical_sets_is_zero() -> None:
    feats = np.random.default_rng(0).normal(size=(400, 16))
    assert fid(feats, feats) == pytest.approx(0.0, abs=1e-8)


def test_fid_of_shifted_set_is_squared_shift() -> None:
    a = np.random.default_rng(1).normal(size=(300, 6))
    shift = np.array([3.0, 4.0, 0.0, 0.0, 0.0, 0.0])  # equal covariances -> FID = |shift|^2
    assert fid(a, a + shift) == pytest.approx(25.0, rel=1e-9)


def test_frechet_distance_closed_form_with_different_covariances() -> None:
    # diag covariances: |mu1 - mu2|^2 + sum (sqrt(s1) - sqrt(s2))^2 = (1 + 4) + (1 + 1) = 7
    got = frechet_distance(
        np.zeros(2), np.diag([1.0, 4.0]), np.array([1.0, 2.0]), np.diag([4.0, 9.0])
    )
    assert got == pytest.approx(7.0, abs=1e-9)


def test_fid_tolerates_singular_covariance() -> None:
    a = np.random.default_rng(2).normal(size=(200, 5))
    a[:, 2] = 0.0  # a dead ReLU unit
    b = a.copy()
    b[:, 0] += 1.0
    assert fid(a, a) == pytest.approx(0.0, abs=1e-5)
    assert fid(a, b) == pytest.approx(1.0, abs=1e-5)


def test_fid_rejects_mismatched_dimensions() -> None:
    with pytest.raises(DataError):
        fid(np.zeros((10, 3)), np.zeros((10, 4)))


# ------------------------------------------------------------------------------ IS


def test_inception_score_of_uniform_one_hot_is_num_classes() -> None:
    probs = np.tile(np.eye(10), (10, 1))  # every split holds each class once
    mean, std = inception_score(probs, splits=10)
    assert mean == pytest.approx(10.0)
    assert std == pytest.approx(0.0, abs=1e-12)
    assert inception_score(np.eye(7), splits=1)[0] == pytest.approx(7.0)


def test_inception_score_of_identical_probs_is_one() -> None:
    probs = np.tile([0.1, 0.2, 0.7], (50, 1))
    mean, std = inception_score(probs, splits=5)
    assert mean == pytest.approx(1.0)
    assert std == pytest.approx(0.0, abs=1e-12)


def test_inception_score_rejects_non_distributions() -> None:
    with pytest.raises(DataError):
        inception_score(np.ones((10, 3)), splits=2)


# --------------------------------------------------------------- precision/recall, D/C


def test_identical_sets_have_full_precision_recall_coverage() -> None:
    pts = np.random.default_rng(3).normal(size=(60, 4))
    assert precision_recall(pts, pts, k=3) == (1.0, 1.0)
    density, coverage = density_coverage(pts, pts, k=5)
    assert coverage == 1.0
    assert density >= 1.0 / 5  # each point at least lies in its own ball


def test_far_apart_sets_score_zero() -> None:
    rng = np.random.default_rng(4)
    real, fake = rng.normal(size=(40, 3)), rng.normal(size=(30, 3)) + 1000.0
    assert precision_recall(real, fake, k=3) == (0.0, 0.0)
    assert density_coverage(real, fake, k=5) == (0.0, 0.0)


def test_hand_computed_line() -> None:
    # real = 0,1,2,3 on a line: every 1-NN radius is 1. fake = 0.5 (inside the balls of 0 and 1)
    # and 10 (outside all); the two fake points' 1-NN radius is 9.5, covering every real point.
    real = np.array([[0.0], [1.0], [2.0], [3.0]])
    fake = np.array([[0.5], [10.0]])
    assert precision_recall(real, fake, k=1) == (0.5, 1.0)
    density, coverage = density_coverage(real, fake, k=1)
    assert density == pytest.approx(2 / (1 * 2))  # fake 0.5 is in 2 balls, 10 in none
    assert coverage == pytest.approx(2 / 4)  # real 0 and 1 have a fake point in their ball


def test_chunked_distances_match_brute_force(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    real, fake = rng.normal(size=(50, 3)), rng.normal(size=(40, 3)) + 0.3
    expected = (precision_recall(real, fake, k=3), density_coverage(real, fake, k=5))
    monkeypatch.setattr(quality, "_DIST_CHUNK", 7)
    assert (precision_recall(real, fake, k=3), density_coverage(real, fake, k=5)) == expected
    d = np.sqrt(((real[:, None] - real[None]) ** 2).sum(-1))
    brute = np.sort(d, axis=1)[:, 3] ** 2  # column 0 is the point itself
    np.testing.assert_allclose(knn_radii(real, [3])[3], brute, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------- shipped extractor


def test_shipped_weights_load_and_match_hash() -> None:
    assert file_sha256(quality.DEFAULT_WEIGHTS) == quality.FEATURE_WEIGHTS_SHA256
    model = load_feature_extractor()
    assert isinstance(model, quality.FeatureNet) and not model.training
    assert load_feature_extractor() is model  # cached
    sidecar = json.loads(quality.DEFAULT_WEIGHTS.with_suffix(".json").read_text())
    assert sidecar["sha256"] == quality.FEATURE_WEIGHTS_SHA256
    assert sidecar["extractor"] == quality.EXTRACTOR_NAME
    assert sidecar["test_accuracy"] >= 0.90


def test_corrupted_weights_are_rejected(tmp_path) -> None:
    data = bytearray(quality.DEFAULT_WEIGHTS.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(CodecError, match="train_feature_classifier"):
        load_feature_extractor(bad)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(bytes(data[:100]))  # hash pinned to the file: fails at decoding
    with pytest.raises(CodecError):
        load_feature_extractor(truncated, expected_sha256=file_sha256(truncated))
    with pytest.raises(CodecError):
        load_feature_extractor(tmp_path / "missing.safetensors")


def _test_images(n: int) -> tuple[torch.Tensor, np.ndarray]:
    from shared.data.datasets import load_fashion_mnist, to_model_input

    try:
        test = load_fashion_mnist("test")
    except DataError as err:
        pytest.skip(f"Fashion-MNIST not available: {err}")
    return to_model_input(test.images[:n]), test.labels[:n]


def test_shipped_extractor_accuracy() -> None:
    images, labels = _test_images(2000)
    feats, probs = extract(images)
    assert feats.shape == (2000, quality.FEATURE_DIM) and feats.dtype == np.float64
    assert probs.shape == (2000, 10)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-9)
    assert (probs.argmax(axis=1) == labels).mean() >= 0.90


def test_evaluate_with_reference_stats(tmp_path) -> None:
    images, _ = _test_images(400)
    ref = quality.reference_stats(images[:200])
    out = evaluate(images[200:], ref)
    assert set(out) == {
        "extractor", "fid", "is_mean", "is_std", "precision", "recall",
        "density", "coverage", "n_fake", "n_real",
    }  # fmt: skip
    assert out["n_fake"] == out["n_real"] == 200
    assert out["extractor"] == quality.EXTRACTOR_NAME
    assert 0.0 <= float(out["precision"]) <= 1.0 and 0.0 <= float(out["coverage"]) <= 1.0
    noise = torch.rand(200, 1, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    assert float(evaluate(noise, ref)["fid"]) > 5 * float(out["fid"])
    assert evaluate(images[200:], images[:200]) == out  # tensor reference gives the same
    ref.save(tmp_path / "ref.npz")
    loaded = ReferenceStats.load(tmp_path / "ref.npz")
    assert evaluate(images[200:], loaded) == out


def test_extract_rejects_bad_shapes() -> None:
    with pytest.raises(DataError):
        extract(torch.zeros(4, 28, 28))
    with pytest.raises(DataError):
        extract(torch.zeros(4, 1, 32, 32, dtype=torch.uint8))


# ------------------------------------------------- evaluation (shared.evaluation.evaluator)


class _FakeEvaluator:
    """Records the device each evaluator is built for; every model scores FID 1."""

    devices: ClassVar[list[torch.device | None]] = []

    def __init__(self, cfg: RunConfig, device: torch.device | None = None) -> None:
        self.devices.append(device)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        return {"fid": 1.0}


def test_evaluation_callers_sample_on_the_compute_device(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run recorder (cloud and simulate: grids and evaluations) samples on
    ``resolve_device(compute.device)``, ``estuary eval`` on ``--device`` ("meta" stands in
    for a GPU)."""
    from cloud.service import RoundSummary
    from estuary.cli import main
    from shared.diffusion import training
    from shared.evaluation import evaluator as evaluation
    from shared.evaluation import recorder
    from shared.models.checkpoint import save_checkpoint
    from shared.transport.telemetry import Traffic

    meta = torch.device("meta")
    resolved: list[str] = []  # the names asked for; every one resolves to "meta"

    def resolve(name: str) -> torch.device:
        resolved.append(name)
        return meta

    monkeypatch.setattr(_FakeEvaluator, "devices", [])
    monkeypatch.setattr(recorder, "resolve_device", resolve)
    monkeypatch.setattr(recorder, "Evaluator", _FakeEvaluator)
    grids: list[torch.device | None] = []

    def write_grid(
        cfg: RunConfig, model: torch.nn.Module, path: Path, *, device: torch.device | None = None
    ) -> Path:
        grids.append(device)
        return path

    monkeypatch.setattr(recorder, "write_grid", write_grid)
    cfg = tiny_config(
        run={"rounds": 1}, eval={"every": 1, "sample_every": 1}, compute={"device": "cpu"}
    )
    rec = recorder.RunRecorder(cfg, tmp_path / "run", Traffic(), evaluate=True)
    rec.model_fn = lambda: torch.nn.Linear(1, 1)
    rec.on_round_end(RoundSummary(0, 1, 1, 0.5, True, "0" * 64, 1.0, 0.1, 0.5, 0))
    assert rec.rows[-1]["quality"] == {"fid": 1.0}
    assert _FakeEvaluator.devices == [meta] and grids == [meta] and resolved == ["cpu"]
    # a run that samples nothing does not look at compute.device (cannot fail on it)
    quiet = tiny_config(eval={"every": 1, "sample_every": 0})
    assert (
        recorder.RunRecorder(quiet, tmp_path / "q", Traffic(), evaluate=False).device.type == "cpu"
    )

    monkeypatch.setattr(training, "resolve_device", resolve)
    monkeypatch.setattr(evaluation, "Evaluator", _FakeEvaluator)
    model = build_unet(cfg.model.preset, seed=0).state_dict()
    save_checkpoint(tmp_path / "done" / "checkpoints", 0, model, cfg)
    assert main(["eval", str(tmp_path / "done"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fid"] == 1.0
    assert _FakeEvaluator.devices == [meta, meta]
    assert resolved == ["cpu", "auto"]  # estuary eval: --device (default auto), not the run's


def test_evaluator_samples_on_the_cpu_by_default() -> None:
    """Without a device the evaluator samples on the CPU; the same images as the model's
    own sampler from the same seeded CPU noise."""
    cfg = tiny_config(eval={"num_samples": 12, "num_reference": 16, "sample_steps": 2})
    assert Evaluator(cfg).device == torch.device("cpu")
    model = build_unet(cfg.model.preset, seed=1)
    images = sample_images(cfg, model, 4, steps=2, salt=3)
    assert images.device.type == "cpu"
    again = sample_images(cfg, model, 4, steps=2, salt=3, device=torch.device("cpu"))
    assert torch.equal(images, again)


@pytest.mark.gpu
def test_evaluator_samples_on_cuda_and_hands_the_model_back_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Samples drawn on the GPU from the same CPU noise score as the CPU's (TF32 off); the
    evaluated model, which callers save next, is on the CPU again afterwards."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    cuda = torch.device("cuda")
    cfg = tiny_config(eval={"num_samples": 16, "num_reference": 32, "sample_steps": 2})
    model = build_unet(cfg.model.preset, seed=1).eval()
    on_cpu, on_gpu = Evaluator(cfg).evaluate(model), Evaluator(cfg, cuda).evaluate(model)
    assert {t.device.type for t in model.state_dict().values()} == {"cpu"}
    for key in ("fid", "is_mean"):
        assert on_gpu[key] == pytest.approx(on_cpu[key], rel=1e-3), key
    want = sample_images(cfg, model, 4, steps=2, salt=1)
    got = sample_images(cfg, model, 4, steps=2, salt=1, device=cuda)
    assert got.device.type == "cpu" and torch.allclose(got, want, atol=1e-2)
    assert write_grid(cfg, model, tmp_path / "grid.png", device=cuda).is_file()
    assert {t.device.type for t in model.state_dict().values()} == {"cpu"}


def test_eval_samples_where_this_host_can(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run trained with compute.device = "cuda" is evaluated on a CPU-only host: ``estuary
    eval`` samples on ``--device`` (default auto), not on the run's compute.device."""
    from estuary.cli import main
    from shared.evaluation import evaluator as evaluation
    from shared.models.checkpoint import save_checkpoint

    monkeypatch.setattr(_FakeEvaluator, "devices", [])
    monkeypatch.setattr(evaluation, "Evaluator", _FakeEvaluator)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = tiny_config(compute={"device": "cuda"})
    save_checkpoint(
        tmp_path / "gpu" / "checkpoints", 0, build_unet(cfg.model.preset).state_dict(), cfg
    )
    assert main(["eval", str(tmp_path / "gpu"), "--json"]) == 0
    assert main(["eval", str(tmp_path / "gpu"), "--json", "--device", "cpu"]) == 0
    assert _FakeEvaluator.devices == [torch.device("cpu")] * 2
    assert json.loads(capsys.readouterr().out.split("\n}\n")[0] + "}")["fid"] == 1.0
    assert main(["eval", str(tmp_path / "gpu"), "--device", "cuda"]) == 2  # said, not a traceback
    assert "torch sees no CUDA device" in capsys.readouterr().err
