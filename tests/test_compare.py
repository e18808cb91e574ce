"""``estuary compare``: config validation, and a tiny synthetic comparison end to end."""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from estuary.cli import main
from estuary.compare import CompareResult, Method, load_compare, parse_compare, run_compare
from estuary.compare.plots import _curves
from estuary.compare.tables import COLUMNS, LAST_EVALS, _algorithm, _quality, markdown
from shared.errors import ConfigError
from shared.methods.fedphd.config import FedPhDConfig
from shared.metrics.accounting import Distances

TINY = """
[compare]
name = "tiny"
reference = "FedAvg"

[base.run]
seed = 0
rounds = 2
[base.federation]
num_devices = 4
num_edges = 2
round_deadline_s = 60
[base.data]
dataset = "synthetic"
synthetic_size = 32
[base.model]
preset = "fmnist-tiny"
[base.train]
local_steps = 1
batch_size = 2
[base.eval]
every = 2
sample_every = 0
num_samples = 12
num_reference = 12
sample_steps = 2

[[method]]
label = "FedAvg"
overrides = {"algorithm.name" = "fedavg"}

[[method]]
label = "FedPhD (select)"
[method.overrides]
"federation.assignment" = "select"
"federation.cloud_every" = 2
[method.overrides.algorithm]
name = "fedphd"

[[method]]
label = "Centralized"
centralized = true
ema = 0.9
"""


def _raw(**changes: Any) -> dict[str, Any]:
    import tomllib

    raw = tomllib.loads(TINY)
    raw.update(changes)
    return raw


@pytest.fixture(scope="module")
def tiny_done(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CompareResult]:
    """The tiny comparison run once in this process, sequentially and with evaluation: its
    TOML and its result (output in ``result.out``). Tests that change the output work on a
    copy (:func:`_copy_of`)."""
    folder = tmp_path_factory.mktemp("tiny")
    cfg = _tiny_file(folder)
    return cfg, run_compare(load_compare(cfg), folder / "out", progress=False)


