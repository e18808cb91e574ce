"""Streaming aggregation and the machinery that keeps a round's critical path short: the
running weighted sum gives one result whatever order the updates arrive in (and today's batch
FedAvg to float32 rounding), an edge keeps a running sum instead of its devices' updates,
checkpoints are written in order off the role's thread, blob-store disk copies are written
by a writer thread without losing a blob, and the round trace records a role's events."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.errors import EstuaryError
from shared.methods.aggregation import WeightedSum, fedavg, weighted_average
from shared.methods.base import HeldFold, MeanFold, Update, build_algorithm
from shared.models.checkpoint import CheckpointWriter
from shared.runtime.trace import ENV_DIR, Trace
from shared.transport import blobs
from shared.transport.blobs import BlobStore
from shared.wire.codec import MappedBlob, sha256_hex
from tests.conftest import tiny_config


def _states(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` states with values over many magnitudes (where float sums depend on order)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        scale = 10.0 ** torch.randint(-9, 4, (4096,), generator=g).float()
        sign = torch.randint(0, 2, (4096,), generator=g).float() * 2 - 1
        out.append({
            "w": torch.randn(4096, generator=g) * scale * sign,
            "steps": torch.tensor([i], dtype=torch.int64),
        })  # fmt: skip
    return out


def test_weighted_sum_is_the_same_in_every_order() -> None:
    states, n = _states(5), [3, 700, 12, 5, 999]
    results = set()
    for perm in itertools.permutations(range(5)):
        acc = WeightedSum()
        for i in perm:
            acc.add(states[i], float(n[i]), key=f"dev{i:03d}")
        mean = acc.mean()
        assert mean["steps"].item() == 0  # non-float tensors: the smallest key's
        assert mean["w"].dtype == torch.float32
        results.add(mean["w"].numpy().tobytes())
    assert len(results) == 1
    # the batch average (float64, normalized weights, one order) agrees to float32 rounding
    batch = weighted_average(states, [float(x) for x in n])["w"]
    streamed = fedavg(states, n)["w"]
    assert torch.allclose(streamed, batch, rtol=2**-23, atol=0)


def test_the_pair_gives_the_exact_mean_where_a_float64_sum_depends_on_the_order() -> None:
    """Four float32 values, weight 1 each, whose exact mean 1 + 2**-24 + 2**-52 lies just
    above a float32 rounding midpoint. A plain float64 running sum loses the two 2**-51
    terms in one order (each is half an ulp of 4: ties to even) and keeps them in another,
    so the float32 means differ; the pair gives the correctly rounded mean in every order."""
    values = [4.0, 2.0**-51, 2.0**-51, 2.0**-22]
    states = [{"w": torch.tensor([v], dtype=torch.float32)} for v in values]
    plain = set()
    for perm in itertools.permutations(range(4)):
        acc = torch.zeros(1, dtype=torch.float64)
        for i in perm:
            acc += states[i]["w"].double()
        plain.add(float((acc / 4).float()))
    assert plain == {1.0, 1.0 + 2.0**-23}  # the order decides, without the pair
    paired = set()
    for perm in itertools.permutations(range(4)):
        ws = WeightedSum()
        for i in perm:
            ws.add(states[i], 1.0, key=str(i))
        paired.add(float(ws.mean()["w"]))
    assert paired == {1.0 + 2.0**-23}


def test_weighted_sum_refuses_what_cannot_be_averaged() -> None:
    acc = WeightedSum()
    with pytest.raises(EstuaryError, match="zero updates"):
        acc.mean()
    acc.add({"a": torch.ones(2)}, 0.0)
    with pytest.raises(EstuaryError, match="sum to zero"):
        acc.mean()
    with pytest.raises(EstuaryError, match="different tensor names"):
        acc.add({"b": torch.ones(2)}, 1.0)
    with pytest.raises(EstuaryError, match="shape"):
        acc.add({"a": torch.ones(3)}, 1.0)
    with pytest.raises(EstuaryError, match="finite"):
        acc.add({"a": torch.ones(2)}, float("nan"))


@pytest.mark.parametrize("name", ["fedavg", "scaffold"])
def test_streaming_folds_match_in_any_order(name: str) -> None:
    """FedAvg's and SCAFFOLD's folds stream, and give one model in any order of arrival."""
    cfg = tiny_config(algorithm={"name": name}, federation={"num_devices": 4, "num_edges": 1})
    algo = build_algorithm(cfg)
    spec_model = {k: v.clone() for k, v in _model(cfg).items()}
    current = algo.init_global(spec_model)
    g = torch.Generator().manual_seed(1)
    base = _upload(algo, current)
    updates = [
        Update(f"dev{i:03d}", {k: v + torch.randn(v.shape, generator=g) * 1e-3
                               if v.is_floating_point() else v for k, v in base.items()},
               n_samples=10 + 7 * i, label_counts=(10 + 7 * i,) + (0,) * 9)
        for i in range(4)
    ]  # fmt: skip
    fold = algo.edge_fold(current)
    assert fold.streams
    hashes = set()
    for perm in itertools.permutations(range(4)):
        fold = algo.edge_fold(current)
        for i in perm:
            fold.add(updates[i])
        out = fold.result()
        hashes.add(sha256_hex(b"".join(out[k].numpy().tobytes() for k in sorted(out))))
    assert len(hashes) == 1
    assert set(out) == set(current)


def _model(cfg: Any) -> dict[str, torch.Tensor]:
    from shared.models.plan import build_model

    return dict(build_model(cfg.model.preset, None, seed=0).state_dict())


def _upload(algo: Any, current: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors of a device's upload of ``algo`` (every name its upload spec has)."""
    from shared.wire.codec import spec_of

    spec = algo.upload_spec(spec_of(current))
    return {k: current[k].clone() if k in current else torch.zeros(s.shape, dtype=s.dtype)
            for k, s in spec.items()}  # fmt: skip


