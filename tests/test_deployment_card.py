"""A deployed model card is checked against the model before a device serves it: bad
scheduler settings, image shapes or class counts are refused with a reason (they used to
pass loading and then fail every sampling call with a raw ONNX Runtime or numpy error), and
a manifest may only name a plain ``*.onnx`` file."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from shared.deploy.export import to_onnx
from shared.deploy.onnx_sampler import OnnxGenerator
from shared.deploy.signing import check_manifest, make_manifest
from shared.errors import EstuaryError, SignatureError
from shared.models.presets import build_unet

# its module-scoped fixtures are built once: every test of the module on one pytest worker
pytestmark = pytest.mark.xdist_group("deployment_card")

GOOD: dict[str, Any] = {
    "image_shape": [1, 32, 32],
    "num_classes": 0,
    "scheduler": {"num_train_timesteps": 1000, "steps_offset": 0},
}


@pytest.fixture(scope="module")
def onnx_model() -> bytes:
    return to_onnx(build_unet("fmnist-tiny", seed=0))


def test_a_good_card_samples(onnx_model: bytes) -> None:
    images, stats = OnnxGenerator(onnx_model, GOOD, provider="cpu").sample(2, steps=2)
    assert images.shape == (2, 1, 32, 32) and np.isfinite(images).all() and stats.n == 2


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"image_shape": ["a", 32, 32]}, "image_shape must be \\[C, H, W\\] of ints"),
        ({"image_shape": [1, 64, 64]}, "does not match the model's sample input"),
        ({"num_classes": "10"}, "num_classes must be an integer"),
        ({"num_classes": 10}, "class_labels input and the card's num_classes differ"),
        ({"scheduler": [1]}, "scheduler must be an object"),
        ({"scheduler": {"num_train_timesteps": "1000"}}, "must be of type int"),
        ({"scheduler": {"num_train_timesteps": 0}}, "num_train_timesteps=0"),
        ({"scheduler": {"steps_offset": 5000}}, "steps_offset=5000 must be in 0..999"),
        ({"scheduler": {"beta_end": 2.0}}, "0 < beta_start <= beta_end < 1"),
        ({"scheduler": {"clip_sample": 1}}, "clip_sample=1 must be of type bool"),
        ({"scheduler": {"clip_sample_range": float("nan")}}, "clip_sample_range=nan"),
    ],
)
def test_bad_cards_are_refused_on_load(
    onnx_model: bytes, change: dict[str, Any], match: str
) -> None:
    with pytest.raises(EstuaryError, match=match):
        OnnxGenerator(onnx_model, {**GOOD, **change}, provider="cpu")


def test_steps_past_the_schedule_and_runtime_errors_are_estuary_errors(
    onnx_model: bytes,
) -> None:
    card = {**GOOD, "scheduler": {"num_train_timesteps": 1000, "steps_offset": 999}}
    gen = OnnxGenerator(onnx_model, card, provider="cpu")
    with pytest.raises(EstuaryError, match="past the schedule's 1000"):
        gen.sample(1, steps=2)
    gen = OnnxGenerator(onnx_model, GOOD, provider="cpu")
    with pytest.raises(EstuaryError, match="ONNX Runtime failed"):
        gen.eps(np.zeros((1, 3, 32, 32), np.float32), np.ones(1, np.int64), None)


@pytest.mark.parametrize(
    "name", ["", "manifest.json", "manifest.sig", "x.onnx\0", "../model.onnx", ".hidden.onnx"]
)
def test_manifest_model_file_must_be_a_plain_onnx_name(name: str) -> None:
    manifest = make_manifest("ab" * 32, 1234, {"name": "m"})
    check_manifest(manifest)
    manifest["model"]["file"] = name
    with pytest.raises(SignatureError, match=r"plain \*\.onnx file name"):
        check_manifest(manifest)
    manifest["model"].update(file="model.onnx", size=True)
    with pytest.raises(SignatureError, match="positive integer"):
        check_manifest(manifest)


@pytest.mark.parametrize(
    "name", ["", "model.onnx", "manifest.json", "../shared.safetensors", "x.safetensors/"]
)
def test_manifest_shared_file_must_be_a_plain_safetensors_name(name: str) -> None:
    shared = {"file": "shared.safetensors", "sha256": "cd" * 32, "size": 10}
    manifest = make_manifest("ab" * 32, 1234, {"name": "m"}, shared=shared)
    check_manifest(manifest)
    manifest["shared"]["file"] = name
    with pytest.raises(SignatureError, match=r"shared.file must be a plain \*\.safetensors"):
        check_manifest(manifest)
    manifest["shared"] = {**shared, "sha256": "no"}
    with pytest.raises(SignatureError, match=r"shared.sha256 is not a sha256"):
        check_manifest(manifest)
    manifest["shared"] = [shared]
    with pytest.raises(SignatureError, match="shared entry is not an object"):
        check_manifest(manifest)
