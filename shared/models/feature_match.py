"""Frozen Fashion-MNIST feature network for PRISM's feature-matching training loss.

PRISM trains its generator to match the mean and variance of a frozen classifier's features
between generated and real images. That kernel must **not** be the FID extractor
(:class:`shared.evaluation.quality.FeatureNet`, ``fmnist-cnn-v1``): a generator optimised to
match the FID net's own feature statistics could lower FID without producing better images,
and FID would stop being an independent judge. :class:`MatchNet` is therefore a separately
trained network with a different architecture (VGG-style, no batch norm) and a different seed.

Features (:meth:`MatchNet.relu_features`) are the flattened outputs of all five ReLUs, from
low-level edges at 32x32 to object parts at 8x8, concatenated into one vector of
:data:`MATCH_FEATURE_DIM` (106,496) values per image. The ReLUs are not in-place, so the
features are differentiable with respect to the input and the generator can be trained
through them (the network's own parameters stay frozen).

Input images are float tensors ``(N, 1, 32, 32)`` in [-1, 1], the space of
:func:`shared.data.datasets.to_model_input` and of the generators' samples.

The weights are trained by ``python scripts/train_feature_classifier.py --net match`` and
shipped as ``shared/assets/fmnist_match.safetensors`` (plus a ``.json`` sidecar) together with
their sha256, :data:`MATCH_WEIGHTS_SHA256`, which :func:`load_match_extractor` checks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shared.models.assets import load_shipped_net

MATCH_EXTRACTOR_NAME = "fmnist-match-v1"
MATCH_NUM_CLASSES = 10
#: length of :meth:`MatchNet.relu_features`: the five ReLU outputs, flattened
MATCH_FEATURE_DIM = 32 * 32 * 32 * 2 + 64 * 16 * 16 * 2 + 128 * 8 * 8  # 106,496
MATCH_WEIGHTS = Path(__file__).resolve().parents[1] / "assets" / "fmnist_match.safetensors"
MATCH_WEIGHTS_SHA256 = "5a2c6f6798341333cb380ed2e3751176c98250361755811c37d0355570a7c206"
MATCH_RETRAIN_HINT = "Retrain it with `python scripts/train_feature_classifier.py --net match`"


class MatchNet(nn.Module):
    """VGG-style Fashion-MNIST classifier whose ReLU activations serve as matching features.

    Architecture (input ``(N, 1, 32, 32)`` in [-1, 1]; no batch norm, convolutions with
    bias, all 3x3 with padding 1)::

        conv(1->32)   ReLU  conv(32->32) ReLU  maxpool2   -> (N, 32, 16, 16)
        conv(32->64)  ReLU  conv(64->64) ReLU  maxpool2   -> (N, 64, 8, 8)
        conv(64->128) ReLU                     maxpool2   -> (N, 128, 4, 4)
        flatten -> Linear(2048, 10)                       -> logits

    :meth:`relu_features` returns the five ReLU outputs, flattened and concatenated;
    :meth:`forward` returns the class logits.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv1a = nn.Conv2d(1, 32, 3, padding=1)
        self.conv1b = nn.Conv2d(32, 32, 3, padding=1)
        self.conv2a = nn.Conv2d(32, 64, 3, padding=1)
        self.conv2b = nn.Conv2d(64, 64, 3, padding=1)
        self.conv3 = nn.Conv2d(64, 128, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(128 * 4 * 4, MATCH_NUM_CLASSES)

    def init_weights(self, generator: torch.Generator) -> None:
        """Re-initialise every weight from ``generator`` (Kaiming normal, zero biases)."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d | nn.Linear):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu", generator=generator)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def _activations(self, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The five ReLU outputs and the final pooled map ``(N, 128, 4, 4)``."""
        r1 = torch.relu(self.conv1a(x))
        r2 = torch.relu(self.conv1b(r1))
        r3 = torch.relu(self.conv2a(self.pool(r2)))
        r4 = torch.relu(self.conv2b(r3))
        r5 = torch.relu(self.conv3(self.pool(r4)))
        return [r1, r2, r3, r4, r5], self.pool(r5)

    def relu_features(self, x: torch.Tensor) -> torch.Tensor:
        """Features ``(N, MATCH_FEATURE_DIM)`` of images ``(N, 1, 32, 32)`` in [-1, 1].

        The flattened outputs of all five ReLUs, concatenated in network order
        (32x32x32, 32x32x32, 64x16x16, 64x16x16, 128x8x8). Differentiable w.r.t. ``x``.
        """
        acts, _ = self._activations(x)
        return torch.cat([a.flatten(1) for a in acts], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits ``(N, 10)`` of images ``(N, 1, 32, 32)`` in [-1, 1]."""
        _, h = self._activations(x)
        return self.head(h.flatten(1))


def load_match_extractor(
    path: str | Path | None = None, *, expected_sha256: str = MATCH_WEIGHTS_SHA256
) -> MatchNet:
    """The shipped :class:`MatchNet` (eval mode, parameters frozen; gradients still flow
    through it to the input), loaded only when the file's sha256 is ``expected_sha256``,
    built once and shared: do not modify it.

    Raises:
        CodecError: the file is missing, its sha256 differs from ``expected_sha256``, or it
            does not hold exactly MatchNet's tensors.
    """
    return load_shipped_net(
        MatchNet, Path(path) if path is not None else MATCH_WEIGHTS, expected_sha256,
        name=MATCH_EXTRACTOR_NAME, hint=MATCH_RETRAIN_HINT,
        constant="MATCH_WEIGHTS_SHA256 in shared/models/feature_match.py",
    )  # fmt: skip
