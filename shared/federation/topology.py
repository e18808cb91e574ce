"""Which broker each role instance talks through, and what the bridges between brokers carry
(``federation.brokers``).

With ``"one"`` every role of a run talks through one broker. With ``"per-edge"`` the
federation is split into **sites**: the cloud site (the cloud, ``estuary deploy``'s deployer)
and one site per edge (that edge and the devices assigned to it: device ``i`` at edge
``i % num_edges``, ``federation.assignment = "static"``). Each site has its own broker; each
edge site's broker bridges to the cloud broker under an account of its own
(:func:`bridge_user`), carrying only the topics the two sides exchange:

``out`` (edge site -> cloud, :func:`bridge_out`)
    the edge's retained state and presence, its round announcement, its report (``up``), the
    chunks of the blobs it serves the cloud alone (its aggregate, and the devices' uploads it
    forwards, under :func:`~shared.wire.messages.cloud_only_home`) and its blob requests to
    the cloud; the site's devices' retained
    registration, presence and deployment report, and their blob requests to the cloud, to
    the deployer and on their private downlink.
``in`` (cloud -> edge site, :func:`bridge_in`)
    the cloud's whole subtree ``cloud/#`` (state, rounds, deployments, the chunks of its and
    the deployer's blobs, and its requests for the edge's blobs) and each of the site's
    devices' private downlink ``device/<d>/down/#``.

A device's update (``device/<d>/up``), its edge choice and the chunks of its blobs
(``device/<d>/blob/...``) match neither list: they never leave the site. Nothing in the
protocol makes the cloud fetch a blob from a device (the uploads the cloud sees are forwarded
by their edge under :func:`~shared.wire.messages.cloud_only_home`), so no device blob has to
cross. Every filter is built from the protocol's own topic builders
(:class:`~shared.wire.messages.Topics`, :func:`~shared.wire.messages.home_of`, ...), so the
bridges follow any change of the topic layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.config import RunConfig
from shared.errors import ConfigError
from shared.naming import device_name, edge_ids
from shared.wire.messages import (
    DEPLOYER_HOME,
    Topics,
    cloud_only_home,
    home_of,
    private_home,
)

BrokerLayout = Literal["one", "per-edge"]
#: the name of the cloud's site (an edge site is named after its edge)
CLOUD_SITE = "cloud"
#: the bridge's topic rules' QoS: at least once, as the roles publish
BRIDGE_QOS = 1
#: mosquitto's retained bridge state topic on the site broker (1 up, 0 down), for a
#: connection named ``bridge-<e>`` (``notifications true``, local only)
BRIDGE_STATE_TOPIC = "$SYS/broker/connection/{connection}/state"


def bridge_user(edge: str) -> str:
    """The cloud broker's account (and the bridge connection's name and client id) of edge
    site ``edge``'s bridge."""
    return f"bridge-{edge}"


def bridge_state_topic(edge: str) -> str:
    """Where the site broker of ``edge`` keeps its bridge's state (retained ``1``/``0``)."""
    return BRIDGE_STATE_TOPIC.format(connection=bridge_user(edge))


@dataclass(frozen=True)
class Site:
    """One broker's share of the federation: its name and the role instances it serves."""

    name: str
    #: the edge of an edge site; None for the cloud site
    edge: str | None
    #: the devices assigned to the edge (none at the cloud site)
    devices: tuple[str, ...] = ()

    @property
    def is_cloud(self) -> bool:
        """Whether this is the cloud's site."""
        return self.edge is None


def per_edge(cfg: RunConfig) -> bool:
    """Whether ``cfg`` runs a broker per edge site."""
    return cfg.federation.brokers == "per-edge"


