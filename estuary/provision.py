"""``estuary provision``: broker credentials, per-role ACLs, the deployment key pair and
(optionally) a TLS CA and server certificate for one federation (DESIGN section 7).

Layout of ``--out DIR`` (consumed by docker/compose.yaml as files and by k8s/ as Secrets)::

    mosquitto/passwd              one PBKDF2-SHA512 ($7$) entry per role instance
    mosquitto/acl                 per-user topic rules (below)
    mosquitto/mosquitto.conf      a broker config that uses both, binds each client's id
                                  to its user name (``mosquitto -c`` it; below) and bounds
                                  packets (one blob chunk) and the broker's heap
                                  (these three files 0640, group of ``--broker-user``)
    credentials/<name>.password   each instance's password (0600), cloud, edge*, dev*,
                                  observer (read-only account of `estuary status`) and
                                  deployer (account of `estuary deploy`)
    keys/deploy_ed25519.pem       deployment signing key (cloud only)
    keys/deploy_ed25519.pub.pem   verification key (devices)
    tls/ca.pem, tls/server.pem, tls/server.key     with --tls
    provision.json                what was generated (no secrets)

The ACL follows the topic layout of :class:`shared.wire.messages.Topics`, where every instance
writes only under its own subtree (``cloud``, ``edge/<e>``, ``device/<d>``), and there exactly
the topics its role publishes (:func:`device_writes`, :func:`edge_writes`,
:func:`cloud_writes`): no wildcard over a subtree, on whose made-up topics an account could
leave as many retained messages as it liked. A device reads the cloud's topics, its edge's
(every edge's when devices pick their edge), the presence and edge choices of other devices,
and requests for its own blobs; it cannot read other devices' updates or blobs. An edge reads
what it serves and aggregates (:func:`edge_reads`): the cloud's topics, the edges' state and
presence, the devices' registrations, presence, choices, updates, update blobs and deployment
reports, and requests for its own blobs. Only the cloud (and the deployer, below) writes under
``cloud/`` (global state, rounds, deployments). Each device's private downlink
``device/<d>/down/#`` (its personal model and the blob chunks of it,
:func:`shared.wire.messages.private_home`) is written only by the cloud and read only by the
cloud and that device: no edge reads it. The ``observer`` account writes nothing and reads
only the retained state and presence ``estuary status`` shows
(:func:`estuary.status.observer_topics`). The ``deployer`` account (:func:`deployer_topics`)
is ``estuary deploy``'s: it publishes deployments and sample requests and serves the deployed
model's blobs under the cloud's subtree, and reads the devices' presence and deployment
reports and the requests for the cloud's blobs; it writes no round, state or presence of the
cloud's and reads no update, blob or downlink.

The ACL is per user name, and the client id would be a second identity beside it: a broker
keys connections and persistent sessions by client id, and the roles' ids are predictable
(``<run>-<name>``), so one device's credentials presenting the edge's id would disconnect the
edge and receive what its session queued. :func:`mosquitto_conf` therefore binds each
client's id to its user name (``use_username_as_clientid``, on every listener it writes), as
do the shipped compose and Kubernetes configs and the local broker with a password file
(:class:`~shared.transport.local_broker.LocalBroker`). Each instance has its own account, so
its session is its own; a second connection with the same account replaces the first (and
takes its session). That is why ``estuary deploy`` has an account of its own: logged in as
the cloud, it would disconnect a running cloud, and the two would keep replacing each other.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

from estuary.status import OBSERVER, observer_topics
from shared.config import BrokerSection, RunConfig
from shared.deploy.signing import PRIVATE_KEY_FILE, PUBLIC_KEY_FILE, generate_keys
from shared.errors import EstuaryError
from shared.federation.topology import (
    BRIDGE_QOS,
    CLOUD_SITE,
    Site,
    bridge_in,
    bridge_out,
    bridge_state_topic,
    bridge_user,
    per_edge,
    sites,
)
from shared.naming import device_name, edge_ids
from shared.transport.local_broker import BIND_CLIENT_ID, mosquitto_limits, secured_packet_bytes
from shared.wire.messages import (
    DEPLOYER_HOME,
    Topics,
    cloud_only_home,
    home_of,
    private_home,
)

log = logging.getLogger(__name__)

PBKDF2_ITERATIONS = 101  # mosquitto_passwd's default for the $7$ (PBKDF2-SHA512) format
BROKER_CONF = "mosquitto.conf"  # in DIR/mosquitto/, beside passwd and acl
#: an edge site's bridge stanza, in DIR/sites/<e>/mosquitto/ (federation.brokers = "per-edge")
BRIDGE_CONF = "bridge.conf"
MQTT_PORT = 1883
MQTTS_PORT = 8883  # the one listener with --tls-host
#: the account ``estuary provision`` makes for ``estuary deploy`` (:func:`deployer_topics`)
DEPLOYER = "deployer"
#: accounts of the operator's tools, which a provisioning made by an older estuary may lack,
#: and what is missing without each
TOOL_ACCOUNTS = {
    OBSERVER: "`estuary status` cannot log in on its own account",
    DEPLOYER: "`estuary deploy` cannot log in on a provisioned broker (it refuses the cloud's "
    "account, which would disconnect the cloud)",
}


def mosquitto_hash(password: str, *, salt: bytes | None = None) -> str:
    """A Mosquitto 2 password-file hash: ``$7$<iterations>$<salt b64>$<sha512 b64>``."""
    salt = salt if salt is not None else secrets.token_bytes(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, PBKDF2_ITERATIONS)
    b64 = base64.b64encode
    return f"$7${PBKDF2_ITERATIONS}${b64(salt).decode()}${b64(digest).decode()}"


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


def bridge_conf(
    cfg: RunConfig, site: Site, address: str, password: str | None, *, cafile: Path | None = None
) -> str:
    """The Mosquitto bridge stanza of edge site ``site``'s broker: a connection named after
    the bridge's account on the cloud broker at ``address`` (``HOST:PORT``), logging in as
    that account with ``password``, whose session outlives a lost link (``cleansession
    false``: the cloud broker queues what the site is sent meanwhile, within its queue
    limits, and the site broker what it sends), its state published on the site broker only
    (``notifications_local_only``), reconnecting within seconds, and QoS 1 topic rules
    exactly :func:`~shared.federation.topology.bridge_out` (``out``) and
    :func:`~shared.federation.topology.bridge_in` (``in``). ``cafile``: the CA that signed
    the cloud broker's TLS certificate. ``password`` None: no account (an open cloud
    broker, as ``estuary demo`` runs locally)."""
    if site.edge is None:
        raise EstuaryError("the cloud site has no bridge")
    topics, name = Topics(cfg.run.name), bridge_user(site.edge)
    lines = [
        f"# bridge of edge site {site.name!r} to the cloud broker, written by `estuary provision`",
        f"connection {name}",
        f"address {address}",
        f"remote_clientid {name}",
        *([f"remote_username {name}", f"remote_password {password}"] if password else []),
        "bridge_protocol_version mqttv311",
        "cleansession false",
        "try_private true",
        "start_type automatic",
        "restart_timeout 1 10",
        "keepalive_interval 15",
        "notifications true",
        "notifications_local_only true",
        "# what crosses while the link is down waits in each broker's bounded queues",
        "# (max_queued_messages, max_queued_bytes of the broker's config)",
    ]
    if cafile is not None:
        lines.append(f"bridge_cafile {cafile}")
    lines += [f"topic {t} out {BRIDGE_QOS}" for t in bridge_out(topics, site)]
    lines += [f"topic {t} in {BRIDGE_QOS}" for t in bridge_in(topics, site)]
    return "\n".join(lines) + "\n"


def mosquitto_conf(
    run: str,
    out: Path,
    *,
    tls: bool = False,
    broker: BrokerSection | None = None,
    certs: Path | None = None,
) -> str:
    """The Mosquitto 2 config for a provisioning in ``out`` (paths as they will be there):
    no anonymous clients, the password file and ACL, each client's id bound to its user name,
    the roles' queue limits, packets no larger than one of ``broker``'s blob chunks plus
    headers and the broker's heap limit (``broker.broker_memory_bytes``); with ``tls``, one
    listener on 8883 with the provisioned server certificate (in ``certs``, default
    ``out/tls``) instead of plain MQTT on 1883."""
    broker = broker if broker is not None else BrokerSection()
    mq = out.resolve() / "mosquitto"
    certs = certs.resolve() if certs is not None else out.resolve() / "tls"
    listener = [
        f"listener {MQTTS_PORT if tls else MQTT_PORT}",
        BIND_CLIENT_ID,  # a listener option: right after its listener line
    ]
    if tls:
        listener += [
            f"cafile {certs / 'ca.pem'}",
            f"certfile {certs / 'server.pem'}",
            f"keyfile {certs / 'server.key'}",
        ]
    lines = [
        f"# Mosquitto 2 for Estuary run {run!r}, written by `estuary provision`; start it with",
        f"#   mosquitto -c {mq / BROKER_CONF}",
        "# Only the provisioned accounts log in, the ACL keeps each to its own topics, and each",
        "# client's id is its user name: a client cannot take over another account's connection",
        "# or session by claiming its id. Give every process its own account: a second",
        "# connection with an account replaces the first and takes its session.",
        *listener,
        "allow_anonymous false",
        f"password_file {mq / 'passwd'}",
        f"acl_file {mq / 'acl'}",
        "",
        *mosquitto_limits(
            max_packet_bytes=secured_packet_bytes(broker.chunk_bytes),
            memory_bytes=broker.broker_memory_bytes,
        ),
        "",
        "# to keep sessions and retained state across broker restarts:",
        "#persistence true",
        "#persistence_location /var/lib/mosquitto/",
        "connection_messages true",
        "log_timestamp true",
    ]
    return "\n".join(lines) + "\n"


#: the user a broker from a distribution package drops to when started as root (Debian's
#: mosquitto), whose group ``estuary provision`` gives read access to the broker's files
DEFAULT_BROKER_USER = "mosquitto"
#: what the broker reads in ``mosquitto/``: the password file holds only hashes
BROKER_FILES = ("passwd", "acl", BROKER_CONF, BRIDGE_CONF)


def broker_group(user: str | None) -> int | None:
    """The group id of the broker's ``user`` (None: no such user on this host, or none
    named): the group that is given read access to the files the broker reads."""
    if not user:
        return None
    import pwd

    try:
        return pwd.getpwnam(user).pw_gid
    except KeyError:
        return None


def make_broker_readable(mq: Path, gid: int | None, *, strict: bool = False) -> None:
    """Let the broker's user read its files in ``mq`` (``DIR/mosquitto``): the folder 0750
    and the files 0640, their group ``gid`` when one is given (else the provisioning user's
    own, for a broker that runs as that user, as in the compose and Kubernetes images).
    Mosquitto opens the password file and the ACL after it has dropped root for its own
    user; owner-only files stop it at start ("Unable to open pwfile").

    Raises:
        EstuaryError: with ``strict``, ``gid`` cannot be set (only root and the group's
            members may); without, that is logged and the files keep their group.
    """
    for path in (mq, *(mq / name for name in BROKER_FILES)):
        if not path.exists():
            continue
        if gid is not None and path.stat().st_gid != gid:
            try:
                os.chown(path, -1, gid)
            except OSError as err:
                if not strict:
                    log.warning("%s keeps its group (%s): a broker that runs as another user "
                                "cannot read it; pass --broker-user to name the broker's user",
                                path, err)  # fmt: skip
                    gid = None
                    path.chmod(0o750 if path.is_dir() else 0o640)
                    continue
                raise EstuaryError(
                    f"cannot give the broker's group (gid {gid}) read access to {path}: {err}; "
                    "provision as root or as a member of that group, or pass --broker-user "
                    "naming the user the broker runs as"
                ) from None
        path.chmod(0o750 if path.is_dir() else 0o640)


def _write_secret(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _tls(out: Path, hosts: list[str]) -> dict[str, str]:
    """A CA and a server certificate for ``hosts`` (DNS names or IPs), 2 years."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    until = now + datetime.timedelta(days=730)

    def pem_key(key: Any) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM,  # type: ignore[no-any-return]
                                 serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())  # fmt: skip

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Estuary federation CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for h in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            alt.append(x509.DNSName(h))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    tls = out / "tls"
    tls.mkdir(parents=True, exist_ok=True)
    (tls / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    _write_secret(tls / "ca.key", pem_key(ca_key))
    (tls / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_secret(tls / "server.key", pem_key(key))
    return {"ca": str(tls / "ca.pem"), "server_cert": str(tls / "server.pem")}


def _kept(out: Path, run: str, names: list[str]) -> dict[str, Any]:
    """The earlier provisioning in ``out`` if it is for ``run`` with users ``names``."""
    try:
        info: dict[str, Any] = json.loads((out / "provision.json").read_text())
    except (OSError, ValueError) as err:
        raise EstuaryError(
            f"{out} holds a password file but no readable provision.json: {err}"
        ) from None
    users = info.get("users")
    lacking = [n for n in TOOL_ACCOUNTS if isinstance(users, list) and n not in users]
    if lacking and users == [n for n in names if n not in lacking]:
        # made before these tool accounts: everything else still holds
        for name in lacking:
            log.warning("%s has no %s account (made by an older estuary): %s; provision "
                        "--force makes it", out, name, TOOL_ACCOUNTS[name])  # fmt: skip
        names = users
    if info.get("run") != run or info.get("users") != names:
        raise EstuaryError(
            f"{out} is provisioned for run {info.get('run')!r} with users "
            f"{info.get('users')}, not for run {run!r} with {names}; "
            "pass --force to replace it (every instance then needs its new password)"
        )
    missing = [n for n in names if not (out / "credentials" / f"{n}.password").exists()]
    if not Path(str(info.get("signing_key", ""))).exists():
        missing.append("the signing key")
    for site, entry in info.get("sites", {}).items():
        files = entry.get("files", {}) if isinstance(entry, dict) else {}
        missing += [f"{site}'s {k}" for k, v in files.items() if not Path(str(v)).exists()]
    if missing:
        raise EstuaryError(f"{out} is incomplete: missing {', '.join(missing)}")
    return {**info, "kept": True}


def _move_in(stage: Path, out: Path, entries: tuple[str, ...]) -> None:
    """Move ``entries`` from ``stage`` into ``out`` in order, the ones they replace into
    ``stage`` as ``<entry>.replaced``; on any failure every entry goes back as it was."""
    done: list[str] = []
    try:
        for entry in entries:
            if not (stage / entry).exists():
                continue
            done.append(entry)
            if (out / entry).exists():
                (out / entry).rename(stage / f"{entry}.replaced")
            (stage / entry).rename(out / entry)
    except BaseException:
        for entry in reversed(done):
            if not (stage / entry).exists() and (out / entry).exists():  # the new one is in
                (out / entry).rename(stage / entry)
            if (stage / f"{entry}.replaced").exists():
                (stage / f"{entry}.replaced").rename(out / entry)
        raise


def provision(
    cfg: RunConfig,
    out: Path,
    *,
    tls_hosts: list[str] | None = None,
    force: bool = False,
    keep: bool = False,
    broker_user: str | None = DEFAULT_BROKER_USER,
    cloud_broker: str | None = None,
) -> dict[str, Any]:
    """Write credentials, ACL, keys (and TLS material) for ``cfg``'s federation to ``out``.

    An existing provisioning is an error unless ``force`` (replace it) or ``keep`` (reuse it
    when it was made for the same run and instances: what ``docker compose up`` does on every
    start). With ``keep``, one that never finished (a password file without
    ``provision.json``, left by a kill between the final moves) is replaced.

    With ``federation.brokers = "per-edge"`` the cloud broker's files stay in ``mosquitto/``
    (the cloud, the observer, the deployer and a bridge account per edge site) and each edge
    site's broker gets ``sites/<e>/mosquitto/`` (:func:`write_sites`); its bridge logs in to
    the cloud broker at ``cloud_broker`` (``HOST:PORT``, default the config's
    ``broker.host:broker.port``).

    The files the brokers read (``mosquitto/``, ``sites/<e>/mosquitto/``) are made readable
    by the group of ``broker_user`` when that user exists here (:func:`make_broker_readable`);
    the credentials and the signing key stay the provisioning user's alone.
    """
    gid = broker_group(broker_user)
    strict = bool(broker_user) and broker_user != DEFAULT_BROKER_USER
    if strict and gid is None:
        raise EstuaryError(f"broker user {broker_user!r} does not exist on this host")
    split = per_edge(cfg)
    if cloud_broker is not None and not split:
        raise EstuaryError("--cloud-broker is for federation.brokers = 'per-edge' (the "
                           "address the edge sites' bridges connect to)")  # fmt: skip
    edges = edge_ids(cfg)
    devices = [device_name(i) for i in range(cfg.federation.num_devices)]
    names = ["cloud", *edges, *devices, OBSERVER, DEPLOYER]
    if split:
        names += [bridge_user(e) for e in edges]
    unfinished = False
    if (out / "mosquitto" / "passwd").exists() and not force:
        if keep and not (out / "provision.json").exists():
            # provision.json is moved in last: a password file without it is a provisioning
            # killed part-way, which no instance can have been started with
            log.warning("%s holds a provisioning that never finished (no provision.json); "
                        "provisioning it again", out)  # fmt: skip
            unfinished = True
        elif keep:
            kept = _kept(out, cfg.run.name, names)
            conf_path = out / "mosquitto" / BROKER_CONF
            if not conf_path.exists():  # made by an older estuary: the rest still holds
                conf = mosquitto_conf(cfg.run.name, out, tls="tls" in kept, broker=cfg.broker)
                conf_path.write_text(conf)
                log.info("wrote %s, which this provisioning did not have yet", conf_path)
            make_broker_readable(out / "mosquitto", gid, strict=strict)
            for site in kept.get("sites", {}):
                if site != CLOUD_SITE:
                    make_broker_readable(out / "sites" / site / "mosquitto", gid, strict=strict)
            return {**kept, "broker_conf": str(conf_path)}
        else:
            raise EstuaryError(f"{out} is already provisioned; pass --force to replace it")
    if not force and not unfinished:
        for key in (out / "keys" / PRIVATE_KEY_FILE, out / "keys" / PUBLIC_KEY_FILE):
            if key.exists():
                raise EstuaryError(f"{key} exists; pass --force to replace it")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".provisioning-*"):  # a killed provisioning's staging (secrets)
        log.warning("removing %s, left by a provisioning that was killed", stale)
        shutil.rmtree(stale, ignore_errors=True)
    # Everything is written to a staging folder first and moved in afterwards, provision.json
    # last: a failure leaves the earlier provisioning (or none), never half of a new one.
    stage = Path(tempfile.mkdtemp(prefix=".provisioning-", dir=out))
    try:
        passwords = {}
        for name in names:
            password = secrets.token_urlsafe(24)
            _write_secret(stage / "credentials" / f"{name}.password", password.encode())
            passwords[name] = password
        cloud_users = ["cloud", OBSERVER, DEPLOYER, *(bridge_user(e) for e in edges)]
        entries = [f"{n}:{mosquitto_hash(passwords[n])}" for n in names
                   if not split or n in cloud_users]  # fmt: skip
        _write_secret(stage / "mosquitto" / "passwd", ("\n".join(entries) + "\n").encode())
        acl = cloud_broker_acl(cfg) if split else acl_text(cfg, devices=devices, edges=edges)
        (stage / "mosquitto" / "acl").write_text(acl + "\n")
        conf = mosquitto_conf(cfg.run.name, out, tls=bool(tls_hosts), broker=cfg.broker)
        (stage / "mosquitto" / BROKER_CONF).write_text(conf)
        generate_keys(stage / "keys")
        info: dict[str, Any] = {
            "run": cfg.run.name,
            "users": names,
            "passwd": str(out / "mosquitto" / "passwd"),
            "acl": str(out / "mosquitto" / "acl"),
            "broker_conf": str(out / "mosquitto" / BROKER_CONF),
            "signing_key": str(out / "keys" / PRIVATE_KEY_FILE),
            "verify_key": str(out / "keys" / PUBLIC_KEY_FILE),
        }
        if tls_hosts:
            tls = _tls(stage, tls_hosts)
            info["tls"] = {k: str(out / Path(v).relative_to(stage)) for k, v in tls.items()}
        if split:
            b = cfg.broker
            address = cloud_broker or f"{b.host}:{b.port}"
            info["brokers"] = "per-edge"
            info["cloud_broker"] = address
            info["sites"] = write_sites(cfg, stage, out, passwords, address, tls=bool(tls_hosts))
            info["sites"][CLOUD_SITE] = {
                "users": cloud_users,
                "files": {
                    "passwd": info["passwd"],
                    "acl": info["acl"],
                    "broker_conf": info["broker_conf"],
                },
            }
            for site in info["sites"]:
                if site != CLOUD_SITE:
                    make_broker_readable(stage / "sites" / site / "mosquitto", gid, strict=strict)
        (stage / "provision.json").write_text(json.dumps(info, indent=2) + "\n")
        make_broker_readable(stage / "mosquitto", gid, strict=strict)
        moved = ("credentials", "mosquitto", "sites", "keys", "tls", "provision.json")
        _move_in(stage, out, moved)
        if not split and (out / "sites").is_dir():  # a per-edge provisioning's, replaced
            shutil.rmtree(out / "sites")
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return info


def write_sites(
    cfg: RunConfig,
    stage: Path,
    out: Path,
    passwords: dict[str, str],
    address: str,
    *,
    tls: bool = False,
) -> dict[str, dict[str, Any]]:
    """Each edge site's broker files under ``stage/sites/<e>/mosquitto/`` (paths as they
    will be under ``out``): the password file of the edge, its devices and the observer (no
    one else logs in there), the ACL (:func:`site_broker_acl`), the bridge stanza
    (``bridge.conf``, :func:`bridge_conf`: it holds the bridge's password) and
    ``mosquitto.conf``, which is the broker config of :func:`mosquitto_conf` with the bridge
    stanza appended (mosquitto 2 has no include of one file, and an ``include_dir`` of this
    folder would read ``mosquitto.conf`` itself again). Returns per site its users and files."""
    record: dict[str, dict[str, Any]] = {}
    for site in sites(cfg)[1:]:
        edge = str(site.edge)
        users = [edge, *site.devices, OBSERVER]
        mq, final = stage / "sites" / edge / "mosquitto", out / "sites" / edge / "mosquitto"
        entries = [f"{n}:{mosquitto_hash(passwords[n])}" for n in users]
        _write_secret(mq / "passwd", ("\n".join(entries) + "\n").encode())
        (mq / "acl").write_text(site_broker_acl(cfg, site) + "\n")
        cafile = (out / "tls" / "ca.pem").resolve() if tls else None
        bridge = bridge_conf(cfg, site, address, passwords[bridge_user(edge)], cafile=cafile)
        _write_secret(mq / BRIDGE_CONF, bridge.encode())
        conf = mosquitto_conf(cfg.run.name, out / "sites" / edge, tls=tls, broker=cfg.broker,
                              certs=out / "tls")  # fmt: skip
        _write_secret(mq / BROKER_CONF, (conf + "\n" + bridge).encode())
        record[edge] = {
            "users": users,
            "files": {
                "passwd": str(final / "passwd"),
                "acl": str(final / "acl"),
                "broker_conf": str(final / BROKER_CONF),
                "bridge_conf": str(final / BRIDGE_CONF),
            },
        }
    return record
