"""FedPhD maths (eqs. 18-25) against hand-computed cases, the selection statistics of the
paper's Figs. 5-6 analysis, and FedPhD runs with device-selected edges."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

from shared.config import config_from_dict
from shared.federation.selection import choose_edge, selection_probs, selection_rng, sh_score
from shared.methods.base import Update
from shared.methods.fedphd.method import FedPhD, sh_weights

TWO_CLASS = [50, 50, 0, 0, 0, 0, 0, 0, 0, 0]


def test_sh_score_eq18() -> None:
    assert sh_score([7] * 10) == pytest.approx(2.0)
    # q = (.5, .5, 0 x 8): ||q - u||^2 = 2 * 0.4^2 + 8 * 0.1^2 = 0.4
    assert sh_score(TWO_CLASS) == pytest.approx(2 - math.sqrt(0.4))
    # a non-uniform target: the score is 2 exactly at the target
    target = [0.5, 0.5] + [0.0] * 8
    assert sh_score(TWO_CLASS, target) == pytest.approx(2.0)


def test_sh_weights_eqs22_24() -> None:
    mu2 = 2 - math.sqrt(0.4)
    w = sh_weights([(100, [10] * 10), (300, [150, 150, 0, 0, 0, 0, 0, 0, 0, 0])], 100.0, 0.0)
    raw = [100 + 100 * 2.0, 300 + 100 * mu2]
    assert w == pytest.approx([r / sum(raw) for r in raw])
    # b enters inside the ReLU; a term below zero gets weight zero
    w = sh_weights([(100, [10] * 10), (10, TWO_CLASS)], 0.0, -50.0)
    assert w == pytest.approx([1.0, 0.0])
    # all terms zero: sample-count weights
    assert sh_weights([(1, TWO_CLASS), (3, TWO_CLASS)], 0.0, -1e9) == pytest.approx([0.25, 0.75])


def test_selection_probs_eq25_counts_the_device_tentatively() -> None:
    edges = {"e0": [0] * 10, "e1": [10] * 10}
    p = selection_probs(edges, TWO_CLASS, 1000.0, 0.0)
    # e0 after: (50, 50, 0...) n=100, mu = 2 - sqrt(.4); e1 after: (60, 60, 10 x 8) n=200,
    # q = (.3, .3, .05 x 8): ||q - u||^2 = 2 * .04 + 8 * .0025 = 0.1
    raw0 = 1000 * (2 - math.sqrt(0.4)) - 100
    raw1 = 1000 * (2 - math.sqrt(0.1)) - 200
    assert p["e0"] == pytest.approx(raw0 / (raw0 + raw1))
    assert p["e1"] == pytest.approx(raw1 / (raw0 + raw1))
    # a loaded edge drops to zero probability through the ReLU
    p = selection_probs({"e0": [0] * 10, "e1": [10_000] * 10}, TWO_CLASS, 1000.0, 0.0)
    assert p == {"e0": 1.0, "e1": 0.0}
    # every numerator zero: uniform
    p = selection_probs({"e0": [10_000] * 10, "e1": [10_000] * 10}, TWO_CLASS, 1.0, 0.0)
    assert p == {"e0": 0.5, "e1": 0.5}


def test_choose_edge_samples_and_falls_back_to_the_next_best_online_edge() -> None:
    probs = {"e0": 0.7, "e1": 0.2, "e2": 0.1}
    picks = [choose_edge(probs, None, np.random.default_rng(i)) for i in range(2000)]
    freq = {e: picks.count(e) / len(picks) for e in probs}
    assert freq == pytest.approx(probs, abs=0.04)  # sampled, not argmax
    # e0 offline: whatever was drawn, e0 is never chosen and e1 (next best) replaces it
    picks = [choose_edge(probs, {"e1", "e2"}, np.random.default_rng(i)) for i in range(500)]
    assert "e0" not in picks
    assert picks.count("e1") > picks.count("e2")
    with pytest.raises(ValueError):
        choose_edge(probs, set(), np.random.default_rng(0))
    # the drawn edge offline, the others tied: the first by name ("edge1" before "edge10")
    tied = {"edge0": 1.0, "edge1": 0.0, "edge10": 0.0}
    assert choose_edge(tied, {"edge10", "edge1"}, np.random.default_rng(0)) == "edge1"
    # the device's RNG: same (seed, device, round) -> same draw; never the global RNG
    state = cast(tuple[Any, ...], np.random.get_state())
    a = choose_edge(probs, None, selection_rng(3, 5, 7))
    assert a == choose_edge(probs, None, selection_rng(3, 5, 7))
    assert np.all(cast(tuple[Any, ...], np.random.get_state())[1] == state[1])


def _devices(n: int) -> list[np.ndarray]:
    """FedPhD's split: 2 classes per device, 1500 images each."""
    out = []
    for i in range(n):
        c = np.zeros(10, dtype=np.int64)
        c[i % 10] += 1500
        c[(i + 1 + i // 10) % 10] += 1500
        out.append(c)
    return out


def _window_stats(mode: str, per_round: int, windows: int = 60, n: int = 20) -> tuple[float, float]:
    """Mean final per-edge SH and mean client-count variance over r_g = 5 windows, choosing
    in the protocol's order (sorted participants, each seeing the earlier choices)."""
    devs = _devices(n)
    rng = np.random.default_rng(0)
    mus, variances = [], []
    for w in range(windows):
        counts = {"e0": np.zeros(10, dtype=np.int64), "e1": np.zeros(10, dtype=np.int64)}
        clients = {"e0": 0, "e1": 0}
        for r in range(5):
            for d in sorted(rng.choice(n, per_round, replace=False)):
                if mode == "fedphd":
                    probs = selection_probs(counts, devs[d], 15_000.0, 0.0)
                else:
                    probs = {"e0": 0.5, "e1": 0.5}
                e = choose_edge(probs, None, selection_rng(0, int(d), w * 5 + r))
                counts[e] += devs[d]
                clients[e] += 1
        mus.append(float(np.mean([sh_score(c) for c in counts.values()])))
        variances.append(float(np.var(list(clients.values()))))
    return float(np.mean(mus)), float(np.mean(variances))


@pytest.mark.parametrize("per_edge", [2, 4, 6, 8])
def test_selection_beats_random_as_in_figs_5_6(per_edge: int) -> None:
    """N = 20, two edges, a = 15000, b = 0: the homogeneity-aware choice gives each edge a
    more uniform accumulated distribution and a steadier client count than random choice."""
    mu, var = _window_stats("fedphd", 2 * per_edge)
    mu_rand, var_rand = _window_stats("random", 2 * per_edge)
    assert mu > mu_rand
    assert var < var_rand
    if per_edge == 2:
        assert var < 1.5  # the paper reports 0.72 for C / N_e = 2


def _cfg(**algo: object) -> object:
    return config_from_dict(
        {
            "run": {"name": "phd", "seed": 3, "rounds": 2},
            "federation": {"num_devices": 2, "num_edges": 1},
            "data": {"dataset": "synthetic", "synthetic_size": 40},
            "train": {"local_steps": 1, "batch_size": 4},
            "algorithm": {"name": "fedphd", **algo},
            "eval": {"every": 0, "sample_every": 0},
        }
    )


def test_fedphd_aggregation_uses_sh_weights() -> None:
    algo = FedPhD(_cfg(a=10.0, b=1.0))  # type: ignore[arg-type]
    ups = [
        Update("d0", {"w": torch.tensor([1.0])}, 100, tuple([10] * 10)),
        Update("d1", {"w": torch.tensor([3.0])}, 300, (150, 150, 0, 0, 0, 0, 0, 0, 0, 0)),
    ]
    w = sh_weights([(100, [10] * 10), (300, [150, 150] + [0] * 8)], 10.0, 1.0)
    expected = w[0] * 1.0 + w[1] * 3.0
    for agg in (algo.edge_aggregate, algo.cloud_aggregate):
        out = agg(ups, {"w": torch.tensor([0.0])})
        assert float(out["w"]) == pytest.approx(expected)


def test_fedphd_runs_with_selected_edges_sparse_training_and_pruning(tmp_path: Path) -> None:
    """MemoryBus, 4 devices choosing among 2 edges, R_s = 1, s_p = 0.44: every participant
    trains each round at the edge it picked; the cloud prunes at its aggregation ending round
    R_s - 1 and every role carries on with the pruned architecture."""
    pytest.importorskip("shared.models.pruning")
    from estuary.simulate import simulate
    from shared.metrics import accounting as acc
    from tests.conftest import tiny_config

    cfg = tiny_config(
        run={"name": "phd", "rounds": 3},
        federation={"num_devices": 4, "num_edges": 2, "assignment": "select"},
        train={"local_steps": 1, "batch_size": 4},
        algorithm={
            "name": "fedphd",
            "a": 200.0,
            "sparse_rounds": 1,
            "lambda0": 1e-3,
            "prune_ratio": 0.44,
        },
    )
    res = simulate(cfg, tmp_path / "phd", progress=False, evaluate=False)
    rows = res.rows
    assert [r["updates"] for r in rows] == [r["participants"] for r in rows] == [4] * 3
    assert all(sum(r["edges"].values()) == 4 for r in rows)
    dense = 686_769  # fmnist-tiny
    assert rows[0]["arch"] != "dense"  # pruned at the cloud aggregation ending round 0
    assert rows[0]["arch"] == rows[1]["arch"] == rows[2]["arch"]
    # round 0 trained the dense model: its period is labelled so, not with the pruned arch
    assert [r["trained_arch"] for r in rows] == ["dense", rows[0]["arch"], rows[0]["arch"]]
    ps = acc.periods(rows)
    assert [p.arch for p in ps] == ["dense", rows[0]["arch"], rows[0]["arch"]]
    assert acc.steady_periods(ps, rows[-1]["arch"]) == ps[1:]
    assert rows[2]["model_params"] == pytest.approx(0.56 * dense, rel=0.01)
    assert res.plan is not None
    assert sum(r["rejected"] for r in rows) == 0
