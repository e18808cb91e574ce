"""The run's random streams (shared/seeds.py): each gives, for every seed and key, the
numbers its derivation gave before the streams had names (so no run's numbers change), and
no module outside shared/seeds.py derives a seed of its own."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from shared import seeds

ROOT = Path(__file__).resolve().parents[1]


def _ss(words: list[int]) -> int:
    return int(np.random.SeedSequence(words).generate_state(1)[0])


@pytest.mark.parametrize("seed", [0, 1, 7, 2**31 - 1])
def test_every_stream_draws_what_its_derivation_drew(seed: int) -> None:
    r, d, e = 3, 5, seeds.name_key("edge1")
    gen, ss = np.random.default_rng, np.random.SeedSequence
    same_rng = {  # stream (keys) -> the generator it replaced
        ("participants", (("round", r),)): gen([seed, r, 0xC10D]),
        ("edge.select", (("device", d), ("round", r))): gen([seed, d, r, 0x5E1EC7]),
        ("data.split", ()): gen([seed, 0x9A27]),
        ("data.split.test", ()): gen([seed, 0x7E57]),
        ("data.domain", (("domain", 2),)): gen(ss([seed, 2, 0xD0, 0xC10D])),
        ("data.domain.device", (("device", d),)): gen(ss([seed, d, 0xD0, 0x3A1])),
        ("data.domain.test", (("device", d),)): gen(ss([seed, d, 0xD0, 0x7E57])),
        ("data.folder", (("device", d),)): gen(seed + d),
        ("feddiffuse.usplit", (("round", r), ("edge", e))): gen(ss([seed, r, e, 0xFEDD1FF])),
        ("prism.mada", (("step", r),)): gen([seed, r, 0x4D414441]),
    }  # fmt: skip
    for (stream, keys), old in same_rng.items():
        new = seeds.rng(stream, seed, **dict(keys))
        assert np.array_equal(new.integers(0, 2**63, 8), old.integers(0, 2**63, 8)), stream
    same_int = {
        ("device.round", (("device", d), ("round", r))): _ss([seed, d, r, 0xDE71CE]),
        ("device.grid", (("device", e),)): _ss([seed, e, 0x6121D]),
        ("eval.samples", (("salt", 4),)): _ss([seed, 0x5A4D, 4]),
        ("centralized", ()): _ss([seed, 0xCE7]),
        ("oneshot.bn", ()): _ss([seed, 0xB4]),
        ("pfedgpa.dm", (("round", r), ("use", 2))): _ss([seed, r, 0x9FED, 2]),
        ("pfedgpa.sweep", (("device", d),)): _ss([seed, d, 0xF7]),
        ("feddeo.image", (("device", d), ("cls", 7), ("image", 11))): _ss([seed, d, 7, 11, 0xDE0]),
        ("feddeo.classifier", ()): seed + 0xC1F,
        ("eval.reference", ()): None,
        ("data.folder", (("device", d),)): seed + d,
    }  # fmt: skip
    for (stream, keys), old_int in same_int.items():
        if old_int is not None:
            assert seeds.integer(stream, seed, **dict(keys)) == old_int, stream
    reference = seeds.rng("eval.reference", None, size=100).choice(100, 10, replace=False)
    assert np.array_equal(reference, gen([0xF1D, 100]).choice(100, 10, replace=False))


def test_a_draw_names_exactly_its_stream_keys() -> None:
    with pytest.raises(KeyError, match="takes the keys"):
        seeds.rng("participants", 0)
    with pytest.raises(KeyError, match="takes the keys"):
        seeds.integer("centralized", 0, round=1)


def test_no_module_derives_a_seed_of_its_own() -> None:
    """Outside shared/seeds.py no product module builds a SeedSequence or seeds a generator
    with a list of words (a stream's derivation)."""
    pattern = re.compile(r"SeedSequence\(|default_rng\(\[")
    found = []
    for package in ("shared", "cloud", "edge_node", "device_agent", "estuary"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "shared" / "seeds.py":
                continue
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert found == []
