"""End to end in real Docker: the images of docker/ built from a debootstrap'ed Debian base and
local wheels (the air-gapped path), and the federation of docker/compose.yaml (2 edges, 4
devices, fmnist-tiny, 2 rounds, deployment to the devices) brought up with docker compose;
then the same images run docker/compose.per-edge.yaml, a broker per edge site bridged to the
cloud broker.

Asserts that the run completes; that the compose file's Prometheus scraped byte counters from
every role; that devices wrote sample grids from the deployed ONNX model; that a device's
credentials cannot publish to the cloud's topics or read another device's updates; for the
per-edge variant, that the run completes and deploys the same way, that each site broker
carried its devices' traffic and its bridge carried less to the cloud than those devices
sent (their updates stayed at the site), that a device's credentials work on its own site's
broker only, and that the cloud broker's observer sees the whole federation done; and that
everything the test started is gone afterwards (containers, networks, volumes, the images it
built, the base image, and dockerd if it started it).

Needs root, Docker (docker.io + docker-compose) and debootstrap, and 10-15 minutes on 2 cores:
marked ``docker`` (deselected by default); ``.ci/run`` runs it. ``ESTUARY_E2E_BASE_IMAGE``
reuses an existing base image instead of debootstrapping one (it is then not removed).
"""

from __future__ import annotations

import http.server
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest
from PIL import Image

from tests.mqtt_probe import close, connect, inbox, login, received
from tests.test_cpu import PROBE

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
PER_EDGE_FILE = ROOT / "docker" / "compose.per-edge.yaml"
RUN = "compose"  # docker/config.toml's run name: the ACL and topics are under it
BASE = f"estuary/v1/{RUN}"
ROLES = {"cloud", "edge0", "edge1", "dev000", "dev001", "dev002", "dev003"}
DEVICES = sorted(r for r in ROLES if r.startswith("dev"))
EDGES = ["edge0", "edge1"]
HOME = {d: EDGES[i % len(EDGES)] for i, d in enumerate(DEVICES)}  # the static assignment
BUILD_TIMEOUT_S = 1800
RUN_TIMEOUT_S = 1200


def _run(
    cmd: list[str], *, timeout: float, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; on failure the assertion carries the tail of its output."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          check=False)  # fmt: skip
    if check and proc.returncode != 0:
        tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-3000:]).strip()
        raise AssertionError(f"{' '.join(cmd[:6])} ... exited {proc.returncode}:\n{tail}")
    return proc


