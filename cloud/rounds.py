"""What a cloud round is made of, apart from the service: who takes part (a seeded draw),
how large its announcement can get, and what the cloud saw of it."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from shared import seeds
from shared.config import RunConfig
from shared.data.datasets import NUM_CLASSES
from shared.errors import ConfigError
from shared.models.plan import dense_plan
from shared.naming import device_name, edge_ids
from shared.wire.messages import (
    MAX_MESSAGE_BYTES,
    BlobRef,
    RoundStart,
    encode,
)

log = logging.getLogger(__name__)


def sample_participants(devices: list[str], kappa: float, seed: int, round_: int) -> list[str]:
    """ceil(kappa * N) devices drawn without replacement by a per-round seeded RNG
    (derived from (seed, round) so a resumed run draws the same devices)."""
    rng = seeds.rng("participants", seed, round=round_)
    k = max(1, math.ceil(kappa * len(devices) - 1e-9))
    chosen = rng.choice(len(devices), size=min(k, len(devices)), replace=False)
    return sorted(devices[i] for i in chosen)


def largest_round_start(cfg: RunConfig) -> int:
    """Encoded bytes of the largest round announcement ``cfg`` can produce: the most
    participants a round can have, with the longest names, listed in the assignment (or, when
    devices pick their edge, as participants); every edge's label counts at 12 digits; and,
    when the cloud prunes, the dense channel plan (a pruned plan has the same entries with
    smaller numbers)."""
    fed = cfg.federation
    k = max(1, math.ceil(fed.participation * fed.num_devices - 1e-9))
    names = [device_name(i) for i in range(fed.num_devices - k, fed.num_devices)]
    edges = edge_ids(cfg)
    selecting = fed.assignment != "static"
    prunes = cfg.algorithm.config().prunes
    msg = RoundStart(
        round=cfg.run.rounds - 1,
        session="f" * 16,
        assignment={e: ([] if selecting or i else names) for i, e in enumerate(edges)},
        global_ref=BlobRef(sha256="f" * 64, size=2**40, kind="global_model", src="cloud"),
        shared_ref=BlobRef(sha256="f" * 64, size=2**40, kind="global_model", src="cloud"),
        new_global=True,
        deadline_s=fed.round_deadline_s,
        config_digest=cfg.digest(),
        participants=names if selecting else [],
        edge_counts={e: [10**12 - 1] * NUM_CLASSES for e in edges},
        arch=dense_plan(cfg.model.preset) if prunes else None,
    )
    return len(encode(msg))


def check_round_start_fits(cfg: RunConfig) -> None:
    """ConfigError when a round announcement of ``cfg`` could exceed the transport's message
    limit (it lists every participant), before any process connects."""
    size = largest_round_start(cfg)
    if size > MAX_MESSAGE_BYTES:
        fed = cfg.federation
        raise ConfigError(
            f"a round announcement for {fed.num_devices} devices (participation "
            f"{fed.participation:g}, assignment {fed.assignment!r}) can take {size} bytes, over "
            f"the {MAX_MESSAGE_BYTES}-byte message limit; use fewer devices per round "
            "(federation.participation or num_devices)"
        )


@dataclass
class RoundSummary:
    """What the cloud saw of one round."""

    round: int
    participants: int
    updates: int
    mean_loss: float | None
    cloud_aggregated: bool
    model_sha256: str
    round_seconds: float
    aggregation_seconds: float
    train_seconds: float
    rejected: int
    edges: dict[str, int] = field(default_factory=dict)
    model_params: int = 0  # parameters of the global model after this round
    arch: str = "dense"  # plan digest of the global model's architecture
    trained_arch: str = "dense"  # plan digest of the architecture this round trained on
    #: the run's last round (``run.rounds``, or earlier where the algorithm's budget ends it)
    final: bool = False
    #: the method's figures of the global state (``aggregation.round_report``)
    algorithm: dict[str, float] = field(default_factory=dict)
    #: classifier runs: each reporting device's (before, after) test accuracy
    accuracy: dict[str, tuple[float | None, float]] = field(default_factory=dict)
