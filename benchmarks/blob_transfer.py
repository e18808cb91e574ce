"""Blob transfer through a real mosquitto on loopback: the MqttBus blob layer against raw paho.

Two measurements, each against the real alternative in the same run:

1. **One receiver.** A sender bus (home ``cloud``) holds the blob; a fresh receiver bus (home
   ``edge/edge0``) fetches it with ``get_blob``: timed from the call to its return, so the
   chunk subscription, the request, the chunk stream, sha256 verification and storing in the
   memory blob store are all inside. The raw alternative is one paho client publishing the
   same bytes as 1 MiB QoS 1 chunks (one topic per chunk, the bus's max in-flight window) to
   one paho subscriber that keeps every chunk's payload (the least a receiver must do to end
   up holding the blob: no hashing, no joining): timed from the first publish to the last
   chunk received. The legs alternate (layer first on even repeats, raw first on odd ones)
   so drift on a shared machine hits both. Ratio = throughput(layer) / throughput(raw) per
   repeat; the bar is a median ratio of at least 0.8. Two diagnostic legs: "raw, discarding"
   is the same raw stream into a subscriber that only counts the chunks (it never holds the
   blob, so it skips the page faults of 136 MB of fresh memory, which cost about 0.08 s on
   the 2-core VM this was written on); "transport only" runs the layer's request and chunk
   stream into a bus that only counts chunks (no hashing or assembly), to separate the
   transport path from the verification work. The layer's buses receive with
   :class:`shared.transport.paho_lean.LeanClient` (paho's client with a one-copy PUBLISH decode) as
   they do in a deployment; the raw legs use paho's own ``mqtt.Client`` unchanged.
The sending side (the blob layer's sender bus and the raw paho publisher) runs in a child
process, as the cloud does in a deployment, so the two sides do not share one interpreter.

2. **Fan-out to 8 receivers.** Eight receiver buses fetch the same blob at once from one
   sender (the sender coalesces their requests; its ``chunks_sent`` is compared with
   8 x chunk count), against one paho publisher sending the chunks once to 8 subscribers
   that keep them.
   Ratio = wall(layer) / wall(raw) per repeat.

Sizes are in MiB (2**20 bytes), throughputs in MiB/s. The default blob is the real
ddpm-cifar10 fp32 state (``encode_tensors`` of its ``state_dict``).

    python benchmarks/blob_transfer.py --out benchmarks/results/blob_transfer.json
    python benchmarks/blob_transfer.py --quick    # 1 repeat of 16 MiB random bytes
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from shared.config import BrokerSection
from shared.transport.blob_transfer import chunk_count
from shared.transport.local_broker import LocalBroker, find_mosquitto
from shared.transport.mqtt import QOS, MqttBus
from shared.wire.codec import sha256_hex

MIB = 1 << 20
RUN = "bench"
SENDER_HOME = "cloud"
KIND = "global_model"
RAW_INFLIGHT = 64  # what MqttBus._make_client sets, so raw paho gets the same window
BAR_RATIO = 0.8


# -- the blob ----------------------------------------------------------------------------


def make_blob(size_mib: float | None, seed: int) -> tuple[bytes, str]:
    """The real ddpm-cifar10 state (``size_mib`` None) or that many MiB of seeded random bytes."""
    if size_mib is None:
        from shared.models.presets import build_unet
        from shared.wire.codec import encode_tensors

        return encode_tensors(build_unet("ddpm-cifar10", seed=seed).state_dict()), "ddpm-cifar10"
    return random.Random(seed).randbytes(int(size_mib * MIB)), f"random {size_mib:g} MiB"


def host_info() -> dict[str, Any]:
    """CPU count, Python, paho and mosquitto versions of this machine."""
    binary = find_mosquitto()
    version = "not found"
    if binary:
        out = subprocess.run(
            [binary, "-h"], capture_output=True, text=True, timeout=10, check=False
        )
        version = (out.stdout or out.stderr).splitlines()[0].strip()
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "paho_mqtt": paho.mqtt.__version__,
        "mosquitto": version,
        "loadavg_1_5_15": list(os.getloadavg()),
    }


# -- the layer: MqttBus ------------------------------------------------------------------


def connect_bus(settings: BrokerSection, home: str, client_id: str) -> MqttBus:
    """A connected bus with a memory-only blob store."""
    return MqttBus(settings, run=RUN, client_id=client_id, home=home).connect()


def layer_fetch(
    receiver: MqttBus, name: str, sha: str, size: int, timeout_s: float
) -> tuple[float, float]:
    """(start, end) perf_counter of one ``get_blob`` of the sender's blob into ``receiver``."""
    endpoint = receiver.endpoint(name, receiver.home)
    start = time.perf_counter()
    data = endpoint.get_blob(sha, size, kind=KIND, src=SENDER_HOME, timeout_s=timeout_s)
    end = time.perf_counter()
    if len(data) != size:
        raise RuntimeError(f"{name} got {len(data)} bytes, expected {size}")
    return start, end


