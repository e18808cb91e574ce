"""The demo's story: the per-class measure, the start's score, the summary and report.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud.service import RoundSummary
from estuary.demo import DEMO_CONFIG, DEMO_GROUPS, DEMO_START, progress_figures
from shared.config import config_from_dict
from shared.data.datasets import load_fashion_mnist, save_grid, to_model_input
from shared.errors import ConfigError, DataError
from shared.evaluation import quality
from shared.evaluation.recorder import RunRecorder
from shared.evaluation.report import headline, plot_report, report_figure
from shared.evaluation.story import (
    class_shares,
    new_class_share,
    new_classes,
    story_figures,
    story_text,
)
from shared.models import init as model_init
from shared.models.init import SHIPPED_STARTS, load_init_state
from shared.models.presets import build_unet
from shared.transport.telemetry import Traffic
from shared.wire.codec import write_asset
from tests.conftest import needs_fmnist, tiny_config

SHOES = [5, 7, 9]  # sandal, sneaker, ankle boot


def test_class_shares_count_the_argmax_of_each_sample() -> None:
    probs = np.array([[0.9, 0.1, 0.0], [0.2, 0.7, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
    assert class_shares(probs) == [0.25, 0.5, 0.25]
    assert new_class_share(class_shares(probs), [1, 2]) == 0.75
    assert new_class_share(class_shares(probs), [1, 1]) == 0.5  # a class counts once
    with pytest.raises(DataError):
        new_class_share([0.5, 0.5], [2])
    with pytest.raises(DataError):
        class_shares(np.zeros((0, 10)))


@needs_fmnist
def test_the_shipped_classifier_tells_clothes_from_shoes() -> None:
    """Real clothes score ~0 on the shoe share and real shoes ~1: a
    generator that draws only the start's classes cannot pass for one that learned."""
    test = load_fashion_mnist("test")
    rng = np.random.default_rng(0)
    clothes = rng.choice(np.flatnonzero(~np.isin(test.labels, SHOES)), 200, False)
    shoes = rng.choice(np.flatnonzero(np.isin(test.labels, SHOES)), 200, False)
    for idx, low, high in ((clothes, 0.0, 0.05), (shoes, 0.95, 1.0)):
        probs = quality.extract(to_model_input(test.images[idx], 1))[1]
        assert low <= new_class_share(class_shares(probs), SHOES) <= high


def test_the_demo_starts_from_the_clothes_and_its_devices_hold_the_rest() -> None:
    cfg = config_from_dict(DEMO_CONFIG, source="demo")
    recipe = json.loads(DEMO_START.with_suffix(".json").read_text())
    assert recipe["sha256"] == SHIPPED_STARTS[DEMO_START.name]
    assert recipe["held_out_classes"] == [5, 7, 8, 9]  # the start saw no shoe and no bag
    assert sorted({c for g in DEMO_GROUPS for c in g}) == [5, 7, 8, 9]  # dominant: new ones
    assert new_classes(cfg) == [5, 7, 8, 9]  # the measure: classes the start lacks, devices hold
    assert cfg.data.dominant_uniform_fraction == 0.5  # and half from all ten (clothes too)
    state = load_init_state("fmnist-tiny", cfg.model.init)  # the recorded hash matches
    assert state is not None


def test_a_shipped_start_with_other_bytes_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / DEMO_START.name
    data = bytearray(DEMO_START.read_bytes())
    data[-1] ^= 1
    copy.write_bytes(bytes(data))
    monkeypatch.setattr(model_init, "ASSETS", tmp_path)
    with pytest.raises(ConfigError, match="SHIPPED_STARTS"):
        load_init_state("fmnist-tiny", str(copy))


def _summary(r: int, loss: float) -> RoundSummary:
    return RoundSummary(
        round=r, participants=4, updates=4, mean_loss=loss, cloud_aggregated=True,
        model_sha256="0" * 64, round_seconds=1.0, aggregation_seconds=0.1, train_seconds=0.5,
        rejected=0,
    )  # fmt: skip


