"""The command line's conventions: ``--version``, ``-q``/``-v`` on every subcommand, and
unusable output paths refused in one line (exit 2) before any work starts."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from estuary.cli import ROLE_COMMANDS, build_parser, main
from estuary.paths import check_out_dir, check_out_file
from shared.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CONFIG = CONFIGS / "fedavg_iid_tiny.toml"


def _unwritable() -> Path:
    """A folder this process cannot write even as root (sysfs), or skip."""
    base = Path("/sys")
    try:
        fd, name = tempfile.mkstemp(dir=base)
    except OSError:
        return base
    os.close(fd)
    os.unlink(name)
    pytest.skip("no unwritable folder on this machine")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("estuary ") and out.split()[1][0].isdigit()


def test_every_subcommand_takes_quiet_and_verbose() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    names = [n for n in sub.choices if n not in ROLE_COMMANDS]  # type: ignore[union-attr]
    assert {"demo", "simulate", "compare", "sample", "status", "classify"} <= set(names)
    for name in names:
        help_text = sub.choices[name].format_help()  # type: ignore[index]
        assert "-q, --quiet" in help_text and "-v, --verbose" in help_text, name
    # either place works, and the subcommand does not reset the top-level flag
    assert parser.parse_args(["-q", "model-info", "--preset", "x"]).quiet is True
    assert parser.parse_args(["model-info", "--preset", "x", "-q"]).quiet is True
    args = parser.parse_args(["-v", "model-info", "--preset", "x"])
    assert args.verbose is True and args.quiet is False


def test_quiet_and_verbose_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["-q", "model-info", "--preset", "fmnist-tiny", "-v"])
    assert exc.value.code == 2
    assert "exclude each other" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["simulate", "demo", "compare", "split-data"])
def test_out_that_is_a_file_is_refused_before_work(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    args = {
        "simulate": ["simulate", str(CONFIG)],
        "demo": ["demo"],
        "compare": ["compare", str(CONFIGS / "compare" / "compare_pfedgpa_quick.toml")],
        "split-data": ["split-data", str(CONFIG)],
    }[command]
    for out, says in ((afile, "this is a file"), (afile / "run", f"{afile} is a file")):
        assert main([*args, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"estuary: error: --out {out}: ") and says in err, err
        assert len(err.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_unwritable_out_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _unwritable() / "estuary-run"
    assert main(["simulate", str(CONFIG), "--out", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"--out {bad}: cannot write" in err and "choose" in err
    assert not bad.exists()


def test_sample_checks_its_grid_path_before_loading_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the model folder does not exist either: the --out check comes first
    assert main(["sample", "--model", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    assert "this is a folder; give a file name" in capsys.readouterr().err


def test_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    deep = tmp_path / "a" / "b" / "c"
    assert check_out_dir(deep) == deep
    assert not (tmp_path / "a").exists()  # created for the probe, removed again
    existing = tmp_path / "runs"
    existing.mkdir()
    check_out_dir(existing)
    assert list(existing.iterdir()) == []
    check_out_file(tmp_path / "new" / "grid.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    with pytest.raises(ConfigError, match="this is a folder"):
        check_out_file(existing)


def test_unforeseen_os_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An OS error no check foresaw (here the keygen target's folder is a file) is one
    ``estuary: error:`` line with exit 2; -v shows the traceback."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["keygen", str(afile / "prism.key")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("estuary: error: ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(OSError):
        main(["-v", "keygen", str(afile / "prism.key")])


def test_model_info_help_lists_every_preset() -> None:
    from estuary.cli import preset_names
    from shared.models.presets import ALL_PRESETS

    assert preset_names() == sorted(ALL_PRESETS)
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    # argparse wraps lines at hyphens: compare without whitespace
    help_text = "".join(sub.choices["model-info"].format_help().split())  # type: ignore[index]
    assert all(name in help_text for name in ALL_PRESETS)


def test_mistyped_names_get_a_suggestion(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "typo.toml"
    config.write_text('[run]\nname = "x"\nrouns = 2\n[trian]\nlr = 0.1\n[algorithm]\n'
                      'name = "fedavgg"\n')  # fmt: skip
    assert main(["simulate", str(config)]) == 2
    err = capsys.readouterr().err
    assert "run.rouns: unknown key (got 2) (did you mean 'rounds'?)" in err
    assert "trian: unknown key (did you mean 'train'?)" in err
    assert "(got 'fedavgg') (did you mean 'fedavg'?)" in err
    assert main(["model-info", "--preset", "fmnist-tin"]) == 2
    assert "(did you mean 'fmnist-tiny'?)" in capsys.readouterr().err
    assert main(["compare", str(config)]) == 2
    assert "is a run config; `estuary compare` takes a comparison" in capsys.readouterr().err


def test_model_info_answers_from_the_shipped_table() -> None:
    import json
    import subprocess
    import sys

    # in a fresh interpreter: the shipped table, torch never imported
    code = (
        "import sys; from estuary.cli import main; "
        "rc = main(['model-info', '--preset', 'fmnist-cnn', '--json']); "
        "assert 'torch' not in sys.modules; sys.exit(rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["params"] == 117_066 and info["kind"] == "classifier"
