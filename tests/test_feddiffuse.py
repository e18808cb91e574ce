"""FedDiffuse (seed 001): the U-Net split, USPLIT's task assignment, partial aggregation,
local parts that persist and train, the paper's communication count, and end-to-end runs."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import UNet2DModel

from estuary.simulate import build_federation
from shared.config import RunConfig
from shared.data.datasets import load_dataset
from shared.data.partition import make_partition
from shared.errors import ConfigError, EstuaryError
from shared.methods.aggregation import fedavg
from shared.methods.base import DeviceContext, Update, build_algorithm
from shared.methods.feddiffuse.config import FedDiffuseConfig
from shared.methods.feddiffuse.method import (
    FEDERATED_PARTS,
    LOCAL_STATE_KEY,
    PARTS,
    FedDiffuse,
    communicated_params,
    part_of,
    part_sizes,
    partial_fedavg,
    usplit_assignment,
    usplit_groups,
)
from shared.models.presets import PRESETS, build_unet, state_spec
from shared.transport.bus import MemoryBus
from shared.wire.codec import encode_tensors, spec_of
from tests.conftest import tiny_config

PEERS = [f"dev{i:03d}" for i in range(7)]


def _cfg(split: str, **overrides: dict) -> RunConfig:  # type: ignore[type-arg]
    return tiny_config(algorithm={"name": "feddiffuse", "split": split}, **overrides)


def _algo(split: str, **overrides: dict) -> FedDiffuse:  # type: ignore[type-arg]
    algo = build_algorithm(_cfg(split, **overrides))
    assert isinstance(algo, FedDiffuse)
    return algo


def _ctx(name: str, peers: list[str], round_: int = 0, seed: int = 0) -> DeviceContext:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    data = torch.rand(16, 1, 32, 32, generator=g) * 2 - 1
    return DeviceContext(
        name, data, torch.zeros(16, dtype=torch.long), g, round_, "edge0", peers, seed
    )


# -- the split ------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_part_of_covers_every_tensor_of_every_preset(preset: str) -> None:
    """Every tensor belongs to one part; parts are non-empty and add up to the model."""
    spec = state_spec(preset)
    parts = {name: part_of(name) for name in spec}
    assert set(parts.values()) == set(PARTS)
    sizes = part_sizes(spec)
    assert sum(sizes.values()) == sum(int(np.prod(s.shape)) for s in spec.values())
    assert part_of("conv_in.weight") == "encoder"
    assert part_of("time_embedding.linear_1.weight") == "encoder"
    assert part_of("down_blocks.0.resnets.0.conv1.weight") == "encoder"
    assert part_of("mid_block.attentions.0.to_q.weight") == "bottleneck"
    assert part_of("up_blocks.0.resnets.0.conv1.weight") == "decoder"
    assert part_of("conv_norm_out.bias") == "decoder"
    assert part_of("conv_out.weight") == "decoder"


def test_part_of_pruned_model_and_unknown_names() -> None:
    """A pruned U-Net (fewer channels, the same names) splits the same way; a tensor outside
    the U-Net is an error that names it."""
    thin = {**PRESETS["ddpm-cifar10"], "block_out_channels": (64, 96, 96, 96)}
    with torch.device("meta"):
        spec = spec_of(UNet2DModel(**thin).state_dict())
    assert set(spec) == set(state_spec("ddpm-cifar10"))
    assert sum(part_sizes(spec).values()) < sum(part_sizes(state_spec("ddpm-cifar10")).values())
    assert {part_of(k) for k in spec} == set(PARTS)
    with pytest.raises(EstuaryError, match=r"scaffold\.c"):
        part_of("scaffold.c.conv_in.weight")


# -- USPLIT task assignment -------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_usplit_groups_partition_the_parts(n: int) -> None:
    """Pairs cover encoder, bottleneck and decoder; the odd device out reports the
    bottleneck plus one half; every device is in exactly one group."""
    peers = PEERS[:n]
    for seed, round_ in [(0, 0), (0, 1), (3, 7), (11, 2)]:
        groups = usplit_groups(peers, seed, round_, "edge0")
        assert sorted(d for g in groups for d in g) == peers
        for g in groups:
            reports = list(g.values())
            if len(g) == 2:
                assert frozenset().union(*reports) == set(PARTS)
                assert sum(len(r) for r in reports) == 3  # disjoint: nothing reported twice
                assert {"encoder", "decoder"} == {p for r in reports for p in r} - {"bottleneck"}
            else:
                assert len(g) == 1 and n % 2 == 1
                (only,) = reports
                assert "bottleneck" in only and len(only) == 2
        assert sum(len(g) == 1 for g in groups) == n % 2


def test_usplit_assignment_is_deterministic_and_shared_by_every_device() -> None:
    """Same (seed, round, edge, peers) -> same tasks, whatever order the peers come in and
    whichever device computes them; other rounds draw other pairs; global RNGs untouched."""
    np_state, torch_state, py_state = (
        np.random.get_state(),
        torch.get_rng_state(),
        random.getstate(),
    )
    a = usplit_assignment(PEERS, 5, 3, "edge1")
    assert a == usplit_assignment(list(reversed(PEERS)), 5, 3, "edge1")
    algo = _algo("usplit")
    for d in PEERS:
        ctx = _ctx(d, list(PEERS), round_=3, seed=5)
        ctx.edge = "edge1"
        assert algo.report_parts(ctx, 3) == a[d]
    others = [usplit_assignment(PEERS, 5, r, "edge1") for r in range(8)]
    assert any(o != a for o in others)
    assert any(usplit_assignment(PEERS, 5, 3, f"edge{e}") != a for e in range(2, 6))
    assert any(usplit_assignment(PEERS, s, 3, "edge1") != a for s in range(6, 10))
    draws = (np.random.random(), torch.rand(1).item(), random.random())
    np.random.set_state(np_state)
    torch.set_rng_state(torch_state)
    random.setstate(py_state)
    assert draws == (np.random.random(), torch.rand(1).item(), random.random())
    with pytest.raises(EstuaryError, match="duplicates"):
        usplit_assignment(["a", "a"], 0, 0, "edge0")
    stranger = _ctx("dev999", list(PEERS))
    with pytest.raises(EstuaryError, match="peers"):
        algo.report_parts(stranger, 0)


def test_usplit_devices_upload_their_assigned_parts() -> None:
    """Three devices at one edge: each uploads exactly its parts, together all of them."""
    algo = _algo("usplit", train={"local_steps": 1, "batch_size": 2})
    peers = PEERS[:3]
    tasks = usplit_assignment(peers, 0, 0, "edge0")
    seen: set[str] = set()
    model, init = build_unet("fmnist-tiny"), build_unet("fmnist-tiny").state_dict()
    for d in peers:
        model.load_state_dict(init)
        result = algo.device_round(_ctx(d, peers), model, 0, upload=True)
        assert result.tensors is not None
        assert {part_of(k) for k in result.tensors} == tasks[d]
        assert set(result.tensors) == {k for k in init if part_of(k) in tasks[d]}
        seen |= set(result.tensors)
    assert seen == set(state_spec("fmnist-tiny"))


# -- aggregation --------------------------------------------------------------------------------
def test_partial_fedavg_hand_computed() -> None:
    """a: (1*[1,2] + 3*[5,6]) / 4 = [4,5]; b: (3*2 + 2*8) / 5 = 4.4; c: nobody -> current."""
    current = {"a": torch.zeros(2), "b": torch.tensor([10.0]), "c": torch.tensor([5.0])}
    states = [
        {"a": torch.tensor([1.0, 2.0])},
        {"a": torch.tensor([5.0, 6.0]), "b": torch.tensor([2.0])},
        {"b": torch.tensor([8.0])},
    ]
    out = partial_fedavg(states, [1, 3, 2], current)
    assert list(out) == ["a", "b", "c"]
    assert torch.allclose(out["a"], torch.tensor([4.0, 5.0]))
    assert torch.allclose(out["b"], torch.tensor([4.4]))
    assert torch.equal(out["c"], current["c"]) and out["c"] is not current["c"]
    algo = _algo("usplit")
    counts = [1, 3, 2]
    updates = [
        Update(f"d{i}", s, n, (n,)) for i, (s, n) in enumerate(zip(states, counts, strict=True))
    ]
    for agg in (algo.edge_aggregate, algo.cloud_aggregate):
        got = agg(updates, current)
        assert all(torch.equal(got[k], out[k]) for k in current)
    with pytest.raises(EstuaryError, match="outside"):
        partial_fedavg([{"z": torch.zeros(1)}], [1], current)


def test_two_tier_usplit_weights_each_part_by_its_reporters() -> None:
    """Edge A: a pair (encoder = 1 from 100 samples, decoder = 1 from 100); edge B: one
    device (bottleneck and decoder = 10, 100 samples). Each part over its reporters:
    encoder 1, bottleneck 10, decoder (100*1 + 100*10) / 200 = 5.5. Weighting whole edges
    by their samples averaged edge B's untouched encoder (0) in and A's stale bottleneck."""
    current = {"down_blocks.w": torch.zeros(1), "mid_block.w": torch.zeros(1),
               "up_blocks.w": torch.zeros(1)}  # fmt: skip
    one, ten = torch.ones(1), torch.full((1,), 10.0)
    edge_a = partial_fedavg(
        [{"down_blocks.w": one}, {"up_blocks.w": one}], [100, 100], current
    )  # the pair's encoder and decoder; the bottleneck stays the global 0
    edge_b = partial_fedavg([{"mid_block.w": ten, "up_blocks.w": ten}], [100], current)
    algo = _algo("usplit")
    updates = [
        Update("a", edge_a, 200, (200,), {"encoder": 100, "bottleneck": 0, "decoder": 100}),
        Update("b", edge_b, 100, (100,), {"encoder": 0, "bottleneck": 100, "decoder": 100}),
    ]
    got = algo.cloud_aggregate(updates, current)
    assert [got[k].item() for k in current] == pytest.approx([1.0, 10.0, 5.5])
    # without part counts (an EdgeUpdate may omit them): whole edges weighted by n_samples
    legacy = algo.cloud_aggregate([Update(u.source, u.tensors, u.n_samples, u.label_counts)
                                   for u in updates], current)  # fmt: skip
    assert [legacy[k].item() for k in current] == pytest.approx([2 / 3, 10 / 3, 4.0])
    # a part nobody reported anywhere keeps the current global
    none = [Update(u.source, u.tensors, u.n_samples, u.label_counts, dict.fromkeys(PARTS, 0))
            for u in updates]  # fmt: skip
    assert all(torch.equal(v, current[k]) for k, v in algo.cloud_aggregate(none, current).items())


def test_partial_fedavg_of_complete_states_is_fedavg() -> None:
    """FULL: every state complete -> exactly shared.methods.aggregation.fedavg."""
    g = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(3, 3, generator=g), "b": torch.randn(3, generator=g)} for _ in "ab"]
    states.append({"w": torch.ones(3, 3), "b": torch.zeros(3)})
    current = {"w": torch.zeros(3, 3), "b": torch.zeros(3)}
    got, ref = partial_fedavg(states, [5, 1, 2], current), fedavg(states, [5, 1, 2])
    assert all(torch.equal(got[k], ref[k]) for k in current)


# -- local parts ------------------------------------------------------------------------------
@pytest.mark.parametrize("split", ["ulatdec", "udec"])
def test_local_parts_persist_across_rounds_and_train(split: str) -> None:
    """Round 0 starts from the global init; later rounds load only the federated parts and
    keep the device's own local parts, which change with training (never frozen)."""
    algo = _algo(split, train={"local_steps": 1, "batch_size": 2})
    fed = FEDERATED_PARTS[split]  # type: ignore[index]
    spec = state_spec("fmnist-tiny")
    assert set(algo.upload_spec(spec)) == {k for k in spec if part_of(k) in fed}
    ctx, model = _ctx("dev000", ["dev000"]), build_unet("fmnist-tiny", seed=1)
    init = build_unet("fmnist-tiny").state_dict()
    algo.device_load(ctx, model, init)
    assert all(torch.equal(v, init[k]) for k, v in model.state_dict().items())
    result = algo.device_round(ctx, model, 0, upload=True)
    assert result.tensors is not None and {part_of(k) for k in result.tensors} == fed
    local0 = {k: v.clone() for k, v in ctx.state[LOCAL_STATE_KEY].items()}
    assert {part_of(k) for k in local0} == set(PARTS) - fed
    assert any(not torch.equal(v, init[k]) for k, v in local0.items())  # trained locally

    edge_state = build_unet("fmnist-tiny", seed=2).state_dict()  # next edge model: all new
    algo.device_load(ctx, model, edge_state)
    for k, v in model.state_dict().items():
        assert torch.equal(v, edge_state[k] if part_of(k) in fed else local0[k]), k
    algo.device_round(ctx, model, 1, upload=False)
    local1 = ctx.state[LOCAL_STATE_KEY]
    assert any(not torch.equal(local1[k], local0[k]) for k in local0)  # still training


