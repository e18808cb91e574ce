from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shared.config import RunConfig, config_from_dict, load_config
from shared.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_defaults_are_valid_and_round_trip() -> None:
    cfg = RunConfig()
    again = config_from_dict(cfg.to_dict())
    assert again == cfg
    assert again.digest() == cfg.digest()


def test_the_digest_is_the_experiment_not_where_each_process_runs() -> None:
    """Per-process settings (where to connect, which device, how many threads) may differ
    between the roles of one run; anything that changes the experiment changes the digest."""
    cfg = RunConfig()
    same: list[dict[str, Any]] = [
        {"train": {"threads": 3}},
        {"train": {"precision": "bf16"}},
        {"train": {"cuda_graph": True}},
        {"compute": {"device": "cpu"}},
        {"broker": {"port": 1884}},
        {"deploy": {"threads": 2}},
        {"metrics": {"port": 9}},
        {"data": {"local_dir": "/srv/images"}},
        {"eval": {"reference_dir": "/srv/real"}},
        {"data": {"class_names": []}},
        {"train": {"adam_betas": [0.9, 0.999]}},  # the default: digests from before it stand
    ]
    for update in same:
        assert config_from_dict(update).digest() == cfg.digest(), update
    for update in ({"train": {"lr": 5e-4}}, {"train": {"batch_size": 8}}, {"run": {"seed": 1}},
                   {"data": {"class_names": ["cat", "dog"]}},
                   {"train": {"adam_betas": [0.5, 0.999]}}):  # fmt: skip
        assert config_from_dict(update).digest() != cfg.digest(), update
    folder = config_from_dict({"data": {"dataset": "folder"}})
    assert folder.digest() != cfg.digest()
    mine = config_from_dict({"data": {"dataset": "folder", "local_dir": "/data/dev007"}})
    assert mine.digest() == folder.digest()


def test_bad_value_is_named() -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"train": {"lr": -1.0}})
    assert "train.lr" in str(err.value)
    assert "-1.0" in str(err.value)


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"federation\.num_device"):
        config_from_dict({"federation": {"num_device": 3}})


def test_bad_choice_lists_the_problem() -> None:
    with pytest.raises(ConfigError, match=r"model\.preset"):
        config_from_dict({"model": {"preset": "resnet"}})


def test_cross_field_rule() -> None:
    with pytest.raises(ConfigError, match="cloud_every"):
        config_from_dict({"federation": {"edge_every": 2, "cloud_every": 3}})


