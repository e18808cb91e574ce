"""The shipped Prometheus rules (docker/estuary-rules.yml): promtool's checks and unit tests on
synthetic series, and a real Prometheus server evaluating them against a role's /metrics."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from estuary.launcher import stop_processes
from shared.metrics.prometheus import RoleMetrics, parse_exposition
from shared.transport.local_broker import free_port
from shared.transport.telemetry import Traffic

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "docker" / "estuary-rules.yml"
K8S_RULES = ROOT / "k8s" / "base" / "prometheus" / "estuary-rules.yml"
UNIT_TESTS = ROOT / "tests" / "prometheus" / "estuary-rules.test.yml"
HOST = "127.0.0.1"

# scripts/setup.sh installs Debian's prometheus (promtool included); CI must not skip these
needs_prometheus = pytest.mark.skipif(
    not (shutil.which("promtool") and shutil.which("prometheus")) and not os.environ.get("CI"),
    reason="Prometheus missing: apt-get install prometheus (scripts/setup.sh does, as root)",
)


def _promtool(*args: str | Path) -> str:
    proc = subprocess.run(
        ["promtool", *map(str, args)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


@needs_prometheus
def test_promtool_accepts_the_rules_and_the_compose_config() -> None:
    assert "SUCCESS: 23 rules found" in _promtool("check", "rules", RULES)
    assert "SUCCESS: 1 rule files found" in _promtool(
        "check", "config", ROOT / "docker" / "prometheus.yml"
    )


@needs_prometheus
def test_alerts_fire_and_stay_quiet_as_the_unit_tests_say() -> None:
    """Every alert firing and not firing, and every recording rule's value, on synthetic
    series (tests/prometheus/estuary-rules.test.yml)."""
    assert "SUCCESS" in _promtool("test", "rules", UNIT_TESTS)


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_every_alert_is_unit_tested() -> None:
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    firing = {
        case["alertname"]
        for t in tests
        for case in t.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    quiet = {
        case["alertname"]
        for t in tests
        for case in t.get("alert_rule_test", [])
        if not case.get("exp_alerts")
    }
    recorded = {case["expr"].split("{")[0] for t in tests for case in t.get("promql_expr_test", [])}
    alerts = {r["alert"] for r in _rules() if "alert" in r}
    records = {r["record"] for r in _rules() if "record" in r}
    assert alerts <= firing, f"never seen firing: {sorted(alerts - firing)}"
    assert alerts <= quiet, f"never seen quiet: {sorted(alerts - quiet)}"
    untested = (
        records
        - recorded
        - {  # the same query shape as a tested one
            "estuary:rejected_messages:rate5m",
            "estuary:training_duration_seconds:p90_1h",
        }
    )
    assert not untested, f"recording rules without a unit test: {sorted(untested)}"


def test_the_kubernetes_copy_is_the_same_file_and_both_prometheus_load_it() -> None:
    assert K8S_RULES.read_bytes() == RULES.read_bytes(), (
        "k8s/base/prometheus/estuary-rules.yml differs from docker/estuary-rules.yml: copy it"
    )
    for config in (ROOT / "docker" / "prometheus.yml", K8S_RULES.parent / "prometheus.yml"):
        assert yaml.safe_load(config.read_text())["rule_files"] == ["estuary-rules.yml"], config
    assert (
        "docker/estuary-rules.yml /etc/prometheus/"
        in (ROOT / "docker" / "prometheus.Dockerfile").read_text()
    )
    kustomization = yaml.safe_load((ROOT / "k8s" / "base" / "kustomization.yaml").read_text())
    generated = {g["name"]: g.get("files", []) for g in kustomization["configMapGenerator"]}
    assert "prometheus/estuary-rules.yml" in generated["estuary-prometheus"]


def test_every_metric_the_rules_use_is_one_a_role_exposes() -> None:
    """A misspelt metric name makes a rule silently match nothing: check each name against a
    real exposition (the transport counters against what the MQTT transport notes)."""
    traffic = Traffic()
    traffic.count("sent", "model", 1)
    traffic.reject("edge", "bad_json")
    exposed = {
        key.split("{")[0]
        for role, name in (("cloud", "cloud"), ("device", "dev000"))  # devices: data gauges
        for key in parse_exposition(RoleMetrics(role, name, traffic).render().decode())
    }
    transport = "".join(
        (ROOT / "shared" / "transport" / f).read_text()
        for f in ("mqtt.py", "blob_server.py", "blob_fetcher.py")
    )
    # metric names (estuary_phase is also a label name, of the same metric)
    used = set(re.findall(r"\b(?:estuary|process)_[a-z_]+", RULES.read_text()))
    for name in sorted(used):
        if name.startswith("estuary_transport_"):
            note = name.removeprefix("estuary_transport_").removesuffix("_total")
            assert f'note("{note}"' in transport, f"{name}: no transport counter {note!r}"
        else:
            assert name in exposed, f"{name} is not exposed by a role"


# -- a real Prometheus ----------------------------------------------------------------------
@pytest.fixture
def cloud_metrics() -> Iterator[RoleMetrics]:
    metrics = RoleMetrics("cloud", "cloud", Traffic())
    metrics.serve(0, HOST)
    yield metrics
    metrics.stop()


@pytest.fixture
def prometheus(tmp_path: Path, cloud_metrics: RoleMetrics) -> Iterator[str]:
    """Prometheus with the shipped rules, scraping ``cloud_metrics`` every second; its URL."""
    shutil.copy(RULES, tmp_path / "estuary-rules.yml")
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": ["estuary-rules.yml"],
        "scrape_configs": [
            {
                "job_name": "estuary",
                "static_configs": [
                    {"targets": [f"{HOST}:{cloud_metrics.port}"], "labels": {"role": "cloud"}}
                ],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port(HOST)
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address={HOST}:{port}"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://{HOST}:{port}"
    try:
        _until(lambda: _ready(url), 60, tmp_path / "prometheus.log")
        yield url
    finally:
        stop_processes({"prometheus": proc}, 20)
        log.close()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=5) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def _get(url: str) -> Any:
    """The ``data`` of a Prometheus API reply, or None while it is unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return json.load(reply)["data"]
    except OSError:
        return None


