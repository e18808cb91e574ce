"""FedDiffuse ULATDEC/UDEC deployments: the cloud's ONNX model is the global one, whose
device-local parts are at their initialization, so each training device serves its own model
(the signed shared tensors over its local parts, exported on the device behind the same
parity gate), over MemoryBus with the real cloud, edges and devices."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cloud.deploy import DeploymentPublisher, deploy_when_trained
from device_agent.deployment import DeploymentReceiver, SamplingAgent
from device_agent.personalize import Personalizer
from device_agent.sampling import OWN_MODEL_FILE, OWN_RECORD_FILE, load_generator
from estuary.cli import main as cli_main
from estuary.simulate import Federation, build_federation
from shared.config import RunConfig
from shared.data.datasets import load_dataset
from shared.data.partition import make_partition
from shared.deploy.export import SHARED_FILE, EpsModel, example_inputs
from shared.deploy.onnx_sampler import OnnxGenerator
from shared.deploy.signing import generate_keys, load_private_key, load_public_key, sign_manifest
from shared.errors import PersonalizeError, SignatureError
from shared.methods.feddiffuse.method import LOCAL_STATE_KEY
from shared.models.plan import ChannelPlan, build_model
from shared.transport.bus import MemoryBus
from shared.wire.messages import Deployment, DeploymentReport
from tests.conftest import tiny_config


def _federation(tmp_path: Path, split: str) -> tuple[RunConfig, MemoryBus, Federation]:
    """3 devices behind 2 edges, 2 rounds of 1 local step, with a signed deployment."""
    priv, pub = generate_keys(tmp_path / "keys")
    cfg = tiny_config(
        run={"rounds": 2},
        federation={"num_devices": 3, "num_edges": 2},
        train={"local_steps": 1, "batch_size": 2},
        algorithm={"name": "feddiffuse", "split": split},
        deploy={"signing_key": str(priv), "verify_key": str(pub), "grid_size": 2,
                "sample_steps": 2, "parity_steps": 3, "wait_s": 60},
    )  # fmt: skip
    data = load_dataset("synthetic", size=cfg.data.synthetic_size, seed=cfg.run.seed)
    parts = make_partition(data.labels, cfg.federation.num_devices, cfg.data, cfg.run.seed)
    bus = MemoryBus()
    return cfg, bus, build_federation(cfg, bus, data, parts)


class Deployed:
    """A trained and deployed federation: each device's receiver, and the devices' latest
    deployment reports as the cloud hears them."""

    def __init__(self, tmp_path: Path, split: str) -> None:
        self.cfg, self.bus, self.fed = _federation(tmp_path, split)
        self.receivers = []
        for device in self.fed.devices:
            out = tmp_path / device.name
            r = DeploymentReceiver(device, out, personalize=Personalizer(device))
            r.start()
            self.receivers.append(r)
        self.reports: dict[str, DeploymentReport] = {}
        cloud = self.fed.cloud
        cloud.on(cloud.topics.all_device_deploy, DeploymentReport,
                 lambda m: self.reports.__setitem__(m.device, m), "msg_test")  # fmt: skip
        deploy_when_trained(cloud, tmp_path / "run")
        self.fed.start()
        assert self.bus.run(lambda: cloud.done)


def _eps(onnx: bytes, card: dict[str, Any], inputs: tuple[torch.Tensor, ...]) -> np.ndarray:
    gen = OnnxGenerator(onnx, card, provider="cpu")
    return gen.session.run(None, {"sample": inputs[0].numpy(), "timestep": inputs[1].numpy()})[0]


@pytest.mark.parametrize("split", ["ulatdec", "udec"])
def test_devices_serve_their_own_model(
    tmp_path: Path, split: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = Deployed(tmp_path, split)
    cfg, fed = run.cfg, run.fed
    export = tmp_path / "run" / "deploy"
    manifest = json.loads((export / "manifest.json").read_text())
    assert manifest["shared"]["file"] == SHARED_FILE and (export / SHARED_FILE).is_file()
    assert manifest["card"]["personalized"]["shared"] == SHARED_FILE
    card = manifest["card"]
    pub = load_public_key(run.cfg.deploy.verify_key)
    global_onnx = (export / "model.onnx").read_bytes()
    inputs = example_inputs(fed.devices[0].model, 2, torch.Generator().manual_seed(5))
    global_eps = _eps(global_onnx, card, inputs)
    for device, receiver in zip(fed.devices, run.receivers, strict=True):
        served = receiver.served
        assert served is not None and served.personal is not None
        path = served.path / OWN_MODEL_FILE
        record = json.loads((served.path / "own_model.json").read_text())
        assert record["sha256"] == served.personal and record["parity"]["passed"]
        # the device's model: the cloud's final federated parts over its own local parts
        own = build_model(cfg.model.preset, None, seed=cfg.run.seed)
        own.load_state_dict({**fed.cloud.model, **device.algo_state[LOCAL_STATE_KEY]})
        with torch.no_grad():
            want = EpsModel(own.eval())(*inputs).numpy()
        got = _eps(path.read_bytes(), card, inputs)
        assert np.abs(got - want).max() < 1e-4
        assert np.abs(got - global_eps).max() > 1e-3  # not the global model
        # `estuary sample --own` loads the same model from the device's directory
        loaded, _ = load_generator(served.path, verify_key=pub, own=True, provider="cpu")
        feed = {"sample": inputs[0].numpy(), "timestep": inputs[1].numpy()}
        assert np.array_equal(loaded.session.run(None, feed)[0], got)
        assert loaded.model_sha256 == served.personal  # what `sample --own` prints
        if device is fed.devices[0]:  # the command itself, once
            out = tmp_path / f"{device.name}.png"
            args = ["sample", "--model", str(served.path), "--own", "--json", "--n", "2",
                    "--steps", "2", "--verify-key", str(cfg.deploy.verify_key),
                    "--provider", "cpu", "--out", str(out)]  # fmt: skip
            assert cli_main(args) == 0 and out.is_file()
            said = json.loads(capsys.readouterr().out)
            assert said["own_model_sha256"] == served.personal
            assert said["model_sha256"] == manifest["model"]["sha256"]
        r = run.reports[device.name]
        assert r.event == "sampled" and r.personal == served.personal
        assert r.model_sha256 == served.sha256 == manifest["model"]["sha256"]
    assert run.bus.traffic.snapshot()["rejected"] == {}


def test_full_deploys_the_global_model_to_everyone(tmp_path: Path) -> None:
    run = Deployed(tmp_path, "full")
    manifest = json.loads((tmp_path / "run" / "deploy" / "manifest.json").read_text())
    assert "shared" not in manifest and "personalized" not in manifest["card"]
    assert not (tmp_path / "run" / "deploy" / SHARED_FILE).exists()
    for r in run.receivers:
        assert r.served is not None and r.served.personal is None
        assert r.served.sha256 == manifest["model"]["sha256"]
    assert {r.personal for r in run.reports.values()} == {None}


def test_bad_shared_tensors_and_foreign_architectures_are_refused(tmp_path: Path) -> None:
    """A shared reference that is not the signed file, a signed model file named like the
    own model, and a deployment for another architecture than the device trained (its local
    parts cannot go with it) are refused with a reason, the model in service kept. A device
    that holds no local parts, or only samples, serves the global model without fetching
    the shared tensors."""
    run = Deployed(tmp_path, "udec")
    fed, device, receiver = run.fed, run.fed.devices[0], run.receivers[0]
    assert receiver.served is not None
    own_dir = receiver.served.path
    # a model in service under another deployment's hash, so the same one loads again
    kept = dataclasses.replace(receiver.served, sha256="0" * 64)
    key = load_private_key(run.cfg.deploy.signing_key)
    publisher = DeploymentPublisher(fed.cloud, key)
    good = publisher.prepare(tmp_path / "run" / "deploy")

    def send(msg: Deployment) -> DeploymentReport:
        receiver.served = kept
        run.reports.pop(device.name, None)
        fed.cloud.send(fed.cloud.topics.cloud_deploy, msg, retain=True)
        run.bus.run(lambda: device.name in run.reports)
        return run.reports[device.name]

    for shared_ref in (good.model_ref, None):  # not the signed shared file, or missing
        report = send(good.model_copy(update={"shared_ref": shared_ref}))
        assert report.event == "refused" and report.reason.startswith("bad_manifest")
        assert receiver.served is kept  # refused: the model in service stays
    manifest = json.loads(good.manifest)
    manifest["model"]["file"] = OWN_MODEL_FILE
    text, signature = sign_manifest(manifest, key)
    report = send(good.model_copy(update={"manifest": text, "signature": signature}))
    assert report.event == "refused" and "reserved" in report.reason

    # as if the device had trained another architecture
    device.plan = ChannelPlan(device.cfg.model.preset, {"foreign": True})
    report = send(good)
    assert report.event == "refused" and report.reason.startswith("personalize_failed")
    assert "architecture" in report.reason and receiver.served is kept
    rejected = run.bus.traffic.snapshot()["rejected"]
    assert rejected == {"device:bad_manifest": 3, "device:personalize_failed": 1}

    # the device lost its local parts (a restart): the global model, no shared tensors
    # fetched (the reference is missing), and its earlier own model is not left behind
    device.algo_state.clear()
    report = send(good.model_copy(update={"shared_ref": None}))
    assert report.event == "loaded" and report.personal is None
    assert receiver.served is not kept and receiver.served.personal is None
    assert not (own_dir / OWN_MODEL_FILE).exists() and not (own_dir / OWN_RECORD_FILE).exists()

    # a sampling-only device likewise
    agent = SamplingAgent(run.cfg, run.bus, device_id="dev003", out_dir=tmp_path / "dev003")
    agent.start()
    fed.cloud.send(fed.cloud.topics.cloud_deploy, good.model_copy(update={"shared_ref": None}))
    run.bus.run(lambda: "dev003" in run.reports)
    assert run.reports["dev003"].event == "loaded" and run.reports["dev003"].personal is None
    served = agent.receiver.served
    assert served is not None and served.sha256 == good.model_ref.sha256
    assert run.bus.traffic.snapshot()["rejected"] == rejected


def test_personalizer_refuses_what_fails_parity_or_breaks_the_export(tmp_path: Path) -> None:
    """The own model must pass the gate the cloud's export passed (here a threshold no
    export meets); anything that breaks the export is a PersonalizeError, not a crash."""
    run = Deployed(tmp_path, "ulatdec")
    export = tmp_path / "run" / "deploy"
    card = json.loads((export / "card.json").read_text())
    shared = (export / SHARED_FILE).read_bytes()
    personalize = Personalizer(run.fed.devices[0])
    assert personalize.holds_local_parts()
    strict = {**card, "parity": {**card["parity"], "threshold": 1e-12}}
    with pytest.raises(PersonalizeError, match="above the deployment's threshold 1e-12"):
        personalize(shared, strict)
    with pytest.raises(PersonalizeError, match="ValueError"):
        personalize(shared, {**card, "opset": "seventeen"})
    with pytest.raises(PersonalizeError, match="shared tensors"):
        personalize(shared[:-8], card)
    assert personalize(shared, card).parity["passed"]


def test_sample_own_refuses_a_tampered_or_foreign_own_model(tmp_path: Path) -> None:
    run = Deployed(tmp_path, "udec")
    served = run.receivers[0].served
    assert served is not None
    with pytest.raises(SignatureError, match="no device's own model"):
        load_generator(tmp_path / "run" / "deploy", own=True)  # the cloud's export has none
    model = served.path / OWN_MODEL_FILE
    data = bytearray(model.read_bytes())
    data[-5] ^= 0x01
    model.write_bytes(bytes(data))
    with pytest.raises(SignatureError, match="differs from its record") as err:
        load_generator(served.path, own=True)
    assert err.value.reason == "hash_mismatch"
    record = json.loads((served.path / OWN_RECORD_FILE).read_text())
    (served.path / OWN_RECORD_FILE).write_text(json.dumps({**record, "deployment": "0" * 64}))
    with pytest.raises(SignatureError, match="not for this deployment"):
        load_generator(served.path, own=True)
