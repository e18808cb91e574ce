"""The edge keeps working whatever validated-but-hostile input its devices and the cloud send:
updates whose sums would break the EdgeUpdate schema are rejected with a reason, a round that
cannot close leaves no half-changed state, a new architecture is adopted only once its model
arrived, discarded updates are not counted, and a bad restart record is ignored. Driven over
a MemoryBus that (like MqttBus) logs and counts handler errors instead of raising them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from edge_node import EdgeServer
from shared.data.datasets import NUM_CLASSES
from shared.methods.registry import make_algorithm
from shared.models.plan import dense_plan
from shared.runtime.service import RoleService
from shared.transport.bus import MemoryBus
from shared.wire.messages import MAX_COUNT, BlobRef, DeviceHello, DeviceUpdate, EdgeUpdate, decode
from tests.conftest import tiny_config
from tests.hand_roles import SESSION, Cloud, put_model


class Dev(RoleService):
    """A device-role endpoint that reports whatever it is told to."""

    role = "device"

    def report(
        self,
        r: int,
        *,
        n: int = 32,
        counts: list[int] | None = None,
        loss: float = 0.1,
        secs: float = 1.0,
    ) -> None:
        """Upload a model and send the DeviceUpdate of round ``r``."""
        counts = counts if counts is not None else [n] + [0] * (NUM_CLASSES - 1)
        ref = put_model(self, "device_update", seed=1)
        msg = DeviceUpdate(
            round=r,
            session=SESSION,
            device=self.name,
            edge="edge0",
            update_ref=ref,
            n_samples=n,
            label_counts=counts,
            train_loss=loss,
            steps=1,
            train_seconds=secs,
        )
        self.send(self.topics.device_up(self.name), msg)


Hierarchy = tuple[MemoryBus, EdgeServer, Cloud, list[Dev], list[EdgeUpdate]]


def _hierarchy(**fed: Any) -> Hierarchy:
    cfg = tiny_config(run={"rounds": 4}, federation={"num_devices": 2, "num_edges": 1, **fed})
    bus = MemoryBus(raise_errors=False)  # like MqttBus: handler errors are logged and counted
    edge = EdgeServer(cfg, bus, make_algorithm(cfg), edge_id="edge0")
    edge.start()
    cloud = Cloud("cloud", cfg, bus)
    reports: list[EdgeUpdate] = []
    topic = cloud.topics.edge_up("edge0")
    cloud.ep.subscribe(topic, lambda _t, p: reports.append(decode(p, EdgeUpdate)), kind="x")
    devs = [Dev(f"dev00{i}", cfg, bus) for i in range(2)]
    return bus, edge, cloud, devs, reports


def _rejected(bus: MemoryBus) -> dict[str, int]:
    return bus.traffic.snapshot()["rejected"]


def _open(bus: MemoryBus, edge: EdgeServer, cloud: Cloud, r: int, **kw: Any) -> None:
    cloud.open_round(r, ["dev000", "dev001"], **kw)
    bus.run(lambda: edge.round == r)


@pytest.mark.parametrize(
    ("reports", "reason"),
    [
        ([{"n": 0, "counts": [0] * NUM_CLASSES}] * 2, "zero_samples"),
        ([{"loss": 1e308}] * 2, "bad_loss"),
        ([{"secs": 1e308}] * 2, "bad_train_seconds"),
        ([{"n": MAX_COUNT}] * 2, "too_many_samples"),
    ],
    ids=["zero_samples", "loss_overflow", "seconds_overflow", "samples_overflow"],
)
def test_updates_that_would_break_the_round_are_rejected(
    reports: list[dict[str, Any]], reason: str
) -> None:
    bus, edge, cloud, devs, sent = _hierarchy()
    _open(bus, edge, cloud, 0)
    for dev, kw in zip(devs, reports, strict=True):
        dev.report(0, **kw)
    bus.run(lambda: False)  # everything, the deadline included
    rejected = _rejected(bus)
    assert "bus:handler_error" not in rejected
    assert len(sent) == 1, "the round must still be reported"
    assert rejected.get(f"edge:{reason}", 0) >= 1
    assert sent[0].n_samples <= MAX_COUNT


def test_huge_sample_count_does_not_poison_later_rounds() -> None:
    bus, edge, cloud, devs, sent = _hierarchy(cloud_every=2)
    _open(bus, edge, cloud, 0)
    devs[0].report(0, n=MAX_COUNT)
    devs[1].report(0, n=MAX_COUNT)
    bus.run(lambda: False)
    assert edge.acc_n <= MAX_COUNT
    _open(bus, edge, cloud, 1, new_global=False)
    devs[0].report(1, n=32)
    devs[1].report(1, n=32)
    bus.run(lambda: False)
    assert [r.round for r in sent] == [0, 1]
    assert "bus:handler_error" not in _rejected(bus)


def test_failed_close_changes_nothing_and_next_round_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bus, edge, cloud, devs, sent = _hierarchy()
    _open(bus, edge, cloud, 0)
    assert edge.model is not None
    before = {k: v.clone() for k, v in edge.model.items()}
    acc = (edge.acc_n, list(edge.acc_counts))

    def boom(*_a: Any, **_k: Any) -> Any:
        raise ValueError("aggregation blew up")

    assert edge.fold is not None  # the round's aggregation, fed as the updates arrive
    monkeypatch.setattr(edge.fold, "result", boom)
    for dev in devs:
        dev.report(0)
    bus.run(lambda: False)
    assert sent == [] and edge.closed
    assert _rejected(bus).get("edge:close_failed") == 1
    assert "bus:handler_error" not in _rejected(bus)
    assert (edge.acc_n, edge.acc_counts) == acc
    assert all(torch.equal(before[k], edge.model[k]) for k in before)
    monkeypatch.undo()
    _open(bus, edge, cloud, 1, new_global=False)
    for dev in devs:
        dev.report(1)
    bus.run(lambda: False)
    assert [r.round for r in sent] == [1]
    assert sent[0].n_samples == 64 and sent[0].devices == ["dev000", "dev001"]


def test_new_arch_adopted_only_after_its_model_arrives() -> None:
    bus, edge, cloud, devs, sent = _hierarchy()
    _open(bus, edge, cloud, 0)
    devs[0].report(0)  # one of two: round 0 stays open
    bus.run(lambda: "dev000" in edge.reported)
    plan, spec = edge.plan, edge.spec
    missing = BlobRef(sha256="ab" * 32, size=1000, kind="global_model", src="cloud")
    cloud.open_round(1, ["dev000", "dev001"], arch=dense_plan(cloud.cfg.model.preset), ref=missing)
    bus.run(lambda: False)  # the fetch fails, then round 0's deadline closes it
    assert _rejected(bus).get("edge:blob_unavailable", 0) >= 1
    assert "bus:handler_error" not in _rejected(bus)
    assert edge.plan == plan and edge.spec == spec and edge.model is not None
    assert [(r.round, r.devices) for r in sent] == [(0, ["dev000"])]


def test_discarded_updates_are_not_counted() -> None:
    bus, edge, cloud, devs, sent = _hierarchy(min_updates=2)
    _open(bus, edge, cloud, 0)
    devs[0].report(0, n=32)
    bus.run(lambda: False)  # deadline with 1 < min_updates
    assert len(sent) == 1
    report = sent[0]
    assert report.devices == [] and report.n_samples == 0 and report.mean_loss is None
    assert report.label_counts == [0] * NUM_CLASSES and report.model_ref is None
    assert (edge.acc_n, edge.acc_counts) == (0, [0] * NUM_CLASSES)
    assert _rejected(bus).get("edge:too_few_updates") == 1


@pytest.mark.parametrize(
    "counts",
    [[5, 5, 5], [10**12] * NUM_CLASSES],
    ids=["wrong_length", "sum_over_limit"],
)
def test_bad_restart_counts_are_ignored(counts: list[int]) -> None:
    bus, edge, cloud, devs, sent = _hierarchy()
    _open(bus, edge, cloud, 1, new_global=False, edge_counts={"edge0": counts})
    assert _rejected(bus).get("edge:bad_edge_counts") == 1
    assert (edge.acc_n, edge.acc_counts) == (0, [0] * NUM_CLASSES)
    for dev in devs:
        dev.report(1)
    bus.run(lambda: False)
    assert "bus:handler_error" not in _rejected(bus)
    assert [(r.round, r.n_samples) for r in sent] == [(1, 64)]


def test_restart_counts_are_load_for_selection_not_aggregated_work() -> None:
    """r_g = 4: an edge restarted in round 2 takes back what it had served from the cloud's
    record. Its model is the global again, so the record is load that edge selection sees
    (added to the round-2 report) but not part of eq. 22's weight: the cloud-round report
    counts only the work aggregated since the restart, and the record is dropped with the
    period."""
    bus, edge, cloud, devs, sent = _hierarchy(cloud_every=4)
    counts = [3] * NUM_CLASSES
    _open(bus, edge, cloud, 2, new_global=False, edge_counts={"edge0": counts})
    assert "edge:bad_edge_counts" not in _rejected(bus)
    assert (edge.acc_n, edge.acc_counts, edge.carried) == (0, [0] * NUM_CLASSES, (30, counts))
    for dev in devs:
        dev.report(2)
    bus.run(lambda: False)
    assert (sent[-1].round, sent[-1].n_samples, sent[-1].model_ref) == (2, 94, None)
    assert sent[-1].label_counts == [67] + [3] * (NUM_CLASSES - 1)
    _open(bus, edge, cloud, 3, new_global=False)  # the cloud round
    for dev in devs:
        dev.report(3)
    bus.run(lambda: False)
    assert (sent[-1].round, sent[-1].n_samples) == (3, 128) and sent[-1].model_ref is not None
    assert sent[-1].label_counts == [128] + [0] * (NUM_CLASSES - 1)
    assert edge.carried == (0, [0] * NUM_CLASSES)


def test_restarted_edge_that_aggregated_nothing_sends_no_model() -> None:
    """Restarted in the cloud round itself, with no update: the edge's model is the global,
    so it sends none (no weight for work it does not hold) and reports no load."""
    bus, edge, cloud, _devs, sent = _hierarchy(cloud_every=2)
    _open(bus, edge, cloud, 1, new_global=False, edge_counts={"edge0": [3] * NUM_CLASSES})
    bus.run(lambda: False)  # deadline: nobody reported
    assert [(r.round, r.n_samples, r.model_ref) for r in sent] == [(1, 0, None)]
    assert edge.carried == (0, [0] * NUM_CLASSES)


def test_update_must_carry_the_counts_its_device_registered_with() -> None:
    """dev000 registered 32 images of class 0: an update claiming 10**12 images (which
    would fill the round's sum) or another histogram is refused; dev001, with the counts it
    registered, is aggregated and reported."""
    bus, edge, cloud, devs, sent = _hierarchy()
    for dev in devs:
        hello = DeviceHello(
            device=dev.name, home_edge="edge0", n_samples=32,
            label_counts=[32] + [0] * (NUM_CLASSES - 1),
        )  # fmt: skip
        dev.send(dev.topics.device_hello(dev.name), hello, retain=True)
    bus.run(lambda: len(edge.registered) == 2)
    _open(bus, edge, cloud, 0)
    devs[0].report(0, n=MAX_COUNT)
    devs[1].report(0)
    bus.run(lambda: False)
    assert _rejected(bus).get("edge:counts_not_registered") == 1
    assert len(sent) == 1 and sent[0].devices == ["dev001"] and sent[0].n_samples == 32
    _open(bus, edge, cloud, 1, new_global=False)
    devs[0].report(1, n=32, counts=[16] * 2 + [0] * (NUM_CLASSES - 2))
    bus.run(lambda: False)
    assert _rejected(bus).get("edge:counts_not_registered") == 2


def _two_classes(n: int) -> list[int]:
    return [0, n] + [0] * (NUM_CLASSES - 2)


def test_rounds_without_upload_count_only_once_their_work_is_aggregated() -> None:
    """r_e = r_g = 2: a device's round-0 work (no upload) reaches the edge model only with
    its round-1 upload; work that never does is not counted. Until then the report shows it
    as pending load (what edge selection sees), and no model goes to the cloud."""
    bus, edge, cloud, devs, sent = _hierarchy(edge_every=2, cloud_every=2)
    ref = put_model(cloud, "global_model")
    cloud.open_round(0, ["dev000", "dev001"], ref=ref)
    bus.run(lambda: edge.round == 0)
    devs[0].report(0, n=32)
    devs[1].report(0, n=16, counts=_two_classes(16))
    bus.run(lambda: False)
    assert [(r.round, r.n_samples, r.model_ref) for r in sent] == [(0, 48, None)]
    assert sent[0].label_counts == [32, 16] + [0] * (NUM_CLASSES - 2)
    assert (edge.acc_n, edge.pending["dev001"]) == (0, (16, _two_classes(16)))
    # round 1 aggregates dev000 only: its two rounds count; dev001's round 0 is lost
    cloud.open_round(1, ["dev000"], ref=ref, new_global=False)
    bus.run(lambda: edge.round == 1)
    devs[0].report(1, n=32)
    bus.run(lambda: False)
    last = sent[-1]
    assert (last.round, last.n_samples, last.devices) == (1, 64, ["dev000"])
    assert last.label_counts == [64] + [0] * (NUM_CLASSES - 1) and last.model_ref is not None
    assert (edge.acc_n, edge.pending) == (64, {})


def test_edge_that_aggregated_nothing_sends_no_model_to_the_cloud() -> None:
    bus, edge, cloud, devs, sent = _hierarchy(edge_every=2, cloud_every=2)
    ref = put_model(cloud, "global_model")
    cloud.open_round(0, ["dev000", "dev001"], ref=ref)
    bus.run(lambda: edge.round == 0)
    for dev in devs:
        dev.report(0)
    bus.run(lambda: False)
    cloud.open_round(1, [], ref=ref, new_global=False)  # nobody trains in the upload round
    bus.run(lambda: False)
    assert [(r.round, r.n_samples, r.model_ref) for r in sent] == [(0, 64, None), (1, 0, None)]
    assert edge.pending == {}


def test_pending_work_is_dropped_when_its_chain_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the round just before continues a chain: after a failed close, or a round the
    edge never closed, or a new global model, the devices start again from the edge's model."""
    bus, edge, cloud, devs, sent = _hierarchy(edge_every=4, cloud_every=4)
    ref = put_model(cloud, "global_model")
    cloud.open_round(0, ["dev000"], ref=ref)
    bus.run(lambda: edge.round == 0)
    devs[0].report(0, n=32)
    bus.run(lambda: False)
    assert edge.pending == {"dev000": (32, [32] + [0] * (NUM_CLASSES - 1))}
    # round 1 fails to close: no chain goes on from it
    monkeypatch.setattr(edge, "_close_report", lambda: 1 / 0)
    cloud.open_round(1, ["dev000"], ref=ref, new_global=False)
    bus.run(lambda: edge.round == 1)
    devs[0].report(1, n=32)
    bus.run(lambda: False)
    monkeypatch.undo()
    assert _rejected(bus).get("edge:close_failed") == 1 and edge.pending == {}
    # round 2 starts a chain; round 3 is announced but never closes (its deadline has not
    # come when round 4's start arrives), so round 4 does not continue round 2's chain
    cloud.open_round(2, ["dev000"], ref=ref, new_global=False)
    bus.run(lambda: edge.round == 2)
    devs[0].report(2, n=32)
    bus.run(lambda: False)
    assert edge.pending_round == 2 and edge.pending["dev000"][0] == 32
    cloud.open_round(3, ["dev000", "dev001"], ref=ref, new_global=False)
    bus.run(lambda: edge.round == 3)
    devs[0].report(3, n=32)  # dev001 never reports: round 3 stays open
    cloud.open_round(4, ["dev000"], ref=ref, new_global=False)
    bus.run(lambda: edge.round == 4)
    devs[0].report(4, n=32)
    bus.run(lambda: False)
    assert (sent[-1].round, sent[-1].n_samples) == (4, 32)
    # a new global model: every device reloads, pending work is gone
    cloud.open_round(5, ["dev000"], ref=put_model(cloud, "global_model", seed=5))
    bus.run(lambda: edge.round == 5)
    assert edge.pending == {}