def layer_single(settings: BrokerSection, sha: str, size: int, tag: str, timeout_s: float) -> float:
    """Seconds for a fresh receiver bus to fetch the blob (connection set up beforehand)."""
    receiver = connect_bus(settings, "edge/edge0", f"bench-edge0-{tag}")
    try:
        start, end = layer_fetch(receiver, "edge0", sha, size, timeout_s)
    finally:
        receiver.close()
    return end - start


def transport_only(
    settings: BrokerSection, sha: str, size: int, tag: str, timeout_s: float
) -> float:
    """Diagnostic: the same request and chunk stream as ``get_blob``, but the receiving bus only
    counts chunks in its network thread (no hand-off, hashing or assembly). Separates the
    transport path from the verification work a real fetch does."""
    import queue as queue_mod

    from shared.transport.blob_fetcher import Fetch

    n = chunk_count(size, settings.chunk_bytes)
    receiver = connect_bus(settings, "edge/edge0", f"bench-tonly-{tag}")
    got = [0]
    done = threading.Event()

    def count(_topic: str, _payload: bytes) -> None:
        got[0] += 1
        if got[0] == n:
            done.set()

    try:
        receiver._blob_fetcher.route_chunk = count  # type: ignore[method-assign,assignment]
        receiver._subscribe_wait(
            receiver.topics.blob_chunk(SENDER_HOME, sha, settings.chunk_bytes, "+")
        )
        fetch = Fetch(
            sha, SENDER_HOME, size, settings.chunk_bytes, n, queue_mod.Queue(), bytearray(n)
        )
        start = time.perf_counter()
        receiver._blob_fetcher._ask(fetch, list(range(n)))
        if not done.wait(timeout_s):
            raise TimeoutError(f"transport-only receiver got {got[0]}/{n} chunks in time")
        return time.perf_counter() - start
    finally:
        receiver.close()


def run_threads(fns: list[Callable[[], None]], timeout_s: float) -> None:
    """Run ``fns`` on one thread each; raise if any fails or outlives ``timeout_s``."""
    errors: list[BaseException] = []

    def guarded(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as err:  # reported on the main thread below
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(fn,), daemon=True) for fn in fns]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"threads still running after {timeout_s:g}s")
    if errors:
        raise errors[0]


def layer_fanout(
    settings: BrokerSection,
    sender: SenderProcess,
    sha: str,
    size: int,
    receivers: int,
    tag: str,
    timeout_s: float,
) -> dict[str, Any]:
    """Wall seconds until ``receivers`` fresh buses fetching at once all hold the blob."""
    buses: list[MqttBus] = []
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * receivers
    sent_before = sender.chunks_sent()

    def fetch(i: int) -> Callable[[], None]:
        def go() -> None:
            spans[i] = layer_fetch(buses[i], f"edge{i}", sha, size, timeout_s)

        return go

    try:
        for i in range(receivers):
            buses.append(connect_bus(settings, f"edge/edge{i}", f"bench-fan{i}-{tag}"))
        run_threads([fetch(i) for i in range(receivers)], timeout_s)
    finally:
        for bus in buses:
            bus.close()
    counters = [bus.traffic.transport() for bus in buses]
    wall = max(e for _, e in spans) - min(s for s, _ in spans)
    return {
        "wall_s": wall,
        "chunks_sent": int(sender.chunks_sent() - sent_before),
        "chunks_duplicate": int(sum(c.get("chunks_duplicate", 0.0) for c in counters)),
        "chunks_rerequested": int(sum(c.get("chunks_rerequested", 0.0) for c in counters)),
        "chunks_unsolicited": int(sum(c.get("chunks_unsolicited", 0.0) for c in counters)),
    }


# -- the alternative: raw paho -----------------------------------------------------------


