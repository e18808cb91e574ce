"""FedDEO: descriptions against a frozen generator, each device's own upload forwarded to
the cloud instead of averaged, guided generation with nested seeds, and the one-shot run end
to end (in-process)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.config import RunConfig, config_from_dict
from shared.diffusion.schedule import make_train_scheduler
from shared.errors import ConfigError, MessageError
from shared.methods.base import Update
from shared.methods.feddeo.config import FedDEOConfig
from shared.methods.feddeo.descriptions import train_descriptions
from shared.methods.feddeo.guidance import (
    class_table,
    compose_eps,
    eps_with_embedding,
    guided_ddim,
    null_row,
)
from shared.methods.feddeo.method import (
    DESC,
    MASK,
    MAX_DESC_NORM_RATIO,
    image_seed,
    prompt_norm,
    start_noise,
)
from shared.methods.registry import make_algorithm
from shared.models.plan import model_spec
from shared.models.presets import build_unet, null_class, num_classes_of

# its module-scoped fixtures are built once: every test of the module on one pytest worker
pytestmark = pytest.mark.xdist_group("feddeo")


def feddeo_config(**sections: dict[str, Any]) -> RunConfig:
    """A tiny FedDEO run: 4 devices at 2 edges, synthetic data, a random generator."""
    base: dict[str, dict[str, Any]] = {
        "run": {"name": "feddeo-test", "seed": 0, "rounds": 1},
        "federation": {"num_devices": 4, "num_edges": 2, "round_deadline_s": 120},
        "data": {"dataset": "synthetic", "synthetic_size": 160, "partition": "iid"},
        "model": {"preset": "fmnist-tiny-cfg"},
        "train": {"batch_size": 8},
        "algorithm": {
            "name": "feddeo", "feddeo_images_per_class": 3, "feddeo_eval_n": [1],
            "feddeo_sample_steps": 2, "feddeo_desc_epochs": 0.5, "feddeo_desc_batch": 8,
            "feddeo_clf_epochs": 1, "feddeo_grid_per_class": 2,
        },
        "eval": {"every": 0, "sample_every": 0, "checkpoint_every": 1},
    }  # fmt: skip
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return config_from_dict(base)


@pytest.fixture(scope="module")
def unet() -> torch.nn.Module:
    return build_unet("fmnist-tiny-cfg", seed=0).eval()


def test_the_guidance_preset_has_ten_classes_and_a_null_one(unet: torch.nn.Module) -> None:
    assert null_class(unet) == 10
    assert num_classes_of(unet) == 10
    assert null_row(unet).shape == (64,)
    assert null_class(build_unet("fmnist-tiny-cond")) is None


def test_a_class_row_as_a_vector_conditions_as_its_label(unet: torch.nn.Module) -> None:
    x = torch.randn(3, 1, 32, 32, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 4, 10])
    with torch.no_grad():
        by_label = unet(x, 500, class_labels=labels).sample
        by_vector = eps_with_embedding(unet, x, 500, class_table(unet)[labels])
    torch.testing.assert_close(by_vector, by_label)
    # the hook is gone afterwards
    with torch.no_grad():
        again = unet(x, 500, class_labels=labels).sample
    torch.testing.assert_close(again, by_label)


def test_eq5_accumulates_each_condition_against_the_null_prediction() -> None:
    null, text, desc = torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([5.0])
    out = compose_eps(null, [text, desc], [3.0, 2.0])
    assert float(out) == pytest.approx(1 + 3 * (2 - 1) + 2 * (5 - 1))
    assert float(compose_eps(null, [], [])) == 1.0
    with pytest.raises(ValueError):
        compose_eps(null, [text], [1.0, 2.0])


def test_one_seed_per_image_makes_smaller_draws_a_prefix(unet: torch.nn.Module) -> None:
    cfg = feddeo_config()
    seeds = [image_seed(0, 1, 3, i) for i in range(4)]
    assert len(set(seeds)) == 4 and seeds[0] != image_seed(0, 2, 3, 0) != image_seed(1, 1, 3, 0)
    table = class_table(unet)
    big = guided_ddim(
        unet, start_noise(seeds, (1, 32, 32)), [table[[3] * 4]], [3.0], cfg.diffusion, steps=3
    )
    small = guided_ddim(
        unet, start_noise(seeds[:2], (1, 32, 32)), [table[[3] * 2]], [3.0], cfg.diffusion, steps=3
    )
    torch.testing.assert_close(big[:2], small, atol=1e-5, rtol=0)
    assert big.abs().max() <= 1.0


def test_descriptions_train_while_the_generator_stays_frozen(unet: torch.nn.Module) -> None:
    s = FedDEOConfig(desc_epochs=2.0, desc_batch=8, desc_lr=0.05,
                     min_class_images=2)  # fmt: skip
    images = torch.rand(20, 1, 32, 32) * 2 - 1
    labels = torch.tensor([0] * 8 + [3] * 11 + [7])  # class 7 has one image: not described
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    flags = [p.requires_grad for p in unet.parameters()]
    sched = make_train_scheduler(feddeo_config().diffusion)
    desc, mask, result = train_descriptions(
        unet, images, labels, s, sched, torch.Generator().manual_seed(0)
    )
    assert mask.tolist() == [1, 0, 0, 1, 0, 0, 0, 0, 0, 0]
    table = class_table(unet)[:10]
    assert desc.shape == (10, 64)
    assert not torch.equal(desc[0], table[0]) and not torch.equal(desc[3], table[3])
    torch.testing.assert_close(desc[7], table[7])  # undescribed: the class row, mask 0
    assert result.steps == 5 and result.mean_loss > 0
    for k, v in unet.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert [p.requires_grad for p in unet.parameters()] == flags


def _upload(desc_value: float, mask: list[float] | None = None) -> dict[str, torch.Tensor]:
    return {DESC: torch.full((10, 64), desc_value), MASK: torch.tensor(mask or [1.0] * 10)}


ALL = {f"dev{i:03d}": [1] * 10 for i in range(4)}  # every device registered every class


def test_each_upload_is_checked_at_its_edge_and_kept_by_the_cloud_as_sent() -> None:
    cfg = feddeo_config()
    algo = make_algorithm(cfg)
    assert algo.traffic.cloud_sees == "every_upload" and algo.traffic.product == "cloud_made"
    state = algo.format.init_global(build_unet("fmnist-tiny-cfg").state_dict())
    fold = algo.aggregation.edge_fold(state)
    fold.add(Update("dev000", _upload(0.5), 10, (1,) * 10))
    fold.add(Update("dev002", _upload(0.25), 10, (1,) * 10))
    with pytest.raises(MessageError, match="not a device of this federation"):
        fold.add(Update("dev099", _upload(0.5), 10, (1,) * 10))
    with pytest.raises(MessageError, match="mask entries"):
        fold.add(Update("dev001", _upload(0.5, [1, 0.5] + [0] * 8), 10, (1,) * 10))
    assert fold.sources == ["dev000", "dev002"]
    assert fold.result() is state  # the generator is never touched, nothing is averaged
    # the cloud keeps each device's own upload (forwarded by its edge), checked again
    finalizer = algo.finalizer
    assert finalizer is not None
    refused = finalizer.collect(0, {
        "dev000": _upload(0.5), "dev002": _upload(0.25), "dev099": _upload(0.5),
        "dev001": _upload(0.5, [1, 0.5] + [0] * 8),
    }, state, ALL)  # fmt: skip
    assert {d: e.reason for d, e in refused.items()} == {
        "dev099": "unknown_device", "dev001": "bad_description"}  # fmt: skip
    held = algo.held  # type: ignore[attr-defined]
    assert sorted(held) == ["dev000", "dev002"]
    assert float(held["dev000"][0].mean()) == 0.5 and float(held["dev002"][0].mean()) == 0.25


def test_an_upload_may_describe_only_classes_its_device_registered() -> None:
    """A device holding one class cannot describe ten, nor describe none; its own class
    passes, at the edge and again at the cloud."""
    algo = make_algorithm(feddeo_config())
    state = algo.format.init_global(build_unet("fmnist-tiny-cfg").state_dict())
    one = (0, 0, 0, 12, 0, 0, 0, 0, 0, 0)  # class 3 only
    fold = algo.aggregation.edge_fold(state)
    with pytest.raises(MessageError, match=r"classes \[0, 1, 2, 4, 5, 6, 7, 8, 9\]") as err:
        fold.add(Update("dev000", _upload(0.5), 12, one))
    assert err.value.reason == "class_not_registered"
    with pytest.raises(MessageError, match="names no class") as err:
        fold.add(Update("dev000", _upload(0.5, [0.0] * 10), 12, one))
    assert err.value.reason == "describes_nothing"
    own = [0.0] * 10
    own[3] = 1.0
    fold.add(Update("dev000", _upload(0.5, own), 12, one))
    assert fold.sources == ["dev000"]
    finalizer = algo.finalizer
    assert finalizer is not None
    refused = finalizer.collect(0, {"dev000": _upload(0.5, own), "dev001": _upload(0.5)}, state,
                                {"dev000": list(one), "dev001": list(one)})  # fmt: skip
    assert {d: e.reason for d, e in refused.items()} == {"dev001": "class_not_registered"}
    assert sorted(algo.held) == ["dev000"]  # type: ignore[attr-defined]


def test_a_description_far_from_the_class_prompts_is_refused() -> None:
    """Rows bounded relative to the generator's class prompts: the largest prompt's norm
    times MAX_DESC_NORM_RATIO passes, a little more does not (nor 999 in every entry)."""
    algo = make_algorithm(feddeo_config())
    state = algo.format.init_global(build_unet("fmnist-tiny-cfg").state_dict())
    limit = MAX_DESC_NORM_RATIO * prompt_norm(state)
    at_limit = limit / 8.0 * 0.999  # a row of 64 equal entries has norm 8 x the entry
    algo.aggregation.edge_fold(state).add(Update("dev000", _upload(at_limit), 10, (1,) * 10))
    for value in (limit / 8.0 * 1.01, 999.0):
        with pytest.raises(MessageError, match="description row of norm") as err:
            algo.aggregation.edge_fold(state).add(Update("dev000", _upload(value), 10, (1,) * 10))
        assert err.value.reason == "bad_description"
    finalizer = algo.finalizer
    assert finalizer is not None
    refused = finalizer.collect(0, {"dev000": _upload(999.0)}, state, ALL)
    assert [e.reason for e in refused.values()] == ["bad_description"]
    assert not algo.held  # type: ignore[attr-defined]


def test_the_published_state_carries_no_description(tmp_path: Path) -> None:
    cfg = feddeo_config()
    algo = make_algorithm(cfg)
    mspec = model_spec(cfg.model.preset, None)
    assert algo.format.global_spec(mspec) == mspec  # the generator alone: no description
    finalizer, view = algo.finalizer, algo.state_view
    assert finalizer is not None and view is not None and view.keeps_files
    state = algo.format.init_global(build_unet("fmnist-tiny-cfg").state_dict())
    assert finalizer.collect(0, {"dev000": _upload(0.75)}, state, ALL) == {}
    view.save_cloud_state(tmp_path, 0)
    again = make_algorithm(cfg)
    assert again.state_view is not None
    again.state_view.load_cloud_state(tmp_path, 0)
    torch.testing.assert_close(again.held["dev000"][0], algo.held["dev000"][0])  # type: ignore[attr-defined]


def test_config_refuses_more_rounds_and_a_generator_without_null_class() -> None:
    with pytest.raises(ConfigError, match="one-shot"):
        feddeo_config(run={"rounds": 2})
    with pytest.raises(ConfigError, match="null class"):
        feddeo_config(model={"preset": "fmnist-tiny-cond"})
    with pytest.raises(ConfigError, match=r"feddeo\.eval_n"):
        feddeo_config(algorithm={"feddeo_eval_n": [10]})


@pytest.mark.parametrize("use_descriptions", [True, False])
def test_a_one_shot_run_generates_trains_and_scores_a_classifier(
    tmp_path: Path, use_descriptions: bool
) -> None:
    from estuary.simulate import simulate

    cfg = feddeo_config(
        data={"domains": ["identity", "invert"]},
        algorithm={"feddeo_use_descriptions": use_descriptions},
    )
    result = simulate(cfg, tmp_path / "run", progress=False, evaluate=False)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    final = summary["final"]
    assert final["preset"] == "fmnist-cnn"
    assert set(final["accuracy"]) == {"identity", "invert"}
    assert set(final["accuracy_by_n"]) == {"1", "3"}
    # N = 3 images for each class each of the 4 devices described (it holds)
    assert len(final["described"]) == 4 and all(v >= 8 for v in final["described"].values())
    assert final["synthetic_images"] == 3 * sum(final["described"].values())
    assert final["use_descriptions"] is use_descriptions
    assert (result.run_dir / "feddeo.json").exists()
    assert len(list((result.run_dir / "synthetic").glob("dev*.png"))) == 4
    # one round; each device's upload is a few hundred bytes (descriptions and mask)
    assert result.rounds == 1
    ckpt = sorted((result.run_dir / "checkpoints").glob("*.safetensors"))
    assert ckpt