def test_full_and_usplit_load_the_whole_edge_model() -> None:
    """Without local parts the edge model replaces everything, every round."""
    for split in ("full", "usplit"):
        algo = _algo(split)
        ctx, model = _ctx("dev000", ["dev000"]), build_unet("fmnist-tiny", seed=1)
        ctx.state[LOCAL_STATE_KEY] = {}
        state = build_unet("fmnist-tiny", seed=2).state_dict()
        algo.device_load(ctx, model, state)
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        assert algo.traffic.uplink == ("parts" if split == "usplit" else "state")
        assert algo.upload_spec(state_spec("fmnist-tiny")) == state_spec("fmnist-tiny")


# -- communication (paper section 4 and Table 1) ------------------------------------------------
@pytest.mark.parametrize("preset", ["ddpm-cifar10", "fmnist-tiny"])
def test_usplit_communicates_exactly_three_quarters_of_full(preset: str) -> None:
    spec = state_spec(preset)
    for k in (2, 4, 10, [4, 4], [2, 6, 8]):
        full = communicated_params("full", spec, k, 15)
        usplit = communicated_params("usplit", spec, k, 15)
        assert 4 * usplit["total"] == 3 * full["total"]
        assert usplit["reduction"] == 0.25 and usplit["downlink"] == full["downlink"]


