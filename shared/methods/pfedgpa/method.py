"""pFedGPA (Lai et al., AAAI 2025; seed 004): generative parameter aggregation for
personalized federated learning.

Devices train a small classifier with cross-entropy (the paper's LocalUpdate, Alg. 1) and
upload it. The cloud keeps every device's uploads of the last ``store_rounds``
rounds, trains a latent diffusion model over their flattened parameters (a p-diff
autoencoder plus a latent DDPM, :mod:`shared.methods.pfedgpa.param_diffusion`) and sends each device
its own parameters: its upload inverted through the diffusion model (eqs. 11-16), or, as
Table 2's ablation, drawn directly from noise. Between diffusion rounds the devices train
the sample-weighted average, so the store holds FedAvg-FT models, as the paper's "last 20
rounds" implies (docs/algorithms.md lists what the lost appendix leaves open and how each
open reading is a setting here).

The layers the diffusion model generates are ``layers`` (the whole model where a GPU
trains the diffusion model, the last layer on a CPU); the rest of a device's parameters stay
its own upload.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from shared import seeds
from shared.atomic import atomic_write
from shared.config import RunConfig
from shared.diffusion.training import resolve_device
from shared.errors import ConfigError
from shared.methods.aggregation import fedavg
from shared.methods.base import Algorithm, DeviceContext, LocalResult, TensorDict, Update
from shared.methods.pfedgpa.config import PFedGPAConfig
from shared.methods.pfedgpa.param_diffusion import (
    ParamDM,
    ParamDMConfig,
    flatten_params,
    generate,
    guide,
    invert,
    kept_signal,
    train_param_dm,
    unflatten_params,
)
from shared.models.presets import state_spec
from shared.settings import AlgorithmConfig
from shared.wire.codec import decode_tensors, encode_tensors, read_metadata

log = logging.getLogger(__name__)

#: the folder of the cloud's pFedGPA files, beside its checkpoints
STATE_DIR = "pfedgpa"
#: the store's bound in bytes (float32 vectors); the oldest rounds go first beyond it
MAX_STORE_BYTES = 2 << 30


#: what ``layers = ["auto"]`` generates on a CPU: the last layer
CPU_LAYERS = ("fc2",)


def generated_names(preset: str, layers: Sequence[str], device: torch.device) -> list[str]:
    """The parameter names (state-dict order) of ``layers`` (module names; ``*``: all;
    ``auto``: all on a GPU ``device``, :data:`CPU_LAYERS` on a CPU)."""
    names = [k for k, s in state_spec(preset).items() if s.dtype.is_floating_point]
    if list(layers) == ["auto"]:
        layers = ["*"] if device.type == "cuda" else list(CPU_LAYERS)
    if list(layers) == ["*"]:
        return names
    chosen = [k for k in names if k.rsplit(".", 1)[0] in layers]
    unknown = set(layers) - {k.rsplit(".", 1)[0] for k in names}
    if unknown or not chosen:
        modules = sorted({k.rsplit(".", 1)[0] for k in names})
        raise ConfigError(
            f"algorithm.pfedgpa.layers: {sorted(unknown) or list(layers)} are not layers of "
            f"{preset!r}; choose among {modules}, or ['*'] for the whole model"
        )
    return chosen


def dm_seed(seed: int, round_: int, salt: int) -> torch.Generator:
    """A generator of the diffusion step of ``round_`` (``salt`` tells its uses apart)."""
    return torch.Generator().manual_seed(seeds.integer("pfedgpa.dm", seed, round=round_, use=salt))


class PFedGPA(Algorithm):
    """Cloud-side diffusion over client parameters; inversion gives each device its own
    (eqs. 11-16); devices fine-tune and report accuracy before and after (Table 2)."""

    name = "pfedgpa"
    config_class: ClassVar[type[AlgorithmConfig]] = PFedGPAConfig
    settings: PFedGPAConfig

    #: the cloud's files beside its checkpoints (the store and the diffusion model)
    keeps_files = True

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.personalization = self
        self.state_view = self
        s = self.settings
        #: how :meth:`personalize` makes the devices' models (``PersonalModel.mode``)
        self.personal_mode: Literal["inversion", "generation", "guidance"] = s.mode
        self.names = generated_names(cfg.model.preset, s.layers, resolve_device(cfg.compute.device))
        spec = state_spec(cfg.model.preset)
        self.shapes = [tuple(spec[k].shape) for k in self.names]
        #: vectors the store holds at most (:data:`MAX_STORE_BYTES` of float32 vectors)
        self.max_stored = MAX_STORE_BYTES // (4 * sum(math.prod(s) for s in self.shapes))
        #: (round, device) -> the device's upload's generated layers, flattened (cloud only)
        self.store: OrderedDict[tuple[int, str], torch.Tensor] = OrderedDict()
        self.dm: ParamDM | None = None
        self.dm_round: int | None = None
        #: the round of each device's first upload the cloud saw (guidance of newcomers)
        self.first_seen: dict[str, int] = {}
        self.modes: dict[str, Literal["inversion", "generation", "guidance"]] = {}

    @property
    def dm_config(self) -> ParamDMConfig:
        """The diffusion model's settings, from ``[algorithm]``."""
        s = self.settings
        return ParamDMConfig(
            ae_size=s.ae_size, denoiser=s.denoiser, denoiser_width=s.denoiser_width,
            ae_steps=s.ae_steps, dm_steps=s.dm_steps,
            batch_size=s.batch, lr=s.lr, timesteps=s.timesteps,
        )  # fmt: skip

    # -- device -----------------------------------------------------------------------------
    def device_round(
        self, ctx: DeviceContext, model: nn.Module, round_: int, *, upload: bool
    ) -> LocalResult:
        # "before FT": the model received (personal or global); "after FT": after LocalUpdate
        return self.classify_round(ctx, model, upload=upload)

    # -- edge and cloud ---------------------------------------------------------------------
    def edge_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        return fedavg([u.tensors for u in updates], [u.n_samples for u in updates])

    def cloud_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        return fedavg([u.tensors for u in updates], [u.n_samples for u in updates])

    def diffusion_round(self, round_: int) -> bool:
        """Whether the cloud trains the diffusion model after ``round_`` (and personalizes
        the next round): every ``dm_every`` rounds, and always before the last."""
        every = self.settings.dm_every
        before_last = round_ == self.cfg.run.rounds - 2
        return before_last or (every > 0 and (round_ + 1) % every == 0)

    def remember(self, round_: int, uploads: Mapping[str, TensorDict]) -> None:
        """Add round ``round_``'s uploads to the store; drop rounds older than
        ``store_rounds`` (and the oldest beyond :data:`MAX_STORE_BYTES`)."""
        for device, tensors in sorted(uploads.items()):
            self.store[(round_, device)] = flatten_params(tensors, self.names)
        oldest = round_ - self.settings.store_rounds + 1
        for key in [k for k in self.store if k[0] < oldest]:
            del self.store[key]
        while len(self.store) > self.max_stored:
            self.store.popitem(last=False)

    def mode_of(self, device: str) -> Literal["inversion", "generation", "guidance"]:
        return self.modes.get(device, self.personal_mode)

    def personalize(
        self, round_: int, uploads: Mapping[str, TensorDict], state: TensorDict
    ) -> Mapping[str, TensorDict] | None:
        previous = {d: self.store.get((round_ - 1, d)) for d in uploads}
        for d in uploads:
            self.first_seen.setdefault(d, round_)
        self.remember(round_, uploads)
        if not self.diffusion_round(round_):
            return self._guide_newcomers(round_, uploads, previous)
        device = resolve_device(self.cfg.compute.device)
        vectors = torch.stack(list(self.store.values()))
        log.info("pfedgpa: training the diffusion model on %d stored vectors of %d parameters "
                 "(%s) on %s", len(vectors), vectors.shape[1], ", ".join(self.names),
                 device)  # fmt: skip
        t0 = time.perf_counter()
        self.dm = train_param_dm(
            vectors, self.names, self.shapes, self.dm_config,
            dm_seed(self.cfg.run.seed, round_, 1), device=device, progress=_progress,
        )  # fmt: skip
        self.dm_round = round_
        devices = sorted(uploads)
        own = torch.stack([flatten_params(uploads[d], self.names) for d in devices])
        gen = dm_seed(self.cfg.run.seed, round_, 2)
        s = self.settings
        if s.mode == "inversion":
            depth, noise = s.invert_from, s.inversion
            log.info("pfedgpa: inverting from t0 = %d of %d (%s noise), where the chain keeps "
                     "%.3g of each upload", depth, self.dm.betas.shape[0], noise,
                     kept_signal(self.dm.betas, depth))  # fmt: skip
            made = invert(self.dm, own, gen, t0=depth, noise=noise, device=device)
        else:
            made = generate(self.dm, len(devices), gen, device=device)
        log.info("pfedgpa: %s for %d devices after %.1fs (round %d)",
                 self.settings.mode, len(devices), time.perf_counter() - t0,
                 round_ + 1)  # fmt: skip
        self.modes = dict.fromkeys(devices, self.personal_mode)
        return self._splice(uploads, dict(zip(devices, made, strict=True)))

    def _splice(
        self, uploads: Mapping[str, TensorDict], made: Mapping[str, torch.Tensor]
    ) -> dict[str, TensorDict]:
        """Each device's upload with the generated layers replaced by ``made[device]``."""
        return {
            d: {**uploads[d], **unflatten_params(v, self.names, self.shapes)}
            for d, v in made.items()
        }

    def _guide_newcomers(
        self, round_: int, uploads: Mapping[str, TensorDict],
        previous: Mapping[str, torch.Tensor | None],
    ) -> Mapping[str, TensorDict] | None:  # fmt: skip
        """Global guidance (eq. 10) for the devices that joined within the last
        ``guide_rounds`` rounds, once a diffusion model exists: their last two
        uploads steer a short denoising from ``guide_from`` (our reading of Alg. 1's
        lost operators, docs/algorithms.md). None when no device is guided."""
        s = self.settings
        if self.dm is None or not s.guide_rounds:
            return None
        new = [
            d for d in sorted(uploads)
            if round_ - self.first_seen[d] < s.guide_rounds and previous[d] is not None
        ]  # fmt: skip
        if not new:
            return None
        device = resolve_device(self.cfg.compute.device)
        gen = dm_seed(self.cfg.run.seed, round_, 3)
        made = {}
        for d in new:
            prev = previous[d]
            if prev is None:  # excluded above; a narrowing for the type checker
                continue
            made[d] = guide(
                self.dm, prev, flatten_params(uploads[d], self.names), gen,
                omega=s.guide_omega, steps=s.guide_steps,
                start_t=s.guide_from, device=device,
            )  # fmt: skip
        self.modes = dict.fromkeys(made, "guidance")
        log.info("pfedgpa: guided %d new device(s) in round %d", len(made), round_ + 1)
        return self._splice(uploads, made)

    # -- the cloud's own files (beside its checkpoints; never exported or published) ------
    def origin(self) -> str | None:
        """Nothing but ``model.init``: the first state is the initial model."""
        return None

    def card_entry(self, module: nn.Module) -> dict[str, Any]:
        """Nothing: the devices serve their own classifiers, not a card's model."""
        return {}

    def save_cloud_state(self, directory: Path, round_: int) -> None:
        """``pfedgpa/store.safetensors`` (the stored uploads' generated layers, the first
        round each device was seen) and ``pfedgpa/dm.safetensors`` (the last diffusion
        model), each written atomically."""
        folder = directory / STATE_DIR
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {f"{r:07d}/{d}": v for (r, d), v in self.store.items()}
        meta = {
            "round": str(round_),
            "names": json.dumps(self.names),
            "first_seen": json.dumps(self.first_seen, sort_keys=True),
        }
        atomic_write(folder / "store.safetensors", encode_tensors(tensors, meta))
        if self.dm is not None:
            self.dm.save(folder / "dm.safetensors")

    def load_cloud_state(self, directory: Path, round_: int) -> None:
        """The store and diffusion model :meth:`save_cloud_state` wrote, up to ``round_``
        (rounds after it are redone by the resumed run); nothing when there are none."""
        path = directory / STATE_DIR / "store.safetensors"
        if not path.is_file():
            log.warning("pfedgpa: no stored uploads in %s; the store starts empty", path.parent)
            return
        data = path.read_bytes()
        meta = read_metadata(data)
        if json.loads(meta.get("names", "[]")) != self.names:
            raise ConfigError(f"{path} stores other layers than {self.names}")
        tensors = decode_tensors(data)
        self.store = OrderedDict(
            ((int(k.split("/")[0]), k.split("/", 1)[1]), v)
            for k, v in sorted(tensors.items())
            if int(k.split("/")[0]) <= round_
        )
        self.first_seen = {
            d: r for d, r in json.loads(meta.get("first_seen", "{}")).items() if r <= round_
        }
        dm_path = path.parent / "dm.safetensors"
        if dm_path.is_file():
            self.dm = ParamDM.load(dm_path)
        log.info("pfedgpa: restored %d stored uploads%s", len(self.store),
                 " and the diffusion model" if self.dm is not None else "")  # fmt: skip


def _progress(phase: str, step: int, total: int, loss: float) -> None:
    """Log the diffusion model's training every tenth of a phase."""
    if total and (step == total or step % max(1, total // 10) == 0):
        log.info("pfedgpa: %s step %d/%d loss %.5f", phase, step, total, loss)
