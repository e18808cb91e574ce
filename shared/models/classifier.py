"""Classifier presets: the small CNNs personalized federated learning trains (pFedGPA, seed 004).

``fmnist-cnn`` is the client CNN of FedPAC's code (``models/cnn.py::CNN_FMNIST``), whose
partition, batch size and baselines pFedGPA's Fashion-MNIST setup matches (the paper's
appendix with its own CNNs is lost): conv 1→16 k5, max-pool, conv 16→32 k5 pad 1, max-pool,
fc 800→128, fc 128→10, LeakyReLU, no normalization: 117,066 parameters. Estuary feeds every
model (N, 1, 32, 32) images in [-1, 1] (Fashion-MNIST padded by two pixels); the classifier
crops the padding back off, so it sees the 28x28 images it was designed for.

``fmnist-cnn-small`` is the same network narrowed to conv 1→6, conv 6→12 and fc 300→32:
11,930 parameters, few enough that a diffusion model over *all* of them trains on a CPU
(pFedGPA generates the whole Fashion-MNIST model; FedPAC's CNN is GPU-sized for that).

Classifiers train with cross-entropy
(:func:`shared.diffusion.training.train_classifier`, beside the DDPM loop: plain minibatch SGD
as the paper's LocalUpdate, no gradient clipping unless configured) and are judged by
accuracy on each device's own test split (:func:`accuracy`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shared.errors import ConfigError

#: preset name -> constructor arguments; every preset classifies 10 classes of 1x32x32 images
CLASSIFIER_PRESETS: dict[str, dict[str, Any]] = {
    "fmnist-cnn": {"num_classes": 10, "crop": 2, "channels": (16, 32), "hidden": 128},
    "fmnist-cnn-small": {"num_classes": 10, "crop": 2, "channels": (6, 12), "hidden": 32},
}


class FmnistCNN(nn.Module):
    """FedPAC's ``CNN_FMNIST``: two 5x5 convolutions with max-pooling, two linear layers
    (``channels`` of the convolutions, ``hidden`` units between the linear layers)."""

    def __init__(
        self, num_classes: int = 10, crop: int = 2, channels: tuple[int, int] = (16, 32),
        hidden: int = 128,
    ) -> None:  # fmt: skip
        super().__init__()
        self.num_classes = num_classes
        self.crop = crop
        self.channels = tuple(channels)
        self.hidden = hidden
        self.conv1 = nn.Conv2d(1, channels[0], 5)
        self.conv2 = nn.Conv2d(channels[0], channels[1], 5, padding=1)
        self.fc1 = nn.Linear(channels[1] * 5 * 5, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of (N, 1, 32, 32) images (the padding is cropped to 28x28 first)."""
        if self.crop:
            x = x[..., self.crop : -self.crop, self.crop : -self.crop]
        x = F.max_pool2d(F.leaky_relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.leaky_relu(self.conv2(x)), 2)
        x = F.leaky_relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def build_classifier(preset: str, *, seed: int = 0) -> FmnistCNN:
    """A freshly initialized classifier of ``preset``; the init is drawn from ``seed`` only."""
    if preset not in CLASSIFIER_PRESETS:
        raise ConfigError(
            f"unknown classifier preset {preset!r}; choose one of {sorted(CLASSIFIER_PRESETS)}"
        )
    with torch.random.fork_rng(devices=[]):
        torch.random.manual_seed(seed)  # scoped: the caller's RNG is untouched
        return FmnistCNN(**CLASSIFIER_PRESETS[preset])


def is_classifier(model: nn.Module) -> bool:
    """Whether ``model`` is a classifier (logits of images) rather than a generator."""
    return isinstance(model, FmnistCNN)


def refuse_classifier(model: nn.Module, what: str) -> None:
    """Raise ConfigError when ``model`` is a classifier: ``what`` (sampling, FID, export
    of a generator) is for generators only."""
    if is_classifier(model):
        raise ConfigError(
            f"{what} is for generators, and this model is a classifier ({type(model).__name__}); "
            "classifiers are judged by accuracy (estuary classify, the devices' test splits)"
        )


@torch.no_grad()
def predict(model: nn.Module, images: torch.Tensor, *, batch_size: int = 1000) -> torch.Tensor:
    """Predicted classes of ``images`` (on the model's device, in eval mode; the mode it had
    is restored)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        out = [
            model(images[i : i + batch_size].to(device)).argmax(1).cpu()
            for i in range(0, len(images), batch_size)
        ]
    finally:
        model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of ``images`` the model classifies as ``labels`` (nan for no images)."""
    if len(labels) == 0:
        return float("nan")
    return float((predict(model, images) == labels.cpu()).float().mean())