def test_communicated_params_hand_computed() -> None:
    """|enc| = 10, |bot| = 5, |dec| = 20, K = 3: FULL 2*3*35; USPLIT 3*35 down and one pair
    (35) + the odd device (5 + enc or dec) up; ULATDEC 2*3*25; UDEC 2*3*20."""
    sizes = {"encoder": 10, "bottleneck": 5, "decoder": 20}
    total = {v: communicated_params(v, sizes, 3)["total"] for v in FEDERATED_PARTS}
    assert total == {"full": 210, "usplit": 105 + 35 + 20, "ulatdec": 150, "udec": 120}
    enc = communicated_params("usplit", sizes, 3, 2, odd_half="encoder")
    assert enc["uplink_per_round"] == 50 and enc["total"] == 2 * 155
    assert communicated_params("usplit", sizes, 3, odd_half="decoder")["uplink"] == 60
    odd = communicated_params("usplit", {"encoder": 1, "bottleneck": 0, "decoder": 0}, 1)
    assert odd["uplink"] == 0.5  # expected value of a coin flip between 1 and 0
    with pytest.raises(ConfigError, match="variant"):
        communicated_params("split", sizes, 2)


def test_communicated_params_reproduce_paper_table_1() -> None:
    """Paper Table 1 (R = 15, |theta| = 2,996,315), N in 10^6 for K = 2 / 5 / 10: FULL
    179.78 / 449.45 / 898.89, USPLIT 134.83 / - / 674.17, ULATDEC 105.50 / 263.75, UDEC
    47.54 / 118.85 / 237.69. The paper gives no per-part sizes; these are the ones its rows
    imply (|dec| in [792,300, 792,316], |dec| + |bot| in [1,758,300, 1,758,366]). USPLIT with
    K = 5 depends on the odd device's coin flips, so it has no exact row."""
    sizes = {"encoder": 1_237_982, "bottleneck": 966_023, "decoder": 792_310}
    assert sum(sizes.values()) == 2_996_315
    table = {
        ("full", 2): 179.78,
        ("full", 5): 449.45,
        ("full", 10): 898.89,
        ("usplit", 2): 134.83,
        ("usplit", 10): 674.17,
        ("ulatdec", 2): 105.50,
        ("ulatdec", 5): 263.75,
        ("udec", 2): 47.54,
        ("udec", 5): 118.85,
        ("udec", 10): 237.69,
    }
    got = {(v, k): round(communicated_params(v, sizes, k, 15)["total"] / 1e6, 2) for v, k in table}
    assert got == table