@dataclass
class _Sink:
    """Receives the chunks on one subscriber, keeping their payloads when ``keep`` (else only
    counting them); notes when the last one came."""

    expected: int
    keep: bool = True
    seen: set[str] = field(default_factory=set)
    kept: list[bytes | bytearray] = field(default_factory=list)
    nbytes: int = 0
    last: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)

    def on_message(self, _c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        if msg.topic in self.seen:
            return
        self.seen.add(msg.topic)
        if self.keep:
            self.kept.append(msg.payload)  # at most ``expected`` chunks: topics are unique
        self.nbytes += len(msg.payload)
        if len(self.seen) == self.expected:
            self.last = time.perf_counter()
            self.done.set()


def raw_client(host: str, port: int, client_id: str, timeout_s: float) -> mqtt.Client:
    """A connected MQTT v5 paho client with its network loop running."""
    connected = threading.Event()
    client = mqtt.Client(
        callback_api_version=CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=mqtt.MQTTv5,
    )
    client.max_inflight_messages_set(RAW_INFLIGHT)
    client.on_connect = lambda *_: connected.set()
    client.connect_async(host, port, clean_start=True)
    client.loop_start()
    if not connected.wait(timeout_s):
        client.loop_stop()
        raise TimeoutError(f"raw client {client_id} not connected within {timeout_s:g}s")
    return client


def raw_subscribe(client: mqtt.Client, pattern: str, sink: _Sink, timeout_s: float) -> None:
    """Subscribe ``sink`` to ``pattern`` and wait for the SUBACK."""
    acked = threading.Event()
    client.on_message = sink.on_message
    client.on_subscribe = lambda *_: acked.set()
    rc, _mid = client.subscribe(pattern, qos=QOS)
    if rc != mqtt.MQTT_ERR_SUCCESS or not acked.wait(timeout_s):
        raise TimeoutError(f"no SUBACK for {pattern} within {timeout_s:g}s (rc {rc})")


def close_raw(client: mqtt.Client) -> None:
    """Disconnect and stop the network thread."""
    client.disconnect()
    client.loop_stop()


def raw_transfer(
    host: str,
    port: int,
    sender: SenderProcess,
    size: int,
    subscribers: int,
    tag: str,
    timeout_s: float,
    keep: bool = True,
) -> float:
    """Seconds from the publish command until every subscriber has every 1 MiB chunk (kept in
    memory when ``keep``, else only counted)."""
    n = chunk_count(size, MIB)
    prefix = f"{RUN}/raw/{tag}"
    sinks = [_Sink(n, keep) for _ in range(subscribers)]
    subs: list[mqtt.Client] = []
    try:
        for i, sink in enumerate(sinks):
            subs.append(raw_client(host, port, f"bench-rawsub{i}-{tag}", timeout_s))
            raw_subscribe(subs[-1], f"{prefix}/+", sink, timeout_s)
        start = time.perf_counter()
        sender.command(f"raw {tag}")
        deadline = time.monotonic() + timeout_s
        for sink in sinks:
            if not sink.done.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"raw subscriber got {len(sink.seen)}/{n} chunks in time")
        sender.wait_sent()
    finally:
        for client in subs:
            close_raw(client)
    if any(s.nbytes != size for s in sinks):
        raise RuntimeError("a raw subscriber received the wrong number of bytes")
    return max(s.last for s in sinks) - start


# -- the sending side, in its own process (as the cloud is in a deployment) ----------------


def serve(port: int, size_mib: float | None, seed: int, timeout_s: float) -> None:
    """Child mode: hold the blob in a sender bus and a raw publisher; obey stdin commands:
    ``raw TAG`` publishes the chunks raw on ``bench/raw/TAG/i``; ``stats`` prints the sender's
    transport counters as JSON; ``quit`` exits."""
    import sys

    data, _ = make_blob(size_mib, seed)
    settings = BrokerSection(host="127.0.0.1", port=port)
    sender = connect_bus(settings, SENDER_HOME, "bench-cloud")
    publisher = raw_client("127.0.0.1", port, "bench-rawpub", timeout_s)
    sender.endpoint("cloud", SENDER_HOME).put_blob(data, kind=KIND)
    n = chunk_count(len(data), MIB)
    print("ready", flush=True)
    try:
        for line in sys.stdin:
            cmd, _, tag = line.strip().partition(" ")
            if cmd == "raw":
                for i in range(n):
                    publisher.publish(
                        f"{RUN}/raw/{tag}/{i}", data[i * MIB : (i + 1) * MIB], qos=QOS
                    )
                print("sent", flush=True)
            elif cmd == "stats":
                print(json.dumps(sender.traffic.transport()), flush=True)
            elif cmd == "quit":
                break
    finally:
        close_raw(publisher)
        sender.close()


