"""End-to-end runs of the in-process federation (the same services that run over MQTT)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from cloud import RoundSummary
from estuary.simulate import build_federation, simulate
from shared.data.datasets import load_dataset
from shared.data.partition import make_partition
from shared.models.checkpoint import latest_checkpoint_path, load_checkpoint
from shared.models.presets import build_unet
from shared.transport.bus import MemoryBus
from shared.wire.codec import encode_tensors
from shared.wire.messages import DeviceHello, DeviceUpdate, Topics, decode, encode
from tests.conftest import needs_fmnist, tiny_config

MODEL_BYTES = len(encode_tensors(build_unet("fmnist-tiny").state_dict()))


@needs_fmnist
def test_smoke_fmnist_tiny(tmp_path: Path) -> None:
    """2 edges x 4 devices x 3 rounds on Fashion-MNIST: loss falls, bytes add up, another
    seed another model."""
    cfg = tiny_config(
        data={"dataset": "fashion-mnist", "max_samples_per_device": 64},
        train={"local_steps": 3, "batch_size": 16, "lr": 2e-3},
    )
    a = simulate(cfg, tmp_path / "a", progress=False)
    losses = [r["train_loss"] for r in a.rows]
    assert len(losses) == 3 and losses[-1] < losses[0]

    received = {k: v for k, v in a.traffic["bytes"].items() if k.startswith("received:")}
    assert received["received:device_update"] == MODEL_BYTES * 8 * 3
    assert received["received:edge_model"] == MODEL_BYTES * 8 * 3
    assert received["received:edge_update"] == MODEL_BYTES * 2 * 3
    assert received["received:global_model"] == MODEL_BYTES * 2 * 3
    assert a.traffic["bytes"]["sent:device_update"] == MODEL_BYTES * 8 * 3
    per_round = [r["bytes_up"] for r in a.rows]
    assert all(b >= MODEL_BYTES * (8 + 2) for b in per_round)

    for name in ("config.json", "metrics.jsonl", "report.png", "label_counts.csv", "summary.json"):
        assert (a.run_dir / name).is_file(), name
    rows = [json.loads(x) for x in (a.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]  # counted from 1, like the bar and logs
    assert sorted(p.name for p in (a.run_dir / "checkpoints").glob("round_*")) == [
        f"round_{r:06d}.safetensors" for r in (1, 2, 3)
    ]
    ckpt = load_checkpoint(latest_checkpoint_path(a.run_dir / "checkpoints"))  # type: ignore[arg-type]
    assert ckpt.round == 2 and ckpt.path.name == "round_000003.safetensors"
    assert ckpt.model_sha256 == a.final_model_sha256
    assert ckpt.config == cfg

    # the same seed again gives the same model: tests/test_resume.py (--fresh reruns)
    c = simulate(tiny_config(**{**{"run": {"seed": 1}}}), tmp_path / "c", progress=False)
    assert c.final_model_sha256 != a.final_model_sha256


def _federation(cfg, bus, summaries):  # type: ignore[no-untyped-def]
    data = load_dataset("synthetic", size=cfg.data.synthetic_size, seed=cfg.run.seed)
    parts = make_partition(data.labels, cfg.federation.num_devices, cfg.data, cfg.run.seed)
    return build_federation(cfg, bus, data, parts, on_round_end=summaries.append)


def test_dead_device_does_not_stall_the_round() -> None:
    """A registered device that never answers: edges close at the deadline, run completes."""
    cfg = tiny_config(federation={"num_devices": 5, "num_edges": 2, "min_updates": 1})
    bus, summaries = MemoryBus(), list[RoundSummary]()
    fed = _federation(cfg, bus, summaries)
    fed.devices.pop()  # dev004 registers (below) but never trains
    fed.start()
    ghost = DeviceHello(device="dev004", home_edge="edge0", n_samples=10, label_counts=[1] * 10)
    bus.endpoint("ghost").publish(Topics("test").device_hello("dev004"), encode(ghost), kind="x")
    assert bus.run(lambda: fed.cloud.done)
    assert [s.participants for s in summaries] == [5, 5, 5]
    assert [s.updates for s in summaries] == [4, 4, 4]
    assert bus.now() >= 3 * cfg.federation.round_deadline_s  # waited (virtually) each round


def test_duplicate_and_late_updates_are_ignored() -> None:
    """Replaying every device update (duplicates, then late) leaves the model unchanged."""
    cfg = tiny_config()
    clean_bus, clean = MemoryBus(), list[RoundSummary]()
    ref = _federation(cfg, clean_bus, clean)
    ref.start()
    clean_bus.run(lambda: ref.cloud.done)

    bus, summaries = MemoryBus(), list[RoundSummary]()
    fed = _federation(cfg, bus, summaries)
    attacker = bus.endpoint("replay")
    seen: list[tuple[str, bytes]] = []

    def replay(topic: str, payload: bytes) -> None:
        msg = decode(payload, DeviceUpdate)
        if msg.round == 1 and not seen:
            # replay everything from round 0 (late) and this update itself (duplicate)
            for t, p in [*captured, (topic, payload)]:
                seen.append((t, p))
                attacker.publish(t, p, kind="replay")
        captured.append((topic, payload))

    captured: list[tuple[str, bytes]] = []
    attacker.subscribe(Topics("test").all_device_up, replay, kind="replay")
    fed.start()
    assert bus.run(lambda: fed.cloud.done)
    rejected = bus.traffic.snapshot()["rejected"]
    assert rejected.get("edge:late", 0) == 8  # each round-0 update, at its own edge
    assert rejected.get("edge:duplicate", 0) == 1
    assert fed.cloud.model_sha == ref.cloud.model_sha


def test_flat_fl_partial_participation_and_rg() -> None:
    """One edge (flat FL), kappa = 0.5, cloud aggregation every 2 rounds."""
    cfg = tiny_config(
        run={"rounds": 4},
        federation={"num_devices": 6, "num_edges": 1, "participation": 0.5, "cloud_every": 2},
    )
    bus, summaries = MemoryBus(), list[RoundSummary]()
    fed = _federation(cfg, bus, summaries)
    fed.start()
    assert bus.run(lambda: fed.cloud.done)
    assert [s.participants for s in summaries] == [3, 3, 3, 3]
    assert [s.cloud_aggregated for s in summaries] == [False, True, False, True]
    b = bus.traffic.snapshot()["bytes"]
    assert b["received:global_model"] == MODEL_BYTES * 2  # rounds 0 and 2
    assert b["received:edge_update"] == MODEL_BYTES * 2  # rounds 1 and 3


def test_edge_every_two_rounds_devices_continue_locally() -> None:
    """r_e = 2: devices keep training their own model between edge aggregations."""
    cfg = tiny_config(run={"rounds": 4}, federation={"edge_every": 2, "cloud_every": 2})
    bus, summaries = MemoryBus(), list[RoundSummary]()
    fed = _federation(cfg, bus, summaries)
    fed.start()
    assert bus.run(lambda: fed.cloud.done)
    b = bus.traffic.snapshot()["bytes"]
    assert b["received:device_update"] == MODEL_BYTES * 8 * 2  # uploads on rounds 1 and 3 only
    assert b["received:edge_model"] == MODEL_BYTES * 8 * 2  # downloads on rounds 0 and 2 only
    assert all(isinstance(s, RoundSummary) for s in summaries)


def test_bad_update_rejected_round_still_completes() -> None:
    """A device update whose blob holds NaN is rejected and counted; the run finishes."""
    cfg = tiny_config(run={"rounds": 1})
    bus, summaries = MemoryBus(), list[RoundSummary]()
    fed = _federation(cfg, bus, summaries)
    victim = fed.devices[0]
    original = victim.algorithm.device_round

    def poisoned(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = original(*args, **kwargs)
        name = next(iter(out.tensors))
        out.tensors[name] = torch.full_like(out.tensors[name], float("nan"))
        return out

    victim.algorithm.device_round = poisoned  # type: ignore[method-assign]
    fed.start()
    assert bus.run(lambda: fed.cloud.done)
    assert bus.traffic.snapshot()["rejected"]["edge:bad_tensors"] == 1
    assert summaries[0].updates == 7
    assert np.isfinite(float(next(iter(fed.cloud.model.values())).sum()))


def test_edge_state_is_retained_for_late_joiners() -> None:
    """After a run, a newcomer reading edge state gets the accumulated label counts."""
    cfg = tiny_config(run={"rounds": 2}, federation={"cloud_every": 2})
    bus, summaries = MemoryBus(), list[RoundSummary]()
    fed = _federation(cfg, bus, summaries)
    fed.start()
    assert bus.run(lambda: fed.cloud.done)
    got: list[bytes] = []
    bus.endpoint("late").subscribe(Topics("test").edge_state("edge0"), lambda t, p: got.append(p))
    bus.run(lambda: bool(got))
    state = decode(got[0])
    served = [d for d in fed.devices if d.home_edge == "edge0"]
    # counts accumulate over both rounds (no cloud aggregation reset in between)
    per_class = zip(*(d.label_counts for d in served), strict=True)
    assert state.label_counts == [2 * sum(c) for c in per_class]
    assert state.round == 1 and state.devices_last_round == len(served)
