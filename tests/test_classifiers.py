"""Classifiers beside the generators (pFedGPA, seed 004): the client CNN's size, cross-entropy
local training, the dominant_groups partition and its per-device test split, accuracy
reporting through the roles, Local-only, FedAvg(-FT) and pFedGPA's private per-device
downlink."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shared.config import RunConfig
from shared.data.partition import dominant_groups, make_partition, split_test
from shared.deploy.classifier_export import preset_of
from shared.diffusion.training import train_classifier
from shared.errors import ConfigError
from shared.evaluation.evaluator import sample_images
from shared.evaluation.recorder import accuracy_figures
from shared.methods.base import build_algorithm
from shared.methods.pfedgpa.method import PFedGPA
from shared.methods.pfedgpa.param_diffusion import LinearParamAutoencoder, MLPDenoiser, invert
from shared.methods.registry import make_algorithm
from shared.models.classifier import accuracy, build_classifier
from shared.models.presets import kind_of, model_info, state_spec
from shared.transport.bus import MemoryBus
from shared.wire.messages import PersonalModel, Topics, decode
from tests.conftest import have_fmnist, synthetic_federation, tiny_config

REPO = Path(__file__).resolve().parents[1]


def classifier_config(
    algorithm: str, *, extra_algorithm: dict[str, Any] | None = None, **extra: Any
) -> RunConfig:
    """3 rounds of 4 devices at 2 edges training the client CNN with SGD on synthetic data
    split by dominant groups (test splits from the synthetic test set)."""
    sections: dict[str, dict[str, Any]] = {
        "run": {"rounds": 3},
        "federation": {"num_devices": 4, "num_edges": 2},
        "data": {
            "synthetic_size": 2000, "partition": "dominant_groups",
            "samples_per_device": 100, "test_samples_per_device": 60,
        },
        "model": {"preset": "fmnist-cnn"},
        "train": {
            "optimizer": "sgd", "lr": 0.05, "momentum": 0.5, "weight_decay": 5e-4,
            "batch_size": 50, "local_epochs": 2, "local_steps": 0, "grad_clip": 0.0,
        },
        "algorithm": {"name": algorithm, **(extra_algorithm or {})},
    }  # fmt: skip
    for section, values in extra.items():
        sections.setdefault(section, {}).update(values)
    return tiny_config(**sections)


def run_federation(cfg: RunConfig) -> tuple[Any, MemoryBus, list[Any]]:
    """The federation of ``cfg`` with each device's test split, run to the end."""
    from estuary.simulate import build_federation
    from shared.data.datasets import load_dataset

    data = load_dataset("synthetic", size=cfg.data.synthetic_size, seed=cfg.run.seed)
    parts = make_partition(data.labels, cfg.federation.num_devices, cfg.data, cfg.run.seed)
    test = split_test(cfg)
    bus = MemoryBus()
    summaries: list[Any] = []
    fed = build_federation(cfg, bus, data, parts, on_round_end=summaries.append, test=test)
    fed.start()
    bus.run(lambda: fed.cloud.done)
    assert fed.cloud.done
    return fed, bus, summaries


def test_the_client_cnn_has_fedpacs_size() -> None:
    model = build_classifier("fmnist-cnn")
    assert sum(p.numel() for p in model.parameters()) == 117_066
    assert kind_of("fmnist-cnn") == "classifier"
    assert list(state_spec("fmnist-cnn")) == list(model.state_dict())
    logits = model(torch.zeros(3, 1, 32, 32))  # padded images; the CNN crops to 28x28
    assert logits.shape == (3, 10)
    info = model_info("fmnist-cnn")
    # conv1 16x24x24x25 + conv2 32x10x10x400 + fc1 800x128 + fc2 128x10
    assert info.params == 117_066
    assert info.weight_macs == 16 * 24 * 24 * 25 + 32 * 10 * 10 * 400 + 800 * 128 + 128 * 10


def test_the_small_cnn_is_fedpacs_narrowed_to_11930_parameters() -> None:
    model = build_classifier("fmnist-cnn-small")
    sizes = {k: v.numel() for k, v in model.state_dict().items()}
    # conv 1->6 k5, conv 6->12 k5 pad 1, fc 300->32, fc 32->10
    assert sizes == {"conv1.weight": 150, "conv1.bias": 6, "conv2.weight": 1800,
                     "conv2.bias": 12, "fc1.weight": 9600, "fc1.bias": 32,
                     "fc2.weight": 320, "fc2.bias": 10}  # fmt: skip
    assert sum(sizes.values()) == 11_930 and kind_of("fmnist-cnn-small") == "classifier"
    assert list(state_spec("fmnist-cnn-small")) == list(model.state_dict())
    assert model(torch.zeros(3, 1, 32, 32)).shape == (3, 10)
    # the export path tells the two presets apart by their widths
    assert preset_of(model) == "fmnist-cnn-small"
    assert preset_of(build_classifier("fmnist-cnn")) == "fmnist-cnn"


