"""Signed deployments: Ed25519 manifests, tampering refused, and the device agent that keeps
serving its old model after a refused deployment (over MemoryBus, then torch-free)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cloud.deploy import DeploymentPublisher, PublisherService
from device_agent.deployment import SamplingAgent
from device_agent.sampling import load_generator
from shared.config import RunConfig, config_from_dict
from shared.deploy.export import export_module
from shared.deploy.signing import (
    generate_keys,
    load_private_key,
    load_public_key,
    make_manifest,
    sign_manifest,
    verify_manifest,
)
from shared.diffusion.schedule import make_train_scheduler
from shared.diffusion.training import train_local
from shared.errors import EstuaryError, SignatureError
from shared.models.presets import build_unet
from shared.transport.bus import MemoryBus
from shared.wire.messages import DeploymentReport, SampleRequest

# its module-scoped fixtures are built once: every test of the module on one pytest worker
pytestmark = pytest.mark.xdist_group("deployment")


def _flip(text: str, index: int) -> str:
    """``text`` with one character changed (to another printable one)."""
    c = text[index]
    return text[:index] + ("0" if c != "0" else "1") + text[index + 1 :]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return generate_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory, keys: tuple[Path, Path]) -> list[Path]:
    """Two signed exports of fmnist-tiny (trained 10 and 20 steps)."""
    cfg = config_from_dict({"train": {"local_steps": 10, "batch_size": 8}})
    model = build_unet("fmnist-tiny", seed=0)
    x = torch.rand(64, 1, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    gen = torch.Generator().manual_seed(0)
    sched = make_train_scheduler(cfg.diffusion)
    out = []
    for i in range(2):
        train_local(model, x, cfg.train, sched, gen)
        d = tmp_path_factory.mktemp(f"export{i}")
        export_module(cfg, model, None, d, round_=i, source="test", threshold=1e-3,
                      parity_steps=5, signing_key=load_private_key(keys[0]))  # fmt: skip
        out.append(d)
    return out


# -- manifests ----------------------------------------------------------------------------


def test_manifest_roundtrip_and_every_flipped_byte_is_refused(keys: tuple[Path, Path]) -> None:
    priv, pub = load_private_key(keys[0]), load_public_key(keys[1])
    manifest = make_manifest("ab" * 32, 1234, {"name": "m", "params": 5})
    text, sig = sign_manifest(manifest, priv)
    assert verify_manifest(text, sig, pub) == manifest
    for i in range(0, len(text), 7):
        with pytest.raises(SignatureError) as err:
            verify_manifest(_flip(text, i), sig, pub)
        assert err.value.reason in {"bad_signature", "bad_manifest"}
    with pytest.raises(SignatureError, match="signature"):
        verify_manifest(text, _flip(sig, 10), pub)
    other = generate_keys(
        Path(os.environ.get("TMPDIR", "/tmp")) / f"k{os.getpid()}", overwrite=True
    )
    with pytest.raises(SignatureError, match="does not verify"):
        verify_manifest(text, sig, load_public_key(other[1]))


def test_flipped_byte_on_disk_is_refused(exports: list[Path], keys: tuple[Path, Path],
                                         tmp_path: Path) -> None:  # fmt: skip
    pub = load_public_key(keys[1])
    load_generator(exports[0], verify_key=pub)  # the untouched export loads

    for name, offset in (("model.onnx", 5000), ("manifest.json", 40)):
        d = tmp_path / name
        shutil.copytree(exports[0], d)
        data = bytearray((d / name).read_bytes())
        data[offset] ^= 0x01
        (d / name).write_bytes(bytes(data))
        with pytest.raises(SignatureError) as err:
            load_generator(d, verify_key=pub)
        assert err.value.reason in {"hash_mismatch", "bad_signature", "bad_manifest"}


def test_sample_cli_refuses_a_tampered_model(exports: list[Path], keys: tuple[Path, Path],
                                             tmp_path: Path) -> None:  # fmt: skip

    d = tmp_path / "m"
    shutil.copytree(exports[0], d)
    data = bytearray((d / "model.onnx").read_bytes())
    data[-10] ^= 0xFF
    (d / "model.onnx").write_bytes(bytes(data))
    proc = subprocess.run(
        [sys.executable, "-m", "estuary", "sample", "--model", str(d), "--n", "2", "--steps", "2",
         "--out", str(tmp_path / "g.png"), "--verify-key", str(keys[1])],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "sha256" in proc.stderr and not (tmp_path / "g.png").exists()


# -- the device agent ---------------------------------------------------------------------


def _federation(tmp_path: Path, keys: tuple[Path, Path], **deploy: object) -> RunConfig:
    return config_from_dict({
        "run": {"name": "dep"},
        "deploy": {"verify_key": str(keys[1]), "grid_size": 4, "sample_steps": 3, **deploy},
    })  # fmt: skip


def test_agent_serves_verified_deployments_and_keeps_old_model_after_refusal(
    exports: list[Path], keys: tuple[Path, Path], tmp_path: Path
) -> None:
    cfg = _federation(tmp_path, keys)
    bus = MemoryBus()
    cloud = PublisherService("cloud", cfg, bus)
    publisher = DeploymentPublisher(cloud, load_private_key(keys[0]))
    agent = SamplingAgent(cfg, bus, device_id="dev000", out_dir=tmp_path / "dev000")
    agent.start()
    first = publisher.publish(exports[0])
    bus.run(lambda: publisher.settled(["dev000"]))
    served = agent.receiver.served
    assert served is not None and served.sha256 == first.model_ref.sha256
    assert publisher.reports["dev000"].event == "sampled"
    assert publisher.reports["dev000"].images_per_s > 0
    assert (tmp_path / "dev000" / "models" / first.model_ref.sha256[:16] / "model.onnx").is_file()
    assert len(agent.receiver.grids) == 1 and agent.receiver.grids[0].is_file()
    m = agent.metrics
    assert m.registry.get_sample_value("estuary_images_generated_total") == 4
    assert m.registry.get_sample_value("estuary_deployments_total", {"outcome": "loaded"}) == 1

    # tampered deployments of a second model: each refused, counted and reported; the
    # first model stays in service
    good = publisher.prepare(exports[1])
    forged = good.manifest.replace('"params":', '"params":1', 1)
    bad = {
        "bad_signature": good.model_copy(update={"manifest": forged}),
        "bad_signature ": good.model_copy(update={"signature": _flip(good.signature, 3)}),
        # a valid signature over the first model, pointing at the second model's blob
        "bad_manifest": first.model_copy(update={"model_ref": good.model_ref}),
    }
    for reason, msg in bad.items():
        publisher.reports.pop("dev000")
        cloud.send(cloud.topics.cloud_deploy, msg, retain=True)
        bus.run(lambda: "dev000" in publisher.reports)
        report = publisher.reports["dev000"]
        assert report.event == "refused" and report.reason.startswith(reason.strip())
        assert report.serving == first.model_ref.sha256
        served = agent.receiver.served
        assert served is not None and served.sha256 == first.model_ref.sha256  # old model kept
    refused = m.registry.get_sample_value("estuary_deployments_total", {"outcome": "refused"})
    assert refused == 3
    rejected = bus.traffic.snapshot()["rejected"]
    assert rejected == {"device:bad_signature": 2, "device:bad_manifest": 1}

    # on request over the bus: sample again from the model in service
    publisher.reports.pop("dev000")
    cloud.send(cloud.topics.cloud_sample, SampleRequest(request_id="r1", n=3, steps=2))
    bus.run(lambda: "dev000" in publisher.reports)
    report = publisher.reports["dev000"]
    assert report.event == "sampled" and report.n == 3 and report.request_id == "r1"
    assert report.serving == first.model_ref.sha256

    # the untampered second deployment is then loaded
    publisher.current = good
    cloud.send(cloud.topics.cloud_deploy, good, retain=True)
    bus.run(lambda: publisher.settled(["dev000"]))
    served = agent.receiver.served
    assert served is not None and served.sha256 == good.model_ref.sha256


def test_devices_draw_their_own_grids_large_enough_to_see(
    exports: list[Path], keys: tuple[Path, Path], tmp_path: Path
) -> None:
    """Two devices serving the same deployment draw different images (each its own seed,
    from the run's seed and its name), and the grid is enlarged to be seen (4 images of
    32 px would be 70 px wide)."""
    from PIL import Image

    from device_agent.deployment import grid_seed
    from device_agent.sampling import GRID_MIN_WIDTH

    cfg = _federation(tmp_path, keys)
    bus = MemoryBus()
    cloud = PublisherService("cloud", cfg, bus)
    publisher = DeploymentPublisher(cloud, load_private_key(keys[0]))
    agents = [SamplingAgent(cfg, bus, device_id=d, out_dir=tmp_path / d)
              for d in ("dev000", "dev001")]  # fmt: skip
    for a in agents:
        a.start()
    publisher.publish(exports[0])
    bus.run(lambda: publisher.settled(["dev000", "dev001"]))
    grids = [a.receiver.grids[0] for a in agents]
    assert grids[0].read_bytes() != grids[1].read_bytes()
    for g in grids:
        with Image.open(g) as img:
            assert GRID_MIN_WIDTH <= img.width <= 8 * GRID_MIN_WIDTH
    assert grid_seed(0, "dev000") == grid_seed(0, "dev000") != grid_seed(0, "dev001")
    assert grid_seed(0, "dev000") != grid_seed(1, "dev000")


def test_agent_without_verify_key_refuses(exports: list[Path], keys: tuple[Path, Path],
                                          tmp_path: Path) -> None:  # fmt: skip
    cfg = _federation(tmp_path, keys, verify_key="")
    bus = MemoryBus()
    cloud = PublisherService("cloud", cfg, bus)
    publisher = DeploymentPublisher(cloud, load_private_key(keys[0]))
    agent = SamplingAgent(cfg, bus, device_id="dev001", out_dir=tmp_path / "d")
    agent.start()
    publisher.publish(exports[0])
    bus.run(lambda: "dev001" in publisher.reports)
    r: DeploymentReport = publisher.reports["dev001"]
    assert r.event == "refused" and r.reason.startswith("no_verify_key")
    assert agent.receiver.served is None


def test_sampling_path_runs_without_torch(exports: list[Path], keys: tuple[Path, Path],
                                          tmp_path: Path) -> None:  # fmt: skip
    """``estuary sample`` and the sampling-only device agent with torch made unimportable."""
    code = f"""