@pytest.mark.parametrize(
    ("data", "match"),
    [
        # the cloud would never aggregate: the run used to end on the initial model
        (
            {"run": {"rounds": 2}, "federation": {"cloud_every": 5, "edge_every": 5}},
            "cloud_every \\(r_g=5\\) exceeds run.rounds \\(2\\)",
        ),
        # used to fail with a diffusers traceback after the first round had trained
        ({"eval": {"sample_steps": 2000}}, "eval.sample_steps \\(2000\\) exceeds"),
        (
            {"diffusion": {"num_train_timesteps": 100}, "deploy": {"sample_steps": 200}},
            "deploy.sample_steps \\(200\\) exceeds",
        ),
        # NaN passed every range check (each comparison with NaN is False)
        ({"federation": {"sh_b": float("nan")}}, "federation.sh_b: Input should be a finite"),
        ({"train": {"weight_decay": float("inf")}}, "train.weight_decay: Input should be a finite"),
        # the last rounds trained and were thrown away
        (
            {"run": {"rounds": 10}, "federation": {"cloud_every": 3}},
            r"run.rounds \(10\) is not a multiple .* the last 1 round\(s\) .* use 9 or 12",
        ),
        # FedPhD pruned at the next aggregation after R_s: rounds 3-4 dense, no penalty
        (
            {"run": {"rounds": 10}, "federation": {"cloud_every": 5},
             "algorithm": {"name": "fedphd", "sparse_rounds": 3, "prune_ratio": 0.44}},
            r"sparse_rounds \(R_s=3\) is not a multiple .* rounds 4..5 would train the dense",
        ),
        # R_s beyond the run: it never pruned; R_s = rounds: the pruned model never trained
        (
            {"run": {"rounds": 10}, "algorithm": {"name": "fedphd", "sparse_rounds": 10,
                                                  "prune_ratio": 0.44}},
            r"sparse_rounds \(R_s=10\) must be below run.rounds \(10\)",
        ),
        # OS prunes before the first round: the penalty would only shrink an already pruned model
        (
            {"algorithm": {"name": "fedphd", "sparse_rounds": 2, "prune_ratio": 0.44,
                           "prune_at": "init"}},
            r"prune_at = 'init' \(FedPhD-OS\) .* set sparse_rounds = 0",
        ),
        # each device trains on its own folder as it is: no split to choose
        (
            {"data": {"dataset": "folder", "partition": "classes"}},
            r"data.partition = 'classes' splits one dataset .* leave data.partition unset",
        ),
        ({"data": {"class_names": ["a", "b", "a"]}}, "class names must differ"),
        ({"data": {"class_names": ["ok", "x/y"]}}, "'x/y' cannot be a folder name"),
        ({"data": {"class_names": [str(i) for i in range(11)]}}, "at most 10 items"),
    ],
    ids=["never_aggregates", "eval_steps", "deploy_steps", "nan", "inf", "trailing_rounds",
         "sparse_not_at_aggregation", "sparse_past_run", "os_with_penalty", "folder_partition",
         "class_names_repeat", "class_name_path", "class_names_too_many"],
)  # fmt: skip
def test_cross_section_and_non_finite_values_are_refused(data: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        config_from_dict(data)


def test_env_overrides_parse_types() -> None:
    env = {"ESTUARY__TRAIN__LR": "3e-4", "ESTUARY__RUN__NAME": "from-env", "OTHER": "x"}
    cfg = config_from_dict({}, env=env)
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.run.name == "from-env"


def test_bad_env_override_is_named() -> None:
    with pytest.raises(ConfigError, match=r"train\.batch_size"):
        config_from_dict({}, env={"ESTUARY__TRAIN__BATCH_SIZE": "many"})
    with pytest.raises(ConfigError, match="SECTION__KEY"):
        config_from_dict({}, env={"ESTUARY__LR": "1"})


def test_config_is_frozen() -> None:
    cfg = RunConfig()
    with pytest.raises(Exception):  # noqa: B017 - pydantic raises ValidationError
        cfg.train.lr = 1.0  # type: ignore[misc]


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nname=")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(bad)


@pytest.mark.parametrize(
    "path",
    [
        *sorted((REPO / "configs").glob("*.toml")),
        *sorted((REPO / "configs" / "compare").glob("*.toml")),
    ],
    ids=lambda p: p.name,
)
def test_shipped_configs_load(path: Path) -> None:
    if path.parent.name == "compare":  # a list of methods over one base run config
        from estuary.compare import load_compare

        assert load_compare(path)
        return
    cfg = load_config(path, env={})
    assert cfg.run.rounds >= 1


def test_role_command_line_overrides_are_validated(tmp_path: Path) -> None:
    """``--broker`` and ``--metrics-port`` go through the same checks as the config file."""
    import argparse

    from shared.errors import EstuaryError
    from shared.runtime.process import add_common_args, load_role_config

    path = tmp_path / "run.toml"
    path.write_text('[run]\nname = "x"\n')
    p = argparse.ArgumentParser()
    add_common_args(p)

    def load(*argv: str) -> RunConfig:
        return load_role_config(p.parse_args([str(path), *argv]))

    cfg = load("--broker", "mqtt.local:1884", "--metrics-port", "-1")
    assert (cfg.broker.host, cfg.broker.port, cfg.metrics.enabled) == ("mqtt.local", 1884, False)
    assert load("--metrics-port", "0").metrics.port == 0
    with pytest.raises(ConfigError, match=r"broker\.port"):
        load("--broker", "h:0")
    with pytest.raises(ConfigError, match=r"broker\.port"):
        load("--broker", "h:70000")
    with pytest.raises(ConfigError, match=r"metrics\.port"):
        load("--metrics-port", "70000")
    with pytest.raises(EstuaryError, match="--metrics-port must be >= -1"):
        load("--metrics-port", "-2")


def test_data_gives_a_folder_run_its_own_images(tmp_path: Path) -> None:
    """``--data DIR`` (a device) sets this process's ``data.local_dir``, ``--reference DIR``
    (the cloud) its ``eval.reference_dir``; a config that splits a shared dataset refuses
    them instead of ignoring them."""
    import argparse

    from shared.errors import EstuaryError
    from shared.runtime.process import add_common_args, load_role_config

    p = argparse.ArgumentParser()
    add_common_args(p)
    p.add_argument("--data")
    p.add_argument("--reference")
    folder, shared_data = tmp_path / "folder.toml", tmp_path / "fmnist.toml"
    folder.write_text('[data]\ndataset = "folder"\n')
    shared_data.write_text('[data]\ndataset = "fashion-mnist"\n')
    cfg = load_role_config(p.parse_args([str(folder), "--data", "/srv/dev003"]))
    assert cfg.data.local_dir == "/srv/dev003"
    assert cfg.digest() == load_role_config(p.parse_args([str(folder)])).digest()
    cloud = load_role_config(p.parse_args([str(folder), "--reference", "/srv/real"]))
    assert cloud.eval.reference_dir == "/srv/real" and cloud.digest() == cfg.digest()
    for flag in ("--data", "--reference"):
        with pytest.raises(EstuaryError, match=rf"{flag} names .* config says data.dataset = "
                                               "'fashion-mnist'"):  # fmt: skip
            load_role_config(p.parse_args([str(shared_data), flag, "/srv/x"]))


def test_stored_configs_are_read_back_without_the_waste_rules(tmp_path: Path) -> None:
    """A checkpoint of a run made before a rule existed stays readable (estuary eval,
    export); a new run with the same settings is refused."""
    from shared.models.checkpoint import latest_checkpoint_path, load_checkpoint, save_checkpoint
    from shared.models.presets import build_unet

    data = {"run": {"rounds": 10}, "federation": {"cloud_every": 3}}
    with pytest.raises(ConfigError, match="not a multiple"):
        config_from_dict(data)
    cfg = config_from_dict(data, stored=True)
    save_checkpoint(tmp_path, 8, build_unet(cfg.model.preset).state_dict(), cfg)
    path = latest_checkpoint_path(tmp_path)
    assert path is not None and load_checkpoint(path).config == cfg


def test_adam_betas_reach_the_optimizer_and_are_checked() -> None:
    from torch import nn

    from shared.diffusion.training import make_optimizer

    params = list(nn.Linear(2, 2).parameters())
    for optimizer in ("adam", "adamw"):
        cfg = config_from_dict({"train": {"optimizer": optimizer, "adam_betas": [0.5, 0.999]}})
        assert make_optimizer(params, cfg.train).param_groups[0]["betas"] == (0.5, 0.999)
    assert make_optimizer(params, RunConfig().train).param_groups[0]["betas"] == (0.9, 0.999)
    with pytest.raises(ConfigError, match="adam_betas"):
        config_from_dict({"train": {"adam_betas": [0.5, 1.0]}})
