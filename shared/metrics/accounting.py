"""Communication and compute accounting per central aggregation (FedPhD Table IV, DESIGN
section 4 "Report per run").

Vocabulary
    *Central aggregation*: one aggregation on the cloud; its *period* is the rounds from the
    previous one (exclusive) to it (inclusive), ``r_g`` rounds. ``V``: the fp32 bytes of the
    model (4 bytes per parameter); sizes are reported in MiB, which is what the paper calls
    MB (its 136.53 "MB" dense U-Net is 35.79 M parameters x 4 B / 2**20).

Links and weights (ShapeFL's rule, as FedPhD section V-C uses it)
    ``C_ne = 0.002 * d_e * V`` for a model crossing the device <-> edge link and
    ``C_ce = 0.02 * d_c * V`` for one crossing the link to the cloud, with the paper's
    ``d_e = 1`` and ``d_c = 10 d_e`` (:class:`Distances`). Blob kinds map to tiers by
    :data:`BLOB_TIER`. *Hierarchical* schedules (``r_e < r_g``) put the edges next to the
    devices: device <-> edge bytes are charged ``C_ne``, edge <-> cloud bytes ``C_ce``.
    *Flat* schedules (``r_e == r_g``: every edge aggregation is a central one, so the edges
    are only the cloud's ingress, DESIGN "flat FL = devices -> one edge that forwards") put
    the edges at the cloud: device <-> edge bytes cross the long link and are charged
    ``C_ce``; edge <-> cloud bytes are internal and cost nothing. Control messages
    (``msg_*``) are counted in the totals but not weighted (the paper weighs model volume).

Measured vs analytic
    :func:`split_received` and :func:`periods` turn a run's ``received:<kind>`` counters
    (one count per delivery, so a blob fetched by k receivers counts k times) into bytes per
    tier and per central aggregation. :func:`analytic_period` predicts the same bytes from
    the config and the encoded payload sizes (exact for static assignment with ``r_e = 1``
    or ``kappa = 1``; USPLIT's partial uploads are estimated).

The paper's Table IV rule (:func:`paper_comm_cost`)
    Comm Cost = ``V * C * payload * (k_c * 0.02 d_c + k_e * 0.002 d_e)`` per *window* of
    equal local computation (one FedPhD central aggregation = ``r_g`` local epochs), with
    ``C = kappa * N`` clients per round, ``k_c`` cloud and ``k_e`` edge aggregations in the
    window and ``payload`` the uploaded model multiple (SCAFFOLD 2). Each participating
    client's model is charged once per aggregation, in one direction, also on the cloud hop
    of the hierarchy (in the paper's setting ``C = 4 = 2 N_e`` that equals the two edges'
    upload plus download, so the paper's numbers cannot tell the two readings apart). With
    ``N = 20``, ``kappa = 0.2``, ``r_g = 5``, ``r_e = 1``, ``d_e = 1``, ``d_c = 10`` and
    ``V = 136.525`` / ``77.93`` MiB it gives Table IV: FedAvg 109.22, FedProx and MOON the
    same, FedAvg(E=1) 546.10 (5 aggregations per window), SCAFFOLD 218.44, FedPhD 65.46
    (``0.8 V + 5 x 4 x 0.002 V = 0.84 V``). FedDiffuse's 72.82 needs ``payload = 2/3``
    (:data:`PAPER_FEDDIFFUSE_PAYLOAD`, 72.81 to the paper's rounding), which no FedDiffuse
    variant gives with the DDPM U-Net's part sizes (USPLIT uploads 1/2; tests/test_accounting.py).
    The measured weighted cost differs by design: it counts both directions and what
    actually crosses each link (an edge sends one aggregate, not its clients' models).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from shared.config import FederationSection, RunConfig
from shared.errors import ConfigError
from shared.methods.registry import make_algorithm
from shared.models.plan import ChannelPlan, model_spec
from shared.wire.codec import TensorSpec, encode_tensors, spec_bytes

MIB = 2**20
FP32_BYTES = 4
EDGE_RATE = 0.002  # C_ne per MiB and unit distance
CLOUD_RATE = 0.02  # C_ce per MiB and unit distance
#: FedDiffuse's uploaded fraction implied by Table IV (72.82 / 109.22), see module docstring
PAPER_FEDDIFFUSE_PAYLOAD = 2.0 / 3.0

Tier = Literal["edge", "cloud"]
#: which link each model blob kind crosses (edge: device <-> edge; cloud: edge <-> cloud)
BLOB_TIER: dict[str, Tier] = {
    "edge_model": "edge",
    "device_update": "edge",
    "description": "edge",  # FedDEO's upload: descriptions instead of a model
    "global_model": "cloud",
    "edge_update": "cloud",
}


@dataclass(frozen=True)
class Distances:
    """Shortest-path distances of the two links; the paper's ``d_c = 10 d_e``."""

    d_e: float = 1.0
    d_c: float = 10.0

    def __post_init__(self) -> None:
        if not (self.d_e >= 0 and self.d_c >= 0 and math.isfinite(self.d_e + self.d_c)):
            raise ConfigError(f"distances must be finite and >= 0, got {self}")