def test_cross_entropy_training_learns_and_is_seeded() -> None:
    cfg = classifier_config("fedavg")
    gen = torch.Generator().manual_seed(0)
    y = torch.arange(200) % 4
    x = 0.3 * torch.randn(200, 1, 32, 32, generator=gen) - 1
    for i, c in enumerate(y.tolist()):  # a bright square in the quadrant of the class
        r, q = 4 + 12 * (c // 2), 4 + 12 * (c % 2)
        x[i, 0, r : r + 10, q : q + 10] += 2
    runs = []
    for _ in range(2):
        model = build_classifier("fmnist-cnn", seed=1)
        first = accuracy(model, x, y)
        loss, steps, _ = train_classifier(
            model, x, y, cfg.train.model_copy(update={"local_epochs": 10}),
            torch.Generator().manual_seed(3),
        )  # fmt: skip
        runs.append((loss, steps, accuracy(model, x, y), first))
    assert runs[0] == runs[1]  # same generator, same result
    loss, steps, acc, first = runs[0]
    assert steps == 10 * 4  # ceil(200 / 50) batches per epoch
    assert acc > max(first, 0.8)


def test_dominant_groups_follow_the_papers_rule() -> None:
    labels = np.repeat(np.arange(10), 2000)
    groups = [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 8], [8, 9, 0]]
    rng = np.random.default_rng(0)
    parts = dominant_groups(labels, 20, groups, 0.2, 600, rng)
    seen = np.concatenate(parts)
    assert len(seen) == len(np.unique(seen)) == 20 * 600  # disjoint, 600 each
    for d, p in enumerate(parts):
        counts = np.bincount(labels[p], minlength=10)
        dominant = groups[d % 5]
        assert all(counts[c] == 12 for c in range(10) if c not in dominant)  # 120 / 10
        assert sorted(counts[dominant]) == [172, 172, 172]  # 12 + 480 / 3 (160)
    tests = dominant_groups(labels[::10], 20, groups, 0.2, 150, rng, disjoint=False)
    assert all(len(t) == len(np.unique(t)) == 150 for t in tests)  # shared across devices
    with pytest.raises(ConfigError, match="has 2000 samples, too few for 20 devices"):
        dominant_groups(labels, 20, groups, 0.2, 2000, rng)


def test_each_device_gets_a_test_split_by_the_same_rule() -> None:
    cfg = classifier_config("fedavg")
    test = split_test(cfg)
    assert test is not None
    data, parts = test
    assert [len(p) for p in parts] == [60] * 4
    for d, p in enumerate(parts):
        top = np.argsort(np.bincount(data.labels[p], minlength=10))[-3:]
        assert set(top.tolist()) == set(cfg.data.dominant_groups[d % 5])


def test_generator_paths_refuse_a_classifier() -> None:
    cfg = classifier_config("fedavg")
    with pytest.raises(ConfigError, match="sampling is for generators"):
        sample_images(cfg, build_classifier("fmnist-cnn"), 2, steps=1)
    with pytest.raises(ConfigError, match="trains U-Nets and one-shot generators"):
        classifier_config("fedprox")
    with pytest.raises(ConfigError, match="trains classifiers"):
        tiny_config(algorithm={"name": "pfedgpa"})


def test_fedavg_devices_report_accuracy_before_and_after_fine_tuning() -> None:
    _, _, summaries = run_federation(classifier_config("fedavg", eval={"every": 1}))
    assert [len(s.accuracy) for s in summaries] == [4, 4, 4]
    first, last = summaries[0].accuracy, summaries[-1].accuracy
    assert all(0.0 <= a <= 1.0 for _, a in last.values())
    assert all(b is not None for b, _ in last.values())
    mean_after = np.mean([a for _, a in last.values()])
    assert mean_after > np.mean([a for _, a in first.values()]) - 0.05
    assert mean_after > 0.3  # well above chance on the synthetic shapes
    figures = accuracy_figures(last)
    assert figures["devices"] == 4 and 0 <= figures["after_under_60"] <= 4


def test_local_only_uploads_nothing_and_downloads_once() -> None:
    fed, bus, summaries = run_federation(classifier_config("local"))
    received = bus.traffic.snapshot()["bytes"]
    assert not any(k.startswith("received:device_update") for k in received)
    # each device fetched the initial model once (round 0), never again
    per_device_model = received["received:edge_model"] / 4
    assert per_device_model == pytest.approx(fed.cloud.model_params() * 4, rel=0.01)
    assert len(summaries[-1].accuracy) == 4
    assert all(d.algo_state.get("local.model") is not None for d in fed.devices)


