"""FedDEO's generator that knows domains: the class + domain conditioning, the stochastic
sampler with per-image seeds, the description rate each device chooses on held-out images,
the Oracle's prompts and the guidance controls of one run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.config import RunConfig, config_from_dict
from shared.data.domains import DOMAINS
from shared.diffusion.schedule import make_train_scheduler
from shared.errors import ConfigError
from shared.methods.feddeo.config import FedDEOConfig
from shared.methods.feddeo.descriptions import train_descriptions
from shared.methods.feddeo.guidance import (
    class_table,
    domain_grid,
    domain_table,
    eps_with_embedding,
    guided_ddim,
    null_row,
)
from shared.methods.feddeo.method import image_seed, start_noise
from shared.models.domain_axis import CLASS_ROWS, ClassDomainEmbedding, encode
from shared.models.plan import preset_of
from shared.models.presets import build_unet, null_class, num_classes_of, state_spec


def dom_config(**sections: dict[str, Any]) -> RunConfig:
    """A tiny FedDEO run on the generator with a domain axis (random weights); ``algorithm``
    updates ``[algorithm.feddeo]``."""
    base: dict[str, dict[str, Any]] = {
        "run": {"name": "feddeo-dom-test", "seed": 0, "rounds": 1},
        "federation": {"num_devices": 2, "num_edges": 1, "round_deadline_s": 120},
        "data": {"dataset": "synthetic", "synthetic_size": 80, "partition": "iid",
                 "domains": ["identity", "invert"]},
        "model": {"preset": "fmnist-tiny-dom"},
        "train": {"batch_size": 8},
        "algorithm": {"name": "feddeo", "feddeo": {
            "images_per_class": 2, "sample_steps": 2, "sample_eta": 1.0, "desc_epochs": 0.5,
            "desc_batch": 8, "clf_epochs": 1, "grid_per_class": 1,
        }},
        "eval": {"every": 0, "sample_every": 0, "checkpoint_every": 1},
    }  # fmt: skip
    for section, values in sections.items():
        own = section == "algorithm"
        (base["algorithm"]["feddeo"] if own else base.setdefault(section, {})).update(values)
    return config_from_dict(base)


@pytest.fixture(scope="module")
def unet() -> torch.nn.Module:
    model = build_unet("fmnist-tiny-dom", seed=0).eval()
    emb = model.class_embedding
    assert isinstance(emb, ClassDomainEmbedding)
    return model


def test_the_domain_preset_adds_a_domain_table_to_the_guidance_classes(
    unet: torch.nn.Module,
) -> None:
    spec = state_spec("fmnist-tiny-dom")
    assert spec["class_embedding.weight"].shape == (CLASS_ROWS, 64)
    assert spec["class_embedding.domain_weight"].shape == (1 + len(DOMAINS), 64)
    assert set(unet.state_dict()) == set(spec)
    assert null_class(unet) == 10 and num_classes_of(unet) == 10
    assert preset_of(unet) == "fmnist-tiny-dom"
    assert preset_of(build_unet("fmnist-tiny-cfg")) == "fmnist-tiny-cfg"


def test_a_label_conditions_on_its_class_row_plus_its_domain_row(unet: torch.nn.Module) -> None:
    emb = unet.class_embedding
    assert isinstance(emb, ClassDomainEmbedding)
    x = torch.randn(4, 1, 32, 32, generator=torch.Generator().manual_seed(2))
    classes, rows = torch.tensor([0, 4, 10, 7]), torch.tensor([0, 3, 6, 1])
    with torch.no_grad():
        by_label = unet(x, 300, class_labels=encode(classes, rows)).sample
        vectors = emb.weight[classes] + emb.domain_weight[rows]
        by_vector = eps_with_embedding(unet, x, 300, vectors)
        plain = unet(x, 300, class_labels=classes).sample  # labels < 11: domain unspecified
    torch.testing.assert_close(by_vector, by_label)
    torch.testing.assert_close(plain[0], by_label[0])
    # the class prompts (and the null) are the rows with the domain unspecified
    torch.testing.assert_close(class_table(unet), emb.weight + emb.domain_weight[0])
    torch.testing.assert_close(null_row(unet), class_table(unet)[10])
    invert = 1 + DOMAINS.index("invert")
    torch.testing.assert_close(domain_table(unet, "invert"), emb.weight + emb.domain_weight[invert])
    with pytest.raises(ConfigError):
        domain_table(build_unet("fmnist-tiny-cfg"), "invert")


def test_stochastic_sampling_depends_on_each_image_s_own_seed(unet: torch.nn.Module) -> None:
    cfg = dom_config()
    seeds = [image_seed(0, 1, 3, i) for i in range(3)]
    cond = class_table(unet)[[3, 3, 3]]

    def draw(n: int, eta: float) -> torch.Tensor:
        return guided_ddim(unet, start_noise(seeds[:n], (1, 32, 32)), [cond[:n]], [3.0],
                           cfg.diffusion, steps=3, eta=eta, seeds=seeds[:n])  # fmt: skip

    big, small = draw(3, 1.0), draw(2, 1.0)
    torch.testing.assert_close(big[:2], small, atol=1e-5, rtol=0)
    assert not torch.allclose(big, draw(3, 0.0))  # fresh noise at each step changes them
    with pytest.raises(ValueError, match="one seed per image"):
        guided_ddim(unet, start_noise(seeds, (1, 32, 32)), [cond], [3.0], cfg.diffusion,
                    steps=2, eta=1.0)  # fmt: skip


def test_a_device_keeps_the_rate_with_the_lowest_held_out_loss(unet: torch.nn.Module) -> None:
    images = torch.rand(40, 1, 32, 32, generator=torch.Generator().manual_seed(3)) * 2 - 1
    labels = torch.arange(40) % 2
    sched = make_train_scheduler(dom_config().diffusion)
    s = FedDEOConfig(desc_epochs=1.0, desc_batch=8,
                     desc_lrs=[1e-4, 0.05, 5.0], desc_holdout=0.25)  # fmt: skip
    report: dict[str, Any] = {}
    desc, mask, result = train_descriptions(
        unet, images, labels, s, sched, torch.Generator().manual_seed(0), report=report
    )
    losses = report["heldout_loss"]
    assert set(losses) == {"0.0001", "0.05", "5"}
    assert report["lr"] == min(s.desc_lrs, key=lambda lr: losses[f"{lr:g}"])
    assert mask.tolist()[:2] == [1, 1] and result.steps == 4  # 30 training images, batch 8
    # the kept descriptions are those the chosen rate trains (same batches, same noise)
    again = FedDEOConfig(desc_epochs=1.0, desc_batch=8,
                         desc_lrs=[report["lr"]], desc_holdout=0.25)  # fmt: skip
    alone, _, _ = train_descriptions(unet, images, labels, again, sched,
                                     torch.Generator().manual_seed(0))  # fmt: skip
    torch.testing.assert_close(desc, alone)


def test_the_domain_grid_has_a_row_per_domain(unet: torch.nn.Module) -> None:
    images = domain_grid(unet, dom_config().diffusion, per_class=1, steps=2)
    assert images.shape == ((1 + len(DOMAINS)) * 10, 1, 32, 32)
    assert images.abs().max() <= 1.0


def test_config_refuses_an_oracle_without_a_domain_axis_and_bad_controls() -> None:
    with pytest.raises(ConfigError, match="domain axis"):
        dom_config(model={"preset": "fmnist-tiny-cfg"},
                   algorithm={"prompt_domain": "device"})  # fmt: skip
    with pytest.raises(ConfigError, match="w_d > 0"):
        dom_config(algorithm={"use_descriptions": False,
                              "eval_guidance": [[6.0, 3.0]]})  # fmt: skip


def test_one_run_scores_its_guidance_controls_and_the_oracle_its_domains(tmp_path: Path) -> None:
    from estuary.simulate import simulate

    cfg = dom_config(algorithm={"eval_guidance": [[0.0, 3.0]],
                                "desc_lrs": [0.01, 0.1]})  # fmt: skip
    result = simulate(cfg, tmp_path / "run", progress=False, evaluate=False)
    final = json.loads((result.run_dir / "summary.json").read_text())["final"]
    assert set(final["accuracy_by_guidance"]) == {"wt0_wd3"}
    assert set(final["accuracy_by_guidance"]["wt0_wd3"]) == {"identity", "invert", "mean"}
    assert final["sample_eta"] == 1.0
    assert len(list((result.run_dir / "synthetic_wt0_wd3").glob("dev*.png"))) == 2

    oracle = dom_config(algorithm={"use_descriptions": False,
                                   "prompt_domain": "device"})  # fmt: skip
    result = simulate(oracle, tmp_path / "oracle", progress=False, evaluate=False)
    final = json.loads((result.run_dir / "summary.json").read_text())["final"]
    assert final["prompt_domain"] == "device" and final["use_descriptions"] is False


def test_the_shipped_domain_comparisons_separate_the_mechanisms() -> None:
    """compare_feddeo_dom_cpu.toml: FedDEO with its descriptions-only control, Prompts-Only
    at w_t 3 and 6, the Oracle, the FedAvg classifier and the Ceiling, every generating row
    on the generator with a domain axis with the same sampler, N and seeds."""
    import tomllib

    from estuary.compare.spec import parse_compare
    from shared.config.legacy import flat_keys_of

    repo = Path(__file__).resolve().parents[1]
    for name in ("compare_feddeo_dom_cpu.toml", "compare_feddeo_dom_labelskew_cpu.toml",
                 "compare_feddeo_dom_ablation_cpu.toml"):  # fmt: skip
        path = repo / "configs" / "compare" / name
        data = tomllib.loads(path.read_text())
        assert flat_keys_of(data["base"]["algorithm"]) == []  # format 2: [algorithm.feddeo]
        spec = parse_compare(data, path)
        methods = {m.label: m.cfg for m in spec.methods}
        generating = {
            k: FedDEOConfig.of(c) for k, c in methods.items() if c.algorithm.name == "feddeo"
        }
        for label, s in generating.items():
            cfg = methods[label]
            assert cfg.model.preset == "fmnist-tiny-dom" and cfg.model.init == "pretrained"
            assert (s.sample_eta, s.w_t, s.desc_lrs) == (
                1.0,
                3.0,
                [0.02, 0.05, 0.2],
            )
        if name != "compare_feddeo_dom_cpu.toml":
            continue
        assert list(methods) == ["FedDEO", "Prompts-Only", "Oracle", "FedAvg classifier", "Ceiling"]
        assert generating["FedDEO"].eval_guidance == [(0.0, 3.0)]
        assert generating["Prompts-Only"].eval_guidance == [(6.0, 0.0)]
        assert not generating["Prompts-Only"].use_descriptions
        oracle = generating["Oracle"]
        assert oracle.prompt_domain == "device" and not oracle.use_descriptions