def fp32_bytes(params: int) -> int:
    """``V``: bytes of ``params`` fp32 parameters."""
    return FP32_BYTES * params


def mib(nbytes: float) -> float:
    """Bytes in MiB (the paper's MB)."""
    return nbytes / MIB


# -- measured bytes --------------------------------------------------------------------------
@dataclass(frozen=True)
class LinkBytes:
    """Received bytes by tier: model payloads on each link, control messages, the rest."""

    edge: int = 0
    cloud: int = 0
    control: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        """Every byte counted."""
        return self.edge + self.cloud + self.control + self.other

    def __add__(self, o: LinkBytes) -> LinkBytes:
        return LinkBytes(
            self.edge + o.edge, self.cloud + o.cloud, self.control + o.control, self.other + o.other
        )


def split_received(counts: Mapping[str, int]) -> LinkBytes:
    """Sum ``received:<kind>`` counters by tier (``sent:`` keys are ignored: a blob put once
    and fetched k times crossed its link k times)."""
    tiers = {"edge": 0, "cloud": 0, "control": 0, "other": 0}
    for key, n in counts.items():
        direction, _, kind = key.partition(":")
        if direction != "received":
            continue
        where = BLOB_TIER.get(kind) or ("control" if kind.startswith("msg_") else "other")
        tiers[where] += int(n)
    return LinkBytes(**tiers)


def is_flat(fed: FederationSection) -> bool:
    """Whether every edge aggregation is a central one (the edges are the cloud's ingress)."""
    return fed.edge_every == fed.cloud_every


def long_link_bytes(b: LinkBytes, *, flat: bool) -> tuple[int, int]:
    """``(bytes on the link to the cloud, bytes on the device <-> edge link)``."""
    return (b.edge, 0) if flat else (b.cloud, b.edge)


def weighted_cost(b: LinkBytes, *, flat: bool, d: Distances | None = None) -> float:
    """``0.02 d_c`` per MiB on the link to the cloud plus ``0.002 d_e`` per MiB device <-> edge."""
    d = d or Distances()
    cloud, edge = long_link_bytes(b, flat=flat)
    return CLOUD_RATE * d.d_c * mib(cloud) + EDGE_RATE * d.d_e * mib(edge)


@dataclass(frozen=True)
class Period:
    """The traffic of one central-aggregation period (rounds ``first..last``)."""

    first: int
    last: int
    bytes: LinkBytes
    arch: str  # the global architecture in force while the period trained


def periods(rows: Sequence[Mapping[str, Any]]) -> list[Period]:
    """Central-aggregation periods of a run's metrics rows (a trailing period that never
    reached the cloud is dropped). A period trains on the architecture its first row
    records as ``trained_arch``; rows written before that field existed fall back to the
    ``arch`` of the row before it (pruning at an aggregation changes the *next* period;
    the first period then takes its own row's, wrong only when pruning at round 0)."""
    out: list[Period] = []
    acc, first, arch = LinkBytes(), None, None
    for row in rows:
        if first is None:
            first = row["round"]
            arch = row.get("trained_arch") or arch or row.get("arch", "dense")
        acc = acc + split_received(row.get("bytes", {}))
        if row.get("cloud_aggregated"):
            out.append(Period(first, row["round"], acc, str(arch)))
            acc, first, arch = LinkBytes(), None, row.get("arch", "dense")
    return out


def steady_periods(ps: Sequence[Period], final_arch: str) -> list[Period]:
    """Periods trained on the final architecture (all of them when none was)."""
    steady = [p for p in ps if p.arch == final_arch]
    return steady or list(ps)


def mean_bytes(ps: Sequence[Period]) -> LinkBytes:
    """Mean traffic of ``ps`` per period (integer bytes, rounded)."""
    if not ps:
        return LinkBytes()
    total = sum((p.bytes for p in ps), LinkBytes())
    n = len(ps)
    return LinkBytes(*(round(getattr(total, f) / n) for f in ("edge", "cloud", "control", "other")))


# -- analytic bytes --------------------------------------------------------------------------
def encoded_bytes(spec: Mapping[str, TensorSpec]) -> int:
    """Size of the safetensors payload of a state with ``spec`` (what one blob carries)."""
    return len(encode_tensors({k: torch.zeros(s.shape, dtype=s.dtype) for k, s in spec.items()}))


