"""FedDEO (Yang et al., ACM MM 2024; seed 003): one-shot federated learning with descriptions.

One round. Every device trains one *description* per class it holds: a vector in the
frozen class-conditional generator's class-embedding space, initialized from the class's own
row (the paper's CLIP text features of the class name) and trained with the noise-prediction
loss (eq. 4) while no weight of the generator changes. It uploads them once, a few hundred
bytes per class. Nothing is averaged: each edge checks the uploads it receives and forwards
each one to the cloud (``cloud_sees = "every_upload"``, the path pFedGPA's uploads take), and
the cloud keeps every device's own descriptions (:meth:`FedDEO.collect`).

The cloud then (:meth:`FedDEO.finalize`, off its message loop) generates
``images_per_class`` images for every (device, described class) with eq. 5's
compositional guidance (null class + w_t x class row + w_d x description, DDIM, one seed per
image so that a smaller N is a prefix of a larger one), trains a fresh classifier on that
synthetic set only, scores it on the real test split seen in every device's domain and
writes a grid of each device's images. The classifier is the product: the cloud deploys it.

Descriptions never leave the cloud: the state it publishes (the global blob, checkpoints) is
the frozen generator alone; the descriptions stay in the method's memory and in a file
beside the checkpoint that is never published.

Prompts-Only (``use_descriptions = false``) is the same pipeline without the
descriptions: devices upload only which classes they hold (their mask), and the cloud
generates from the class rows alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from shared import seeds
from shared.atomic import atomic_write
from shared.config import RunConfig
from shared.data.datasets import NUM_CLASSES, from_model_output, save_grid
from shared.data.domains import domain_of
from shared.data.partition import domain_test_sets
from shared.diffusion.training import TrainResult, placed, train_classifier
from shared.errors import ConfigError, MessageError
from shared.evaluation.domains import accuracy_by_domain
from shared.methods.base import (
    Algorithm,
    DeviceContext,
    FinalResult,
    Fold,
    LocalResult,
    TensorDict,
    Update,
    fold_all,
)
from shared.methods.feddeo.config import FedDEOConfig
from shared.methods.feddeo.descriptions import train_descriptions
from shared.methods.feddeo.guidance import (
    class_table,
    domain_table,
    guided_ddim,
)
from shared.models.classifier import build_classifier
from shared.models.domain_axis import UNSPECIFIED
from shared.models.presets import build_unet, state_spec
from shared.naming import device_index, device_name
from shared.settings import AlgorithmConfig
from shared.wire.codec import TensorSpec, decode_tensors, encode_tensors

log = logging.getLogger(__name__)

#: tensor-name prefixes of a device's descriptions (C, D) and of its mask (C,): 1 for each
#: class it describes. A slot in the state is ``<prefix>.<device>``.
DESC = "feddeo.desc"
MASK = "feddeo.mask"
#: the cloud's file of the descriptions, beside the checkpoint (never published)
STATE_FILE = "feddeo_descriptions.safetensors"
#: a description row's norm must stay within this multiple of the largest class prompt's
#: norm in the frozen generator (honest descriptions measured at most 1.32x on the shipped
#: generators: 11.3 against 8.6; anything far larger is no description of an image but an
#: attempt to steer the cloud's guidance)
MAX_DESC_NORM_RATIO = 4.0


def slot(prefix: str, device: str) -> str:
    """The state's tensor name of ``device``'s slot under ``prefix``."""
    return f"{prefix}.{device}"


def image_seed(seed: int, device: int, cls: int, i: int) -> int:
    """The seed of synthetic image ``i`` of (device, class): independent of N and of the
    order of generation, so the first n images of N are the draw of n."""
    return seeds.integer("feddeo.image", seed, device=device, cls=cls, image=i)


def start_noise(seeds: Sequence[int], shape: tuple[int, ...]) -> torch.Tensor:
    """One start noise per seed (each from its own CPU generator)."""
    return torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in seeds]
    )


def guidance_key(w_t: float, w_d: float) -> str:
    """The name of a (w_t, w_d) pair in a report: ``"wt3_wd0"``."""
    return f"wt{w_t:g}_wd{w_d:g}"


def prompt_norm(state: Mapping[str, torch.Tensor]) -> float:
    """The largest norm of a class prompt (a class row, with the domain unspecified on a
    generator with a domain axis) in the frozen generator's ``state``: what a description
    row is bounded relative to."""
    table = state.get("class_embedding.weight")
    if table is None:
        raise ConfigError("feddeo needs a class-conditional U-Net (class_embedding.weight)")
    rows = table[:NUM_CLASSES].float()
    domains = state.get("class_embedding.domain_weight")
    if domains is not None:
        rows = rows + domains[UNSPECIFIED].float()
    return float(rows.norm(dim=1).max())


@dataclass
class Synthetic:
    """The cloud's synthetic training set: images in [-1, 1] (8-bit values), labels, the
    device each image describes and its index i within its (device, class)."""

    images: torch.Tensor
    labels: torch.Tensor
    devices: list[str]
    index: torch.Tensor

    def first(self, n: int) -> Synthetic:
        """The first ``n`` images of every (device, class)."""
        keep = self.index < n
        devices = [d for d, k in zip(self.devices, keep.tolist(), strict=True) if k]
        return Synthetic(self.images[keep], self.labels[keep], devices, self.index[keep])

    def sha256(self) -> str:
        """Digest of the 8-bit images and the labels."""
        h = hashlib.sha256(from_model_output(self.images).tobytes())
        h.update(self.labels.numpy().astype(np.int64).tobytes())
        return h.hexdigest()


def synthesize(
    unet: nn.Module,
    slots: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    cfg: RunConfig,
    *,
    n: int,
    use_descriptions: bool,
    weights: tuple[float, float] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> Synthetic:
    """``n`` images for every (device, class) of ``slots`` (device -> (descriptions, mask);
    the classes with mask 1) with eq. 5: null + w_t x class prompt (+ w_d x the device's
    description when ``use_descriptions``), DDIM with ``sample_steps`` and
    ``sample_eta``, the start noise (and any later noise) of each image from
    :func:`image_seed`. A condition whose weight is 0 is left out (it adds nothing). With
    ``prompt_domain = "device"`` the class prompt is the class in the device's own
    domain (the Oracle control). ``weights`` = (w_t, w_d) in place of the configured ones.
    ``on_progress(done, total)`` counts images after each batch."""
    s = FedDEOConfig.of(cfg)
    table = class_table(unet).float()
    jobs: list[tuple[str, int, int, int]] = []  # (device, its index, class, i)
    prompts: dict[str, torch.Tensor] = {}
    for dev in sorted(slots):
        index = device_index(dev, cfg)
        mask = slots[dev][1]
        prompts[dev] = table
        if s.prompt_domain == "device":
            prompts[dev] = domain_table(unet, domain_of(cfg.data.domains, index)).float()
        for c in range(NUM_CLASSES):
            if mask[c] > 0:
                jobs.extend((dev, index, c, i) for i in range(n))
    conf: Any = unet.config
    shape = (int(conf.in_channels), int(conf.sample_size), int(conf.sample_size))
    w_t, w_d = weights if weights is not None else (s.w_t, s.w_d)
    use_prompt = w_t != 0
    use_desc = use_descriptions and w_d != 0
    ws = [w for w, on in ((w_t, use_prompt), (w_d, use_desc)) if on]
    out: list[torch.Tensor] = []
    device = next(unet.parameters()).device
    batch = s.sample_batch
    for lo in range(0, len(jobs), batch):
        part = jobs[lo : lo + batch]
        seeds = [image_seed(cfg.run.seed, k, c, i) for _, k, c, i in part]
        noise = start_noise(seeds, shape)
        conds = []
        if use_prompt:
            conds.append(torch.stack([prompts[d][c] for d, _, c, _ in part]))
        if use_desc:
            conds.append(torch.stack([slots[d][0][c] for d, _, c, _ in part]).float())
        x = guided_ddim(
            unet, noise.to(device), conds, ws, cfg.diffusion, steps=s.sample_steps,
            eta=s.sample_eta, seeds=seeds,
        ).cpu()  # fmt: skip
        out.append(((x + 1) * 127.5).round() / 127.5 - 1)  # 8-bit images, as a real set
        if on_progress is not None:
            on_progress(min(lo + batch, len(jobs)), len(jobs))
    images = torch.cat(out) if out else torch.zeros((0, *shape))
    return Synthetic(
        images,
        torch.tensor([c for _, _, c, _ in jobs], dtype=torch.long),
        [d for d, _, _, _ in jobs],
        torch.tensor([i for _, _, _, i in jobs], dtype=torch.long),
    )


def fit_classifier(
    data: Synthetic, cfg: RunConfig, *, device: torch.device | None = None
) -> tuple[nn.Module, float]:
    """A fresh ``classifier`` (init from the run's seed) trained with cross-entropy
    on ``data`` only (SGD, momentum 0.9, the ``clf_*`` settings); (model, last loss)."""
    s = FedDEOConfig.of(cfg)
    model = build_classifier(s.classifier, seed=cfg.run.seed)
    train = cfg.train.model_copy(
        update={"optimizer": "sgd", "lr": s.clf_lr, "momentum": 0.9,
                "weight_decay": 5e-4, "batch_size": s.clf_batch,
                "local_epochs": s.clf_epochs, "local_steps": 0, "grad_clip": 0.0}
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seeds.integer("feddeo.classifier", cfg.run.seed))
    loss, _, _ = train_classifier(model, data.images, data.labels, train, gen, device=device)
    return model.eval(), loss


class DescriptionCheck(Fold):
    """An edge's "aggregation" of FedDEO's uploads: each one is checked as it arrives
    against the device's registered label counts and the generator's class prompts (a
    refused one raises :class:`~shared.errors.MessageError`, is counted by its reason and is
    not forwarded to the cloud); the edge's state, the frozen generator, stays as it was."""

    #: the edge keeps each upload to forward it, so it is never read in place from its blob
    streams = False

    def __init__(self, method: FedDEO, current: TensorDict) -> None:
        super().__init__()
        self.method, self.current = method, current
        self.prompt_norm = prompt_norm(current)

    def _add(self, update: Update) -> None:
        problem = self.method.problem(update.source, update.tensors, update.label_counts,
                                      self.prompt_norm)  # fmt: skip
        if problem is not None:
            raise problem

    def result(self) -> TensorDict:
        return self.current


class FedDEO(Algorithm):
    """Descriptions on the devices, forwarded by the edges, generation and a classifier on
    the cloud (:meth:`finalize`)."""

    name = "feddeo"
    config_class: ClassVar[type[AlgorithmConfig]] = FedDEOConfig
    settings: FedDEOConfig
    #: the descriptions are kept beside the cloud's checkpoints
    keeps_files = True

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.finalizer = self
        self.state_view = self
        self.devices = [device_name(i) for i in range(cfg.federation.num_devices)]
        #: the cloud's descriptions once collected: device -> (descriptions, mask)
        self.held: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- shapes -------------------------------------------------------------------------------
    def _dims(self, model_spec: Mapping[str, TensorSpec]) -> tuple[int, int]:
        spec = model_spec.get("class_embedding.weight")
        if spec is None:
            raise ConfigError("feddeo needs a class-conditional U-Net (class_embedding.weight)")
        return NUM_CLASSES, int(spec.shape[1])

    def upload_spec(self, global_spec: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        """A mask of the classes described (C,) and, unless Prompts-Only, their
        descriptions (C, D) in the generator's class-embedding space."""
        c, d = self._dims(global_spec)
        out = {MASK: TensorSpec((c,), torch.float32)}
        if self.settings.use_descriptions:
            out[DESC] = TensorSpec((c, d), torch.float32)
        return out

    # -- device -------------------------------------------------------------------------------
    def device_round(
        self, ctx: DeviceContext, model: nn.Module, round_: int, *, upload: bool
    ) -> LocalResult:
        s = self.settings
        if not s.use_descriptions:  # Prompts-Only: which classes it holds, nothing else
            counts = torch.bincount(ctx.labels.long(), minlength=NUM_CLASSES)[:NUM_CLASSES]
            mask = (counts >= s.min_class_images).float()
            return LocalResult({MASK: mask} if upload else None, TrainResult(0.0, 0, 0.0))
        report: dict[str, Any] = {}
        desc, mask, result = train_descriptions(
            model, ctx.data, ctx.labels, s, self.scheduler, ctx.generator,
            device=self.training_device, report=report,
        )  # fmt: skip
        if "heldout_loss" in report:
            log.info("feddeo: %s chose description lr %g (held-out eq. 4 loss by lr: %s)",
                     ctx.device, report["lr"], report["heldout_loss"])  # fmt: skip
        ctx.state[DESC] = desc.clone()  # the device's own, kept where it was made
        return LocalResult({DESC: desc, MASK: mask} if upload else None, result)

    # -- edge and cloud -----------------------------------------------------------------------
    def problem(
        self,
        source: str,
        tensors: Mapping[str, torch.Tensor],
        label_counts: Sequence[int] | None,
        prompt_norm: float,
    ) -> MessageError | None:
        """Why ``source``'s upload cannot be used (None: it can): it must come from a device
        of the federation, describe at least one class, only classes its registered
        ``label_counts`` hold ``min_class_images`` images of, and every description row
        within :data:`MAX_DESC_NORM_RATIO` x ``prompt_norm`` (:func:`prompt_norm`)."""
        if source not in self.devices:
            return MessageError("unknown_device", f"{source} is not a device of this federation")
        mask = tensors.get(MASK)
        if mask is None or not bool(((mask == 0) | (mask == 1)).all()):
            return MessageError("bad_description", f"{source}: mask entries must be 0 or 1")
        described = [c for c in range(NUM_CLASSES) if mask[c] > 0]
        if not described:
            return MessageError("describes_nothing", f"{source}: its mask names no class")
        counts = list(label_counts or [])
        held = [c for c in range(min(len(counts), NUM_CLASSES))
                if counts[c] >= self.settings.min_class_images]  # fmt: skip
        unheld = sorted(set(described) - set(held))
        if unheld:
            return MessageError(
                "class_not_registered",
                f"{source} describes classes {unheld} it did not register "
                f"{self.settings.min_class_images}+ images of (it holds {held})",
            )
        desc = tensors.get(DESC)
        if desc is not None:
            limit = MAX_DESC_NORM_RATIO * prompt_norm
            norm = float(desc.float().norm(dim=1).max())
            if not norm <= limit:
                return MessageError(
                    "bad_description",
                    f"{source}: a description row of norm {norm:.4g}, over {limit:.4g} "
                    f"({MAX_DESC_NORM_RATIO:g} x the largest class prompt's {prompt_norm:.4g})",
                )
        return None

    def edge_fold(self, current: TensorDict) -> Fold:
        """Each upload checked (:class:`DescriptionCheck`); the generator unchanged."""
        return DescriptionCheck(self, current)

    def edge_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        return fold_all(self.edge_fold(current), updates)

    def cloud_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        """The generator stays the cloud's (the descriptions come forwarded)."""
        return current

    def collect(
        self,
        round_: int,
        uploads: Mapping[str, TensorDict],
        state: TensorDict,
        label_counts: Mapping[str, Sequence[int]],
    ) -> dict[str, MessageError]:
        """Keep each device's own descriptions and mask, checked again against its
        registered ``label_counts`` and the generator ``state`` (a forwarded upload is the
        edge's word); a Prompts-Only device's descriptions are the zeros nothing reads.
        Returns the refused ones (device -> why)."""
        c, d = self._dims(state_spec(self.cfg.model.preset))
        norm = prompt_norm(state)
        refused: dict[str, MessageError] = {}
        for dev, tensors in sorted(uploads.items()):
            problem = self.problem(dev, tensors, label_counts.get(dev), norm)
            if problem is not None:
                refused[dev] = problem
                continue
            mask = tensors[MASK].float().clone()
            desc = tensors[DESC].float().clone() if DESC in tensors else torch.zeros(c, d)
            self.held[dev] = (desc, mask)
        return refused

    # -- the cloud's own file (beside its checkpoints; never exported or published) ------
    def origin(self) -> str | None:
        """Nothing but ``model.init``: the first state is the frozen generator."""
        return None

    def card_entry(self, module: nn.Module) -> dict[str, Any]:
        """Nothing: the product's card carries the final step's report."""
        return {}

    def save_cloud_state(self, directory: Path, round_: int) -> None:
        """The descriptions, beside the checkpoint (never published)."""
        tensors: dict[str, torch.Tensor] = {}
        for dev, (desc, mask) in sorted(self.held.items()):
            tensors[slot(DESC, dev)], tensors[slot(MASK, dev)] = desc, mask
        atomic_write(directory / STATE_FILE, encode_tensors(tensors))

    def load_cloud_state(self, directory: Path, round_: int) -> None:
        path = directory / STATE_FILE
        if not path.exists():
            return
        tensors = decode_tensors(path.read_bytes())
        self.held = {
            dev: (tensors[slot(DESC, dev)], tensors[slot(MASK, dev)])
            for dev in self.devices if slot(MASK, dev) in tensors
        }  # fmt: skip

    # -- the cloud's one-shot step ---------------------------------------------------------------
    def finalize(
        self,
        state: TensorDict,
        out_dir: Path | None,
        *,
        on_progress: Callable[[str, int, int], None] | None = None,
    ) -> FinalResult:
        """Generate the synthetic set from the held descriptions, train the classifier on
        it, score it on every domain's real test split; grids in ``out_dir``."""
        s, cfg = self.settings, self.cfg
        if not self.held:
            raise ConfigError("feddeo: no device's upload reached the cloud; nothing to generate")
        unet = build_unet(cfg.model.preset)
        unet.load_state_dict(state)
        unet.eval()
        device = self.training_device
        t0 = time.perf_counter()

        def progress(phase: str) -> Callable[[int, int], None]:
            def call(done: int, total: int) -> None:
                if on_progress is not None:
                    on_progress(phase, done, total)

            return call

        with placed(unet, device):
            synthetic = synthesize(
                unet, self.held, cfg, n=s.images_per_class,
                use_descriptions=s.use_descriptions, on_progress=progress("generating"),
            )  # fmt: skip
        gen_s = time.perf_counter() - t0
        tests = domain_test_sets(cfg)
        by_n: dict[str, dict[str, float]] = {}
        model: nn.Module | None = None
        t1 = time.perf_counter()
        sizes = sorted({*s.eval_n, s.images_per_class})
        for k, n in enumerate(sizes):
            clf, _ = fit_classifier(synthetic.first(n), cfg, device=device)
            by_n[str(n)] = accuracy_by_domain(clf, tests)
            progress("training classifiers")(k + 1, len(sizes))
            if n == s.images_per_class:
                model = clf
        assert model is not None
        by_guidance: dict[str, dict[str, float]] = {}
        for w_t, w_d in s.eval_guidance:
            key = guidance_key(w_t, w_d)
            with placed(unet, device):
                other = synthesize(
                    unet, self.held, cfg, n=s.images_per_class,
                    use_descriptions=s.use_descriptions, weights=(w_t, w_d),
                    on_progress=progress(f"generating {key}"),
                )  # fmt: skip
            clf, _ = fit_classifier(other, cfg, device=device)
            by_guidance[key] = accuracy_by_domain(clf, tests)
            if out_dir is not None and s.grid_per_class:
                self._grids(other, out_dir / f"synthetic_{key}")
        train_s = time.perf_counter() - t1
        if out_dir is not None and s.grid_per_class:
            self._grids(synthetic, out_dir / "synthetic")
        final = by_n[str(s.images_per_class)]
        report = {
            "accuracy": {k: v for k, v in final.items() if k != "mean"},
            "mean_accuracy": final["mean"],
            "accuracy_by_n": by_n,
            "accuracy_by_guidance": by_guidance,
            "domains": list(tests),
            "synthetic_images": len(synthetic.labels),
            "synthetic_sha256": synthetic.sha256(),
            "described": {d: int(m.sum()) for d, (_, m) in sorted(self.held.items())},
            "use_descriptions": s.use_descriptions,
            "w_t": s.w_t,
            "w_d": s.w_d if s.use_descriptions else 0.0,
            "images_per_class": s.images_per_class,
            "sample_steps": s.sample_steps,
            "sample_eta": s.sample_eta,
            "prompt_domain": s.prompt_domain,
            "classifier": s.classifier,
            "generate_s": round(gen_s, 1),
            "classifier_s": round(train_s, 1),
        }
        if out_dir is not None:
            atomic_write(out_dir / "feddeo.json", json.dumps(report, indent=2).encode())
        log.info("feddeo: %d synthetic images in %.0fs; classifier mean accuracy %.4f over %s",
                 len(synthetic.labels), gen_s, final["mean"], list(tests))  # fmt: skip
        state_dict = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return FinalResult(state_dict, s.classifier, report)

    def _grids(self, data: Synthetic, directory: Path) -> None:
        """One PNG per device: ``grid_per_class`` images of each class it described."""
        per = self.settings.grid_per_class
        devices = np.array(data.devices)
        for dev in sorted(set(data.devices)):
            sel = np.flatnonzero((devices == dev) & (data.index.numpy() < per))
            if len(sel):
                save_grid(from_model_output(data.images[sel]), directory / f"{dev}.png")
