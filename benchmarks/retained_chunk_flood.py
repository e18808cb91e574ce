"""The broker's memory under retained blob-chunk floods (docs/reliability.md, "Broker").

Starts Mosquitto from the ``mosquitto.conf`` that ``estuary provision`` writes (default
settings: 1 GiB heap limit), with ``sys_interval 1`` and edge0 allowed to read
``$SYS/broker/heap/current`` added for the measurement; connects the cloud's bus with the
cloud's credentials and default settings; then dev001's credentials retain ``--count``
chunks of 1 MiB on its own blob-chunk topics, ``--floods`` times, ``--gap-s`` apart. Prints
one JSON object: what each flood got in, the broker's heap (sampled every second) and
resident memory, how many chunks the broker still holds afterwards, and the cloud's
counters::

    PYTHONPATH=$PWD python3 benchmarks/retained_chunk_flood.py

Needs ``mosquitto`` on the PATH; about 1.2 GiB over the loopback with the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from estuary.provision import provision
from shared.config import BrokerSection
from shared.transport.mqtt import MqttBus
from shared.wire.messages import Topics
from tests.attack_tools import Hostile, MosquittoProcess, retained_under
from tests.test_attacks_broker import config, login, publish_until_cut

MIB = 1 << 20
RUN = "atk-brk"


def measure(floods: int, count: int, gap_s: float, settle_s: float) -> dict[str, Any]:
    """Run the floods (see the module's doc); the figures."""
    work = Path(tempfile.mkdtemp(prefix="estuary-chunk-flood-"))
    work.chmod(0o755)  # the broker's own user reads it when started as root
    try:
        out = work / "prov"
        provision(config(RUN), out)
        with open(out / "mosquitto" / "acl", "a", encoding="utf-8") as f:
            f.write("\nuser edge0\ntopic read $SYS/broker/heap/current\n")
        with open(out / "mosquitto" / "mosquitto.conf", "a", encoding="utf-8") as f:
            f.write("sys_interval 1\n")
        return _measure(out, work, floods, count, gap_s, settle_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure(out: Path, work: Path, floods: int, count: int, gap_s: float,
             settle_s: float) -> dict[str, Any]:  # fmt: skip
    topics = Topics(RUN)
    edge_pw = (out / "credentials" / "edge0.password").read_text().strip()
    rss: list[tuple[float, int]] = []
    heap: list[tuple[float, int]] = []
    stop = threading.Event()
    with MosquittoProcess(out / "mosquitto" / "mosquitto.conf", work) as broker:
        t0 = time.monotonic()

        def sample() -> None:
            while not stop.is_set():
                rss.append((time.monotonic() - t0, broker.rss()))
                stop.wait(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        probe = Hostile(broker.host, broker.port, "edge0", user="edge0", password=edge_pw)
        probe.on_message = lambda _t, p: heap.append((time.monotonic() - t0, int(p)))
        probe.subscribe("$SYS/broker/heap/current")
        cloud_pw = str(out / "credentials" / "cloud.password")
        settings = BrokerSection(host=broker.host, port=broker.port, connect_timeout_s=10,
                                 username="cloud", password_file=cloud_pw)  # fmt: skip
        bus = MqttBus(settings, run=RUN, client_id=f"{RUN}-cloud", home="cloud").connect()
        try:
            time.sleep(1.0)
            baseline = broker.rss()
            payload = os.urandom(MIB)
            results = []
            for k in range(floods):
                items = [(topics.blob_chunk("device/dev001", f"{k:04x}{i:060x}", MIB, 0), payload)
                         for i in range(count)]  # fmt: skip
                evil = login(out, broker, "dev001")
                start = time.monotonic()
                try:
                    codes, cut = publish_until_cut(evil, items)
                finally:
                    evil.close()
                taken = sum(c < 0x80 for c in codes)
                results.append({"start_s": round(start - t0, 1), "taken": taken, "cut": cut,
                                "seconds": round(time.monotonic() - start, 2)})  # fmt: skip
                time.sleep(gap_s)
            time.sleep(settle_s)
            stop.set()
            sampler.join()
            probe.close()
            held = retained_under(broker.host, broker.port, f"{topics.base}/device/+/blob/#",
                                  user="edge0", password=edge_pw)  # fmt: skip
            counters = bus.traffic.transport()
        finally:
            bus.close()
    return {
        "baseline_rss_mib": round(baseline / MIB, 1),
        "floods": results,
        "peak_rss_mib": round(max(r for _, r in rss) / MIB, 1),
        "end_rss_mib": round(rss[-1][1] / MIB, 1),
        "heap_mib": [(round(t, 1), round(h / MIB)) for t, h in heap],
        "retained_at_end": len(held),
        "retained_chunks_cleared": counters.get("retained_chunks_cleared", 0),
        "retained_sweeps": counters.get("retained_sweeps", 0),
    }


def main() -> None:
    """Parse the arguments and print the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floods", type=int, default=4)
    parser.add_argument("--count", type=int, default=300, help="1 MiB chunks per flood")
    parser.add_argument("--gap-s", type=float, default=3.0)
    parser.add_argument("--settle-s", type=float, default=12.0)
    args = parser.parse_args()
    print(json.dumps(measure(args.floods, args.count, args.gap_s, args.settle_s)))


if __name__ == "__main__":
    main()