def participants_per_round(fed: FederationSection) -> int:
    """``C = ceil(kappa N)``, as the cloud samples them."""
    return max(1, min(fed.num_devices, math.ceil(fed.participation * fed.num_devices - 1e-9)))


def analytic_period(
    fed: FederationSection, *, down: int, up: float, edge_state: int, global_state: int
) -> LinkBytes:
    """Model bytes of one central-aggregation period predicted from the config.

    Each of the ``C`` participants fetches the edge model (``down``) and uploads
    (``up``) once per edge period, ``r_g / r_e`` times; every edge uploads its state to the
    cloud and fetches the new global model once. Exact for ``r_e = 1`` or ``kappa = 1``
    with every edge serving someone in the period."""
    c, k = participants_per_round(fed), fed.cloud_every // fed.edge_every
    return LinkBytes(
        edge=round(c * k * (down + up)), cloud=fed.num_edges * (edge_state + global_state)
    )


@dataclass(frozen=True)
class Payloads:
    """Blob sizes of one configuration (bytes) and the parameters they carry."""

    down: int  # edge state a device fetches
    up: float  # mean device upload (USPLIT devices send parts)
    edge_state: int  # edge -> cloud
    global_state: int  # cloud -> edge
    model_params: int  # parameters of the model (V = 4 x this)
    #: the mean device upload in fp32 parameters' worth of bytes (SCAFFOLD: 2 x the
    #: model; PRISM's bit-packed masks: 1/32 of the masked weights)
    up_params: float

    @property
    def payload(self) -> float:
        """Upload size in models: Table IV's multiple (SCAFFOLD 2, USPLIT 1/2)."""
        return self.up_params / self.model_params


def payloads(cfg: RunConfig, plan: ChannelPlan | None = None) -> Payloads:
    """What one device fetch / device upload / edge report / global download carries for the
    configured algorithm on ``model.preset`` under ``plan`` (the algorithm's own specs).

    Uploads of parts (``traffic.uplink = "parts"``: FedDiffuse USPLIT) are counted as the
    method counts them (:meth:`~shared.methods.api.StateFormat.part_uplink`), the
    participants split evenly over the edges (pairs form within an edge). Where the method
    has a :meth:`~shared.methods.api.StateFormat.shared_spec` (FedDiffuse ULATDEC/UDEC) the
    downloads and edge reports carry only it: the steady state, after each device's one
    download of the whole model."""
    algo = make_algorithm(cfg)
    mspec = model_spec(cfg.model.preset, plan)
    gspec = algo.format.global_spec(mspec)
    uspec = algo.format.upload_spec(gspec)
    g, u = encoded_bytes(gspec), encoded_bytes(uspec)
    params = sum(math.prod(s.shape) for s in mspec.values())
    # in fp32 parameters' worth of bytes: a packed bit vector (PRISM) is 1/32 of its weights
    up_params = spec_bytes(uspec) / FP32_BYTES
    if algo.traffic.uplink == "parts":
        c, e = participants_per_round(cfg.federation), cfg.federation.num_edges
        groups = [c // e + (1 if i < c % e else 0) for i in range(e)]
        sent = algo.format.part_uplink(mspec, groups)
        fraction = sent / (c * up_params)
        u, up_params = round(u * fraction), up_params * fraction
    shared = algo.format.shared_spec(gspec)
    if shared is not None:  # only the shared tensors travel once a role holds the rest
        g = encoded_bytes(shared)
    return Payloads(g, u, g, g, params, up_params)


# -- the paper's Table IV rule ----------------------------------------------------------------
def paper_comm_cost(
    v_mib: float,
    clients: int,
    *,
    cloud_aggs: float = 1.0,
    edge_aggs: float = 0.0,
    payload: float = 1.0,
    d: Distances | None = None,
) -> float:
    """Table IV's "Comm Cost" of one window: ``V C payload (k_c 0.02 d_c + k_e 0.002 d_e)``."""
    d = d or Distances()
    per_client = cloud_aggs * CLOUD_RATE * d.d_c + edge_aggs * EDGE_RATE * d.d_e
    return v_mib * clients * payload * per_client


def aggregations_per_window(
    fed: FederationSection, *, steps_per_round: float, window_steps: float
) -> tuple[float, float]:
    """``(k_c, k_e)``: cloud and (hierarchical) edge aggregations in a window of
    ``window_steps`` local steps per device, for rounds of ``steps_per_round`` steps."""
    if steps_per_round <= 0 or window_steps <= 0:
        raise ConfigError("steps per round and window steps must be > 0")
    rounds = window_steps / steps_per_round
    k_c = rounds / fed.cloud_every
    k_e = 0.0 if is_flat(fed) else rounds / fed.edge_every
    return k_c, k_e
