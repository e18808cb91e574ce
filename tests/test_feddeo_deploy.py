"""FedDEO's product deployed: the cloud exports the classifier of its final step to ONNX
(parity-gated), signs a manifest whose task is "classify" and publishes it as it publishes
generators; each device verifies it, classifies its own images with ONNX Runtime and reports
its accuracy. Tampered or badly signed classifiers are refused with a reason, the device
keeps running; the device side needs no torch."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cloud.deploy import (
    DeploymentPublisher,
    PublisherService,
    deploy_when_trained,
    export_final_classifier,
    report_for_card,
)
from device_agent.deployment import (
    CLASSIFIED_FILE,
    IMAGE_FOLDER,
    TEST_SPLIT,
    DeploymentReceiver,
    SamplingAgent,
)
from estuary.simulate import build_federation, device_test_splits
from shared.config import RunConfig
from shared.data.datasets import load_dataset, to_model_input, write_image_folder
from shared.data.partition import make_partition
from shared.deploy.classifier_export import ClassifierExport
from shared.deploy.onnx_classifier import OnnxClassifier
from shared.deploy.signing import (
    CLASSIFY_TASK,
    generate_keys,
    load_private_key,
    load_public_key,
    read_signed,
    sign_manifest,
    verify_manifest,
)
from shared.errors import EstuaryError, ExportError
from shared.methods.base import FinalResult
from shared.models.classifier import build_classifier
from shared.transport.bus import MemoryBus
from shared.wire.messages import Deployment, DeploymentReport, SampleRequest
from tests.conftest import tiny_config

# its module-scoped fixtures are built once: every test of the module on one pytest worker
pytestmark = pytest.mark.xdist_group("feddeo_deploy")

REPORT = {
    "accuracy": {"identity": 0.5, "noise": 0.25},
    "mean_accuracy": 0.375,
    "accuracy_by_n": {"2": {"identity": 0.5, "noise": 0.25, "mean": 0.375}},
    "domains": ["identity", "noise"],
    "described": {"dev000": 4, "dev001": 5},
    "spread": float("nan"),
}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return generate_keys(tmp_path_factory.mktemp("keys"))


def _config(keys: tuple[Path, Path], **over: dict[str, Any]) -> RunConfig:
    """A FedDEO config on the synthetic data with signing and verification keys."""
    sections: dict[str, dict[str, Any]] = {
        "run": {"name": "feddeo-deploy", "rounds": 1},
        "model": {"preset": "fmnist-tiny-cfg", "init": "random"},
        "algorithm": {"name": "feddeo"},
        "deploy": {
            "signing_key": str(keys[0]),
            "verify_key": str(keys[1]),
            "wait_s": 60,
            "provider": "cpu",
        },
    }
    for section, values in over.items():
        sections.setdefault(section, {}).update(values)
    return tiny_config(**sections)


@pytest.fixture(scope="module")
def exported(
    keys: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[RunConfig, ClassifierExport]:
    """A freshly built fmnist-cnn exported and signed by the cloud's export function."""
    cfg = _config(keys)
    model = build_classifier("fmnist-cnn", seed=3)
    final = FinalResult({k: v.clone() for k, v in model.state_dict().items()}, "fmnist-cnn",
                        REPORT)  # fmt: skip
    out = tmp_path_factory.mktemp("run") / "deploy"
    result = export_final_classifier(
        cfg, final, out, signing_key=load_private_key(keys[0]), round_=1, source="test"
    )
    return cfg, result


def _test_images(cfg: RunConfig) -> tuple[np.ndarray, np.ndarray]:
    test = load_dataset("synthetic", split="test", size=cfg.data.synthetic_size,
                        seed=cfg.run.seed)  # fmt: skip
    return test.images, test.labels


# -- the cloud's export ---------------------------------------------------------------------


