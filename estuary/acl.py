"""The Mosquitto ACLs ``estuary provision`` writes: what each account may publish and read.

Every role may write exactly the topics its role publishes (:func:`cloud_writes`,
:func:`edge_writes`, :func:`device_writes`, :func:`deployer_topics`), built from the
protocol's own topic builders (:class:`~shared.wire.messages.Topics`, ...), and read what it
subscribes to. :func:`acl_text` is the ACL of one broker for the whole federation;
with a broker per edge site (``federation.brokers = "per-edge"``) :func:`cloud_broker_acl`
is the cloud broker's (the cloud, the operator's tools and one bridge account per site) and
:func:`site_broker_acl` each site broker's (its edge and devices).
"""

from __future__ import annotations

from estuary.status import OBSERVER, observer_topics
from shared.config import RunConfig
from shared.errors import EstuaryError
from shared.federation.topology import (
    Site,
    bridge_in,
    bridge_out,
    bridge_state_topic,
    bridge_user,
    sites,
)
from shared.wire.messages import (
    DEPLOYER_HOME,
    Topics,
    cloud_only_home,
    home_of,
    private_home,
)

#: the account ``estuary provision`` makes for ``estuary deploy`` (:func:`deployer_topics`)
DEPLOYER = "deployer"


def edge_reads(base: str, edge: str) -> list[str]:
    """What edge ``edge`` reads beside its own subtree: what its service subscribes to and
    fetches, and the retained state and presence ``estuary status`` shows.
    Never a device's private downlink ``device/<d>/down/#``: none of these matches it."""
    return [
        f"{base}/cloud/#",  # rounds, state, deployments, global-model blobs
        f"{base}/edge/+/state",
        f"{base}/edge/+/status",
        f"{base}/device/+/hello",
        f"{base}/device/+/status",
        f"{base}/device/+/join",
        f"{base}/device/+/up",
        f"{base}/device/+/deploy",
        f"{base}/device/+/blob/#",  # update blobs
        f"{base}/+/+/want/edge/{edge}",  # requests for this edge's blobs
    ]


def deployer_topics(topics: Topics) -> tuple[list[str], list[str]]:
    """What ``estuary deploy`` publishes and subscribes to, as (writes, reads): the ACL of
    the deployer account.

    It speaks under the cloud's subtree (devices fetch a deployment's files from there), but
    only as a deployment publisher (:class:`cloud.deploy.DeploymentPublisher`): the retained
    deployment, sample requests and the chunks of the blobs it serves from its own subtree
    there (:data:`~shared.wire.messages.DEPLOYER_HOME`, where a running cloud never answers);
    it reads the retained deployment, the devices' presence (whom to wait for), their
    deployment reports, and the
    requests for its blobs (:meth:`~shared.wire.messages.Topics.blob_want_patterns`, what its
    bus subscribes to). Not the cloud's rounds, state, presence or blobs; no update, blob or
    downlink of anyone."""
    writes = [
        topics.cloud_deploy,
        topics.cloud_sample,
        topics.blob_chunks(DEPLOYER_HOME),
    ]
    reads = [
        topics.cloud_deploy,  # the deployments whose reports count (DeploymentPublisher)
        topics.all_device_status,
        topics.all_device_deploy,
        *topics.blob_want_patterns(DEPLOYER_HOME),
    ]
    return writes, reads


def device_writes(topics: Topics, device: str, edges: list[str]) -> list[str]:
    """Every topic device ``device`` publishes, none more: its registration, presence and
    deployment report (the retained ones), its updates and edge choices, the chunks of the
    blobs it serves (its uploads), and its blob requests to ``edges`` (the edges it may
    train with), the cloud, the deployer and its own private downlink. A wildcard over its
    own subtree would let its credentials leave retained messages on as many made-up topics
    as it likes (each one held by the broker until cleared)."""
    own = home_of("device", device)
    return [
        topics.device_hello(device),
        topics.status(own),
        topics.device_deploy(device),
        topics.device_up(device),
        topics.device_join(device),
        topics.blob_chunks(own),
        topics.blob_want(own, "cloud"),
        topics.blob_want(own, DEPLOYER_HOME),  # a deployment `estuary deploy` serves
        *(topics.blob_want(own, home_of("edge", e)) for e in edges),
        topics.private_want(device),
    ]