def _copy_of(done: tuple[Path, CompareResult], tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the finished tiny comparison in ``tmp_path``: (its TOML, its output)."""
    cfg, res = done
    shutil.copytree(res.out, tmp_path / "out")
    return _tiny_file(tmp_path, cfg.read_text()), tmp_path / "out"


#: the tests that read the module's finished comparison run on one pytest worker
uses_tiny_done = pytest.mark.xdist_group("compare-tiny")


@uses_tiny_done
def test_compare_writes_tables_and_plots(tiny_done: tuple[Path, CompareResult]) -> None:
    cfg, res = tiny_done
    spec = load_compare(cfg)
    assert [m.slug for m in spec.methods] == ["fedavg", "fedphd-select", "centralized"]
    out = res.out
    for name in ("table.md", "table.csv", "table.json", "quality.png", "bytes.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for slug in ("fedavg", "fedphd-select", "centralized"):
        assert (out / slug / "metrics.jsonl").is_file(), slug
    keys = [k for k, _, _ in COLUMNS]
    with (out / "table.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == keys and [r["method"] for r in rows] == [m.label for m in spec.methods]
    assert all(r[k] != "" for r in rows for k in keys)
    md = (out / "table.md").read_text()
    assert all(header in md for _, header, _ in COLUMNS)
    doc = json.loads((out / "table.json").read_text())
    by = {r["method"]: r for r in doc["rows"]}
    assert all(k in r for r in doc["rows"] for k in keys)

    fedavg, fedphd, central = by["FedAvg"], by["FedPhD (select)"], by["Centralized"]
    # a whole fp32 model per upload, plus the safetensors header: just over 32 bits a weight
    assert 32.0 < fedavg["bits_per_weight"] < 32.5
    assert fedavg["device_round_bytes"] > 2 * fedavg["device_up_bytes"] * 0.99
    assert all(r["fid"] is not None and r["is"] is not None for r in doc["rows"])
    # the same local compute everywhere: 2 rounds x 4 devices x 1 step
    assert fedavg["local_steps"] == fedphd["local_steps"] == central["local_steps"] == 8
    assert fedavg["central_aggs"] == 2 and fedphd["central_aggs"] == 1
    assert fedavg["cloud_mib_per_agg"] == pytest.approx(fedavg["cloud_mib_per_agg_analytic"])
    # flat FedAvg: 4 devices down + up cross the cloud link; FedPhD: 2 edges up + down
    assert fedavg["cloud_bytes_per_agg"] == pytest.approx(2 * fedphd["cloud_bytes_per_agg"], 1e-3)
    assert central["total_bytes"] == 0 and central["central_aggs"] == 0
    assert [q["method"] for q in doc["relative"]] == ["FedPhD (select)"]  # not Centralized
    # the plotted weighted cost uses the comparison's distances, as the table does (the
    # plot used the defaults): FedAvg is flat, so all of it is on the cloud link (0.02 d_c)
    run = res.runs[0]
    near, far = (_curves(run, Distances(1.0, d_c))["cost"][-1] for d_c in (10.0, 20.0))
    assert near > 0 and far == pytest.approx(2 * near)


def test_quality_columns_last_best_and_the_mean_of_the_last_evaluations() -> None:
    assert LAST_EVALS == 3
    rows: list[dict] = [{"round": 0}]  # a round with no evaluation is skipped
    rows += [{"round": i + 1, "quality": {"fid": f, "is_mean": 1.0}} for i, f in
             enumerate([300.0, 90.0, 210.0, 120.0])]  # fmt: skip
    q = _quality(rows)
    assert q["fid"] == 120.0 and q["fid_best"] == 90.0
    assert q["fid_last"] == pytest.approx((90.0 + 210.0 + 120.0) / 3)
    # fewer evaluations than LAST_EVALS: the mean of those there are
    assert _quality(rows[:3])["fid_last"] == pytest.approx(195.0)
    assert _quality([{"round": 0}])["fid_last"] is None


def test_unknown_override_key_is_named() -> None:
    raw = _raw(method=[{"label": "A", "overrides": {"algorithm.nmae": "fedavg"}}])
    with pytest.raises(ConfigError, match=r"'A'.*unknown override key 'algorithm.nmae'"):
        parse_compare(raw, Path("x.toml"))
    raw = _raw(method=[{"label": "A", "overrides": {"algo.name": "fedavg"}}])
    with pytest.raises(ConfigError, match=r"unknown override key 'algo.name'"):
        parse_compare(raw, Path("x.toml"))


@pytest.mark.parametrize(
    ("method", "match"),
    [
        ({"label": "A", "overrides": {"algorithm.name": "nope"}}, "algorithm.name"),
        ({"label": "A", "overrides": {"data.partition": "classes"}}, "changes data"),
        ({"label": "A", "overrides": {"run.seed": 3}}, "changes run.seed"),
        ({"label": "A", "overides": {}}, "unknown keys"),
        ({"overrides": {}}, "needs a string 'label'"),
        # a string is truthy: "false" used to make the method centralized
        ({"label": "A", "centralized": "false"}, "'centralized' must be true or false"),
        ({"label": "A", "ema": 0.99}, "'ema' is for centralized training only"),
        ({"label": "A", "centralized": True, "ema": 1.0}, r"'ema' must be a number in \[0, 1\)"),
        ({"label": "A", "centralized": True, "ema": "0.9"}, "'ema' must be a number"),
        ({"label": "A", "centralized": True, "ema": True}, "'ema' must be a number"),
        ({"label": "A", "centralized": True, "ema": float("nan")}, "'ema' must be a number"),
        ({"label": "A", "centralized": True, "ema": -0.1}, "'ema' must be a number"),
        (
            {
                "label": "A",
                "centralized": True,
                "overrides": {
                    "algorithm.name": "fedphd",
                    "algorithm.fedphd.prune_ratio": 0.44,
                    "algorithm.fedphd.sparse_rounds": 1,
                },
            },
            "prunes only before its first step",
        ),
        (
            {
                "label": "A",
                "centralized": True,
                "overrides": {"algorithm.prune_ratio": 0.44, "algorithm.prune_at": "init"},
            },
            "a pruned centralized ceiling names fedphd",
        ),
    ],
)
def test_bad_methods_rejected(method: dict[str, Any], match: str) -> None:
    raw = _raw(method=[{"label": "B"}, method])
    with pytest.raises(ConfigError, match=match):
        parse_compare(raw, Path("x.toml"))


def test_bad_compare_sections_rejected() -> None:
    with pytest.raises(ConfigError, match="no \\[\\[method\\]\\]"):
        parse_compare(_raw(method=[]), Path("x.toml"))
    with pytest.raises(ConfigError, match="duplicate method labels"):
        parse_compare(_raw(method=[{"label": "A"}, {"label": "A"}]), Path("x.toml"))
    with pytest.raises(ConfigError, match="reference 'Z'"):
        parse_compare(_raw(compare={"reference": "Z"}), Path("x.toml"))
    with pytest.raises(ConfigError, match="unknown top-level keys"):
        parse_compare(_raw(methods=[]), Path("x.toml"))
    # these two used to raise TypeError
    with pytest.raises(ConfigError, match="\\[compare\\] must be a table"):
        parse_compare(_raw(compare=5), Path("x.toml"))
    with pytest.raises(ConfigError, match="base sections \\['run'\\] must be tables"):
        parse_compare({**_raw(), "base": {"run": 5}}, Path("x.toml"))


def test_env_overrides_apply_to_the_base() -> None:
    spec = parse_compare(_raw(), Path("x.toml"), {"ESTUARY__TRAIN__LR": "0.01"})
    assert all(m.cfg.train.lr == 0.01 for m in spec.methods)


def test_cli_reports_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(TINY.replace('"algorithm.name" = "fedavg"', '"federation.edges" = 3'))
    assert main(["compare", str(cfg), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert "unknown override key 'federation.edges'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


REPO = Path(__file__).resolve().parents[1]
#: the shipped comparison specs
COMPARE_DIR = REPO / "configs" / "compare"


@pytest.mark.parametrize(
    "name",
    [
        "compare_cpu_tiny.toml",
        "compare_cpu_tiny_long.toml",
        "compare_cpu_tiny_xlong.toml",
        "compare_gpu_small.toml",
    ],
)
def test_shipped_comparisons_load(name: str) -> None:
    spec = parse_compare(_toml(COMPARE_DIR / name), COMPARE_DIR / name)
    labels = [m.label for m in spec.methods]
    assert {"FedAvg", "FedPhD"} <= set(labels)
    if "long" not in name:
        assert {"FedAvg (E=1)", "FedPhD (OS)"} <= set(labels)
    if "xlong" not in name:  # the 16 k-step run: FedAvg, FedAvg(E=1) and FedPhD only
        central = next(m for m in spec.methods if m.centralized)
        assert 0.99 <= central.ema < 1  # the paper's centralized baseline uses EMA
    steps = {
        m.label: m.cfg.run.rounds * (m.cfg.train.local_steps or m.cfg.train.local_epochs)
        for m in spec.methods
    }
    assert len(set(steps.values())) == 1, steps  # equal local computation
    phd = next(m.cfg for m in spec.methods if m.label == "FedPhD")
    assert FedPhDConfig.of(phd).prune_ratio == 0.44 and phd.federation.cloud_every == 5


@pytest.mark.parametrize(
    ("name", "of"),
    [
        ("compare_ablation_cpu_tiny_long.toml", "compare_cpu_tiny_long.toml"),
        ("compare_ablation_cpu_tiny_xlong.toml", "compare_cpu_tiny_xlong.toml"),
    ],
)
def test_shipped_ablations_match_their_comparison(name: str, of: str) -> None:
    """An ablation's rows are read beside its comparison's: same split, seed, model and
    evaluation, and equal local computation within the ablation."""
    spec = parse_compare(_toml(COMPARE_DIR / name), COMPARE_DIR / name)
    main = parse_compare(_toml(COMPARE_DIR / of), COMPARE_DIR / of).methods[0].cfg
    for m in spec.methods:
        c = m.cfg
        assert (c.data, c.run.seed, c.model, c.diffusion) == (
            main.data,
            main.run.seed,
            main.model,
            main.diffusion,
        ), m.label
        assert (c.eval.num_samples, c.eval.sample_steps) == (500, 25), m.label
        assert c.federation.num_devices == main.federation.num_devices, m.label
    steps = {m.label: m.cfg.run.rounds * m.cfg.train.local_steps for m in spec.methods}
    assert len(set(steps.values())) == 1, steps


def _toml(path: Path) -> dict[str, Any]:
    import tomllib

    return tomllib.loads(path.read_text())


@uses_tiny_done
def test_finished_methods_are_reused_and_bad_records_ignored(
    tiny_done: tuple[Path, CompareResult], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, out = _copy_of(tiny_done, tmp_path)
    first = tiny_done[1]
    table = (out / "table.json").read_text()
    stamps = {s: (out / s / "method.json").stat().st_mtime_ns for s in ("fedavg", "centralized")}
    # each record keeps the thread count it ran with (the trajectory depends on it)
    assert {r["torch_threads"] for r in json.loads(table)["rows"]} == {torch.get_num_threads()}
    n = torch.get_num_threads()
    assert f"torch threads: FedAvg {n}, " in (out / "table.md").read_text()
    # and whether its kernels were deterministic only (compute.deterministic; off here)
    assert {r["deterministic"] for r in json.loads(table)["rows"]} == {False}
    assert "deterministic kernels" not in (out / "table.md").read_text()
    marked = [{**r, "deterministic": r["method"] == "FedAvg"} for r in json.loads(table)["rows"]]
    said = markdown(marked, load_compare(cfg))
    assert "deterministic kernels (compute.deterministic): FedAvg (a GPU run" in said

    # same config, same directory: nothing trains again, and the table is the same
    again = run_compare(load_compare(cfg), out, progress=True)
    said = capsys.readouterr().out
    assert said.count("reusing the run finished earlier") == 3
    assert (out / "table.json").read_text() == table
    assert [r.rows for r in again.runs] == [r.rows for r in first.runs]

    # a changed method, a corrupt record and a malformed record: those methods run again
    old = 'overrides = {"algorithm.name" = "fedavg"}'
    cfg.write_text(TINY.replace(old, old[:-1] + ', "train.lr" = 5e-4}'))
    (out / "fedphd-select" / "method.json").write_text('{"format": "estuary.compare-method/1"')
    record = json.loads((out / "centralized" / "method.json").read_text())
    record["steps"] = record["steps"][:-1]  # malformed: one round short
    (out / "centralized" / "method.json").write_text(json.dumps(record))
    run_compare(load_compare(cfg), out, progress=True)
    said = capsys.readouterr().out
    assert "reusing the run" not in said
    assert "FedAvg: not reusing" in said and "has digest" in said
    assert "FedPhD (select): not reusing" in said and "is not JSON" in said
    assert "Centralized: not reusing" in said and "malformed" in said
    assert (out / "fedavg" / "method.json").stat().st_mtime_ns != stamps["fedavg"]
    assert json.loads((out / "centralized" / "method.json").read_text())["steps"] != record["steps"]

    # --fresh runs everything again even when every record matches
    assert main(["compare", str(cfg), "--out", str(out), "--fresh", "--no-eval"]) == 0
    assert "reusing the run" not in capsys.readouterr().out


def test_centralized_training_with_a_weight_average(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ema`` on a centralized method (the paper's centralized baseline uses EMA): the
    evaluated and checkpointed model is the average, one optimizer serves the whole run,
    and a record made with another decay (or before the average existed) is not reused."""
    import estuary.compare.runner as runner
    from estuary.compare import load_record, run_method
    from shared.models.checkpoint import latest_checkpoint_path, load_checkpoint

    central = {"label": "Centralized", "centralized": True, "ema": 0.9}
    raw = _raw(method=[{"label": "FedAvg"}, central])
    raw["base"]["eval"]["every"] = 1  # two evaluation points: train_local runs twice
    m = parse_compare(raw, Path("x.toml")).methods[1]
    assert m.ema == 0.9 and _algorithm(m) == "centralized ema=0.9"
    plain = Method(m.label, "plain", m.cfg, True)
    made: list[object] = []
    real = runner.make_optimizer  # looked up there by run_centralized

    def counted(*args: Any) -> Any:
        made.append(real(*args))
        return made[-1]

    monkeypatch.setattr(runner, "make_optimizer", counted)
    run = run_method(m, tmp_path, evaluate=True, progress=False)
    assert len(made) == 1  # not one per evaluation interval
    base = run_method(plain, tmp_path, evaluate=True, progress=False)
    assert [r["round"] for r in run.rows] == [1, 2] and "quality" in run.rows[-1]
    # same data, seed and steps: the raw weights train identically, the saved model differs
    assert [r["train_loss"] for r in run.rows] == [r["train_loss"] for r in base.rows]
    assert run.rows[-1]["quality"]["fid"] != base.rows[-1]["quality"]["fid"]
    ema_ckpt = load_checkpoint(latest_checkpoint_path(tmp_path / m.slug / "checkpoints"))  # type: ignore[arg-type]
    raw_ckpt = load_checkpoint(latest_checkpoint_path(tmp_path / "plain" / "checkpoints"))  # type: ignore[arg-type]
    assert any(not torch.equal(v, raw_ckpt.model[k]) for k, v in ema_ckpt.model.items())
    assert load_record(m, tmp_path / m.slug, evaluate=True)[0] is not None
    other = Method(m.label, m.slug, m.cfg, True, 0.99)
    done, why = load_record(other, tmp_path / m.slug, evaluate=True)
    assert done is None and "centralized_training" in why
    record = json.loads((tmp_path / m.slug / "method.json").read_text())
    del record["centralized_training"]  # a record from before: not reused
    (tmp_path / m.slug / "method.json").write_text(json.dumps(record))
    assert load_record(m, tmp_path / m.slug, evaluate=True)[0] is None


def test_centralized_training_of_a_pruned_architecture(tmp_path: Path) -> None:
    """A centralized method of FedPhD with ``prune_ratio`` (``prune_at = "init"``) trains the pruned
    architecture (FedPhD-OS's ceiling): its plan reaches the record, the table's params and
    the checkpoint, and a record of the same config trained dense (earlier versions ignored
    the ratio) is not reused."""
    from estuary.compare import load_record, run_method, summarize
    from shared.models.checkpoint import latest_checkpoint_path, load_checkpoint
    from shared.models.plan import build_model

    pruned = {
        "label": "Centralized (s_p=0.44)",
        "centralized": True,
        "overrides": {
            "algorithm.name": "fedphd",
            "algorithm.fedphd.prune_ratio": 0.44,
            "algorithm.fedphd.prune_at": "init",
        },
    }
    raw = _raw(method=[{"label": "FedAvg"}, {"label": "Centralized", "centralized": True}, pruned])
    spec = parse_compare(raw, Path("x.toml"))
    fedavg, dense, m = spec.methods
    assert _algorithm(m) == "centralized s_p=0.44 OS"
    run = run_method(m, tmp_path, evaluate=False, progress=False)
    assert run.plan is not None
    runs = [run_method(x, tmp_path, evaluate=False, progress=False) for x in (fedavg, dense)]
    rows = {r["method"]: r for r in summarize([*runs, run], spec)}
    ratio = rows[m.label]["params"] / rows["Centralized"]["params"]
    assert ratio == pytest.approx(0.56, abs=0.01)  # 44 % of the parameters removed
    assert rows[m.label]["gmacs"] < rows["Centralized"]["gmacs"]
    ckpt = load_checkpoint(latest_checkpoint_path(tmp_path / m.slug / "checkpoints"))  # type: ignore[arg-type]
    assert ckpt.plan == run.plan
    model = build_model(m.cfg.model.preset, ckpt.plan)
    model.load_state_dict(ckpt.model)  # the saved weights fit the rebuilt architecture
    assert load_record(m, tmp_path / m.slug, evaluate=False)[0] is not None
    record = json.loads((tmp_path / m.slug / "method.json").read_text())
    del record["pruning"]  # a record from before pruning existed here: trained dense
    (tmp_path / m.slug / "method.json").write_text(json.dumps(record))
    done, why = load_record(m, tmp_path / m.slug, evaluate=False)
    assert done is None and "pruning" in why
    record["pruning"] = "an earlier recipe"  # pruned otherwise: not reused either
    (tmp_path / m.slug / "method.json").write_text(json.dumps(record))
    done, why = load_record(m, tmp_path / m.slug, evaluate=False)
    assert done is None and "pruning" in why


def test_a_record_is_not_reused_once_the_init_file_changes(tmp_path: Path) -> None:
    """``model.init`` as a path enters the config digest as a string, so the record keeps the
    file's content hash beside it: the same path with other weights runs the method again."""
    from safetensors.torch import save_file

    from estuary.compare import MethodRun, load_record, save_record
    from shared.models.presets import build_unet

    init = tmp_path / "init.safetensors"
    save_file(build_unet("fmnist-tiny", seed=1).state_dict(), init)
    line = 'preset = "fmnist-tiny"'
    raw = _toml_text(TINY.replace(line, f'{line}\ninit = "{init}"'))
    m = parse_compare(raw, tmp_path / "x.toml").methods[0]
    run_dir = tmp_path / m.slug
    run_dir.mkdir()
    steps = [1] * m.cfg.run.rounds
    save_record(MethodRun(m, run_dir, [{"round": 1}], {}, None, 1.0, steps), evaluate=False)
    assert load_record(m, run_dir, evaluate=False)[0] is not None

    save_file(build_unet("fmnist-tiny", seed=2).state_dict(), init)  # same path, new weights
    done, why = load_record(m, run_dir, evaluate=False)
    assert done is None and "has init 'sha256:" in why
    init.unlink()
    done, why = load_record(m, run_dir, evaluate=False)
    assert done is None and "'unreadable: No such file or directory'" in why


def test_a_record_is_not_reused_at_another_precision(tmp_path: Path) -> None:
    """``train.precision`` is per process (outside the digest), so the record keeps it:
    a bf16 run is not reused for an fp32 comparison, nor the other way round."""
    from estuary.compare import MethodRun, load_record, save_record

    fp32 = parse_compare(_toml_text(TINY), tmp_path / "x.toml").methods[0]
    bf16 = parse_compare(
        _toml_text(TINY.replace("[base.train]", '[base.train]\nprecision = "bf16"')),
        tmp_path / "x.toml",
    ).methods[0]
    assert bf16.cfg.train.precision == "bf16" and bf16.cfg.digest() == fp32.cfg.digest()
    run_dir = tmp_path / fp32.slug
    run_dir.mkdir()
    steps = [1] * fp32.cfg.run.rounds
    save_record(MethodRun(fp32, run_dir, [{"round": 1}], {}, None, 1.0, steps), evaluate=False)
    assert load_record(fp32, run_dir, evaluate=False)[0] is not None
    assert load_record(bf16, run_dir, evaluate=False)[0] is None
    save_record(MethodRun(bf16, run_dir, [{"round": 1}], {}, None, 1.0, steps), evaluate=False)
    assert load_record(bf16, run_dir, evaluate=False)[0] is not None
    done, why = load_record(fp32, run_dir, evaluate=False)
    assert done is None and "has precision 'bf16', this comparison 'fp32'" in why
    record = json.loads((run_dir / "method.json").read_text())
    del record["precision"]  # a record from before the key: trained in fp32
    (run_dir / "method.json").write_text(json.dumps(record))
    assert load_record(fp32, run_dir, evaluate=False)[0] is not None
    assert load_record(bf16, run_dir, evaluate=False)[0] is None


def test_init_fingerprint(tmp_path: Path) -> None:
    from shared.models.init import PRETRAINED, init_fingerprint

    assert init_fingerprint("fmnist-tiny", "random") == "random"
    assert init_fingerprint("fmnist-tiny", "pretrained") == f"sha256:{PRETRAINED['fmnist-tiny'][1]}"
    assert init_fingerprint("ddpm-cifar10", "pretrained").startswith("unreadable")
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"abc")
    sha = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert init_fingerprint("fmnist-tiny", str(f)) == f"sha256:{sha}"
    assert init_fingerprint("fmnist-tiny", str(tmp_path)).startswith("unreadable: ")


