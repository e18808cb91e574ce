"""FedAdam and FedYogi (Reddi et al. 2021, Algorithm 2): the server step computed by hand,
the cloud's moments across a checkpoint and a resume, and a run that learns."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from cloud.service import CloudServer, RoundSummary
from estuary.simulate import build_federation
from shared.data.datasets import load_dataset
from shared.data.partition import make_partition
from shared.methods.api import Update
from shared.methods.fedadam.config import FedAdamConfig
from shared.methods.fedadam.method import FedAdam, server_step
from shared.methods.registry import make_algorithm
from shared.models.checkpoint import load_checkpoint
from shared.transport.bus import MemoryBus
from tests.conftest import tiny_config


def _settings(**kw: float | str) -> FedAdamConfig:
    return FedAdamConfig.model_validate({"eta": 0.1, "beta1": 0.5, "beta2": 0.75, "tau": 0.01,
                                         **kw})  # fmt: skip


def test_one_adam_step_by_hand() -> None:
    x = {"w": torch.tensor([1.0, -2.0]), "count": torch.tensor([3])}
    avg = {"w": torch.tensor([1.5, -2.0]), "count": torch.tensor([5])}
    moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    out = server_step(x, avg, moments, _settings())
    # Delta = (0.5, 0); m = 0.5 * Delta = (0.25, 0); v = 0.75 tau^2 + 0.25 Delta^2
    m, v = [0.25, 0.0], [0.75 * 1e-4 + 0.25 * 0.25, 0.75 * 1e-4]
    want = [1.0 + 0.1 * m[0] / (math.sqrt(v[0]) + 0.01), -2.0]
    assert out["w"].tolist() == pytest.approx(want, rel=1e-6)
    assert out["w"].dtype == torch.float32 and out["count"].tolist() == [5]  # buffers: avg
    assert moments["w"][0].tolist() == pytest.approx(m) and moments["w"][1].tolist() == (
        pytest.approx(v)
    )
    # a second step continues from the moments: Delta = 0 decays m and v
    out2 = server_step(out, out, moments, _settings())
    m2, v2 = 0.5 * m[0], 0.75 * v[0]
    step = 0.1 * m2 / (math.sqrt(v2) + 0.01)
    assert out2["w"][0].item() == pytest.approx(out["w"][0].item() + step, rel=1e-6)


def test_yogi_moves_v_by_the_sign_of_its_gap() -> None:
    moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    server_step({"w": torch.zeros(1)}, {"w": torch.ones(1)}, moments, _settings(variant="yogi"))
    # v = tau^2 - (1 - beta2) * 1 * sign(tau^2 - 1) = 1e-4 + 0.25
    assert moments["w"][1].item() == pytest.approx(1e-4 + 0.25)
    server_step({"w": torch.zeros(1)}, {"w": torch.zeros(1)}, moments, _settings(variant="yogi"))
    assert moments["w"][1].item() == pytest.approx(1e-4 + 0.25)  # Delta = 0: v stays


def test_the_cloud_step_is_the_average_then_adam() -> None:
    cfg = tiny_config(algorithm={"name": "fedadam", "fedadam": {"eta": 0.05}})
    algo = make_algorithm(cfg)
    assert isinstance(algo, FedAdam) and algo.state_view is algo
    current = {"w": torch.zeros(3)}
    fold = algo.aggregation.cloud_fold(current)
    fold.add(Update("edge0", {"w": torch.full((3,), 1.0)}, 1, (1,) + (0,) * 9))
    fold.add(Update("edge1", {"w": torch.full((3,), 4.0)}, 2, (2,) + (0,) * 9))
    out = fold.result()  # the mean is 3: Delta = 3
    expected = server_step(current, {"w": torch.full((3,), 3.0)}, {}, algo.settings)
    torch.testing.assert_close(out["w"], expected["w"])


def test_the_moments_survive_a_checkpoint_and_a_resume(tmp_path: Path) -> None:
    cfg = tiny_config(algorithm={"name": "fedadam"})
    algo = make_algorithm(cfg)
    assert isinstance(algo, FedAdam)
    server_step({"w": torch.zeros(2)}, {"w": torch.ones(2)}, algo.moments, algo.settings)
    algo.save_cloud_state(tmp_path, 3)
    again = make_algorithm(cfg)
    assert isinstance(again, FedAdam)
    again.load_cloud_state(tmp_path, 3)
    assert list(again.moments) == ["w"]
    for a, b in zip(again.moments["w"], algo.moments["w"], strict=True):
        assert torch.equal(a, b)
    later = make_algorithm(cfg)
    assert isinstance(later, FedAdam)
    later.load_cloud_state(tmp_path, 4)  # another round's checkpoint: start afresh
    assert later.moments == {}


def test_a_resumed_cloud_continues_with_the_same_moments(tmp_path: Path) -> None:
    """A cloud restarted from the checkpoint of the first round (its moments taken back)
    ends on the model of the run that never stopped; without the moments it does not."""
    cfg = tiny_config(run={"rounds": 2}, algorithm={"name": "fedadam"})
    data = load_dataset("synthetic", size=cfg.data.synthetic_size, seed=cfg.run.seed)
    parts = make_partition(data.labels, cfg.federation.num_devices, cfg.data, cfg.run.seed)

    def keep_first(summary: RoundSummary) -> None:  # the run directory as it was then
        if summary.round == 0:
            shutil.copytree(tmp_path / "whole", tmp_path / "first")

    def run(name: str, *, resume: bool = False, moments: bool = True) -> str:
        bus = MemoryBus()
        on_end = keep_first if name == "whole" else None
        fed = build_federation(cfg, bus, data, parts, checkpoint_dir=tmp_path / name,
                               on_round_end=on_end)  # fmt: skip
        if resume:
            ckpt = load_checkpoint(sorted((tmp_path / "first").glob("round_*.safetensors"))[-1])
            assert ckpt.round == 0
            fed.cloud = CloudServer(
                cfg, bus, make_algorithm(cfg), initial_model=ckpt.model, plan=ckpt.plan,
                start_round=1, checkpoint_dir=tmp_path / name, init=ckpt.init,
            )  # fmt: skip
            view = fed.cloud.algorithm.state_view
            assert view is not None
            if moments:
                view.load_cloud_state(tmp_path / "first", 0)
        fed.start()
        assert bus.run(lambda: fed.cloud.done)
        return fed.cloud.model_sha

    whole = run("whole")
    assert run("resumed", resume=True) == whole
    assert run("cold", resume=True, moments=False) != whole