def test_held_fold_hands_sorted_updates() -> None:
    got: list[str] = []

    def combine(updates: Any) -> dict[str, torch.Tensor]:
        got.extend(u.source for u in updates)
        return {}

    fold = HeldFold(combine)
    for name in ("dev002", "dev000", "dev001"):
        fold.add(Update(name, {}, 1, (1,) + (0,) * 9))
    fold.result()
    assert not fold.streams and got == ["dev000", "dev001", "dev002"] and len(fold) == 3
    assert MeanFold.streams


def test_an_edge_keeps_a_running_sum_not_the_updates() -> None:
    """Over a MemoryBus: after every update of a FedAvg round arrived, the edge holds no
    update's tensors, and its model is the weighted mean of what the devices sent."""
    from tests.test_edge_robustness import _hierarchy, _open

    bus, edge, cloud, devs, sent = _hierarchy()
    _open(bus, edge, cloud, 0)
    for dev in devs:
        dev.report(0)
    bus.run(lambda: False)
    assert [r.round for r in sent] == [0]
    assert set(edge.updates) == {"dev000", "dev001"}
    assert all(u.tensors == {} for u in edge.updates.values())


def test_checkpoint_writes_run_in_order_and_errors_reach_the_caller(tmp_path: Path) -> None:
    writer = CheckpointWriter(background=True)
    order: list[int] = []
    for i in range(5):
        writer.write(functools.partial(order.append, i))
    writer.wait()
    assert order == [0, 1, 2, 3, 4]

    def fail() -> None:
        raise OSError("disk full")

    writer.write(fail)
    with pytest.raises(OSError, match="disk full"):
        writer.wait()
    writer.wait()  # reported once


def test_blob_disk_copies_are_written_by_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = BlobStore(tmp_path / "cache", memory_limit_bytes=100)
    data = [bytes([i]) * 80 for i in range(4)]
    shas = [store.put(d) for d in data]
    for sha, d in zip(shas, data, strict=True):  # from memory, the pending queue or disk
        assert store.get(sha) == d and store.has(sha) and store.size(sha) == len(d)
    assert store.flush(10)
    assert all((tmp_path / "cache" / s[:2] / s).read_bytes() == d
               for s, d in zip(shas, data, strict=True))  # fmt: skip
    # past the pending-bytes bound a put writes its copy itself
    monkeypatch.setattr(blobs, "MAX_PENDING_WRITE_BYTES", 0)
    sha = store.put(b"x" * 50)
    assert (tmp_path / "cache" / sha[:2] / sha).is_file()


def test_round_trace_writes_events_and_stops_at_its_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_DIR, raising=False)
    assert not Trace("edge0").enabled  # off unless asked for
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    trace = Trace("edge0")
    trace.event("announce", 3, devices=4)
    lines = (tmp_path / "edge0.jsonl").read_text().splitlines()
    event = json.loads(lines[0])
    assert event["who"] == "edge0" and event["ev"] == "announce" and event["round"] == 3
    assert event["devices"] == 4
    from shared.runtime import trace as trace_mod

    monkeypatch.setattr(trace_mod, "MAX_TRACE_BYTES", len(lines[0]) + 10)
    trace.event("reported", 3)
    assert not trace.enabled
    assert len((tmp_path / "edge0.jsonl").read_text().splitlines()) == 1


