"""``python -m edge_node`` / ``estuary edge --id edge0``: one edge aggregator over MQTT.

Stateless across restarts by design: a restarted edge reads the cloud's retained round
start, fetches the global model once into its blob cache and serves it to its devices.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from edge_node.service import EdgeServer
from shared.config import RunConfig
from shared.errors import ConfigError
from shared.methods.registry import make_algorithm
from shared.naming import edge_ids
from shared.runtime.cpu import set_torch_threads
from shared.runtime.memory import tune_allocator
from shared.runtime.process import (
    Serve,
    add_common_args,
    connect_bus,
    run_role,
    serve_until_cloud_done,
)

log = logging.getLogger("edge_node")


def build_parser() -> argparse.ArgumentParser:
    """Arguments of the edge process."""
    p = argparse.ArgumentParser(prog="estuary edge", description=__doc__)
    add_common_args(p)
    p.add_argument("--id", required=True, help="edge id: edge0, edge1, ...")
    p.add_argument("--cache-dir", help="on-disk blob cache (default: memory only)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Serve as edge ``--id`` until the cloud says the run is done."""
    return run_role(build_parser(), argv, lambda args: args.id, _start, log)


def _start(args: argparse.Namespace, cfg: RunConfig) -> Serve:
    """Check edge ``--id`` against the config and connect it; returns its serving body."""
    tune_allocator()  # model-sized buffers every round: keep RSS near what is held
    set_torch_threads(0)  # aggregation: torch's default, within this process's CPU limit
    if args.id not in edge_ids(cfg):
        raise ConfigError(f"edge id {args.id!r} is not one of {edge_ids(cfg)}")
    cache = Path(args.cache_dir) if args.cache_dir else None
    bus = connect_bus(cfg, "edge", args.id, cache)

    def serve() -> int:
        edge = EdgeServer(cfg, bus, make_algorithm(cfg), edge_id=args.id)
        return serve_until_cloud_done(edge, bus, stay=args.stay)

    return serve