def _toml_text(text: str) -> dict[str, Any]:
    import tomllib

    return tomllib.loads(text)


def test_an_evaluated_record_serves_a_comparison_without_evaluation(tmp_path: Path) -> None:
    """``--no-eval`` reuses a run finished with evaluation (keeping its FID) instead of
    training it again over the record; an unevaluated run does not serve an evaluated one."""
    from estuary.compare import MethodRun, load_record, save_record

    m = parse_compare(_toml_text(TINY), tmp_path / "x.toml").methods[0]
    run_dir = tmp_path / m.slug
    run_dir.mkdir()
    rows = [{"round": 1, "quality": {"fid": 12.5}}]
    steps = [1] * m.cfg.run.rounds
    save_record(MethodRun(m, run_dir, rows, {}, None, 1.0, steps), evaluate=True)
    done, _ = load_record(m, run_dir, evaluate=False)
    assert done is not None and done.rows == rows
    save_record(MethodRun(m, run_dir, [{"round": 1}], {}, None, 1.0, steps), evaluate=False)
    done, why = load_record(m, run_dir, evaluate=True)
    assert done is None and "has evaluate False, this comparison True" in why

    # the thread count is optional (older records lack it) but, when present, well-formed
    save_record(MethodRun(m, run_dir, rows, {}, None, 1.0, steps, threads=2), evaluate=True)
    done, _ = load_record(m, run_dir, evaluate=True)
    assert done is not None and done.threads == 2
    doc = json.loads((run_dir / "method.json").read_text())
    del doc["torch_threads"]
    (run_dir / "method.json").write_text(json.dumps(doc))
    done, _ = load_record(m, run_dir, evaluate=True)
    assert done is not None and done.threads is None
    (run_dir / "method.json").write_text(json.dumps({**doc, "torch_threads": "2"}))
    done, why = load_record(m, run_dir, evaluate=True)
    assert done is None and "torch_threads '2' is not a positive integer" in why

    # so is whether it ran with deterministic kernels only
    save_record(MethodRun(m, run_dir, rows, {}, None, 1.0, steps, deterministic=True),
                evaluate=True)  # fmt: skip
    done, _ = load_record(m, run_dir, evaluate=True)
    assert done is not None and done.deterministic is True
    (run_dir / "method.json").write_text(json.dumps(doc))  # a record from before it was kept
    done, _ = load_record(m, run_dir, evaluate=True)
    assert done is not None and done.deterministic is None
    (run_dir / "method.json").write_text(json.dumps({**doc, "deterministic": "yes"}))
    done, why = load_record(m, run_dir, evaluate=True)
    assert done is None and "deterministic 'yes' is not true or false" in why