def _until(check: Any, timeout_s: float, log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.25)
    tail = log.read_text(errors="replace")[-2000:] if log is not None else ""
    raise AssertionError(f"not within {timeout_s} s\n{tail}")


def _alerts(url: str) -> dict[str, list[dict[str, Any]]]:
    data = _get(f"{url}/api/v1/alerts") or {"alerts": []}
    out: dict[str, list[dict[str, Any]]] = {}
    for alert in data["alerts"]:
        out.setdefault(alert["labels"]["alertname"], []).append(alert)
    return out


@needs_prometheus
def test_a_real_prometheus_evaluates_the_rules_on_a_real_role(
    prometheus: str, cloud_metrics: RoleMetrics
) -> None:
    """The rules load and evaluate without errors; a rejection raises EstuaryRejectingMessages
    at once, a round open for far longer than its deadline puts EstuaryRoundStalled into
    pending (it waits 2 min before firing), and the traffic rate is recorded."""
    groups = _until(lambda: (_get(f"{prometheus}/api/v1/rules") or {}).get("groups"), 30)
    assert {g["name"] for g in groups} == {"estuary-load", "estuary-alerts"}
    cloud_metrics.phase.state("training")
    cloud_metrics.round_started.set(time.time() - 1000)
    cloud_metrics.round_deadline.set(100)
    cloud_metrics.traffic.count("sent", "global_model", 4096)
    time.sleep(2)  # a scrape before the first rejection: the series is born at 1
    cloud_metrics.traffic.reject("cloud", "bad_signature")

    rejecting = _until(lambda: _alerts(prometheus).get("EstuaryRejectingMessages"), 60)
    assert [a["state"] for a in rejecting] == ["firing"]
    assert rejecting[0]["labels"]["reason"] == "bad_signature"
    assert rejecting[0]["labels"]["role"] == "cloud"
    stalled = _until(lambda: _alerts(prometheus).get("EstuaryRoundStalled"), 60)
    assert [a["state"] for a in stalled] == ["pending"]
    assert "EstuaryCloudDown" not in _alerts(prometheus)

    def sent_rate() -> list[dict[str, Any]]:
        q = urllib.parse.urlencode({"query": "estuary:sent_bytes:rate5m"})
        return (_get(f"{prometheus}/api/v1/query?{q}") or {}).get("result", [])

    assert _until(sent_rate, 30)[0]["metric"]["role"] == "cloud"
    groups = _get(f"{prometheus}/api/v1/rules")["groups"]
    broken = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"]
              if r.get("health") != "ok"]  # fmt: skip
    assert not broken, broken


@needs_prometheus
def test_cloud_down_tells_a_crash_from_a_finished_run(
    prometheus: str, cloud_metrics: RoleMetrics
) -> None:
    """A cloud that stops answering mid-run puts EstuaryCloudDown into pending; one that
    waited for Prometheus to scrape its phase ``done`` before exiting (what
    ``metrics.final_scrape_s`` makes a role do) does not."""
    port = cloud_metrics.port
    assert port is not None
    cloud_metrics.phase.state("training")
    assert cloud_metrics.wait_for_scrape(30)  # Prometheus scrapes every second
    cloud_metrics.stop()  # a crash
    down = _until(lambda: _alerts(prometheus).get("EstuaryCloudDown"), 60)
    assert [a["state"] for a in down] == ["pending"]

    cloud_metrics.serve(port, HOST)  # restarted; it finishes the run this time
    cloud_metrics.phase.state("done")
    assert cloud_metrics.wait_for_scrape(30)
    cloud_metrics.stop()

    def up() -> list[dict[str, Any]]:
        q = urllib.parse.urlencode({"query": 'up{job="estuary"} == 0'})
        return (_get(f"{prometheus}/api/v1/query?{q}") or {}).get("result", [])

    _until(up, 30)  # Prometheus has seen it go
    _until(lambda: "EstuaryCloudDown" not in _alerts(prometheus), 30)
    time.sleep(3)  # and it stays quiet over more evaluations
    assert "EstuaryCloudDown" not in _alerts(prometheus)