def test_pfedgpa_sends_each_device_only_its_own_parameters() -> None:
    cfg = classifier_config(
        "pfedgpa", extra_algorithm={
            "pfedgpa_store_rounds": 2, "pfedgpa_ae_steps": 20,
            "pfedgpa_dm_steps": 20, "pfedgpa_timesteps": 20, "pfedgpa_denoiser_width": 8,
            "pfedgpa_batch": 8, "pfedgpa_invert_from": 4,
        },
    )  # fmt: skip
    from estuary.simulate import build_federation
    from shared.data.datasets import load_dataset

    data = load_dataset("synthetic", size=cfg.data.synthetic_size, seed=cfg.run.seed)
    parts = make_partition(data.labels, 4, cfg.data, cfg.run.seed)
    bus = MemoryBus()
    downlink: list[tuple[str, PersonalModel]] = []
    topics = Topics(cfg.run.name)
    bus.endpoint("probe").subscribe(
        f"{topics.base}/device/+/down", lambda t, p: downlink.append((t, decode(p)))
    )
    summaries: list[Any] = []
    fed = build_federation(cfg, bus, data, parts, on_round_end=summaries.append,
                           test=split_test(cfg))  # fmt: skip
    fed.start()
    bus.run(lambda: fed.cloud.done)
    # the diffusion round is the one before the last: one personal model per device
    assert sorted(m.device for _, m in downlink) == sorted(d.name for d in fed.devices)
    for topic, msg in downlink:
        assert topic == topics.device_down(msg.device) and msg.round == 2
        assert msg.mode == "inversion"
    algo = fed.cloud.algorithm
    assert isinstance(algo, PFedGPA)
    assert algo.dm_round == 1 and len(algo.store) == 2 * 4  # 2 rounds kept of 4 devices
    # each device trained its own parameters in the last round: fc2 generated, the rest its own
    assert all(not d.personal for d in fed.devices)  # consumed
    assert len(summaries[-1].accuracy) == 4


def test_a_personal_model_for_another_device_is_refused() -> None:
    cfg = classifier_config("pfedgpa")
    fed, _, _ = synthetic_federation(cfg)
    device = fed.devices[0]
    fed.start()
    msg = PersonalModel.model_validate({
        "round": 1, "session": "0" * 16, "device": fed.devices[1].name, "mode": "inversion",
        "model_ref": {"sha256": "0" * 64, "size": 1, "kind": "personal_model"},
    })  # fmt: skip
    device.on_personal(msg)
    assert not device.personal
    traffic = make_algorithm(cfg).traffic
    assert traffic.cloud_sees == "every_upload" and traffic.downlink == "per_device"


def test_pfedgpa_keeps_its_store_across_a_restart_and_guides_newcomers(tmp_path: Any) -> None:
    cfg = classifier_config(
        "pfedgpa", run={"rounds": 10}, extra_algorithm={
            "pfedgpa_store_rounds": 2, "pfedgpa_ae_steps": 10, "pfedgpa_dm_steps": 10,
            "pfedgpa_timesteps": 20, "pfedgpa_invert_from": 4, "pfedgpa_denoiser_width": 8,
            "pfedgpa_batch": 8, "pfedgpa_dm_every": 3, "pfedgpa_guide_rounds": 2,
            "pfedgpa_guide_steps": 2,
            "pfedgpa_guide_from": 10,
        },
    )  # fmt: skip
    algo = make_algorithm(cfg)
    assert isinstance(algo, PFedGPA)

    def uploads(devices: list[str], salt: int) -> dict[str, Any]:
        return {
            d: build_classifier("fmnist-cnn", seed=100 * salt + i).state_dict()
            for i, d in enumerate(devices)
        }

    assert algo.personalize(0, uploads(["dev000", "dev001"], 0), {}) is None
    assert algo.personalize(1, uploads(["dev000", "dev001"], 9), {}) is None
    made = algo.personalize(2, uploads(["dev000", "dev001"], 1), {})  # a diffusion round
    assert made is not None and sorted(made) == ["dev000", "dev001"]
    assert {algo.mode_of(d) for d in made} == {"inversion"}
    assert len(algo.store) == 4 and algo.dm is not None
    # only the generated layer differs from the device's own upload
    own = uploads(["dev000"], 1)["dev000"]
    assert torch.equal(made["dev000"]["conv1.weight"], own["conv1.weight"])
    assert not torch.equal(made["dev000"]["fc2.weight"], own["fc2.weight"])

    algo.save_cloud_state(tmp_path, 2)
    restored = make_algorithm(cfg)
    assert isinstance(restored, PFedGPA)
    restored.load_cloud_state(tmp_path, 2)
    assert list(restored.store) == list(algo.store)
    assert all(torch.equal(restored.store[k], v) for k, v in algo.store.items())
    assert restored.dm is not None and restored.first_seen == algo.first_seen

    # a device that joins after the diffusion model exists is guided in its second round
    assert restored.personalize(3, uploads(["dev000", "dev001", "dev009"], 2), {}) is None
    guided = restored.personalize(4, uploads(["dev000", "dev001", "dev009"], 3), {})
    assert guided is not None and list(guided) == ["dev009"]
    assert restored.mode_of("dev009") == "guidance"
    assert torch.isfinite(guided["dev009"]["fc2.weight"]).all()


