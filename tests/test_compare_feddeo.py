"""``estuary compare`` of FedDEO and its baselines (configs/compare/compare_feddeo_quick.toml):
the per-domain table, the bytes per device against the reference, the centralized classifier
(Ceiling) and records that keep the final figures."""

from __future__ import annotations

import csv
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from estuary.compare import load_compare, parse_compare, run_compare
from estuary.compare.record import RECORD, load_record
from shared.errors import ConfigError
from shared.methods.feddeo.config import FedDEOConfig

# its module-scoped fixtures are built once: every test of the module on one pytest worker
pytestmark = pytest.mark.xdist_group("compare_feddeo")

REPO = Path(__file__).resolve().parents[1]
QUICK = REPO / "configs" / "compare" / "compare_feddeo_quick.toml"
DOMAINS = ["identity", "invert", "rot90"]  # the quick config's data.domains
LABELS = ["FedDEO", "Prompts-Only", "FedAvg classifier", "Ceiling"]


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quick comparison, run once for every test here (seconds)."""
    out = tmp_path_factory.mktemp("compare-feddeo")
    run_compare(load_compare(QUICK), out, progress=False)
    return out


def _rows(out: Path) -> dict[str, dict[str, Any]]:
    table = json.loads((out / "table.json").read_text())
    return {r["method"]: r for r in table["rows"]}


def test_the_table_has_a_column_per_domain_the_mean_and_rounds(compared: Path) -> None:
    table = json.loads((compared / "table.json").read_text())
    rows = _rows(compared)
    assert list(rows) == LABELS
    keys = list(table["columns"])
    assert keys[2:6] == [*(f"acc_{d}" for d in DOMAINS), "acc_mean"]
    assert {"rounds", "up_per_device", "down_per_device", "up_vs_reference"} <= set(keys)
    for r in rows.values():  # every method scored on the same test sets
        assert r["domains"] == DOMAINS
        accs = [r[f"acc_{d}"] for d in DOMAINS]
        assert all(0 <= a <= 100 for a in accs)
        assert r["acc_mean"] == pytest.approx(sum(accs) / len(accs), abs=0.02)
    assert rows["FedDEO"]["rounds"] == rows["Prompts-Only"]["rounds"] == 1
    assert rows["FedAvg classifier"]["rounds"] == 2 and rows["Ceiling"]["rounds"] == 2
    # FedDEO also scored the first N = 1 image per (device, class): the JSON keeps it
    assert set(rows["FedDEO"]["accuracy_by_n"]) == {"1", "3"}
    assert rows["FedDEO"]["accuracy_by_n"]["3"]["mean"] == pytest.approx(
        rows["FedDEO"]["acc_mean"], abs=0.01
    )
    assert "accuracy_by_n" not in rows["FedAvg classifier"]
    with (compared / "table.csv").open() as f:
        header = next(csv.reader(f))
    assert header == keys
    md = (compared / "table.md").read_text()
    assert "| identity (%) | invert (%) | rot90 (%) | mean (%) | rounds |" in md
    assert "by synthetic images per (device, class)" in md
    assert (compared / "accuracy_by_domain.png").stat().st_size > 0


def test_feddeo_uploads_a_few_kilobytes_per_device_and_fedavg_its_model_each_round(
    compared: Path,
) -> None:
    rows = _rows(compared)
    deo, prompts, avg = rows["FedDEO"], rows["Prompts-Only"], rows["FedAvg classifier"]
    # descriptions (10 x 64 fp32) and a mask, once; Prompts-Only: the mask alone
    assert 2_560 < deo["up_per_device"] <= 4_096
    assert 0 < prompts["up_per_device"] < 256
    # fmnist-cnn's 117,066 weights in fp32, once per round for 2 rounds
    assert avg["up_per_device"] == pytest.approx(2 * 468_856, rel=0.01)
    assert avg["up_vs_reference"] == 1.0
    assert deo["up_vs_reference"] == pytest.approx(deo["up_per_device"] / avg["up_per_device"])
    assert deo["up_vs_reference"] < 0.01
    assert deo["down_per_device"] > 0  # the frozen generator every device fetched
    ceiling = rows["Ceiling"]
    assert ceiling["centralized"] and ceiling["up_per_device"] is None
    assert ceiling["up_vs_reference"] is None


def test_the_ceiling_trains_a_classifier_on_the_pooled_data(compared: Path) -> None:
    ceiling = compared / "ceiling"
    summary = json.loads((ceiling / "summary.json").read_text())
    assert summary["final"]["preset"] == "fmnist-cnn"
    assert list(summary["final"]["accuracy"]) == DOMAINS
    metrics = [json.loads(x) for x in (ceiling / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == [1, 2]  # 120 images, batch 8: 15 steps a round
    assert [m["steps"] for m in metrics] == [15, 15]
    assert list((ceiling / "checkpoints").glob("*.safetensors"))
    # a federated classifier under data.domains reports its final global model the same way
    fedavg = json.loads((compared / "fedavg-classifier" / "summary.json").read_text())
    assert list(fedavg["final"]["accuracy"]) == DOMAINS


def test_a_reused_record_keeps_the_final_figures(compared: Path) -> None:
    spec = load_compare(QUICK)
    for m in spec.methods:
        run, why = load_record(m, compared / m.slug, evaluate=True)
        assert run is not None, why
        assert run.final is not None and list(run.final["accuracy"]) == DOMAINS
    before = _rows(compared)
    res = run_compare(spec, compared, progress=False)  # every method reused
    assert all(r.wall_s == before[r.method.label]["wall_s"] for r in res.runs)
    after = _rows(compared)
    for label in LABELS:
        for key in ("acc_mean", "up_per_device", "up_vs_reference", "accuracy_by_n"):
            assert after[label].get(key) == before[label].get(key), (label, key)
    # a record whose final figures are malformed is not reused
    path = compared / "feddeo" / RECORD
    doc = json.loads(path.read_text())
    m = spec.methods[0]
    try:
        path.write_text(json.dumps({**doc, "final": {"accuracy": {"identity": "high"}}}))
        run, why = load_record(m, compared / m.slug, evaluate=True)
        assert run is None and "final" in why
    finally:
        path.write_text(json.dumps(doc))


def test_a_centralized_classifier_takes_no_weight_average_or_pruning() -> None:
    raw = tomllib.loads(QUICK.read_text())
    ceiling = next(e for e in raw["method"] if e["label"] == "Ceiling")
    pruned = {"algorithm.name": "fedphd", "algorithm.fedphd.prune_ratio": 0.4,
              "algorithm.fedphd.prune_at": "init"}  # fmt: skip
    for extra, match in (({"ema": 0.9}, "centralized classifier"),
                         ({"overrides": pruned}, "trains U-Nets")):  # fmt: skip
        ceiling_bad = {**ceiling, **extra}
        bad = {**raw, "method": [m if m is not ceiling else ceiling_bad for m in raw["method"]]}
        with pytest.raises(ConfigError, match=match):
            parse_compare(bad, QUICK)


@pytest.mark.parametrize("name", ["compare_feddeo_cpu.toml", "compare_feddeo_labelskew_cpu.toml"])
def test_the_shipped_feddeo_comparisons(name: str) -> None:
    """The four methods, FedAvg's total upload the reference, and the Ceiling as many passes
    over the pooled data as FedAvg's devices make over theirs."""
    path = REPO / "configs" / "compare" / name
    spec = parse_compare(tomllib.loads(path.read_text()), path)
    methods = {m.label: m for m in spec.methods}
    assert list(methods) == LABELS and spec.reference == "FedAvg classifier"
    for label in ("FedDEO", "Prompts-Only"):
        cfg = methods[label].cfg
        assert (cfg.algorithm.name, cfg.run.rounds, cfg.model.init) == ("feddeo", 1, "pretrained")
    assert FedDEOConfig.of(methods["FedDEO"].cfg).use_descriptions
    assert not FedDEOConfig.of(methods["Prompts-Only"].cfg).use_descriptions
    avg, ceiling = methods["FedAvg classifier"].cfg, methods["Ceiling"].cfg
    assert methods["Ceiling"].centralized and ceiling.model.preset == avg.model.preset
    epochs = avg.run.rounds * avg.train.local_epochs
    assert ceiling.run.rounds * ceiling.train.local_epochs == epochs
    assert avg.data.domains  # so FedAvg's final global model is scored per domain
    assert (avg.eval.every, avg.eval.sample_every) == (0, 0)