def edge_writes(topics: Topics, edge: str, devices: list[str]) -> list[str]:
    """Every topic edge ``edge`` publishes: its retained state, presence and round
    announcement, its reports to the cloud, the chunks of its blobs (forwarded uploads under
    its path to the cloud alone) and its blob requests to the cloud and to ``devices``
    (those it may aggregate)."""
    own = home_of("edge", edge)
    return [
        topics.edge_state(edge),
        topics.status(own),
        topics.edge_round(edge),
        topics.edge_up(edge),
        topics.blob_chunks(own),
        topics.blob_chunks(cloud_only_home(own)),  # forwarded uploads, for the cloud alone
        topics.blob_want(own, "cloud"),
        *(topics.blob_want(own, home_of("device", d)) for d in devices),
    ]


def cloud_writes(topics: Topics, devices: list[str], edges: list[str]) -> list[str]:
    """Every topic the cloud publishes: its retained state, round, presence and deployment,
    sample requests, the chunks of its blobs, its blob requests to edges and devices, and
    each device's private downlink (the personal model and the chunks of its blob), and
    the empty retained message that clears a retained chunk on any blob-chunk topic of the
    run (the cloud's bus sweeps them, ``broker.retained_sweep_s``: the ACL cannot refuse the
    retain flag on a chunk topic a device, an edge or the deployer may write)."""
    any_edge, any_device = home_of("edge", "+"), home_of("device", "+")
    return [
        topics.cloud_state,
        topics.cloud_round,
        topics.status("cloud"),
        topics.cloud_deploy,
        topics.cloud_sample,
        topics.blob_chunks("cloud"),
        *(topics.blob_want("cloud", home_of("edge", e)) for e in edges),
        *(topics.cloud_only_want(home_of("edge", e)) for e in edges),  # forwarded uploads
        *(topics.blob_want("cloud", home_of("device", d)) for d in devices),
        topics.device_down("+"),
        topics.blob_chunks(private_home("+")),
        # clearing retained chunks (broker.retained_sweep_s) where others serve blobs
        topics.blob_chunks(DEPLOYER_HOME),
        topics.blob_chunks(any_edge),
        topics.blob_chunks(cloud_only_home(any_edge)),
        topics.blob_chunks(any_device),
    ]


def _cloud_lines(topics: Topics, devices: list[str], edges: list[str]) -> list[str]:
    return [
        "user cloud",
        *(f"topic write {t}" for t in cloud_writes(topics, devices, edges)),
        f"topic read {topics.base}/#",
        "",
    ]


def _edge_lines(topics: Topics, edge: str, aggregates: list[str]) -> list[str]:
    return [
        f"user {edge}",
        *(f"topic write {t}" for t in edge_writes(topics, edge, aggregates)),
        f"topic read {topics.base}/edge/{edge}/#",
        *(f"topic read {t}" for t in edge_reads(topics.base, edge)),
        "",
    ]


def _observer_lines(topics: Topics, extra_reads: list[str] | None = None) -> list[str]:
    # `estuary status`: the retained state and presence, nothing else, and no writes
    reads = [*observer_topics(topics), *(extra_reads or [])]
    return [f"user {OBSERVER}", *(f"topic read {t}" for t in reads), ""]


def _deployer_lines(topics: Topics) -> list[str]:
    # `estuary deploy`: deployments and their blobs under the cloud's subtree, and reports
    writes, reads = deployer_topics(topics)
    return [
        f"user {DEPLOYER}",
        *(f"topic write {t}" for t in writes),
        *(f"topic read {t}" for t in reads),
        "",
    ]


