"""``model.init``: where the first global model comes from (random, the shipped pretrained
generator, or a file), and how a bad file is refused."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from estuary.simulate import simulate
from shared.config import config_from_dict
from shared.errors import ConfigError
from shared.evaluation.evaluator import Evaluator
from shared.models import init as model_init
from shared.models.checkpoint import latest_checkpoint_path, load_checkpoint, save_checkpoint
from shared.models.init import initial_model, load_init_state, pretrained_path
from shared.models.presets import build_unet
from shared.runtime.process import EXIT_ERROR
from shared.wire.codec import decode_tensors, encode_tensors, read_metadata, write_asset
from tests.conftest import needs_fmnist, tiny_config


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def test_config_accepts_the_three_forms_and_nothing_else() -> None:
    for init in ("random", "pretrained", "runs/x/checkpoints/round_000003.safetensors"):
        assert config_from_dict({"model": {"init": init}}).model.init == init
    for bad in ("", "pretrianed", "weights.pt", "model.pkl"):
        with pytest.raises(ConfigError, match=r"model\.init"):
            config_from_dict({"model": {"init": bad}})
    assert config_from_dict({}).model.init == "random"


def test_random_init_is_the_seeded_preset() -> None:
    assert load_init_state("fmnist-tiny", "random") is None
    assert _same(
        initial_model("fmnist-tiny", "random", seed=4).state_dict(),
        build_unet("fmnist-tiny", seed=4).state_dict(),
    )


def test_bare_state_dict_and_dense_checkpoint_both_load(tmp_path: Path) -> None:
    source = build_unet("fmnist-tiny", seed=7).state_dict()
    bare = _save(tmp_path / "bare.safetensors", source)
    assert _same(initial_model("fmnist-tiny", str(bare), seed=0).state_dict(), source)

    cfg = tiny_config()
    ckpt = save_checkpoint(tmp_path / "ck", 3, dict(source), cfg, algo_state={"c": torch.ones(2)})
    assert _same(initial_model("fmnist-tiny", str(ckpt), seed=0).state_dict(), source)


def test_unusable_files_are_refused_with_the_reason(tmp_path: Path) -> None:
    source = build_unet("fmnist-tiny", seed=7).state_dict()
    cases: dict[str, tuple[Path, str]] = {}
    cases["missing"] = (tmp_path / "nope.safetensors", "cannot read")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 40)
    cases["junk"] = (junk, "does not hold a fmnist-tiny model")
    other = _save(tmp_path / "small.safetensors", build_unet("fmnist-small").state_dict())
    cases["other preset"] = (other, "does not hold a fmnist-tiny model")
    short = dict(source)
    short.pop(next(iter(short)))
    cases["tensor missing"] = (_save(tmp_path / "short.safetensors", short), "missing")
    nan = {k: v.clone() for k, v in source.items()}
    nan["conv_in.weight"][0, 0, 0, 0] = float("nan")
    cases["NaN"] = (_save(tmp_path / "nan.safetensors", nan), "NaN")
    half = {k: v.half() for k, v in source.items()}
    cases["fp16"] = (_save(tmp_path / "half.safetensors", half), "float16")
    prefixed = {f"model/{k}": v for k, v in source.items()}
    cases["fake checkpoint"] = (_save(tmp_path / "fake.safetensors", prefixed), "metadata")
    ckpt = save_checkpoint(tmp_path / "ck", 1, dict(source), tiny_config())
    tampered = decode_tensors(ckpt.read_bytes())
    tampered["model/conv_in.bias"] = tampered["model/conv_in.bias"] + 1
    edited = tmp_path / "edited.safetensors"
    edited.write_bytes(encode_tensors(tampered, read_metadata(ckpt.read_bytes())))
    cases["edited checkpoint"] = (edited, "model hash differs")
    for label, (path, reason) in cases.items():
        with pytest.raises(ConfigError, match=reason):
            load_init_state("fmnist-tiny", str(path))
        assert label


def test_pruned_checkpoint_is_refused(tmp_path: Path) -> None:
    from shared.methods.fedphd.method import prune_state

    state, plan = prune_state(
        "fmnist-tiny", build_unet("fmnist-tiny").state_dict(), 0.3, method="l2", seed=0
    )
    ckpt = save_checkpoint(tmp_path / "ck", 0, state, tiny_config(), plan=plan)
    with pytest.raises(ConfigError, match="pruned model"):
        load_init_state("fmnist-tiny", str(ckpt))


def test_pretrained_needs_a_shipped_file_with_the_recorded_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match="no pretrained generator ships for preset"):
        load_init_state("ddpm-cifar10", "pretrained")
    copy = tmp_path / model_init.PRETRAINED["fmnist-tiny"][0]
    data = bytearray(pretrained_path("fmnist-tiny").read_bytes())
    data[-1] ^= 1  # one flipped bit in the last weight
    copy.write_bytes(bytes(data))
    monkeypatch.setattr(model_init, "ASSETS", tmp_path)
    with pytest.raises(ConfigError, match="corrupt or from another training run"):
        load_init_state("fmnist-tiny", "pretrained")
    copy.unlink()
    with pytest.raises(ConfigError, match=r"pretrain_generator\.py"):
        load_init_state("fmnist-tiny", "pretrained")


def test_shipped_pretrained_generator_matches_its_sidecar() -> None:
    path = pretrained_path("fmnist-tiny")
    sidecar = json.loads(path.with_suffix(".json").read_text())
    assert sidecar["sha256"] == model_init.PRETRAINED["fmnist-tiny"][1]
    assert sidecar["data"] == "fashion-mnist/test"  # public data no device holds
    state = load_init_state("fmnist-tiny", "pretrained")
    assert state is not None and not _same(state, build_unet("fmnist-tiny").state_dict())


@needs_fmnist
def test_pretrained_generator_samples_far_better_than_random_init() -> None:
    """The point of shipping it: FID of the shipped weights against the train split is a
    fraction of a random init's (same protocol, same noise)."""
    cfg = config_from_dict({"eval": {"num_samples": 100, "num_reference": 1000,
                                     "sample_steps": 10}})  # fmt: skip
    evaluator = Evaluator(cfg)
    fid_random = evaluator.evaluate(initial_model("fmnist-tiny", "random"))["fid"]
    fid_pretrained = evaluator.evaluate(initial_model("fmnist-tiny", "pretrained"))["fid"]
    assert fid_pretrained < 0.5 * fid_random, (fid_pretrained, fid_random)