def _start_file(tmp_path: Path, held_out: list[int] | None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "start.safetensors"
    write_asset(path, build_unet("fmnist-tiny", seed=3).state_dict(), {"preset": "fmnist-tiny"})
    if held_out is not None:
        recipe = json.loads(path.with_suffix(".json").read_text())
        path.with_suffix(".json").write_text(json.dumps({**recipe, "held_out_classes": held_out}))
    return path


def test_the_cloud_scores_the_start_before_round_one(tmp_path: Path) -> None:
    """The start's grid and quality (with the new-class share) land in round 1's row."""
    cfg = tiny_config(
        model={"init": str(_start_file(tmp_path, [5, 7]))},
        eval={"every": 1, "sample_every": 1, "num_samples": 12, "num_reference": 12,
              "sample_steps": 2, "grid_size": 4},
    )  # fmt: skip
    run = tmp_path / "run"
    rec = RunRecorder(cfg, run, Traffic(), evaluate=True, traffic_scope="cloud")
    rec.model_fn = lambda: build_unet("fmnist-tiny", seed=3)
    rec.evaluate_start()
    assert rec.start is not None and (run / "samples" / "round_000000.png").is_file()
    rec.on_round_end(_summary(0, 0.5))
    rec.on_round_end(_summary(1, 0.4))
    first, second = rec.rows
    assert "start" in first and "start" not in second
    start_q = first["start"]["quality"]
    assert start_q["new_classes"] == [5, 7]
    assert start_q["new_class_share"] == pytest.approx(
        sum(start_q["class_shares"][c] for c in (5, 7))
    )
    assert sum(start_q["class_shares"]) == pytest.approx(1.0, abs=1e-3)
    assert headline(rec.rows)["start_quality"]["round"] == 0
    fig = story_figures(rec.rows)
    assert fig["rounds"] == (0, 2) and fig["loss"] == (0.5, 0.4)
    assert fig["grids"] == ("samples/round_000000.png", "samples/round_000002.png")


def test_a_random_start_is_not_scored(tmp_path: Path) -> None:
    cfg = tiny_config(eval={"every": 1, "sample_every": 1, "num_samples": 12,
                            "num_reference": 12, "sample_steps": 2, "grid_size": 4})  # fmt: skip
    rec = RunRecorder(cfg, tmp_path, Traffic(), evaluate=True)
    rec.model_fn = lambda: build_unet("fmnist-tiny")
    rec.evaluate_start()
    assert rec.start is None and not (tmp_path / "samples").exists()


def _story_rows(run: Path) -> list[dict[str, Any]]:
    for name in ("round_000000.png", "round_000004.png"):
        save_grid(np.full((4, 28, 28), 128 if "4" in name else 0, np.uint8), run / "samples" / name)
    q = {"fid": 90.0, "precision": 0.5, "recall": 0.4, "new_class_share": 0.02,
         "new_classes": SHOES, "extractor": "fmnist-cnn-v1"}  # fmt: skip
    return [
        {"round": 1, "train_loss": 0.06, "bytes_up": 10, "bytes_down": 20,
         "start": {"round": 0, "grid": "samples/round_000000.png", "quality": q}},
        {"round": 2, "train_loss": 0.05, "quality": {**q, "fid": 70.0, "new_class_share": 0.3}},
        {"round": 4, "train_loss": 0.045, "grid": "samples/round_000004.png",
         "quality": {**q, "fid": 60.0, "new_class_share": 0.41}},
    ]  # fmt: skip


def test_the_summary_and_the_bar_give_first_and_last(tmp_path: Path) -> None:
    rows = _story_rows(tmp_path)
    lines = story_text(story_figures(rows))
    assert lines == [
        "train loss: first round 0.0600 -> last round 0.0450",
        "FID: the start 90.0 -> round 4 60.0",
        "samples drawn in the classes only the devices held (Sandal, Sneaker, Ankle boot): "
        "2% -> 41%",
    ]
    assert progress_figures(rows) == {"loss": "0.0600->0.0450", "FID": "90.0->60.0",
                                      "new": "2%->41%"}  # fmt: skip
    without_start = [{k: v for k, v in r.items() if k != "start"} for r in rows]
    assert story_text(story_figures(without_start))[1] == "FID: round 2 70.0 -> round 4 60.0"


def test_report_shows_the_before_and_after_grids_beside_the_curves(tmp_path: Path) -> None:
    rows = _story_rows(tmp_path)
    fig = report_figure(rows, run_dir=tmp_path)
    assert len(fig.axes) == 6  # loss, traffic, quality (+ its twin), before, after
    before, after = (a for a in fig.axes if a.get_images())
    assert before.get_title().startswith("before") and after.get_title() == "after: round 4"
    assert float(np.asarray(before.get_images()[0].get_array()).mean()) < float(
        np.asarray(after.get_images()[0].get_array()).mean()
    )  # the start's grid (black here) on the left
    share = [ln for a in fig.axes for ln in a.get_lines() if "new to" in str(ln.get_label())]
    assert list(share[0].get_xdata()) == [0, 2, 4]  # type: ignore[arg-type]
    assert len(report_figure(rows).axes) == 4  # no run directory: the curves only
    assert plot_report(rows, tmp_path / "report.png").stat().st_size > 10_000


def test_new_classes_are_those_the_start_lacks_and_the_devices_hold(tmp_path: Path) -> None:
    init = str(_start_file(tmp_path, [5, 7, 8, 9]))
    groups = {"partition": "dominant_groups", "dominant_groups": [[5, 7], [0, 5]],
              "dominant_uniform_fraction": 0.0}  # fmt: skip
    assert new_classes(tiny_config(model={"init": init}, data=groups)) == [5, 7]
    mixed = {**groups, "dominant_uniform_fraction": 0.2}  # every device holds every class
    assert new_classes(tiny_config(model={"init": init}, data=mixed)) == [5, 7, 8, 9]
    assert new_classes(tiny_config(model={"init": init})) == [5, 7, 8, 9]
    assert new_classes(tiny_config()) is None  # a random start: nothing to compare with
    plain = str(_start_file(tmp_path / "b", None))
    assert new_classes(tiny_config(model={"init": plain})) is None
