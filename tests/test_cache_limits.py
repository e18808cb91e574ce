"""Blob-store limits: "auto" by default, sized from the run's model when a role connects;
an explicit value always wins."""

from __future__ import annotations

import json

import pytest

from shared.config import (
    AutoBytes,
    BrokerSection,
    RunConfig,
    config_from_dict,
    with_overrides,
)
from shared.config.deployment import (
    BLOB_DISK_FACTOR,
    BLOB_MEMORY_BLOBS,
    BLOB_MEMORY_HEADROOM,
)
from shared.errors import ConfigError
from shared.runtime.process import blob_bytes, role_broker_settings
from shared.transport.mqtt import MqttBus

TINY_BYTES = 2_747_076  # fmnist-tiny's fp32 state
CIFAR_BYTES = 142_985_228  # ddpm-cifar10's


def cfg_of(preset: str = "fmnist-tiny", algorithm: str = "fedavg", **broker: object) -> RunConfig:
    """A run of ``preset`` trained by ``algorithm`` (a stored config: no waste checks)."""
    data = {"model": {"preset": preset}, "algorithm": {"name": algorithm}, "broker": broker}
    return config_from_dict(data, stored=True)


def test_limits_are_auto_by_default_and_stay_auto_through_config_json() -> None:
    cfg = cfg_of()
    assert isinstance(cfg.broker.memory_limit_bytes, AutoBytes)
    assert isinstance(cfg.broker.cache_limit_bytes, AutoBytes)
    assert cfg.broker.blob_limits_auto
    dumped = json.loads(cfg.to_json())["broker"]
    assert dumped["memory_limit_bytes"] == dumped["cache_limit_bytes"] == "auto"
    again = config_from_dict(json.loads(cfg.to_json()), stored=True)
    assert again.broker.blob_limits_auto
    # command-line overrides go through the dumped config: still auto
    moved = with_overrides(cfg, {"broker": {"host": "broker.local"}}, stored=True)
    assert moved.broker.blob_limits_auto and moved.digest() == cfg.digest()


def test_auto_can_be_written_and_anything_else_must_be_a_byte_count() -> None:
    assert BrokerSection(memory_limit_bytes="auto").blob_limits_auto  # type: ignore[arg-type]
    env = {"ESTUARY__BROKER__CACHE_LIMIT_BYTES": "auto", "ESTUARY__BROKER__MEMORY_LIMIT_BYTES": "5"}
    cfg = config_from_dict({}, env=env)
    assert isinstance(cfg.broker.cache_limit_bytes, AutoBytes)
    assert cfg.broker.memory_limit_bytes == 5
    assert not isinstance(cfg.broker.memory_limit_bytes, AutoBytes)
    for bad in (-1, "lots"):
        with pytest.raises(ConfigError, match="memory_limit_bytes"):
            config_from_dict({"broker": {"memory_limit_bytes": bad}})


def memory_for(blob: int, per_device: int = 0) -> int:
    """The auto memory limit of a run whose largest blob is ``blob`` bytes."""
    return (BLOB_MEMORY_BLOBS + per_device) * blob + BLOB_MEMORY_HEADROOM


def test_the_rule_multiple_headroom_and_disk_factor() -> None:
    tiny = BrokerSection().with_blob_limits(TINY_BYTES)
    assert tiny.memory_limit_bytes == 2 * TINY_BYTES + (8 << 20)  # 13.2 MiB
    assert tiny.cache_limit_bytes == BLOB_DISK_FACTOR * tiny.memory_limit_bytes  # 52.9 MiB
    big = BrokerSection().with_blob_limits(CIFAR_BYTES)
    assert big.memory_limit_bytes == memory_for(CIFAR_BYTES)  # 281 MiB
    assert big.cache_limit_bytes == BLOB_DISK_FACTOR * memory_for(CIFAR_BYTES)
    per_device = BrokerSection().with_blob_limits(CIFAR_BYTES, per_device_blobs=10)
    assert per_device.memory_limit_bytes == memory_for(CIFAR_BYTES, 10)
    assert not big.blob_limits_auto  # sized: plain numbers from now on
    assert big.with_blob_limits(1) is big
    with pytest.raises(ValueError):
        BrokerSection().with_blob_limits(-1)