def _announced(bus: Any, edge: Any) -> Any:
    """The EdgeRound the edge left retained for its devices."""
    from shared.wire.messages import EdgeRound, decode

    got: list[Any] = []
    bus.endpoint("probe", "device/probe").subscribe(
        edge.topics.edge_round("edge0"), lambda _t, p: got.append(decode(p, EdgeRound)), kind="x"
    )
    bus.run(lambda: bool(got))
    return got[-1]


def test_an_edge_serves_the_globals_own_bytes_and_reads_its_model_in_place() -> None:
    """FedAvg: the edge announces the blob it downloaded (same hash, served by the edge:
    nothing encoded again), and its model is a read-only view of those bytes."""
    from tests.test_edge_robustness import _hierarchy, _open

    bus, edge, cloud, _, _ = _hierarchy()
    _open(bus, edge, cloud, 0)
    announced = _announced(bus, edge)
    assert announced.model_ref.src == "edge/edge0"
    assert announced.model_ref.sha256 == edge.global_sha
    assert edge.model is not None  # views into one buffer: the downloaded blob itself
    ptrs = [t.data_ptr() for t in edge.model.values() if t.numel()]
    assert max(ptrs) - min(ptrs) < announced.model_ref.size


def test_a_stateful_fold_gets_the_edges_model() -> None:
    """SCAFFOLD's fold reads the edge's control variate: it streams, from the edge's model."""
    from tests.test_edge_robustness import _hierarchy, _open

    bus, edge, cloud, _, _ = _hierarchy()
    edge.algorithm = build_algorithm(tiny_config(algorithm={"name": "scaffold"}))
    assert not edge.algorithm.aggregation_stateless
    edge._set_arch(None)
    ref = cloud.put_tensors(edge.algorithm.init_global(_model(edge.cfg)), "global_model")
    _open(bus, edge, cloud, 0, ref=ref)
    assert edge.model is not None and edge.fold is not None and edge.fold.streams
    assert _announced(bus, edge).model_ref.sha256 == ref.sha256


def test_a_released_blob_leaves_memory_only_where_disk_keeps_it(tmp_path: Path) -> None:
    on_disk = BlobStore(tmp_path / "cache")
    sha = on_disk.put(b"y" * 100)
    assert on_disk.release(sha) and on_disk.get(sha) == b"y" * 100  # read back from disk
    memory_only = BlobStore(None)
    sha = memory_only.put(b"z" * 100)
    assert not memory_only.release(sha) and memory_only.get(sha) == b"z" * 100


def test_the_allocator_is_tuned_on_glibc() -> None:
    import platform

    from shared.runtime.memory import release_memory, tune_allocator

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert tune_allocator()
    release_memory()


@pytest.mark.parametrize("weight", [1.0, 3.0, 700.0, 0.3, 1e-7, 12345.678])
def test_a_sum_of_one_state_allocates_no_buffers_and_gives_the_state(weight: float) -> None:
    """A sum of one state holds no float64 buffers (a cloud with one edge, an edge with one
    device), and its mean is bit for bit the mean the buffers give."""
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(1000, generator=g) * 1e3, "b": torch.randn(7, generator=g) * 1e-30,
             "steps": torch.tensor(4)}  # fmt: skip
    one = WeightedSum()
    one.add(state, weight, key="a")
    assert one._flat is None  # nothing allocated for one state
    mean = one.mean()
    via_buffers = WeightedSum()
    via_buffers.add(state, weight, key="a")
    via_buffers._materialize()
    assert via_buffers._flat is not None
    expected = via_buffers.mean()
    for k in state:
        assert mean[k].dtype == expected[k].dtype
        assert mean[k].numpy().tobytes() == expected[k].numpy().tobytes()
    assert mean["w"].data_ptr() != state["w"].data_ptr()  # a copy, not the caller's tensor


def test_the_deferred_first_state_folds_as_before_when_a_second_comes() -> None:
    states, n = _states(3), [5.0, 11.0, 2.0]
    deferred, eager = WeightedSum(), WeightedSum()
    for i, s in enumerate(states):
        deferred.add(s, n[i], key=str(i))
        eager.add(s, n[i], key=str(i))
        eager._materialize()
    for k, v in deferred.mean().items():
        assert v.numpy().tobytes() == eager.mean()[k].numpy().tobytes()


