"""Communication accounting: FedPhD's Table IV from the config, and measured == analytic."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from estuary.simulate import simulate
from shared.config import FederationSection
from shared.methods.feddiffuse.method import communicated_params, part_of, part_sizes
from shared.metrics import accounting as acc
from shared.models.presets import state_spec
from tests.conftest import tiny_config

MIB = 2**20

# FedPhD section V-A: N = 20 clients, kappa = 0.2 (C = 4), N_e = 2, r_g = 5, r_e = 1.
# Baselines train E = 5 local epochs per round, FedPhD and FedAvg(E=1) one: the window of
# equal compute is 5 local epochs per participating client.
FLAT = FederationSection(num_devices=20, num_edges=2, participation=0.2)
HFL = FederationSection(num_devices=20, num_edges=2, participation=0.2, cloud_every=5)
# The paper prints V = 136.53 MB (dense) and 77.93 MB (s_p = 0.44); SCAFFOLD's 218.44 =
# 1.6 V pins the dense V to 136.525 +- 0.0005 MiB.
V_DENSE, V_PRUNED = 136.525, 77.93


def table_iv(fed: FederationSection, v: float, epochs: int, payload: float = 1.0) -> float:
    k_c, k_e = acc.aggregations_per_window(fed, steps_per_round=epochs, window_steps=5)
    c = acc.participants_per_round(fed)
    return acc.paper_comm_cost(v, c, cloud_aggs=k_c, edge_aggs=k_e, payload=payload)


def test_table_iv_comm_cost_reproduced() -> None:
    """Table IV "Comm Cost" on CIFAR-10 (ddpm-cifar10) with d_e = 1, d_c = 10, MiB."""
    assert acc.participants_per_round(FLAT) == 4
    got = {
        "FedAvg": table_iv(FLAT, V_DENSE, epochs=5),
        "FedAvg (E=1)": table_iv(FLAT, V_DENSE, epochs=1),
        "FedProx": table_iv(FLAT, V_DENSE, epochs=5),
        "MOON": table_iv(FLAT, V_DENSE, epochs=5),
        "SCAFFOLD": table_iv(FLAT, V_DENSE, epochs=5, payload=2.0),
        "FedDiffuse": table_iv(FLAT, V_DENSE, epochs=5, payload=acc.PAPER_FEDDIFFUSE_PAYLOAD),
        "FedPhD": table_iv(HFL, V_PRUNED, epochs=1),
    }
    paper = {
        "FedAvg": 109.22,
        "FedAvg (E=1)": 546.10,
        "FedProx": 109.22,
        "MOON": 109.22,
        "SCAFFOLD": 218.44,
        "FedDiffuse": 72.82,
        "FedPhD": 65.46,
    }
    for method, value in paper.items():
        # FedDiffuse's 72.82 is 2/3 of FedAvg only to the paper's rounding (72.813)
        assert got[method] == pytest.approx(value, abs=0.01), method
    assert got["FedPhD"] / got["FedAvg"] == pytest.approx(0.599, abs=1e-3)


def test_table_iv_from_parameter_counts() -> None:
    """The same rule from our U-Net's parameters: 35,746,307 -> V = 136.36 MiB, within 0.2 %
    of the paper's V; FedPhD at the nominal 20.3 M params within 1 %."""
    spec = state_spec("ddpm-cifar10")
    params = sum(math.prod(s.shape) for s in spec.values())
    assert params == 35_746_307
    v = acc.mib(acc.fp32_bytes(params))
    assert table_iv(FLAT, v, epochs=5) == pytest.approx(109.22, rel=2e-3)
    v_pruned = acc.mib(acc.fp32_bytes(20_300_000))
    assert table_iv(HFL, v_pruned, epochs=1) == pytest.approx(65.46, rel=1e-2)
    # FedDiffuse counted by its own module: USPLIT uploads half the model per client (both
    # directions: 25 % below FULL); no variant gives the paper's implied 2/3.
    sizes = {str(k): v for k, v in part_sizes(spec).items()}
    usplit = communicated_params("usplit", sizes, [2, 2])
    assert usplit["reduction"] == pytest.approx(0.25)
    assert usplit["uplink_per_round"] / (4 * params) == pytest.approx(0.5)
    for variant in ("usplit", "ulatdec", "udec"):
        up = communicated_params(variant, sizes, [2, 2])["uplink_per_round"] / (4 * params)
        assert abs(up - acc.PAPER_FEDDIFFUSE_PAYLOAD) > 0.03, variant


def test_weighted_cost_by_topology() -> None:
    """Hierarchical: 0.002 d_e on device<->edge, 0.02 d_c on edge<->cloud; flat: the edges
    are the cloud's ingress, so device<->edge pays 0.02 d_c and edge<->cloud nothing."""
    b = acc.LinkBytes(edge=10 * MIB, cloud=2 * MIB, control=5)
    assert acc.weighted_cost(b, flat=False) == pytest.approx(0.02 * 10 * 2 + 0.002 * 1 * 10)
    assert acc.weighted_cost(b, flat=True) == pytest.approx(0.02 * 10 * 10)
    d = acc.Distances(d_e=2.0, d_c=5.0)
    assert acc.weighted_cost(b, flat=False, d=d) == pytest.approx(0.02 * 5 * 2 + 0.002 * 2 * 10)
    assert acc.long_link_bytes(b, flat=True) == (10 * MIB, 0)
    assert acc.is_flat(FLAT) and not acc.is_flat(HFL)


