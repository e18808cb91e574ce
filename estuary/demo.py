"""``estuary demo``: a real local hierarchy on Fashion-MNIST, as separate processes over MQTT.

Starts a broker (mosquitto when installed, else an embedded amqtt), one cloud, two edges
and six devices, shows progress per round, and writes the run directory: ``report.png``,
sample grids, ``metrics.jsonl``, checkpoints, every process's log, and the last Prometheus
scrape of every role (``prometheus.json``). Everything it started is stopped at the end,
also on Ctrl-C or an error. With ``--brokers per-edge`` (or ``federation.brokers``) it starts
a cloud broker and one mosquitto per edge site bridged to it, and each role talks through
its own site's broker (docs/operations.md, Brokers per edge site).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from estuary.launcher import Hierarchy, site_brokers
from estuary.status import BROKERS_FILE
from shared.atomic import atomic_write
from shared.config import RunConfig, config_from_dict, load_config
from shared.errors import EstuaryError
from shared.evaluation.report import read_metrics
from shared.evaluation.story import story_figures, story_text
from shared.families import family_of
from shared.federation.topology import per_edge
from shared.methods.registry import make_algorithm
from shared.models.init import ASSETS
from shared.progress import progress_bar
from shared.runtime.process import interrupts_as_keyboard
from shared.transport.local_broker import BrokerKind, LocalBroker

log = logging.getLogger(__name__)

#: the demo's starting generator: fmnist-tiny pretrained on the public test images of the
#: clothes only (T-shirt, trouser, pullover, dress, coat, shirt; its recipe beside it)
DEMO_START = ASSETS / "fmnist_tiny_clothes.safetensors"
#: the classes each device holds (device i: group i mod 6): shoes only (sandal, sneaker,
#: ankle boot), which the start never saw, two a device. Not bags, though the start never
#: saw those either: the classifier calls a misshapen top a bag, so a bag share would not
#: tell learning from noise
DEMO_GROUPS = [[5, 7], [7, 8], [8, 9], [9, 5], [5, 8], [7, 9]]

DEMO_CONFIG: dict[str, dict[str, Any]] = {
    "run": {"name": "demo", "seed": 0, "rounds": 4},
    "federation": {
        "num_devices": 6,
        "num_edges": 2,
        "round_deadline_s": 240,
        "registration_timeout_s": 120,
    },
    "data": {
        "dataset": "fashion-mnist",
        "partition": "dominant_groups",
        "dominant_groups": DEMO_GROUPS,
        "dominant_uniform_fraction": 0.5,
        "samples_per_device": 1200,
        "test_samples_per_device": 100,
    },
    "model": {"preset": "fmnist-tiny", "init": str(DEMO_START)},
    "train": {"local_steps": 25, "batch_size": 32, "lr": 1e-3, "threads": 1},
    "deploy": {"threads": 1, "grid_size": 16, "sample_steps": 50},
    "eval": {"every": 2, "sample_every": 2, "num_samples": 250, "sample_steps": 25},
}
"""The embedded default: 6 devices x 25 steps x 4 rounds of fmnist-tiny, a few minutes on
two CPU cores. The shared generator starts from :data:`DEMO_START`, which draws clothes but
has never seen a shoe or a bag (pretrained by ``scripts/pretrain_generator.py --classes
0,1,2,3,4,6`` on the Fashion-MNIST test split, which no device holds). Each device's private
train images are half from two of the classes the start lacks (sandal, sneaker, bag, ankle
boot: :data:`DEMO_GROUPS`) and half from all ten. The cloud scores the start before round 1,
so the summary's first and last figures (FID, and the share of samples in the classes only
the devices held) show what federation added. Pass ``--config`` for anything else."""

OVERALL_TIMEOUT_S = 1800.0


@dataclass
class DemoResult:
    """What the demo produced."""

    run_dir: Path
    rounds: int
    final_model_sha256: str
    seconds: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    scrapes: dict[str, dict[str, float]] = field(default_factory=dict)
    deployment: dict[str, dict[str, Any]] = field(default_factory=dict)  # device -> report
    #: the last round (from 1) the cloud restored from the run directory's checkpoints
    #: (None: it started afresh); equal to ``rounds`` when the directory held a finished run
    #: and nothing was trained
    resumed_after_round: int | None = None
    #: a one-shot algorithm's product and figures (FedDEO: the classifier's accuracy per
    #: domain), the summary's ``final``; None for every other algorithm
    final: dict[str, Any] | None = None
    #: per device, its uploads' bytes and count and every byte it sent (summary ``demo``)
    device_uploads: dict[str, dict[str, float]] = field(default_factory=dict)


def demo_config(path: Path | None) -> RunConfig:
    """The config the demo runs: ``path`` if given, else :data:`DEMO_CONFIG`."""
    return load_config(path) if path is not None else config_from_dict(DEMO_CONFIG, source="demo")


def _bytes_by_role(scrapes: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, samples in scrapes.items():
        sent = sum(
            v for k, v in samples.items() if k.startswith('estuary_bytes_total{direction="sent"')
        )
        recv = sum(
            v
            for k, v in samples.items()
            if k.startswith('estuary_bytes_total{direction="received"')
        )
        out[name] = {"sent": sent, "received": recv}
    return out


def with_brokers(cfg: RunConfig, brokers: str | None) -> RunConfig:
    """``cfg`` with ``federation.brokers = brokers`` (validated again: a broker per edge site
    needs static assignment); ``cfg`` itself when ``brokers`` is None."""
    if brokers is None or brokers == cfg.federation.brokers:
        return cfg
    doc = cfg.to_dict()
    doc["federation"] = {**doc["federation"], "brokers": brokers}
    return config_from_dict(doc, source=f"--brokers {brokers}")


def run_demo(
    out: Path | None = None,
    *,
    config: Path | None = None,
    broker_kind: BrokerKind = "auto",
    brokers: str | None = None,
    progress: bool = True,
    evaluate: bool = True,
) -> DemoResult:
    """Run the demo hierarchy to completion; raises EstuaryError if any role fails.

    ``brokers`` (``"one"`` or ``"per-edge"``) overrides the config's ``federation.brokers``:
    with ``"per-edge"`` a cloud broker and one mosquitto per edge site, bridged to it
    (:func:`~estuary.launcher.site_brokers`); every role is told its own site's broker, and
    ``brokers.json`` in the run directory records them all for ``estuary status``."""
    cfg = with_brokers(demo_config(config), brokers)
    run_dir = (
        out or Path("runs") / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = with_deploy_keys(cfg, run_dir)
    t0 = time.monotonic()
    broker = LocalBroker(kind=broker_kind, workdir=run_dir / "broker",
                         memory_bytes=cfg.broker.broker_memory_bytes)  # fmt: skip
    # the config every process reads, with the broker's real address: `estuary status
    # <run dir>` finds the running demo from it
    broker_section = cfg.broker.model_copy(update={"host": broker.host, "port": broker.port})
    cfg = cfg.model_copy(update={"broker": broker_section})
    config_path = run_dir / "launch_config.json"
    atomic_write(config_path, cfg.to_json().encode())
    method = make_algorithm(cfg)
    if method.preparation is not None:  # the processes inherit what it provides (a key)
        method.preparation.prepare(run_dir / "keys", show=progress)
    hier = Hierarchy(cfg, config_path, run_dir, broker, evaluate=evaluate)
    if per_edge(cfg):
        hier.site_brokers = site_brokers(cfg, broker, run_dir / "brokers")
        where = {s: {"host": b.host, "port": b.port} for s, b in hier.brokers().items()}
        atomic_write(run_dir / BROKERS_FILE, json.dumps(where, indent=2).encode())
    scrapes: dict[str, dict[str, float]] = {}
    with interrupts_as_keyboard():
        try:
            _run(hier, scrapes, progress=progress)
        finally:
            hier.stop_all()
            for b in hier.site_brokers.values():
                b.stop()
            broker.stop()
    summary = json.loads((run_dir / "summary.json").read_text())
    atomic_write(run_dir / "prometheus.json", json.dumps(scrapes, indent=1).encode())
    reports = run_dir / "deploy" / "reports.json"
    deployment = json.loads(reports.read_text()) if reports.is_file() else {}
    summary["demo"] = {  # what the cloud cannot know: the whole demo's time, the devices' word
        "wall_s": round(time.monotonic() - t0, 1),
        "deployment": _deployment_outcome(deployment),
        "device_uploads": _device_uploads(cfg, scrapes),
    }
    atomic_write(run_dir / "summary.json", json.dumps(summary, indent=2).encode())
    return DemoResult(
        run_dir=run_dir,
        rounds=summary["rounds"],
        final_model_sha256=summary["final_model_sha256"],
        seconds=time.monotonic() - t0,
        rows=read_metrics(run_dir / "metrics.jsonl"),
        scrapes=scrapes,
        deployment=deployment,
        resumed_after_round=summary.get("resumed_after_round"),
        final=summary.get("final"),
        device_uploads=summary["demo"]["device_uploads"],
    )


def _device_uploads(
    cfg: RunConfig, scrapes: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Per device, from its last Prometheus scrape: the bytes of its uploads (the
    algorithm's upload kind: model updates, masks, descriptions), how many it sent, and
    every byte it sent (control messages too)."""
    from shared.naming import device_name

    kind = f'kind="{cfg.algorithm.config().traffic().blob_kind}"'
    out: dict[str, dict[str, float]] = {}
    for i in range(cfg.federation.num_devices):
        samples = scrapes.get(device_name(i), {})
        sent = {k: v for k, v in samples.items() if 'direction="sent"' in k}
        out[device_name(i)] = {
            "upload_bytes": sum(v for k, v in sent.items()
                                if k.startswith("estuary_bytes_total{") and kind in k),
            "uploads": sum(v for k, v in sent.items()
                           if k.startswith("estuary_messages_total{") and kind in k),
            "sent_bytes": sum(v for k, v in sent.items() if k.startswith("estuary_bytes_total{")),
        }  # fmt: skip
    return out


