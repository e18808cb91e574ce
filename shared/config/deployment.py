"""The deployment sections of a run config (not part of its digest): the MQTT broker and
its blob limits, Prometheus metrics, deployment to the devices, and where this process
computes. Each role process may set its own."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_serializer,
    field_validator,
    model_validator,
)

from shared.settings import Section

#: a byte limit sized from the run's model (``cache_limit_bytes``, ``memory_limit_bytes``)
AUTO = "auto"


class AutoBytes(int):
    """A blob-store limit left ``"auto"``: sized from the run's model where the run is known
    (:meth:`BrokerSection.with_blob_limits`, which every role process applies when it
    connects). The int itself is the fallback a bus built from these settings alone uses
    (tests, benchmarks): the fixed limits of earlier versions."""

    def __repr__(self) -> str:
        return f"AutoBytes({int(self)})"


#: "auto" blob limits: memory holds BLOB_MEMORY_BLOBS of the run's largest blob (what a role
#: serves: the global state and its shared part, an edge's model, a device's upload), plus
#: one per device for a role that holds a blob for each device, plus BLOB_MEMORY_HEADROOM
#: for the small ones (masks, descriptions, a deployed classifier); the disk cache
#: BLOB_DISK_FACTOR times that. Both scale with the model: no fixed floor holds a hundred
#: copies of a small one. Uploads an aggregator fetches are folded and dropped, never stored
BLOB_MEMORY_BLOBS, BLOB_MEMORY_HEADROOM = 2, 8 << 20
BLOB_DISK_FACTOR = 4
#: the shortest period of the cloud's sweep of retained blob chunks (one subscribe and
#: unsubscribe per sweep)
MIN_RETAINED_SWEEP_S = 0.5


class BrokerSection(Section):
    """MQTT broker connection and blob-transfer limits (deployment settings, not in the digest).

    The password never lives in the config: it comes from ``password_file`` or the
    ``ESTUARY_MQTT_PASSWORD`` environment variable.
    """

    host: str = Field("127.0.0.1", min_length=1, max_length=253)
    port: int = Field(1883, ge=1, le=65_535)
    protocol: Literal["5", "3.1.1"] = "5"
    username: str = Field("", max_length=128)
    password_file: str = ""
    tls: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    keepalive_s: int = Field(30, ge=5, le=3600)
    connect_timeout_s: float = Field(30.0, gt=0.0, le=3600.0)
    reconnect_min_s: int = Field(1, ge=1, le=60)
    reconnect_max_s: int = Field(30, ge=1, le=3600)
    session_expiry_s: int = Field(300, ge=0, le=7 * 86_400)
    chunk_bytes: int = Field(1 << 20, ge=4096, le=64 << 20, description="blob chunk size")
    max_blob_bytes: int = Field(1 << 30, ge=1, le=1 << 40)
    max_inflight_bytes: int = Field(32 << 20, ge=4096, description="sent, not yet acknowledged")
    max_fetch_bytes: int = Field(2 << 30, ge=4096, description="partial blobs being received")
    chunk_timeout_s: float = Field(5.0, gt=0.0, le=600.0, description="re-ask after silence")
    max_update_fetches: int = Field(
        2,
        ge=1,
        le=1024,
        description="uploads an edge downloads at once, the others wait their turn (one of "
        "16 MiB or more is received into a file when the role has a disk cache, else into "
        "memory until it is folded into the round's sum). A download silent for "
        "3 x chunk_timeout_s gives up, so a silent device holds a turn no longer",
    )
    fetch_timeout_s: float = Field(600.0, gt=0.0, le=86_400.0)
    serve_repeat_s: float = Field(
        4.0,
        ge=0.0,
        le=600.0,
        description="a blob server sends a chunk to one requester at most once in this many "
        "seconds; a repeated request within it is dropped (keep it below the requesters' "
        "chunk_timeout_s, after which an honest receiver asks again)",
    )
    serve_budget_bytes_per_min: int = Field(
        1 << 30,
        ge=4096,
        le=1 << 40,
        description="bytes of chunks a blob server queues for one requester per minute; "
        "beyond it the rest of a request is dropped until the minute is over",
    )
    cache_dir: str = Field("", description="on-disk blob cache; empty = memory only")
    cache_limit_bytes: int = Field(
        AutoBytes(8 << 30), ge=0, description='on-disk blob cache; "auto": sized from the model'
    )
    memory_limit_bytes: int = Field(
        AutoBytes(2 << 30), ge=0, description='blobs kept in memory; "auto": sized from the model'
    )
    max_queue: int = Field(100_000, ge=10, le=10_000_000, description="inbound messages queued")
    max_queue_bytes: int = Field(
        64 << 20, ge=1 << 20, le=1 << 40, description="inbound message bytes queued"
    )
    broker_memory_bytes: int = Field(
        1 << 30,
        ge=64 << 20,
        le=1 << 40,
        description="heap limit of the broker `estuary provision` and the local broker "
        "configure (mosquitto memory_limit): past it the broker refuses the allocation and "
        "disconnects the publisher instead of exhausting the host",
    )
    retained_sweep_s: float = Field(
        2.0,
        ge=0.0,
        le=3600.0,
        description="how often the cloud clears retained messages on blob-chunk topics "
        "(no role publishes a chunk retained; the broker would hold them until cleared); "
        "0 = never",
    )

    @model_validator(mode="after")
    def _check(self) -> BrokerSection:
        if self.reconnect_max_s < self.reconnect_min_s:
            raise ValueError("reconnect_max_s must be >= reconnect_min_s")
        if self.max_inflight_bytes < self.chunk_bytes:
            raise ValueError("max_inflight_bytes must hold at least one chunk")
        if self.serve_budget_bytes_per_min < self.chunk_bytes:
            raise ValueError(
                "serve_budget_bytes_per_min must hold at least one chunk (chunk_bytes)"
            )
        if 0.0 < self.retained_sweep_s < MIN_RETAINED_SWEEP_S:
            raise ValueError(
                f"retained_sweep_s must be 0 (never) or at least {MIN_RETAINED_SWEEP_S:g}"
            )
        return self

    @field_validator("cache_limit_bytes", "memory_limit_bytes", mode="wrap")
    @classmethod
    def _auto_limit(
        cls, value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo
    ) -> int:
        """``"auto"`` (or a limit still auto) stays auto; anything else is a byte count."""
        if value == AUTO or isinstance(value, AutoBytes):
            default = cls.model_fields[str(info.field_name)].default
            return AutoBytes(default)
        limit: int = handler(value)
        return limit

    @field_serializer("cache_limit_bytes", "memory_limit_bytes")
    def _dump_limit(self, value: int) -> int | str:
        """An auto limit is written as ``"auto"`` (config.json keeps it auto)."""
        return AUTO if isinstance(value, AutoBytes) else int(value)

    def with_blob_limits(self, blob_bytes: int, per_device_blobs: int = 0) -> BrokerSection:
        """These settings with each limit left ``"auto"`` sized for a run whose largest blob
        is ``blob_bytes`` and where this role holds ``per_device_blobs`` blobs, one per
        device, at once (pFedGPA's personal models on the cloud, the per-device uploads an
        edge forwards); an explicit limit is kept.

        Memory: ``(BLOB_MEMORY_BLOBS + per_device_blobs) * blob_bytes +
        BLOB_MEMORY_HEADROOM``: room for what the role serves at once (the global state and its
        shared part, an edge's model and its report to the cloud, a device's upload and
        the model it trained); the uploads an aggregator fetches are never stored, and an
        older blob (the previous round's model, for a device that asks late) is read back
        from disk. Evicted blobs are the least recently used ones (still on
        disk), and every request served refreshes the blob asked for. Disk:
        ``BLOB_DISK_FACTOR`` times that."""
        if blob_bytes < 0 or per_device_blobs < 0:
            raise ValueError("blob_bytes and per_device_blobs must be >= 0")
        memory = (BLOB_MEMORY_BLOBS + per_device_blobs) * blob_bytes + BLOB_MEMORY_HEADROOM
        update: dict[str, int] = {}
        if isinstance(self.memory_limit_bytes, AutoBytes):
            update["memory_limit_bytes"] = memory
        if isinstance(self.cache_limit_bytes, AutoBytes):
            update["cache_limit_bytes"] = BLOB_DISK_FACTOR * memory
        return self.model_copy(update=update) if update else self

    @property
    def blob_limits_auto(self) -> bool:
        """Whether a blob-store limit is still ``"auto"`` (not sized for a run yet)."""
        return isinstance(self.memory_limit_bytes, AutoBytes) or isinstance(
            self.cache_limit_bytes, AutoBytes
        )


class MetricsSection(Section):
    """Prometheus ``/metrics`` endpoint of a service process."""

    enabled: bool = True
    addr: str = "0.0.0.0"
    port: int = Field(9100, ge=0, le=65_535, description="0 = any free port")
    port_file: str | None = Field(
        None,
        description="once serving, write the bound port (decimal text) to this file, so a "
        "process started with port 0 tells its launcher where its /metrics is",
    )
    final_scrape_s: float = Field(
        0.0,
        ge=0,
        le=600,
        description="after a clean finish, keep /metrics up until Prometheus has scraped the "
        "final state (the cloud's phase 'done'), at most this long; 0 = exit at once",
    )


class ComputeSection(Section):
    """Where this process trains: a per-process setting (not part of the config digest), so
    GPU and CPU devices can serve one federation."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="local training: cuda when available (auto), or forced"
    )
    deterministic: bool = Field(
        False,
        description="deterministic kernels only (cuDNN, cuBLAS, torch's strict deterministic "
        "mode): a GPU run repeats bit for bit, somewhat slower",
    )