def test_a_large_blob_is_served_from_its_disk_copy_once_written(tmp_path: Path) -> None:
    """A blob of at least spill_bytes leaves memory once its disk copy is written; its chunks
    are read from the file, which is verified again after it changed (a corrupt one is
    deleted, never served). Below the threshold, and without disk, blobs stay in memory."""
    store = BlobStore(tmp_path / "cache", spill_bytes=1000)
    big, small = bytes(range(256)) * 8, b"s" * 100
    sha, sha_small = store.put(big), store.put(small)
    assert store.flush(10)
    assert sha not in store._mem and sha_small in store._mem
    assert [store.chunk(sha, i, 700) for i in range(3)] == [big[:700], big[700:1400], big[1400:]]
    assert store.chunk(sha, 3, 700) is None
    assert sha not in store._mem  # read range by range, not loaded back
    again = store.get(sha)  # mapped from the file, not read back into memory
    assert isinstance(again, MappedBlob) and again[:] == big and sha not in store._mem
    del again
    path = tmp_path / "cache" / sha[:2] / sha
    path.write_bytes(b"x" + big[1:])  # changed behind the store's back
    assert store.chunk(sha, 0, 700) is None and not path.exists()
    memory_only = BlobStore(None, spill_bytes=10)
    sha = memory_only.put(big)
    assert memory_only.chunk(sha, 0, 700) == big[:700] and sha in memory_only._mem


def test_a_fold_of_mapped_uploads_gives_their_pages_back(tmp_path: Path) -> None:
    """Uploads received into files are folded from views of their maps: each tensor's pages
    go back once folded in (the sum holds none of the uploads in memory), and the mean is
    the one the same tensors in memory give, bit for bit."""
    from shared.wire.codec import decode_tensors, encode_tensors_to_file

    g = torch.Generator().manual_seed(3)
    states = [{"w": torch.randn(4096, 1024, generator=g), "v": torch.randn(4096, generator=g)}
              for _ in range(3)]  # fmt: skip
    warm = WeightedSum()  # the library code a fold runs is paged in (file pages too)
    for i, s in enumerate(states):
        warm.add(s, 1.0, key=str(i))
    warm.mean()
    blobs_ = [encode_tensors_to_file(s, tmp_path / f"{i}.part") for i, s in enumerate(states)]
    mapped, plain = WeightedSum(), WeightedSum()
    rss = []
    for i, (s, b) in enumerate(zip(states, blobs_, strict=True)):
        mapped.add(decode_tensors(b, copy=False), float(i + 1), key=str(i))
        plain.add(s, float(i + 1), key=str(i))
        rss.append(_rss_file_kib())
    assert max(rss) - rss[0] < 4096  # 16 MiB per upload, none of it kept resident
    for k, v in plain.mean().items():
        assert mapped.mean()[k].numpy().tobytes() == v.numpy().tobytes()


def _rss_file_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


def test_a_consumed_mean_is_the_mean_and_the_next_sum_starts_clean() -> None:
    """mean(consume=True) writes the float32 mean over the sum's float32 half (no third
    buffer): bit for bit the mean; the mean keeps that half, and the next sum of the same
    size gets a fresh one (the kept mean is never zeroed or summed into)."""
    states, n = _states(4), [3.0, 70.0, 12.0, 5.0]
    states = [{"w": s["w"]} for s in states]
    plain, consumed = WeightedSum(), WeightedSum()
    for i, s in enumerate(states):
        plain.add(s, n[i], key=str(i))
        consumed.add(s, n[i], key=str(i))
    expected = plain.mean()["w"].numpy().tobytes()
    mean = consumed.mean(consume=True)
    consumed.recycle()
    assert mean["w"].numpy().tobytes() == expected
    again = WeightedSum()
    for i, s in enumerate(reversed(states)):
        again.add(s, n[3 - i], key=str(3 - i))
    assert again.mean()["w"].numpy().tobytes() == expected
    assert mean["w"].numpy().tobytes() == expected  # untouched by the next sum
    with pytest.raises(EstuaryError):
        consumed_again = WeightedSum()
        consumed_again.add(states[0], 1.0)
        consumed_again.add(states[1], 1.0)
        consumed_again.mean(consume=True)
        consumed_again.mean()
