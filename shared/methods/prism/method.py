"""PRISM (seed 002, Seo et al., ICLR 2025): federated stochastic masks over a frozen random
generator: the paper's one-shot ResNet generator with its feature-matching loss, or the U-Net
presets with the DDPM loss (paper App. K).

Every role derives the same frozen weights ``W_init`` (Rademacher signs times
``sqrt(2 / fan_in)``) from a secret key (:mod:`shared.methods.prism.masking`). What the roles keep
and send is a probability per masked weight:

- **global / edge state**: ``prism.theta/<weight>`` (float32, the weight's shape),
  ``prism.masks`` (the masks, or samples, behind it) and ``prism.step`` (cloud aggregations
  so far: it seeds MADA's draws and the final mask);
- **device upload**: ``prism.mask``, one bit per masked weight (the tensors in sorted name
  order, each flattened in C order) packed little bit order into one uint8 vector
  (:func:`~shared.wire.codec.pack_bits`); a padding bit set is rejected as bad input.
  PRISM* (``alpha``): the last alpha % of the layers in depth order
  (:func:`~shared.methods.prism.masking.output_side`) send ``prism.prob/<weight>`` (float32
  probabilities) instead, and the mask holds the rest.

Devices turn probabilities into scores ``s = logit(theta)``, train them with Adam
(lr 0.1, betas (0.5, 0.999), 100 iterations by default; the optimizer's state kept across
rounds as the authors' code does), one Bernoulli mask per forward, and upload a mask drawn
from ``sigmoid(s)`` (with differential privacy: from the noised, clipped ``theta``). Edges
average the bits (one per device, or weighted by samples); the cloud averages the edges by
their counts, maps into ``[eps, 1 - eps]`` and applies MADA: ``lambda`` is the distance
between two seeded Bernoulli samples of the previous and the new probabilities (Hamming:
the fraction of differing bits; or one minus their cosine), and the new state is
``lambda * new + (1 - lambda) * previous`` in score space (Alg. 1, the default) or
probability space (eq. 2). PRISM-dagger is MADA off; ``mada_fixed_lambda`` mixes with
a constant instead (a control: MADA's damping without its adaptivity). Every aggregation
records that distance (also with MADA off) and the local divergence of the paper's Fig. 6:
the devices' mean expected Hamming distance between their mask and a mask of the state they
started from, which is linear in the masks, so the cloud gets it exactly from their mean.

Differential privacy (``dp_noise > 0``, or ``dp_calibrate``: the smallest noise
multiplier whose ``run.rounds`` releases fit ``dp_epsilon``): each device clips ``theta`` to
``[c, 1 - c]``, adds ``N(0, sigma^2)`` per weight with ``sigma = z * Delta`` and
``Delta = (1 - 2c) sqrt(D)`` (the L2 sensitivity of the clipped vector of ``D`` masked
weights: any change of the device's data moves each coordinate by at most ``1 - 2c``),
clips again and samples its mask from the result. One round is one Gaussian mechanism per
device; the privacy loss of ``T`` rounds is Opacus's RDP accountant at sampling rate 1
(no amplification is claimed; :mod:`shared.methods.prism.privacy`). The cloud ends the run
before a round would exceed ``dp_epsilon``, and a device refuses to release past it whatever
the cloud says.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from shared import seeds
from shared.config import RunConfig
from shared.diffusion.schedule import ddpm_loss
from shared.diffusion.training import TrainResult, placed, train_local
from shared.errors import ConfigError
from shared.methods.api import Centralized
from shared.methods.base import (
    Algorithm,
    DeviceContext,
    LocalResult,
    TensorDict,
    Update,
    optimizer_state_on_cpu,
)
from shared.methods.prism.config import PrismConfig
from shared.methods.prism.masking import (
    COUNT,
    DEMO_KEY,
    STEP,
    THETA,
    MaskedModule,
    MaskKey,
    final_mask,
    frozen_constant,
    frozen_weight,
    initial_scores,
    is_masked,
    load_demo_scores,
    load_key,
    logit,
    masked_names,
    output_side,
    provide_key_file,
    state_spec,
)
from shared.methods.prism.privacy import dp_epsilon, dp_noise_for, dp_rounds, privatize, sensitivity
from shared.models.plan import model_spec
from shared.settings import AlgorithmConfig
from shared.wire.codec import TensorSpec, check_spec, pack_bits, packed_spec, unpack_bits

log = logging.getLogger(__name__)

#: the device upload: every masked weight's bit, tensors in sorted name order, each
#: flattened in C order, packed little bit order into one uint8 vector (one header, and
#: padding only after the last bit)
MASK = "prism.mask"
#: PRISM*: the probabilities an output-side layer uploads instead of its mask bits
PROB = "prism.prob/"
#: ``DeviceContext.state`` entries: the frozen weights (a cache), the probabilities loaded
#: this round, the score optimizer's state, the rounds this device has released under DP
WINIT, LOADED, ADAM, RELEASES = "prism.winit", "prism.theta", "prism.adam", "prism.releases"
#: the score optimizer's state a round started from (so that a round trained again, after a
#: cloud restart re-announced it, starts from the same moments: the same update)
ADAM_BEFORE = "prism.adam_before"
#: float32 keeps integers exactly up to 2**24
MAX_EXACT = float(2**24)


def mask_distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], kind: str) -> float:
    """Hamming (fraction of differing entries) or cosine distance of two 0/1 masks."""
    if kind == "hamming":
        n = sum(t.numel() for t in a.values())
        return sum(float((a[k] != b[k]).sum()) for k in a) / n
    dot = sum(float((a[k] * b[k]).sum()) for k in a)
    na = math.sqrt(sum(float(a[k].sum()) for k in a))
    nb = math.sqrt(sum(float(b[k].sum()) for k in b))
    return 1.0 - dot / (na * nb) if na and nb else 1.0


class KeyPreparation:
    """PRISM's run preparation: the run's key, a fresh secret one, or the public
    :data:`~shared.methods.prism.masking.DEMO_KEY` for a run that starts from the demo
    scores (``demo``)."""

    def __init__(self, *, demo: bool = False) -> None:
        self.demo = demo

    def prepare(self, run_dir: Path, *, show: bool) -> None:
        """Give the run a key (``run_dir/prism.key``, kept for a resumed run) when none is
        configured, and say where it is (never what it is)."""
        path = provide_key_file(run_dir, key=DEMO_KEY if self.demo else None)
        if path is not None:
            fingerprint = load_key().fingerprint
            log.info("PRISM key: %s (fingerprint %s)", path, fingerprint)
            if show:
                public = " (the public demo key: nothing it trains is secret)" if self.demo else ""
                print(f"PRISM key: {path} (fingerprint {fingerprint}; keep it to resume or "
                      f"deploy){public}")  # fmt: skip


class Prism(Algorithm):
    """Masks over frozen random weights; 1-bit uploads; MADA at the cloud."""

    name = "prism"
    config_class: ClassVar[type[AlgorithmConfig]] = PrismConfig
    device_cache_keys = frozenset({WINIT})
    settings: PrismConfig
    #: the state view keeps no files of its own (the key is never written by the roles)
    keeps_files = False

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.state_view = self  # the state derives from the key (origin, model card)
        self.preparation = KeyPreparation(demo=self.settings.init == "demo")
        self.central = self  # its ceiling trains scores, not weights
        self._key: MaskKey | None = None
        #: the cloud's last MADA lambda (None before the first aggregation, or MADA off)
        self.last_lambda: float | None = None
        #: the distance MADA measures between the previous and the new probabilities at the
        #: cloud's last aggregation (measured with MADA off too; None before the first)
        self.last_distance: float | None = None
        #: the local divergence of the paper's Fig. 6 at the cloud's last aggregation: the
        #: devices' mean expected Hamming distance between their uploaded mask and a mask
        #: of the state they started from (None before the first)
        self.last_divergence: float | None = None

    # -- the key --------------------------------------------------------------------------
    @property
    def key(self) -> MaskKey:
        """The secret key (read once, when a role first needs it: edges never do)."""
        if self._key is None:
            self._key = load_key()
            log.info("PRISM key fingerprint %s", self._key.fingerprint)
        return self._key

    def _model_spec(self) -> dict[str, TensorSpec]:
        return model_spec(self.cfg.model.preset, None)

    # -- shapes of what travels ----------------------------------------------------------
    def global_spec(self, model_spec: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        return state_spec(model_spec)

    def _prob_layers(self) -> frozenset[str]:
        """PRISM*'s output-side layers (empty for PRISM)."""
        alpha = self.settings.alpha
        return output_side(self.cfg.model.preset, alpha) if alpha > 0 else frozenset()

    def upload_spec(self, global_spec: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        probs = self._prob_layers()
        out: dict[str, TensorSpec] = {}
        bits = 0
        for key, s in global_spec.items():
            if not key.startswith(THETA):
                continue
            name = key[len(THETA) :]
            if name in probs:
                out[PROB + name] = TensorSpec(s.shape, torch.float32)
            else:
                bits += math.prod(s.shape)
        if bits:
            out[MASK] = packed_spec(bits)
        return out

    def init_global(self, model: TensorDict) -> TensorDict:
        """The first probabilities: the sigmoid of the key's N(0, 1) scores, or the shipped
        demo scores (``init = "demo"``, checked against the key and the seed)."""
        spec = {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in model.items()}
        seed = self.cfg.run.seed
        out: TensorDict
        if self.settings.init == "demo":
            theta = load_demo_scores(self.cfg.model.preset, self.key, seed)
            want = {k: s for k, s in state_spec(spec).items() if k.startswith(THETA)}
            check_spec({k: v for k, v in theta.items() if k in want}, want)
            out = {k: theta[k].float().clamp(0.0, 1.0) for k in want}
        else:
            out = {
                THETA + n: torch.sigmoid(initial_scores(self.key, seed, n, spec[n].shape))
                for n in masked_names(spec)
            }
        out[COUNT] = torch.zeros((), dtype=torch.float32)
        out[STEP] = torch.zeros((), dtype=torch.float32)
        return out

    def materialize(self, state: TensorDict) -> TensorDict:
        """The dense model of one fixed mask ``M* ~ Bern(theta)`` drawn from the key, the run
        seed and ``prism.step``: ``W_init * M*`` on masked weights, the frozen constants
        elsewhere (a state that is already a model's is returned as it is)."""
        if STEP not in state:
            return state
        spec = self._model_spec()
        gspec = self.global_spec(spec)
        check_spec({k: v for k, v in state.items() if k in gspec}, gspec)
        step, seed = int(state[STEP]), self.cfg.run.seed
        out: TensorDict = {}
        for name, s in spec.items():
            if THETA + name in state:
                theta = state[THETA + name].float()
                mask = final_mask(self.key, seed, step, name, theta)
                out[name] = frozen_weight(self.key, seed, name, s.shape) * mask
            else:
                out[name] = frozen_constant(name, s)
        return out

    def centralized(self, model: nn.Module, seed: int) -> Centralized:
        """PRISM's ceiling on pooled data: the scores of every masked weight (from the key's
        initial scores) trained continuously with the devices' Adam, no clipping and no
        rounds to quantize them; the model after round ``r`` is the dense model of one
        fixed mask drawn from the probabilities (:meth:`materialize` at step ``r + 1``), and
        its checkpoint holds the probabilities, as a federated run's does."""
        st = self.settings
        spec = {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
        key, run_seed = self.key, self.cfg.run.seed
        frozen = {n: frozen_weight(key, run_seed, n, spec[n].shape) for n in masked_names(spec)}
        model.load_state_dict(
            {n: frozen[n] if n in frozen else frozen_constant(n, s) for n, s in spec.items()}
        )
        scores = {n: initial_scores(key, run_seed, n, spec[n].shape) for n in frozen}
        net = MaskedModule(model, frozen, scores, estimator=st.estimator, seed=seed)
        opt = torch.optim.Adam(list(net.scores), lr=st.lr, betas=(st.beta1, st.beta2))

        def state(round_: int) -> TensorDict:
            out: TensorDict = {THETA + n: p for n, p in net.probabilities().items()}
            out[COUNT] = torch.ones((), dtype=torch.float32)
            out[STEP] = torch.tensor(float(round_ + 1), dtype=torch.float32)
            return out

        def dense(round_: int) -> nn.Module:
            out = copy.deepcopy(model)
            out.load_state_dict(self.materialize(state(round_)))
            return out

        train = self.cfg.train.model_copy(update={"grad_clip": 0.0})
        return Centralized(net, opt, train, dense, state)

    def origin(self) -> str:
        return f"prism-key:{self.key.fingerprint}"

    def save_cloud_state(self, directory: Path, round_: int) -> None:
        """Nothing: the state is all there is (the key stays where it was configured)."""

    def load_cloud_state(self, directory: Path, round_: int) -> None:
        """Nothing to take back."""

    def card_entry(self, module: nn.Module) -> dict[str, Any]:
        """Bits per weight of the compact form, the kept fraction of the masked weights
        and the key's fingerprint (the key itself is never written)."""
        weights = {k: v for k, v in module.state_dict().items() if is_masked(k, tuple(v.shape))}
        n = sum(v.numel() for v in weights.values())
        kept = sum(int((v != 0).sum()) for v in weights.values())
        return {
            "masked_weights": n,
            "density": round(kept / n, 6),
            "bits_per_weight": 1,
            "frozen_weights": "Rademacher signs x sqrt(2 / fan_in) from the key",
            "key_fingerprint": self.key.fingerprint,
        }

    @functools.cached_property
    def dp_noise(self) -> float:
        """The noise multiplier z of the devices' releases: ``dp_noise``, or with
        ``dp_calibrate`` the smallest that lets every round fit the budget; 0 = no
        differential privacy."""
        st = self.settings
        if not st.dp_calibrate:
            return st.dp_noise
        z = dp_noise_for(st.dp_epsilon, st.dp_delta, self.cfg.run.rounds)
        log.info("privacy: noise multiplier %g lets %d releases fit epsilon = %g (delta = %g)",
                 z, self.cfg.run.rounds, st.dp_epsilon, st.dp_delta)  # fmt: skip
        return z

    def mask_density(self, state: TensorDict) -> float:
        """Mean probability over every masked weight (the expected kept fraction)."""
        thetas = [v for k, v in state.items() if k.startswith(THETA)]
        return float(sum(float(t.sum()) for t in thetas) / sum(t.numel() for t in thetas))

    def round_report(self, round_: int, state: TensorDict) -> dict[str, float]:
        """Mask density (the mean probability), MADA's last lambda (``mada_lambda``; fixed
        by ``mada_fixed_lambda``), the distance MADA measured (``mask_distance``, also
        with MADA off), the local divergence of the paper's Fig. 6 (``local_divergence``)
        and, with privacy on, the epsilon a device that uploaded in every round so far has
        spent (devices release every round, also between cloud aggregations)."""
        out = {"density": round(self.mask_density(state), 6)}
        if self.last_lambda is not None:
            out["mada_lambda"] = round(self.last_lambda, 6)
        if self.last_distance is not None:
            out["mask_distance"] = round(self.last_distance, 6)
        if self.last_divergence is not None:
            out["local_divergence"] = round(self.last_divergence, 6)
        st = self.settings
        if self.dp_noise > 0:
            spent = dp_epsilon(self.dp_noise, round_ + 1, st.dp_delta)
            out["dp_epsilon"] = round(spent, 6)
            out["dp_noise"] = self.dp_noise
            weights = sum(v.numel() for k, v in state.items() if k.startswith(THETA))
            out["dp_sigma"] = round(self.dp_noise * sensitivity(st.dp_clip, weights), 6)
        return out

    def round_limit(self, rounds: int) -> int:
        st = self.settings
        noise = self.dp_noise
        if noise <= 0:
            return rounds
        allowed = dp_rounds(noise, st.dp_epsilon, st.dp_delta, rounds)
        if allowed == 0:
            one = dp_epsilon(noise, 1, st.dp_delta)
            raise ConfigError(
                f"the privacy budget epsilon = {st.dp_epsilon:g} does not cover one "
                f"round: one release at noise multiplier {noise:g} costs "
                f"epsilon = {one:.4g} (delta = {st.dp_delta:g}); raise "
                "algorithm.prism.dp_noise or algorithm.prism.dp_epsilon"
            )
        if allowed < rounds:
            log.warning(
                "the privacy budget epsilon = %g (delta = %g, noise multiplier %g) allows %d "
                "of the %d rounds; the run stops there",
                st.dp_epsilon, st.dp_delta, noise, allowed, rounds,
            )  # fmt: skip
        return allowed

    # -- device ---------------------------------------------------------------------------
    def _frozen(
        self, ctx: DeviceContext, spec: Mapping[str, TensorSpec]
    ) -> dict[str, torch.Tensor]:
        cached = ctx.state.get(WINIT)
        names = masked_names(spec)
        if (
            isinstance(cached, dict)
            and list(cached) == names
            and all(tuple(cached[n].shape) == spec[n].shape for n in names)
        ):
            return cached
        seed = self.cfg.run.seed
        frozen = {n: frozen_weight(self.key, seed, n, spec[n].shape) for n in names}
        ctx.state[WINIT] = frozen
        return frozen

    def device_load(self, ctx: DeviceContext, model: nn.Module, state: TensorDict) -> None:
        """Write the frozen weights into ``model`` and keep the round's probabilities."""
        spec = {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
        frozen = self._frozen(ctx, spec)
        dense = {n: frozen[n] if n in frozen else frozen_constant(n, s) for n, s in spec.items()}
        model.load_state_dict(dense)
        ctx.state[LOADED] = {n: state[THETA + n].detach().clone() for n in frozen}

    def _optimizer(
        self, ctx: DeviceContext, net: MaskedModule, round_: int
    ) -> tuple[torch.optim.Optimizer, Any]:
        """Adam on the scores, from the moments the device's last earlier round left (the
        entry ``(round, shapes, state)``); a round trained again starts where it first
        started. Returns the optimizer and the entry it started from."""
        st = self.settings
        opt = torch.optim.Adam(list(net.scores), lr=st.lr, betas=(st.beta1, st.beta2))
        shapes = tuple(tuple(p.shape) for p in net.scores)
        kept = ctx.state.get(ADAM)
        if kept is not None and kept[0] >= round_:  # this round again (or the run restarted)
            kept = ctx.state.get(ADAM_BEFORE)
        if kept is not None and kept[0] < round_ and kept[1] == shapes:
            opt.load_state_dict(copy.deepcopy(kept[2]))
            return opt, kept
        return opt, None

    def device_round(
        self, ctx: DeviceContext, model: nn.Module, round_: int, *, upload: bool
    ) -> LocalResult:
        st = self.settings
        noise = self.dp_noise
        dp = noise > 0
        released = int(ctx.state.get(RELEASES, 0))
        if dp and upload and dp_epsilon(noise, released + 1, st.dp_delta) > (st.dp_epsilon):
            log.warning(
                "%s: one more release would exceed the privacy budget epsilon = %g: "
                "nothing trained or uploaded", ctx.device, st.dp_epsilon,
            )  # fmt: skip
            return LocalResult(None, TrainResult(0.0, 0, 0.0))
        theta = ctx.state.get(LOADED)
        if not isinstance(theta, dict):
            raise ConfigError("PRISM: device_round before device_load")
        frozen = self._frozen(
            ctx, {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
        )
        scores = {n: logit(theta[n], st.mask_eps) for n in frozen}
        seed = int(torch.randint(0, 2**62, (), generator=ctx.generator))
        net = MaskedModule(model, frozen, scores, estimator=st.estimator, seed=seed)
        train_cfg = self.cfg.train.model_copy(update={"grad_clip": 0.0})
        device = self.training_device
        match = self.objective(ctx, model, device)  # one-shot: feature matching, eq. 1
        # the kept moments are loaded where the scores train (load_state_dict moves them to
        # the parameters' device), so the scores move there first
        with placed(net, device if device.type != "cpu" else None):
            opt, started = self._optimizer(ctx, net, round_)
            result = train_local(
                net, ctx.data, train_cfg, self.scheduler, ctx.generator,
                steps=st.local_iters, device=device, optimizer=opt,
                loss_fn=match or ddpm_loss,  # an explicit loss keeps the step eager
            )  # fmt: skip
        if match is not None:
            match.keep(ctx.state)
        ctx.state[ADAM_BEFORE] = started
        ctx.state[ADAM] = (
            round_,
            tuple(tuple(p.shape) for p in net.scores),
            optimizer_state_on_cpu(opt.state_dict()),
        )
        for p in model.parameters():
            p.requires_grad_(True)
        if not upload:
            return LocalResult(None, result)
        probs = net.probabilities()
        if dp:
            probs = privatize(probs, noise=noise, clip=st.dp_clip,
                              generator=ctx.generator)  # fmt: skip
            ctx.state[RELEASES] = released + 1
        sent_as_probs = self._prob_layers()
        tensors: TensorDict = {PROB + n: probs[n].float() for n in sorted(sent_as_probs)}
        masks = []
        for name in sorted(set(probs) - sent_as_probs):
            prob = probs[name].reshape(-1)
            masks.append(torch.rand(prob.shape, generator=ctx.generator) < prob)
        if masks:
            tensors[MASK] = pack_bits(torch.cat(masks))
        return LocalResult(tensors, result)

    # -- edge and cloud -----------------------------------------------------------------------
    def edge_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        """Weighted mean of the devices' masks; ``prism.masks`` their total weight."""
        by_samples = self.settings.weighting == "samples"
        weights = [float(u.n_samples) if by_samples else 1.0 for u in updates]
        total = sum(weights)
        sent_as_probs = self._prob_layers()
        out: TensorDict = {}
        for name in sorted(sent_as_probs):  # PRISM*: probabilities, clamped into [0, 1]
            acc = torch.zeros(current[THETA + name].shape, dtype=torch.float64)
            for u, w in zip(updates, weights, strict=True):
                acc += w * u.tensors[PROB + name].double().clamp(0.0, 1.0)
            out[THETA + name] = (acc / total).float()
        keys = sorted(
            k for k in current if k.startswith(THETA) and k[len(THETA) :] not in sent_as_probs
        )
        if keys:
            sizes = [current[k].numel() for k in keys]
            bits = torch.zeros(sum(sizes), dtype=torch.float64)
            for u, w in zip(updates, weights, strict=True):
                bits += w * unpack_bits(u.tensors[MASK], sum(sizes)).to(torch.float64)
            mean = (bits / total).to(torch.float32)
            for k, part in zip(keys, mean.split(sizes), strict=True):
                out[k] = part.reshape(current[k].shape)
        out[COUNT] = torch.tensor(min(total, MAX_EXACT), dtype=torch.float32)
        out[STEP] = current[STEP].clone()
        return out

    def cloud_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        """Count-weighted mean of the edges, mapped into [eps, 1 - eps], then MADA."""
        st = self.settings
        # an edge's report is validated here too: counts >= 0, probabilities in [0, 1]
        counts = [min(max(float(u.tensors[COUNT]), 0.0), MAX_EXACT) for u in updates]
        if sum(counts) <= 0:
            counts = [1.0] * len(updates)
        total = sum(counts)
        eps = st.mask_eps
        agg = {}
        differ, weights = 0.0, 0
        for key in current:
            if key.startswith(THETA):
                mean = torch.zeros(current[key].shape, dtype=torch.float64)
                for c, u in zip(counts, updates, strict=True):
                    mean += c * u.tensors[key].double().clamp(0.0, 1.0)
                mean /= total
                # the devices' mean expected Hamming distance to a mask of what they received
                # is linear in their masks, so their mean mask gives it exactly
                theta = current[key].double()
                differ += float((theta + mean - 2.0 * theta * mean).sum())
                weights += mean.numel()
                agg[key] = (eps + (1.0 - 2.0 * eps) * mean).float()
        self.last_divergence = differ / weights if weights else None
        step = int(current[STEP])
        out: TensorDict = {}
        self.last_distance = self._mada_lambda(current, agg, step) if agg else None
        if st.mada and self.last_distance is not None:
            lam = st.mada_fixed_lambda or self.last_distance
            self.last_lambda = lam
            for key, new in agg.items():
                old = current[key].float()
                if st.mada_space == "score":
                    mixed = lam * logit(new, eps) + (1.0 - lam) * logit(old, 1e-6)
                    out[key] = torch.sigmoid(mixed)
                else:
                    out[key] = lam * new + (1.0 - lam) * old
        else:
            out.update(agg)
        out[COUNT] = torch.tensor(min(total, MAX_EXACT), dtype=torch.float32)
        out[STEP] = torch.tensor(float(step + 1), dtype=torch.float32)
        return out

    def _mada_lambda(self, old: TensorDict, new: TensorDict, step: int) -> float:
        """Distance between a seeded Bernoulli sample of ``old`` and one of ``new``."""
        rng = seeds.rng("prism.mada", self.cfg.run.seed, step=step)
        a, b = {}, {}
        for key in sorted(new):  # a resumed state comes back in sorted order
            u = torch.from_numpy(rng.random(new[key].numel(), dtype=np.float32))
            v = torch.from_numpy(rng.random(new[key].numel(), dtype=np.float32))
            a[key] = (u < old[key].reshape(-1)).float()
            b[key] = (v < new[key].reshape(-1)).float()
        return mask_distance(a, b, self.settings.mada_distance)