@pytest.mark.skipif(not have_fmnist(), reason="Fashion-MNIST missing")
def test_the_quick_pfedgpa_comparison_reports_accuracies_and_bytes(tmp_path: Any) -> None:
    from estuary.compare import load_compare, run_compare
    from estuary.compare.tables import CLASSIFIER_COLUMNS

    spec = load_compare(REPO / "configs" / "compare" / "compare_pfedgpa_quick.toml")
    run_compare(spec, tmp_path, progress=False)
    table = json.loads((tmp_path / "table.json").read_text())
    rows = {r["method"]: r for r in table["rows"]}
    assert list(rows) == ["Local-only", "FedAvg", "pFedGPA", "pFedGPA, direct"]
    assert set(table["columns"]) == {k for k, _, _ in CLASSIFIER_COLUMNS}
    for r in rows.values():
        assert 0 <= r["acc_after"] <= 100 and 0 <= r["acc_before"] <= 100
        assert r["under60_before"] <= 5 and r["acc_std"] >= 0
    assert rows["Local-only"]["device_up_bytes"] == 0  # nothing travels up
    assert rows["FedAvg"]["device_up_bytes"] == pytest.approx(468_856, rel=0.01)
    assert rows["pFedGPA"]["device_down_bytes"] == pytest.approx(468_856, rel=0.01)
    # pFedGPA and its ablation differ only in the last round's parameters
    assert rows["pFedGPA"]["acc_before"] != rows["pFedGPA, direct"]["acc_before"]
    assert (tmp_path / "accuracy.png").is_file() and (tmp_path / "table.md").is_file()


def _personalized(inversion: str) -> tuple[PFedGPA, dict[str, Any], dict[str, Any]]:
    """A pFedGPA cloud with a linear autoencoder and an MLP denoiser, run over two rounds of
    four devices' uploads (the second is the diffusion round); its personal models."""
    cfg = classifier_config("pfedgpa", extra_algorithm={"pfedgpa": {
        "store_rounds": 2, "ae_steps": 5, "dm_steps": 5, "timesteps": 20, "invert_from": 20,
        "inversion": inversion, "ae_size": "linear", "denoiser": "mlp", "denoiser_width": 8,
        "batch": 8, "layers": ["fc2"],
    }})  # fmt: skip
    algo = build_algorithm(cfg)
    assert isinstance(algo, PFedGPA)
    base = build_classifier(cfg.model.preset).state_dict()
    gen = torch.Generator().manual_seed(0)
    uploads = {
        f"dev{i:03d}": {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
        for i in range(4)
    }
    assert algo.personalize(0, uploads, base) is None  # not a diffusion round
    made = algo.personalize(1, uploads, base)
    assert made is not None and algo.dm is not None
    return algo, uploads, dict(made)


def test_pfedgpa_inverts_with_the_configured_noise_depth_and_networks() -> None:
    algo, uploads, made = _personalized("posterior")
    dm = algo.dm
    assert dm is not None
    assert isinstance(dm.autoencoder, LinearParamAutoencoder)
    assert isinstance(dm.denoiser, MLPDenoiser)
    devices = sorted(uploads)
    own = torch.stack([torch.cat([uploads[d][n].reshape(-1) for n in algo.names])
                       for d in devices])  # fmt: skip
    recon = invert(dm, own, torch.Generator().manual_seed(0), t0=0)
    for d, r in zip(devices, recon, strict=True):
        # the layers not generated are the device's own; the generated ones, inverted with
        # the posterior noise from the whole chain, are the autoencoder's reconstruction
        assert torch.equal(made[d]["conv1.weight"], uploads[d]["conv1.weight"])
        got = torch.cat([made[d][n].reshape(-1) for n in algo.names])
        torch.testing.assert_close(got, r, rtol=1e-4, atol=1e-4)
    # eq. 15's own noises do not retrace the chain: the same run ends elsewhere
    _, _, chain = _personalized("chain")
    got = torch.cat([chain[devices[0]][n].reshape(-1) for n in algo.names])
    assert (got - recon[0]).abs().max() > 1e-2
