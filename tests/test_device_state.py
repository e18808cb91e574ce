"""A device's state across restarts (``--state-dir``, :mod:`device_agent.state`): the
structure codec, the file's checks, and runs in which devices lose their memory mid-run
and take up their saved state, ending at the uninterrupted run's model."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from device_agent.service import DeviceAgent
from device_agent.state import (
    DeviceState,
    decode_state,
    encode_state,
    pack,
    read_state,
    save_state,
    state_path,
    unpack,
)
from estuary.simulate import build_federation
from shared.config import RunConfig
from shared.data.partition import split_dataset
from shared.errors import CodecError, StateError
from shared.models.plan import build_model, model_spec
from shared.transport.bus import MemoryBus
from shared.wire.codec import encode_tensors
from tests.conftest import tiny_config


def _same(a: Any, b: Any) -> bool:
    """Structural equality with tensors compared by dtype, shape and value."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# -- the structure codec ------------------------------------------------------------------
def test_pack_round_trips_tuples_int_keys_and_tensors() -> None:
    obj = {
        "shapes": ((3, 4), (5,)),
        "state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(3, 4)}},
        "groups": [{"lr": 2e-3, "betas": (0.9, 0.999), "foreach": None, "amsgrad": False}],
        "name": "x",
        "half": torch.ones(2, dtype=torch.float16),
        "ints": torch.arange(4),
    }
    tensors: list[torch.Tensor] = []
    doc = pack(obj, tensors)
    assert len(tensors) == 4
    back = unpack(doc, dict(enumerate(tensors)))
    assert _same(back, obj)
    assert isinstance(back["shapes"], tuple) and isinstance(back["shapes"][0], tuple)
    assert list(back["state"]) == [0]  # an int key, not "0"


@pytest.mark.parametrize("bad", [object(), math.inf, math.nan, {(1, 2): 3}, {True: 1}, {1.5: 2}])
def test_pack_refuses_what_it_cannot_store(bad: Any) -> None:
    with pytest.raises(StateError):
        pack({"entry": bad}, [])


@pytest.mark.parametrize(
    "doc",
    [
        {"T": 3},  # no such tensor
        {"T": True},
        {"X": []},
        {"L": 5},
        {"D": [["k"]]},
        {"D": [[1.5, 2]]},
        {"a": 1, "b": 2},
        [1, 2],  # an untagged list
        math.inf,
    ],
)
def test_unpack_refuses_what_pack_never_writes(doc: Any) -> None:
    with pytest.raises(StateError):
        unpack(doc, {0: torch.zeros(1)})


# -- the file -----------------------------------------------------------------------------
def _adam_state() -> Any:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    shapes = tuple(tuple(p.shape) for p in model.parameters())
    return shapes, opt.state_dict(), model


def _state(**over: Any) -> DeviceState:
    shapes, opt_state, _ = _adam_state()
    base: dict[str, Any] = {
        "device": "dev001",
        "config_digest": "abc",
        "plan": None,
        "algo_state": {
            "optimizer.state": (shapes, opt_state),
            "scaffold.c_i": {"w": torch.ones(2)},
        },
        "round": 2,  # the third round of the 4-round runs below
        "session": "s" * 16,
        "choices": [("s" * 16, 2, "edge1")],
    }
    base.update(over)
    return DeviceState(**base)


def test_a_saved_state_reads_back_and_loads_into_an_optimizer(tmp_path: Path) -> None:
    state = _state(algo_state={**_state().algo_state, "fedphd.penalty": object()})
    path = state_path(tmp_path, "dev001")
    size = save_state(path, state, skip=frozenset({"fedphd.penalty"}))
    assert size == path.stat().st_size
    back = read_state(path)
    assert back is not None
    assert "fedphd.penalty" not in back.algo_state  # a cache: not stored
    state.algo_state.pop("fedphd.penalty")
    assert _same(back.algo_state, state.algo_state)
    assert (back.device, back.round, back.session, back.choices) == (
        "dev001", 2, "s" * 16, [("s" * 16, 2, "edge1")],
    )  # fmt: skip
    _, _, model = _adam_state()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.load_state_dict(back.algo_state["optimizer.state"][1])
    assert int(opt.state_dict()["state"][0]["step"]) == 1
    assert read_state(tmp_path / "missing.safetensors") is None


def test_an_uncacheable_entry_is_refused_by_name() -> None:
    with pytest.raises(StateError, match="penalty"):
        encode_state(_state(algo_state={"fedphd.penalty": object()}))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"not safetensors at all", "safetensors"),
        (encode_tensors({"w": torch.zeros(2)}), "no state document"),
        (
            encode_tensors(
                {"doc": torch.frombuffer(bytearray(b'{"format": "x"}'), dtype=torch.uint8)}
            ),
            "not a estuary-device-state-v1",
        ),
        (
            encode_tensors({"doc": torch.frombuffer(bytearray(b"{not json"), dtype=torch.uint8)}),
            "JSONDecodeError",
        ),
    ],
)
def test_decode_refuses_what_is_not_a_device_state(data: bytes, match: str) -> None:
    with pytest.raises((StateError, CodecError), match=match):
        decode_state(data)