# -- end to end over MemoryBus ------------------------------------------------------------------
def _three_devices_two_edges(split: str, *, rounds: int) -> tuple[RunConfig, MemoryBus, Any]:
    """A FedDiffuse federation of 3 devices behind 2 edges, one local step per round."""
    cfg = _cfg(
        split,
        run={"rounds": rounds},
        federation={"num_devices": 3, "num_edges": 2},
        train={"local_steps": 1, "batch_size": 2},
    )
    data = load_dataset("synthetic", size=cfg.data.synthetic_size, seed=cfg.run.seed)
    parts = make_partition(data.labels, cfg.federation.num_devices, cfg.data, cfg.run.seed)
    bus = MemoryBus()
    return cfg, bus, build_federation(cfg, bus, data, parts)


@pytest.mark.parametrize("split", ["full", "usplit", "ulatdec", "udec"])
def test_end_to_end_memory_bus(split: str) -> None:
    """3 devices behind 2 edges (a pair, and a device alone: USPLIT's odd one out), 2 rounds:
    the run completes, the global model moves in the federated parts only, local parts live
    trained on the devices, and the uplink carries what the paper's count says."""
    cfg, bus, fed = _three_devices_two_edges(split, rounds=2)
    fed.start()
    assert bus.run(lambda: fed.cloud.done)
    init = build_unet(cfg.model.preset, seed=cfg.run.seed).state_dict()
    final = fed.cloud.model
    assert final is not None and set(final) == set(init)
    moved = {part_of(k) for k in init if not torch.equal(final[k], init[k])}
    assert moved == FEDERATED_PARTS[split]  # type: ignore[index]
    for device in fed.devices:  # local parts live on the device, trained
        local = device.algo_state.get(LOCAL_STATE_KEY, {})
        assert {part_of(k) for k in local} == set(PARTS) - moved
        assert all(not torch.equal(v, init[k]) for k, v in local.items())
    # uplink bytes = the paper's count (edge0: a pair, edge1: one device) x 4 bytes + headers
    up = bus.traffic.snapshot()["bytes"]["sent:device_update"]
    lo, hi = (
        4 * communicated_params(split, init, [2, 1], 2, odd_half=h)["uplink"]
        for h in ("encoder", "decoder")
    )
    headers = 6 * (len(encode_tensors(init)) - 4 * sum(v.numel() for v in init.values()))
    assert min(lo, hi) < up <= max(lo, hi) + headers