class DeploySection(Section):
    """Shipping the trained generator to the devices (DESIGN section 5)."""

    enabled: bool = Field(True, description="cloud exports and publishes after training")
    signing_key: str = Field("", description="cloud: Ed25519 private key (PEM) to sign with")
    verify_key: str = Field("", description="devices: Ed25519 public key (PEM) to verify with")
    opset: int = Field(17, ge=17, le=23)
    fp16: bool = False
    parity_threshold: float = Field(1e-4, gt=0.0, description="max abs error vs torch")
    parity_steps: int = Field(20, ge=1, le=1000, description="DDIM steps of the parity check")
    sample_steps: int = Field(50, ge=1, le=1000, description="DDIM steps of device grids")
    grid_size: int = Field(16, ge=1, le=1024, description="images in a device's sample grid")
    max_request_images: int = Field(256, ge=1, le=100_000, description="cap per request")
    provider: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int = Field(0, ge=0, description="ONNX Runtime intra-op threads; 0 = default")
    out_dir: str = Field("", description="devices: where grids and models go; empty = ./deploy")
    wait_s: float = Field(
        120.0, ge=0.0, le=86_400.0, description="cloud: serve the deployment this long for reports"
    )
    fetch_timeout_s: float = Field(
        60.0,
        gt=0.0,
        le=86_400.0,
        description="devices: give up fetching a deployment's files after this long (the fetch "
        "runs beside training and sampling; capped by broker.fetch_timeout_s)",
    )
