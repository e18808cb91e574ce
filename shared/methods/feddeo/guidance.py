"""Conditioning a class-conditional U-Net on free vectors, and compositional guidance.

A diffusers ``UNet2DModel`` with ``num_class_embeds`` adds ``class_embedding(labels)`` to its
time embedding. FedDEO's descriptions (seed 003) are vectors in that embedding space: a
device's description of class c starts as the class's own row and is trained against the
frozen model. :func:`eps_with_embedding` runs the model with given vectors in place of the
looked-up rows (a forward hook on the embedding replaces its output, so gradients reach the
vectors and nothing in the model changes).

:func:`compose_eps` is eq. 5 of the paper (the weights come from the authors' code):

    eps_hat = eps(x, t, null) + w_t [eps(x, t, T_c) - eps(x, t, null)]
                              + w_d [eps(x, t, d_c) - eps(x, t, null)]

and :func:`guided_ddim` draws images with it, one model call per step on the stacked
conditions. Sampling is DDIM with eta = 0 (deterministic) or eta > 0 (stochastic; eta = 1
is the paper's ancestral sampling, eq. 6), the per-step noise then drawn from a generator
of the image's own: an image depends on its own seed only, so with one seed per image the
first n images of a larger draw are the draw of n.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from shared.config import DiffusionSection
from shared.data.domains import DOMAINS, check_domains
from shared.diffusion.schedule import make_sample_scheduler
from shared.errors import ConfigError
from shared.models.domain_axis import ClassDomainEmbedding
from shared.models.presets import null_class


def class_table(unet: nn.Module) -> torch.Tensor:
    """The U-Net's class prompts (num_class_embeds, D), detached: its class-embedding rows,
    or with a domain axis the rows with the domain unspecified
    (:meth:`~shared.models.domain_axis.ClassDomainEmbedding.prompt_rows`). Refused for a
    model without a class embedding."""
    emb = getattr(unet, "class_embedding", None)
    if not isinstance(emb, nn.Embedding):
        raise ConfigError("this U-Net has no class embedding: descriptions need a "
                          "class-conditional preset (fmnist-tiny-cfg)")  # fmt: skip
    if isinstance(emb, ClassDomainEmbedding):
        return emb.prompt_rows()
    return emb.weight.detach()


def domain_table(unet: nn.Module, domain: str) -> torch.Tensor:
    """The conditioning rows (classes and null, (11, D)) of ``domain`` (a name of
    ``shared.data.domains.DOMAINS``) on a U-Net with a domain axis, detached: what a
    description of that domain could at best be (the Oracle's prompts)."""
    emb = getattr(unet, "class_embedding", None)
    if not isinstance(emb, ClassDomainEmbedding):
        raise ConfigError("conditioning on a domain needs a generator with a domain axis "
                          "(model.preset = 'fmnist-tiny-dom')")  # fmt: skip
    check_domains([domain])
    return emb.rows(1 + DOMAINS.index(domain))


def null_row(unet: nn.Module) -> torch.Tensor:
    """The null class's embedding (D,) of a classifier-free-guidance U-Net."""
    null = null_class(unet)
    if null is None:
        raise ConfigError("guidance needs a null class: use a classifier-free-guidance preset "
                          "(fmnist-tiny-cfg), trained with label dropout")  # fmt: skip
    return class_table(unet)[null]


@contextlib.contextmanager
def _embedding_as(unet: nn.Module, vectors: torch.Tensor) -> Iterator[None]:
    """Within the block, the U-Net's class embedding returns ``vectors`` (B, D)."""
    emb = unet.class_embedding
    if not isinstance(emb, nn.Module):
        raise ConfigError("this U-Net has no class embedding to condition")

    def replace(_m: nn.Module, _inp: object, out: torch.Tensor) -> torch.Tensor:
        if out.shape != vectors.shape:
            raise ValueError(f"{tuple(vectors.shape)} vectors for a batch of {tuple(out.shape)}")
        return vectors.to(out.dtype)

    handle = emb.register_forward_hook(replace)
    try:
        yield
    finally:
        handle.remove()


def eps_with_embedding(
    unet: nn.Module, x: torch.Tensor, t: torch.Tensor | int, vectors: torch.Tensor
) -> torch.Tensor:
    """The U-Net's noise prediction for ``x`` at ``t``, conditioned on ``vectors`` (B, D) in
    its class-embedding space instead of class labels."""
    labels = torch.zeros(len(x), dtype=torch.long, device=x.device)  # replaced by the hook
    with _embedding_as(unet, vectors):
        return unet(x, t, class_labels=labels).sample


def compose_eps(
    eps_null: torch.Tensor,
    eps_conds: Sequence[torch.Tensor],
    weights: Sequence[float],
) -> torch.Tensor:
    """Eq. 5: ``eps_null + sum_k w_k (eps_k - eps_null)``."""
    if len(eps_conds) != len(weights):
        raise ValueError(f"{len(eps_conds)} conditions and {len(weights)} weights")
    out = eps_null.clone()
    for eps, w in zip(eps_conds, weights, strict=True):
        out = out + w * (eps - eps_null)
    return out


@torch.no_grad()
def guided_ddim(
    unet: nn.Module,
    noise: torch.Tensor,
    conditions: Sequence[torch.Tensor],
    weights: Sequence[float],
    cfg: DiffusionSection,
    *,
    steps: int,
    eta: float = 0.0,
    seeds: Sequence[int] | None = None,
    on_step: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Images in [-1, 1] from start ``noise`` (B, C, H, W) with DDIM and eq. 5's guidance:
    ``conditions`` are (B, D) vectors per image (each guided with its weight in
    ``weights``) besides the null class, which is always the first. One model call per step
    on the (1 + K) B stacked inputs. ``on_step`` is called after every step (progress).

    ``eta`` = 0 is deterministic DDIM; ``eta`` = 1 is DDPM-like ancestral sampling (eq. 6)
    on the DDIM time grid. Its fresh noise at every step comes from one generator per image,
    seeded from ``seeds`` (required when ``eta`` > 0), so that an image still depends on its
    own seed only."""
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    if eta > 0 and (seeds is None or len(seeds) != len(noise)):
        raise ValueError("stochastic sampling (eta > 0) needs one seed per image")
    scheduler = make_sample_scheduler(cfg)
    scheduler.set_timesteps(steps)
    device = noise.device
    null = null_row(unet).to(device).expand(len(noise), -1)
    stacked = torch.cat([null, *(c.to(device) for c in conditions)])
    k = 1 + len(conditions)
    gens = [torch.Generator().manual_seed(s ^ 0x5A3D) for s in seeds] if eta > 0 and seeds else []
    was_training = unet.training
    unet.eval()
    x = noise.clone()
    try:
        for t in scheduler.timesteps:
            eps_all = eps_with_embedding(unet, x.repeat(k, 1, 1, 1), t, stacked)
            parts = eps_all.chunk(k)
            eps = compose_eps(parts[0], parts[1:], weights)
            variance = None
            if gens:
                variance = torch.stack([torch.randn(x.shape[1:], generator=g) for g in gens]).to(
                    device
                )
            x = scheduler.step(eps, t, x, eta=eta, variance_noise=variance).prev_sample
            if on_step is not None:
                on_step()
    finally:
        unet.train(was_training)
    return x.clamp(-1, 1)


def domain_grid(
    unet: nn.Module,
    cfg: DiffusionSection,
    *,
    per_class: int = 2,
    weight: float = 3.0,
    steps: int = 25,
    eta: float = 1.0,
    seed: int = 0,
) -> torch.Tensor:
    """Images of a U-Net with a domain axis, one row per domain row (unspecified first, then
    ``DOMAINS``), ``per_class`` images of each of the 10 classes a row, each guided with
    ``weight`` towards its (class, domain) conditioning against the null: (7 x 10 x
    per_class, C, H, W) in [-1, 1]. The same start noise in every row, so a column differs
    only in its domain."""
    emb = getattr(unet, "class_embedding", None)
    if not isinstance(emb, ClassDomainEmbedding):
        raise ConfigError("a domain grid needs a generator with a domain axis")
    conf = getattr(unet, "config", None)
    shape = (int(getattr(conf, "in_channels", 1)), int(getattr(conf, "sample_size", 32)))
    classes = torch.arange(10).repeat_interleave(per_class)
    seeds = [seed * 1000 + j for j in range(len(classes))]
    noise = torch.stack(
        [torch.randn((shape[0], shape[1], shape[1]), generator=torch.Generator().manual_seed(s))
         for s in seeds]
    )  # fmt: skip
    device = next(unet.parameters()).device
    out = []
    for row in range(1 + len(DOMAINS)):
        cond = emb.rows(row)[classes].to(device)
        x = guided_ddim(unet, noise.to(device), [cond], [weight], cfg, steps=steps, eta=eta,
                        seeds=seeds)  # fmt: skip
        out.append(x.cpu())
    return torch.cat(out)