@pytest.mark.parametrize("split", ["full", "usplit", "ulatdec", "udec"])
def test_local_parts_never_travel_after_the_first_download(split: str) -> None:
    """ULATDEC/UDEC: a device downloads the whole edge model once (the shared init of its
    local parts), then only the federated parts; edges upload and, holding the rest,
    download only the federated parts too, checked byte for byte against the global blob.
    FULL/USPLIT move whole models. 3 rounds, 3 devices behind 2 edges, a cloud round each."""
    cfg, bus, fed = _three_devices_two_edges(split, rounds=3)
    fed.start()
    assert bus.run(lambda: fed.cloud.done)
    snap = bus.traffic.snapshot()
    assert not snap["rejected"], snap["rejected"]
    init = build_unet(cfg.model.preset, seed=cfg.run.seed).state_dict()
    fed_parts = FEDERATED_PARTS[split]  # type: ignore[index]
    whole = len(encode_tensors(init))
    shared = len(encode_tensors({k: v for k, v in init.items() if part_of(k) in fed_parts}))
    got = snap["bytes"]
    if split in ("full", "usplit"):
        assert shared == whole
    else:
        assert shared < whole
    # each of the 3 devices: round 0 the whole model, rounds 1-2 the shared part
    assert got["received:edge_model"] == 3 * whole + 6 * shared
    # each of the 2 edges: the initial global whole, then the two new globals' shared part
    assert got["received:global_model"] == 2 * whole + 4 * shared
    # a blob counts as sent once, when first fetched: the whole globals of rounds 1-2 (and
    # the shared one of round 0) were put beside the others but never moved
    assert got["sent:global_model"] == (whole + 2 * shared if shared < whole else 3 * whole)
    if split != "usplit":  # USPLIT edges carry every part (some devices report each)
        assert got["received:edge_update"] == 2 * 3 * shared
    final = fed.cloud.model
    assert final is not None
    for k, v in init.items():  # the global's local parts stay the initial ones, exactly
        assert part_of(k) in fed_parts or torch.equal(final[k], v), k


