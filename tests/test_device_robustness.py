"""The device agent under bad input and bad luck, on a MemoryBus with hand-made peers.

* Local training that diverges (NaN/inf loss or weights) is rejected as ``diverged``:
  nothing is uploaded or reported, and the next round starts again from the edge's model.
* Other participants' ``DeviceJoin`` messages are checked on receipt (``bad_join``) and kept
  compactly, only for the current session's current and later rounds, under a hard cap.
* A ``RoundStart`` whose ``edge_counts`` are not label histograms is rejected as
  ``bad_edge_counts`` (not miscounted as ``no_edge_online``).

Every check also asserts that no handler failed (the service kept running).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import device_agent.choosing as device_choosing
from device_agent.service import DeviceAgent
from shared.config import RunConfig
from shared.methods.registry import make_algorithm
from shared.runtime.service import RoleService
from shared.transport.bus import MemoryBus
from shared.wire.messages import DeviceJoin, DeviceUpdate, EdgeRound, RoundStart, decode
from tests.conftest import tiny_config
from tests.hand_roles import SESSION, put_model

OTHER_SESSION = "fedcba9876543210"
COUNTS = [1] * 10

#: settings under which a few local SGD steps blow up to NaN
DIVERGING: dict[str, Any] = {"lr": 10.0, "local_steps": 6, "optimizer": "sgd", "grad_clip": 0}


def rejected(bus: MemoryBus) -> dict[str, int]:
    """The bus's rejection counters (``role:reason`` -> count), handler errors included."""
    return dict(bus.traffic.snapshot()["rejected"])


def make_device(cfg: RunConfig, bus: MemoryBus) -> DeviceAgent:
    """``dev000`` at ``edge0`` with 16 synthetic images of all ten classes, started."""
    g = torch.Generator().manual_seed(0)
    dev = DeviceAgent(
        cfg,
        bus,
        make_algorithm(cfg),
        device_id="dev000",
        index=0,
        home_edge="edge0",
        data=torch.rand(16, 1, 28, 28, generator=g) * 2 - 1,
        labels=torch.arange(16) % 10,
    )
    dev.start()
    return dev


class Edge(RoleService):
    """A hand-made edge: announces a model to ``dev000``."""

    role = "edge"

    def announce(self, round_: int, *, upload: bool, ref: Any = None, select: bool = False) -> Any:
        """Send an EdgeRound for ``round_`` (a fresh model blob unless ``ref``); the ref."""
        if ref is None:
            ref = put_model(self, "edge_model")
        msg = EdgeRound(
            round=round_,
            session=SESSION,
            edge=self.name,
            devices=["dev000"],
            model_ref=ref,
            upload=upload,
            deadline_s=60.0,
            select=select,
        )
        self.send(self.topics.edge_round(self.name), msg)
        return ref


def edge_setup(
    *, federation: dict[str, Any] | None = None, **train: Any
) -> tuple[MemoryBus, DeviceAgent, Edge, list[DeviceUpdate]]:
    """A device and a hand-made edge; the list collects what the device reports."""
    fed = {"num_devices": 1, "num_edges": 1, **(federation or {})}
    cfg = tiny_config(federation=fed, train=train)
    bus = MemoryBus(raise_errors=False)  # like MqttBus: handler errors are logged + counted
    dev = make_device(cfg, bus)
    edge = Edge("edge0", cfg, bus)
    ups: list[DeviceUpdate] = []
    edge.ep.subscribe(
        edge.topics.device_up("dev000"), lambda t, p: ups.append(decode(p, DeviceUpdate))
    )
    return bus, dev, edge, ups


