"""The adversarial suite, content of the messages: what a device's upload, report or id
may carry into the cloud's product, its log and its operator's terminal, tried on a real
Mosquitto by a hostile paho client (:mod:`tests.attack_tools`).

FedDEO, one run (``feddeo_run``; one edge, three devices, one round, the open broker),
the attacker speaking as dev001, which registered one class (3) only. In the one round it
uploads, in this order:

- a mask claiming all ten classes (descriptions at the class prompts): refused at the edge
  as ``class_not_registered``;
- its own class with every description entry 999 (row norm ~8,000 against prompts of ~8):
  ``bad_description``;
- a mask naming no class (an upload that fills no slot): ``describes_nothing``, not counted
  as accepted;
- then its own class, honestly: accepted.

``test_feddeo_uploads_describe_only_registered_classes_within_bounds`` checks the counts,
the edge's accepted-updates counter and what the cloud kept (dev001: class 3 alone) and
generated from (the final report's classes per device). About 12 s.

``test_wire_text_reaches_the_log_and_the_terminal_escaped``: deployment reports and a topic
level carrying line breaks, terminal escapes and a bidi override, read by the cloud's
deployment publisher and by ``estuary status`` (about 2 s).

``test_estuary_deploy_works_beside_a_connected_cloud_and_fails_when_no_device_accepts``:
``estuary deploy`` (in this process) to a sampling device while a cloud is connected, then a
deployment the device refuses (about 10 s, most of it the ONNX export).

``test_a_rerun_reads_no_earlier_runs_deployment_or_reports``: the broker holds a finished
run's signed deployment (its cloud offline) and a device's report about it; the rerun's
device holds that deployment instead of fetching it, the rerun's fresh cloud clears it, and
neither the cloud's report collection nor ``estuary status`` shows the earlier report; the
rerun's own deployment is fetched at once and its report counts (about 5 s).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.config import RunConfig
from shared.methods.feddeo.method import DESC, MASK
from shared.transport.local_broker import LocalBroker, find_mosquitto
from shared.wire.codec import encode_tensors, sha256_hex
from shared.wire.messages import DeviceHello, Topics, encode
from tests.attack_tools import (
    Federation,
    Hostile,
    LogLines,
    Outcome,
    rejected,
    serve_retained,
    total_rejected,
    wait_for,
    watch_round,
)
from tests.conftest import shared_broker, tiny_config
from tests.test_attack_suite import EDGE, Script, model_state, ref_of, update_of

pytestmark = [
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed"),
    pytest.mark.xdist_group("attacks_content"),
]

broker = pytest.fixture(scope="module")(shared_broker)

ATTACKER = "dev001"
OWN_CLASS = 3
OWN_COUNTS = [0] * 10
OWN_COUNTS[OWN_CLASS] = 12


def feddeo_config(name: str) -> RunConfig:
    """A tiny FedDEO run: 1 edge, 3 devices, one round, a random generator."""
    return tiny_config(
        run={"name": name, "rounds": 1},
        federation={"num_devices": 3, "num_edges": 1, "round_deadline_s": 60},
        data={"synthetic_size": 120},
        model={"preset": "fmnist-tiny-cfg"},
        train={"batch_size": 8, "threads": 1},
        algorithm={
            "name": "feddeo", "feddeo_images_per_class": 1, "feddeo_sample_steps": 1,
            "feddeo_desc_epochs": 0.5, "feddeo_desc_batch": 8, "feddeo_clf_epochs": 1,
            "feddeo_grid_per_class": 0,
        },
    )  # fmt: skip


def _upload(desc: torch.Tensor, classes: list[int]) -> bytes:
    mask = torch.zeros(10)
    mask[classes] = 1.0
    return encode_tensors({DESC: desc.contiguous(), MASK: mask})


@dataclass
class FedDEORun:
    """What the FedDEO attack run did and saw."""

    outcome: Outcome
    problems: list[str]
    edge: dict[str, int]
    cloud: dict[str, int]
    accepted: float | None  # the edge's estuary_updates_total{outcome="accepted"}
    held: dict[str, list[int]]  # device -> the classes the cloud kept a description of
    described: dict[str, int]  # the final report's classes per device


@pytest.fixture(scope="module")
def feddeo_run(broker: LocalBroker) -> FedDEORun:
    """The FedDEO federation with dev001 played by the attacker (see the module's doc)."""
    cfg = feddeo_config("atk-feddeo")
    topics = Topics(cfg.run.name)
    state = model_state(cfg)
    prompts = state["class_embedding.weight"][:10].float()
    script = Script()
    with (
        contextlib.closing(Hostile(broker.host, broker.port, "intruder-feddeo")) as evil,
        Federation(cfg, broker.host, broker.port, absent=[ATTACKER], gated_rounds=[0]) as fed,
    ):
        evil.subscribe(topics.edge_round("+"))
        hello = DeviceHello(device=ATTACKER, home_edge=EDGE, n_samples=sum(OWN_COUNTS),
                            label_counts=OWN_COUNTS)  # fmt: skip
        evil.send(topics.device_hello(ATTACKER), encode(hello), retain=True)
        announced = watch_round(evil, topics, EDGE)
        edge_t, cloud_t = fed.traffic(EDGE), fed.traffic("cloud")
        fed.start()
        session = announced(0).session
        chunk = fed.bus(EDGE).settings.chunk_bytes
        src = f"device/{ATTACKER}"
        uploads: list[tuple[str, bytes]] = [
            ("all ten classes", _upload(prompts, list(range(10)))),
            ("entries of 999", _upload(torch.full_like(prompts, 999.0), [OWN_CLASS])),
            ("no class", _upload(prompts, [])),
        ]
        for what, data in uploads:
            with script.step(what):
                ref = ref_of(src, data).model_copy(update={"kind": "description"})
                serve_retained(evil, topics, src, ref.sha256, data, chunk)
                before = total_rejected(edge_t)
                msg = update_of(ATTACKER, session, ref, fed, counts=OWN_COUNTS)
                evil.send(topics.device_up(ATTACKER), encode(msg))
                wait_for(lambda: total_rejected(edge_t) > before, f"the edge to refuse {what}")  # noqa: B023
        with script.step("its own class, honestly"):
            data = _upload(prompts, [OWN_CLASS])
            ref = ref_of(src, data).model_copy(update={"kind": "description"})
            serve_retained(evil, topics, src, ref.sha256, data, chunk)
            msg = update_of(ATTACKER, session, ref, fed, counts=OWN_COUNTS)
            evil.send(topics.device_up(ATTACKER), encode(msg))
            wait_for(lambda: ATTACKER in fed.edges[EDGE].reported, "its honest upload")
        fed.release(0)
        outcome = fed.wait()
        edge = fed.edges[EDGE]
        accepted = edge.metrics.registry.get_sample_value("estuary_updates_total",
                                                          {"outcome": "accepted"})  # fmt: skip
        algo: Any = fed.cloud.algorithm
        held = {d: torch.nonzero(m).flatten().tolist() for d, (_, m) in sorted(algo.held.items())}
        final = fed.cloud.final
        described = dict(final.report.get("described", {})) if final is not None else {}
        return FedDEORun(outcome=outcome, problems=script.problems, edge=rejected(edge_t),
                         cloud=rejected(cloud_t), accepted=accepted, held=held,
                         described=described)  # fmt: skip


def test_feddeo_uploads_describe_only_registered_classes_within_bounds(
    feddeo_run: FedDEORun,
) -> None:
    """A device holding one class cannot describe ten, cannot steer with huge rows and
    cannot be counted for an upload that describes nothing; its own class still counts."""
    run = feddeo_run
    assert run.held.get(ATTACKER) == [OWN_CLASS], run.held
    assert run.described.get(ATTACKER) == 1, run.described
    assert run.edge == {"edge:class_not_registered": 1, "edge:bad_description": 1,
                        "edge:describes_nothing": 1}  # fmt: skip
    assert run.problems == []
    assert run.outcome.completed, (run.outcome.failed, run.outcome.left)
    assert run.cloud == {}
    assert run.accepted == 3.0  # the two honest devices and the attacker's honest upload
    assert sorted(run.held) == ["dev000", ATTACKER, "dev002"]


# -- text from the wire in the cloud's log and on the operator's terminal -------------------

#: a device's deployment report whose free text forges a log line, clears the terminal, sets
#: its title and reverses what follows
FORGED = ("blob_unavailable\n2026-11-29 13:00:00,000 INFO cloud: run finished; global model "
          "deadbeef\x1b[2J\x1b]0;owned\x07\u202edone")  # fmt: skip
CONTROL = ("\n", "\r", "\x1b", "\x07", "\u202e")


def _clean(text: str) -> bool:
    return not any(c in text for c in CONTROL)


def test_wire_text_reaches_the_log_and_the_terminal_escaped(broker: LocalBroker) -> None:
    """A device's report (reason, provider, request id) and a topic level (an id) carrying
    line breaks and terminal escapes: the cloud's deployment publisher logs them, a role's
    rejection names the topic, ``estuary status`` and ``estuary deploy`` print the report;
    every line stays one line, with the escapes shown as text."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from cloud.deploy import DeploymentPublisher, PublisherService
    from estuary.deploy_cli import report_line
    from estuary.status import collect_status, format_status
    from shared.config import BrokerSection
    from shared.logs import EscapingFormatter
    from shared.transport.mqtt import MqttBus
    from shared.wire.messages import BlobRef, Deployment, DeploymentReport

    cfg = tiny_config(run={"name": "atk-text"}, federation={"num_devices": 3, "num_edges": 1})
    topics = Topics(cfg.run.name)
    sha = "ab" * 32
    # the deployment the reports are about (retained; its content does not matter here)
    deployment = Deployment(manifest="{}", signature="0" * 128, key_id="0" * 16,
                            model_ref=BlobRef(sha256=sha, size=1, kind="model"))  # fmt: skip
    refused = DeploymentReport(device="dev000", event="refused", model_sha256=sha, reason=FORGED,
                               deployment=deployment.ident)  # fmt: skip
    classified = DeploymentReport(device="dev001", event="classified", model_sha256=sha, n=8,
                                  accuracy=0.5, provider="cpu\x1b[31m",
                                  request_id="own\n2026 INFO x",
                                  deployment=deployment.ident)  # fmt: skip
    lines = LogLines()
    settings = BrokerSection(host=broker.host, port=broker.port, connect_timeout_s=10)
    buses = [MqttBus(settings, run=cfg.run.name, client_id=f"atk-text-{w}", home=h).connect()
             for w, h in (("cloud", "cloud"), ("status", "observer/status"))]  # fmt: skip
    try:
        with (
            contextlib.closing(Hostile(broker.host, broker.port, "intruder-text")) as evil,
            contextlib.contextmanager(lines.install)(),
        ):
            service = PublisherService("cloud", cfg, buses[0])
            publisher = DeploymentPublisher(service, Ed25519PrivateKey.generate())
            evil.send(topics.cloud_deploy, encode(deployment), retain=True)
            buses[0].pump(0.3)  # the publisher sees the deployment before the reports
            evil.send(topics.device_deploy("dev000"), encode(refused), retain=True)
            evil.send(topics.device_deploy("dev001"), encode(classified), retain=True)
            # an id from the wire: a topic level with a bidi override (Mosquitto refuses
            # control characters in topics, not format characters)
            evil.send(f"{topics.base}/device/dev\u202e200/deploy", encode(refused))
            end = time.monotonic() + 30
            while time.monotonic() < end and not (
                len(publisher.reports) == 2 and rejected(buses[0].traffic)
            ):
                buses[0].pump(0.1)
            assert sorted(publisher.reports) == ["dev000", "dev001"]
            assert rejected(buses[0].traffic) == {"cloud:wrong_sender": 1}
            status = format_status(collect_status(cfg, buses[1], 1.0), "test")
        logged = lines.matching("refused deployment") + lines.matching("wrong_sender")
        assert len(logged) == 2, lines.lines
        assert all(_clean(line) for line in logged), logged
        assert "\\x0a2026-11-29 13:00:00,000 INFO cloud" in logged[0]
        records = [logging.LogRecord("cloud", logging.WARNING, __file__, 1, "%s", (FORGED,), None)]
        formatted = EscapingFormatter("%(levelname)s %(message)s").format(records[0])
        assert _clean(formatted) and "\\x1b[2J" in formatted
        status_lines = status.split("\n")
        assert all(_clean(line) for line in status_lines), status
        assert len(status_lines) == 8, status  # run, cloud, edges, an edge, devices, 3 devices
        shown = [line for line in status_lines if "REFUSED" in line]
        assert len(shown) == 1 and "INFO cloud: run finished" in shown[0]
        printed = [report_line(d, r) for d, r in publisher.summary().items()]
        assert all(_clean(line) for line in printed), printed
    finally:
        for bus in buses:
            bus.close(timeout_s=2.0)


# -- `estuary deploy` beside a running cloud, and its exit status ---------------------------


def _deploy_config(name: str, keys: tuple[Path, Path], broker: LocalBroker) -> RunConfig:
    return tiny_config(
        run={"name": name},
        federation={"num_devices": 1, "num_edges": 1},
        broker={"host": broker.host, "port": broker.port, "chunk_bytes": 16 << 10},
        deploy={"verify_key": str(keys[1]), "grid_size": 2, "sample_steps": 2,
                "fetch_timeout_s": 20},
    )  # fmt: skip


def test_estuary_deploy_works_beside_a_connected_cloud_and_fails_when_no_device_accepts(
    broker: LocalBroker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cloud connected to the broker does not hold the files `estuary deploy` publishes
    (it answered every request for them "missing", and the devices refused the deployment
    as ``blob_unavailable``): the deployer serves them from its own subtree and the device
    samples. Then a signed deployment the device refuses (its model is no ONNX file):
    `estuary deploy` exits 1 and names the device's reason."""
    from device_agent.deployment import SamplingAgent
    from estuary.cli import main
    from shared.config import BrokerSection
    from shared.deploy.export import export_module
    from shared.deploy.signing import (
        generate_keys,
        key_id,
        load_private_key,
        make_manifest,
        sign_manifest,
        write_signed,
    )
    from shared.models.presets import build_unet
    from shared.transport.mqtt import MqttBus

    keys = generate_keys(tmp_path / "keys")
    cfg = _deploy_config("atk-deploy", keys, broker)
    path = tmp_path / "cfg.json"
    path.write_text(cfg.to_json())
    good = tmp_path / "export"
    private = load_private_key(keys[0])
    export_module(cfg, build_unet("fmnist-tiny", seed=0), None, good, round_=0, source="test",
                  threshold=1e-3, parity_steps=2, signing_key=private)  # fmt: skip
    bad = tmp_path / "bad"
    bad.mkdir()
    junk = b"not an onnx model" * 64
    (bad / "model.onnx").write_bytes(junk)
    manifest = make_manifest(sha256_hex(junk), len(junk), {"name": "junk", "source": {"run": "x"}})
    write_signed(bad, *sign_manifest(manifest, private), key_id(private.public_key()))

    settings = BrokerSection(host=broker.host, port=broker.port, connect_timeout_s=10,
                             chunk_bytes=16 << 10)  # fmt: skip
    stop = threading.Event()
    cloud = MqttBus(settings, run=cfg.run.name, client_id="atk-deploy-cloud", home="cloud")
    device_bus = MqttBus(settings, run=cfg.run.name, client_id="atk-deploy-dev000",
                         home="device/dev000")  # fmt: skip
    buses = [cloud.connect(), device_bus.connect()]
    agent = SamplingAgent(cfg, device_bus, device_id="dev000", out_dir=tmp_path / "dev000")
    agent.start()
    runner = threading.Thread(target=lambda: device_bus.run(lambda: False, timeout_s=120,
                                                            stop=stop), daemon=True)  # fmt: skip
    runner.start()
    addr = f"{broker.host}:{broker.port}"
    try:
        time.sleep(0.5)  # the device's retained presence, which `deploy` waits for
        code = main(["deploy", str(good), str(path), "--broker", addr, "--key", str(keys[0]),
                     "--wait-s", "60"])  # fmt: skip
        out = capsys.readouterr()
        served = agent.receiver.served
        assert "dev000:  sampled" in out.out, out.out + out.err
        assert code == 0, out.out + out.err
        assert served is not None
        assert cloud.traffic.transport().get("blob_requests_missing", 0) == 0  # never asked
        code = main(["deploy", str(bad), str(path), "--broker", addr, "--key", str(keys[0]),
                     "--wait-s", "60"])  # fmt: skip
        out = capsys.readouterr()
        assert code == 1, out.out + out.err
        assert "no device accepted deployment" in out.err and "dev000: " in out.err, out.err
    finally:
        stop.set()
        runner.join(10)
        for bus in buses:
            bus.close(timeout_s=2.0)


# -- a rerun under the same run name --------------------------------------------------------


def test_a_rerun_reads_no_earlier_runs_deployment_or_reports(
    broker: LocalBroker, tmp_path: Path
) -> None:
    """The broker holds what a finished run left under this run name: its signed deployment
    (its cloud gone, presence offline) and a device's report about it. The rerun's device
    starts first and does not fetch that deployment; the rerun's fresh cloud clears it (an
    empty retained publish, which the device counts as no ``bad_json``); neither the cloud's
    report collection nor ``estuary status`` reads the earlier report as this run's, while a
    report about the deployment the cloud published counts."""
    from cloud import CloudServer
    from cloud.deploy import DeploymentPublisher
    from device_agent.deployment import SamplingAgent
    from estuary.status import collect_status, format_status
    from shared.config import BrokerSection
    from shared.deploy.signing import (
        MODEL_BLOB_KIND,
        generate_keys,
        key_id,
        load_private_key,
        make_manifest,
        sign_manifest,
    )
    from shared.methods.registry import make_algorithm
    from shared.models.init import initial_model
    from shared.transport.mqtt import MqttBus
    from shared.wire.messages import BlobRef, Deployment, DeploymentReport, Presence

    keys = generate_keys(tmp_path / "keys")
    cfg = _deploy_config("atk-rerun", keys, broker)
    topics = Topics(cfg.run.name)
    private = load_private_key(keys[0])

    def deployment(model: bytes) -> Deployment:
        card = {"name": "first", "source": {"run": cfg.run.name}}
        text, sig = sign_manifest(make_manifest(sha256_hex(model), len(model), card), private)
        ref = BlobRef(sha256=sha256_hex(model), size=len(model), kind=MODEL_BLOB_KIND,
                      src="cloud")  # fmt: skip
        return Deployment(manifest=text, signature=sig, key_id=key_id(private.public_key()),
                          model_ref=ref)  # fmt: skip

    old = deployment(b"the first run's model" * 64)
    old_report = DeploymentReport(device="dev000", event="sampled", deployment=old.ident,
                                  model_sha256=old.model_ref.sha256, n=4, images_per_s=3.0,
                                  provider="cpu")  # fmt: skip
    gone = Presence(name="cloud", role="cloud", online=False)
    settings = BrokerSection(host=broker.host, port=broker.port, connect_timeout_s=10,
                             chunk_bytes=16 << 10)  # fmt: skip
    stop = threading.Event()
    buses: list[Any] = []
    try:
        with contextlib.closing(Hostile(broker.host, broker.port, "first-run")) as first:
            first.send(topics.status("cloud"), encode(gone), retain=True)
            first.send(topics.cloud_deploy, encode(old), retain=True)
            first.send(topics.device_deploy("dev000"), encode(old_report), retain=True)
        # the rerun: its device first, then its fresh cloud
        device_bus = MqttBus(settings, run=cfg.run.name, client_id="atk-rerun-dev000",
                             home="device/dev000").connect()  # fmt: skip
        buses.append(device_bus)
        agent = SamplingAgent(cfg, device_bus, device_id="dev000", out_dir=tmp_path / "dev000")
        agent.start()
        threading.Thread(target=lambda: device_bus.run(lambda: False, timeout_s=60, stop=stop),
                         daemon=True).start()  # fmt: skip
        wait_for(lambda: agent.receiver.held is not None, "the device to see the deployment")
        assert agent.receiver.job is None  # held, not fetched: its cloud is offline
        cloud_bus = MqttBus(settings, run=cfg.run.name, client_id="atk-rerun-cloud",
                            home="cloud").connect()  # fmt: skip
        buses.append(cloud_bus)
        state = dict(initial_model(cfg.model.preset, cfg.model.init, seed=0).state_dict())
        cloud = CloudServer(cfg, cloud_bus, make_algorithm(cfg), initial_model=state)
        publisher = DeploymentPublisher(cloud, private)  # as the cloud's deploy_when_trained
        cloud.clear_deployment()  # what a cloud that does not resume does before it starts
        cloud.start()
        cloud_bus.pump(1.5)
        wait_for(lambda: agent.receiver.held is None, "the device to drop the deployment")
        time.sleep(0.5)  # the cloud online: a deployment still held would be fetched now
        assert agent.receiver.job is None and agent.receiver.served is None
        assert device_bus.traffic.transport().get("deployments_withdrawn") == 1
        assert rejected(device_bus.traffic) == {}, rejected(device_bus.traffic)  # no bad_json
        sent = device_bus.traffic.snapshot()["messages"]
        assert "sent:msg_deploy_report" not in sent, sent  # nothing refused, nothing reported
        assert publisher.reports == {}
        assert cloud.traffic.transport().get("deploy_report_other_deployment") == 1
        with contextlib.closing(Hostile(broker.host, broker.port, "retained")) as look:
            look.subscribe(topics.cloud_deploy)
            time.sleep(0.3)
            assert look.received(topics.cloud_deploy) == []  # nothing retained any more
        status_bus = MqttBus(settings, run=cfg.run.name, client_id="atk-rerun-status",
                             home="observer/status").connect()  # fmt: skip
        buses.append(status_bus)
        st = collect_status(cfg, status_bus, 1.0)
        assert st.devices["dev000"].report == old_report  # retained, and not shown:
        assert st.as_dict()["devices"]["dev000"]["deploy"] is None
        assert "no deployment report" in format_status(st, "test"), format_status(st, "test")
        # the control: the rerun's own deployment (the cloud online) is fetched at once, and
        # the device's report about it counts (a refusal: this cloud holds no such file)
        new = deployment(b"the rerun's model" * 64)
        cloud.send(topics.cloud_deploy, new, retain=True)

        def reported() -> bool:
            cloud_bus.pump(0.1)
            return "dev000" in publisher.reports

        wait_for(reported, "the report about the rerun's deployment")
        report = publisher.reports["dev000"]
        assert (report.event, report.deployment) == ("refused", new.ident), report
    finally:
        stop.set()
        for bus in buses:
            bus.close(timeout_s=2.0)
