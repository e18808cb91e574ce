"""The ``[algorithm]`` section as one table per method (format 2), and format 1's flat,
prefixed keys still read: moved to their tables with a note naming the new key, their
configs keeping the digests format 1 gave them (the stored configs of committed results
included)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from shared.config import FORMAT, config_from_dict, load_config, with_overrides
from shared.config.legacy import FLAT_KEYS
from shared.errors import ConfigError
from shared.methods.prism.config import PrismConfig

#: configs stored with committed comparison results (their ``config.json``) and the digests
#: their records hold (``method.json``), written by format 1
STORED = json.loads((Path(__file__).parent / "format1_configs.json").read_text())


@pytest.mark.parametrize("entry", STORED, ids=[e["source"].split("results/")[-1] for e in STORED])
def test_a_stored_format1_config_keeps_its_digest(entry: dict[str, Any]) -> None:
    cfg = config_from_dict(entry["config"], stored=True)
    assert cfg.format == 1 and cfg.digest() == entry["digest"]
    again = config_from_dict(json.loads(cfg.to_json()), stored=True)  # re-stored nested
    assert again == cfg and again.digest() == entry["digest"]


@pytest.mark.parametrize(
    ("data", "digest"),
    [  # computed by format 1's code
        ({"algorithm": {"name": "prism", "prism_lr": 0.2}, "model": {"init": "random"}},
         "2cc6f0ff2559105b"),
        ({"algorithm": {"name": "fedphd", "a": 18000.0, "prune_ratio": 0.3, "sparse_rounds": 1},
          "run": {"rounds": 2}}, "5c0b73ffba7bfdb5"),
        ({"algorithm": {"name": "moon", "moon_mu": 0.5}}, "7a65301d29698e30"),
    ],
)  # fmt: skip
def test_flat_keys_go_to_their_tables_with_a_note_and_the_old_digest(
    data: dict[str, Any], digest: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="shared.config.legacy"):
        cfg = config_from_dict(data)
    assert cfg.format == 1 and cfg.digest() == digest
    for key in data["algorithm"]:
        if key in FLAT_KEYS:
            section, table, name = FLAT_KEYS[key]
            where = f"{section}.{table}.{name}" if table else f"{section}.{name}"
            value = (
                getattr(cfg.algorithm.settings_of(table), name)
                if table
                else (getattr(cfg.federation, name))
            )
            assert value == data["algorithm"][key]
            notes = [r.message for r in caplog.records if f"algorithm.{key} " in r.message]
            assert len(notes) <= 1 and all(where in n for n in notes)


def test_a_method_table_and_what_the_digest_covers() -> None:
    cfg = config_from_dict({"algorithm": {"name": "prism", "prism": {"local_iters": 3}},
                            "model": {"init": "random"}})  # fmt: skip
    assert cfg.format == FORMAT == 2
    settings = cfg.algorithm.config()
    assert isinstance(settings, PrismConfig) and settings.local_iters == 3
    assert PrismConfig.of(cfg) == settings
    dumped = cfg.to_dict()["algorithm"]
    assert list(dumped) == ["name", "prism"] and dumped["prism"]["local_iters"] == 3
    # another method's table is carried and checked, but is not this run's experiment
    other = with_overrides(cfg, {"algorithm": {"fedprox": {"mu": 0.5}}})
    assert other.algorithm.settings_of("fedprox").mu == 0.5  # type: ignore[attr-defined]
    assert other.digest() == cfg.digest()
    assert with_overrides(cfg, {"algorithm": {"prism": {"lr": 0.2}}}).digest() != cfg.digest()
    # the named method's table is there with its defaults when the config gives none
    plain = config_from_dict({"algorithm": {"name": "moon"}})
    assert plain.to_dict()["algorithm"] == {"name": "moon", "moon": {"mu": 1.0, "tau": 0.5}}


def test_format_is_said_or_inferred() -> None:
    assert config_from_dict({}).format == 2
    assert config_from_dict({"algorithm": {"prox_mu": 0.5}}).format == 1
    # a format 2 config overridden with a flat key stays format 2 (the key is moved)
    cfg = with_overrides(config_from_dict({}), {"algorithm": {"name": "fedprox", "prox_mu": 0.3}})
    assert cfg.format == 2 and cfg.algorithm.config().mu == 0.3  # type: ignore[attr-defined]


def test_every_shipped_config_is_format_2() -> None:
    root = Path(__file__).resolve().parents[1] / "configs"
    for path in sorted(root.glob("*.toml")):
        assert load_config(path, env={}).format == 2, path
    for path in sorted((root / "compare").glob("*.toml")):
        text = path.read_text()
        assert not any(f'"algorithm.{k}"' in text for k in FLAT_KEYS), path


def test_a_method_table_key_from_the_environment() -> None:
    cfg = config_from_dict(
        {"algorithm": {"name": "prism"}, "model": {"init": "random"}},
        env={"ESTUARY__ALGORITHM__PRISM__LOCAL_ITERS": "7"},
    )
    assert cfg.algorithm.config().local_iters == 7  # type: ignore[attr-defined]


def test_format1_pfedgpa_depth_zero_is_read_as_the_whole_chain() -> None:
    """Format 1's ``pfedgpa_invert_from = 0``, its default, was the whole chain; format 2's 0
    is no diffusion at all and its default 200, so a format 1 config's zero, or no depth,
    becomes the run's ``timesteps`` (and keeps format 1's digest)."""
    run = {"model": {"preset": "fmnist-cnn"}, "data": {"partition": "dominant_groups"},
           "run": {"rounds": 3}}  # fmt: skip

    def depth(algorithm: dict[str, Any]) -> int:
        cfg = config_from_dict({**run, "algorithm": {"name": "pfedgpa", **algorithm}})
        again = config_from_dict(json.loads(cfg.to_json()), stored=True)
        assert again == cfg and again.digest() == cfg.digest()
        return int(cfg.algorithm.config().invert_from)  # type: ignore[attr-defined]

    assert depth({"pfedgpa_invert_from": 0, "pfedgpa_timesteps": 50}) == 50
    assert depth({"pfedgpa_timesteps": 50, "pfedgpa_invert_from": 0}) == 50
    assert depth({"pfedgpa_invert_from": 0}) == 1000
    assert depth({"pfedgpa_batch": 8, "pfedgpa_timesteps": 50}) == 50  # format 1, no depth
    assert depth({"pfedgpa_invert_from": 30, "pfedgpa_timesteps": 50}) == 30
    assert depth({"pfedgpa": {"invert_from": 0}}) == 0  # format 2: the reconstruction
    assert depth({}) == 200
    same = [
        config_from_dict({**run, "algorithm": {"name": "pfedgpa", **a}}).digest()
        for a in ({"pfedgpa_batch": 8}, {"pfedgpa_batch": 8, "pfedgpa_invert_from": 0})
    ]
    assert (
        same[0]
        == same[1]
        != config_from_dict(
            {
                **run,
                "algorithm": {"name": "pfedgpa", "pfedgpa_batch": 8, "pfedgpa_invert_from": 200},
            }
        ).digest()
    )
    with pytest.raises(ConfigError, match=r"invert_from \(60\) cannot exceed timesteps \(50\)"):
        depth({"pfedgpa": {"invert_from": 60, "timesteps": 50}})
