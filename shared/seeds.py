"""The random streams of a run, each derived from the run seed under its own name.

Every random draw of a run comes from one of the streams below (never from a global RNG):
a stream names the words its numpy ``SeedSequence`` is built from, the run seed and the
keys of one draw (a round, a device, ...) around a constant that keeps it apart from every
other stream. :func:`sequence`, :func:`rng` and :func:`integer` build a draw's seed from its
stream's name and keys, so the derivations live here and nowhere else, and a new stream is a
new line of :data:`STREAMS`.

Two streams are additive (``seed + k``), as they always were (the same seed gives the same
numbers as before): ``data.folder`` (a device's sample of a large image folder, ``seed +
device index``: device i of run s draws what device i - 1 of run s + 1 draws) and
``feddeo.classifier`` (``seed + 0xC1F``). Every other stream hashes its words, so neighbouring
seeds and neighbouring keys draw unrelated numbers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

#: the run seed's word in a stream's layout
SEED = "seed"


@dataclass(frozen=True)
class Stream:
    """One stream: its words (the run seed, the keys of a draw by name, constants), what it
    draws, and whether it is additive (its seed is the run seed plus its one key or
    constant, not a hash)."""

    words: tuple[str | int, ...]
    what: str
    additive: bool = False


#: every stream, by name
STREAMS: dict[str, Stream] = {
    "participants": Stream((SEED, "round", 0xC10D), "a round's participants (cloud)"),
    "device.round": Stream((SEED, "device", "round", 0xDE71CE), "a device's round (torch)"),
    "device.grid": Stream((SEED, "device", 0x6121D), "a device's grid of a deployed model"),
    "edge.select": Stream((SEED, "device", "round", 0x5E1EC7), "a device's edge choice (eq. 25)"),
    "data.split": Stream((SEED, 0x9A27), "the training split across the devices"),
    "data.split.test": Stream((SEED, 0x7E57), "the test split across the devices"),
    "data.domain": Stream((SEED, "domain", 0xD0, 0xC10D), "a domain's images of a mixture"),
    "data.domain.device": Stream((SEED, "device", 0xD0, 0x3A1), "a device's domain transform"),
    "data.domain.test": Stream((SEED, "device", 0xD0, 0x7E57), "a device's test transform"),
    "data.folder": Stream((SEED, "device"), "a device's sample of its image folder", True),
    "eval.samples": Stream((SEED, 0x5A4D, "salt"), "evaluation's latents and noise"),
    "eval.reference": Stream((0xF1D, "size"), "FID's reference images (no run seed: fixed)"),
    "centralized": Stream((SEED, 0xCE7), "a centralized ceiling's batches and noise"),
    "oneshot.bn": Stream((SEED, 0xB4), "latents recomputing a one-shot generator's BN"),
    "feddiffuse.usplit": Stream((SEED, "round", "edge", 0xFEDD1FF), "USPLIT's pairing"),
    "pfedgpa.dm": Stream((SEED, "round", 0x9FED, "use"), "pFedGPA's diffusion model"),
    "pfedgpa.sweep": Stream((SEED, "device", 0xF7), "a device's LocalUpdate in pFedGPA's "
                            "offline depth sweep (benchmarks/pfedgpa_inversion.py)"),
    "feddeo.image": Stream((SEED, "device", "cls", "image", 0xDE0), "a synthetic image"),
    "feddeo.classifier": Stream((SEED, 0xC1F), "FedDEO's classifier training", True),
    "prism.mada": Stream((SEED, "step", 0x4D414441), "MADA's two Bernoulli samples"),
}  # fmt: skip


def name_key(name: str) -> int:
    """A name (a device's, an edge's) as a stream's key: the first 8 bytes of its sha256."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def _words(stream: str, seed: int | None, keys: dict[str, int]) -> list[int]:
    spec = STREAMS[stream]
    wanted = {w for w in spec.words if isinstance(w, str) and w != SEED}
    if set(keys) != wanted:
        raise KeyError(f"stream {stream!r} takes the keys {sorted(wanted)}, got {sorted(keys)}")
    if (SEED in spec.words) != (seed is not None):
        raise ValueError(f"stream {stream!r} {'needs' if SEED in spec.words else 'takes no'} seed")
    return [int(seed or 0) if w == SEED else keys[w] if isinstance(w, str) else w
            for w in spec.words]  # fmt: skip


def sequence(stream: str, seed: int | None, **keys: int) -> np.random.SeedSequence:
    """The ``SeedSequence`` of one draw of ``stream`` (not for an additive stream)."""
    if STREAMS[stream].additive:
        raise ValueError(f"stream {stream!r} is additive: use integer()")
    return np.random.SeedSequence(_words(stream, seed, keys))


def rng(stream: str, seed: int | None, **keys: int) -> np.random.Generator:
    """A numpy generator for one draw of ``stream``."""
    if STREAMS[stream].additive:
        return np.random.default_rng(integer(stream, seed, **keys))
    return np.random.default_rng(sequence(stream, seed, **keys))


def integer(stream: str, seed: int | None, **keys: int) -> int:
    """One draw's seed as an integer (a torch generator's ``manual_seed``): the first word
    of its sequence's state, or the sum of its words for an additive stream."""
    if STREAMS[stream].additive:
        return sum(_words(stream, seed, keys))
    return int(sequence(stream, seed, **keys).generate_state(1)[0])
