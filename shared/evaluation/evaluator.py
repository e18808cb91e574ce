"""Sampling and scoring a global model: sample grids and quality metrics against real images.

Used by ``estuary simulate`` during a run and by ``estuary eval`` on a finished one. Sample
noise comes from CPU generators seeded by the run seed, so the same model gives the same
images on any device (up to the device's float differences). Sampling runs on the device a
caller passes (``compute.device`` for the cloud, ``estuary simulate`` and ``estuary
compare``, ``--device`` for ``estuary eval``; the CPU by default); the sampled model is back
where it was afterwards, and features are extracted on the CPU (a small CNN: cheap, and the
metrics stay comparable with the reference numbers).

The extractor is a Fashion-MNIST classifier on 1-channel images: a 3-channel model trained
on the gray view of a grayscale dataset (``data.gray_to_rgb``) is scored on the mean of its
samples' channels (exactly the gray image when the channels are equal), against the real
images in 1 channel; a model trained on CIFAR-10 is not scored at all
(:func:`check_evaluable`), its sample grids are in colour.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shared import seeds
from shared.config import RunConfig
from shared.data.datasets import from_model_output, load_dataset, load_image_folder, to_model_input
from shared.diffusion.schedule import ddim_sample
from shared.diffusion.training import placed
from shared.errors import ConfigError, DataError
from shared.evaluation import quality, story
from shared.evaluation.report import save_grid
from shared.methods.registry import make_algorithm
from shared.models.classifier import refuse_classifier
from shared.models.oneshot import is_oneshot, latent_dim, latents, recalibrate_bn
from shared.models.plan import ChannelPlan, build_model
from shared.models.presets import image_shape

if TYPE_CHECKING:  # the interface is a floor above: only its type is needed here
    from shared.methods.api import Method


def model_from_state(
    cfg: RunConfig,
    state: dict[str, torch.Tensor],
    plan: ChannelPlan | None = None,
    *,
    algorithm: Method | None = None,
) -> torch.nn.Module:
    """The configured preset (pruned by ``plan`` when given) holding ``state``, in eval mode.
    Tensors the module does not have (an algorithm's extra state, e.g. SCAFFOLD's control
    variate) are ignored; every module tensor must be present. The configured algorithm
    materializes the state first (:meth:`~shared.methods.api.StateFormat.materialize`:
    PRISM's probabilities become the dense weights of one fixed mask). A one-shot
    generator's batch norms then get their running statistics from latents drawn from the
    run seed (:func:`~shared.models.oneshot.recalibrate_bn`), so that the eval-mode module
    maps each latent to one image whatever the batch."""
    model = build_model(cfg.model.preset, plan, seed=cfg.run.seed)
    keys = set(model.state_dict())
    tensors = (algorithm or make_algorithm(cfg)).format.materialize(state)
    model.load_state_dict({k: v for k, v in tensors.items() if k in keys})
    if is_oneshot(model):
        recalibrate_bn(model, cfg.run.seed)
    return model.eval()


def sample_images(
    cfg: RunConfig,
    model: torch.nn.Module,
    n: int,
    *,
    steps: int,
    salt: int = 0,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``n`` DDIM samples in [-1, 1] (on the CPU) from noise seeded by (run seed, salt),
    drawn on the CPU; the model samples on ``device`` (default: where it is) and is back
    where it was on return. A one-shot generator maps ``n`` such latents in one pass each
    (``steps`` unused), in eval mode."""
    refuse_classifier(model, "sampling")
    gen = torch.Generator().manual_seed(seeds.integer("eval.samples", cfg.run.seed, salt=salt))
    if is_oneshot(model):
        return oneshot_sample(model, n, gen, device=device)
    shape = (n, *image_shape(cfg.model.preset))
    with placed(model, device):
        return ddim_sample(model, shape, cfg.diffusion, gen, steps=steps, batch_size=256)


@torch.no_grad()
def oneshot_sample(
    model: torch.nn.Module,
    n: int,
    generator: torch.Generator,
    *,
    device: torch.device | None = None,
    batch_size: int = 256,
) -> torch.Tensor:
    """``n`` images (on the CPU) of a one-shot generator from latents drawn on the CPU from
    ``generator``, in batches on ``device``; the model is back in its mode and place after."""
    was_training = model.training
    model.eval()
    out = []
    try:
        with placed(model, device):
            first = next(model.parameters())
            for lo in range(0, n, batch_size):
                z = latents(min(batch_size, n - lo), latent_dim(model), generator)
                out.append(model(z.to(first.device)).float().cpu())
    finally:
        model.train(was_training)
    return torch.cat(out)


def write_grid(
    cfg: RunConfig, model: torch.nn.Module, path: Path, *, device: torch.device | None = None
) -> Path:
    """Sample ``eval.grid_size`` images (fixed noise) on ``device`` (see
    :func:`sample_images`) and save them as a PNG grid."""
    images = sample_images(
        cfg, model, cfg.eval.grid_size, steps=cfg.eval.sample_steps, salt=1, device=device
    )
    return save_grid(from_model_output(images), path)


def check_evaluable(cfg: RunConfig) -> None:
    """Refuse quality metrics where the Fashion-MNIST feature extractor means nothing: on a
    colour dataset (CIFAR-10)."""
    if cfg.data.channels != 1:
        raise ConfigError(
            f"quality metrics (FID, IS, precision/recall) use {quality.EXTRACTOR_NAME}, the "
            f"features of a Fashion-MNIST classifier, which mean nothing on data.dataset = "
            f"{cfg.data.dataset!r}: set eval.every = 0 (or pass --no-eval); sample grids "
            "(eval.sample_every) still show the model's images"
        )


def reference_images(cfg: RunConfig, split: str = "train", n: int | None = None) -> torch.Tensor:
    """``n`` (default ``eval.num_reference``) real images of ``split``, drawn with a fixed seed,
    in 1 channel (the feature extractor's input, also for a model on the gray view).
    ``eval.reference_dir``, when set, holds them instead (an image folder; this process's
    own, and the only source when devices train on folders of their own)."""
    check_evaluable(cfg)
    if cfg.eval.reference_dir or cfg.data.own_folders:
        if not cfg.eval.reference_dir:
            raise DataError(
                "quality metrics need real images to compare with, and with data.dataset = "
                "'folder' no dataset is shared: give this process a folder of them "
                "(eval.reference_dir, ESTUARY__EVAL__REFERENCE_DIR, or the cloud's "
                "--reference DIR), or turn evaluation off (eval.every = 0, --no-eval)"
            )
        real = load_image_folder(cfg.eval.reference_dir, class_names=cfg.data.class_names)
    else:
        real = load_dataset(
            cfg.data.dataset,
            cfg.data.path,
            split=split,
            size=cfg.data.synthetic_size,
            seed=cfg.run.seed,
            class_names=cfg.data.class_names,
        )
    return to_model_input(real.images[reference_indices(len(real), n or cfg.eval.num_reference)])


def reference_indices(size: int, n: int) -> np.ndarray:
    """Which ``n`` of ``size`` real images :func:`reference_images` takes (sorted; all of them,
    in order, when ``n >= size``)."""
    count = min(size, n)
    return np.sort(seeds.rng("eval.reference", None, size=size).choice(size, count, replace=False))


class Evaluator:
    """Scores models against a fixed random set of real training images (features cached).

    The protocol (``eval.num_samples`` generated vs ``eval.num_reference`` real, extractor
    ``fmnist-cnn-v1``) is the one the reference numbers in docs/algorithms.md use; FID is biased by
    sample size, so only compare numbers measured with the same counts.

    Models sample on ``device`` (default: the CPU; callers pass ``compute.device``) and are
    back where they were after :meth:`evaluate`; features are extracted on the CPU.
    """

    def __init__(self, cfg: RunConfig, device: torch.device | None = None) -> None:
        check_evaluable(cfg)
        self.cfg = cfg
        self.device = device if device is not None else torch.device("cpu")
        self.reference = quality.reference_stats(reference_images(cfg))
        #: the classes the starting generator never saw (its recipe's), or None
        self.new_classes = story.new_classes(cfg)

    def evaluate(self, model: torch.nn.Module) -> dict[str, Any]:
        """Quality metrics of ``eval.num_samples`` samples from ``model`` (on :attr:`device`),
        with ``class_shares`` (the share of samples the feature extractor assigns to each
        class) and, when the run starts from a generator that never saw some classes,
        ``new_classes`` and ``new_class_share`` (the share of samples in them)."""
        fake = quality.one_channel(sample_images(
            self.cfg, model, self.cfg.eval.num_samples, steps=self.cfg.eval.sample_steps,
            salt=2, device=self.device,
        ))  # fmt: skip
        out: dict[str, Any] = dict(quality.evaluate(fake, self.reference))
        out["sample_steps"] = 1 if is_oneshot(model) else self.cfg.eval.sample_steps
        shares = story.class_shares(quality.extract(fake)[1])
        out["class_shares"] = [round(s, 4) for s in shares]
        if self.new_classes is not None:
            out["new_classes"] = self.new_classes
            out["new_class_share"] = round(story.new_class_share(shares, self.new_classes), 4)
        return out