def test_an_edge_whose_rest_differs_fetches_the_whole_global_and_a_fresh_device_too() -> None:
    """The shared-only download is a shortcut, never a source of truth: an edge whose local
    copy differs from the global's is caught by the global blob's hash (rejected as
    ``shared_mismatch``, counted) and fetches the whole state; a device that lost its local
    parts (a restart) downloads the whole edge model again."""
    cfg, bus, fed = _three_devices_two_edges("udec", rounds=2)
    fed.start()
    assert bus.run(lambda: fed.cloud.round >= 1)
    edge = fed.edges[0]
    assert edge.model is not None
    name = next(k for k in edge.model if part_of(k) == "encoder")
    edge.model = {**edge.model, name: edge.model[name] + 1.0}  # drifted from the global
    fed.devices[0].algo_state.clear()  # as after a restart
    before = bus.traffic.snapshot()["bytes"]
    assert bus.run(lambda: fed.cloud.done)
    snap = bus.traffic.snapshot()
    assert snap["rejected"] == {"edge:shared_mismatch": 1}, snap["rejected"]
    init = build_unet(cfg.model.preset, seed=cfg.run.seed).state_dict()
    whole = len(encode_tensors(init))
    shared = len(encode_tensors({k: v for k, v in init.items() if part_of(k) == "decoder"}))
    got = {k: snap["bytes"][k] - before.get(k, 0) for k in ("received:global_model",
                                                            "received:edge_model")}  # fmt: skip
    assert got == {
        "received:global_model": 2 * shared + whole,  # both try the shortcut; edge0 falls back
        "received:edge_model": whole + 2 * shared,  # device 0 starts over
    }
    assert edge.model is not None and torch.equal(edge.model[name], init[name])