def test_the_disk_cache_of_a_small_model_holds_copies_in_proportion() -> None:
    """A fixed 256 MiB disk floor kept ~95 copies of fmnist-tiny's 2.7 MB on every role; the
    limits now scale with the model: 8 to about 20 copies, whatever its size."""
    for blob in (TINY_BYTES, CIFAR_BYTES):
        copies = BrokerSection().with_blob_limits(blob).cache_limit_bytes / blob
        assert BLOB_DISK_FACTOR * BLOB_MEMORY_BLOBS <= copies <= 21, (blob, copies)


def test_an_explicit_limit_wins() -> None:
    memory_set = BrokerSection(memory_limit_bytes=123).with_blob_limits(CIFAR_BYTES)
    assert memory_set.memory_limit_bytes == 123
    assert memory_set.cache_limit_bytes == BLOB_DISK_FACTOR * memory_for(CIFAR_BYTES)
    disk_set = BrokerSection(cache_limit_bytes=8 << 30).with_blob_limits(TINY_BYTES)
    assert disk_set.cache_limit_bytes == 8 << 30
    assert disk_set.memory_limit_bytes == memory_for(TINY_BYTES)
    # the very value of the old fallback, written by hand, is explicit too
    both = cfg_of(memory_limit_bytes=2 << 30, cache_limit_bytes=0)
    settings = role_broker_settings(both, "device")
    assert (settings.memory_limit_bytes, settings.cache_limit_bytes) == (2 << 30, 0)


def test_blob_bytes_is_the_largest_state_or_upload() -> None:
    assert blob_bytes(cfg_of()) == (TINY_BYTES, False)
    assert blob_bytes(cfg_of("ddpm-cifar10")) == (CIFAR_BYTES, False)
    unit, per_device = blob_bytes(cfg_of(algorithm="scaffold"))  # model + control variate
    assert unit == 2 * TINY_BYTES and not per_device
    _, per_device = blob_bytes(cfg_of("fmnist-cnn", "pfedgpa"))
    assert per_device


def test_roles_size_their_limits_and_per_device_blobs_get_room() -> None:
    cfg = cfg_of("ddpm-cifar10")
    for role in ("cloud", "edge", "device"):
        s = role_broker_settings(cfg, role)
        assert s.memory_limit_bytes == memory_for(CIFAR_BYTES)
    pfedgpa = config_from_dict(
        {"model": {"preset": "fmnist-cnn"}, "algorithm": {"name": "pfedgpa"},
         "federation": {"num_devices": 400, "num_edges": 4}},
        stored=True,
    )  # fmt: skip
    unit, _ = blob_bytes(pfedgpa)
    # the cloud's personal models and an edge's forwarded uploads: one per device
    for role in ("cloud", "edge"):
        s = role_broker_settings(pfedgpa, role)
        assert s.memory_limit_bytes == memory_for(unit, 400)
    assert role_broker_settings(pfedgpa, "device").memory_limit_bytes == memory_for(unit)


def test_the_cache_dir_argument_applies_unless_the_config_names_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert role_broker_settings(cfg_of(), "edge", tmp_path).cache_dir == str(tmp_path)
    named = cfg_of(cache_dir="/srv/cache")
    assert role_broker_settings(named, "edge", tmp_path).cache_dir == "/srv/cache"


def test_a_bus_built_from_the_settings_alone_keeps_the_fixed_fallback() -> None:
    """Tests and benchmarks build buses without a run: the old fixed limits."""
    bus = MqttBus(BrokerSection(), run="limits", client_id="limits", home="cloud")
    assert bus.store.memory_limit_bytes == 2 << 30
    assert bus.store.disk_limit_bytes == 8 << 30
    sized = role_broker_settings(cfg_of(), "device")
    bus = MqttBus(sized, run="limits", client_id="limits2", home="device/dev000")
    assert bus.store.memory_limit_bytes == memory_for(TINY_BYTES)
    assert type(bus.store.memory_limit_bytes) is int