def test_decode_refuses_a_stray_tensor_and_a_model_without_kept_local() -> None:
    good = encode_state(_state())
    from safetensors.torch import load, save

    tensors = load(good)
    with pytest.raises(StateError, match="unexpected tensor"):
        decode_state(save({**tensors, "zzz": torch.zeros(1)}))
    with pytest.raises(StateError, match="kept model"):
        decode_state(save({**tensors, "m/conv.weight": torch.zeros(1)}))


# -- agents that lose their memory and take up their saved state --------------------------
def _cfg(algorithm: dict[str, Any], edge_every: int = 1) -> RunConfig:
    return tiny_config(
        run={"rounds": 4},
        federation={"num_devices": 4, "num_edges": 2, "edge_every": edge_every, "cloud_every": 2},
        train={"local_steps": 2, "batch_size": 8, "lr": 5e-3, "optimizer_state": "keep"},
        algorithm=algorithm,
        eval={"every": 0, "sample_every": 0, "checkpoint_every": 0},
    )


def _forget(agent: DeviceAgent) -> None:
    """What a process restart loses: everything the agent kept in memory for training."""
    cfg = agent.cfg
    agent.algo_state.clear()
    agent.plan = None
    agent.model = build_model(cfg.model.preset, None, seed=cfg.run.seed)
    agent.spec = agent.algorithm.format.global_spec(model_spec(cfg.model.preset, None))
    agent.kept_local = None
    agent.last_update = None
    agent.state_session = None
    agent.choices.clear()


def _run(
    cfg: RunConfig, state_dir: Path | None, restart: dict[int, bool]
) -> tuple[str, dict[str, DeviceAgent]]:
    """Run ``cfg`` in one process; after each round in ``restart`` every device forgets
    its memory and (when the value is True) restores its saved state."""
    data, parts = split_dataset(cfg)
    bus = MemoryBus()
    agents: dict[str, DeviceAgent] = {}

    def on_round_end(summary: Any) -> None:
        if summary.round in restart:
            for agent in agents.values():
                _forget(agent)
                if restart[summary.round]:
                    assert agent.restore_state() or agent.state_session is None

    fed = build_federation(cfg, bus, data, parts, on_round_end=on_round_end)
    for agent in fed.devices:
        if state_dir is not None:
            agent.state_file = state_path(state_dir, agent.name)
        agents[agent.name] = agent
    fed.start()
    bus.run(lambda: fed.cloud.done)
    assert fed.cloud.done
    return fed.cloud.model_sha, agents


#: the uninterrupted runs, each made once in this process (by config)
_REFERENCES: dict[str, tuple[str, dict[str, DeviceAgent]]] = {}


def _reference(cfg: RunConfig) -> tuple[str, dict[str, DeviceAgent]]:
    """``_run(cfg, None, {})``: the uninterrupted run without a state file, made once."""
    key = cfg.to_json()
    if key not in _REFERENCES:
        _REFERENCES[key] = _run(cfg, None, {})
    return _REFERENCES[key]


#: the tests that compare with the uninterrupted SCAFFOLD run share it on one pytest worker
scaffold_reference = pytest.mark.xdist_group("device-state-scaffold")


@pytest.mark.parametrize(
    ("algorithm", "edge_every"),
    [
        pytest.param({"name": "scaffold"}, 1, marks=[scaffold_reference, pytest.mark.slow]),
        # slow (CI's slow stage): the default run keeps PRISM (an optimizer's moments);
        # SCAFFOLD's variate restored is the slow stage's
        pytest.param({"name": "scaffold"}, 2, marks=pytest.mark.slow),
        pytest.param({"name": "feddiffuse", "split": "ulatdec"}, 1, marks=pytest.mark.slow),
        pytest.param({"name": "moon"}, 1, marks=pytest.mark.slow),
        pytest.param(
            {"name": "fedphd", "sparse_rounds": 2, "lambda0": 1e-3, "prune_ratio": 0.3},
            1,
            marks=pytest.mark.slow,
        ),
        ({"name": "prism", "prism_local_iters": 2}, 1),  # its score optimizer's moments
    ],
    ids=["scaffold", "scaffold-r_e=2", "feddiffuse-ulatdec", "moon", "fedphd", "prism"],
)
def test_devices_restarted_mid_run_end_at_the_uninterrupted_model(
    tmp_path: Path, algorithm: dict[str, Any], edge_every: int
) -> None:
    """Every device forgets everything after rounds 0, 1 and 2 and restores its file: an
    edge aggregation between cloud ones, a cloud aggregation (FedPhD's pruning: the plan
    changes) and, with r_e = 2, the middle of an edge period (the device keeps training its
    own model, which the file holds). The final model is the uninterrupted run's.
    Forgetting without restoring ends elsewhere: the state matters."""
    cfg = _cfg(algorithm, edge_every)
    reference, ref_agents = _reference(cfg)
    restored, agents = _run(cfg, tmp_path / "state", {0: True, 1: True, 2: True})
    assert restored == reference
    for name, agent in agents.items():
        skip = agent.algorithm.device.device_cache_keys
        kept = {k: v for k, v in agent.algo_state.items() if k not in skip}
        assert _same(kept, {k: v for k, v in ref_agents[name].algo_state.items() if k not in skip})
        assert agent.metrics.device_state.labels(event="restored")._value.get() == 3
        assert agent.metrics.device_state.labels(event="save_failed")._value.get() == 0
    forgotten, _ = _run(cfg, None, {0: False, 1: False, 2: False})
    assert forgotten != reference


