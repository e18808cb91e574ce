"""Static checks of docker/ that need no Docker engine: the dependency lock covers what the
package needs, the compose file parses (docker-compose v1 when installed) and wires every
role to the broker, Prometheus and its own credentials, and the Dockerfiles keep the
properties the docs promise (BASE_IMAGE, air-gapped pip arguments, non-root, healthchecks)."""

from __future__ import annotations

import importlib.metadata as md
import itertools
import os
import queue
import re
import shutil
import stat
import subprocess
import time
import tomllib
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
#: the shipped Mosquitto configs: compose's, Kubernetes' cloud broker and its site brokers
BROKER_CONFIGS = (
    DOCKER / "mosquitto.conf",
    ROOT / "k8s" / "base" / "broker" / "mosquitto.conf",
    ROOT / "k8s" / "overlays" / "per-edge" / "mosquitto.conf",
)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _lock(name: str) -> dict[str, str]:
    """name -> pinned version of docker/requirements/<name> (following -r includes)."""
    pins: dict[str, str] = {}
    for raw in (DOCKER / "requirements" / name).read_text().splitlines():
        line = raw.split("#")[0].strip()
        if line.startswith("-r "):
            pins.update(_lock(line[3:].strip()))
        elif line:
            pkg, sep, version = line.partition("==")
            assert sep and version, f"{name}: {raw!r} is not pinned with =="
            pins[_norm(pkg)] = version
    return pins


def test_lock_pins_every_dependency_of_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = [
        Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["train"]
    ]
    for image, ort in (("cloud.txt", "onnxruntime"), ("device.txt", "onnxruntime-gpu")):
        pins = _lock(image)
        for req in needed:
            name = ort if _norm(req.name) == "onnxruntime" else _norm(req.name)
            if name == "torch":  # installed first, from TORCH_SPEC
                continue
            assert name in pins, f"{image} does not pin {name}"
            if name != "onnxruntime-gpu":
                assert pins[name] in req.specifier, f"{image}: {name}=={pins[name]} vs {req}"
    assert "onnxruntime" not in _lock("device.txt"), "onnxruntime and onnxruntime-gpu clash"


def test_lock_is_closed_under_the_installed_metadata() -> None:
    """Every requirement of a locked package (as installed here, at the locked version) is
    locked too, so the images' pip never resolves an unpinned version."""
    pins = {**_lock("cloud.txt"), "torch": "2.13.0"}
    checked = 0
    for name, version in pins.items():
        try:
            if md.version(name).split("+")[0] != version:
                continue
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        checked += 1
        for raw in requires:
            req = Requirement(raw)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            assert _norm(req.name) in pins, f"{name}=={version} needs {req}, not in the lock"
    assert checked >= len(pins) // 2, "too few locked packages installed here to check"


def _compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_wires_every_role() -> None:
    services = _compose()["services"]
    fed = tomllib.loads((DOCKER / "config.toml").read_text())["federation"]
    roles = {"cloud"} | {f"edge{i}" for i in range(fed["num_edges"])}
    roles |= {f"dev{i:03d}" for i in range(fed["num_devices"])}
    assert roles | {"provision", "broker", "prometheus"} == set(services)
    for name in roles:
        svc = services[name]
        env = svc["environment"]
        assert env["ESTUARY__BROKER__USERNAME"] == name
        assert env["ESTUARY__BROKER__PASSWORD_FILE"] == f"/provision/credentials/{name}.password"
        assert env["ESTUARY__BROKER__HOST"] == "broker"
        assert svc["depends_on"]["broker"]["condition"] == "service_healthy"
        assert svc["depends_on"]["provision"]["condition"] == "service_completed_successfully"
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"]
        if name.startswith("dev"):
            assert name in svc["command"] and env["ESTUARY__DEPLOY__VERIFY_KEY"].endswith(
                ".pub.pem"
            )
    assert services["cloud"]["environment"]["ESTUARY__DEPLOY__SIGNING_KEY"].endswith("ed25519.pem")
    # Prometheus scrapes exactly these roles, on the port the images serve /metrics on
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = {
        t for sc in prom["scrape_configs"] for g in sc["static_configs"] for t in g["targets"]
    }
    assert targets == {f"{r}:9100" for r in roles}
    gpu = yaml.safe_load((DOCKER / "compose.gpu.yaml").read_text())["services"]
    assert set(gpu) == {r for r in roles if r.startswith("dev")}
    for svc in gpu.values():
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


