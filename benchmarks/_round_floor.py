"""The transfer floor of a round: the bytes a round of Estuary moves, moved by plain paho
clients through the same mosquitto, with no model work (no encoding, hashing, verifying or
aggregating), each role its own process.

A round of one edge and ``n`` devices moves a model of ``size`` bytes four times along its
critical path, each leg as 1 MiB QoS 1 chunks with paho's in-flight window set as the bus sets
it, every receiver keeping every payload (the least a receiver must do to hold the model):

1. cloud -> edge (the global model),
2. edge -> the ``n`` devices (one publish, ``n`` subscribers: the edge's model),
3. the ``n`` devices -> edge, ``turns`` at a time (their updates; the edge fetches
   ``broker.max_update_fetches``, 2, at once, and with all eight at once the broker's queue
   for the one subscriber overflows and drops chunks),
4. edge -> cloud (the edge's aggregate).

Each leg is timed from its first publish to the moment its last receiver holds the last chunk
(``time.monotonic``, one clock for every process); the floor is the sum of the four legs.

``hashed``: the same with the least a content-addressed transfer adds, sha256 over the bytes
on both sides (a sender hashes the model before its first publish, inside the leg; a
receiver hashes every chunk as it arrives), still no encoding, checking or aggregating.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import threading
import time
from multiprocessing import connection as mp_connection
from multiprocessing.connection import Connection
from typing import Any

MIB = 1 << 20
QOS = 1


def _receive(
    client: Any,
    pattern: str,
    expected: int,
    conn: Connection,
    name: str,
    timeout_s: float,
    hashed: bool = False,
) -> tuple[float, int]:
    """Subscribe to ``pattern``, answer ``ready`` once subscribed, keep every payload (and
    with ``hashed`` hash it) until ``expected`` distinct chunks are in: (the time the last
    arrived, the bytes held)."""
    seen: set[str] = set()
    kept: list[bytes] = []
    done, acked = threading.Event(), threading.Event()
    last = [0.0]
    hasher = hashlib.sha256()

    def on_message(_c: Any, _u: Any, msg: Any) -> None:
        if msg.topic in seen:
            return
        seen.add(msg.topic)
        kept.append(msg.payload)
        if hashed:
            hasher.update(msg.payload)
        if len(seen) == expected:
            last[0] = time.monotonic()
            done.set()

    client.on_message = on_message
    client.on_subscribe = lambda *_: acked.set()
    client.subscribe(pattern, qos=QOS)
    if not acked.wait(timeout_s):
        raise TimeoutError(f"{name}: no SUBACK for {pattern}")
    conn.send(("ready",))
    if not done.wait(timeout_s):
        raise TimeoutError(f"{name}: {len(seen)}/{expected} chunks of {pattern}")
    client.unsubscribe(pattern)
    return last[0], sum(len(k) for k in kept)


def _role(
    name: str,
    host: str,
    port: int,
    size: int,
    conn: Connection,
    timeout_s: float,
    hashed: bool = False,
) -> None:
    """One role process, a paho client as blob_transfer.py's raw leg: obeys ``("sub",
    pattern, chunks)`` (subscribe, answer ``ready``, then ``got <t>`` once it holds that many
    distinct chunks) and ``("pub", prefix)`` (publish the model as chunks ``prefix/i``,
    answer ``sent <t>`` when every PUBACK is in); with ``hashed`` it hashes what it
    publishes first and what it receives as it comes."""
    payload = bytes(size)  # the model's bytes: content does not matter to the broker
    from blob_transfer import raw_client  # the raw leg of the blob benchmark

    client = raw_client(host, port, f"floor-{name}", timeout_s)
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "quit":
                return
            if cmd[0] == "sub":
                _, pattern, expected = cmd
                last, nbytes = _receive(client, pattern, expected, conn, name, timeout_s,
                                        hashed)  # fmt: skip
                conn.send(("got", last, nbytes))
            elif cmd[0] == "pub":
                _, prefix = cmd
                if hashed:
                    hashlib.sha256(payload).hexdigest()
                view = memoryview(payload)
                infos = [client.publish(f"{prefix}/{i}", view[o:o + MIB].tobytes(), qos=QOS)
                         for i, o in enumerate(range(0, size, MIB))]  # fmt: skip
                for info in infos:
                    info.wait_for_publish(timeout_s)
                conn.send(("sent", time.monotonic()))
    finally:
        client.disconnect()
        client.loop_stop()


class FloorRound:
    """The processes of one edge, ``devices`` devices and the cloud, as plain paho clients."""

    def __init__(self, host: str, port: int, devices: int, size: int, timeout_s: float = 300.0,
                 turns: int = 2, hashed: bool = False):  # fmt: skip
        self.size, self.timeout_s, self.turns = size, timeout_s, turns
        self.chunks = -(-size // MIB)
        ctx = mp.get_context("spawn")  # a clean interpreter each, as the roles are
        self.names = ["cloud", "edge", *(f"dev{i}" for i in range(devices))]
        self.conns: dict[str, Connection] = {}
        self.procs: list[Any] = []
        for name in self.names:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_role, args=(name, host, port, size, child, timeout_s,
                                                hashed), daemon=True)  # fmt: skip
            p.start()
            self.conns[name], self.procs = parent, [*self.procs, p]

    def _recv(self, name: str) -> tuple[Any, ...]:
        conn = self.conns[name]
        if not conn.poll(self.timeout_s):
            raise TimeoutError(f"floor: {name} did not answer within {self.timeout_s:g} s")
        return conn.recv()  # type: ignore[no-any-return]

    def leg(self, senders: list[str], receivers: list[str], topic: str,
            at_once: int | None = None) -> float:  # fmt: skip
        """Seconds from the first publish until every receiver holds every chunk of every
        sender (each sender publishes the model under ``topic/<sender>``; with ``at_once``,
        that many senders at a time, the next starting as one has every PUBACK)."""
        for r in receivers:
            self.conns[r].send(("sub", f"{topic}/+/+", self.chunks * len(senders)))
        for r in receivers:
            self._recv(r)
        start = time.monotonic()
        waiting = list(senders)
        busy: list[str] = []
        while waiting or busy:
            while waiting and len(busy) < (at_once or len(senders)):
                s = waiting.pop(0)
                self.conns[s].send(("pub", f"{topic}/{s}"))
                busy.append(s)
            if not waiting:
                break
            ready = mp_connection.wait([self.conns[s] for s in busy], self.timeout_s)
            if not ready:
                raise TimeoutError(f"floor: no sender of {topic} finished in {self.timeout_s:g} s")
            for s in [s for s in busy if self.conns[s] in ready]:
                self._recv(s)
                busy.remove(s)
        ends = []
        for r in receivers:
            _, t, nbytes = self._recv(r)
            if nbytes != self.size * len(senders):
                raise RuntimeError(f"floor: {r} got {nbytes} bytes")
            ends.append(t)
        for s in busy:
            self._recv(s)
        return max(ends) - start

    def round(self, tag: str) -> dict[str, float]:
        """The four legs of one round (s) and their sum, ``floor``."""
        devs = self.names[2:]
        legs = {
            "cloud_to_edge": self.leg(["cloud"], ["edge"], f"floor/{tag}/g"),
            "edge_to_devices": self.leg(["edge"], devs, f"floor/{tag}/e"),
            "devices_to_edge": self.leg(devs, ["edge"], f"floor/{tag}/u", self.turns),
            "edge_to_cloud": self.leg(["edge"], ["cloud"], f"floor/{tag}/a"),
        }
        legs["floor"] = sum(legs.values())
        return legs

    def close(self) -> None:
        """Stop every process."""
        for c in self.conns.values():
            try:
                c.send(("quit",))
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
