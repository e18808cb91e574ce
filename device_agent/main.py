"""``python -m device_agent`` / ``estuary device --id dev000``: one device agent over MQTT.

The device trains on its own image folder (``data.dataset = "folder"``, ``--data DIR``), or
loads the config's dataset and keeps only its own partition (the same seeded split
``estuary simulate`` makes); raw data never leaves the process. It also serves the
generator the cloud deploys (verified, then sampled with ONNX Runtime; its own model, built
from the deployment and the parts it keeps, when the algorithm keeps parts on the devices). With
``--sample-only`` it does nothing else, and never imports torch.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from device_agent.deployment import DeploymentReceiver, SamplingAgent, device_out_dir
from shared.families import family_of
from shared.runtime.cpu import set_torch_threads
from shared.runtime.process import (
    Serve,
    add_common_args,
    connect_bus,
    run_role,
    serve_until_cloud_done,
)

if TYPE_CHECKING:  # shared.data.datasets imports torch, which a sampling-only device lacks
    from shared.config import RunConfig
    from shared.data.datasets import ImageDataset

log = logging.getLogger("device_agent")


def build_parser() -> argparse.ArgumentParser:
    """Arguments of the device process."""
    p = argparse.ArgumentParser(prog="estuary device", description=__doc__)
    add_common_args(p)
    p.add_argument("--id", required=True, help="device id: dev000, dev001, ...")
    p.add_argument("--cache-dir", help="on-disk blob cache (default: memory only)")
    p.add_argument(
        "--state-dir",
        help="where the device keeps what it carries between rounds (control variates, "
        "local model parts, optimizer state), so that a restart goes on where it stopped "
        "(default: memory only)",
    )
    p.add_argument(
        "--sample-only",
        action="store_true",
        help="do not train: only serve deployed generators (no torch needed)",
    )
    p.add_argument("--out-dir", help="deployed models and sample grids (default: deploy.out_dir)")
    p.add_argument(
        "--data",
        metavar="DIR",
        help="this device's own images, DIR/<class>/<files> (sets data.local_dir; the run's "
        "config must say data.dataset = 'folder')",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Serve as device ``--id`` until the cloud says the run is done."""
    return run_role(build_parser(), argv, lambda args: args.id, _start, log)


def _start(args: argparse.Namespace, cfg: RunConfig) -> Serve:
    """Build device ``--id`` (sampling only, or training on its own data) and connect it;
    returns its serving body. The sampling-only path imports no torch."""
    out_dir = Path(args.out_dir) if args.out_dir else device_out_dir(cfg, args.id)
    cache = Path(args.cache_dir) if args.cache_dir else None
    if args.sample_only:
        bus = connect_bus(cfg, "device", args.id, cache)
        agent = SamplingAgent(cfg, bus, device_id=args.id, out_dir=out_dir)
        log.info("%s: sampling only; grids go to %s", args.id, out_dir)
        # served here, inside run_role's EstuaryError handling, as this path always was
        code = serve_until_cloud_done(agent, bus, stay=args.stay)
        return lambda: code
    device, bus = _training_agent(args, cfg, cache)
    receiver = None
    if cfg.deploy.enabled and family_of(cfg.model.preset).served_by == "devices":
        from device_agent.own_classifier import OwnClassifier

        device.after_last_round = OwnClassifier(device, out_dir)
    elif cfg.deploy.enabled:
        from device_agent.personalize import Personalizer

        receiver = DeploymentReceiver(device, out_dir, personalize=Personalizer(device))

    def serve() -> int:
        if receiver is not None:
            receiver.start()
        return serve_until_cloud_done(device, bus, stay=args.stay)

    return serve


def _training_agent(args: argparse.Namespace, cfg: Any, cache: Path | None) -> tuple[Any, Any]:
    """The training device of ``--id`` with its private partition, connected."""
    import torch

    from device_agent.service import DeviceAgent
    from shared.data.datasets import to_model_input
    from shared.diffusion.training import set_deterministic
    from shared.methods.registry import make_algorithm
    from shared.naming import device_index, home_edge

    index = device_index(args.id, cfg)
    set_torch_threads(cfg.train.threads)
    set_deterministic(cfg.compute.deterministic)
    data = device_data(cfg, index)
    test = device_test_data(cfg, index)
    bus = connect_bus(cfg, "device", args.id, cache)
    channels = cfg.data.input_channels
    device = DeviceAgent(
        cfg,
        bus,
        make_algorithm(cfg),
        device_id=args.id,
        index=index,
        home_edge=home_edge(index, cfg),
        data=to_model_input(data.images, channels),
        labels=torch.from_numpy(data.labels),
        state_dir=Path(args.state_dir) if args.state_dir else None,
        test_data=None if test is None else to_model_input(test.images, channels),
        test_labels=None if test is None else torch.from_numpy(test.labels),
    )
    log.info("%s has %d samples from %s (home %s)", args.id, len(data), data.name, device.home_edge)
    device.metrics.training_images.set(len(data))
    device.metrics.skipped_image_files.set(data.skipped)
    return device, bus


def device_test_data(cfg: RunConfig, index: int) -> ImageDataset | None:
    """A classifier's own test split (the test set split by the training split's rule, seen
    in its domain as in simulate: :func:`~shared.data.partition.split_test`), on which it
    reports its accuracy (also where the run's product is a classifier made from a
    generator run: FedDEO's devices classify with it); None for another generator run or a
    dataset without a test set."""
    from shared.config import classifies
    from shared.data.partition import split_test

    if not classifies(cfg):
        return None
    test = split_test(cfg)
    return None if test is None else test[0].subset(test[1][index])


def device_data(cfg: RunConfig, index: int) -> ImageDataset:
    """Device ``index``'s training images: its own folder (``data.dataset = "folder"`` without
    ``data.path``: ``data.local_dir``, or ``data.local_dir/<device id>`` where that exists,
    the layout ``simulate`` reads; at most ``data.max_samples_per_device`` of them), or its
    share of the config's dataset (the seeded split ``estuary simulate`` makes, without the
    public share); either seen in its domain (``data.domains``), as simulate gives it."""
    from shared.data.partition import device_folder, split_dataset
    from shared.errors import ConfigError
    from shared.naming import device_name

    if cfg.data.own_folders:
        if not cfg.data.local_dir:
            raise ConfigError(
                "data.dataset = 'folder': this device needs its image folder; pass --data DIR "
                "(or set ESTUARY__DATA__LOCAL_DIR)"
            )
        folder = Path(cfg.data.local_dir)
        if (folder / device_name(index)).is_dir():
            folder = folder / device_name(index)
        return device_folder(cfg, index, folder, progress=True)
    data, parts = split_dataset(cfg)
    return data.subset(parts[index])