def _device_lines(topics: Topics, device: str, served_by: list[str]) -> list[str]:
    base = topics.base
    lines = [
        f"user {device}",
        *(f"topic write {t}" for t in device_writes(topics, device, served_by)),
        f"topic read {base}/device/{device}/#",
        f"topic read {base}/cloud/#",
        f"topic read {base}/edge/+/round",
        f"topic read {base}/edge/+/status",
        f"topic read {base}/edge/+/state",
        f"topic read {base}/device/+/status",
        f"topic read {base}/device/+/join",
        f"topic read {base}/+/+/want/device/{device}",  # requests for this device's blobs
    ]
    lines += [f"topic read {base}/edge/{e}/blob/#" for e in served_by]
    return [*lines, ""]


def acl_text(cfg: RunConfig, *, devices: list[str], edges: list[str]) -> str:
    """The Mosquitto ACL file for the run of ``cfg`` on one broker: each account may write
    exactly the topics its role publishes (:func:`cloud_writes`, :func:`edge_writes`,
    :func:`device_writes`, :func:`deployer_topics`), and read what it subscribes to."""
    topics = Topics(cfg.run.name)
    picks = cfg.federation.assignment != "static"
    lines = [
        f"# Estuary ACL for run {cfg.run.name!r}: each instance writes exactly the topics its",
        "# role publishes (under its own subtree; the cloud also each device's private downlink",
        "# device/<d>/down). Generated by `estuary provision`; anonymous clients are refused.",
        "",
        *_cloud_lines(topics, devices, edges),
    ]
    for e in edges:
        aggregates = devices if picks else [d for i, d in enumerate(devices)
                                            if edges[i % len(edges)] == e]  # fmt: skip
        lines += _edge_lines(topics, e, aggregates)
    lines += _observer_lines(topics)
    lines += _deployer_lines(topics)
    for i, d in enumerate(devices):
        served_by = edges if picks else [edges[i % len(edges)]] if edges else []
        lines += _device_lines(topics, d, served_by)
    return "\n".join(lines)


def cloud_broker_acl(cfg: RunConfig) -> str:
    """The cloud broker's ACL with a broker per edge site: the cloud, the observer, the
    deployer, and each edge site's bridge (:func:`~shared.federation.topology.bridge_user`),
    which writes exactly the topics its site sends the cloud
    (:func:`~shared.federation.topology.bridge_out`) and reads exactly those it brings back
    (:func:`~shared.federation.topology.bridge_in`). No edge or device has an account here.
    The cloud asks no device for a blob (no method fetches one from a device), so it writes
    no request to a device."""
    topics = Topics(cfg.run.name)
    edge_sites = sites(cfg)[1:]
    lines = [
        f"# Estuary ACL of the cloud broker for run {cfg.run.name!r} (a broker per edge site):",
        "# the cloud, the operator's tools and one bridge account per edge site, which carries",
        "# only what the site and the cloud exchange. Generated by `estuary provision`.",
        "",
        *_cloud_lines(topics, [], [s.name for s in edge_sites]),
        *_observer_lines(topics),
        *_deployer_lines(topics),
    ]
    for site in edge_sites:
        lines += [
            f"user {bridge_user(site.name)}",
            *(f"topic write {t}" for t in bridge_out(topics, site)),
            *(f"topic read {t}" for t in bridge_in(topics, site)),
            "",
        ]
    return "\n".join(lines)


def site_broker_acl(cfg: RunConfig, site: Site) -> str:
    """The ACL of edge site ``site``'s broker: its edge, its devices (the rules of the one
    broker's ACL) and the observer, which also reads the bridge's state. The bridge itself
    is the broker's own connection and needs no account here."""
    topics = Topics(cfg.run.name)
    if site.edge is None:
        raise EstuaryError("the cloud site's ACL is cloud_broker_acl's")
    lines = [
        f"# Estuary ACL of edge site {site.name!r}'s broker for run {cfg.run.name!r}: its edge",
        "# and devices write exactly the topics their role publishes. Generated by",
        "# `estuary provision`; anonymous clients are refused.",
        "",
        *_edge_lines(topics, site.edge, list(site.devices)),
        *_observer_lines(topics, [bridge_state_topic(site.edge)]),
    ]
    for d in site.devices:
        lines += _device_lines(topics, d, [site.edge])
    return "\n".join(lines)