def test_usplit_global_is_each_part_averaged_over_its_reporters() -> None:
    """Over the hierarchy (3 devices behind 2 edges, so one edge reports a part its peer
    edge does not) one round's global model equals the flat per-part FedAvg over the devices
    (the paper's federator), to float rounding."""
    cfg, bus, fed = _three_devices_two_edges("usplit", rounds=1)
    sent: list[tuple[dict[str, torch.Tensor], int]] = []
    algo_cls = type(build_algorithm(cfg))
    original = algo_cls.device_round

    def spy(self, ctx, model, round_, *, upload):  # type: ignore[no-untyped-def]
        result = original(self, ctx, model, round_, upload=upload)
        sent.append((result.tensors, len(ctx.data)))
        return result

    init = {k: v.clone() for k, v in build_unet(cfg.model.preset, seed=cfg.run.seed)
            .state_dict().items()}  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(algo_cls, "device_round", spy)
        fed.start()
        assert bus.run(lambda: fed.cloud.done)
    reported = [{part_of(k) for k in t} for t, _ in sent]
    assert len(sent) == 3 and not all(r == set(PARTS) for r in reported)
    flat = partial_fedavg([t for t, _ in sent], [n for _, n in sent], init)
    final = fed.cloud.model
    assert final is not None
    for k in init:
        assert torch.allclose(final[k], flat[k], rtol=0, atol=1e-6), k


@pytest.mark.parametrize("assignment", ["select", "random"])
def test_usplit_refuses_devices_choosing_their_edge(assignment: str) -> None:
    """USPLIT pairs within an edge; with devices picking edges mid-round a pair could straddle
    two edges and leave an edge without some part, so the config is refused up front."""
    with pytest.raises(ConfigError, match="USPLIT pairs the devices within each edge"):
        _cfg("usplit", federation={"assignment": assignment})
    for split in ("full", "ulatdec", "udec"):  # no pairing: any assignment works
        cfg = _cfg(split, federation={"assignment": assignment})
        assert FedDiffuseConfig.of(cfg).split == split


def test_ulatdec_and_udec_are_evaluated_at_the_client_level(tmp_path: Path) -> None:
    """The paper measures ULATDEC/UDEC "on client level, given that the federator only had
    access to partial models": in-process runs evaluate the first ``eval.clients`` devices'
    own models (global federated parts + their local parts) and average them."""
    from estuary.simulate import client_modules, simulate

    small = {
        "run": {"rounds": 1},
        "federation": {"num_devices": 3, "num_edges": 2},
        "train": {"local_steps": 1, "batch_size": 2},
        "eval": {"every": 1, "num_samples": 10, "num_reference": 20, "sample_steps": 2,
                 "clients": 2},
    }  # fmt: skip
    res = simulate(_cfg("udec", **small), tmp_path / "udec", progress=False)
    q = res.rows[-1]["quality"]
    assert q["level"] == "client" and sorted(q["clients"]) == ["dev000", "dev001"]
    fids = [c["fid"] for c in q["clients"].values()]
    assert q["fid"] == pytest.approx(np.mean(fids)) and q["fid_std"] == pytest.approx(np.std(fids))
    full = simulate(_cfg("full", **small), tmp_path / "full", progress=False)
    assert "level" not in full.rows[-1]["quality"]  # the global model is every client's

    _, bus, fed = _three_devices_two_edges("udec", rounds=1)
    assert client_modules(fed, 5) == {}  # nobody holds local parts before training
    fed.start()
    assert bus.run(lambda: fed.cloud.done)
    models = client_modules(fed, 2)
    assert list(models) == ["dev000", "dev001"]
    for name, module in models.items():
        local = next(d for d in fed.devices if d.name == name).algo_state[LOCAL_STATE_KEY]
        for k, v in module.state_dict().items():
            assert torch.equal(v, fed.cloud.model[k] if part_of(k) == "decoder" else local[k])
    # a device without local parts (it missed every round) stays in the set, with the
    # global model, which is what it generates with
    del fed.devices[0].algo_state[LOCAL_STATE_KEY]
    models = client_modules(fed, 2)
    assert list(models) == ["dev000", "dev001"]
    for k, v in models["dev000"].state_dict().items():
        assert torch.equal(v, fed.cloud.model[k])