def _shrunk(doc: dict[str, Any]) -> dict[str, Any]:
    """A shipped comparison cut to a few steps per method: the same methods, preset, split and
    hierarchy (every method still trains, FedPhD still prunes after sparse rounds, each is
    evaluated), with 10 E=1 rounds (2 E=5 rounds), one local step per epoch, small batches
    and a small evaluation."""
    base = doc["base"]
    base["run"]["rounds"] = 10
    base["train"].pop("local_epochs", None)
    base["train"].update(local_steps=1, batch_size=8)
    base["eval"].update(
        every=5, sample_every=10, num_samples=16, num_reference=64, sample_steps=2,
        checkpoint_every=5,
    )  # fmt: skip
    base["diffusion"]["sample_steps"] = 2
    for method in doc["method"]:
        over = method.get("overrides", {})
        if over.pop("train.local_epochs", None):  # the E = 5 baselines: 2 rounds of 5 steps
            over.update({"run.rounds": 2, "train.local_steps": 5})
            over.update({"eval.every": 1, "eval.sample_every": 2, "eval.checkpoint_every": 1})
        for key in ("algorithm.sparse_rounds", "algorithm.fedphd.sparse_rounds"):
            if key in over:
                over[key] = 5
    return doc


@pytest.mark.slow
def test_the_gpu_comparison_runs_end_to_end_shrunk(tmp_path: Path) -> None:
    """Every method of ``configs/compare/compare_gpu_small.toml`` (fmnist-small,
    Fashion-MNIST, the paper's split) runs through ``estuary compare`` on the CPU when cut to a
    few steps: the shipped GPU study fails at start, not after hours (about 10 min on 2
    cores)."""
    path = COMPARE_DIR / "compare_gpu_small.toml"
    spec = parse_compare(_shrunk(_toml(path)), path)
    res = run_compare(spec, tmp_path / "out", progress=False)
    doc = json.loads((res.out / "table.json").read_text())
    by = {r["method"]: r for r in doc["rows"]}
    assert list(by) == [m.label for m in spec.methods]
    assert all(r["fid"] is not None for r in doc["rows"])
    steps = {r["local_steps"] for r in doc["rows"]}
    assert steps == {40}, steps  # equal local computation survives the cut
    dense, phd = by["FedAvg"], by["FedPhD"]
    assert phd["params_m"] == pytest.approx(0.56 * dense["params_m"], rel=0.01)
    assert phd["cloud_bytes_per_agg"] <= 0.6 * dense["cloud_bytes_per_agg"]


