"""FedDiffuse: FEDDIFF and its communication-efficient variants (seed 001, de Goede et al.,
"Training Diffusion Models with Federated Learning", Algorithm 3 and section 4).

The U-Net is cut into three parts by :func:`part_of`: the encoder ``theta_enc``, the
bottleneck (latent bridge) ``theta_bot`` and the decoder ``theta_dec``, so that
``theta = theta_enc ^ theta_bot ^ theta_dec``. Four variants (``algorithm.feddiffuse.split``):

- ``full``: FedAvg (Algorithm 3). Devices train and report the whole U-Net.
- ``usplit``: devices receive and train the whole U-Net but report only the parts assigned
  to them this round (:func:`usplit_assignment`); each tensor is averaged over the devices
  that reported it, weighted by data size (:func:`partial_fedavg`).
- ``ulatdec``: bottleneck and decoder federated, encoder local.
- ``udec``: decoder federated, encoder and bottleneck local.

Local parts are trained with the rest of the model every round and persist on the device in
``DeviceContext.state``; they start from the shared global initialization on a device's
first round and are never overwritten by the edge's state afterwards.

The paper counts communication as parameters exchanged between the federator and its
clients (downlink + uplink, summed over rounds); :func:`communicated_params` reproduces it.
On the wire, a device downloads the whole edge model once (the shared initialization of
its local parts) and then only the federated parts (:meth:`FedDiffuse.shared_spec`), so
the measured device-tier bytes follow that count plus the one-time first download; edges
upload, and download from the cloud, only the federated parts too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast, get_args

import numpy as np
import torch
from torch import nn

from shared import seeds
from shared.config import RunConfig
from shared.errors import ConfigError, EstuaryError
from shared.methods.aggregation import weighted_average
from shared.methods.base import (
    Algorithm,
    DeviceContext,
    LocalResult,
    TensorDict,
    Update,
    model_state,
)
from shared.methods.feddiffuse.config import FedDiffuseConfig
from shared.wire.codec import TensorSpec

log = logging.getLogger(__name__)

Part = Literal["encoder", "bottleneck", "decoder"]
Split = Literal["full", "usplit", "ulatdec", "udec"]
OddHalf = Literal["expected", "encoder", "decoder"]

PARTS: tuple[Part, ...] = get_args(Part)
SPLITS: tuple[Split, ...] = get_args(Split)

#: the parts each variant trains in federation (the rest stays on the device)
FEDERATED_PARTS: dict[Split, frozenset[Part]] = {
    "full": frozenset(PARTS),
    "usplit": frozenset(PARTS),
    "ulatdec": frozenset({"bottleneck", "decoder"}),
    "udec": frozenset({"decoder"}),
}

#: ``DeviceContext.state`` key of the device's local (never federated) tensors
LOCAL_STATE_KEY = "feddiffuse.local"

# Top-level submodules of diffusers' UNet2DModel, in forward order. The time embedding
# (``time_proj`` has no tensors; ``time_embedding`` is its MLP) and the optional class
# embedding are computed from the inputs before the first down block, so they belong to
# the encoder even though every ResNet block, decoder ones included, reads their output.
_PART_OF_ROOT: dict[str, Part] = {
    "conv_in": "encoder",
    "time_proj": "encoder",
    "time_embedding": "encoder",
    "class_embedding": "encoder",
    "down_blocks": "encoder",
    "mid_block": "bottleneck",
    "up_blocks": "decoder",
    "conv_norm_out": "decoder",
    "conv_out": "decoder",
}


def part_of(name: str) -> Part:
    """The U-Net part that owns state-dict tensor ``name``.

    Encoder: ``conv_in``, ``time_proj``/``time_embedding`` (and ``class_embedding`` when
    present), ``down_blocks``. Bottleneck: ``mid_block``. Decoder: ``up_blocks``,
    ``conv_norm_out``, ``conv_out``. Only the first name component matters, so pruned
    models (same names, fewer channels) split the same way.
    """
    root = name.split(".", 1)[0]
    try:
        return _PART_OF_ROOT[root]
    except KeyError:
        raise EstuaryError(
            f"tensor {name!r} is in no FedDiffuse part; known roots: {sorted(_PART_OF_ROOT)}"
        ) from None


def part_sizes(spec: Mapping[str, TensorSpec] | Mapping[str, torch.Tensor]) -> dict[Part, int]:
    """Number of parameters of each part for a model spec or state dict."""
    sizes: dict[Part, int] = dict.fromkeys(PARTS, 0)
    for name, t in spec.items():
        sizes[part_of(name)] += math.prod(t.shape)
    return sizes


# -- USPLIT task assignment ----------------------------------------------------------------
def usplit_rng(seed: int, round_: int, edge: str) -> np.random.Generator:
    """The pairing RNG of ``edge`` in ``round_``; every device of the edge derives the same."""
    return seeds.rng("feddiffuse.usplit", seed, round=round_, edge=seeds.name_key(edge))


def usplit_groups(
    peers: Sequence[str], seed: int, round_: int, edge: str
) -> list[dict[str, frozenset[Part]]]:
    """USPLIT's task groups of one edge and round (paper section 4, "USPLIT"): random pairs,
    plus a singleton when the count is odd; each maps device -> the parts it reports.

    The devices (sorted, so the order they were given in does not matter) are shuffled and
    taken two by two: the first of a pair reports the encoder, the second the decoder, and
    the bottleneck goes to one of the two at random. With an odd count the device left over
    reports the bottleneck plus the encoder or the decoder, drawn at random as in the paper.
    Draw order: the permutation, then one bottleneck draw per pair, then the odd device's.
    """
    names = sorted(peers)
    if len(set(names)) != len(names):
        raise EstuaryError(f"USPLIT peers contain duplicates: {names}")
    rng = usplit_rng(seed, round_, edge)
    order = [names[i] for i in rng.permutation(len(names))]
    groups: list[dict[str, frozenset[Part]]] = []
    for a, b in zip(order[0::2], order[1::2], strict=False):
        a_bot = bool(rng.integers(2) == 0)
        groups.append(
            {
                a: frozenset({"encoder", "bottleneck"} if a_bot else {"encoder"}),
                b: frozenset({"decoder"} if a_bot else {"decoder", "bottleneck"}),
            }
        )
    if len(order) % 2:
        half: Part = "encoder" if rng.integers(2) == 0 else "decoder"
        groups.append({order[-1]: frozenset({"bottleneck", half})})
    return groups


def usplit_assignment(
    peers: Sequence[str], seed: int, round_: int, edge: str
) -> dict[str, frozenset[Part]]:
    """Device -> the parts it reports in USPLIT (:func:`usplit_groups`, merged)."""
    return {d: parts for g in usplit_groups(peers, seed, round_, edge) for d, parts in g.items()}


# -- aggregation ---------------------------------------------------------------------------
def partial_fedavg(
    states: Sequence[Mapping[str, torch.Tensor]],
    n_samples: Sequence[int],
    current: Mapping[str, torch.Tensor],
    part_samples: Sequence[Mapping[str, int] | None] | None = None,
) -> TensorDict:
    """FedAvg per tensor over the states that hold it; tensors nobody sent keep ``current``.

    ``theta[k] = sum_{i reported k} w_i theta_i[k] / sum_{i reported k} w_i`` with
    ``w_i = n_samples[i]``, or, where ``part_samples[i]`` is given, the samples behind the
    part of ``k`` in state ``i`` (an edge's state covers a part only as far as its devices
    reported it; a part with no samples there is left out of the average, since the edge
    only carried the previous global copy of it). With every state complete and no part
    counts this is plain FedAvg (Algorithm 3's federator step).
    """
    if len(states) != len(n_samples):
        raise EstuaryError(f"{len(states)} states but {len(n_samples)} sample counts")
    if part_samples is not None and len(part_samples) != len(states):
        raise EstuaryError(f"{len(states)} states but {len(part_samples)} part sample counts")
    for s in states:
        extra = set(s) - set(current)
        if extra:
            raise EstuaryError(f"update holds tensors outside the state: {sorted(extra)[:3]}")

    def weight(i: int, name: str) -> int:
        parts = None if part_samples is None else part_samples[i]
        return n_samples[i] if parts is None else parts.get(part_of(name), 0)

    groups: dict[tuple[tuple[int, int], ...], list[str]] = {}
    for name in current:
        who = tuple(
            (i, w) for i, s in enumerate(states) if name in s and (w := weight(i, name)) > 0
        )
        groups.setdefault(who, []).append(name)
    out: TensorDict = {}
    for who, names in groups.items():
        if not who:
            out.update({k: current[k].clone() for k in names})
            continue
        sub = [{k: states[i][k] for k in names} for i, _ in who]
        out.update(weighted_average(sub, [float(w) for _, w in who]))
    return {k: out[k] for k in current}


# -- communication accounting ----------------------------------------------------------------
def communicated_params(
    variant: str,
    sizes: Mapping[str, int] | Mapping[str, TensorSpec] | Mapping[str, torch.Tensor],
    n_devices: int | Sequence[int],
    rounds: int = 1,
    *,
    odd_half: OddHalf = "expected",
) -> dict[str, float]:
    """Parameters exchanged between federators and devices, counted as the paper does.

    Each round the federator sends its federated parts to every device (downlink) and every
    device sends its report back (uplink): FULL ``2K|theta|``; USPLIT ``K|theta|`` down and
    ``|theta|`` per pair up, so ``1.5K|theta|`` (exactly 25 % below FULL for even K);
    ULATDEC ``2K|theta_dec ^ theta_bot|``; UDEC ``2K|theta_dec|``; times ``rounds`` (the
    paper's N over R rounds). An odd device out in USPLIT sends the bottleneck plus the
    encoder or the decoder (random): ``odd_half`` picks one, or ``"expected"`` averages them.

    ``sizes``: parameters per part (keys ``encoder``/``bottleneck``/``decoder``), or a model
    spec / state dict to split with :func:`part_sizes`. ``n_devices``: K, or the devices
    training at each edge (USPLIT pairs within an edge). Only the device tier is counted
    (the paper's federator is our edge; edge-cloud traffic is extra). Returns per round and
    over ``rounds``: ``downlink``, ``uplink``, ``total`` (``*_per_round`` too),
    ``full_total`` (FULL with the same K) and ``reduction`` = 1 - total / full_total.
    Counts are ints except for "expected" with an odd edge and an odd enc + dec total.
    """
    if variant not in SPLITS:
        raise ConfigError(f"unknown FedDiffuse variant {variant!r}; choose one of {SPLITS}")
    if odd_half not in get_args(OddHalf):
        raise ConfigError(f"odd_half must be one of {get_args(OddHalf)}, got {odd_half!r}")
    groups = [n_devices] if isinstance(n_devices, int) else list(n_devices)
    if rounds < 0 or any(g < 0 for g in groups):
        raise ConfigError(f"rounds ({rounds}) and device counts ({groups}) must be >= 0")
    p = _as_part_sizes(sizes)
    total, k = sum(p.values()), sum(groups)
    fed = sum(p[part] for part in FEDERATED_PARTS[cast(Split, variant)])
    down = k * fed
    if variant == "usplit":
        # twice the odd device's report, to stay in integers when "expected" halves it
        half2 = {
            "expected": p["encoder"] + p["decoder"],
            "encoder": 2 * p["encoder"],
            "decoder": 2 * p["decoder"],
        }[odd_half]
        odd2 = 2 * p["bottleneck"] + half2
        up2 = sum(2 * (g // 2) * total + (g % 2) * odd2 for g in groups)
        up: float = up2 // 2 if up2 % 2 == 0 else up2 / 2
    else:
        up = k * fed
    full = 2 * k * total
    return {
        "downlink_per_round": down,
        "uplink_per_round": up,
        "total_per_round": down + up,
        "downlink": rounds * down,
        "uplink": rounds * up,
        "total": rounds * (down + up),
        "full_total": rounds * full,
        "reduction": 1.0 - (down + up) / full if full else 0.0,
    }


def _as_part_sizes(
    sizes: Mapping[str, int] | Mapping[str, TensorSpec] | Mapping[str, torch.Tensor],
) -> dict[Part, int]:
    if set(sizes) == set(PARTS) and all(isinstance(v, int) for v in sizes.values()):
        return {part: int(sizes[part]) for part in PARTS}  # type: ignore[arg-type]
    return part_sizes(sizes)  # type: ignore[arg-type]


# -- the algorithm ---------------------------------------------------------------------------
class FedDiffuse(Algorithm):
    """FEDDIFF (seed 001, Algorithm 3) with the USPLIT, ULATDEC and UDEC training methods of
    its section 4, chosen by ``algorithm.feddiffuse.split``.

    Device: load the edge's state (only its federated parts after the first round when
    parts are local), minimize L_simple (eq. 8) over the whole U-Net for the configured
    local steps, keep the local parts in ``ctx.state``, report the federated parts (USPLIT:
    the parts :func:`usplit_assignment` gives this device). Edge and cloud:
    :func:`partial_fedavg`, weighted by data size (eq. 9's ``|D_k| / |D|``).
    """

    name = "feddiffuse"
    config_class = FedDiffuseConfig
    settings: FedDiffuseConfig

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.split: Split = self.settings.split
        self.federated = FEDERATED_PARTS[self.split]
        self.local_parts = self.federated != FEDERATED_PARTS["full"]  # ULATDEC, UDEC
        # USPLIT devices report different parts, so the edges count samples per part
        self.part_names: tuple[str, ...] = PARTS if self.split == "usplit" else ()

    def is_federated(self, name: str) -> bool:
        """Whether tensor ``name`` is trained in federation under this variant."""
        return part_of(name) in self.federated

    def upload_spec(self, global_spec: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        """The federated tensors (a USPLIT device sends a subset of them)."""
        return {k: v for k, v in global_spec.items() if self.is_federated(k)}

    def shared_spec(self, global_spec: Mapping[str, TensorSpec]) -> dict[str, TensorSpec] | None:
        """ULATDEC/UDEC: the federated parts (the local parts never leave the devices, and
        the cloud's and edges' copies of them stay the initial ones); FULL/USPLIT: None."""
        return self.upload_spec(global_spec) if self.local_parts else None

    def device_holds_rest(self, ctx: DeviceContext, global_spec: Mapping[str, TensorSpec]) -> bool:
        """Whether the device kept local parts that fit a state of ``global_spec``."""
        local = ctx.state.get(LOCAL_STATE_KEY)
        return self.local_parts and local is not None and self._local_fits(local, global_spec)

    def client_state(
        self, global_state: TensorDict, device_state: Mapping[str, Any]
    ) -> TensorDict | None:
        """ULATDEC/UDEC: the global federated parts over the device's local parts (the
        paper measures FID "on client level, given that the federator only had access to
        partial models"); None for FULL/USPLIT and for a device without local parts yet."""
        local = device_state.get(LOCAL_STATE_KEY)
        if not self.local_parts or local is None or not self._local_fits(local, global_state):
            return None
        return {**global_state, **local}

    def part_uplink(self, model_spec: Mapping[str, TensorSpec], per_edge: Sequence[int]) -> float:
        """USPLIT's uplink as the paper counts it (:func:`communicated_params`)."""
        counted = communicated_params(self.split, model_spec, list(per_edge))
        return float(counted["uplink_per_round"])

    def upload_parts(self, tensors: Mapping[str, object]) -> frozenset[str]:
        """The parts an upload holds (a USPLIT device reports its assigned parts)."""
        return frozenset(part_of(k) for k in tensors)

    # -- device ---------------------------------------------------------------------------
    def device_load(self, ctx: DeviceContext, model: nn.Module, state: TensorDict) -> None:
        """The edge's federated parts, over the device's own local parts once it has some.

        ``state`` is the edge's whole state (first round, or after the device lost its
        local parts) or only its federated parts (:meth:`shared_spec`)."""
        local = ctx.state.get(LOCAL_STATE_KEY)
        if local is not None and not self._local_fits(local, model.state_dict()):
            log.warning("%s: local parts do not fit the new architecture; reset", ctx.device)
            local = None
        if local is None:
            missing = set(model.state_dict()) - set(state)
            if missing:
                raise EstuaryError(
                    f"{ctx.device}: holds no local parts for the {len(missing)} tensors the "
                    f"edge's state leaves out (e.g. {sorted(missing)[0]!r})"
                )
            model.load_state_dict(state)  # first round: the shared initialization
            return
        merged = {**local, **{k: v for k, v in state.items() if self.is_federated(k)}}
        model.load_state_dict(merged)

    def _local_fits(
        self, local: TensorDict, spec: Mapping[str, TensorSpec] | Mapping[str, torch.Tensor]
    ) -> bool:
        names = {k for k in spec if not self.is_federated(k)}
        return set(local) == names and all(
            tuple(local[k].shape) == tuple(spec[k].shape) for k in names
        )

    def device_round(
        self, ctx: DeviceContext, model: nn.Module, round_: int, *, upload: bool
    ) -> LocalResult:
        result = self.train(ctx, model)
        trained = model_state(model)
        if self.local_parts:
            ctx.state[LOCAL_STATE_KEY] = {
                k: v for k, v in trained.items() if not self.is_federated(k)
            }
        if not upload:
            return LocalResult(None, result)
        parts = self.report_parts(ctx, round_)
        return LocalResult({k: v for k, v in trained.items() if part_of(k) in parts}, result)

    def report_parts(self, ctx: DeviceContext, round_: int) -> frozenset[Part]:
        """The parts this device reports in ``round_``."""
        if self.split != "usplit":
            return self.federated
        assignment = usplit_assignment(ctx.peers, ctx.seed, round_, ctx.edge)
        if ctx.device not in assignment:
            raise EstuaryError(
                f"USPLIT: {ctx.device} is not among the peers {ctx.peers} of {ctx.edge!r} in "
                f"round {round_ + 1}; the device agent must fill DeviceContext.peers"
            )
        log.debug("%s round %d reports %s", ctx.device, round_ + 1, sorted(assignment[ctx.device]))
        return assignment[ctx.device]

    # -- edge and cloud ----------------------------------------------------------------------
    def edge_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        return partial_fedavg([u.tensors for u in updates], [u.n_samples for u in updates], current)

    def cloud_aggregate(self, updates: Sequence[Update], current: TensorDict) -> TensorDict:
        """:func:`partial_fedavg` of the edges' states, each part weighted by the samples of
        the devices that reported it at that edge (``Update.part_samples``, USPLIT)."""
        return partial_fedavg(
            [u.tensors for u in updates],
            [u.n_samples for u in updates],
            current,
            [u.part_samples for u in updates],
        )