def test_export_is_parity_checked_and_signed_for_classifying(
    exported: tuple[RunConfig, ClassifierExport], keys: tuple[Path, Path]
) -> None:
    cfg, result = exported
    out = result.out_dir
    text, signature = read_signed(out)
    assert signature is not None
    manifest = verify_manifest(text, signature, load_public_key(keys[1]))
    assert manifest["task"] == CLASSIFY_TASK
    data = (out / "model.onnx").read_bytes()
    assert manifest["model"]["sha256"] == result.sha256 == manifest["card"]["sha256"]
    assert manifest["model"]["size"] == len(data)
    assert manifest["version"]["run"] == cfg.run.name
    card = json.loads((out / "card.json").read_text())
    assert card == manifest["card"] and card["kind"] == "classifier" and card["signed"]
    assert card["parity"]["passed"] and card["parity"]["images"] == 256
    assert "synthetic's test split" in card["parity_images"]
    assert card["accuracy"]["images"] == 256  # ONNX Runtime on the labelled parity images
    assert card["source"]["algorithm"] == "feddeo" and card["source"]["round"] == 1
    # the final report, per-domain accuracy included, as plain JSON (NaN as null)
    assert card["final"]["accuracy"] == REPORT["accuracy"]
    assert card["final"]["mean_accuracy"] == 0.375 and card["final"]["spread"] is None
    # the classifier serves from the export directory too (`estuary classify`): the
    # final state's logits
    images, _ = _test_images(cfg)
    clf = OnnxClassifier(out, provider="cpu")
    model = build_classifier("fmnist-cnn", seed=3).eval()
    with torch.no_grad():
        want = model(to_model_input(images[:16])).numpy()
    assert np.abs(clf.logits(images[:16]) - want).max() < 1e-4


def test_a_new_export_numbers_after_the_last_and_refuses_what_is_no_classifier(
    exported: tuple[RunConfig, ClassifierExport], keys: tuple[Path, Path], tmp_path: Path
) -> None:
    cfg, _ = exported
    key = load_private_key(keys[0])
    model = build_classifier("fmnist-cnn", seed=4)
    final = FinalResult(model.state_dict(), "fmnist-cnn", {})
    out = tmp_path / "deploy"
    serial = []
    for _ in range(2):  # the same model again: a new version, after the one it replaces
        export_final_classifier(cfg, final, out, signing_key=key, round_=1, source="t")
        serial.append(json.loads((out / "manifest.json").read_text())["version"]["serial"])
    assert serial[1] > serial[0]
    with pytest.raises(ExportError, match="not a 'fmnist-cnn' classifier"):
        export_final_classifier(cfg, FinalResult({"w": torch.zeros(1)}, "fmnist-cnn", {}),
                                out, signing_key=key, round_=1, source="t")  # fmt: skip
    # a folder dataset has no test split: seeded random images, no labels
    folder = cfg.model_copy(update={"data": cfg.data.model_copy(update={"dataset": "folder"})})
    c = export_final_classifier(folder, final, tmp_path / "f", signing_key=key, round_=1,
                                source="t")  # fmt: skip
    assert "random" in c.card["parity_images"] and c.card["accuracy"] is None


def test_the_report_fits_the_card() -> None:
    big = {"accuracy": {"identity": 0.5}, "described": {f"dev{i:05d}": 10 for i in range(5000)}}
    out = report_for_card(big, budget=1024)
    assert out["accuracy"] == {"identity": 0.5} and out["omitted"] == ["described"]
    assert report_for_card({"x": np.float32(0.5), "n": np.int64(3)}) == {"x": 0.5, "n": 3}


# -- the device ----------------------------------------------------------------------------