def sites(cfg: RunConfig) -> list[Site]:
    """The cloud site, then one site per edge with its devices (device ``i`` at edge
    ``i % num_edges``), whatever ``federation.brokers`` says.

    Raises:
        ConfigError: the devices do not have a fixed edge (``federation.assignment`` is not
            ``"static"``), so they cannot be placed at a site.
    """
    if cfg.federation.assignment != "static":
        raise ConfigError(
            "broker sites need federation.assignment = 'static' (each device at its home "
            f"edge), got {cfg.federation.assignment!r}; federation.brokers = 'per-edge' "
            "cannot run with devices that pick their edge"
        )
    edges = edge_ids(cfg)
    members: dict[str, list[str]] = {e: [] for e in edges}
    for i in range(cfg.federation.num_devices):
        members[edges[i % len(edges)]].append(device_name(i))
    return [Site(CLOUD_SITE, None), *(Site(e, e, tuple(members[e])) for e in edges)]


def site_of(cfg: RunConfig, role: str, name: str) -> str:
    """The site whose broker instance ``name`` of ``role`` talks through: ``"cloud"`` for the
    cloud and the operator's tools (deployer, observer), the edge's own for an edge, the home
    edge's for a device.

    Raises:
        ConfigError: ``name`` is no edge or device of ``cfg``.
    """
    if role not in ("edge", "device"):
        return CLOUD_SITE
    for site in sites(cfg)[1:]:
        if (role == "edge" and site.edge == name) or (role == "device" and name in site.devices):
            return site.name
    raise ConfigError(f"{role} {name!r} is not in run {cfg.run.name!r}'s federation")


def subtree(topics: Topics, home: str) -> str:
    """The filter of every topic under role subtree ``home`` (and ``home`` itself)."""
    return f"{topics.base}/{home}/#"


def bridge_out(topics: Topics, site: Site) -> list[str]:
    """What edge site ``site``'s bridge carries to the cloud broker (module docstring)."""
    if site.edge is None:
        raise ConfigError("the cloud site has no bridge")
    edge = site.edge
    own = home_of("edge", edge)
    rules = [
        topics.edge_state(edge),
        topics.status(own),
        topics.edge_round(edge),
        topics.edge_up(edge),
        topics.blob_chunks(cloud_only_home(own)),  # the uploads it forwards to the cloud alone
        topics.blob_want(own, "cloud"),
    ]
    for d in site.devices:
        dev = home_of("device", d)
        rules += [
            topics.device_hello(d),
            topics.status(dev),
            topics.device_deploy(d),
            topics.blob_want(dev, "cloud"),
            topics.blob_want(dev, DEPLOYER_HOME),
            topics.private_want(d),
        ]
    return rules


def bridge_in(topics: Topics, site: Site) -> list[str]:
    """What edge site ``site``'s bridge brings from the cloud broker (module docstring):
    ``cloud/#`` holds the cloud's requests for the edge's blobs
    (:meth:`~shared.wire.messages.Topics.blob_want` and
    :meth:`~shared.wire.messages.Topics.cloud_only_want` from ``cloud``) and the deployer's
    subtree ``cloud/deployer``."""
    if site.edge is None:
        raise ConfigError("the cloud site has no bridge")
    return [
        subtree(topics, home_of("cloud", CLOUD_SITE)),
        *(subtree(topics, private_home(d)) for d in site.devices),
    ]


def topic_matches(pattern: str, topic: str) -> bool:
    """Whether MQTT filter ``pattern`` (``+`` one level, ``#`` the rest and the parent level)
    matches ``topic``; a ``$``-topic is matched only by a filter that starts with ``$``."""
    if topic.startswith("$") and not pattern.startswith("$"):
        return False
    want, got = pattern.split("/"), topic.split("/")
    for i, level in enumerate(want):
        if level == "#":
            return i == len(want) - 1
        if i >= len(got):
            return False
        if level not in ("+", got[i]):
            return False
    return len(want) == len(got)


def crosses(rules: list[str], topic: str) -> bool:
    """Whether ``topic`` matches any of ``rules`` (a bridge's ``out`` or ``in`` list)."""
    return any(topic_matches(rule, topic) for rule in rules)