@scaffold_reference
def test_a_state_that_cannot_be_written_is_counted_and_training_goes_on(tmp_path: Path) -> None:
    """A state directory that cannot be created (here: a file is in the way) fails every
    save; each failure is logged and counted, and the run is the one without a state file."""
    cfg = _cfg({"name": "scaffold"})
    reference, _ = _reference(cfg)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("in the way")
    sha, agents = _run(cfg, blocker, {})
    assert sha == reference
    for agent in agents.values():
        assert agent.metrics.device_state.labels(event="save_failed")._value.get() == cfg.run.rounds
        assert agent.metrics.device_state.labels(event="saved")._value.get() == 0


def _agent(cfg: RunConfig, state_dir: Path, name: str = "dev001") -> DeviceAgent:
    from shared.methods.base import build_algorithm

    return DeviceAgent(
        cfg, MemoryBus(), build_algorithm(cfg), device_id=name, index=int(name[3:]),
        home_edge="edge0", data=torch.zeros(4, 1, 28, 28), labels=torch.zeros(4, dtype=torch.long),
        state_dir=state_dir,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("write", "reason"),
    [
        (lambda p: p.write_bytes(b"garbage"), "unreadable"),
        (lambda p: save_state(p, _state(device="dev002")), "other-device"),
        (lambda p: save_state(p, _state(config_digest="0" * 16)), "other-config"),
    ],
    ids=["unreadable", "other-device", "other-config"],
)
def test_an_unusable_state_file_is_moved_aside_and_the_device_starts_afresh(
    tmp_path: Path, write: Any, reason: str
) -> None:
    cfg = _cfg({"name": "scaffold"})
    path = state_path(tmp_path, "dev001")
    path.parent.mkdir(parents=True, exist_ok=True)
    write(path)
    before = path.read_bytes()
    agent = _agent(cfg, tmp_path)
    assert not agent.restore_state()
    assert agent.algo_state == {} and not path.exists()
    (aside,) = tmp_path.glob(f"dev001.safetensors.{reason}-*")
    assert aside.read_bytes() == before  # moved, never deleted
    assert agent.metrics.device_state.labels(event="set_aside")._value.get() == 1


def test_a_state_past_the_runs_last_round_is_moved_aside(tmp_path: Path) -> None:
    """A saved round no real round of the run can reach (a forged far-future round would
    otherwise make every real round look late after a restart)."""
    cfg = _cfg({"name": "scaffold"})
    agent = _agent(cfg, tmp_path)
    save_state(agent.state_file, _state(config_digest=agent.config_digest, round=10**6))  # type: ignore[arg-type]
    assert not agent.restore_state()
    assert list(tmp_path.glob("dev001.safetensors.bad-round-*"))


def test_a_state_for_a_plan_the_preset_refuses_is_moved_aside(tmp_path: Path) -> None:
    cfg = _cfg({"name": "scaffold"})
    agent = _agent(cfg, tmp_path)
    save_state(agent.state_file, _state(config_digest=agent.config_digest, plan={"bogus": 1}))  # type: ignore[arg-type]
    assert not agent.restore_state()
    assert list(tmp_path.glob("dev001.safetensors.bad-plan-*"))


def test_a_run_started_over_does_not_take_up_the_earlier_runs_state(tmp_path: Path) -> None:
    """The same config run again from scratch (a cloud with no checkpoint starts at round 0
    under a new session): the devices restore the first run's files at start, see round 0
    of another session and drop them, so the second run ends at the first run's model."""
    cfg = _cfg({"name": "scaffold"})
    first, _ = _run(cfg, tmp_path / "state", {})
    again, agents = _run(cfg, tmp_path / "state", {})
    assert again == first
    for agent in agents.values():
        assert agent.metrics.device_state.labels(event="restored")._value.get() == 1