class Devices:
    """A publishing cloud and a sampling-only device given a test split of its own."""

    def __init__(self, cfg: RunConfig, keys: tuple[Path, Path], out: Path) -> None:
        self.bus = MemoryBus()
        self.cloud = PublisherService("cloud", cfg, self.bus)
        self.publisher = DeploymentPublisher(self.cloud, load_private_key(keys[0]))
        self.agent = SamplingAgent(cfg, self.bus, device_id="dev000", out_dir=out)
        images, labels = _test_images(cfg)
        self.images, self.labels = images[:100], labels[:100]
        self.agent.test_data = self.images  # type: ignore[attr-defined]
        self.agent.test_labels = self.labels  # type: ignore[attr-defined]
        self.agent.start()

    def send(self, msg: Deployment) -> DeploymentReport:
        """Publish ``msg`` and wait for the device's classified or refused report."""
        self.publisher.reports.pop("dev000", None)
        self.cloud.send(self.cloud.topics.cloud_deploy, msg, retain=True)
        self.bus.run(lambda: self.event() in ("classified", "refused"))
        return self.publisher.reports["dev000"]

    def event(self) -> str | None:
        r = self.publisher.reports.get("dev000")
        return None if r is None else r.event


def test_device_verifies_installs_and_classifies_its_test_split(
    exported: tuple[RunConfig, ClassifierExport], keys: tuple[Path, Path], tmp_path: Path
) -> None:
    cfg, result = exported
    run = Devices(cfg, keys, tmp_path / "dev000")
    msg = run.publisher.publish(result.out_dir)
    run.bus.run(lambda: run.publisher.settled(["dev000"]))
    report = run.publisher.reports["dev000"]
    want = OnnxClassifier(result.out_dir, provider="cpu").accuracy(run.images, run.labels)
    assert report.event == "classified" and report.request_id == TEST_SPLIT
    assert report.n == 100 and report.accuracy is not None
    assert math.isclose(report.accuracy, want)
    assert report.model_sha256 == report.serving == msg.model_ref.sha256 == result.sha256
    served = run.agent.receiver.served
    assert served is not None and served.classifier is not None and served.generator is None
    for name in ("model.onnx", "card.json", "manifest.json", "manifest.sig", CLASSIFIED_FILE):
        assert (served.path / name).is_file(), name
    assert OnnxClassifier(served.path, provider="cpu").sha256 == result.sha256
    figures = json.loads((served.path / CLASSIFIED_FILE).read_text())
    assert figures["set"] == TEST_SPLIT and figures["accuracy"] == report.accuracy
    m = run.agent.metrics
    assert m.registry.get_sample_value("estuary_deployments_total", {"outcome": "loaded"}) == 1
    # a classifier draws no images: a sample request is answered with a reason
    run.publisher.reports.pop("dev000")
    run.cloud.send(run.cloud.topics.cloud_sample, SampleRequest(request_id="r1", n=2, steps=2))
    run.bus.run(lambda: "dev000" in run.publisher.reports)
    r = run.publisher.reports["dev000"]
    assert r.event == "refused" and r.reason.startswith("no_generator")


