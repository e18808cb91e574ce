"""Per-role Prometheus metrics, checked through a real HTTP scrape."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.errors import CodecError, ConfigError, TransportError
from shared.metrics.prometheus import RoleMetrics, parse_exposition, sample_key, scrape
from shared.transport.telemetry import Traffic

HOST = "127.0.0.1"


@pytest.fixture
def traffic() -> Traffic:
    t = Traffic()
    t.count("sent", "model", 1000)
    t.count("sent", "model", 500)
    t.count("received", "update", 300)
    t.reject("edge", "bad_json")
    t.reject("edge", "bad_json")
    t.reject("cloud", "stale:round")
    t.note("wire_bytes_sent", 1234)
    t.note("reconnects")
    t.note("blob-cache.hits", 2)
    t.note("chunks_rerequested_total", 3)
    return t


@pytest.fixture
def edge(traffic: Traffic) -> Iterator[RoleMetrics]:
    m = RoleMetrics("edge", "edge0", traffic)
    yield m
    m.stop()


def url(port: int) -> str:
    return f"http://{HOST}:{port}/metrics"


def test_traffic_is_scraped_over_http(edge: RoleMetrics) -> None:
    samples = scrape(url(edge.serve(0, HOST)))
    assert samples['estuary_info{instance="edge0",role="edge"}'] == 1
    assert samples['estuary_bytes_total{direction="sent",kind="model"}'] == 1500
    assert samples['estuary_bytes_total{direction="received",kind="update"}'] == 300
    assert samples['estuary_messages_total{direction="sent",kind="model"}'] == 2
    assert samples['estuary_messages_total{direction="received",kind="update"}'] == 1
    assert samples['estuary_rejected_messages_total{reason="bad_json",role="edge"}'] == 2
    assert samples['estuary_rejected_messages_total{reason="stale:round",role="cloud"}'] == 1
    transport = {k: v for k, v in samples.items() if k.startswith("estuary_transport_")}
    assert transport == {
        "estuary_transport_blob_cache_hits_total": 2,
        "estuary_transport_chunks_rerequested_total": 3,
        "estuary_transport_reconnects_total": 1,
        "estuary_transport_wire_bytes_sent_total": 1234,
    }


def test_traffic_is_read_at_scrape_time(edge: RoleMetrics, traffic: Traffic) -> None:
    port = edge.serve(0, HOST)
    traffic.count("sent", "model", 1)
    traffic.note("reconnects")
    samples = scrape(url(port))
    assert samples['estuary_bytes_total{direction="sent",kind="model"}'] == 1501
    assert samples["estuary_transport_reconnects_total"] == 2


def test_instrumentation_is_scraped(edge: RoleMetrics) -> None:
    edge.round.set(3)
    edge.phase.state("aggregating")
    edge.round_seconds.observe(12.5)
    edge.aggregation_seconds.observe(0.02)
    edge.training_seconds.observe(90)
    edge.training_seconds.observe(4000)
    edge.devices.labels(edge="edge0").set(4)
    edge.sh_score.labels(edge="edge0").set(0.75)
    edge.model_params.set(1_000_000)
    edge.model_bytes.set(4_000_000)
    edge.images_generated.inc(16)
    edge.sampling_seconds.observe(0.003)
    edge.updates.labels(outcome="accepted").inc(3)
    edge.updates.labels(outcome="late").inc()
    samples = scrape(url(edge.serve(0, HOST)))

    assert samples["estuary_round"] == 3
    phases = {k: v for k, v in samples.items() if k.startswith("estuary_phase{")}
    assert phases == {
        f'estuary_phase{{estuary_phase="{s}"}}': float(s == "aggregating")
        for s in ("idle", "scoring", "waiting", "training", "aggregating", "deploying", "done")
    }
    assert samples["estuary_round_duration_seconds_count"] == 1
    assert samples["estuary_round_duration_seconds_sum"] == 12.5
    assert samples["estuary_aggregation_duration_seconds_count"] == 1
    assert samples["estuary_training_duration_seconds_count"] == 2
    assert samples['estuary_training_duration_seconds_bucket{le="3600.0"}'] == 1
    assert samples['estuary_training_duration_seconds_bucket{le="+Inf"}'] == 2
    assert samples['estuary_connected_devices{edge="edge0"}'] == 4
    assert samples['estuary_sh_score{edge="edge0"}'] == 0.75
    assert samples["estuary_model_params"] == 1_000_000
    assert samples["estuary_model_bytes"] == 4_000_000
    assert samples["estuary_images_generated_total"] == 16
    assert samples['estuary_sampling_latency_seconds_bucket{le="0.005"}'] == 1
    assert samples["estuary_sampling_latency_seconds_count"] == 1
    assert samples['estuary_updates_total{outcome="accepted"}'] == 3
    assert samples['estuary_updates_total{outcome="late"}'] == 1
    assert samples['estuary_updates_total{outcome="rejected"}'] == 0
    assert samples['estuary_updates_total{outcome="duplicate"}'] == 0


def test_fresh_role_is_idle_with_no_traffic() -> None:
    samples = parse_exposition(RoleMetrics("device", "dev000").render().decode())
    assert samples['estuary_phase{estuary_phase="idle"}'] == 1
    assert samples['estuary_info{instance="dev000",role="device"}'] == 1
    assert not any(k.startswith(("estuary_bytes_total{", "estuary_transport_")) for k in samples)
    assert samples["estuary_training_images"] == samples["estuary_skipped_image_files"] == 0


def test_data_gauges_exist_on_devices_only(edge: RoleMetrics) -> None:
    edge.training_images.set(5)  # a role that holds no data: not exposed
    text = edge.render().decode()
    assert "estuary_training_images" not in text and "estuary_skipped_image_files" not in text


def test_no_doubled_total_suffix(edge: RoleMetrics) -> None:
    text = edge.render().decode()
    assert "_total_total" not in text
    assert "# TYPE estuary_bytes_total counter" in text
    assert "# TYPE estuary_transport_wire_bytes_sent_total counter" in text


def test_two_roles_in_one_process_do_not_collide(edge: RoleMetrics) -> None:
    other_traffic = Traffic()
    other_traffic.count("sent", "model", 7)
    cloud = RoleMetrics("cloud", "cloud", other_traffic)
    try:
        edge.round.set(2)
        cloud.round.set(5)
        edge_port, cloud_port = edge.serve(0, HOST), cloud.serve(0, HOST)
        edge_samples, cloud_samples = scrape(url(edge_port)), scrape(url(cloud_port))
    finally:
        cloud.stop()
    assert edge_port != cloud_port
    assert edge_samples["estuary_round"] == 2
    assert cloud_samples["estuary_round"] == 5
    assert cloud_samples['estuary_bytes_total{direction="sent",kind="model"}'] == 7
    assert 'estuary_info{instance="cloud",role="cloud"}' in cloud_samples
    assert 'estuary_info{instance="edge0",role="edge"}' not in cloud_samples


def test_stop_frees_the_port_and_is_idempotent(edge: RoleMetrics) -> None:
    port = edge.serve(0, HOST)
    assert port > 0
    assert edge.port == port
    edge.stop()
    edge.stop()
    assert edge.port is None
    with pytest.raises(TransportError):
        scrape(url(port), timeout_s=1.0)
    again = RoleMetrics("edge", "edge1")
    try:
        assert again.serve(port, HOST) == port
        assert scrape(url(port))['estuary_info{instance="edge1",role="edge"}'] == 1
    finally:
        again.stop()


def test_serving_twice_or_on_a_taken_port_is_refused(edge: RoleMetrics) -> None:
    port = edge.serve(0, HOST)
    with pytest.raises(ConfigError, match="already served"):
        edge.serve(0, HOST)
    other = RoleMetrics("edge", "edge1")
    with pytest.raises(ConfigError, match="pick a free port"):
        other.serve(port, HOST)
    assert other.port is None


def test_bad_role_is_refused() -> None:
    with pytest.raises(ConfigError, match="'server'"):
        RoleMetrics("server", "s0")


def test_sample_key_sorts_and_escapes_labels() -> None:
    assert sample_key("m", {}) == "m"
    assert sample_key("m", {"b": "2", "a": 'x"y'}) == 'm{a="x\\"y",b="2"}'


def test_garbage_exposition_is_a_codec_error() -> None:
    with pytest.raises(CodecError):
        parse_exposition("metric{ not valid\n")


def test_wait_for_scrape_counts_prometheus_scrapes_made_after_the_call(
    edge: RoleMetrics,
) -> None:
    """Only a request with Prometheus's scrape header, begun after the call, ends the wait; a
    health probe's plain GET does not, and the wait is bounded."""
    import threading
    import urllib.request

    assert not edge.wait_for_scrape(0.1)  # not serving
    port = edge.serve(0, HOST)

    def get(prometheus: bool) -> None:
        headers = {"X-Prometheus-Scrape-Timeout-Seconds": "4"} if prometheus else {}
        with urllib.request.urlopen(urllib.request.Request(url(port), headers=headers)) as r:
            assert b"estuary_round" in r.read()

    get(prometheus=True)  # before the call: does not count
    probe = threading.Timer(0.2, get, kwargs={"prometheus": False})
    probe.start()
    assert not edge.wait_for_scrape(1.0)
    probe.join()
    scraper = threading.Timer(0.2, get, kwargs={"prometheus": True})
    scraper.start()
    assert edge.wait_for_scrape(10.0)
    scraper.join()


def test_the_process_load_is_exposed(edge: RoleMetrics) -> None:
    """CPU time, memory, open files and start time of the role's process (Linux /proc), what
    the estuary:cpu_cores and EstuaryRoleRestarted rules read."""
    samples = scrape(url(edge.serve(0, HOST)))
    assert samples["process_cpu_seconds_total"] > 0
    assert samples["process_resident_memory_bytes"] > 1 << 20
    assert 0 < samples["process_open_fds"] < samples["process_max_fds"]
    assert samples["process_start_time_seconds"] > 1.7e9
