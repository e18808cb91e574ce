"""The frozen feature-matching network (``shared.models.feature_match``): shipped weights,
hash check, differentiable features, accuracy, and independence from the FID extractor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.errors import CodecError
from shared.evaluation import quality
from shared.models.feature_match import (
    MATCH_EXTRACTOR_NAME,
    MATCH_FEATURE_DIM,
    MATCH_WEIGHTS,
    MATCH_WEIGHTS_SHA256,
    MatchNet,
    load_match_extractor,
)
from shared.wire.codec import file_sha256
from tests.conftest import needs_fmnist


def test_shipped_weights_load_with_checked_hash() -> None:
    assert file_sha256(MATCH_WEIGHTS) == MATCH_WEIGHTS_SHA256
    net = load_match_extractor()
    assert isinstance(net, MatchNet)
    assert not net.training
    assert not any(p.requires_grad for p in net.parameters())
    assert load_match_extractor() is net  # cached per (path, hash)


def test_relu_features_shape_and_gradient() -> None:
    assert MATCH_FEATURE_DIM == 106_496
    net = load_match_extractor()
    x = (
        torch.rand(3, 1, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    ).requires_grad_()
    feats = net.relu_features(x)
    assert feats.shape == (3, MATCH_FEATURE_DIM)
    assert bool((feats >= 0).all())
    assert net(x).shape == (3, 10)
    feats.mean().backward()
    assert x.grad is not None
    assert float(x.grad.abs().sum()) > 0.0


def test_wrong_hash_and_missing_file_raise(tmp_path: Path) -> None:
    data = bytearray(MATCH_WEIGHTS.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad = tmp_path / "tampered.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(CodecError, match="--net match"):
        load_match_extractor(bad)
    with pytest.raises(CodecError, match="sha256"):
        load_match_extractor(MATCH_WEIGHTS, expected_sha256="0" * 64)
    with pytest.raises(CodecError):
        load_match_extractor(tmp_path / "missing.safetensors")


def test_wrong_tensors_raise(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(other))
    with pytest.raises(CodecError, match="tensor names differ"):
        load_match_extractor(other, expected_sha256=file_sha256(other))


def test_independent_of_fid_extractor() -> None:
    assert MATCH_WEIGHTS_SHA256 != quality.FEATURE_WEIGHTS_SHA256
    assert MATCH_EXTRACTOR_NAME != quality.EXTRACTOR_NAME
    assert MATCH_WEIGHTS.resolve() != quality.DEFAULT_WEIGHTS.resolve()


@needs_fmnist
def test_classifies_fashion_mnist() -> None:
    from shared.data.datasets import load_fashion_mnist, to_model_input

    test = load_fashion_mnist("test")
    n = 500
    with torch.no_grad():
        pred = load_match_extractor()(to_model_input(test.images[:n])).argmax(1).numpy()
    acc = float((pred == test.labels[:n]).mean())
    assert acc >= 0.85, acc