def test_per_edge_compose_puts_each_site_on_its_own_broker() -> None:
    """compose.per-edge.yaml: the roles of compose.yaml, each edge and the devices the static
    assignment gives it (device i at edge i % num_edges) on their site's broker and network
    only, the cloud on the cloud broker, every site broker also on the cloud network (its
    bridge), and provisioning for per-edge with the cloud broker's address."""
    compose = yaml.safe_load((DOCKER / "compose.per-edge.yaml").read_text())
    services = compose["services"]
    run = tomllib.loads((DOCKER / "config.per-edge.toml").read_text())
    fed = run["federation"]
    assert fed["brokers"] == "per-edge" and fed.get("assignment", "static") == "static"
    edges = [f"edge{i}" for i in range(fed["num_edges"])]
    devices = [f"dev{i:03d}" for i in range(fed["num_devices"])]
    home = {d: edges[i % len(edges)] for i, d in enumerate(devices)}
    site_brokers = {f"broker-{e}" for e in edges}
    assert set(services) == {"cloud", *edges, *devices, "provision", "broker", "prometheus",
                             *site_brokers}  # fmt: skip
    assert set(compose["networks"]) == {"cloud", *(f"site-{e}" for e in edges)}
    plain = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    for name in ("cloud", *edges, *devices):
        svc = services[name]
        env = svc["environment"]
        site = "cloud" if name == "cloud" else name if name in edges else home[name]
        broker = "broker" if site == "cloud" else f"broker-{site}"
        network = "cloud" if site == "cloud" else f"site-{site}"
        assert env["ESTUARY__BROKER__HOST"] == broker, name
        assert svc["networks"] == [network], name
        assert svc["depends_on"][broker]["condition"] == "service_healthy", name
        assert svc["depends_on"]["provision"]["condition"] == "service_completed_successfully"
        assert len(svc["depends_on"]) == 2, name
        # the rest as in compose.yaml: same command, account and credential files
        ours = {k: v for k, v in env.items() if k != "ESTUARY__BROKER__HOST"}
        theirs = {k: v for k, v in plain[name]["environment"].items()
                  if k != "ESTUARY__BROKER__HOST"}  # fmt: skip
        assert ours == theirs, name
        assert svc["command"] == plain[name]["command"], name
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"], name
    for edge in edges:
        svc = services[f"broker-{edge}"]
        assert svc["environment"] == {"ESTUARY_SITE": edge}
        assert sorted(svc["networks"]) == sorted(["cloud", f"site-{edge}"])
        assert svc["image"] == services["broker"]["image"]
        assert f"broker-{edge}-data:/mosquitto/data" in svc["volumes"]
        assert "provision:/provision:ro" in svc["volumes"]
    assert services["broker"]["networks"] == ["cloud"]
    assert sorted(services["prometheus"]["networks"]) == sorted(compose["networks"])
    command = services["provision"]["command"]
    assert command[:4] == ["provision", "/etc/estuary/config.toml", "--out", "/provision"]
    assert "--keep" in command
    assert command[command.index("--cloud-broker") + 1] == "broker:1883"
    assert services["provision"]["network_mode"] == "none"


def _collect(c: mqtt.Client, *patterns: str) -> queue.Queue[tuple[str, bool]]:
    """Subscribe ``c`` to ``patterns``; (topic, retained) of what arrives lands in the queue."""
    box: queue.Queue[tuple[str, bool]] = queue.Queue()
    c.on_message = lambda cl, ud, msg: box.put((msg.topic, bool(msg.retain)))
    for pattern in patterns:
        c.subscribe(pattern, qos=1)
    time.sleep(0.3)
    return box


def _drain(box: queue.Queue[tuple[str, bool]], wait_s: float) -> set[tuple[str, bool]]:
    end, got = time.monotonic() + wait_s, set()
    while time.monotonic() < end:
        try:
            got.add(box.get(timeout=0.05))
        except queue.Empty:
            pass
    return got