class SenderProcess:
    """The parent's handle on the ``--serve`` child."""

    def __init__(self, port: int, size_mib: float | None, seed: int, timeout_s: float) -> None:
        import sys

        argv = [sys.executable, __file__, "--serve", str(port), "--seed", str(seed)]
        argv += ["--timeout", str(timeout_s)]
        if size_mib is not None:
            argv += ["--size-mb", str(size_mib)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self._line() != "ready":
            raise RuntimeError("the sender process did not start")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def command(self, cmd: str) -> None:
        """Send one command line (not waiting for its answer)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def chunks_sent(self) -> float:
        """The sender bus's ``chunks_sent`` counter."""
        self.command("stats")
        return float(json.loads(self._line()).get("chunks_sent", 0.0))

    def wait_sent(self) -> None:
        """Read the ``sent`` answer of a ``raw`` command."""
        if self._line() != "sent":
            raise RuntimeError("the sender process did not finish a raw publish")

    def close(self) -> None:
        """Ask the child to quit; kill it if it does not."""
        try:
            self.command("quit")
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)


# -- the run -----------------------------------------------------------------------------


def mib_s(size: int, seconds: float) -> float:
    """Throughput in MiB/s."""
    return size / MIB / seconds


def single_repeat(
    settings: BrokerSection,
    sender: SenderProcess,
    data: bytes,
    sha: str,
    rep: int,
    timeout_s: float,
) -> dict[str, float]:
    """One layer/raw pair (plus the two diagnostics), layer first on even ``rep`` (0-based),
    raw first otherwise."""
    size = len(data)
    order = ["layer", "transport", "discard", "raw"]
    if rep % 2:
        order.reverse()
    secs: dict[str, float] = {}
    for which in order:
        gc.collect()
        if which == "layer":
            secs[which] = layer_single(settings, sha, size, f"s{rep}", timeout_s)
        elif which == "transport":
            secs[which] = transport_only(settings, sha, size, f"s{rep}", timeout_s)
        else:
            secs[which] = raw_transfer(
                settings.host,
                settings.port,
                sender,
                size,
                1,
                f"s{rep}{which}",
                timeout_s,
                keep=which == "raw",
            )
    return {
        "layer_s": secs["layer"],
        "raw_s": secs["raw"],
        "layer_mib_s": mib_s(size, secs["layer"]),
        "raw_mib_s": mib_s(size, secs["raw"]),
        "ratio": secs["raw"] / secs["layer"],  # throughput(layer) / throughput(raw)
        "raw_discard_s": secs["discard"],
        "discard_ratio": secs["discard"] / secs["layer"],
        "transport_s": secs["transport"],
        "transport_ratio": secs["raw"] / secs["transport"],
    }


