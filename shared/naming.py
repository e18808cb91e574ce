"""Names of the role instances of a federation, shared by every role and the launchers."""

from __future__ import annotations

import re

from shared.config import RunConfig
from shared.errors import ConfigError

_DEVICE = re.compile(r"^dev(\d{3,})$")


def edge_ids(cfg: RunConfig) -> list[str]:
    """Names of the configured edges: ``edge0``, ``edge1``, ..."""
    return [f"edge{i}" for i in range(cfg.federation.num_edges)]


def device_name(index: int) -> str:
    """Name of the ``index``-th device: ``dev000``, ``dev001``, ..."""
    return f"dev{index:03d}"


def device_index(name: str, cfg: RunConfig) -> int:
    """The partition index of device ``name`` (``dev007`` -> 7), checked against the config."""
    m = _DEVICE.match(name)
    if m is None:
        raise ConfigError(f"device id {name!r} must look like dev000, dev001, ...")
    index = int(m.group(1))
    if name != device_name(index):  # one name per device: dev0007 is not dev007
        raise ConfigError(f"device id {name!r} must be written {device_name(index)!r}")
    if index >= cfg.federation.num_devices:
        raise ConfigError(
            f"device {name} is outside federation.num_devices = {cfg.federation.num_devices}"
        )
    return index


def is_device_of(name: str, cfg: RunConfig) -> bool:
    """Whether ``name`` is one of the federation's devices (``dev000`` up to
    ``federation.num_devices``): what registrations and presence are kept for."""
    try:
        device_index(name, cfg)
    except ConfigError:
        return False
    return True


def home_edge(index: int, cfg: RunConfig) -> str:
    """The edge device ``index`` registers with (round-robin over the edges)."""
    edges = edge_ids(cfg)
    return edges[index % len(edges)]