def test_per_edge_compose_site_broker_bridges_on_real_mosquitto(tmp_path: Path) -> None:
    """The site broker of compose.per-edge.yaml as the compose file starts it (its shell
    command, on what `estuary provision --cloud-broker` wrote for site edge0) and the cloud
    broker on docker/mosquitto.conf, both real Mosquitto with paths and ports moved here: the
    bridge comes up with its own account, the edge's aggregate and the device's registration
    reach the cloud broker and the device's update does not, and a restarted site broker
    still holds its retained messages (the persistence the command adds)."""
    from estuary.provision import provision
    from shared.config import config_from_dict
    from shared.transport.local_broker import find_mosquitto, free_port
    from shared.wire.messages import Topics
    from tests.mosquitto_sites import local_conf, mosquitto, wait_bridge_up
    from tests.mqtt_probe import close, login

    binary = find_mosquitto()
    if binary is None:
        pytest.skip("mosquitto missing: apt-get install mosquitto")
    compose = yaml.safe_load((DOCKER / "compose.per-edge.yaml").read_text())
    cfg = config_from_dict(tomllib.loads((DOCKER / "config.per-edge.toml").read_text()),
                           source="config.per-edge.toml")  # fmt: skip
    cloud_port, site_port = free_port(), free_port()
    prov = tmp_path / "provision"
    provision(cfg, prov, broker_user=None, cloud_broker=f"127.0.0.1:{cloud_port}")
    data = {name: tmp_path / name for name in ("cloud-data", "site-data")}
    for d in data.values():
        d.mkdir()
    cloud_conf = tmp_path / "cloud.conf"
    cloud_conf.write_text(local_conf((DOCKER / "mosquitto.conf").read_text(), cloud_port, {
        "/provision/": prov, "/mosquitto/data/": data["cloud-data"]}))  # fmt: skip
    # the site broker's command, up to the exec, writes its config here
    svc = compose["services"]["broker-edge0"]
    assert svc["entrypoint"] == ["sh", "-c"]
    script = svc["command"][0].replace("$$", "$")
    combined = tmp_path / "site-combined.conf"
    script = script.replace("/tmp/mosquitto.conf", str(combined)).replace("/provision/", f"{prov}/")
    assert script.rstrip().endswith(f"exec mosquitto -c {combined}")
    script = script.rstrip().removesuffix(f"exec mosquitto -c {combined}")
    proc = subprocess.run(["sh", "-c", script], env={**os.environ, **svc["environment"]},
                          capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(combined.stat().st_mode) == 0o600  # it holds the bridge's password
    site_conf = tmp_path / "site.conf"
    site_conf.write_text(local_conf(combined.read_text(), site_port,
                                    {"/mosquitto/data/": data["site-data"]}))  # fmt: skip
    t = Topics(cfg.run.name)
    creds = prov / "credentials"
    users = ("cloud", "edge0", "dev000", "observer")
    pw = {u: (creds / f"{u}.password").read_text() for u in users}
    with mosquitto(binary, cloud_conf, cloud_port):
        with mosquitto(binary, site_conf, site_port):
            wait_bridge_up(cfg, prov, "edge0", site_port)
            cloud = login("127.0.0.1", cloud_port, "cloud", pw["cloud"])
            edge = login("127.0.0.1", site_port, "edge0", pw["edge0"])
            device = login("127.0.0.1", site_port, "dev000", pw["dev000"])
            try:
                at_cloud = _collect(cloud, f"{t.base}/#")
                at_edge = _collect(edge, t.all_device_up)
                device.publish(t.device_hello("dev000"), b"hello", qos=1, retain=True)
                device.publish(t.device_up("dev000"), b"update", qos=1).wait_for_publish(5)
                edge.publish(t.edge_up("edge0"), b"aggregate", qos=1).wait_for_publish(5)
                assert _drain(at_edge, 1.0) == {(t.device_up("dev000"), False)}
                crossed = {topic for topic, _ in _drain(at_cloud, 1.5)}
                assert crossed == {t.device_hello("dev000"), t.edge_up("edge0")}, crossed
            finally:
                close(cloud, edge, device)
        assert any(data["site-data"].iterdir()), "the site broker saved no persistence file"
        with mosquitto(binary, site_conf, site_port):
            observer = login("127.0.0.1", site_port, "observer", pw["observer"])
            try:
                kept = _drain(_collect(observer, t.device_hello("+")), 1.0)
            finally:
                close(observer)
            assert kept == {(t.device_hello("dev000"), True)}, kept


def test_compose_config_is_accepted_by_docker_compose() -> None:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose (v1) is not installed")
    for files in (
        ["compose.yaml"],
        ["compose.yaml", "compose.gpu.yaml"],
        ["compose.per-edge.yaml"],
        ["compose.per-edge.yaml", "compose.gpu.yaml"],
    ):
        args = [exe, "--project-directory", str(DOCKER)]
        for f in files:
            args += ["-f", str(DOCKER / f)]
        proc = subprocess.run([*args, "config", "-q"], capture_output=True, text=True,
                              timeout=60, check=False)  # fmt: skip
        assert proc.returncode == 0, proc.stderr


def _compose_clis() -> list[list[str]]:
    """The Compose command lines installed here: docker-compose v1 and the v2 plugin."""
    clis = [[exe] for exe in [shutil.which("docker-compose")] if exe]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True,
                               text=True, timeout=30, check=False)  # fmt: skip
        if probe.returncode == 0:
            clis.append(["docker", "compose"])
    return clis


