"""FedDEO end to end over a real mosquitto: every role on its own MqttBus and thread (as in
tests/test_mqtt_federation.py), the devices built from their own data and test split as
``python -m device_agent`` builds them. One round: each device uploads its descriptions (a
blob of a few KB, kind "description"), the cloud generates, trains and scores the classifier
on every domain, exports and signs it, and every device verifies it and classifies its own
test split with it; the global model the cloud publishes carries no description."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from cloud import CloudServer
from cloud.deploy import deploy_when_trained
from cloud.service import RoundSummary
from device_agent import DeviceAgent
from device_agent.deployment import TEST_SPLIT, DeploymentReceiver
from device_agent.main import device_data, device_test_data
from device_agent.personalize import Personalizer
from edge_node import EdgeServer
from shared.config import RunConfig
from shared.data.datasets import to_model_input
from shared.deploy.signing import CLASSIFY_TASK, generate_keys
from shared.methods.feddeo.method import DESC, MASK
from shared.methods.registry import make_algorithm
from shared.models.init import initial_model
from shared.models.plan import model_spec
from shared.naming import device_name, edge_ids, home_edge
from shared.transport.local_broker import LocalBroker, find_mosquitto
from shared.transport.mqtt import MqttBus
from shared.transport.telemetry import Traffic
from shared.wire.codec import decode_tensors
from shared.wire.messages import DeploymentReport
from tests.conftest import shared_broker, tiny_config
from tests.test_mqtt_federation import _bus

# its module-scoped fixtures are built once: every test of the module on one pytest worker
pytestmark = [
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed"),
    pytest.mark.xdist_group("mqtt_feddeo"),
]

DOMAINS = ["identity", "invert"]
#: a device's upload: 10 descriptions of 64 floats and a mask of 10, with the codec's header
MAX_UPLOAD_BYTES = 4096
TIMEOUT_S = 120.0


#: the session's open mosquitto (this module's runs have names of their own)
broker = pytest.fixture(scope="module")(shared_broker)


def _config(keys: tuple[Path, Path]) -> RunConfig:
    """One edge, two devices (one per domain), one round of a tiny FedDEO, signed deployment."""
    return tiny_config(
        run={"name": "mqtt-feddeo", "rounds": 1},
        federation={"num_devices": 2, "num_edges": 1, "round_deadline_s": 120},
        data={"synthetic_size": 160, "domains": DOMAINS, "max_samples_per_device": 64},
        model={"preset": "fmnist-tiny-cfg", "init": "random"},
        train={"threads": 1},
        algorithm={"name": "feddeo", "feddeo_images_per_class": 2, "feddeo_sample_steps": 2,
                   "feddeo_desc_epochs": 0.2, "feddeo_clf_epochs": 1,
                   "feddeo_grid_per_class": 0},
        eval={"every": 0},
        deploy={"signing_key": str(keys[0]), "verify_key": str(keys[1]), "wait_s": 60,
                "provider": "cpu", "threads": 1},
    )  # fmt: skip


def test_feddeo_over_mqtt_uploads_descriptions_and_deploys_the_classifier(
    broker: LocalBroker, tmp_path: Path
) -> None:
    cfg = _config(generate_keys(tmp_path / "keys"))
    run_dir = tmp_path / "run"
    name = cfg.run.name
    traffic: dict[str, Traffic] = {}
    buses: list[MqttBus] = []

    def bus(role: str, who: str) -> MqttBus:
        traffic[who] = Traffic()
        b = _bus(broker, name, role, who, traffic[who])
        buses.append(b)
        return b

    summaries: list[RoundSummary] = []
    reports: dict[str, DeploymentReport] = {}
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        cbus = bus("cloud", "cloud")
        init = initial_model(cfg.model.preset, cfg.model.init, seed=cfg.run.seed)
        cloud = CloudServer(cfg, cbus, make_algorithm(cfg), initial_model=dict(init.state_dict()),
                            checkpoint_dir=run_dir / "checkpoints",
                            on_round_end=summaries.append)  # fmt: skip
        deploy_when_trained(cloud, run_dir)
        cloud.on(cloud.topics.all_device_deploy, DeploymentReport,
                 lambda m: reports.__setitem__(m.device, m), "msg_test")  # fmt: skip
        services: list[tuple[object, MqttBus]] = []
        for e in edge_ids(cfg):
            b = bus("edge", e)
            services.append((EdgeServer(cfg, b, make_algorithm(cfg), edge_id=e), b))
        devices: list[DeviceAgent] = []
        for i in range(cfg.federation.num_devices):
            d = device_name(i)
            data, test = device_data(cfg, i), device_test_data(cfg, i)
            assert test is not None  # FedDEO's devices classify their own test split
            b = bus("device", d)
            device = DeviceAgent(
                cfg, b, make_algorithm(cfg), device_id=d, index=i, home_edge=home_edge(i, cfg),
                data=to_model_input(data.images), labels=torch.from_numpy(data.labels),
                test_data=to_model_input(test.images), test_labels=torch.from_numpy(test.labels),
            )  # fmt: skip
            DeploymentReceiver(device, tmp_path / d, personalize=Personalizer(device)).start()
            devices.append(device)
            services.append((device, b))
        threads = [
            threading.Thread(target=b.run, args=(stop.is_set,),
                             kwargs={"timeout_s": TIMEOUT_S}, daemon=True)
            for _, b in services
        ]  # fmt: skip
        cloud.start()
        for svc, _ in services:
            svc.start()  # type: ignore[attr-defined]
        for t in threads:
            t.start()
        finished = cbus.run(lambda: cloud.done or cloud.failed is not None, timeout_s=TIMEOUT_S)
        assert finished, "the cloud did not finish"
        assert cloud.failed is None, cloud.failed
        stop.set()
        for t in threads:
            t.join(10)

        # one round, and the one-shot step's classifier scored in every domain
        assert cloud.round == 1 and len(summaries) == 1 and summaries[0].final
        assert cloud.final is not None and cloud.final.preset == "fmnist-cnn"
        accuracy = cloud.final.report["accuracy"]
        assert set(accuracy) == set(DOMAINS), accuracy
        assert all(0.0 <= accuracy[dom] <= 1.0 for dom in DOMAINS)

        # each device uploaded one "description" blob of a few KB, which its edge fetched;
        # no model went up
        edge = traffic[edge_ids(cfg)[0]].snapshot()
        n = cfg.federation.num_devices
        assert edge["messages"]["received:description"] == n, edge["messages"]
        assert 0 < edge["bytes"]["received:description"] <= n * MAX_UPLOAD_BYTES
        assert "received:device_update" not in edge["messages"]
        for d in (device_name(i) for i in range(n)):
            sent = traffic[d].snapshot()
            assert sent["messages"]["sent:description"] == 1, sent["messages"]
            assert sent["bytes"]["sent:description"] <= MAX_UPLOAD_BYTES
            assert "sent:device_update" not in sent["messages"]
        for counters in traffic.values():
            assert counters.snapshot()["rejected"] == {}

        # every device verified the signed classifier and classified its own test split
        manifest = json.loads((run_dir / "deploy" / "manifest.json").read_text())
        assert manifest["task"] == CLASSIFY_TASK
        assert manifest["card"]["final"]["accuracy"] == accuracy
        for device in devices:
            r = reports[device.name]
            assert r.event == "classified", r
            assert r.request_id == TEST_SPLIT and r.accuracy is not None
            assert 0.0 <= r.accuracy <= 1.0 and r.model_sha256 == manifest["model"]["sha256"]
            assert device.test_data is not None and r.n == len(device.test_data)

        # the global model the cloud published holds no description (the generator alone),
        # read back from the broker as an edge would fetch it
        ref = cloud.global_ref
        assert ref is not None and ref.sha256 == cloud.model_sha
        ebus = services[0][1]
        e0 = edge_ids(cfg)[0]
        blob = ebus.endpoint(e0, f"edge/{e0}").get_blob(ref.sha256, ref.size, kind=ref.kind,
                                                       src=ref.src)  # fmt: skip
        state = decode_tensors(blob)
        assert not [k for k in state if k.startswith((DESC, MASK))]
        assert set(state) == set(model_spec(cfg.model.preset, None))
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for b in buses:
            b.close()