def _deployment_outcome(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Devices per deployment event (``sampled``, ``classified``, ``refused``...) and the
    median images per second of those that sampled or classified."""
    events: dict[str, int] = {}
    for r in reports.values():
        events[r["event"]] = events.get(r["event"], 0) + 1
    rates = sorted(r["images_per_s"] for r in reports.values() if r.get("images_per_s"))
    return {
        "devices": len(reports),
        "events": events,
        "median_images_per_s": rates[len(rates) // 2] if rates else None,
    }


def with_deploy_keys(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """Give the demo a deployment key pair (``run_dir/keys``) and a device output folder
    (``run_dir/devices``) unless the config names its own."""
    if not cfg.deploy.enabled or cfg.deploy.signing_key:
        return cfg
    from shared.deploy.signing import PRIVATE_KEY_FILE, PUBLIC_KEY_FILE, generate_keys

    keys = run_dir / "keys"
    if not (keys / PRIVATE_KEY_FILE).is_file():
        generate_keys(keys, overwrite=True)
    deploy = cfg.deploy.model_copy(
        update={
            "signing_key": str((keys / PRIVATE_KEY_FILE).resolve()),
            "verify_key": cfg.deploy.verify_key or str((keys / PUBLIC_KEY_FILE).resolve()),
            "out_dir": cfg.deploy.out_dir or str((run_dir / "devices").resolve()),
        }
    )
    return cfg.model_copy(update={"deploy": deploy})


def _run(hier: Hierarchy, scrapes: dict[str, dict[str, float]], *, progress: bool) -> None:
    """Broker up, processes up, follow to the end (the caller stops everything)."""
    hier.broker.start()
    for b in hier.site_brokers.values():
        b.start()
    if progress:
        print(f"broker: {hier.broker.kind} at {hier.broker.url}")
        for site, b in hier.site_brokers.items():
            print(f"broker of edge site {site}: {b.kind} at {b.url}, bridged to the cloud's")
    hier.start_all()
    if progress:
        bound = hier.metrics_ports(timeout_s=30)
        ports = ", ".join(f"{name}:{port or '?'}" for name, port in bound.items())
        print(f"started {len(hier.procs)} processes; Prometheus /metrics ports: {ports}")
    scrapes.update(_follow(hier, hier.cfg, hier.run_dir, progress=progress, evaluate=hier.evaluate))
    code = hier.wait("cloud", 60)
    if code != 0:
        raise EstuaryError(
            f"the cloud exited with code {code}; its log ends with:\n"
            f"{hier.procs['cloud'].log_tail()}"
        )
    for p in hier.procs.values():  # edges and devices leave once they see "done"
        hier.wait(p.name, 30)


def _state_of(samples: dict[str, float]) -> str | None:
    """The ``estuary_phase`` state a role's scrape reports (None when it has none yet)."""
    for key, value in samples.items():
        if key.startswith("estuary_phase{") and value == 1.0:
            return key.split('"')[1]
    return None


def phase_text(
    cfg: RunConfig, scrapes: dict[str, dict[str, float]], rows: int, *, evaluate: bool = True
) -> str:
    """What the hierarchy is doing now, in a few words, from the roles' last scrapes and
    the rounds recorded (``rows``): the demo's progress bar shows it. ``evaluate``: whether
    the cloud computes FID on its evaluation rounds."""
    cloud = scrapes.get("cloud")
    state = _state_of(cloud) if cloud else None
    if cloud is None or state is None:
        return "starting processes"
    if state == "scoring":
        return f"scoring the start (FID on {cfg.eval.num_samples} samples)"
    if state in ("idle", "waiting"):
        online = sum(
            int(v) for samples in scrapes.values() for k, v in samples.items()
            if k.startswith("estuary_connected_devices{")
        )  # fmt: skip
        return f"waiting for devices ({online}/{cfg.federation.num_devices} connected)"
    r = int(cloud.get("estuary_round", rows)) + 1
    if state == "training":
        return f"round {r}: devices training"
    own = cfg.algorithm.config().phase_text  # the method's own work in a phase, if any
    if state == "aggregating" and state in own:
        return f"round {r}: {own[state]}"
    if state == "aggregating":
        fid = evaluate and family_of(cfg.model.preset).quality == "fid"
        every = cfg.eval.every if fid else 0
        if every and (r % every == 0 or r == cfg.run.rounds):
            return f"round {r}: aggregating and evaluating (FID on {cfg.eval.num_samples} samples)"
        return f"round {r}: aggregating"
    if state == "deploying":
        if state in own:
            return f"deploying: {own[state]}"
        if family_of(cfg.model.preset).served_by == "devices":
            return "deploying: each device exports its own classifier to ONNX and tests it"
        return "deploying: export to ONNX, parity check, signing, devices sampling"
    return "finishing"


def _follow(
    hier: Hierarchy, cfg: RunConfig, run_dir: Path, *, progress: bool, evaluate: bool
) -> dict[str, dict[str, float]]:
    """Show a progress bar from ``metrics.jsonl`` until the cloud exits; keep the last
    Prometheus scrape of every role; fail fast if any process dies with an error."""
    metrics = run_dir / "metrics.jsonl"
    scrapes: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + OVERALL_TIMEOUT_S
    next_scrape = 0.0
    with progress_bar(total=cfg.run.rounds, desc="demo", unit="round", disable=not progress) as bar:
        while hier.procs["cloud"].alive:
            if time.monotonic() > deadline:
                raise EstuaryError(f"demo did not finish within {OVERALL_TIMEOUT_S:.0f}s")
            failed = hier.failed()
            if failed:
                p = failed[0]
                raise EstuaryError(
                    f"{p.name} exited with code {p.returncode}; its log ends with:\n{p.log_tail()}"
                )
            rows = read_metrics(metrics) if metrics.is_file() else []
            if len(rows) > bar.n:
                bar.update(len(rows) - bar.n)
                bar.set_postfix(progress_figures(rows))
            if time.monotonic() >= next_scrape:
                scrapes.update(hier.scrape_all())
                next_scrape = time.monotonic() + 2.0
                text = phase_text(cfg, scrapes, len(rows), evaluate=evaluate)
                bar.set_description_str(f"demo: {text}")
            time.sleep(0.5)
        rows = read_metrics(metrics) if metrics.is_file() else []
        bar.update(max(0, len(rows) - bar.n))
        bar.set_description_str("demo: done")
    return scrapes


def progress_figures(rows: list[dict[str, Any]]) -> dict[str, str]:
    """The progress bar's figures, first -> latest: the training loss, FID (from the start's
    score when the cloud made one) and the share of samples in the classes only the devices
    held ("new"); the latest evaluation stays shown between evaluations."""
    fig = story_figures(rows)
    post: dict[str, str] = {}
    if "loss" in fig:
        post["loss"] = "{:.4f}->{:.4f}".format(*fig["loss"])
    if "fid" in fig:
        post["FID"] = "{:.1f}->{:.1f}".format(*fig["fid"])
    if "new_class_share" in fig:
        post["new"] = "{:.0%}->{:.0%}".format(*fig["new_class_share"])
    return post


def print_demo_result(result: DemoResult) -> None:
    """Where the outputs are, and the headline numbers."""
    rows = result.rows
    quality = [r["quality"] for r in rows if r.get("quality")]
    grids = [r["grid"] for r in rows if r.get("grid")]
    d = result.run_dir
    print(f"\ndemo finished: {result.rounds} rounds in {result.seconds:.0f}s")
    start = result.resumed_after_round
    if start is not None and start >= result.rounds:
        print(f"nothing was trained: {d} already held all {result.rounds} rounds of this "
              "config (the cloud resumed after the last one); the figures below are that "
              "run's. Use a new --out to train again.")  # fmt: skip
    elif start is not None:
        print(f"resumed from the checkpoint of round {start} in {d}")
    figures = story_figures(rows)
    for line in story_text(figures):
        print(line)
    if quality:
        q = quality[-1]
        print(f"final FID ({q['extractor']} features, {q['n_fake']} samples): {q['fid']:.2f}")
    print(f"final global model sha256: {result.final_model_sha256}")
    if any(v["uploads"] for v in result.device_uploads.values()):
        print("uploads per device (bytes, all rounds):")
        for name, v in sorted(result.device_uploads.items()):
            print(f"  {name}: {v['upload_bytes']:,.0f} in {v['uploads']:.0f} uploads "
                  f"({v['sent_bytes']:,.0f} sent in all)")  # fmt: skip
    by_role = _bytes_by_role(result.scrapes)
    if by_role:
        print("bytes by role (last Prometheus scrape):")
        for name, v in sorted(by_role.items()):
            mib = {k: x / 2**20 for k, x in v.items()}
            print(f"  {name:>8}: sent {mib['sent']:8.2f} MiB  received {mib['received']:8.2f} MiB")
    final = result.final
    if final is not None and final.get("accuracy"):
        per_domain = ", ".join(f"{k} {v:.3f}" for k, v in final["accuracy"].items())
        print(
            f"one-shot classifier ({final['preset']}) trained on {final.get('synthetic_images')} "
            f"synthetic images: mean test accuracy over domains {final['mean_accuracy']:.4f} "
            f"({per_domain})"
        )
    classified = {k: r for k, r in result.deployment.items() if r["event"] == "classified"}
    if classified and final is not None:
        accs = sorted(r["accuracy"] for r in classified.values() if r.get("accuracy") is not None)
        print(
            f"deployed {d / 'deploy' / 'model.onnx'} (signed): {len(classified)}/"
            f"{len(result.deployment)} devices classified their own test split with it"
            + (f"; accuracy with ONNX Runtime: mean {sum(accs) / len(accs):.4f}, "
               f"min {accs[0]:.4f}, max {accs[-1]:.4f}" if accs else "")
        )  # fmt: skip
        for name, r in sorted(result.deployment.items()):
            if r["event"] != "classified":
                print(f"  {name}: {r['event']} {r['reason']}")
    elif classified:
        accs = sorted(r["accuracy"] for r in classified.values() if r.get("accuracy") is not None)
        rates = sorted(r["images_per_s"] for r in classified.values())
        print(
            f"{len(classified)}/{len(result.deployment)} devices exported their own classifier "
            f"(ONNX, parity-checked, unsigned: {d / 'devices'}/<device>/classifier/)"
            + (f"; test accuracy with ONNX Runtime: mean {sum(accs) / len(accs):.4f}, "
               f"min {accs[0]:.4f}" if accs else "")
            + (f", median {rates[len(rates) // 2]:.0f} images/s" if rates else "")
        )  # fmt: skip
        for name, r in sorted(result.deployment.items()):
            if r["event"] != "classified":
                print(f"  {name}: {r['event']} {r['reason']}")
    elif result.deployment:
        sampled = {k: r for k, r in result.deployment.items() if r["event"] == "sampled"}
        speeds = sorted(r["images_per_s"] for r in sampled.values())
        own = sum(1 for r in sampled.values() if r.get("personal"))
        card = d / "deploy" / "card.json"
        print(
            f"deployed {d / 'deploy' / 'model.onnx'} (signed; card {card}): "
            f"{len(sampled)}/{len(result.deployment)} devices sampled from it"
            + (f" ({own} from their own model: shared parts over their local parts)" if own else "")
            + (f", median {speeds[len(speeds) // 2]:.1f} images/s (ONNX Runtime)" if speeds else "")
        )
        for name, r in sorted(result.deployment.items()):
            if r["event"] != "sampled":
                print(f"  {name}: {r['event']} {r['reason']}")
    print(f"run directory: {d}")
    print(f"  report:      {d / 'report.png'}")
    if "grids" in figures:
        before, after = figures["grids"]
        print(f"  before:      {d / before} (the start)")
        print(f"  after:       {d / after}")
    elif grids:
        print(f"  samples:     {d / grids[-1]}")
    if result.deployment and not classified:
        print(f"  device grids: {d / 'devices'}/<device>/samples/")
    if (d / "synthetic").is_dir():
        print(f"  synthetic:   {d / 'synthetic'}/<device>.png (the cloud's images per device)")
    print(f"  metrics:     {d / 'metrics.jsonl'}")
    print(f"  prometheus:  {d / 'prometheus.json'}")
    print(f"  logs:        {d / 'logs'}")