def _mounts(svc: dict) -> dict[str, str]:
    """target -> source of a service's volumes, from either CLI's ``config`` output (v1:
    "src:dst:mode" strings; v2: mappings)."""
    out = {}
    for vol in svc.get("volumes", []):
        if isinstance(vol, str):
            src, dst = vol.split(":")[:2]
        else:
            src, dst = vol.get("source", ""), vol["target"]
        out[dst] = src
    return out


def test_root_env_names_the_local_hierarchy() -> None:
    """`docker compose up` at the repository root: the root .env names docker/compose.yaml
    (Compose v1 and v2 both read COMPOSE_FILE from the working directory's .env)."""
    env = {}
    for raw in (ROOT / ".env").read_text().splitlines():
        if raw.strip() and not raw.startswith("#"):
            key, sep, value = raw.partition("=")
            assert sep, f".env: {raw!r} is not KEY=VALUE"
            env[key] = value
    assert env == {"COMPOSE_FILE": "docker/compose.yaml"}
    assert (ROOT / env["COMPOSE_FILE"]).is_file()
    # the image build context excludes it (it is only Compose's)
    assert "*" in (ROOT / ".dockerignore").read_text().splitlines()


@pytest.mark.parametrize("cli", _compose_clis() or [None], ids=lambda c: " ".join(c or ["none"]))
def test_compose_at_the_repository_root_resolves_paths_under_docker(
    cli: list[str] | None, tmp_path: Path
) -> None:
    """What `up` at the root would run: the services of docker/compose.yaml, their build
    context the repository root and the run config docker/config.toml, exactly as with
    ``-f docker/compose.yaml``; nothing of the caller's environment decides it."""
    if cli is None:
        pytest.skip("neither docker-compose nor docker compose is installed")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "ESTUARY_"))}
    # HOME: the v2 plugin reads its config from there; keep the test's own
    env = {**clean, "HOME": str(tmp_path)} if cli[0] == "docker" else clean

    def config(*args: str) -> dict:
        proc = subprocess.run([*cli, *args, "config"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=60, check=False)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return yaml.safe_load(proc.stdout)

    at_root = config()
    services = at_root["services"]
    assert set(services) == set(_compose()["services"])
    for name in ("provision", "cloud", "dev000"):
        assert Path(services[name]["build"]["context"]) == ROOT, name
        assert _mounts(services[name])["/etc/estuary/config.toml"] == str(DOCKER / "config.toml")
    if not (DOCKER / ".env").exists():  # the explicit file reads docker/.env, the root .env not
        assert at_root["services"] == config("-f", "docker/compose.yaml")["services"]


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "device.Dockerfile", "broker.Dockerfile",
                                        "prometheus.Dockerfile"])  # fmt: skip
