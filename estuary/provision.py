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

The ACL (built in :mod:`estuary.acl`) follows the topic layout of
:class:`shared.wire.messages.Topics`, where every instance writes only under its own subtree
(``cloud``, ``edge/<e>``, ``device/<d>``), and there exactly the topics its role publishes
(:func:`estuary.acl.device_writes`, :func:`~estuary.acl.edge_writes`,
:func:`~estuary.acl.cloud_writes`): no wildcard over a subtree, on whose made-up topics an
account could leave as many retained messages as it liked. A device reads the cloud's topics,
its edge's (every edge's when devices pick their edge), the presence and edge choices of other
devices, and requests for its own blobs; it cannot read other devices' updates or blobs. An
edge reads what it serves and aggregates (:func:`~estuary.acl.edge_reads`): the cloud's
topics, the edges' state and presence, the devices' registrations, presence, choices, updates,
update blobs and deployment reports, and requests for its own blobs. Only the cloud (and the
deployer, below) writes under ``cloud/`` (global state, rounds, deployments). Each device's
private downlink ``device/<d>/down/#`` (its personal model and the blob chunks of it,
:func:`shared.wire.messages.private_home`) is written only by the cloud and read only by the
cloud and that device: no edge reads it. The ``observer`` account writes nothing and reads
only the retained state and presence ``estuary status`` shows
(:func:`estuary.status.observer_topics`). The ``deployer`` account
(:func:`~estuary.acl.deployer_topics`) is ``estuary deploy``'s: it publishes deployments and
sample requests and serves the deployed model's blobs under the cloud's subtree, and reads the
devices' presence and deployment reports and the requests for the cloud's blobs; it writes no
round, state or presence of the cloud's and reads no update, blob or downlink.

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

from estuary.acl import (
    DEPLOYER,
    acl_text,
    cloud_broker_acl,
    site_broker_acl,
)
from estuary.status import OBSERVER
from shared.config import BrokerSection, RunConfig
from shared.deploy.signing import PRIVATE_KEY_FILE, PUBLIC_KEY_FILE, generate_keys
from shared.errors import EstuaryError
from shared.federation.topology import (
    BRIDGE_QOS,
    CLOUD_SITE,
    Site,
    bridge_in,
    bridge_out,
    bridge_user,
    per_edge,
    sites,
)
from shared.naming import device_name, edge_ids
from shared.transport.local_broker import BIND_CLIENT_ID, mosquitto_limits, secured_packet_bytes
from shared.wire.messages import (
    Topics,
)

log = logging.getLogger(__name__)

PBKDF2_ITERATIONS = 101  # mosquitto_passwd's default for the $7$ (PBKDF2-SHA512) format
BROKER_CONF = "mosquitto.conf"  # in DIR/mosquitto/, beside passwd and acl
#: an edge site's bridge stanza, in DIR/sites/<e>/mosquitto/ (federation.brokers = "per-edge")
BRIDGE_CONF = "bridge.conf"
MQTT_PORT = 1883
MQTTS_PORT = 8883  # the one listener with --tls-host
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
