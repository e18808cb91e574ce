"""A device's own classifier exported to ONNX (parity-gated, unsigned by design) and
classified without torch: ``shared.deploy.classifier_export``, ``shared.deploy.onnx_classifier``
and ``estuary classify``, all against real ONNX Runtime."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from estuary.cli import main
from shared.data.datasets import (
    ImageDataset,
    load_fashion_mnist,
    load_image_folder,
    synthetic_dataset,
    to_model_input,
    write_image_folder,
)
from shared.deploy.classifier_export import ClassifierExport, export_classifier
from shared.deploy.onnx_classifier import (
    OnnxClassifier,
    model_input,
    read_fashion_mnist_test,
    read_image_folder,
)
from shared.errors import EstuaryError, ExportError
from shared.models.classifier import (
    FmnistCNN,
    accuracy,
    build_classifier,
    predict,
)
from tests.conftest import needs_fmnist

# its module-scoped fixtures are built once: every test of the module on one pytest worker
pytestmark = pytest.mark.xdist_group("classifier_export")

ORIGIN = {"device": "dev003", "round": 199, "algorithm": "pfedgpa"}


@pytest.fixture(scope="module")
def trained() -> tuple[FmnistCNN, ImageDataset]:
    """fmnist-cnn after 15 seeded Adam steps on the synthetic set (a plain loop: the
    library's train_classifier imports diffusers, seconds for nothing here), and a
    held-out test set."""
    train, test = synthetic_dataset(384, seed=0), synthetic_dataset(200, seed=1)
    model = build_classifier("fmnist-cnn", seed=0)
    x, y = to_model_input(train.images), torch.from_numpy(train.labels)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 117k-parameter CNN: more threads only contend on a busy CPU
    try:
        for _ in range(15):
            idx = torch.randint(0, len(x), (32,), generator=gen)
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval(), test


@pytest.fixture(scope="module")
def exported(
    trained: tuple[FmnistCNN, ImageDataset], tmp_path_factory: pytest.TempPathFactory
) -> ClassifierExport:
    model, test = trained
    out = tmp_path_factory.mktemp("export") / "dev003"
    return export_classifier(
        model, out, images=to_model_input(test.images),
        labels=torch.from_numpy(test.labels), origin=ORIGIN,
    )  # fmt: skip


def torch_accuracy(model: nn.Module, data: ImageDataset) -> float:
    """shared.models.classifier.accuracy as an exact fraction (it averages in float32)."""
    acc = accuracy(model, to_model_input(data.images), torch.from_numpy(data.labels))
    correct = round(acc * len(data))
    assert abs(acc - correct / len(data)) < 1e-6
    return correct / len(data)


class BranchyCNN(FmnistCNN):
    """Data-dependent control flow: the trace (of blank images) records the no-branch path,
    eager torch on real images takes the other, so ONNX Runtime genuinely disagrees."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if bool((x > 0).any()):
            return logits.roll(1, dims=1) + 1.0
        return logits


def test_export_writes_model_and_card(
    exported: ClassifierExport, trained: tuple[FmnistCNN, ImageDataset]
) -> None:
    model, test = trained
    files = sorted(p.name for p in exported.out_dir.iterdir())
    assert files == ["card.json", "model.onnx"]  # no manifest, no signature
    card = json.loads(exported.card_path.read_text())
    assert card == exported.card
    assert card["kind"] == "classifier" and card["preset"] == "fmnist-cnn"
    assert card["num_classes"] == 10 and card["image_shape"] == [1, 32, 32]
    assert card["opset"] == 17 and card["params"] == 117_066
    assert card["sha256"] == hashlib.sha256(exported.model_path.read_bytes()).hexdigest()
    assert card["sha256"] == exported.sha256
    assert card["signed"] is False and "no signature" in card["signature_note"]
    assert card["origin"] == ORIGIN
    p = exported.parity
    assert p.passed and p.max_abs <= 1e-4 and p.argmax_agreement == 1.0 and p.images == 200
    assert card["parity"]["max_abs"] == p.max_abs
    # every argmax agrees, so ONNX Runtime's accuracy is torch's; trained: far above chance (10%)
    want = torch_accuracy(model, test)
    assert exported.accuracy == want and want > 0.6
    assert card["accuracy"]["value"] == exported.accuracy


def test_onnx_runtime_matches_torch_on_a_new_batch_size(
    exported: ClassifierExport, trained: tuple[FmnistCNN, ImageDataset]
) -> None:
    model, _ = trained
    data = synthetic_dataset(37, seed=5)
    # the numpy normalization is torch's, bit for bit
    assert np.array_equal(model_input(data.images), to_model_input(data.images).numpy())
    clf = OnnxClassifier(exported.out_dir, provider="cpu")
    got = clf.logits(data.images, batch_size=16)  # 16 + 16 + 5: dynamic batch
    with torch.no_grad():
        want = model(to_model_input(data.images)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert np.array_equal(clf.predict(data.images), predict(model, to_model_input(data.images)))
    assert clf.accuracy(data.images, data.labels) == torch_accuracy(model, data)
    assert clf.providers == ["CPUExecutionProvider"]


def test_tampered_or_foreign_export_is_refused(exported: ClassifierExport, tmp_path: Path) -> None:
    bad = shutil.copytree(exported.out_dir, tmp_path / "tampered")
    data = bytearray((bad / "model.onnx").read_bytes())
    data[-10] ^= 0x01
    (bad / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(EstuaryError, match="does not match its card"):
        OnnxClassifier(bad, provider="cpu")

    foreign = shutil.copytree(exported.out_dir, tmp_path / "foreign")
    card = json.loads((foreign / "card.json").read_text())
    (foreign / "card.json").write_text(json.dumps({**card, "kind": "unet"}))
    with pytest.raises(EstuaryError, match="not a classifier export"):
        OnnxClassifier(foreign, provider="cpu")


def test_parity_failure_refuses_and_writes_nothing(
    trained: tuple[FmnistCNN, ImageDataset], exported: ClassifierExport, tmp_path: Path
) -> None:
    model, test = trained
    branchy = BranchyCNN()
    branchy.load_state_dict(model.state_dict())
    images = to_model_input(test.images)
    with (
        pytest.warns(torch.jit.TracerWarning),  # torch says the trace may not generalize ...
        pytest.raises(ExportError, match=r"refused.*0\.00% of 200 images"),  # ... and it doesn't
    ):
        export_classifier(branchy, tmp_path / "new", images=images)
    assert not (tmp_path / "new").exists()
    # over an earlier export: it stays as it was
    old = shutil.copytree(exported.out_dir, tmp_path / "old")
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    with pytest.warns(torch.jit.TracerWarning), pytest.raises(ExportError, match="refused"):
        export_classifier(branchy, old, images=images)
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    assert branchy.training  # the mode it came in with


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tolerance": -1.0}, "tolerance"),
        ({"tolerance": float("nan")}, "tolerance"),
        ({"opset": 16}, "opset must be >= 17"),
        ({"images": torch.zeros(3, 1, 28, 28)}, r"\(N, 1, 32, 32\)"),
        ({"labels": torch.zeros(2, dtype=torch.long)}, "labels for 4 images"),
        ({"origin": {"device": object()}}, "origin must be JSON"),
        ({"model": nn.Linear(2, 2)}, "not a classifier"),
    ],
)
def test_bad_export_arguments(kwargs: dict[str, Any], message: str, tmp_path: Path) -> None:
    args = {"model": build_classifier("fmnist-cnn"), "images": torch.zeros(4, 1, 32, 32), **kwargs}
    with pytest.raises(ExportError, match=message):
        export_classifier(args.pop("model"), tmp_path / "x", **args)
    assert not (tmp_path / "x").exists()


def test_folder_reader_decodes_like_training(tmp_path: Path) -> None:
    """Odd files (RGB, not square, 16-bit, JPEG, nested) give training's pixels."""
    rng = np.random.default_rng(0)
    (tmp_path / "coat" / "deep").mkdir(parents=True)
    (tmp_path / "3").mkdir()
    Image.fromarray(rng.integers(0, 256, (50, 40, 3), dtype=np.uint8)).save(tmp_path / "3/a.png")
    Image.fromarray(rng.integers(0, 65535, (30, 30), dtype=np.uint16)).save(tmp_path / "coat/b.png")
    Image.fromarray(rng.integers(0, 256, (64, 64), dtype=np.uint8)).save(tmp_path / "coat/c.jpg")
    Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(
        tmp_path / "coat/deep/d.png"
    )
    (tmp_path / "3" / "broken.png").write_bytes(b"not an image")
    mine = read_image_folder(tmp_path)
    want = load_image_folder(tmp_path, progress=False)
    assert np.array_equal(mine.images, want.images)
    assert mine.labels is not None and np.array_equal(mine.labels, want.labels)
    assert mine.files == ["3/a.png", "coat/b.png", "coat/c.jpg", "coat/deep/d.png"]
    assert len(mine.skipped) == 1 and "broken.png" in mine.skipped[0]


def test_classify_cli_on_an_image_folder(
    exported: ClassifierExport, trained: tuple[FmnistCNN, ImageDataset], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    model, test = trained
    data = test.subset(np.arange(120))
    write_image_folder(data, tmp_path / "imgs", [f"{i:04d}" for i in range(len(data))])
    out = tmp_path / "r.json"
    rc = main(["classify", str(exported.out_dir), "--images", str(tmp_path / "imgs"),
               "--provider", "cpu", "--json", str(out)])  # fmt: skip
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["images"] == 120 and r["labelled"] and r["signed"] is False
    assert r["accuracy"] == torch_accuracy(model, data)
    want = predict(model, to_model_input(data.images)).numpy()
    assert r["predictions"] == want.tolist()
    assert [c["predicted"] for c in r["per_class"]] == np.bincount(want, minlength=10).tolist()
    assert [c["images"] for c in r["per_class"]] == np.bincount(data.labels, minlength=10).tolist()
    assert [f.split("/")[-1] for f in r["source"]["files"]] == [f"{i:04d}.png" for i in range(120)]
    text = capsys.readouterr().out
    assert f"accuracy: {r['accuracy']:.4f} ({r['correct']}/120)" in text
    assert "images/s" in text and "CPUExecutionProvider" in text and "unsigned" in text
    assert "device dev003" in text and "Ankle boot" in text


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def test_classify_cli_on_an_idx_test_split(
    exported: ClassifierExport, trained: tuple[FmnistCNN, ImageDataset], tmp_path: Path
) -> None:
    """A tiny split in Fashion-MNIST's own file format (all four files, so the training
    loader reads the same split to compare with)."""
    model, test = trained
    for prefix in ("t10k", "train"):
        _write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", test.images)
        _write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", test.labels)
    images, labels = read_fashion_mnist_test(tmp_path)
    ref = load_fashion_mnist("test", tmp_path)
    assert np.array_equal(images, ref.images) and np.array_equal(labels, ref.labels)
    out = tmp_path / "r.json"
    rc = main(["classify", str(exported.out_dir), "--fashion-mnist-test", str(tmp_path),
               "--limit", "150", "--provider", "cpu", "--json", str(out)])  # fmt: skip
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["images"] == 150 and r["source"]["kind"] == "fashion-mnist-test"
    assert r["accuracy"] == torch_accuracy(model, ref.subset(np.arange(150)))


def test_classify_cli_flat_folder_and_bad_input(
    exported: ClassifierExport, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flat = tmp_path / "flat"
    flat.mkdir()
    data = synthetic_dataset(7, seed=9)
    for i, image in enumerate(data.images):
        Image.fromarray(image).save(flat / f"{i}.png")
    rc = main(["classify", str(exported.out_dir), "--images", str(flat), "--json", "-"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0 and r["images"] == 7 and not r["labelled"] and r["accuracy"] is None
    assert sum(c["predicted"] for c in r["per_class"]) == 7

    for argv in (
        ["classify", str(exported.out_dir), "--images", str(tmp_path / "missing")],
        ["classify", str(tmp_path), "--images", str(flat)],  # no card.json
        ["classify", str(exported.out_dir), "--images", str(flat), "--limit", "-1"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("estuary: error: ") and "\n" not in err


def test_classify_path_imports_no_torch(
    exported: ClassifierExport, trained: tuple[FmnistCNN, ImageDataset], tmp_path: Path
) -> None:
    """`estuary classify` and OnnxClassifier in a fresh process never import torch."""
    model, test = trained
    write_image_folder(test, tmp_path / "imgs", [f"{i:04d}" for i in range(len(test))])
    out = tmp_path / "r.json"
    code = f"""
import sys
import numpy as np
from estuary.cli import main
from shared.deploy.onnx_classifier import OnnxClassifier, read_image_folder
rc = main(["classify", {str(exported.out_dir)!r}, "--images", {str(tmp_path / "imgs")!r},
           "--provider", "cpu", "--json", {str(out)!r}])
assert rc == 0, rc
folder = read_image_folder({str(tmp_path / "imgs")!r})
clf = OnnxClassifier({str(exported.out_dir)!r}, provider="cpu")
acc = clf.accuracy(folder.images, folder.labels)
assert "torch" not in sys.modules, "torch was imported"
print("ok", acc)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr
    acc = float(proc.stdout.split("ok")[-1])
    assert acc == json.loads(out.read_text())["accuracy"] == torch_accuracy(model, test)


@needs_fmnist
def test_classify_cli_finds_the_installed_fashion_mnist(
    exported: ClassifierExport, trained: tuple[FmnistCNN, ImageDataset], tmp_path: Path
) -> None:
    """Without a PATH, the test split is looked up where training looks for it."""
    model, _ = trained
    out = tmp_path / "r.json"
    argv = ["classify", str(exported.out_dir), "--fashion-mnist-test", "--limit", "1000"]
    assert main([*argv, "--provider", "cpu", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    ref = load_fashion_mnist("test").subset(np.arange(1000))
    assert r["images"] == 1000 and r["accuracy"] == torch_accuracy(model, ref)