def test_dockerfiles_are_buildable_air_gapped_and_unprivileged(dockerfile: str) -> None:
    text = (DOCKER / dockerfile).read_text()
    first = next(ln for ln in text.splitlines() if ln and not ln.startswith("#"))
    assert first.startswith("ARG BASE_IMAGE="), "BASE_IMAGE must come first, before FROM"
    assert "FROM ${BASE_IMAGE}" in text
    assert "USER 10001:10001" in text
    assert "HEALTHCHECK" in text
    if dockerfile in ("Dockerfile", "device.Dockerfile"):
        for arg in ("PYPI_INDEX_URL", "PYPI_EXTRA_INDEX_URL", "FIND_LINKS", "OFFLINE",
                    "TRUSTED_HOST", "TORCH_SPEC", "TORCH_INDEX_URL"):  # fmt: skip
            assert f"ARG {arg}=" in text, arg
        assert "COPY docker/wheelhouse/ /wheels/" in text


def test_dockerignore_keeps_the_context_small() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in lines, "exclude everything but what the images need"
    for needed in ("pyproject.toml", "shared/", "docker/"):
        assert f"!{needed}" in lines


def _conf_settings(text: str) -> dict[str, str]:
    """mosquitto.conf option -> value (comments and blank lines skipped)."""
    pairs = (ln.split(None, 1) for ln in text.splitlines() if ln.strip() and ln[0] != "#")
    return {p[0]: p[1].strip() if len(p) > 1 else "" for p in pairs}


def test_mosquitto_configs_share_the_local_brokers_limits(tmp_path: Path) -> None:
    """The compose and Kubernetes broker configs keep the limits and socket options that
    shared/transport/local_broker.py gives the local one with accounts (their comments say so;
    this keeps it true): packets of one default blob chunk, the heap limit, the queues."""
    from shared.transport.local_broker import LocalBroker

    secured = LocalBroker(kind="mosquitto", password_file=tmp_path / "passwd")
    local = _conf_settings(secured._mosquitto_conf(tmp_path))
    keys = (
        "max_packet_size",
        "memory_limit",
        "max_queued_messages",
        "max_queued_bytes",
        "max_inflight_messages",
        "set_tcp_nodelay",
    )
    assert local["set_tcp_nodelay"] == "true"
    for path in BROKER_CONFIGS:
        deployed = _conf_settings(path.read_text())
        for key in keys:
            assert deployed.get(key) == local[key], f"{path.relative_to(ROOT)}: {key}"


def listener_blocks(text: str) -> tuple[list[str], list[list[str]]]:
    """A mosquitto.conf's settings before its first ``listener`` line, and each listener's
    block (its ``listener`` line and the settings up to the next one), comments skipped."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    starts = [i for i, ln in enumerate(lines) if ln.split()[0] == "listener"]
    bounds = [*starts, len(lines)]
    head = lines[: starts[0]] if starts else lines
    return head, [lines[a:b] for a, b in itertools.pairwise(bounds)]


def test_mosquitto_configs_bind_client_ids_to_user_names() -> None:
    """The compose and Kubernetes brokers make every client's id its user name on every
    listener, so one account's credentials cannot take over another's connection or session
    by claiming its client id. Mosquitto 2 reads ``use_username_as_clientid`` per listener:
    before the first ``listener`` line it would configure a default listener instead."""
    for path in BROKER_CONFIGS:
        head, blocks = listener_blocks(path.read_text())
        name = path.relative_to(ROOT)
        assert blocks, f"{name}: no listener"
        assert not any(ln.startswith("use_username_as_clientid") for ln in head), name
        for block in blocks:
            assert "use_username_as_clientid true" in block, f"{name}: {block[0]} is unbound"
        assert "allow_anonymous false" in (ln for b in blocks for ln in b), name


def test_listener_blocks_sees_an_unbound_listener() -> None:
    """The check above fails on a config where only the first listener is bound."""
    head, blocks = listener_blocks(
        "# c\nuse_username_as_clientid true\nlistener 1883\nuse_username_as_clientid true\n"
        "listener 8883\ncafile /ca.pem\n"
    )
    assert head == ["use_username_as_clientid true"]
    assert ["use_username_as_clientid true" in b for b in blocks] == [True, False]