def count_fetches(dev: DeviceAgent) -> list[int]:
    """Wrap ``dev.fetch_tensors``; the returned list grows by one per model download."""
    calls: list[int] = []
    inner = dev.fetch_tensors

    def fetch(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return inner(*args, **kwargs)

    dev.fetch_tensors = fetch  # type: ignore[method-assign]
    return calls


# -- divergence ---------------------------------------------------------------------------------


def test_diverged_upload_round_is_rejected_and_nothing_leaves_the_device() -> None:
    bus, dev, edge, ups = edge_setup(**DIVERGING)
    kept = {"c_local": torch.ones(3)}  # per-device state from earlier rounds (SCAFFOLD's c_i)
    dev.algo_state.update(kept)
    edge.announce(0, upload=True)
    bus.run(lambda: False)
    assert rejected(bus) == {"device:diverged": 1}
    assert ups == [] and dev.last_update is None
    assert bus.traffic.total("sent", "device_update") == 0  # no NaN blob was uploaded
    # the state from before the round is kept (clearing it broke c = mean c_i for SCAFFOLD
    # and reset FedDiffuse's trained local parts to the initial model)
    assert dev.kept_local is None and dev.algo_state == kept


def test_local_model_is_continued_only_at_the_same_edge() -> None:
    """r_e > 1: the next round continues the device's own model only when the same edge
    announces the same model; at another edge (which counts only its own devices' rounds)
    with the same global model it starts again from that edge's model."""
    fed = {"num_devices": 2, "num_edges": 2, "assignment": "random"}
    bus, dev, edge, ups = edge_setup(federation=fed)
    other = Edge("edge1", dev.cfg, bus)
    fetches = count_fetches(dev)
    dev.choices.update({(SESSION, 0): "edge0", (SESSION, 1): "edge0", (SESSION, 2): "edge1"})
    ref = edge.announce(0, upload=False, select=True)
    bus.run(lambda: False)
    edge.announce(1, upload=False, ref=ref, select=True)
    bus.run(lambda: False)
    assert len(fetches) == 1 and dev.kept_local is not None  # continued at edge0
    other.announce(2, upload=True, ref=ref, select=True)
    bus.run(lambda: False)
    assert len(fetches) == 2 and [u.round for u in ups] == [0, 1, 2]


def test_a_forged_round_from_another_edge_or_past_the_run_is_refused() -> None:
    """Under a static assignment a device trains only its home edge's rounds, and never a
    round past the run's last: a far-future round would make every real round "late" (and
    reach the state file). Both are counted; the real round then trains as usual."""
    bus, dev, edge, ups = edge_setup()
    rogue = Edge("edge7", dev.cfg, bus)
    rogue.announce(0, upload=True)
    edge.announce(10**6, upload=True)
    bus.run(lambda: False)
    assert rejected(bus) == {"device:not_my_edge": 1, "device:round_out_of_range": 1}
    assert ups == [] and dev.last_update is None
    edge.announce(0, upload=True)
    bus.run(lambda: False)
    assert [u.round for u in ups] == [0]


def test_diverged_local_round_is_not_continued_next_round() -> None:
    """r_e > 1: a round without upload that diverged must not be trained on next round; the
    device fetches the edge's model again."""
    bus, dev, edge, ups = edge_setup(**DIVERGING)
    fetches = count_fetches(dev)
    ref = edge.announce(0, upload=False)
    bus.run(lambda: False)
    assert rejected(bus) == {"device:diverged": 1}
    assert dev.kept_local is None
    edge.announce(1, upload=True, ref=ref)  # the same edge model: would be "continued"
    bus.run(lambda: False)
    assert len(fetches) == 2
    assert rejected(bus) == {"device:diverged": 2}
    assert ups == [] and bus.traffic.total("sent", "device_update") == 0


def test_honest_local_round_is_still_continued() -> None:
    """The divergence check leaves r_e > 1 as it was: the next round continues the local
    model without downloading the edge's again, and the upload round reports."""
    bus, dev, edge, ups = edge_setup()
    fetches = count_fetches(dev)
    ref = edge.announce(0, upload=False)
    bus.run(lambda: False)
    edge.announce(1, upload=True, ref=ref)
    bus.run(lambda: False)
    assert rejected(bus) == {}
    assert len(fetches) == 1
    assert [(u.round, u.update_ref is None) for u in ups] == [(0, True), (1, False)]


def test_a_device_of_a_static_assignment_joins_the_session_its_edge_announces() -> None:
    """Without edge selection no RoundStart reaches a device; the round it trains makes its
    session the device's, which its deployment reports name (the cloud counts only reports
    of its own session: before, a pFedGPA device's own-classifier report named none and the
    demo's cloud waited deploy.wait_s and counted 0 of 5)."""
    bus, dev, edge, ups = edge_setup()
    assert not dev.selecting and dev.joined_session() is None
    edge.announce(0, upload=True)
    bus.run(lambda: False)
    assert rejected(bus) == {} and len(ups) == 1
    assert dev.joined_session() == SESSION


# -- joins and edge counts (device-selected edges) ----------------------------------------------


class Peer(RoleService):
    """A hand-made cloud or device that sends one message of its role."""

    def __init__(self, name: str, role: str, cfg: RunConfig, bus: MemoryBus) -> None:
        self.role = role
        super().__init__(name, cfg, bus)

    def join(self, round_: int, counts: list[int], session: str = SESSION) -> None:
        """Publish this device's choice of ``edge0`` for ``round_``."""
        msg = DeviceJoin(
            round=round_, session=session, device=self.name, edge="edge0", label_counts=counts
        )
        self.send(self.topics.device_join(self.name), msg)

    def round_start(
        self, round_: int, edge_counts: dict[str, list[int]], participants: list[str]
    ) -> None:
        """Open ``round_`` with device-selected edges."""
        ref = put_model(self, "m")
        msg = RoundStart(
            round=round_,
            session=SESSION,
            assignment={},
            global_ref=ref,
            new_global=True,
            participants=participants,
            edge_counts=edge_counts,
            deadline_s=60.0,
            config_digest=self.cfg.digest(),
        )
        self.send(self.topics.cloud_round, msg)


def select_setup() -> tuple[MemoryBus, DeviceAgent, Peer, Peer, list[DeviceJoin]]:
    """``dev000`` choosing among two edges, a cloud, a peer device ``dev001`` and the list of
    ``dev000``'s own joins."""
    cfg = tiny_config(federation={"num_devices": 2, "num_edges": 2, "assignment": "select"})
    bus = MemoryBus(raise_errors=False)
    dev = make_device(cfg, bus)
    cloud = Peer("cloud", "cloud", cfg, bus)
    peer = Peer("dev001", "device", cfg, bus)
    mine: list[DeviceJoin] = []
    cloud.ep.subscribe(
        cloud.topics.device_join("dev000"), lambda t, p: mine.append(decode(p, DeviceJoin))
    )
    return bus, dev, cloud, peer, mine


@pytest.mark.parametrize("n", [1, 9, 11, 1000])
def test_join_with_wrong_number_of_label_counts_is_rejected_and_not_kept(n: int) -> None:
    bus, dev, _, peer, _ = select_setup()
    peer.join(0, [7] * n)
    bus.run(lambda: False)
    assert rejected(bus) == {"device:bad_join": 1}
    assert len(dev.joins) == 0
    peer.join(0, COUNTS)  # and a good one after it is kept, compactly
    bus.run(lambda: False)
    assert dict(dev.joins) == {(SESSION, 0, "dev001"): ("edge0", tuple(COUNTS))}


def test_joins_are_kept_only_for_the_current_session_and_later_rounds() -> None:
    bus, dev, cloud, peer, mine = select_setup()
    cloud.round_start(5, {"edge0": COUNTS, "edge1": COUNTS}, ["dev000"])
    bus.run(lambda: False)
    assert [j.round for j in mine] == [5]
    for r in (3, 4, 5, 6):
        peer.join(r, COUNTS)
    peer.join(2, COUNTS, session=OTHER_SESSION)  # possibly a newer session: kept for now
    bus.run(lambda: False)
    assert set(dev.joins) == {
        (SESSION, 5, "dev001"),
        (SESSION, 6, "dev001"),
        (OTHER_SESSION, 2, "dev001"),
    }
    cloud.round_start(6, {"edge0": COUNTS, "edge1": COUNTS}, ["dev000", "dev001"])
    bus.run(lambda: False)
    assert sorted(dev.joins) == [(SESSION, 6, "dev001")]  # older rounds, other session gone
    assert rejected(bus) == {}


def test_kept_joins_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_choosing, "MAX_KEPT_JOINS", 5)
    bus, dev, _, peer, _ = select_setup()
    for r in range(12):
        peer.join(r, COUNTS)
    bus.run(lambda: False)
    assert sorted(k[1] for k in dev.joins) == [7, 8, 9, 10, 11]
    assert rejected(bus) == {}


@pytest.mark.parametrize("n", [3, 11])
def test_round_start_with_wrong_length_edge_counts_is_rejected_as_such(n: int) -> None:
    bus, dev, cloud, _, mine = select_setup()
    cloud.round_start(0, {"edge0": COUNTS, "edge1": [1] * n}, ["dev000"])
    bus.run(lambda: False)
    assert rejected(bus) == {"device:bad_edge_counts": 1}
    assert mine == [] and dev.choices == {}
    cloud.round_start(1, {"edge0": COUNTS, "edge1": COUNTS}, ["dev000"])  # still serving
    bus.run(lambda: False)
    assert [j.round for j in mine] == [1]
    assert rejected(bus) == {"device:bad_edge_counts": 1}
