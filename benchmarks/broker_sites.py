"""Per broker, what a federation of processes costs it: one broker against a broker per edge
site (``federation.brokers``), with 2 edges and 2, 4 and 8 devices per edge (fmnist-tiny).

Each run is a real federation as ``estuary demo`` starts it (:class:`estuary.launcher.Hierarchy`
over mosquitto, every role its own process), evaluation and deployment off. In per-edge mode
the cloud broker and one mosquitto per edge site, each bridged to the cloud broker with
:func:`estuary.provision.bridge_conf` (open brokers, as the demo runs them). Every broker
publishes its ``$SYS`` counters every second (``sys_interval 1``); an observer subscribed to
``$SYS/broker/bytes/received``, ``$SYS/broker/bytes/sent`` and
``$SYS/broker/clients/connected`` on each broker records them. Per broker and run:

- bytes per round: (received + sent) from just before the roles start until every role has
  exited, divided by the rounds (registrations, the final state and the observer's own
  ``$SYS`` traffic, three short messages a second, included);
- peak connections: the largest ``clients/connected`` it published (sampled each second;
  the observer counts, and each bridge on both of its brokers);
- peak memory: ``VmHWM`` of the mosquitto process, read before it stops.

Each run's final model sha256 (``summary.json``) is recorded: the two modes of a device count
must end at the same model. Run from the repository root::

    python benchmarks/broker_sites.py --rounds 3 --repeats 3 \\
        --out benchmarks/results/broker_sites/table.json \\
        --markdown benchmarks/results/broker_sites/table.md \\
        --plot benchmarks/results/broker_sites/broker_sites.png

``--from-json FILE`` rebuilds the table and plot of an earlier ``--out`` without running;
``--tap`` adds, per run, the payload bytes the cloud broker delivered by topic shape (a
diagnostic: the tap's deliveries add to that broker's counters).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from estuary.launcher import Hierarchy
from estuary.provision import bridge_conf
from shared.config import RunConfig, config_from_dict
from shared.errors import EstuaryError
from shared.federation.topology import sites
from shared.transport.local_broker import LocalBroker
from shared.wire.messages import Topics

#: mosquitto publishes its $SYS tree this often (s)
SYS_INTERVAL_S = 1
SYS_TOPICS = (
    "$SYS/broker/bytes/received",
    "$SYS/broker/bytes/sent",
    "$SYS/broker/clients/connected",
)
#: how long after the last role exits the counters are read: two $SYS periods
SETTLE_S = 2.5 * SYS_INTERVAL_S
RUN_TIMEOUT_S = 900.0


def bench_config(devices_per_edge: int, brokers: str, rounds: int, name: str) -> RunConfig:
    """fmnist-tiny from the shipped pretrained generator on Fashion-MNIST, 2 edges, every
    device in every round, 2 local steps: short rounds whose traffic is the model's."""
    return config_from_dict(
        {
            "run": {"name": name, "seed": 0, "rounds": rounds},
            "federation": {
                "num_devices": 2 * devices_per_edge,
                "num_edges": 2,
                "brokers": brokers,
                "round_deadline_s": 240,
                "registration_timeout_s": 120,
            },
            "data": {"dataset": "fashion-mnist", "partition": "iid"},
            "model": {"preset": "fmnist-tiny", "init": "pretrained"},
            "train": {"local_steps": 2, "batch_size": 8, "lr": 2e-4, "threads": 1},
            "deploy": {"enabled": False},
            "eval": {"every": 0, "sample_every": 0, "checkpoint_every": 1},
        },
        source="benchmarks/broker_sites.py",
    )


