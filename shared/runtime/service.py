"""Glue every role service shares: decoding inbound messages safely, rejecting bad ones with
a reason and a count, and moving tensors through blobs.

Role services subclass :class:`RoleService`; their handlers receive validated messages only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from shared.config import RunConfig
from shared.errors import CodecError, MessageError, TransportError
from shared.logs import REJECT_LOG_BURST, REJECT_LOG_WINDOW_S, LogLimiter, printable
from shared.metrics.prometheus import RoleMetrics
from shared.runtime.trace import Trace
from shared.transport.bus import Bus, Endpoint
from shared.transport.telemetry import Traffic
from shared.wire.codec import (
    Blob,
    TensorDict,
    TensorSpec,
    decode_tensors,
    encoded_size_limit,
)
from shared.wire.messages import (
    CLOUD_RECIPIENT,
    BlobRef,
    Presence,
    Topics,
    cloud_only_home,
    decode,
    encode,
    home_of,
    private_home,
)

log = logging.getLogger(__name__)

__all__ = ["REJECT_LOG_BURST", "REJECT_LOG_WINDOW_S", "LogLimiter", "RoleService"]

M = TypeVar("M")


class RoleService:
    """Base of the cloud, edge and device services: one endpoint, one name, one config."""

    role = "role"

    def __init__(self, name: str, cfg: RunConfig, bus: Bus, *, home: str | None = None) -> None:
        self.name = name
        self.cfg = cfg
        #: the subtree it writes under (default its role's, :func:`home_of`)
        self.home = home if home is not None else home_of(self.role, name)
        self.ep: Endpoint = bus.endpoint(name, self.home)
        self.topics = Topics(cfg.run.name)
        self.traffic: Traffic = bus.traffic
        self.metrics = RoleMetrics(self.role, name, bus.traffic)
        self.reject_log = LogLimiter()
        #: the round timeline (``ESTUARY_TRACE_DIR``; off by default)
        self.trace = Trace(name)

    def presence(self, online: bool) -> Presence:
        """This instance's presence message (the offline one is the MQTT last will)."""
        return Presence(name=self.name, role=self.role, online=online)  # type: ignore[arg-type]

    def announce_presence(self, online: bool) -> None:
        """Publish retained presence under this instance's own subtree."""
        self.send(self.topics.status(self.home), self.presence(online), retain=True)

    def start(self) -> None:
        """Subscribe to what this role handles and announce it (each role implements it)."""
        raise NotImplementedError

    def joined_session(self) -> str | None:
        """The cloud session whose rounds this process has taken part in (None: none yet)."""
        return None

    def worked_in_session(self) -> str | None:
        """The cloud session this process did a round's work in (:func:`follow_cloud
        <shared.runtime.process.follow_cloud>` ends the process on that session's "done"
        even with its cloud gone); by default :meth:`joined_session`."""
        return self.joined_session()

    def stop(self) -> None:
        """Say goodbye (retained ``online: false``) before a clean shutdown."""
        self.announce_presence(False)

    def reject(self, reason: str, detail: str = "") -> None:
        """Count and log a rejected input; the service carries on. Every rejection is
        counted; the log gets :data:`REJECT_LOG_BURST` lines per reason a minute, the next
        line saying how many it left out."""
        self.traffic.reject(self.role, reason)
        text = printable(detail)  # topics, ids and reasons from the wire, escaped
        self.reject_log.warn(reason, f"{self.name} rejected input ({reason}): {text}", log)

    def on(
        self, pattern: str, msg_type: type[M], handler: Callable[[M], None], kind: str,
        *, on_clear: Callable[[str], None] | None = None,
    ) -> None:  # fmt: skip
        """Subscribe ``handler`` to validated ``msg_type`` messages on ``pattern``.

        An empty payload (a retained message being cleared) is counted as
        ``retained_cleared`` and handed to ``on_clear(topic)`` if given, never to
        ``handler``. A message that arrives on another topic
        than its sender's own
        (:meth:`~shared.wire.messages.Topics.origin`) is rejected as ``wrong_sender``, so one
        device cannot speak for another.
        """

        def wrapped(topic: str, payload: bytes) -> None:
            if not payload:
                # an empty retained publish clears a retained message (a fresh cloud clears
                # an earlier run's deployment): nothing to handle, and not malformed
                self.traffic.note("retained_cleared")
                if on_clear is not None:
                    on_clear(topic)
                return
            try:
                msg = decode(payload, msg_type)  # type: ignore[arg-type]
            except MessageError as err:
                self.reject(err.reason, f"{topic}: {err.detail}")
                return
            origin = self.topics.origin(msg)
            if origin is not None and topic != origin:
                self.reject("wrong_sender", f"{topic} carried a message for {origin}")
                return
            handler(msg)

        self.ep.subscribe(pattern, wrapped, kind=kind)

    def send(self, topic: str, msg: Any, *, retain: bool = False) -> None:
        """Publish a message; its traffic is counted under ``msg_<kind>``."""
        self.ep.publish(topic, encode(msg), kind=f"msg_{msg.kind}", retain=retain)

    def put_tensors(self, tensors: Mapping[str, Any], kind: str) -> BlobRef:
        """Encode tensors as safetensors and upload them as a blob."""
        return self.put_encoded(self.ep.encode_tensors(tensors), kind)

    def put_encoded(self, data: Blob, kind: str) -> BlobRef:
        """Upload tensors already encoded (:func:`~shared.wire.codec.encode_tensors`)."""
        sha = self.ep.put_blob(data, kind=kind)
        return BlobRef(sha256=sha, size=len(data), kind=kind, src=self.home)

    def put_private_tensors(self, tensors: Mapping[str, Any], kind: str, device: str) -> BlobRef:
        """Encode tensors as safetensors and upload them as a blob served to ``device`` alone,
        on its private downlink (the ref's ``src``), which only it and the cloud can read."""
        data = self.ep.encode_tensors(tensors)
        sha = self.ep.put_blob(data, kind=kind, recipient=device)
        return BlobRef(sha256=sha, size=len(data), kind=kind, src=private_home(device))

    def put_cloud_only_tensors(self, tensors: Mapping[str, Any], kind: str) -> BlobRef:
        """Encode tensors as safetensors and upload them as a blob served to the cloud alone,
        under :func:`~shared.wire.messages.cloud_only_home` of this role (the ref's ``src``),
        which no device reads."""
        data = self.ep.encode_tensors(tensors)
        sha = self.ep.put_blob(data, kind=kind, recipient=CLOUD_RECIPIENT)
        return BlobRef(sha256=sha, size=len(data), kind=kind, src=cloud_only_home(self.home))

    def put_state(
        self, state: Mapping[str, Any], shared: Mapping[str, Any] | None, kind: str
    ) -> tuple[BlobRef, BlobRef | None]:
        """Put ``state`` as a blob and, when ``shared`` names a subset of it
        (:meth:`~shared.methods.base.Algorithm.shared_spec`), that subset as a second
        blob, for receivers that hold the rest."""
        ref = self.put_tensors(state, kind)
        if shared is None:
            return ref, None
        return ref, self.put_tensors({k: state[k] for k in shared}, kind)

    def fetch_tensors(
        self,
        ref: BlobRef,
        spec: Mapping[str, TensorSpec] | None,
        *,
        timeout_s: float = 600.0,
        partial: bool = False,
        keep: bool = True,
        views: bool = False,
    ) -> TensorDict | None:
        """Download and validate a tensor blob; ``None`` (rejected and counted) if bad.
        With ``partial`` a non-empty subset of ``spec`` is accepted."""
        try:
            return self.load_tensors(
                ref, spec, timeout_s=timeout_s, partial=partial, keep=keep, views=views
            )
        except (CodecError, TransportError) as err:
            self.reject(err.reason, str(err))
        return None

    def load_tensors(
        self,
        ref: BlobRef,
        spec: Mapping[str, TensorSpec] | None,
        *,
        timeout_s: float = 600.0,
        partial: bool = False,
        keep: bool = True,
        views: bool = False,
        stall_s: float | None = None,
    ) -> TensorDict:
        """:meth:`fetch_tensors` that raises CodecError or TransportError instead of
        rejecting (safe to call from a worker thread: it touches no state of the role).

        A blob declared larger than ``spec`` can encode to is refused before any download
        (``blob_too_large``); a downloaded blob is kept in the blob store only once it has
        passed validation, so nothing refused stays in a cache; with ``keep`` False not even
        then (an upload an aggregator folds into its sum and drops). The bytes are verified
        against the sha256 as they arrive (or were put here), so decoding hashes nothing
        again. With ``views`` the tensors are read-only views of the downloaded bytes (no
        second copy; for a caller that only reads them, such as a streaming fold). With
        ``stall_s`` a download that receives nothing for that long gives up early."""
        return self.load_blob_tensors(
            ref, spec, timeout_s=timeout_s, partial=partial, keep=keep, views=views,
            stall_s=stall_s,
        )[0]  # fmt: skip

    def load_blob_tensors(
        self,
        ref: BlobRef,
        spec: Mapping[str, TensorSpec] | None,
        *,
        timeout_s: float = 600.0,
        partial: bool = False,
        keep: bool = True,
        views: bool = False,
        stall_s: float | None = None,
    ) -> tuple[TensorDict, Blob]:
        """:meth:`load_tensors`, and the blob's verified bytes the tensors were decoded from
        (for a caller that may serve those very bytes again, as the cloud serves the one
        edge's model as the new global)."""
        limit = None if spec is None else encoded_size_limit(spec)
        if limit is not None and ref.size > limit:
            raise TransportError(
                f"blob {ref.sha256[:12]}… from {ref.src}: declared {ref.size} bytes, more than "
                f"its tensors can take ({limit})",
                reason="blob_too_large",
            )
        data = self.ep.get_blob(
            ref.sha256,
            ref.size,
            kind=ref.kind,
            src=ref.src,
            timeout_s=timeout_s,
            cache=False,
            stall_s=stall_s,
        )
        tensors = decode_tensors(data, expected=spec, partial=partial, copy=not views)
        if keep:
            self.ep.keep_blob(data, ref.sha256, kind=ref.kind)
        return tensors, data