def _unavailable(reason: str) -> None:
    """Fail where the docker test must run (CI), skip elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(f"docker e2e cannot run: {reason}")
    pytest.skip(reason)


def _engine_up() -> bool:
    return _run(["docker", "info"], timeout=30, check=False).returncode == 0


@pytest.fixture(scope="module")
def engine() -> Iterator[None]:
    """A Docker engine: the running one, or a dockerd this fixture starts and stops."""
    if shutil.which("docker") is None:
        _unavailable("docker is not installed (apt-get install docker.io)")
    if _engine_up():
        yield None
        return
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        _unavailable("no Docker engine running, and dockerd cannot be started here")
    log = open("/tmp/estuary-e2e-dockerd.log", "ab")
    proc = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not _engine_up():
            if proc.poll() is not None or time.monotonic() > deadline:
                _unavailable("dockerd did not come up: see /tmp/estuary-e2e-dockerd.log")
            time.sleep(1)
        yield None
    finally:
        proc.terminate()  # dockerd stops the containerd it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
        assert not _engine_up(), "dockerd started by the test is still answering"


def _compose_cmd() -> list[str]:
    """docker-compose v1 where installed (the version the issue pins), else docker compose."""
    if os.environ.get("ESTUARY_COMPOSE"):
        return os.environ["ESTUARY_COMPOSE"].split()
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if _run(["docker", "compose", "version"], timeout=30, check=False).returncode == 0:
        return ["docker", "compose"]
    _unavailable("neither docker-compose nor docker compose is installed")
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def base_image(engine: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Debian bookworm image from debootstrap + docker import (Docker Hub is unreachable)."""
    given = os.environ.get("ESTUARY_E2E_BASE_IMAGE")
    if given:
        yield given
        return
    if shutil.which("debootstrap") is None:
        _unavailable("debootstrap is not installed (apt-get install debootstrap)")
    rootfs = tmp_path_factory.mktemp("rootfs") / "bookworm"
    mirror = os.environ.get("ESTUARY_DEBIAN_MIRROR", "http://deb.debian.org/debian")
    _run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), mirror], timeout=900)
    tag = f"estuary-e2e-base:{uuid.uuid4().hex[:10]}"
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run(["docker", "import", "-", tag], stdin=tar.stdout,
                              capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    tar.wait(timeout=60)
    shutil.rmtree(rootfs, ignore_errors=True)
    assert imported.returncode == 0, imported.stderr
    try:
        yield tag
    finally:
        _run(["docker", "rmi", "-f", tag], timeout=300, check=False)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def _bridge_gateway() -> str:
    """The host's address on Docker's default bridge, where build containers reach it."""
    out = _run(["docker", "network", "inspect", "bridge"], timeout=30).stdout
    cfg = json.loads(out)[0]["IPAM"]["Config"][0]
    if cfg.get("Gateway"):
        return str(cfg["Gateway"])
    return str(next(ipaddress.ip_network(cfg["Subnet"]).hosts()))


@pytest.fixture(scope="module")
def wheel_server(engine: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The images' wheels, downloaded here and served over HTTP on the bridge gateway: the
    builds then run with OFFLINE=1 and FIND_LINKS, as an air-gapped site's would."""
    wheels = tmp_path_factory.mktemp("wheels")
    reqs = ROOT / "docker" / "requirements"
    _run([sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels),
          "--only-binary=:all:", "-r", str(reqs / "cloud.txt"), "-r", str(reqs / "device.txt"),
          "torch==2.13.0+cpu"], timeout=1200)  # fmt: skip
    host = _bridge_gateway()
    server = http.server.ThreadingHTTPServer((host, 0), partial(_Quiet, directory=str(wheels)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(wheels, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Stack:
    """The compose project the test brought up."""

    project: str
    env: dict[str, str]
    compose: list[str]
    broker_port: int
    prometheus_port: int
    out: Path
    timings: dict[str, float] = field(default_factory=dict)
    file: Path = COMPOSE_FILE
    site_ports: dict[str, int] = field(default_factory=dict)  # per-edge: site -> broker port

    def cmd(self, *args: str) -> list[str]:
        return [*self.compose, "-p", self.project, "-f", str(self.file), *args]

    def container(self, service: str) -> str:
        ids = _run(["docker", "ps", "-a", "-q",
                    "--filter", f"label=com.docker.compose.project={self.project}",
                    "--filter", f"label=com.docker.compose.service={service}"],
                   timeout=30).stdout.split()  # fmt: skip
        assert ids, f"no container for service {service}"
        return ids[0]

    def states(self) -> dict[str, dict[str, object]]:
        """service -> its container's ``State``, for every container of the project (one
        ``docker ps`` and one ``docker inspect``)."""
        ids = _run(["docker", "ps", "-a", "-q",
                    "--filter", f"label=com.docker.compose.project={self.project}"],
                   timeout=30).stdout.split()  # fmt: skip
        if not ids:
            return {}
        fmt = '{{index .Config.Labels "com.docker.compose.service"}} {{json .State}}'
        out = _run(["docker", "inspect", "-f", fmt, *ids], timeout=30).stdout
        pairs = (line.split(" ", 1) for line in out.splitlines() if line.strip())
        return {service: json.loads(state) for service, state in pairs}

    def state(self, service: str) -> dict[str, object]:
        states = self.states()
        assert service in states, f"no container for service {service}"
        return states[service]

    def copy_out(self, service: str, path: str) -> Path:
        """``docker cp`` a path out of a (possibly stopped) container into ``out``."""
        dest = self.out / service
        dest.mkdir(parents=True, exist_ok=True)
        _run(["docker", "cp", f"{self.container(service)}:{path}", str(dest)], timeout=120)
        return dest / Path(path).name

    def logs(self, tail: int = 40) -> str:
        return _run(self.cmd("logs", "--no-color", f"--tail={tail}"), timeout=120,
                    env=self.env, check=False).stdout  # fmt: skip


def _leftovers(project: str | None, build: str | None) -> list[str]:
    """Containers, networks and volumes of ``project`` and images of ``build`` that still
    exist."""
    found = []
    checks = []
    if project is not None:
        checks += [(kind, f"label=com.docker.compose.project={project}")
                   for kind in ("ps", "network ls", "volume ls")]  # fmt: skip
    if build is not None:
        checks.append(("images", f"label=io.estuary.build={build}"))
    for kind, flt in checks:
        args = ["docker", *kind.split(), "-q", "--filter", flt]
        if kind in ("ps", "images"):
            args.insert(2, "-a")
        ids = _run(args, timeout=60).stdout.split()
        found += [f"{kind}: {i}" for i in ids]
    return found


@dataclass
class Images:
    """The images the test built (every service's, from compose.yaml), and how."""

    build: str
    env: dict[str, str]
    compose: list[str]
    out: Path
    timings: dict[str, float] = field(default_factory=dict)


@pytest.fixture(scope="module")
def images(
    base_image: str, wheel_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Images]:
    """Build the images once for both compose files; remove them (and their builder stages)
    when the module is done."""
    build = uuid.uuid4().hex[:10]
    gateway = urllib.parse.urlsplit(wheel_server).hostname or ""
    env = {
        **os.environ,
        "ESTUARY_TAG": f"e2e-{build}",
        "ESTUARY_BUILD": build,
        "ESTUARY_BASE_IMAGE": base_image,
        "ESTUARY_DEVICE_BASE_IMAGE": base_image,
        "ESTUARY_FIND_LINKS": wheel_server,
        "ESTUARY_TRUSTED_HOST": gateway,
        "ESTUARY_OFFLINE": "1",
        "ESTUARY_TORCH_SPEC": "torch==2.13.0+cpu",
        "ESTUARY_DEVICE_TORCH_SPEC": "torch==2.13.0+cpu",
    }
    built = Images(build=build, env=env, compose=_compose_cmd(),
                   out=tmp_path_factory.mktemp("e2e-out"))  # fmt: skip
    try:
        t0 = time.monotonic()
        _run([*built.compose, "-p", f"estuarye2e{build}", "-f", str(COMPOSE_FILE), "build"],
             timeout=BUILD_TIMEOUT_S, env=env)  # fmt: skip
        built.timings["build_s"] = time.monotonic() - t0
        print(f"\ndocker e2e: build {built.timings['build_s']:.0f} s")
        yield built
    finally:
        # the top-level images (their intermediate layers go with them), as `down --rmi all`
        ids = _run(["docker", "images", "-q", "--filter", f"label=io.estuary.build={build}"],
                   timeout=60, check=False).stdout.split()  # fmt: skip
        if ids:
            _run(["docker", "rmi", "-f", *dict.fromkeys(ids)], timeout=600, check=False)
        # the builder stages are untagged images carrying the build label
        _run(["docker", "image", "prune", "-f", "--filter", f"label=io.estuary.build={build}"],
             timeout=300, check=False)  # fmt: skip
        left = _leftovers(None, build)
        assert not left, f"images left behind: {left}"


def _bring_up(images: Images, file: Path, name: str, sites: tuple[str, ...] = ()) -> Stack:
    """``up -d`` of ``file`` with the built images, until the run is done."""
    env = {
        **images.env,
        "ESTUARY_BROKER_PORT": str(_free_port()),
        "ESTUARY_PROMETHEUS_PORT": str(_free_port()),
    }
    site_ports = {site: _free_port() for site in sites}
    env |= {f"ESTUARY_{site.upper()}_BROKER_PORT": str(p) for site, p in site_ports.items()}
    s = Stack(project=f"estuarye2e{name}{images.build}", env=env, compose=images.compose,
              broker_port=int(env["ESTUARY_BROKER_PORT"]),
              prometheus_port=int(env["ESTUARY_PROMETHEUS_PORT"]),
              out=images.out / name, file=file, site_ports=site_ports)  # fmt: skip
    t0 = time.monotonic()
    _run(s.cmd("up", "-d", "--no-build"), timeout=600, env=env)
    _wait_for_run(s, time.monotonic() + RUN_TIMEOUT_S)
    s.timings["run_s"] = time.monotonic() - t0
    print(f"\ndocker e2e ({file.name}): run {s.timings['run_s']:.0f} s")
    return s


def _tear_down(s: Stack) -> None:
    t0 = time.monotonic()
    _run(s.cmd("down", "-v", "--remove-orphans", "-t", "20"), timeout=600, env=s.env,
         check=False)  # fmt: skip
    left = _leftovers(s.project, None)
    print(f"docker e2e ({s.file.name}): teardown {time.monotonic() - t0:.0f} s")
    assert not left, f"left behind after teardown: {left}"


@pytest.fixture(scope="module")
def stack(images: Images) -> Iterator[Stack]:
    """The federation of docker/compose.yaml brought up and run to completion; torn down."""
    s: Stack | None = None
    try:
        s = _bring_up(images, COMPOSE_FILE, "one")
        yield s
    finally:
        if s is None:  # up or the run failed: take down what came up
            s = Stack(project=f"estuarye2eone{images.build}", env=images.env,
                      compose=images.compose, broker_port=0, prometheus_port=0,
                      out=images.out, file=COMPOSE_FILE)  # fmt: skip
        _tear_down(s)


@pytest.fixture(scope="module")
def sites(images: Images) -> Iterator[Stack]:
    """The federation of docker/compose.per-edge.yaml run to completion; torn down. (Its tests
    come after the one-broker stack's, whose brokers and Prometheus stay up, idle, until the
    module ends.)"""
    s: Stack | None = None
    try:
        s = _bring_up(images, PER_EDGE_FILE, "sites", tuple(EDGES))
        yield s
    finally:
        if s is None:
            s = Stack(project=f"estuarye2esites{images.build}", env=images.env,
                      compose=images.compose, broker_port=0, prometheus_port=0,
                      out=images.out, file=PER_EDGE_FILE)  # fmt: skip
        _tear_down(s)


def _wait_for_run(s: Stack, deadline: float) -> None:
    """Until the cloud, the edges and the devices have exited; fail fast on a crash."""

    def failed(states: dict[str, dict[str, object]]) -> dict[str, object]:
        exited = {r: states[r] for r in ROLES if states[r].get("Status") == "exited"}
        return {r: st.get("ExitCode") for r, st in exited.items() if st.get("ExitCode") != 0}

    while True:
        states = s.states()
        assert ROLES <= set(states), f"containers missing: {ROLES - set(states)}"
        if failed(states):
            time.sleep(5)  # `restart: on-failure` may bring them back; look again
            states = s.states()
            if bad := failed(states):
                raise AssertionError(f"roles failed: {bad}\n{s.logs()}")
        if all(states[r].get("Status") == "exited" for r in ROLES):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"run not done in {RUN_TIMEOUT_S} s\n{s.logs()}")
        time.sleep(5)


def test_run_completes_and_deploys(stack: Stack) -> None:
    _assert_run_completed_and_deployed(stack)


def _assert_run_completed_and_deployed(stack: Stack) -> None:
    for role in sorted(ROLES):
        assert stack.state(role).get("ExitCode") == 0, f"{role} failed\n{stack.logs()}"
    run = stack.copy_out("cloud", "/var/lib/estuary/run")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds"] == 2, summary
    reports = json.loads((run / "deploy" / "reports.json").read_text())
    sampled = {d for d, r in reports.items() if r.get("event") == "sampled"}
    assert sampled == set(DEVICES), reports
    # onnxruntime-gpu lists CUDA everywhere; without a GPU reservation the devices fall back
    providers = {r.get("provider") for r in reports.values()}
    assert providers == {"CPUExecutionProvider"}, reports
    assert (run / "deploy" / "model.onnx").stat().st_size > 0


def test_prometheus_scraped_byte_counters_from_every_role(stack: Stack) -> None:
    query = 'sum by (instance, role) (max_over_time(estuary_bytes_total{direction="sent"}[1h]))'
    url = (f"http://127.0.0.1:{stack.prometheus_port}/api/v1/query?"
           + urllib.parse.urlencode({"query": query}))  # fmt: skip
    with urllib.request.urlopen(url, timeout=30) as reply:
        result = json.load(reply)["data"]["result"]
    sent = {r["metric"]["instance"]: float(r["value"][1]) for r in result}
    roles = {r["metric"]["instance"]: r["metric"]["role"] for r in result}
    assert set(sent) == ROLES, sent
    assert all(v > 0 for v in sent.values()), sent
    assert {roles[i] for i in ROLES} == {"cloud", "edge", "device"}


def test_prometheus_evaluated_the_shipped_rules_without_false_alarms(stack: Stack) -> None:
    """The image's Prometheus loaded docker/estuary-rules.yml and evaluated every rule on the
    real series without errors; after a clean run, whose roles exited once it was done, no
    down or stalled alert is pending or firing."""
    base = f"http://127.0.0.1:{stack.prometheus_port}/api/v1"
    with urllib.request.urlopen(f"{base}/rules", timeout=30) as reply:
        groups = json.load(reply)["data"]["groups"]
    assert {g["name"] for g in groups} == {"estuary-load", "estuary-alerts"}
    unhealthy = [(r["name"], r["health"], r.get("lastError")) for g in groups
                 for r in g["rules"] if r["health"] != "ok"]  # fmt: skip
    assert not unhealthy, unhealthy
    with urllib.request.urlopen(f"{base}/alerts", timeout=30) as reply:
        alerts = json.load(reply)["data"]["alerts"]
    print("alerts after the run:", [(a["labels"]["alertname"], a["state"]) for a in alerts])
    false = {"EstuaryCloudDown", "EstuaryEdgeDown", "EstuaryDeviceDown", "EstuaryRoundStalled"}
    assert not [a for a in alerts if a["labels"]["alertname"] in false], alerts


def test_devices_wrote_grids_from_the_deployed_model(stack: Stack) -> None:
    for device in DEVICES:
        deploy = stack.copy_out(device, "/var/lib/estuary/deploy")
        grids = sorted(deploy.rglob("*.png"))
        assert grids, f"{device} wrote no sample grid: {sorted(deploy.rglob('*'))}"
        with Image.open(grids[0]) as img:
            assert img.width >= 28 and img.height >= 28
        assert list(deploy.rglob("model.onnx")), f"{device} kept no deployed model"


def test_status_reads_the_finished_run_through_the_acl(stack: Stack) -> None:
    """``estuary status`` as the provisioned read-only observer account: the run is done,
    every role said goodbye, and every device sampled the deployed model."""
    creds = stack.copy_out("provision", "/provision/credentials")
    env = {**os.environ, "ESTUARY__BROKER__USERNAME": "observer",
           "ESTUARY_MQTT_PASSWORD": (creds / "observer.password").read_text()}  # fmt: skip
    config = str(ROOT / "docker" / "config.toml")
    proc = _run([sys.executable, "-m", "estuary", "status", config, "--json",
                 "--broker", f"127.0.0.1:{stack.broker_port}"], timeout=120, env=env)  # fmt: skip
    doc = json.loads(proc.stdout)
    assert doc["cloud"]["state"]["phase"] == "done" and doc["same_config"] is True, doc
    assert doc["cloud"]["online"] is False
    assert all(e["online"] is False and e["state"] for e in doc["edges"].values()), doc["edges"]
    for device in DEVICES:
        view = doc["devices"][device]
        assert view["online"] is False and view["hello"]["device"] == device, view
        assert view["deploy"]["event"] == "sampled", view
    assert doc["rejected"] == {}


def test_device_credentials_cannot_write_cloud_topics_or_read_other_devices(
    stack: Stack,
) -> None:
    creds = stack.copy_out("provision", "/provision/credentials")
    pw = {name: (creds / f"{name}.password").read_text() for name in ("cloud", "dev000", "dev001")}
    host, port = "127.0.0.1", stack.broker_port
    anonymous, code = connect(host, port, None, None)
    close(anonymous)
    assert code != 0, "the broker let an anonymous client in"
    cloud = login(host, port, "cloud", pw["cloud"])
    dev0 = login(host, port, "dev000", pw["dev000"])
    dev1 = login(host, port, "dev001", pw["dev001"])
    try:
        at_cloud = inbox(cloud, f"{BASE}/#")
        at_dev0 = inbox(dev0, f"{BASE}/device/dev001/up", f"{BASE}/device/+/up")
        for topic in (f"{BASE}/cloud/state", f"{BASE}/cloud/deploy", f"{BASE}/cloud/round"):
            dev0.publish(topic, b"{}", qos=1)
        dev1.publish(f"{BASE}/device/dev001/up", b"{}", qos=1)  # dev001 may write its own
        got_cloud = received(at_cloud, 2.0)
        assert f"{BASE}/device/dev001/up" in got_cloud  # the positive control
        assert not {t for t in got_cloud if t.startswith(f"{BASE}/cloud/")}, got_cloud
        assert received(at_dev0, 0.5) == set(), "dev000 read another device's update"
    finally:
        close(cloud, dev0, dev1)


def test_a_cpu_limited_device_container_trains_with_that_many_threads(stack: Stack) -> None:
    """``docker run --cpus 1`` of the device image: torch in the container counts every core
    of the host, and the roles' cap (``shared.runtime.cpu``, ``train.threads = 0``) uses the one CPU
    the container may."""
    image = f"estuary/device:{stack.env['ESTUARY_TAG']}"
    proc = _run(["docker", "run", "--rm", "--cpus", "1", "--network", "none",
                 "--entrypoint", "/opt/venv/bin/python", image, "-c", PROBE],
                timeout=300)  # fmt: skip
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["limit"] == 1.0 and got["budget"] == 1, got
    assert got["after"] == got["torch"] == 1, got
    if (os.cpu_count() or 1) > 1:
        assert got["before"] > 1, got  # what a role used before the cap


FOLDER_PROBE = """
import json
from shared.data.datasets import load_image_folder
d = load_image_folder("/data", progress=False)
print(json.dumps({"n": len(d), "labels": d.labels.tolist(), "sum": int(d.images.sum())}))
"""


def test_a_device_container_reads_its_mounted_image_folder(stack: Stack, tmp_path: Path) -> None:
    """A device's own images mounted read-only into the device image (``--data /data``):
    the container's non-root user reads them as the host does."""
    from shared.data.datasets import load_image_folder, synthetic_dataset, write_image_folder

    folder = tmp_path / "images"
    data = synthetic_dataset(24, seed=4)
    write_image_folder(data, folder, [f"{i:02d}" for i in range(len(data))])
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    want = load_image_folder(folder, progress=False)
    image = f"estuary/device:{stack.env['ESTUARY_TAG']}"
    proc = _run(["docker", "run", "--rm", "--network", "none", "-v", f"{folder}:/data:ro",
                 "--entrypoint", "/opt/venv/bin/python", image, "-c", FOLDER_PROBE],
                timeout=300)  # fmt: skip
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"n": 24, "labels": want.labels.tolist(), "sum": int(want.images.sum())}


# --------------------------------------------------------------------------- per-edge


def _interfaces(stack: Stack, service: str) -> dict[str, tuple[int, int]]:
    """Compose network name -> (received, sent) bytes of the container's interface on it,
    read from the kernel's counters inside the container."""
    container = stack.container(service)
    script = ('for i in /sys/class/net/*; do echo "$(cat $i/address) '
              '$(cat $i/statistics/rx_bytes) $(cat $i/statistics/tx_bytes)"; done')  # fmt: skip
    counters = {}
    out = _run(["docker", "exec", container, "sh", "-c", script], timeout=60).stdout
    for line in out.splitlines():
        mac, rx, tx = line.split()
        counters[mac.lower()] = (int(rx), int(tx))
    fmt = "{{json .NetworkSettings.Networks}}"
    networks = json.loads(_run(["docker", "inspect", "-f", fmt, container], timeout=30).stdout)
    prefix = f"{stack.project}_"
    return {name.removeprefix(prefix): counters[net["MacAddress"].lower()]
            for name, net in networks.items()}  # fmt: skip


def _prometheus(stack: Stack, query: str) -> dict[str, float]:
    """instance -> value of an instant ``query`` on the stack's Prometheus."""
    url = (f"http://127.0.0.1:{stack.prometheus_port}/api/v1/query?"
           + urllib.parse.urlencode({"query": query}))  # fmt: skip
    with urllib.request.urlopen(url, timeout=30) as reply:
        result = json.load(reply)["data"]["result"]
    return {r["metric"]["instance"]: float(r["value"][1]) for r in result}


def test_per_edge_run_completes_and_deploys(sites: Stack) -> None:
    _assert_run_completed_and_deployed(sites)


def test_per_edge_device_traffic_stays_at_its_site(sites: Stack) -> None:
    """Each site broker received at least what its edge and devices put on the wire (the
    devices' updates among it), and its bridge sent the cloud broker less than the edge's
    wire bytes plus half of the devices': had the devices' updates crossed, it would have
    sent at least the edge's and all of the devices'. The figures are printed."""
    sent = _prometheus(sites, "max_over_time(estuary_transport_wire_bytes_sent_total[1h])")
    assert ROLES <= set(sent), sent
    cloud_broker = _interfaces(sites, "broker")
    print(f"\nper-edge: cloud broker (rx, tx) {cloud_broker}; cloud sent {sent['cloud']:.0f}")
    for edge in EDGES:
        devices = [d for d in DEVICES if HOME[d] == edge]
        at_site = _interfaces(sites, f"broker-{edge}")
        assert set(at_site) == {"cloud", f"site-{edge}"}, at_site
        site_rx, _ = at_site[f"site-{edge}"]
        bridge_rx, bridge_tx = at_site["cloud"]
        edge_sent, devices_sent = sent[edge], sum(sent[d] for d in devices)
        print(f"per-edge: site {edge}: broker received {site_rx} on the site network; bridge "
              f"sent {bridge_tx}, received {bridge_rx}; {edge} sent {edge_sent:.0f}, "
              f"{'+'.join(devices)} sent {devices_sent:.0f}")  # fmt: skip
        assert devices_sent > 0 and edge_sent > 0
        assert site_rx >= edge_sent + devices_sent, "the site broker missed its roles' traffic"
        # TCP/IP headers and acknowledgements: well under 5 % of what crosses either way
        overhead = 0.05 * (bridge_tx + bridge_rx)
        assert bridge_tx < edge_sent + devices_sent / 2 + overhead, (
            f"the bridge of {edge} sent {bridge_tx} bytes to the cloud: device updates crossed?"
        )


def test_per_edge_device_credentials_work_on_their_sites_broker_only(sites: Stack) -> None:
    creds = sites.copy_out("provision", "/provision/credentials")
    host = "127.0.0.1"
    for device in ("dev000", "dev001"):
        password = (creds / f"{device}.password").read_text()
        ports = {"cloud": sites.broker_port, **sites.site_ports}
        for site, port in ports.items():
            c, code = connect(host, port, device, password)
            close(c)
            assert (code == 0) == (site == HOME[device]), (device, site, code)


def test_per_edge_status_sees_the_federation_and_the_bridges(sites: Stack) -> None:
    """`estuary status` as the observer on the cloud broker: the cloud's, the edges' and the
    devices' retained state all reached it (the devices' across the bridges), the run is done
    and every device sampled the deployment; each site broker says its bridge is up."""
    from estuary.status import bridge_state
    from shared.config import load_config

    creds = sites.copy_out("provision", "/provision/credentials")
    password = (creds / "observer.password").read_text()
    env = {**os.environ, "ESTUARY__BROKER__USERNAME": "observer",
           "ESTUARY_MQTT_PASSWORD": password}  # fmt: skip
    config = ROOT / "docker" / "config.per-edge.toml"
    proc = _run([sys.executable, "-m", "estuary", "status", str(config), "--json",
                 "--broker", f"127.0.0.1:{sites.broker_port}"], timeout=120, env=env)  # fmt: skip
    doc = json.loads(proc.stdout)
    assert doc["cloud"]["state"]["phase"] == "done" and doc["same_config"] is True, doc
    assert set(doc["edges"]) == set(EDGES) and all(e["state"] for e in doc["edges"].values())
    for device in DEVICES:
        view = doc["devices"][device]
        assert view["hello"]["device"] == device and view["deploy"]["event"] == "sampled", view
    cfg = load_config(config)
    for edge, port in sites.site_ports.items():
        section = cfg.broker.model_copy(update={
            "host": "127.0.0.1", "port": port, "username": "observer",
            "password_file": str(creds / "observer.password")})  # fmt: skip
        assert bridge_state(cfg.model_copy(update={"broker": section}), edge, 10.0) is True, edge
