"""What a run leaves for its reader: the headline results in ``summary.json``, a report whose
axes do not exaggerate, and the demo's progress bar saying what the hierarchy is doing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from estuary.demo import DEMO_CONFIG, _device_uploads, phase_text
from estuary.simulate import simulate
from shared.config import config_from_dict
from shared.evaluation.report import headline, read_metrics, report_figure
from tests.conftest import tiny_config


def _rows() -> list[dict[str, Any]]:
    return [
        {"round": 1, "train_loss": 0.0512, "bytes_up": 100, "bytes_down": 200},
        {"round": 2, "train_loss": 0.0508, "bytes_up": 100, "bytes_down": 200,
         "quality": {"fid": 35.5, "precision": 0.5, "recall": 0.4, "extractor": "x",
                     "n_fake": 250}},
        {"round": 3, "train_loss": None, "bytes_up": 0, "bytes_down": 0},
        {"round": 4, "train_loss": 0.0505, "bytes_up": 100, "bytes_down": 200,
         "quality": {"fid": 34.8, "precision": 0.6, "recall": 0.5, "extractor": "x",
                     "n_fake": 250, "clients": {"dev000": 40.0}},
         "accuracy": {"devices": 2, "after_mean": 0.8, "per_device": {"dev000": [0.7, 0.8]}}},
    ]  # fmt: skip


def test_headline_has_loss_quality_and_accuracy() -> None:
    h = headline(_rows())
    assert h["train_loss"] == {"first": 0.0512, "last": 0.0505, "first_round": 1,
                               "last_round": 4}  # fmt: skip
    assert h["quality"]["fid"] == 34.8 and h["quality"]["round"] == 4
    assert "clients" not in h["quality"]  # headline figures only, not every device's
    assert h["accuracy"] == {"round": 4, "devices": 2, "after_mean": 0.8}
    assert headline([]) == {}


def test_report_axes_start_at_zero_and_the_legend_has_room(tmp_path: Path) -> None:
    """A flat loss and FID 35.5 -> 34.8 must look flat: both axes start at zero; the
    traffic legend sits in headroom above the bars."""
    fig = report_figure(_rows())
    loss_ax, traffic_ax, quality_ax = fig.axes[:3]
    assert loss_ax.get_ylim()[0] == 0 and quality_ax.get_ylim()[0] == 0
    assert quality_ax.get_ylim()[1] >= 35.5
    assert traffic_ax.get_ylim()[1] >= 1.3 * 300 / 2**20


def test_demo_progress_says_what_is_happening() -> None:
    cfg = config_from_dict(DEMO_CONFIG, source="demo")

    def cloud(state: str, round_: float) -> dict[str, dict[str, float]]:
        return {"cloud": {f'estuary_phase{{estuary_phase="{state}"}}': 1.0,
                          'estuary_phase{estuary_phase="idle"}': 0.0,
                          "estuary_round": round_}}  # fmt: skip

    assert phase_text(cfg, {}, 0) == "starting processes"
    waiting = cloud("waiting", 0) | {
        "edge0": {'estuary_connected_devices{edge="edge0"}': 3.0},
        "edge1": {'estuary_connected_devices{edge="edge1"}': 2.0},
    }
    assert phase_text(cfg, waiting, 0) == "waiting for devices (5/6 connected)"
    assert phase_text(cfg, cloud("scoring", 0), 0) == "scoring the start (FID on 250 samples)"
    assert phase_text(cfg, cloud("training", 2), 2) == "round 3: devices training"
    # the demo evaluates every 2 rounds: round 2 is an evaluation round, round 3 is not
    assert "evaluating (FID on 250 samples)" in phase_text(cfg, cloud("aggregating", 1), 1)
    assert phase_text(cfg, cloud("aggregating", 2), 2) == "round 3: aggregating"
    assert phase_text(cfg, cloud("aggregating", 1), 1, evaluate=False) == "round 2: aggregating"
    assert phase_text(cfg, cloud("deploying", 4), 4).startswith("deploying: export to ONNX")


def test_the_demo_summary_counts_each_devices_uploads_from_its_scrape() -> None:
    cfg = config_from_dict(DEMO_CONFIG, source="demo")
    sent = {'estuary_bytes_total{direction="sent",kind="device_update"}': 4000.0,
            'estuary_messages_total{direction="sent",kind="device_update"}': 4.0,
            'estuary_bytes_total{direction="sent",kind="device_report"}': 300.0,
            'estuary_bytes_total{direction="received",kind="edge_model"}': 9000.0}  # fmt: skip
    out = _device_uploads(cfg, {"dev000": sent, "cloud": sent})
    assert out["dev000"] == {"upload_bytes": 4000.0, "uploads": 4.0, "sent_bytes": 4300.0}
    assert list(out) == [f"dev{i:03d}" for i in range(6)]  # every device, scraped or not
    assert out["dev005"] == {"upload_bytes": 0, "uploads": 0, "sent_bytes": 0}


def test_rounds_are_counted_from_one_everywhere_a_person_reads_them(tmp_path: Path) -> None:
    """The third round is round 3 in metrics.jsonl, in the grid's and the checkpoint's file
    names, on the report's x axis and in summary.json, as in the progress bar and the logs."""
    import json

    cfg = tiny_config(eval={"every": 0, "sample_every": 2, "checkpoint_every": 1,
                            "grid_size": 4, "sample_steps": 2})  # fmt: skip
    result = simulate(cfg, tmp_path / "r", progress=False, evaluate=False)
    run = result.run_dir
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["round"] for r in rows] == [1, 2, 3]
    # every second round and the last one: rounds 2 and 3
    assert sorted(p.name for p in (run / "samples").glob("*.png")) == [
        "round_000002.png",
        "round_000003.png",
    ]
    assert [r.get("grid") for r in rows] == [None, "samples/round_000002.png",
                                             "samples/round_000003.png"]  # fmt: skip
    assert sorted(p.name for p in (run / "checkpoints").glob("round_*")) == [
        "round_000001.safetensors",
        "round_000002.safetensors",
        "round_000003.safetensors",
    ]
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["round"] == 3
    loss_ax, traffic_ax = report_figure(rows).axes[:2]
    assert list(map(int, loss_ax.lines[0].get_xdata())) == [1, 2, 3]  # type: ignore[arg-type]
    bars = [b.get_center()[0] for b in traffic_ax.patches[:3]]  # type: ignore[attr-defined]
    assert [round(x) for x in bars] == [1, 2, 3]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["results"]["train_loss"]["last_round"] == 3 and summary["rounds"] == 3


def test_the_progress_bar_shows_on_a_terminal_that_reports_no_size() -> None:
    """A fresh pseudo-terminal reports 0 columns and 0 rows (``script``, some ``docker exec
    -t``); tqdm alone draws nothing there, the demo's bar gets a size and shows."""
    import os
    import pty
    import subprocess
    import sys

    draw = (
        "from {} import {} as bar\n"
        "with bar(total=4, desc='demo', unit='round') as b:\n"
        "    b.set_description_str('demo: round 2: devices training'); b.update(1)\n"
    )

    def on_a_fresh_pty(code: str) -> str:
        master, slave = pty.openpty()
        try:
            assert os.get_terminal_size(slave) == (0, 0)
            subprocess.run([sys.executable, "-c", code], stderr=slave, check=True, timeout=60)
            return os.read(master, 65536).decode()
        finally:
            os.close(master)
            os.close(slave)

    assert "round 2" not in on_a_fresh_pty(draw.format("tqdm", "tqdm"))  # what this fixes
    out = on_a_fresh_pty(draw.format("shared.progress", "progress_bar"))
    assert "demo: round 2: devices training" in out and "1/4" in out