import sys
sys.modules["torch"] = None  # any import of torch now raises ImportError
from estuary.cli import main
import device_agent.main, device_agent.deployment  # the sampling-only agent's modules
rc = main(["sample", "--model", {str(exports[0])!r}, "--n", "3", "--steps", "3",
           "--out", {str(tmp_path / "g.png")!r}, "--verify-key", {str(keys[1])!r}, "--quiet"])
assert rc == 0, rc
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr
    assert (tmp_path / "g.png").is_file()
    assert json.loads((exports[0] / "manifest.sig").read_text())["key_id"]


@pytest.mark.skipif(shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists(),
                    reason="mosquitto not installed")  # fmt: skip
def test_estuary_deploy_on_demand_over_mosquitto(exports: list[Path], keys: tuple[Path, Path],
                                                 tmp_path: Path) -> None:  # fmt: skip
    """`estuary deploy` publishes an export as the cloud; a sampling-only device process
    verifies it, writes a grid, and `estuary deploy` exits 0 once the device reported."""
    from shared.transport.local_broker import LocalBroker

    cfg = _federation(tmp_path, keys)
    path = tmp_path / "cfg.json"
    path.write_text(cfg.to_json())
    broker = LocalBroker(kind="mosquitto", workdir=tmp_path / "broker").start()
    addr = f"127.0.0.1:{broker.port}"
    device = subprocess.Popen(
        [sys.executable, "-m", "device_agent", str(path), "--id", "dev000", "--sample-only",
         "--broker", addr, "--metrics-port", "-1", "--stay", "--out-dir", str(tmp_path / "d")],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        time.sleep(3)  # the device's retained presence is what `deploy` waits for
        proc = subprocess.run(
            [sys.executable, "-m", "estuary", "deploy", str(exports[1]), str(path), "--broker",
             addr, "--key", str(keys[0]), "--wait-s", "60"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "dev000:  sampled" in proc.stdout
        assert list((tmp_path / "d" / "samples").glob("deploy-*.png"))
    finally:
        device.terminate()
        device.wait(timeout=20)
        broker.stop()


def test_provider_choice_uses_cuda_only_where_a_gpu_is_visible(
    exports: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """onnxruntime-gpu lists its CUDA provider on every machine; a container without a GPU
    must still sample on the CPU, and an explicit "cuda" must fail rather than fall back."""
    import onnxruntime as ort

    from shared.deploy import onnx_sampler as sampling

    real_available = ort.get_available_providers()
    monkeypatch.delenv("ESTUARY_ASSUME_GPU", raising=False)
    monkeypatch.setattr(sampling, "NVIDIA_DEVICE_DIR", tmp_path)
    with monkeypatch.context() as m:
        m.setattr(ort, "get_available_providers",
                  lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])  # fmt: skip
        assert not sampling.gpu_visible()
        assert sampling.default_providers() == ["CPUExecutionProvider"]
        (tmp_path / "nvidiactl").touch()
        (tmp_path / "nvidia0").touch()
        assert sampling.gpu_visible()
        assert sampling.default_providers() == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    model = exports[0] / "model.onnx"
    if "CUDAExecutionProvider" not in real_available:
        assert sampling.default_providers() == ["CPUExecutionProvider"]
        with pytest.raises(EstuaryError, match="no CUDA EP"):
            sampling.make_session(model, provider="cuda")
    session = sampling.make_session(model, provider="auto")
    assert session.get_providers()[0] == sampling.default_providers()[0]
