"""``estuary`` command line: demo, simulate, compare, cloud, edge, device, eval, model-info,
split-data, keys, export, sample, provision, deploy, status."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from estuary.paths import check_out_dir, describe_os_error
from shared.errors import ConfigError, EstuaryError, did_you_mean
from shared.logs import escaping_handler

#: modules of the "train" extra; a sampling-only install lacks them
TRAIN_MODULES = frozenset({"torch", "diffusers", "torch_pruning", "safetensors", "scipy",
                           "matplotlib", "onnx"})  # fmt: skip


#: the subcommands that are role processes (they parse their own arguments)
ROLE_COMMANDS = frozenset({"cloud", "edge", "device"})
QUIET_HELP = "no progress bars, tables or warnings; results and errors still print"
VERBOSE_HELP = "debug logging (and a traceback with an error)"


def _cmd_simulate(args: argparse.Namespace) -> int:
    from estuary.simulate import simulate
    from shared.config import load_config

    cfg = load_config(args.config)
    check_out_dir(Path(args.out) if args.out else Path("runs"))
    result = simulate(
        cfg,
        Path(args.out) if args.out else None,
        progress=not args.quiet,
        evaluate=not args.no_eval,
        fresh=args.fresh,
    )
    losses = [r["train_loss"] for r in result.rows if r["train_loss"] is not None]
    print(f"run directory: {result.run_dir}")
    if losses:
        print(f"train loss: first round {losses[0]:.4f} -> last round {losses[-1]:.4f}")
    quality = [r["quality"] for r in result.rows if r.get("quality")]
    if quality:
        q = quality[-1]
        print(f"final FID ({q['extractor']} features, {q['n_fake']} samples): {q['fid']:.2f}")
    print(f"final global model sha256: {result.final_model_sha256}")
    print(f"report: {result.run_dir / 'report.png'}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from estuary.compare import load_compare, run_compare

    spec = load_compare(args.config)
    out = check_out_dir(Path(args.out) if args.out else Path("runs") / spec.name)
    result = run_compare(
        spec,
        out,
        evaluate=not args.no_eval,
        progress=not args.quiet,
        fresh=args.fresh,
        only=args.only or (),
        jobs=args.jobs,
        tables=not args.no_table,
    )
    if result.rows:
        print((result.out / "table.md").read_text())
        print(f"tables and plots: {result.out}")
    else:
        print(f"records of {', '.join(r.method.label for r in result.runs) or 'no method'} "
              f"in {result.out}")  # fmt: skip
    return 0


def _cmd_split_data(args: argparse.Namespace) -> int:
    from estuary.split_data import split_data
    from shared.config import load_config

    out = check_out_dir(Path(args.out))
    result = split_data(load_config(args.config), out, progress=not args.quiet)
    sizes = result.device_images
    print(f"{len(sizes)} device folders ({min(sizes)}-{max(sizes)} images each) and the "
          f"cloud's {result.reference_images} reference images in {out}")  # fmt: skip
    print(f"config reading them: {result.config_path}; train on them in one process with")
    print(f"  estuary simulate {result.config_path}")
    print("or as role processes, each device given only its own folder:")
    print(f"  estuary cloud {result.config_path} --out runs/folder --reference {out / 'cloud'}")
    print(f"  estuary device {result.config_path} --id dev000 --data {out / 'dev000'}   "
          "(and each other device, its own folder)")  # fmt: skip
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from estuary.demo import print_demo_result, run_demo

    check_out_dir(Path(args.out) if args.out else Path("runs"))
    result = run_demo(
        Path(args.out) if args.out else None,
        config=Path(args.config) if args.config else None,
        broker_kind=args.broker,
        brokers=args.brokers,
        progress=not args.quiet,
        evaluate=not args.no_eval,
    )
    print_demo_result(result)
    return 0


def _role_main(module: str, argv: list[str]) -> int:
    import importlib

    main = importlib.import_module(f"{module}.main").main
    return int(main(argv))


def _cmd_eval(args: argparse.Namespace) -> int:
    from shared.config import with_overrides
    from shared.diffusion.training import resolve_device
    from shared.evaluation.evaluator import Evaluator, model_from_state
    from shared.models.checkpoint import checkpoint_of, load_checkpoint

    path = checkpoint_of(Path(args.run_dir))
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    if args.num_samples is not None:
        cfg = with_overrides(
            cfg, {"eval": {"num_samples": args.num_samples}}, source="--num-samples", stored=True
        )
    # where this host samples, not the run's compute.device (a deployment setting of the
    # host that trained: "cuda" there must not stop an evaluation on a CPU-only machine)
    evaluator = Evaluator(cfg, resolve_device(args.device))
    metrics = evaluator.evaluate(model_from_state(cfg, ckpt.model, ckpt.plan))
    out = {
        "checkpoint": str(path),
        "round": ckpt.round + 1,
        "model_sha256": ckpt.model_sha256,
        **metrics,
        "level": "global",
    }
    if cfg.algorithm.config().traffic().device_keeps == "local_parts":
        print(f"estuary: note: this is the global model of a {cfg.algorithm.name} run, its "
              "device-local parts at their initialization; `estuary simulate` and `estuary "
              "compare` report the client-level FID the paper uses", file=sys.stderr)  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:>14}: {v}")
    return 0


def _cmd_model_info(args: argparse.Namespace) -> int:
    from shared.models.info_table import load_table, masked_weight_count

    names = preset_names()
    if args.preset not in names:  # said at once, before torch is imported
        raise ConfigError(f"unknown model preset {args.preset!r}"
                          f"{did_you_mean(args.preset, names)}; choose one of {names}")  # fmt: skip
    shipped = load_table().get(args.preset) if args.prune_sp is None else None
    if shipped is not None:  # the shipped table: at once, no torch
        return _print_model_info(dict(shipped), args)
    from shared.models.presets import build_unet, kind_of, model_info, state_spec

    kind = kind_of(args.preset)
    if args.prune_sp is None:
        info = model_info(args.preset).to_dict()
    elif kind != "unet":
        raise ConfigError(f"--prune-sp: {args.preset!r} is a {kind} model; U-Nets prune")
    else:
        from torch import nn

        from shared.models.pruning import prune_unet

        def pruned() -> nn.Module:
            dense = build_unet(args.preset, seed=args.prune_seed)
            return prune_unet(dense, args.prune_sp, method=args.prune_method, seed=args.prune_seed)

        info = model_info(args.preset, model_fn=pruned).to_dict()
        dense = sum(math.prod(s.shape) for s in state_spec(args.preset).values())
        info["prune"] = {
            "sp": args.prune_sp,
            "method": args.prune_method,
            "seed": args.prune_seed,
            "removed": round(1 - info["params"] / dense, 4),
        }
    info["kind"] = kind
    if kind != "classifier":
        info["masked_weights"] = masked_weight_count(args.preset)
    return _print_model_info(info, args)


def _print_model_info(info: dict[str, Any], args: argparse.Namespace) -> int:
    kind = info["kind"]
    if args.json:
        print(json.dumps(info, indent=2))
    elif kind == "classifier":
        print(
            f"{info['preset']}: {info['params']:,} params, {info['macs']:,} MACs "
            f"({info['weight_macs']:,} weight multiply-accumulates) per image, "
            f"{info['fp32_bytes']:,} bytes fp32 ({kind})"
        )
    else:
        pruned_by = f" (pruned {args.prune_sp:g} by {args.prune_method})" if "prune" in info else ""
        print(
            f"{info['preset']}{pruned_by}: {info['params_m']} M params, {info['gmacs']} GMACs "
            f"({info['weight_gmacs']} G weight multiply-accumulates), {info['fp32_mib']} MiB fp32, "
            f"{info['masked_weights']:,} maskable weights ({kind})"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    p = argparse.ArgumentParser(prog="estuary", description=__doc__)
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    p.add_argument("-q", "--quiet", action="store_true", help=QUIET_HELP)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser(
        "demo", help="local hierarchy as processes over MQTT on Fashion-MNIST (the main job)"
    )
    d.add_argument("--out", help="run directory (default runs/demo-<timestamp>)")
    d.add_argument("--config", help="run config instead of the embedded demo default")
    d.add_argument("--broker", choices=["auto", "mosquitto", "amqtt"], default="auto")
    d.add_argument("--brokers", choices=["one", "per-edge"], help="one broker, or one per "
                   "edge site bridged to the cloud's (mosquitto); default the config's "
                   "federation.brokers")  # fmt: skip
    d.add_argument("--no-eval", action="store_true", help="skip quality evaluation")
    d.set_defaults(func=_cmd_demo)

    for role, module, what in (
        ("cloud", "cloud", "the cloud aggregator process (MQTT)"),
        ("edge", "edge_node", "one edge aggregator process (MQTT); needs --id"),
        ("device", "device_agent", "one device agent process (MQTT); needs --id"),
    ):
        r = sub.add_parser(role, help=what, add_help=False)
        r.set_defaults(func=None, role_module=module)

    s = sub.add_parser("simulate", help="run a federation in one process (MemoryBus)")
    s.add_argument("config", help="TOML config (see configs/)")
    s.add_argument(
        "--out",
        help="run directory (default runs/<name>-<timestamp>); one that holds checkpoints of "
        "this config is resumed after the latest (with the devices' states kept beside it), "
        "one holding another config's is refused",
    )
    s.add_argument("--no-eval", action="store_true", help="skip quality evaluation")
    s.add_argument(
        "--fresh",
        action="store_true",
        help="start over even if --out holds checkpoints (they are moved aside)",
    )
    s.set_defaults(func=_cmd_simulate)

    c = sub.add_parser("compare", help="run several methods on one split; table and plots")
    c.add_argument("config", help="comparison TOML (see configs/compare/)")
    c.add_argument("--out", help="output directory (default runs/<compare name>)")
    c.add_argument("--no-eval", action="store_true", help="skip quality evaluation")
    c.add_argument(
        "--fresh",
        action="store_true",
        help="run every method again from its first round (default: reuse methods already "
        "finished in --out and resume unfinished ones after their latest checkpoint)",
    )
    c.add_argument(
        "--only",
        action="append",
        metavar="LABEL",
        help="run only this method (repeatable); the others are reused from --out, and the "
        "table is written once every method has finished",
    )
    c.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="run up to N methods at once, each in its own process with 1/N of the CPU "
        "threads (default 1)",
    )
    c.add_argument(
        "--no-table", action="store_true", help="run the methods only; write no table or plots"
    )
    c.set_defaults(func=_cmd_compare)

    e = sub.add_parser("eval", help="quality metrics of a run's latest checkpoint")
    e.add_argument("run_dir", help="run directory (or a checkpoint file)")
    e.add_argument("--json", action="store_true")
    e.add_argument("--num-samples", type=int, help="override eval.num_samples")
    e.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto",
        help="where to sample (auto: a GPU when torch sees one; default auto)",
    )  # fmt: skip
    e.set_defaults(func=_cmd_eval)

    m = sub.add_parser("model-info", help="params, MACs and fp32 bytes of a preset")
    m.add_argument("--preset", required=True, help=f"one of: {', '.join(preset_names())}")
    m.add_argument(
        "--prune-sp", type=float, help="report the preset pruned by this fraction of parameters"
    )
    m.add_argument("--prune-method", choices=["l2", "random"], default="l2")
    m.add_argument("--prune-seed", type=int, default=0, help="init (and random ranking) seed")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=_cmd_model_info)

    sd = sub.add_parser(
        "split-data",
        help="write a config's split as per-device image folders (to try --data DIR)",
    )
    sd.add_argument("config", help="run config (fashion-mnist or synthetic)")
    sd.add_argument("--out", required=True, help="new directory for the folders")
    sd.set_defaults(func=_cmd_split_data)

    from estuary.classify_cli import add_parser as add_classify_parser
    from estuary.deploy_cli import add_parsers
    from estuary.status import add_parser as add_status_parser
    from shared.methods.registry import cli_modules

    add_parsers(sub)
    add_classify_parser(sub)
    for module in cli_modules():  # the methods' own verbs (estuary prism pack|unpack, ...)
        module.add_parsers(sub)
    add_status_parser(sub)
    for name, command in sub.choices.items():
        if name not in ROLE_COMMANDS:  # the roles parse their own arguments
            add_output_flags(command)
    return p


def add_output_flags(command: argparse.ArgumentParser) -> None:
    """``-q/--quiet`` and ``-v/--verbose`` on a subcommand, as on ``estuary`` itself (either
    place works: ``estuary -q demo`` is ``estuary demo -q``)."""
    flags = command.add_argument_group("output")
    # SUPPRESS: a subcommand that is not given the flag keeps the top-level value
    flags.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                       help=QUIET_HELP)  # fmt: skip
    flags.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                       help=VERBOSE_HELP)  # fmt: skip


def preset_names() -> list[str]:
    """Every model preset a config may name (from the config schema: no torch import)."""
    from typing import get_args

    from shared.config import ModelSection

    return sorted(get_args(ModelSection.model_fields["preset"].annotation))


def version() -> str:
    """The installed package's version (``0+unknown`` when run from an uninstalled tree)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("estuary")
    except PackageNotFoundError:
        return "0+unknown"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``estuary`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = build_parser().parse_known_args(argv)
    if getattr(args, "role_module", None):
        return _role_main(args.role_module, rest)  # the role parses its own arguments
    if rest:
        build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
    if args.quiet and args.verbose:
        build_parser().error("-q/--quiet and -v/--verbose exclude each other")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.ERROR if args.quiet else logging.WARNING,
        handlers=[escaping_handler(sys.stderr, "%(asctime)s %(levelname)s %(name)s: %(message)s")],
    )
    try:
        return int(args.func(args))
    except EstuaryError as err:
        if args.verbose:
            traceback.print_exc()
        print(f"estuary: error: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        if err.name not in TRAIN_MODULES:
            raise
        print(f"estuary: error: `estuary {args.command}` needs {err.name}, from the training "
              "extra: pip install 'estuary[train]'", file=sys.stderr)  # fmt: skip
        return 2
    except KeyboardInterrupt:
        print("estuary: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`| head`): no error line, the usual status
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing more to flush into the closed pipe
        return 141
    except OSError as err:
        if args.verbose:
            raise
        # a file-system error the checks before the work did not foresee: one line, not a
        # traceback (-v shows it)
        print(f"estuary: error: {describe_os_error(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
