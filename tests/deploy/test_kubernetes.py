"""The Kubernetes manifests of a fleet (deploy/kubernetes/): Kubernetes' own schemas,
the generator, the collector configs they embed, and the wiring between the tiers
(vLLM -> agent on its node -> load balancer -> gateways), each check shown to fail
on a broken copy. No cluster runs here: scheduling, DNS, hostPort reachability and
the collectors' start-up are not checked."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_kit import (
    COLLECTOR_CONFIG,
    DEPLOY,
    SERVICES,
    load,
    pipeline_problems,
    rel,
    schema_token_problems,
)

from vllm_journey_otel import config as C

K8S_DIR = DEPLOY / "kubernetes"
GENERATOR = K8S_DIR / "generate_manifests.py"
KUSTOMIZATION = K8S_DIR / "kustomization.yaml"
MANIFESTS = sorted(p for p in K8S_DIR.glob("*.yaml") if p != KUSTOMIZATION)
LOADBALANCER_FILE = COLLECTOR_CONFIG / "loadbalancer.yaml"
NAMESPACE = "vllm-journey"
# The oldest Kubernetes these manifests are meant for, and a current one; both
# bundled by kubernetes-validate.
K8S_VERSIONS = ("1.30", "1.34")

WORKLOAD_KINDS = ("Deployment", "DaemonSet", "StatefulSet")
CLUSTER_SCOPED = ("Namespace",)
# Variables vLLM itself (not the plugin) reads that a pod may set.
VLLM_OWN_ENV = {"HF_TOKEN"}
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|API_KEY")
ENV_REF = re.compile(r"\$\{(?:env:)?([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
K8S_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


# ---------------------------------------------------------------------------
# Reading the manifests
# ---------------------------------------------------------------------------
def resources_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """A file's resources: the items of a `kind: List`, else the document itself."""
    if doc.get("kind") == "List":
        assert doc["apiVersion"] == "v1" and isinstance(doc["items"], list)
        return doc["items"]
    return [doc]


def fleet() -> list[dict[str, Any]]:
    """Every resource of every manifest (a fresh copy, for the broken-copy tests)."""
    return [r for path in MANIFESTS for r in resources_of(load(path))]


def find(res: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [r for r in res if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def workloads(res: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in res if r["kind"] in WORKLOAD_KINDS]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    return pod_spec(workload)["containers"]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """The container's literal env values (valueFrom ones as '<from>')."""
    return {e["name"]: e.get("value", "<from>") for e in container.get("env", [])}


def config_of(res: list[dict[str, Any]], container: dict[str, Any]) -> tuple[str, str] | None:
    """(key, text) of the collector config a container reads: its --config= path, in
    the directory where a ConfigMap volume is mounted, is one key of that ConfigMap."""
    paths = [a.split("=", 1)[1] for a in container.get("args", []) if a.startswith("--config=")]
    if not paths:
        return None
    (path,) = paths
    workload = next(w for w in workloads(res) if container in containers(w))
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if str(Path(path).parent) == mount["mountPath"].rstrip("/"):
            cm = find(res, "ConfigMap", volumes[mount["name"]]["configMap"]["name"])
            key = Path(path).name
            return key, cm["data"][key]
    raise AssertionError(f"{container['name']}: {path} is in no mounted ConfigMap")


def resolve(value: Any, env: dict[str, str]) -> str:
    """A collector config value with `${env:NAME:-default}` replaced as the collector
    would, given the container's environment."""
    return ENV_REF.sub(lambda m: env.get(m.group(1), m.group(2) or ""), str(value))


def selected(res: list[dict[str, Any]], service: dict[str, Any]) -> list[dict[str, Any]]:
    """The workloads whose pods a Service selects."""
    sel = service["spec"].get("selector") or {}
    return [
        w
        for w in workloads(res)
        if sel and sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()
    ]


def port_numbers(workload: dict[str, Any]) -> dict[str | int, int]:
    """Container ports of a workload by name and by number -> number."""
    out: dict[str | int, int] = {}
    for c in containers(workload):
        for p in c.get("ports", []):
            out[p["containerPort"]] = p["containerPort"]
            if "name" in p:
                out[p["name"]] = p["containerPort"]
    return out


def service_target(res: list[dict[str, Any]], name: str, port: int) -> list[tuple[Any, int]]:
    """(workload, container port) that a Service's `port` leads to."""
    service = find(res, "Service", name)
    (sp,) = [p for p in service["spec"]["ports"] if p["port"] == port]
    target = sp.get("targetPort", sp["port"])
    return [(w, port_numbers(w)[target]) for w in selected(res, service)]


def grpc_port(config_text: str) -> int:
    cfg = yaml.safe_load(config_text)
    return int(cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1])


def mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 * 1024, "M": 1e6 / 2**20}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", str(quantity))
    assert m and (m.group(2) in units or not m.group(2)), quantity
    return float(m.group(1)) * (units[m.group(2)] if m.group(2) else 1 / 2**20)


