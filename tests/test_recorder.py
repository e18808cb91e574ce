"""RunRecorder's per-round traffic columns and the report's traffic panel labels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cloud.service import RoundSummary
from shared.config import RunConfig
from shared.errors import EstuaryError
from shared.evaluation.recorder import RunRecorder
from shared.evaluation.report import plot_report, read_metrics, report_figure, traffic_labels
from shared.transport.telemetry import Traffic


def summary(r: int) -> RoundSummary:
    return RoundSummary(
        round=r,
        participants=4,
        updates=4,
        mean_loss=0.5,
        cloud_aggregated=True,
        model_sha256="0" * 64,
        round_seconds=1.0,
        aggregation_seconds=0.1,
        train_seconds=0.5,
        rejected=0,
    )


def test_cloud_scope_counts_what_the_cloud_received_and_sent(
    tiny_cfg: RunConfig, tmp_path: Path
) -> None:
    """Over MQTT the cloud's counters see only its own traffic: the global model leaves as
    a blob it sends, so "down" must come from its sent bytes (it read ~0 from received)."""
    traffic = Traffic()
    rec = RunRecorder(tiny_cfg, tmp_path, traffic, evaluate=False, traffic_scope="cloud")
    traffic.count("received", "edge_update", 1000)
    traffic.count("received", "msg_edge_update", 10)
    traffic.count("received", "msg_presence", 7)  # neither up nor sent
    traffic.count("sent", "global_model", 500)
    traffic.count("sent", "msg_round_start", 5)
    rec.on_round_end(summary(0))
    traffic.count("received", "edge_update", 1000)
    traffic.count("sent", "global_model", 500)
    rec.on_round_end(summary(1))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["bytes_up"], r["bytes_down"]) for r in rows] == [(1010, 505), (1000, 500)]
    assert all(r["traffic_scope"] == "cloud" for r in rows)
    title, up, down = traffic_labels(rows)
    assert "at the cloud" in title and "received by the cloud" in up and "sent by the cloud" in down
    fig = report_figure(rows, title="demo (MQTT)")
    assert fig.get_suptitle() == "demo (MQTT)"
    assert fig.axes[1].get_title() == title
    legend = fig.axes[1].get_legend()
    assert legend is not None and [t.get_text() for t in legend.get_texts()] == [up, down]
    assert plot_report(rows, tmp_path / "report.png").stat().st_size > 10_000


def test_all_scope_counts_what_every_receiver_got(tiny_cfg: RunConfig, tmp_path: Path) -> None:
    """In one process (MemoryBus) every role counts into one Traffic: receptions on both
    tiers are the traffic, and sends would count every message twice."""
    traffic = Traffic()
    rec = RunRecorder(tiny_cfg, tmp_path, traffic, evaluate=False)
    traffic.count("received", "global_model", 400)  # at two edges
    traffic.count("received", "edge_model", 800)  # at four devices
    traffic.count("received", "device_update", 800)
    traffic.count("received", "edge_update", 400)
    traffic.count("sent", "global_model", 200)
    rec.on_round_end(summary(0))
    row = rec.rows[0]
    assert (row["bytes_up"], row["bytes_down"], row["traffic_scope"]) == (1200, 1200, "all")
    assert traffic_labels(rec.rows) == (
        "traffic per round",
        "up (devices→edges→cloud)",
        "down (cloud→edges→devices)",
    )


def test_rows_without_a_scope_keep_the_old_labels() -> None:
    """metrics.jsonl files written before the scope existed plot as they always did."""
    assert traffic_labels([{"round": 0, "bytes_up": 1}])[0] == "traffic per round"
    assert traffic_labels([])[0] == "traffic per round"


def test_resume_after_a_torn_last_row(tiny_cfg: RunConfig, tmp_path: Path) -> None:
    """A cloud killed while appending a row leaves half a line; the restarted cloud reads
    the rows before it and rewrites the file (it used to die on a JSONDecodeError), while a
    bad line in the middle is still an error."""
    traffic = Traffic()
    rec = RunRecorder(tiny_cfg, tmp_path, traffic, evaluate=False, traffic_scope="cloud")
    rec.on_round_end(summary(0))
    rec.on_round_end(summary(1))
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(path.read_bytes()[:-40])  # the second row cut short
    assert [r["round"] for r in read_metrics(path)] == [1]  # rows count rounds from 1
    # resume after the round of index 0: the first row is kept
    again = RunRecorder(tiny_cfg, tmp_path, Traffic(), evaluate=False, resume_after=0)
    assert [r["round"] for r in again.rows] == [1]
    again.on_round_end(summary(1))
    assert [r["round"] for r in read_metrics(path)] == [1, 2]
    path.write_text("{not json\n" + path.read_text())
    with pytest.raises(EstuaryError, match="line 1 is not JSON"):
        read_metrics(path)