@dataclass
class SysWatch:
    """An observer of one broker's ``$SYS`` counters (latest values, peak connections)."""

    site: str
    broker: LocalBroker
    latest: dict[str, int] = field(default_factory=dict)
    peak_connected: int = 0
    _client: mqtt.Client | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, timeout_s: float = 10.0) -> SysWatch:
        """Connect and wait until every counter has been published once (bounded)."""
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"sys-watch-{self.site}",
                        protocol=mqtt.MQTTv311)  # fmt: skip
        c.on_connect = self._on_connect
        c.on_message = self._on_message
        c.connect(self.broker.host, self.broker.port, keepalive=30)
        c.loop_start()
        self._client = c
        end = time.monotonic() + timeout_s
        while not self.ready():
            if time.monotonic() > end:
                raise EstuaryError(f"no $SYS counters from the {self.site} broker in {timeout_s} s")
            time.sleep(0.1)
        return self

    @staticmethod
    def _on_connect(c: mqtt.Client, *_: Any) -> None:
        for topic in SYS_TOPICS:
            c.subscribe(topic, qos=0)

    def ready(self) -> bool:
        """Whether every counter has been seen."""
        with self._lock:
            return all(t in self.latest for t in SYS_TOPICS)

    def _on_message(self, _c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        try:
            value = int(msg.payload.decode().split()[0])
        except (ValueError, IndexError, UnicodeDecodeError):
            return
        with self._lock:
            self.latest[msg.topic] = value
            if msg.topic.endswith("/clients/connected"):
                self.peak_connected = max(self.peak_connected, value)

    def bytes_total(self) -> int:
        """Bytes received plus sent so far, by the broker's last $SYS message."""
        return sum(self.counters())

    def counters(self) -> tuple[int, int]:
        """Bytes received and bytes sent so far, by the broker's last $SYS messages."""
        with self._lock:
            return self.latest[SYS_TOPICS[0]], self.latest[SYS_TOPICS[1]]

    def stop(self) -> None:
        """Disconnect."""
        if self._client is not None:
            self._client.loop_stop()
            self._client.disconnect()


class TopicTap:
    """A subscriber to every topic of a run on one broker, summing payload bytes by topic
    shape (device and edge names, digests and numbers replaced): what crosses to the cloud,
    for ``--tap`` diagnostic runs only (its own deliveries add to the broker's bytes)."""

    def __init__(self, broker: LocalBroker, base: str) -> None:
        self.by_shape: dict[str, int] = {}
        self._lock = threading.Lock()
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="broker-sites-tap",
                        protocol=mqtt.MQTTv311)  # fmt: skip
        c.on_connect = lambda cl, ud, fl, rc, pr: cl.subscribe(f"{base}/#", qos=1)
        c.on_message = self._on_message
        c.connect(broker.host, broker.port, keepalive=30)
        c.loop_start()
        self._client = c
        self._base = base

    @staticmethod
    def shape(topic: str) -> str:
        """``topic`` with device and edge names, sha256 digests and numbers generalised."""
        out = []
        for level in topic.split("/"):
            if re.fullmatch(r"dev\d+", level):
                level = "<d>"
            elif re.fullmatch(r"edge\d+", level):
                level = "<e>"
            elif re.fullmatch(r"[0-9a-f]{64}", level):
                level = "<sha>"
            elif level.isdigit():
                level = "<n>"
            out.append(level)
        return "/".join(out)

    def _on_message(self, _c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        key = self.shape(msg.topic[len(self._base) + 1 :])
        with self._lock:
            self.by_shape[key] = self.by_shape.get(key, 0) + len(msg.payload)

    def stop(self) -> dict[str, int]:
        """Disconnect; the payload bytes by topic shape, largest first."""
        self._client.loop_stop()
        self._client.disconnect()
        with self._lock:
            return dict(sorted(self.by_shape.items(), key=lambda kv: -kv[1]))


def peak_rss_bytes(broker: LocalBroker) -> int:
    """``VmHWM`` of the broker's mosquitto process (0 where unreadable)."""
    proc = broker.process
    if proc is None:
        return 0
    try:
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def run_once(
    devices_per_edge: int, brokers: str, rounds: int, workdir: Path, *, tap: bool = False
) -> dict[str, Any]:
    """One federation; its per-broker figures and final model sha256 (with ``tap``, the
    payload bytes the cloud broker delivered by topic shape too: a diagnostic run)."""
    name = f"sites{devices_per_edge}"
    cfg = bench_config(devices_per_edge, brokers, rounds, name)
    sys_line = f"sys_interval {SYS_INTERVAL_S}"
    cloud = LocalBroker(kind="mosquitto", workdir=workdir / "cloud", extra_conf=[sys_line],
                        memory_bytes=cfg.broker.broker_memory_bytes)  # fmt: skip
    section = cfg.broker.model_copy(update={"host": cloud.host, "port": cloud.port})
    cfg = cfg.model_copy(update={"broker": section})
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "config.json"
    path.write_text(cfg.to_json())
    hier = Hierarchy(cfg, path, workdir / "run", cloud, metrics=False, evaluate=False)
    if brokers == "per-edge":
        for site in sites(cfg)[1:]:
            stanza = bridge_conf(cfg, site, f"{cloud.host}:{cloud.port}", None).splitlines()
            hier.site_brokers[site.name] = LocalBroker(
                kind="mosquitto", host=cloud.host, workdir=workdir / site.name,
                memory_bytes=cfg.broker.broker_memory_bytes, extra_conf=[sys_line, *stanza],
            )  # fmt: skip
    watches: list[SysWatch] = []
    tapped: TopicTap | None = None
    by_shape: dict[str, int] = {}
    t0 = time.monotonic()
    try:
        for b in hier.brokers().values():
            b.start()
        time.sleep(2 * SYS_INTERVAL_S)  # the bridges connect
        watches = [SysWatch(site, b).start() for site, b in hier.brokers().items()]
        time.sleep(1.5 * SYS_INTERVAL_S)
        if tap:
            tapped = TopicTap(cloud, Topics(name).base)
            time.sleep(0.5)
        before = {w.site: w.counters() for w in watches}
        hier.start_all()
        code = hier.wait("cloud", RUN_TIMEOUT_S)
        if code != 0:
            raise EstuaryError(f"cloud exited with {code}: {hier.procs['cloud'].log_tail(20)}")
        for p in hier.procs.values():
            hier.wait(p.name, 60)
        failed = hier.failed()
        if failed:
            raise EstuaryError(f"{failed[0].name} failed: {failed[0].log_tail(20)}")
        wall_s = time.monotonic() - t0
        time.sleep(SETTLE_S)
        per_broker = {
            w.site: {
                "bytes_received": w.counters()[0] - before[w.site][0],
                "bytes_sent": w.counters()[1] - before[w.site][1],
                "bytes_per_round": (w.bytes_total() - sum(before[w.site])) / rounds,
                "peak_connected": w.peak_connected,
                "peak_rss_bytes": peak_rss_bytes(w.broker),
            }
            for w in watches
        }
    finally:
        if tapped is not None:
            by_shape = tapped.stop()
        for w in watches:
            w.stop()
        hier.stop_all(timeout_s=10)
        for b in hier.site_brokers.values():
            b.stop()
        cloud.stop()
    summary = json.loads((hier.run_dir / "summary.json").read_text())
    if summary["rounds"] != rounds:
        raise EstuaryError(f"{summary['rounds']} of {rounds} rounds")
    return {
        "devices_per_edge": devices_per_edge,
        "devices": 2 * devices_per_edge,
        "brokers": brokers,
        "rounds": rounds,
        "wall_s": round(wall_s, 1),
        "final_model_sha256": summary["final_model_sha256"],
        "per_broker": per_broker,
        **({"cloud_payload_bytes_by_topic": by_shape} if tap else {}),
    }


def _kb(n: float) -> str:
    return f"{n / 1000:,.0f}"


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[int, str], list[dict[str, Any]]]:
    out: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault((r["devices_per_edge"], r["brokers"]), []).append(r)
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0], kv[0][1] != "one")))


