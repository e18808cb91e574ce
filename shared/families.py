"""The model families Estuary trains, declared once (torch-free): U-Net generators, one-shot
generators and classifiers, each with its presets and what the rest of the system does with
it. The config validates presets and the methods' model kinds against this table; the model
builders (:mod:`shared.models.presets`) build each family's presets; evaluation, deployment
and the devices read how a family's model is judged and served from it, never from a
preset's name.

- ``quality``: a generator's run is judged by the images it generates (``"fid"``, FID and
  its companions), a classifier's by its accuracy on each device's own test split
  (``"accuracy"``);
- ``deploy_task``: what a device does with a deployed model of the family (``"sample"`` a
  grid, or ``"classify"`` its own images; the signed manifest's task);
- ``served_by``: where a trained model is served: the cloud exports, signs and deploys the
  global model (``"cloud"``), or each device exports and serves the model it fine-tuned last
  (``"devices"``: a classifier run's devices, pFedGPA's and its baselines').
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["unet", "oneshot", "classifier"]


@dataclass(frozen=True)
class ModelFamily:
    """One family of models (module docstring)."""

    kind: Kind
    #: the family in prose, one model and several (error messages)
    name: str
    plural: str
    presets: tuple[str, ...]
    quality: Literal["fid", "accuracy"]
    deploy_task: Literal["sample", "classify"]
    served_by: Literal["cloud", "devices"]


FAMILIES: dict[Kind, ModelFamily] = {
    # diffusers U-Nets (shared.models.presets), trained with the DDPM loss
    "unet": ModelFamily(
        "unet", "a U-Net", "U-Nets",
        ("fmnist-tiny", "fmnist-small", "fmnist-tiny-cond", "fmnist-small-cond",
         "fmnist-tiny-cfg", "fmnist-small-cfg", "fmnist-tiny-dom", "ddpm-cifar10"),
        quality="fid", deploy_task="sample", served_by="cloud",
    ),
    # an image from a latent in one forward pass (shared.models.oneshot), trained with the
    # feature-matching loss instead of the DDPM loss
    "oneshot": ModelFamily(
        "oneshot", "a one-shot generator", "one-shot generators",
        ("resnetg-fmnist-16", "resnetg-fmnist-32", "resnetg-fmnist-64", "resnetg-cifar10-64"),
        quality="fid", deploy_task="sample", served_by="cloud",
    ),
    # small CNNs (shared.models.classifier), trained with cross-entropy
    "classifier": ModelFamily(
        "classifier", "a classifier", "classifiers", ("fmnist-cnn", "fmnist-cnn-small"),
        quality="accuracy", deploy_task="classify", served_by="devices",
    ),
}  # fmt: skip


def family_of(preset: str) -> ModelFamily:
    """The family of ``preset`` (KeyError for an unknown preset)."""
    for family in FAMILIES.values():
        if preset in family.presets:
            return family
    raise KeyError(preset)