def collector(res: list[dict[str, Any]], workload_name: str) -> tuple[dict[str, Any], Any]:
    """(container, parsed config) of a collector workload."""
    workload = next(w for w in workloads(res) if w["metadata"]["name"] == workload_name)
    (container,) = containers(workload)
    found = config_of(res, container)
    assert found, workload_name
    return container, yaml.safe_load(found[1])


# ---------------------------------------------------------------------------
# The checks; each returns problems (the broken-copy tests prove they can fail)
# ---------------------------------------------------------------------------
def schema_problems(resource: dict[str, Any], version: str) -> list[str]:
    where = f"{resource.get('kind')}/{resource.get('metadata', {}).get('name')}"
    try:
        kubernetes_validate.validate(resource, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{where}: {'.'.join(map(str, e.path))}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        # The CLI only warns here; an unknown kind is a mistake in this kit.
        return [f"{where}: {e.message}"]
    return []


def embedded_config_problems(res: list[dict[str, Any]]) -> list[str]:
    problems = []
    embedded: set[str] = set()
    for cm in (r for r in res if r["kind"] == "ConfigMap"):
        for key, text in cm["data"].items():
            embedded.add(key)
            source = COLLECTOR_CONFIG / key
            if not source.exists():
                problems.append(f"ConfigMap {cm['metadata']['name']}: no collector-config/{key}")
            elif text != source.read_text():
                problems.append(
                    f"ConfigMap {cm['metadata']['name']}: {key} differs from {rel(source)}"
                )
            problems += [f"{key}: {p}" for p in pipeline_problems(yaml.safe_load(text))]
    for w in workloads(res):
        for c in containers(w):
            found = config_of(res, c)
            if found is None:
                continue
            want = hashlib.sha256(found[1].encode()).hexdigest()
            have = w["spec"]["template"]["metadata"].get("annotations", {}).get("checksum/config")
            if have != want:
                problems.append(f"{w['metadata']['name']}: checksum/config is not {found[0]}'s")
    if not {"agent.yaml", "loadbalancer.yaml", "gateway.yaml"} <= embedded:
        problems.append(f"embedded configs: {sorted(embedded)}")
    return problems


def vllm_to_agent_problems(res: list[dict[str, Any]]) -> list[str]:
    """vLLM's endpoint is http://$(NODE_IP):<hostPort of the agent>, where that
    hostPort is the container port of the agent's OTLP gRPC receiver."""
    problems = []
    (vllm,) = containers(find(res, "Deployment", "vllm"))
    env = {e["name"]: e for e in vllm["env"]}
    if env_of(vllm).get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") != "grpc":
        problems.append("vLLM: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is not grpc")
    if env_of(vllm).get(C.ENABLE) != "1":
        problems.append(f"vLLM: {C.ENABLE} is not 1")
    endpoint = env_of(vllm).get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
    m = re.fullmatch(r"http://\$\(([A-Z_]+)\):(\d+)", endpoint)
    if not m:
        return [*problems, f"vLLM: endpoint {endpoint!r} is not http://$(NODE_IP):PORT"]
    var, port = m.group(1), int(m.group(2))
    ref = env.get(var, {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    if ref != "status.hostIP":
        problems.append(f"vLLM: {var} is not the downward API's status.hostIP")
    (agent,) = [w for w in workloads(res) if w["kind"] == "DaemonSet"]
    (container,) = containers(agent)
    found = config_of(res, container)
    assert found
    host_ports = {
        p.get("hostPort"): p["containerPort"] for p in container["ports"] if p.get("hostPort")
    }
    if host_ports.get(port) != grpc_port(found[1]):
        problems.append(
            f"vLLM sends to hostPort {port}; the agent's receiver is on {grpc_port(found[1])}"
            f" (hostPorts {host_ports})"
        )
    return problems


def service_dns_problems(host: str, kind: str) -> tuple[str, list[str]]:
    """(Service name, problems) of a DNS name that must be a Service of NAMESPACE."""
    service, _, rest = host.partition(".")
    if rest and rest not in (NAMESPACE, f"{NAMESPACE}.svc", f"{NAMESPACE}.svc.cluster.local"):
        return service, [f"{kind} {host!r} is not a Service of namespace {NAMESPACE}"]
    return service, []


def agent_to_loadbalancer_problems(res: list[dict[str, Any]]) -> list[str]:
    container, cfg = collector(res, "otel-agent")
    exporters = [e for e in cfg["exporters"] if e.split("/")[0] == "otlp"]
    (exporter,) = exporters
    endpoint = resolve(cfg["exporters"][exporter]["endpoint"], env_of(container))
    host, _, port = endpoint.rpartition(":")
    name, problems = service_dns_problems(host, "GATEWAY_ENDPOINT")
    if not any(r["kind"] == "Service" and r["metadata"]["name"] == name for r in res):
        return [*problems, f"GATEWAY_ENDPOINT {endpoint!r}: no Service {name!r}"]
    try:
        targets = service_target(res, name, int(port))
    except (ValueError, KeyError):
        return [*problems, f"GATEWAY_ENDPOINT {endpoint!r}: Service {name} has no such port"]
    if not targets:
        problems.append(f"Service {name} selects no workload")
    for workload, cport in targets:
        wcontainer, wcfg = collector(res, workload["metadata"]["name"])
        found = config_of(res, wcontainer)
        assert found
        if "loadbalancing" not in wcfg["exporters"]:
            problems.append(f"GATEWAY_ENDPOINT leads to {workload['metadata']['name']}, no LB")
        if cport != grpc_port(found[1]):
            problems.append(f"Service {name} leads to port {cport}, the receiver is elsewhere")
    return problems


def loadbalancer_to_gateway_problems(res: list[dict[str, Any]]) -> list[str]:
    container, cfg = collector(res, "otel-loadbalancer")
    lb = cfg["exporters"]["loadbalancing"]
    problems = []
    if lb.get("routing_key") != "traceID":
        problems.append(f"routing_key is {lb.get('routing_key')!r}, not traceID")
    dns = lb["resolver"].get("dns")
    if not dns:
        return [*problems, "the load balancer has no dns resolver"]
    host = resolve(dns["hostname"], env_of(container))
    name, more = service_dns_problems(host, "resolver hostname")
    problems += more
    services = [r for r in res if r["kind"] == "Service" and r["metadata"]["name"] == name]
    if not services:
        return [*problems, f"resolver hostname {host!r}: no Service {name!r}"]
    (service,) = services
    if service["spec"].get("clusterIP") != "None":
        problems.append(f"Service {name} is not headless (clusterIP: None): DNS gives one IP")
    gateways = selected(res, service)
    if not gateways:
        problems.append(f"Service {name} selects no workload")
    for gw in gateways:
        gcontainer, _ = collector(res, gw["metadata"]["name"])
        found = config_of(res, gcontainer)
        assert found
        port = int(resolve(dns.get("port", 4317), env_of(container)))
        if port != grpc_port(found[1]) or port not in port_numbers(gw).values():
            problems.append(f"resolver port {port} is not the gateway's receiver port")
        if gw["kind"] == "StatefulSet" and gw["spec"]["serviceName"] != name:
            problems.append(f"StatefulSet {gw['metadata']['name']}: serviceName is not {name}")
    return problems


def service_port_problems(res: list[dict[str, Any]]) -> list[str]:
    """Every Service selects a workload and each targetPort is a port of its pods;
    every probe and Prometheus annotation names a container port."""
    problems = []
    for service in (r for r in res if r["kind"] == "Service"):
        name = service["metadata"]["name"]
        chosen = selected(res, service)
        if not chosen:
            problems.append(f"Service {name} selects no workload")
        for w in chosen:
            for p in service["spec"]["ports"]:
                if p.get("targetPort", p["port"]) not in port_numbers(w):
                    problems.append(
                        f"Service {name}: targetPort {p.get('targetPort')!r} is no port"
                        f" of {w['metadata']['name']}"
                    )
    for w in workloads(res):
        ports = port_numbers(w)
        for c in containers(w):
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                port = c.get(probe, {}).get("httpGet", {}).get("port")
                if probe in c and port not in ports:
                    problems.append(f"{c['name']}: {probe} port {port!r} is no container port")
        annotated = w["spec"]["template"]["metadata"].get("annotations", {})
        if "prometheus.io/port" in annotated and int(annotated["prometheus.io/port"]) not in ports:
            problems.append(f"{w['metadata']['name']}: prometheus.io/port is no container port")
    return problems


def env_problems(res: list[dict[str, Any]]) -> list[str]:
    """A collector sets only variables its config reads; vLLM only the plugin's own,
    the SDK's OTEL_*, vLLM's own, and downward-API helpers it expands; each $(VAR)
    is defined before it is used; secrets come from a Secret."""
    problems = []
    for w in workloads(res):
        for c in containers(w):
            entries = c.get("env", [])
            found = config_of(res, c)
            expanded = {
                ref
                for text in [*(e.get("value", "") for e in entries), *c.get("args", [])]
                for ref in K8S_REF.findall(text)
            }
            defined: set[str] = set()
            for e in entries:
                name = e["name"]
                for ref in K8S_REF.findall(e.get("value", "")):
                    if ref not in defined:
                        problems.append(f"{c['name']}: {name} uses $({ref}) before it is set")
                if found is not None:
                    if name not in {m[0] for m in ENV_REF.findall(found[1])}:
                        problems.append(f"{c['name']}: {name} is not read by {found[0]}")
                elif not (
                    name in C.ALL_VARIABLES
                    or name.startswith("OTEL_")
                    or name in VLLM_OWN_ENV
                    or ("fieldRef" in e.get("valueFrom", {}) and name in expanded)
                ):
                    problems.append(f"{c['name']}: {name} is neither the plugin's nor used")
                if SECRET_NAME.search(name) and "secretKeyRef" not in e.get("valueFrom", {}):
                    problems.append(f"{c['name']}: {name} must come from a Secret")
                defined.add(name)
    return problems


def memory_problems(res: list[dict[str, Any]]) -> list[str]:
    """memory_limiter's limit (as the container's env sets it) is below the
    container's memory limit, with the spike allowance below the limit."""
    problems = []
    for w in workloads(res):
        for c in containers(w):
            found = config_of(res, c)
            if found is None:
                continue
            limiter = yaml.safe_load(found[1])["processors"]["memory_limiter"]
            limit = float(resolve(limiter["limit_mib"], env_of(c)))
            spike = float(resolve(limiter.get("spike_limit_mib", 0), env_of(c)))
            memory = c.get("resources", {}).get("limits", {}).get("memory")
            if memory is None:
                problems.append(f"{c['name']}: no memory limit")
            elif not spike < limit < mebibytes(memory):
                problems.append(
                    f"{c['name']}: memory_limiter {limit} MiB (spike {spike}) vs limit {memory}"
                )
    return problems


def placement_problems(res: list[dict[str, Any]]) -> list[str]:
    """Namespace, images, security contexts, the GPU count, the tiers' sizes."""
    problems = []
    if not any(r["kind"] == "Namespace" and r["metadata"]["name"] == NAMESPACE for r in res):
        problems.append(f"no Namespace {NAMESPACE}")
    for r in res:
        if r["kind"] not in CLUSTER_SCOPED and r["metadata"].get("namespace") != NAMESPACE:
            problems.append(f"{r['kind']}/{r['metadata']['name']} is not in {NAMESPACE}")
    compose_otel = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", SERVICES["otel-gateway"]["image"])
    for w in workloads(res):
        spec = pod_spec(w)
        for c in containers(w):
            sc = c.get("securityContext", {})
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{c['name']}: allowPrivilegeEscalation is not false")
            if config_of(res, c) is None:
                continue
            if c["image"] != compose_otel:
                problems.append(f"{c['name']}: image {c['image']} is not compose's {compose_otel}")
            if spec.get("securityContext", {}).get("runAsNonRoot") is not True:
                problems.append(f"{c['name']}: runAsNonRoot is not true")
            if sc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{c['name']}: readOnlyRootFilesystem is not true")
    (vllm,) = containers(find(res, "Deployment", "vllm"))
    if vllm["image"] != SERVICES["vllm-gpu"]["image"]:
        problems.append(f"vLLM image {vllm['image']} is not the one Dockerfile.gpu builds")
    dp = [int(a.split("=")[1]) for a in vllm["args"] if a.startswith("--data-parallel-size=")]
    gpus = int(vllm["resources"]["limits"].get("nvidia.com/gpu", 0))
    if not gpus or gpus != (dp[0] if dp else 1):
        problems.append(f"vLLM: {gpus} GPUs for data-parallel size {dp}")
    if find(res, "StatefulSet", "otel-gateway")["spec"]["replicas"] != 3:
        problems.append("not 3 gateways")
    if find(res, "Deployment", "otel-loadbalancer")["spec"]["replicas"] != 2:
        problems.append("not 2 load balancers")
    return problems


CHECKS: dict[str, Callable[[list[dict[str, Any]]], list[str]]] = {
    "embedded configs": embedded_config_problems,
    "vLLM -> agent": vllm_to_agent_problems,
    "agent -> load balancer": agent_to_loadbalancer_problems,
    "load balancer -> gateways": loadbalancer_to_gateway_problems,
    "Service ports": service_port_problems,
    "env": env_problems,
    "memory": memory_problems,
    "placement": placement_problems,
}


# ---------------------------------------------------------------------------
# (a) Kubernetes' schemas
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=rel)
def test_manifests_validate_against_the_kubernetes_schemas(path: Path, version: str) -> None:
    res = resources_of(load(path))
    assert res
    assert [p for r in res for p in schema_problems(r, version)] == []


def test_schema_check_rejects_misspelt_fields_and_kinds() -> None:
    gateway = find(fleet(), "StatefulSet", "otel-gateway")
    assert schema_problems(gateway, K8S_VERSIONS[0]) == []
    typo = copy.deepcopy(gateway)
    typo["spec"]["replcas"] = typo["spec"].pop("replicas")
    (problem,) = schema_problems(typo, K8S_VERSIONS[0])
    assert "'replcas' was unexpected" in problem
    deep = copy.deepcopy(gateway)
    deep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPrt"] = 4317
    assert any("containerPrt" in p for p in schema_problems(deep, K8S_VERSIONS[0]))
    wrong_type = copy.deepcopy(gateway)
    wrong_type["spec"]["replicas"] = "three"
    assert schema_problems(wrong_type, K8S_VERSIONS[0])
    kind = copy.deepcopy(gateway)
    kind["kind"] = "StatefulSett"
    assert any("Couldn't find schema" in p for p in schema_problems(kind, K8S_VERSIONS[0]))


def test_kustomization_lists_every_manifest() -> None:
    kustomization = load(KUSTOMIZATION)
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS)
    assert len(set(kustomization["resources"])) == len(kustomization["resources"])


# ---------------------------------------------------------------------------
# (b) the generator
# ---------------------------------------------------------------------------
def test_manifests_are_the_generators_output() -> None:
    spec = importlib.util.spec_from_file_location("generate_manifests", GENERATOR)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rendered = module.render()
    assert sorted(rendered) == sorted(p.name for p in K8S_DIR.glob("*.yaml"))
    for name, text in rendered.items():
        assert (K8S_DIR / name).read_text() == text, (
            f"{name} is stale: run python deploy/kubernetes/generate_manifests.py"
        )


# ---------------------------------------------------------------------------
# (c) the collector configs, (d) the wiring: the shipped fleet passes every check
# ---------------------------------------------------------------------------
def test_loadbalancer_config_routes_by_trace_to_the_gateways() -> None:
    cfg = load(LOADBALANCER_FILE)
    assert pipeline_problems(cfg) == []
    (pipeline,) = cfg["service"]["pipelines"].values()
    assert pipeline["processors"][0] == "memory_limiter"
    assert pipeline["exporters"] == ["loadbalancing"]
    lb = cfg["exporters"]["loadbalancing"]
    assert lb["routing_key"] == "traceID"
    assert lb["protocol"]["otlp"]["tls"]["insecure"] is True
    assert "endpoint" not in lb["protocol"]["otlp"], "the resolver fills it in"
    # Queue and retries above the per-gateway exporters, so a refused batch is
    # routed again on the current ring; none below, where it would stay bound.
    assert lb["sending_queue"]["enabled"] is True
    assert lb["retry_on_failure"]["enabled"] is True
    assert lb["protocol"]["otlp"]["sending_queue"]["enabled"] is False
    assert set(lb["resolver"]) == {"dns"}
    assert (
        cfg["service"]["telemetry"]["metrics"]["readers"][0]["pull"]["exporter"]["prometheus"][
            "port"
        ]
        == 8888
    )


@pytest.mark.parametrize("check", CHECKS)
def test_the_fleet_is_wired(check: str) -> None:
    assert CHECKS[check](fleet()) == []


# Broken copies: (check, how it is broken, what the check must say).
def _set_env(workload: str, name: str, value: str) -> Callable[[list[dict[str, Any]]], None]:
    def edit(res: list[dict[str, Any]]) -> None:
        (c,) = containers(next(w for w in workloads(res) if w["metadata"]["name"] == workload))
        for e in c["env"]:
            if e["name"] == name:
                e.clear()
                e.update({"name": name, "value": value})
                return
        c["env"].append({"name": name, "value": value})

    return edit


def _edit_configmap(old: str, new: str) -> Callable[[list[dict[str, Any]]], None]:
    def edit(res: list[dict[str, Any]]) -> None:
        cm = find(res, "ConfigMap", "otel-gateway")
        assert old in cm["data"]["gateway.yaml"]
        cm["data"]["gateway.yaml"] = cm["data"]["gateway.yaml"].replace(old, new, 1)

    return edit


def _headless(res: list[dict[str, Any]]) -> None:
    find(res, "Service", "otel-gateway-headless")["spec"].pop("clusterIP")


def _target_port(res: list[dict[str, Any]]) -> None:
    find(res, "Service", "otel-gateway-headless")["spec"]["ports"][1]["targetPort"] = "spanmetric"


def _memory(res: list[dict[str, Any]]) -> None:
    (c,) = containers(find(res, "StatefulSet", "otel-gateway"))
    c["resources"]["limits"]["memory"] = "1Gi"


def _node_ip(res: list[dict[str, Any]]) -> None:
    (c,) = containers(find(res, "Deployment", "vllm"))
    c["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] = "status.podIP"


def _env_order(res: list[dict[str, Any]]) -> None:
    (c,) = containers(find(res, "Deployment", "vllm"))
    c["env"].append(c["env"].pop(0))


def _root(res: list[dict[str, Any]]) -> None:
    pod_spec(find(res, "DaemonSet", "otel-agent"))["securityContext"]["runAsNonRoot"] = False


def _gpus(res: list[dict[str, Any]]) -> None:
    (c,) = containers(find(res, "Deployment", "vllm"))
    c["resources"]["limits"]["nvidia.com/gpu"] = 1


def _namespace(res: list[dict[str, Any]]) -> None:
    find(res, "Service", "otel-loadbalancer")["metadata"]["namespace"] = "default"


def _checksum(res: list[dict[str, Any]]) -> None:
    tmpl = find(res, "Deployment", "otel-loadbalancer")["spec"]["template"]
    tmpl["metadata"]["annotations"]["checksum/config"] = "0" * 64


BROKEN: list[tuple[str, Callable[[list[dict[str, Any]]], None], str]] = [
    ("embedded configs", _edit_configmap("decision_wait: 30s", "decision_wait: 31s"), "differs"),
    (
        "embedded configs",
        _edit_configmap("exporters: [otlp/tempo, otlp/jaeger]", "exporters: [otlp/tempo]"),
        "'otlp/jaeger' is defined but used by no pipeline",
    ),
    ("embedded configs", _checksum, "checksum/config"),
    (
        "vLLM -> agent",
        _set_env("vllm", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://$(NODE_IP):4318"),
        "hostPort 4318",
    ),
    (
        "vLLM -> agent",
        _set_env("vllm", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://otel-agent:4317"),
        "is not http://$(NODE_IP):PORT",
    ),
    ("vLLM -> agent", _node_ip, "status.hostIP"),
    (
        "agent -> load balancer",
        _set_env("otel-agent", "GATEWAY_ENDPOINT", "otel-loadbalancr:4317"),
        "no Service 'otel-loadbalancr'",
    ),
    (
        "agent -> load balancer",
        _set_env("otel-agent", "GATEWAY_ENDPOINT", "otel-loadbalancer.vllm-journey.svc:4318"),
        "has no such port",
    ),
    (
        "agent -> load balancer",
        _set_env("otel-agent", "GATEWAY_ENDPOINT", "otel-gateway-headless:4317"),
        "no LB",
    ),
    (
        "agent -> load balancer",
        _set_env("otel-agent", "GATEWAY_ENDPOINT", "otel-loadbalancer.other-ns.svc:4317"),
        "not a Service of namespace",
    ),
    ("load balancer -> gateways", _headless, "not headless"),
    (
        "load balancer -> gateways",
        _set_env("otel-loadbalancer", "GATEWAY_HEADLESS_SERVICE", "otel-gateway.vllm-journey.svc"),
        "no Service 'otel-gateway'",
    ),
    ("Service ports", _target_port, "targetPort 'spanmetric'"),
    ("env", _set_env("otel-gateway", "GATEWAY_MEMORY_MB", "1536"), "GATEWAY_MEMORY_MB is not read"),
    ("env", _set_env("vllm", "VLLM_JOURNEY_OTEL_TAILS", "none"), "neither the plugin's"),
    ("env", _set_env("vllm", "HF_TOKEN", "hf_abc"), "must come from a Secret"),
    ("env", _env_order, "before it is set"),
    ("memory", _memory, "memory_limiter 1536.0 MiB"),
    ("memory", _set_env("otel-agent", "AGENT_MEMORY_MIB", "700"), "memory_limiter 700.0 MiB"),
    ("placement", _root, "runAsNonRoot"),
    ("placement", _gpus, "1 GPUs for data-parallel size [2]"),
    ("placement", _namespace, "is not in vllm-journey"),
]


@pytest.mark.parametrize(
    ("check", "breakage", "expected"), BROKEN, ids=[f"{c}: {e}" for c, _, e in BROKEN]
)
def test_wiring_checks_catch_a_broken_copy(
    check: str, breakage: Callable[[list[dict[str, Any]]], None], expected: str
) -> None:
    res = fleet()
    breakage(res)
    problems = CHECKS[check](res)
    assert any(expected in p for p in problems), problems


# ---------------------------------------------------------------------------
# (e) schema names
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("path", [*MANIFESTS, KUSTOMIZATION, LOADBALANCER_FILE], ids=rel)
def test_manifests_use_schema_names(path: Path) -> None:
    assert schema_token_problems(path.read_text(), rel(path)) == []
