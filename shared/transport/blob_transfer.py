"""Chunked blob transfer over MQTT: :class:`~shared.transport.blob_server.BlobServer` answers
chunk requests for the blobs this process holds, :class:`~shared.transport.blob_fetcher.BlobFetcher`
receives blobs from the role that serves them; this module holds what both sides use (the
:class:`BlobContext` of a bus, a chunk topic's index, the chunk count).

Blobs are content-addressed and moved in chunks (DESIGN section 2): the receiver subscribes
to ``{src}/blob/{sha}/{chunk_bytes}/+`` of the role that serves it, asks for the chunks it
lacks, hashes them as they arrive in order, asks again for whatever is still missing after
``chunk_timeout_s`` of silence, and refuses the result if the sha256 differs. A server
coalesces requests: a chunk already queued for sending is not queued twice, so several
receivers asking at once share one stream (the broker fans it out). Received and published
blobs live in a :class:`~shared.transport.blobs.BlobStore` (memory LRU + optional disk cache), so an
edge fetches each global model once and serves it to all its devices; a large blob is
received into a file of that cache (:class:`~shared.transport.blob_fetcher.FileSink`).

A private blob (``BlobServer.put_private``: the cloud's personal model for one device) is kept
in a store of its own and served only under that device's private downlink
``device/{d}/down`` (:func:`~shared.wire.messages.private_home`), to requests on
``device/{d}/want/device/{d}/down``: the device's own subtree, which the broker's ACL grants
to its credentials alone, as it grants ``device/{d}/down/#`` to it and the cloud alone. The
fetching side needs nothing special: a BlobRef whose ``src`` is the private downlink makes
its fetcher ask and listen exactly there. Any other request for a private blob is answered
as for a blob never put, and counted. An edge's blobs for the cloud alone (the devices'
uploads it forwards: ``recipient`` :data:`~shared.wire.messages.CLOUD_RECIPIENT`) are
private the same way, served under :func:`~shared.wire.messages.cloud_only_home` to requests
from the cloud's subtree only.

A server cannot be made an amplifier (a request of ~170 bytes answered by megabytes, again
and again). It answers a requester (the subtree a request is published under, which the
broker's ACL ties to an account) only for blobs it has a reason to fetch: a device may fetch
from an edge its current model (the newest blobs put or kept as ``edge_model`` /
``global_model``), from the cloud the current deployment (``onnx_model`` /
``shared_weights``), from a device nothing; the cloud and the edges may fetch any blob served
in the open. Any other request for a blob held is counted and left unanswered (a ``missing``
on the shared path would end an entitled fetch of the same blob); one for a blob not held
gets the ``missing`` answer. A chunk sent to a requester is not sent
to it again within ``serve_repeat_s``, and no requester gets more than
``serve_budget_bytes_per_min`` of chunks queued in a minute. Every refusal is counted
(``blob_server`` rejections) and logged at most a few lines a minute per reason.

Both classes are driven by :class:`~shared.transport.mqtt.MqttBus` and follow its threading
contract: what runs in paho's network thread (``BlobServer.admit_want``,
``BlobFetcher.route_chunk``) only counts and enqueues; a server's requests are handled and
its chunks sent on the bus's I/O worker, and a fetch runs on the thread that asked for
the blob. They reach the network only through the callables the bus hands them (the
``publish`` of their :class:`BlobContext`, the fetcher's ``subscribe`` and ``unsubscribe``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from shared.config import BrokerSection
from shared.transport.blobs import BlobStore
from shared.transport.telemetry import Traffic
from shared.wire.messages import Topics

Publish = Callable[[str, bytes], int]
"""Publishes ``payload`` on ``topic`` at the bus's QoS; returns the message id."""


@dataclass(frozen=True)
class BlobContext:
    """What either side of a transfer uses of its bus."""

    settings: BrokerSection
    store: BlobStore
    topics: Topics
    home: str  # this role's topic subtree: where it serves, and who it asks as
    traffic: Traffic
    publish: Publish
    name: str  # the client id, in log lines


#: what :func:`parse_index` returns for the ``missing`` answer and for a malformed index
MISSING_INDEX = -1
BAD_INDEX = -2

MAX_INDEX_DIGITS: Final = 12  # 10**12 chunks of >= 4 KiB is far beyond max_blob_bytes


def parse_index(level: str) -> int:
    """A chunk topic's last level: ``missing``, a plain ASCII decimal index, or BAD_INDEX.

    ``str.isdigit`` alone accepts superscripts and non-ASCII digits that ``int`` refuses,
    and ``int`` refuses very long digit strings; both would raise in paho's thread."""
    if level == "missing":
        return MISSING_INDEX
    if not (0 < len(level) <= MAX_INDEX_DIGITS and level.isascii() and level.isdigit()):
        return BAD_INDEX
    return int(level)


def chunk_count(size: int, chunk_bytes: int) -> int:
    """Number of chunks of a blob (an empty blob still has one, empty, chunk)."""
    return max(1, math.ceil(size / chunk_bytes))


def index_ranges(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted indices as inclusive [first, last] runs."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out
