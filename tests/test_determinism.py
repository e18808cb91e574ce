"""``compute.deterministic``: deterministic kernels only, so a GPU run repeats bit for bit."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from shared.config import RunConfig, config_from_dict
from shared.diffusion.schedule import make_train_scheduler
from shared.diffusion.training import CUBLAS_WORKSPACE_CONFIG, set_deterministic, train_local
from shared.models.presets import build_unet


@pytest.fixture
def torch_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Give the process-wide settings :func:`set_deterministic` changes back as they were."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    mode = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(mode, warn_only=warn_only)


def _cfg(**compute: object) -> RunConfig:
    return config_from_dict({
        "model": {"preset": "fmnist-tiny-cond"},
        "train": {"batch_size": 8, "lr": 1e-3},
        "compute": compute,
    })  # fmt: skip


def test_the_setting_is_per_process_and_off_by_default(torch_settings: None) -> None:
    off, on = _cfg(), _cfg(deterministic=True)
    assert off.compute.deterministic is False and on.compute.deterministic is True
    assert on.digest() == off.digest()  # a device may set it without leaving the federation
    with pytest.raises(Exception, match="deterministic"):
        _cfg(deterministic="sometimes")

    torch.use_deterministic_algorithms(False)
    set_deterministic(False)  # off: torch's settings stay as they are
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ

    set_deterministic(True)
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()  # strict: see its doc
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE_CONFIG
    set_deterministic(False)  # one-way: a process that asked for it keeps it
    assert torch.are_deterministic_algorithms_enabled()


def test_a_workspace_the_environment_chose_is_kept(
    torch_settings: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the other setting NVIDIA documents
    set_deterministic(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def _train(device: str) -> tuple[torch.Tensor, float]:
    """Six class-conditional local steps (Adam, clipping) from the seed-0 U-Net: the final
    weights and the mean loss (under the strict mode, an op without a deterministic kernel
    raises here)."""
    cfg = _cfg()
    gen = torch.Generator().manual_seed(3)
    data = torch.rand((24, 1, 32, 32), generator=gen) * 2 - 1
    labels = torch.randint(0, 10, (24,), generator=gen)
    model = build_unet("fmnist-tiny-cond", seed=0)
    result = train_local(
        model, data, cfg.train, make_train_scheduler(cfg.diffusion),
        torch.Generator().manual_seed(5), steps=6, labels=labels, device=torch.device(device),
    )  # fmt: skip
    return torch.cat([p.detach().flatten() for p in model.parameters()]), result.mean_loss


def test_on_the_cpu_it_changes_no_number(torch_settings: None) -> None:
    """A CPU run already repeats at one thread count: the mode must leave it as it is, and
    every op of a class-conditional training step (embedding, attention, GroupNorm,
    upsampling, clipping, Adam) has a deterministic kernel there (else it raises)."""
    free, free_loss = _train("cpu")
    set_deterministic(True)
    exact, exact_loss = _train("cpu")
    assert torch.equal(exact, free) and exact_loss == free_loss


@pytest.mark.gpu
def test_on_a_gpu_two_runs_end_on_the_same_weights(torch_settings: None) -> None:
    """cuDNN's default backward kernels are not deterministic: on an H200 two eager runs of
    FedProx rounds ended 1.3e-3 apart (benchmarks/results/compare_gpu_h200_tiny). With the
    mode on, no op of the step may lack a deterministic kernel (torch's error names it) and
    two runs must end on the same bits."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    set_deterministic(True)
    first, first_loss = _train("cuda")
    second, second_loss = _train("cuda")
    assert torch.equal(first, second) and first_loss == second_loss