def cloud_per_round(runs: list[dict[str, Any]]) -> list[float]:
    """The cloud broker's bytes per round of each repeat."""
    return [r["per_broker"]["cloud"]["bytes_per_round"] for r in runs]


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table: per device count and mode, each broker's KB per round (median over the
    repeats; the cloud broker's min-max too), peak connections and peak RSS (the largest
    over the repeats), and the final model(s)."""
    lines = [
        "| devices per edge | brokers | cloud broker KB/round (min-max) | edge0 broker "
        "KB/round | edge1 broker KB/round | peak connections cloud / edge0 / edge1 | "
        "peak RSS MiB cloud / edge0 / edge1 | final model sha256 |",
        "|---:|---|---:|---:|---:|---|---|---|",
    ]
    for (n, mode), runs in _groups(rows).items():
        sites_ = [s for s in ("cloud", "edge0", "edge1") if s in runs[0]["per_broker"]]

        def of(site: str, key: str, runs: list[dict[str, Any]] = runs) -> list[float]:
            return [r["per_broker"][site][key] for r in runs]

        cloud = cloud_per_round(runs)
        cells = [f"{_kb(statistics.median(cloud))} ({_kb(min(cloud))}-{_kb(max(cloud))})"]
        for site in ("edge0", "edge1"):
            cells.append(_kb(statistics.median(of(site, "bytes_per_round")))
                         if site in sites_ else "-")  # fmt: skip
        conns = " / ".join(str(int(max(of(s, "peak_connected")))) for s in sites_)
        rss = " / ".join(f"{max(of(s, 'peak_rss_bytes')) / 2**20:.1f}" for s in sites_)
        shas = ", ".join(sorted({f"`{r['final_model_sha256'][:12]}`" for r in runs}))
        lines.append(f"| {n} | {mode} | {' | '.join(cells)} | {conns} | {rss} | {shas} |")
    return "\n".join(lines) + "\n"


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The cloud broker's median bytes per round at the largest against the smallest device
    count, per mode, and whether every run of a device count ended at one model."""
    out: dict[str, Any] = {}
    groups = _groups(rows)
    counts = sorted({n for n, _ in groups})
    for mode in ("one", "per-edge"):
        cloud = {n: statistics.median(cloud_per_round(runs))
                 for (n, m), runs in groups.items() if m == mode}  # fmt: skip
        if len(cloud) == len(counts) and len(counts) > 1:
            out[f"cloud_ratio_{counts[-1]}_over_{counts[0]}_{mode}"] = round(
                cloud[counts[-1]] / cloud[counts[0]], 3
            )
    out["same_model_per_count"] = {
        str(n): len({r["final_model_sha256"] for r in rows if r["devices_per_edge"] == n}) == 1
        for n in counts
    }
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """The cloud broker's MB per round against devices per edge, both modes (median, with
    the min-max of the repeats), and each site broker's in per-edge mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    series = [("one", "cloud", "one broker: the broker", "o-"),
              ("per-edge", "cloud", "per-edge: cloud broker", "s-"),
              ("per-edge", "edge0", "per-edge: edge0 site broker", "^--"),
              ("per-edge", "edge1", "per-edge: edge1 site broker", "v--")]  # fmt: skip
    for mode, site, label, style in series:
        xs, med, lo, hi = [], [], [], []
        for (n, m), runs in groups.items():
            if m != mode:
                continue
            vals = [r["per_broker"][site]["bytes_per_round"] / 1e6 for r in runs]
            xs.append(n)
            med.append(statistics.median(vals))
            lo.append(statistics.median(vals) - min(vals))
            hi.append(max(vals) - statistics.median(vals))
        if xs:
            ax.errorbar(xs, med, yerr=[lo, hi], fmt=style, capsize=3, label=label)
    ax.set_xlabel("devices per edge (2 edges)")
    ax.set_ylabel("MB per round through the broker (in + out)")
    ax.set_xticks(sorted({n for n, _ in groups}))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("fmnist-tiny, 3 rounds: bytes per round per broker")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every repeat of every device count in every mode, alternating; one row per run."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="broker-sites-") as tmp:
        root = args.workdir or Path(tmp)
        for rep in range(args.repeats):
            for n in args.devices_per_edge:
                for mode in args.modes:
                    where = root / f"{mode}-{n}-r{rep}"
                    row = run_once(n, mode, args.rounds, where, tap=args.tap)
                    row["repeat"] = rep
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run every device count in both modes (alternating), print and write the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices-per-edge", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of every device count and mode, alternating (median reported)",
    )
    p.add_argument("--out", type=Path, help="write the figures as JSON")
    p.add_argument("--markdown", type=Path, help="write the table as markdown")
    p.add_argument(
        "--from-json",
        type=Path,
        help="no runs: the table, verdict and plot of an earlier --out file",
    )
    p.add_argument("--plot", type=Path, help="write the bytes-per-round plot (PNG)")
    p.add_argument("--workdir", type=Path, help="keep the runs here (default: a temp dir)")
    p.add_argument("--modes", nargs="+", default=["one", "per-edge"], choices=["one", "per-edge"])
    p.add_argument(
        "--tap",
        action="store_true",
        help="diagnostic: also sum the payload bytes the cloud broker delivered by "
        "topic shape (the tap's deliveries add to its byte counters)",
    )
    args = p.parse_args(argv)
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
        rows = doc["rows"]
        doc["verdict"] = verdict(rows)
    else:
        doc = {"command": " ".join(["python", "benchmarks/broker_sites.py",
                                    *(sys.argv[1:] if argv is None else argv)]),
               "rows": measure(args)}  # fmt: skip
        rows = doc["rows"]
        doc = {"benchmark": "broker_sites", "sys_interval_s": SYS_INTERVAL_S, **doc,
               "verdict": verdict(rows)}  # fmt: skip
    table = markdown(rows)
    print(table)
    print(json.dumps(doc["verdict"], indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(rows, args.plot)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