def fanout_repeat(
    settings: BrokerSection,
    sender: SenderProcess,
    data: bytes,
    sha: str,
    receivers: int,
    rep: int,
    timeout_s: float,
) -> dict[str, float]:
    """One layer/raw fan-out pair, alternating the order like :func:`single_repeat`."""
    size = len(data)
    order = ("layer", "raw") if rep % 2 == 0 else ("raw", "layer")
    out: dict[str, Any] = {}
    for which in order:
        gc.collect()
        if which == "layer":
            layer = layer_fanout(settings, sender, sha, size, receivers, f"f{rep}", timeout_s)
            out["layer_s"] = layer.pop("wall_s")
            out.update(layer)
        else:
            out["raw_s"] = raw_transfer(
                settings.host, settings.port, sender, size, receivers, f"f{rep}", timeout_s
            )
    out["layer_aggregate_mib_s"] = mib_s(receivers * size, out["layer_s"])
    out["raw_aggregate_mib_s"] = mib_s(receivers * size, out["raw_s"])
    out["wall_ratio"] = out["layer_s"] / out["raw_s"]
    return out


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per-key median over repeats."""
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def print_table(title: str, rows: list[dict[str, float]], cols: list[tuple[str, str]]) -> None:
    """One line per repeat plus a median line."""
    print(f"\n{title}")
    print(f"{'repeat':>8}" + "".join(f"{head:>14}" for head, _ in cols))
    for i, row in enumerate(rows):
        print(f"{i + 1:>8}" + "".join(f"{row[key]:>14.3f}" for _, key in cols))
    med = medians(rows)
    print(f"{'median':>8}" + "".join(f"{med[key]:>14.3f}" for _, key in cols))


def main() -> None:
    """Run both measurements, print tables and optionally save JSON."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--size-mb", type=float, default=None, help="random blob of this many MiB")
    ap.add_argument("--quick", action="store_true", help="1 repeat of a 16 MiB random blob")
    ap.add_argument("--receivers", type=int, default=8, help="fan-out receivers")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds any one wait may take")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write results JSON here")
    ap.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)  # child mode: port
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.size_mb, args.seed, args.timeout)
        return
    repeats, size_mib = (1, 16.0) if args.quick else (args.repeats, args.size_mb)
    if repeats < 1 or args.receivers < 1:
        ap.error("--repeats and --receivers must be at least 1")
    data, blob_name = make_blob(size_mib, args.seed)
    sha = sha256_hex(data)
    host_before = host_info()
    print(f"blob: {blob_name}, {len(data)} bytes ({len(data) / MIB:.1f} MiB), sha {sha[:12]}…")

    with LocalBroker(kind="mosquitto") as broker:
        settings = BrokerSection(host=broker.host, port=broker.port)
        sender = SenderProcess(broker.port, size_mib, args.seed, args.timeout)
        try:
            single_repeat(settings, sender, data, sha, -1, args.timeout)  # warm-up, not recorded
            single: list[dict[str, float]] = []
            fanout: list[dict[str, float]] = []
            for rep in range(repeats):
                single.append(single_repeat(settings, sender, data, sha, rep, args.timeout))
                fanout.append(
                    fanout_repeat(settings, sender, data, sha, args.receivers, rep, args.timeout)
                )
                print(
                    f"repeat {rep + 1}: single layer {single[-1]['layer_s']:.2f}s "
                    f"raw {single[-1]['raw_s']:.2f}s ratio {single[-1]['ratio']:.3f} | "
                    f"fan-out layer {fanout[-1]['layer_s']:.2f}s raw {fanout[-1]['raw_s']:.2f}s",
                    flush=True,
                )
        finally:
            sender.close()

    n = chunk_count(len(data), settings.chunk_bytes)
    print_table(
        f"one receiver, {len(data) / MIB:.1f} MiB (ratio = throughput layer / raw)",
        single,
        [
            ("layer s", "layer_s"),
            ("raw s", "raw_s"),
            ("layer MiB/s", "layer_mib_s"),
            ("raw MiB/s", "raw_mib_s"),
            ("ratio", "ratio"),
            ("discard s", "raw_discard_s"),
            ("vs discard", "discard_ratio"),
            ("transport s", "transport_s"),
            ("transp. ratio", "transport_ratio"),
        ],
    )
    print_table(
        f"fan-out to {args.receivers} (wall ratio = layer / raw; "
        f"{args.receivers} x {n} = {args.receivers * n} chunks without coalescing)",
        fanout,
        [
            ("layer s", "layer_s"),
            ("raw s", "raw_s"),
            ("layer MiB/s", "layer_aggregate_mib_s"),
            ("raw MiB/s", "raw_aggregate_mib_s"),
            ("chunks sent", "chunks_sent"),
            ("wall ratio", "wall_ratio"),
        ],
    )
    median_ratio = statistics.median(r["ratio"] for r in single)
    bar = {
        "metric": "median over repeats of throughput(layer) / throughput(raw paho, receiver "
        "keeping the chunks), one receiver",
        "threshold": BAR_RATIO,
        "value": median_ratio,
        "met": median_ratio >= BAR_RATIO,
    }
    print(f"\nbar: median ratio {median_ratio:.3f} >= {BAR_RATIO}: {bar['met']}")
    result = {
        "benchmark": "blob_transfer",
        "blob": {"name": blob_name, "bytes": len(data), "mib": len(data) / MIB, "sha256": sha},
        "settings": {
            "repeats": repeats,
            "receivers": args.receivers,
            "chunks": n,
            "qos": QOS,
            "raw_max_inflight_messages": RAW_INFLIGHT,
            "broker": "mosquitto (shared.transport.local_broker.LocalBroker) on loopback",
            "topology": "sender bus and raw publisher in one child process; receivers in the "
            "parent process (fan-out: 8 receiver buses or paho subscribers on threads of it)",
            "bus": settings.model_dump(),
        },
        "host": host_before,
        "loadavg_after": list(os.getloadavg()),
        "single": {"repeats": single, "median": medians(single)},
        "fanout": {
            "chunks_without_coalescing": args.receivers * n,
            "repeats": fanout,
            "median": medians(fanout),
        },
        "bar": bar,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