def _tiny_file(tmp_path: Path, text: str = TINY) -> Path:
    """``text`` (the tiny comparison) written to ``tmp_path / "tiny.toml"``."""
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(text)
    return cfg


@uses_tiny_done
def test_jobs_run_methods_in_their_own_processes_with_the_same_results(
    tiny_done: tuple[Path, CompareResult], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--jobs 2``: every method runs in a child process (its output in its compare.log),
    the parent writes the table from their records, a rerun reuses all of them, and the
    rows match a sequential run's (the same training; only the thread count differs)."""
    cfg, out = _tiny_file(tmp_path), tmp_path / "jobs"
    assert main(["compare", str(cfg), "--out", str(out), "--jobs", "2"]) == 0
    said = capsys.readouterr().out
    assert said.count("started, output in") == 3 and said.count(" done in ") == 3
    for slug in ("fedavg", "fedphd-select", "centralized"):
        assert (out / slug / "method.json").is_file(), slug
        assert "done in" in (out / slug / "compare.log").read_text(), slug
    table = (out / "table.json").read_text()
    assert main(["compare", str(cfg), "--out", str(out), "--jobs", "2"]) == 0
    assert capsys.readouterr().out.count("reusing the run finished earlier") == 3
    assert (out / "table.json").read_text() == table

    seq = tiny_done[1]  # the same comparison run sequentially
    par = {r["method"]: r for r in json.loads(table)["rows"]}
    for row in seq.rows:
        for key in ("fid", "is", "local_steps", "total_bytes", "params", "central_aggs"):
            assert par[row["method"]][key] == pytest.approx(row[key], rel=1e-3), key


def test_only_runs_the_named_methods_and_the_table_waits_for_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, out = _tiny_file(tmp_path), tmp_path / "out"
    spec = load_compare(cfg)
    with pytest.raises(ConfigError, match=r"--only \['FedSGD'\]: no such method"):
        run_compare(spec, out, only=["FedSGD"], progress=False)
    with pytest.raises(ConfigError, match="jobs must be at least 1"):
        run_compare(spec, out, jobs=0, progress=False)
    part = run_compare(spec, out, only=["FedAvg"], evaluate=False)
    assert [r.method.label for r in part.runs] == ["FedAvg"] and part.rows == []
    assert part.missing == ["FedPhD (select)", "Centralized"]
    assert not (out / "table.md").exists()
    assert "no table yet: FedPhD (select), Centralized not run" in capsys.readouterr().out
    stamp = (out / "fedavg" / "method.json").stat().st_mtime_ns
    rest = run_compare(spec, out, only=["FedPhD (select)", "Centralized"], evaluate=False,
                       fresh=True, progress=False)  # fmt: skip
    assert rest.missing == [] and [r["method"] for r in rest.rows] == [
        m.label for m in spec.methods
    ]
    assert (out / "table.md").is_file()  # fresh applies to the named methods only:
    assert (out / "fedavg" / "method.json").stat().st_mtime_ns == stamp
    with pytest.raises(ConfigError, match="needs a comparison read from a file"):
        run_compare(parse_compare(_raw(), cfg), tmp_path / "x", jobs=2, fresh=True)


def test_jobs_refuse_a_comparison_not_read_from_a_file(tmp_path: Path) -> None:
    """Each job re-reads the comparison from its TOML: ``run_jobs`` itself refuses one parsed
    from a dict with a :class:`ConfigError` (a check that ``python -O`` keeps)."""
    from estuary.compare.jobs import run_jobs

    spec = parse_compare(_raw(), Path("x.toml"))
    m = spec.methods[0]
    with pytest.raises(ConfigError, match="was not read from a file"):
        run_jobs(spec, tmp_path, [(1, m, "random")], 2, evaluate=False, progress=False)
    assert not (tmp_path / m.slug).exists()  # refused before any job started


def test_a_failed_job_is_named_and_the_others_keep_their_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A method whose init file is missing fails in its process; the run fails naming it and
    its log, the other methods' records stay, and the same command then runs only it."""
    missing = tmp_path / "gone.safetensors"
    old = 'overrides = {"algorithm.name" = "fedavg"}'
    cfg = _tiny_file(tmp_path, TINY.replace(old, old[:-1] + f', "model.init" = "{missing}"}}'))
    out = tmp_path / "out"
    argv = ["compare", str(cfg), "--out", str(out), "--jobs", "2", "--no-eval"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "FedAvg FAILED" in captured.out
    err = captured.err
    assert "1 method(s) failed: FedAvg (exit status 2; see" in err, err
    assert str(out / "fedavg" / "compare.log") in err
    assert str(missing) in (out / "fedavg" / "compare.log").read_text()
    assert not (out / "fedavg" / "method.json").exists() and not (out / "table.md").exists()
    for slug in ("fedphd-select", "centralized"):
        assert (out / slug / "method.json").is_file(), slug

    from safetensors.torch import save_file

    from shared.models.presets import build_unet

    save_file(build_unet("fmnist-tiny", seed=1).state_dict(), missing)
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert said.count("reusing the run finished earlier") == 2 and "FedAvg (fedavg" in said
    assert (out / "table.md").is_file()


def _processes_mentioning(text: str) -> list[int]:
    """PIDs of the live processes whose command line contains ``text``."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if proc.name.isdigit() and text in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_stopping_a_compare_with_jobs_stops_its_jobs(tmp_path: Path, sig: str) -> None:
    """``kill`` (SIGTERM) or Ctrl-C (SIGINT) of the parent stops the running jobs too, and
    jobs whose parent was SIGKILLed stop on their own: none is left training."""
    import signal
    import subprocess
    import sys
    import time

    cfg = tmp_path / "long.toml"
    cfg.write_text(TINY.replace("rounds = 2", "rounds = 2000"))
    out = tmp_path / "out"
    parent = subprocess.Popen(
        [sys.executable, "-m", "estuary", "compare", str(cfg), "--out", str(out), "--jobs", "2",
         "--no-eval"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(_processes_mentioning(f"{out} --only")) < 2:
            assert parent.poll() is None, "the comparison ended before its jobs started"
            assert time.monotonic() < deadline, "the jobs did not start"
            time.sleep(0.2)
        parent.send_signal(getattr(signal, sig))
        assert parent.wait(timeout=60) != 0
        deadline = time.monotonic() + 30  # after SIGKILL, the jobs get SIGTERM from Linux
        while _processes_mentioning(f"{out} --only") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _processes_mentioning(f"{out} --only") == []
        assert not (out / "fedavg" / "method.json").exists()
    finally:
        parent.kill()
        for pid in _processes_mentioning(f"{out} --only"):
            os.kill(pid, signal.SIGKILL)