def test_split_received_and_periods() -> None:
    counts = {
        "received:edge_model": 10,
        "received:device_update": 20,
        "received:global_model": 3,
        "received:edge_update": 4,
        "received:msg_round_start": 7,
        "received:mystery": 1,
        "sent:device_update": 999,
    }
    b = acc.split_received(counts)
    assert (b.edge, b.cloud, b.control, b.other, b.total) == (30, 7, 7, 1, 45)
    rows = [
        {"round": 0, "bytes": {"received:edge_model": 1}, "cloud_aggregated": False, "arch": "d"},
        {"round": 1, "bytes": {"received:edge_update": 2}, "cloud_aggregated": True, "arch": "p"},
        {"round": 2, "bytes": {"received:edge_model": 3}, "cloud_aggregated": False, "arch": "p"},
        {"round": 3, "bytes": {"received:global_model": 4}, "cloud_aggregated": True, "arch": "p"},
        {"round": 4, "bytes": {"received:edge_model": 5}, "cloud_aggregated": False, "arch": "p"},
    ]
    ps = acc.periods(rows)  # the trailing round 4 never reached the cloud
    assert [(p.first, p.last, p.arch, p.bytes.total) for p in ps] == [
        (0, 1, "d", 3),
        (2, 3, "p", 7),
    ]
    assert acc.steady_periods(ps, "p") == [ps[1]]
    assert acc.steady_periods(ps, "other") == ps
    assert acc.mean_bytes(ps) == acc.LinkBytes(edge=2, cloud=3)


def test_payloads_scaffold_and_usplit() -> None:
    """What travels: SCAFFOLD's uploads are 2x the model; USPLIT pairs upload half."""
    fed = {"num_devices": 4, "num_edges": 2}
    dense = acc.payloads(tiny_config(federation=fed))
    assert dense.payload == 1.0 and dense.up == dense.down
    scaffold = acc.payloads(tiny_config(federation=fed, algorithm={"name": "scaffold"}))
    assert scaffold.payload == 2.0
    usplit = acc.payloads(
        tiny_config(federation=fed, algorithm={"name": "feddiffuse", "split": "usplit"})
    )
    assert usplit.payload == pytest.approx(0.5)
    assert usplit.up == pytest.approx(usplit.down / 2, rel=0.01)


def test_measured_bytes_equal_analytic_udec_after_the_first_round(tmp_path: Path) -> None:
    """FedDiffuse UDEC: from the second period on, every period moves exactly the predicted
    bytes (decoder only, both links); the first adds each role's one whole-model download."""
    cfg = tiny_config(
        run={"rounds": 3},
        federation={"num_devices": 4, "num_edges": 2},
        data={"synthetic_size": 32},
        train={"local_steps": 1, "batch_size": 2},
        algorithm={"name": "feddiffuse", "split": "udec"},
    )
    res = simulate(cfg, tmp_path / "run", progress=False, evaluate=False)
    pl = acc.payloads(cfg)
    whole = acc.encoded_bytes(state_spec(cfg.model.preset))
    decoder = {k: s for k, s in state_spec(cfg.model.preset).items() if part_of(k) == "decoder"}
    assert pl.down == pl.up == pl.edge_state == acc.encoded_bytes(decoder) < whole
    predicted = acc.analytic_period(
        cfg.federation, down=pl.down, up=pl.up, edge_state=pl.edge_state,
        global_state=pl.global_state,
    )  # fmt: skip
    first, *rest = acc.periods(res.rows)
    assert len(rest) == 2
    for p in rest:
        assert (p.bytes.edge, p.bytes.cloud) == (predicted.edge, predicted.cloud)
    extra = whole - pl.down
    assert (first.bytes.edge, first.bytes.cloud) == (
        predicted.edge + 4 * extra,
        predicted.cloud + 2 * extra,
    )


def test_measured_bytes_equal_analytic_fedavg(tmp_path: Path) -> None:
    """A tiny FedAvg run: every central-aggregation period moves exactly the predicted bytes."""
    cfg = tiny_config(
        run={"rounds": 2},
        federation={"num_devices": 4, "num_edges": 2},
        data={"synthetic_size": 32},
        train={"local_steps": 1, "batch_size": 2},
    )
    res = simulate(cfg, tmp_path / "run", progress=False, evaluate=False)
    pl = acc.payloads(cfg)
    predicted = acc.analytic_period(
        cfg.federation,
        down=pl.down,
        up=pl.up,
        edge_state=pl.edge_state,
        global_state=pl.global_state,
    )
    ps = acc.periods(res.rows)
    assert len(ps) == 2
    for p in ps:
        assert (p.bytes.edge, p.bytes.cloud) == (predicted.edge, predicted.cloud)
    # 4 devices x (download + upload) and 2 edges x (upload + download), one model each
    assert predicted.edge == 8 * pl.down and predicted.cloud == 4 * pl.down
    total = acc.split_received(res.traffic["bytes"])
    assert total.edge == 2 * predicted.edge and total.cloud == 2 * predicted.cloud