def test_tampered_or_badly_signed_classifiers_are_refused(
    exported: tuple[RunConfig, ClassifierExport], keys: tuple[Path, Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    cfg, result = exported
    run = Devices(cfg, keys, tmp_path / "dev000")
    key = load_private_key(keys[0])
    good = run.publisher.prepare(result.out_dir)
    manifest = json.loads(good.manifest)

    def signed(m: dict[str, Any], **update: Any) -> Deployment:
        text, signature = sign_manifest(m, key)
        return good.model_copy(update={"manifest": text, "signature": signature, **update})

    forged = good.manifest.replace('"num_classes":10', '"num_classes":11', 1)
    assert forged != good.manifest
    flipped = good.signature[:5] + ("0" if good.signature[5] != "0" else "1") + good.signature[6:]
    # a validly signed manifest whose card names another model than the signed file
    other_card = {**manifest, "card": {**manifest["card"], "sha256": "ab" * 32}}
    # a validly signed manifest and a card of something else than a classifier
    not_clf = {**manifest, "card": {**manifest["card"], "kind": "unet"}}
    cases = [
        ("bad_signature", good.model_copy(update={"manifest": forged})),
        ("bad_signature", good.model_copy(update={"signature": flipped})),
        ("bad_manifest", signed(other_card)),
        ("bad_model: card kind is 'unet'", signed(not_clf)),
        ("bad_manifest: task", signed({**manifest, "task": "train"})),
    ]
    for reason, msg in cases:
        report = run.send(msg)
        assert report.event == "refused" and report.reason.startswith(reason), report.reason
        assert run.agent.receiver.served is None
    # the ONNX bytes changed on the way (the device checks them against the signed hash)
    real_get = run.agent.ep.get_blob

    def tampered(*args: Any, **kwargs: Any) -> bytes:
        data = bytearray(real_get(*args, **kwargs))
        data[-10] ^= 0xFF
        return bytes(data)

    with monkeypatch.context() as m:
        m.setattr(run.agent.ep, "get_blob", tampered)
        report = run.send(good)
    assert report.event == "refused" and report.reason.startswith("hash_mismatch")
    assert run.agent.receiver.served is None
    # signed, but not an ONNX model: refused, and the device keeps running
    junk = b"not an onnx model" * 8
    sha = hashlib.sha256(junk).hexdigest()
    blob = run.cloud.ep.put_blob(junk, kind=good.model_ref.kind)
    junk_manifest = {**manifest, "model": {**manifest["model"], "sha256": sha,
                                           "size": len(junk)},
                     "card": {**manifest["card"], "sha256": sha}}  # fmt: skip
    ref = good.model_ref.model_copy(update={"sha256": blob, "size": len(junk)})
    report = run.send(signed(junk_manifest, model_ref=ref))
    assert report.event == "refused" and report.reason.startswith("bad_model")
    # ... and the untampered deployment then serves
    report = run.send(good)
    assert report.event == "classified" and report.accuracy is not None
    rejected = run.bus.traffic.snapshot()["rejected"]
    assert rejected["device:bad_signature"] == 2 and rejected["device:hash_mismatch"] == 1
    # the installed copy, tampered on disk, is refused by the loader
    served = run.agent.receiver.served
    assert served is not None
    path = served.path / "model.onnx"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(EstuaryError, match="does not match its card"):
        OnnxClassifier(served.path)


def test_a_device_without_torch_classifies_its_image_folder(
    exported: tuple[RunConfig, ClassifierExport], keys: tuple[Path, Path], tmp_path: Path
) -> None:
    """A sampling-only device (torch made unimportable) verifies the classifier and runs it
    on its labelled image folder (``data.local_dir``)."""
    cfg, result = exported
    test = load_dataset("synthetic", split="test", size=60, seed=5)
    write_image_folder(test, tmp_path / "images", [f"{i:04d}" for i in range(len(test))])
    cfg = cfg.model_copy(update={
        "data": cfg.data.model_copy(update={"local_dir": str(tmp_path / "images")})
    })  # fmt: skip
    (tmp_path / "cfg.json").write_text(cfg.to_json())
    want = OnnxClassifier(result.out_dir, provider="cpu").accuracy(test.images, test.labels)
    code = f"""
import json, sys
sys.modules["torch"] = None  # any import of torch now raises ImportError
from pathlib import Path
from device_agent.deployment import SamplingAgent
from shared.config import RunConfig
from shared.deploy.signing import MODEL_BLOB_KIND, key_id, load_public_key, read_signed
from shared.runtime.service import RoleService
from shared.transport.bus import MemoryBus
from shared.wire.messages import BlobRef, Deployment, DeploymentReport

class Cloud(RoleService):
    role = "cloud"
    def start(self): pass

cfg = RunConfig.model_validate_json(Path({str(tmp_path / "cfg.json")!r}).read_text())
out = Path({str(result.out_dir)!r})
bus = MemoryBus()
cloud = Cloud("cloud", cfg, bus)
reports = []
cloud.on(cloud.topics.all_device_deploy, DeploymentReport, reports.append, "msg_test")
agent = SamplingAgent(cfg, bus, device_id="dev000", out_dir=Path({str(tmp_path / "d")!r}))
agent.start()
text, signature = read_signed(out)
data = (out / "model.onnx").read_bytes()
sha = cloud.ep.put_blob(data, kind=MODEL_BLOB_KIND)
ref = BlobRef(sha256=sha, size=len(data), kind=MODEL_BLOB_KIND, src=cloud.home)
kid = key_id(load_public_key(cfg.deploy.verify_key))
msg = Deployment(manifest=text, signature=signature, key_id=kid, model_ref=ref)
cloud.send(cloud.topics.cloud_deploy, msg, retain=True)
bus.run(lambda: any(r.event in ("classified", "refused") for r in reports))
print(json.dumps(reports[-1].model_dump()))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["event"] == "classified" and report["request_id"] == IMAGE_FOLDER
    assert report["n"] == 60 and math.isclose(report["accuracy"], want)


# -- a whole FedDEO run ---------------------------------------------------------------------


def test_feddeo_run_deploys_its_classifier_to_every_device(
    keys: tuple[Path, Path], tmp_path: Path
) -> None:
    """2 devices behind 1 edge, one round of FedDEO on the synthetic data: the cloud
    generates, trains the classifier, exports, signs and publishes it; every device
    verifies it and classifies its own test split."""
    cfg = _config(
        keys,
        federation={"num_devices": 2, "num_edges": 1},
        data={"max_samples_per_device": 64},
        algorithm={"feddeo_images_per_class": 2, "feddeo_sample_steps": 2,
                   "feddeo_desc_epochs": 0.1, "feddeo_clf_epochs": 1,
                   "feddeo_grid_per_class": 0},
    )  # fmt: skip
    data = load_dataset("synthetic", size=cfg.data.synthetic_size, seed=cfg.run.seed)
    parts = make_partition(data.labels, cfg.federation.num_devices, cfg.data, cfg.run.seed)
    run_dir = tmp_path / "run"
    test = device_test_splits(cfg, tmp_path, ["dev000", "dev001"], show=False)
    assert test is not None  # FedDEO's devices get a test split of their own
    bus = MemoryBus()
    fed = build_federation(cfg, bus, data, parts, checkpoint_dir=run_dir / "checkpoints",
                           test=test)  # fmt: skip
    reports: dict[str, DeploymentReport] = {}
    cloud = fed.cloud
    cloud.on(cloud.topics.all_device_deploy, DeploymentReport,
             lambda m: reports.__setitem__(m.device, m), "msg_test")  # fmt: skip
    receivers = [DeploymentReceiver(d, tmp_path / d.name) for d in fed.devices]
    for receiver in receivers:
        receiver.start()
    deploy_when_trained(cloud, run_dir)
    fed.start()
    assert bus.run(lambda: cloud.done or cloud.failed is not None)
    assert cloud.failed is None and cloud.done and cloud.final is not None
    manifest = json.loads((run_dir / "deploy" / "manifest.json").read_text())
    assert manifest["task"] == CLASSIFY_TASK and manifest["card"]["preset"] == "fmnist-cnn"
    assert manifest["card"]["final"]["accuracy"] == cloud.final.report["accuracy"]
    for device in fed.devices:
        r = reports[device.name]
        assert r.event == "classified", r
        assert r.accuracy is not None and r.request_id == TEST_SPLIT
        assert device.test_data is not None and r.n == len(device.test_data)
        assert r.model_sha256 == manifest["model"]["sha256"]
    saved = json.loads((run_dir / "deploy" / "reports.json").read_text())
    assert {d: v["event"] for d, v in saved.items()} == {"dev000": "classified",
                                                          "dev001": "classified"}  # fmt: skip
    assert bus.traffic.snapshot()["rejected"] == {}
