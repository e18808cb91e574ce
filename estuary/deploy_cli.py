"""``estuary keys``, ``export``, ``sample``, ``deploy`` and ``provision``: the deployment
commands (DESIGN sections 5 and 7). ``keys`` and ``sample`` never import torch."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from estuary.paths import check_out_dir, check_out_file
from shared.errors import EstuaryError
from shared.logs import printable

log = logging.getLogger(__name__)


def cmd_keys(args: argparse.Namespace) -> int:
    """Generate the Ed25519 deployment key pair."""
    from shared.deploy.signing import generate_keys, key_id, load_public_key

    priv, pub = generate_keys(check_out_dir(Path(args.out)), overwrite=args.force)
    out = {"private_key": str(priv), "public_key": str(pub), "key_id": key_id(load_public_key(pub))}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"signing key (cloud only, keep secret): {priv}")
        print(f"verification key (devices):           {pub}")
        print(f"key id: {out['key_id']}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Export a checkpoint or run to ONNX with the parity gate, card and manifest."""
    from shared.deploy.export import export_generator
    from shared.deploy.signing import load_private_key

    check_out_dir(Path(args.out))
    key = load_private_key(args.key) if args.key else None
    result = export_generator(
        Path(args.source),
        Path(args.out),
        fp16=args.fp16,
        opset=args.opset,
        threshold=args.threshold,
        parity_steps=args.parity_steps,
        signing_key=key,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    p, card = result.parity, result.card
    size = f"{card['onnx_bytes'] / 2**20:.2f} MiB"
    params, gmacs = card["params"] / 1e6, card["macs"] / 1e9
    print(f"exported {card['name']} to {result.model_path} ({size}, {params:.3f} M params, "
          f"{gmacs:.3f} GMACs, {card['dtype']})")  # fmt: skip
    second = ("from the devices' sampler" if card.get("kind") == "oneshot"
              else f"over a {p.trajectory_steps}-step DDIM trajectory")  # fmt: skip
    print(f"parity vs torch: {p.random_max_abs:.3g} on random inputs, "
          f"{p.trajectory_max_abs:.3g} {second} (threshold {p.threshold:g})")  # fmt: skip
    signed = "signed" if result.signed else "UNSIGNED (pass --key to sign)"
    print(f"manifest: {result.manifest_path} ({signed}); card: {result.out_dir / 'card.json'}")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    """Sample a grid from an exported model with ONNX Runtime (no torch)."""
    from device_agent.sampling import load_generator, save_grid
    from shared.deploy.signing import load_public_key

    check_out_file(Path(args.out))  # before sampling, not after it
    key = load_public_key(args.verify_key) if args.verify_key else None
    gen, manifest = load_generator(
        Path(args.model), verify_key=key, provider=args.provider, threads=args.threads,
        own=args.own,
    )  # fmt: skip
    if "personalized" in manifest["card"] and not args.own:
        print("note: the devices of this run keep local model parts, which this global model "
              "has at their initialization; a device's own model: --own on its "
              "devices/<id>/models/<sha16> directory", file=sys.stderr)  # fmt: skip
    if args.warmup:
        gen.sample(min(args.batch_size, args.n), steps=1, seed=args.seed)
    bar = _progress(args.n, quiet=args.json or args.quiet)
    try:
        images, stats = gen.sample(
            args.n, steps=args.steps, seed=args.seed, batch_size=args.batch_size,
            progress=bar.update if bar is not None else None,
        )  # fmt: skip
    finally:
        if bar is not None:
            bar.close()
    grid = save_grid(images, Path(args.out))
    out: dict[str, Any] = {
        "model": manifest["card"].get("name"),
        "model_sha256": manifest["model"]["sha256"],
        # the bytes load_generator checked against the device's record and built the session from
        "own_model_sha256": gen.model_sha256 if args.own else None,
        "signature": "verified" if key is not None else "not checked",
        "provider": gen.providers[0],
        **stats.to_dict(),
        "grid": str(grid),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        how = "one pass each" if gen.kind == "oneshot" else f"{out['steps']} DDIM steps"
        print(f"{out['n']} images, {how} on {out['provider']}: "
              f"{out['images_per_s']:.2f} images/s, {out['latency_s']:.3f} s per batch of "
              f"{out['batch_size']} -> {grid}")  # fmt: skip
        if key is None:
            print("note: signature not checked (pass --verify-key)")
    return 0


def _progress(total: int, *, quiet: bool) -> Any:
    if quiet:
        return None
    try:
        from shared.progress import progress_bar
    except ImportError:  # a device image without tqdm
        return None
    return progress_bar(total=total, unit="img", desc="sampling")


def cmd_deploy(args: argparse.Namespace) -> int:
    """Publish an exported model to the devices of a running federation, under the cloud's
    subtree (where devices fetch deployments from).

    On a provisioned broker it logs in as the ``deployer`` account (``estuary provision``),
    never as the cloud: the broker binds each client id to its account, so a second login
    with the cloud's account would disconnect a running cloud (and the two would keep
    replacing each other). The cloud's account is refused before connecting."""
    from cloud.deploy import DeploymentPublisher, PublisherService
    from estuary.acl import DEPLOYER
    from shared.deploy.signing import load_private_key
    from shared.runtime.process import connect_bus, load_role_config
    from shared.wire.messages import DEPLOYER_HOME, Presence

    cfg = load_role_config(args)
    if cfg.broker.username == "cloud":
        raise EstuaryError(
            "deploy refuses the cloud's broker account: a second login with it disconnects a "
            f"running cloud; log in as the {DEPLOYER!r} account `estuary provision` makes "
            f"(ESTUARY__BROKER__USERNAME={DEPLOYER} ESTUARY__BROKER__PASSWORD_FILE="
            f"<provision dir>/credentials/{DEPLOYER}.password)"
        )
    key_path = args.key or cfg.deploy.signing_key
    if not key_path:
        raise EstuaryError("no signing key: pass --key or set deploy.signing_key")
    # its files served from its own subtree inside the cloud's, without the cloud's presence
    # or last will: the cloud may be up (and never answers for those files)
    bus = connect_bus(cfg, "cloud", "cloud-deploy", None, will=False, home=DEPLOYER_HOME)
    try:
        service = PublisherService("cloud", cfg, bus, home=DEPLOYER_HOME)
        online: set[str] = set()

        def presence(msg: Presence) -> None:
            (online.add if msg.online else online.discard)(msg.name)

        service.on(service.topics.all_device_status, Presence, presence, "msg_presence")
        publisher = DeploymentPublisher(service, load_private_key(key_path))
        bus.pump(1.0)  # retained presence of the devices
        msg = publisher.publish(Path(args.export_dir))
        targets = sorted(args.devices.split(",")) if args.devices else sorted(online)
        print(f"published {msg.model_ref.sha256[:12]} to {len(targets)} online devices; "
              f"waiting up to {args.wait_s:g} s for their reports")  # fmt: skip
        deadline = time.monotonic() + args.wait_s
        while time.monotonic() < deadline and not publisher.settled(targets):
            bus.pump(0.5)
        if args.request_samples:
            publisher.request_samples(
                f"req{int(time.time())}", devices=targets, n=args.request_samples,
                steps=cfg.deploy.sample_steps,
            )  # fmt: skip
            bus.pump(min(args.wait_s, 30.0))
    finally:
        bus.close()
    for device, r in publisher.summary().items():
        print(report_line(device, r))
    problem = deploy_problem(publisher, targets)
    if problem:
        print(f"estuary deploy: {problem}", file=sys.stderr)
        return 1
    return 0


def deploy_problem(publisher: Any, targets: list[str]) -> str:
    """Why ``estuary deploy`` failed ("" when it did not): no device among ``targets``
    accepted the deployment now current at ``publisher``
    (:class:`~cloud.deploy.DeploymentPublisher`; the reasons of those that refused it are
    named), or some did not report on it (or did not finish loading it) in time."""
    current = publisher.current
    sha = current.model_ref.sha256 if current is not None else ""
    on_it = {d: r for d, r in publisher.reports.items() if d in targets and r.model_sha256 == sha}
    refused = {d: r.reason for d, r in sorted(on_it.items()) if r.event == "refused"}
    silent = sorted(set(targets) - set(on_it))
    if not targets:
        return "no device online to deploy to"
    if len(refused) + len(silent) == len(targets):  # none took it
        named = [f"{d}: {why or 'no reason given'}" for d, why in refused.items()]
        named += [f"{d}: no report within --wait-s" for d in silent]
        return printable(f"no device accepted deployment {sha[:12]} ({'; '.join(named)})")
    pending = sorted([*silent, *(d for d, r in on_it.items() if r.event == "loaded")])
    if pending:
        return (f"{len(pending)} of {len(targets)} device(s) did not finish with deployment "
                f"{sha[:12]} in time: {', '.join(pending)}")  # fmt: skip
    return ""


def report_line(device: str, report: dict[str, Any]) -> str:
    """One line of ``estuary deploy``'s result for ``device``'s latest report (its JSON
    form, :meth:`~cloud.deploy.DeploymentPublisher.summary`): a generator's sampling speed, a
    classifier's accuracy and speed, or why the device refused."""
    event = report["event"]
    if event == "sampled":
        what = f"{report['images_per_s']:.2f} images/s"
    elif event == "classified":
        from estuary.status import classified_figures

        what = classified_figures(report)
    else:
        what = report.get("reason") or ""
    return printable(f"  {device}: {event:>8}  {what}".rstrip())  # a device's text, escaped


def cmd_provision(args: argparse.Namespace) -> int:
    """Broker credentials, ACL, deployment keys (and TLS) for a federation."""
    from estuary.provision import provision
    from shared.config import load_config

    cfg = load_config(args.config)
    info = provision(cfg, check_out_dir(Path(args.out)), tls_hosts=args.tls_host,
                     force=args.force, keep=args.keep, broker_user=args.broker_user,
                     cloud_broker=args.cloud_broker)  # fmt: skip
    if args.json:
        print(json.dumps(info, indent=2))
    elif info.get("kept"):
        print(f"kept the provisioning of run {info['run']!r} in {args.out} "
              f"({len(info['users'])} broker users)")  # fmt: skip
    else:
        print(
            f"provisioned {len(info['users'])} broker users for run {info['run']!r} in {args.out}:"
        )
        print(f"  mosquitto password file {info['passwd']}, ACL {info['acl']}")
        print(f"  passwords in {args.out}/credentials/<name>.password (one file per instance)")
        print(f"  deployment keys {info['signing_key']} (cloud), {info['verify_key']} (devices)")
        if "tls" in info:
            print(f"  TLS CA {info['tls']['ca']}, server certificate {info['tls']['server_cert']}")
        for site, entry in info.get("sites", {}).items():
            if site != "cloud":
                print(f"  edge site {site}: broker {entry['files']['broker_conf']} (bridge to "
                      f"{info['cloud_broker']}), {len(entry['users'])} users")  # fmt: skip
    return 0


def add_parsers(sub: Any) -> None:
    """Register the deployment subcommands on ``sub`` (argparse subparsers)."""
    k = sub.add_parser("keys", help="generate the Ed25519 deployment signing key pair")
    k.add_argument("--out", required=True, help="directory for the two PEM files")
    k.add_argument("--force", action="store_true", help="replace existing keys")
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=cmd_keys)

    e = sub.add_parser("export", help="export a checkpoint or run to ONNX (parity-gated)")
    e.add_argument("source", help="checkpoint file or run directory")
    e.add_argument("--out", required=True, help="output directory")
    e.add_argument("--fp16", action="store_true", help="fp16 weights and compute inside")
    e.add_argument("--opset", type=int, default=17)
    e.add_argument(
        "--threshold", type=float, help="max abs error vs torch (default 1e-4; 5e-2 with --fp16)"
    )
    e.add_argument("--parity-steps", type=int, default=20, help="DDIM steps of the check")
    e.add_argument("--key", help="Ed25519 private key (PEM) to sign the manifest with")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_export)

    s = sub.add_parser("sample", help="sample a grid from an exported model (ONNX Runtime)")
    s.add_argument("--model", required=True, help="export directory (model.onnx + manifest)")
    s.add_argument("--n", type=int, default=64, help="images to sample (default 64)")
    s.add_argument("--steps", type=int, default=100, help="DDIM steps, 1..T (default 100)")
    s.add_argument("--batch-size", type=int, default=64, help="images per ORT batch")
    s.add_argument("--seed", type=int, default=0, help="noise (and label) seed")
    s.add_argument("--out", default="grid.png", help="PNG grid path")
    s.add_argument("--verify-key", help="Ed25519 public key (PEM); refuse unless it verifies")
    s.add_argument(
        "--provider",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: CUDA where a GPU is visible, else CPU; cuda: fail unless it runs on CUDA",
    )
    s.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0 = default)")
    s.add_argument("--own", action="store_true", help="a device's own model (FedDiffuse "
                   "ULATDEC/UDEC): --model is the device's models/<sha16> directory")  # fmt: skip
    s.add_argument("--warmup", action="store_true", help="one untimed 1-step batch first")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(func=cmd_sample)

    v = sub.add_parser("provision", help="broker passwords, per-role ACL, keys, TLS")
    v.add_argument("config", help="run config (run name, edges, devices, assignment)")
    v.add_argument("--out", required=True, help="output directory")
    v.add_argument("--tls-host", action="append", help="also make a CA and a server "
                   "certificate for this broker host name or IP (repeatable)")  # fmt: skip
    v.add_argument("--force", action="store_true", help="replace an earlier provisioning")
    v.add_argument("--keep", action="store_true", help="reuse an earlier provisioning of the "
                   "same run and instances (an error if it differs; one killed before it "
                   "finished is made again)")  # fmt: skip
    v.add_argument("--broker-user", default="mosquitto", help="the user the broker runs as "
                   "(default mosquitto, Debian's): its group may read the password file, "
                   "ACL and mosquitto.conf; '' leaves them to the provisioning user's "
                   "group")  # fmt: skip
    v.add_argument("--cloud-broker", metavar="HOST:PORT", help="federation.brokers = "
                   "'per-edge': the cloud broker's address the edge sites' bridges connect to "
                   "(default the config's broker.host:broker.port)")  # fmt: skip
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_provision)

    d = sub.add_parser("deploy", help="publish an exported model to a running federation")
    d.add_argument("export_dir", help="directory written by `estuary export`")
    d.add_argument("config", help="run config (broker address and credentials: on a "
                   "provisioned broker the deployer account, never the cloud's)")  # fmt: skip
    d.add_argument("--broker", help="HOST:PORT (overrides broker.host/port)")
    d.add_argument("--key", help="signing key (default deploy.signing_key)")
    d.add_argument("--devices", help="comma-separated device ids to wait for (default: online)")
    d.add_argument("--wait-s", type=float, default=120.0)
    d.add_argument("--request-samples", type=int, default=0, help="then ask for N more images")
    d.set_defaults(func=cmd_deploy, metrics_port=-1)