def test_simulate_starts_from_the_init_file(tmp_path: Path) -> None:
    """With a learning rate of 1e-10 one round moves no weight by more than ~1e-9, so the
    final global model is the init file's (and far from the seeded random init)."""
    source = build_unet("fmnist-tiny", seed=11).state_dict()
    init = _save(tmp_path / "init.safetensors", source)
    cfg = tiny_config(
        model={"preset": "fmnist-tiny", "init": str(init)},
        run={"rounds": 1},
        train={"local_steps": 2, "batch_size": 8, "lr": 1e-10},
    )
    result = simulate(cfg, tmp_path / "run", progress=False)
    final = load_checkpoint(latest_checkpoint_path(result.run_dir / "checkpoints")).model  # type: ignore[arg-type]
    seeded = build_unet("fmnist-tiny", seed=cfg.run.seed).state_dict()
    for name, value in source.items():
        if value.is_floating_point():
            assert torch.allclose(final[name], value, atol=1e-6), name
    assert not all(torch.allclose(final[k], v, atol=1e-3) for k, v in seeded.items())
    bad = tiny_config(model={"preset": "fmnist-tiny", "init": str(tmp_path / "no.safetensors")})
    with pytest.raises(ConfigError, match="cannot read"):
        simulate(bad, tmp_path / "bad", progress=False)


def test_cloud_process_refuses_a_bad_init_before_connecting(tmp_path: Path) -> None:
    """The broker address is a closed port: the refusal must come first, with the reason."""
    config = tmp_path / "run.toml"
    config.write_text(
        '[model]\npreset = "fmnist-tiny"\ninit = "missing.safetensors"\n'
        "[broker]\nconnect_timeout_s = 30\n"
    )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "cloud", str(config), "--out", str(tmp_path / "run"),
         "--broker", "127.0.0.1:9", "--metrics-port", "-1"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == EXIT_ERROR, proc.stdout + proc.stderr
    assert "cannot read missing.safetensors" in proc.stdout + proc.stderr
    assert time.monotonic() - start < 60


def test_write_asset_is_reproducible_and_loads_as_an_init(tmp_path: Path) -> None:
    """What the pretraining script ships: same bytes for the same weights, sidecar hash equal
    to the file's, and a file ``model.init`` accepts."""
    state = build_unet("fmnist-tiny", seed=5).state_dict()
    info = {"preset": "fmnist-tiny", "steps": 1}
    first = write_asset(tmp_path / "a" / "g.safetensors", state, info)
    again = write_asset(tmp_path / "b" / "g.safetensors", dict(reversed(state.items())), info)
    assert first == again == hashlib.sha256((tmp_path / "a/g.safetensors").read_bytes()).hexdigest()
    sidecar = json.loads((tmp_path / "a" / "g.json").read_text())
    assert sidecar == {"sha256": first, **info}
    assert (tmp_path / "a" / "g.safetensors").stat().st_mode & 0o777 == 0o644
    loaded = load_init_state("fmnist-tiny", str(tmp_path / "a" / "g.safetensors"))
    assert loaded is not None and _same(loaded, state)
