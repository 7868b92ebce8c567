"""The Grafana dashboard: its queries name the schema's keys, its layout, its generator,
and every attribute it relies on is emitted by real journeys."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest
from deploy_kit import (
    DASHBOARD_FILES,
    DASHBOARDS_DIR,
    DATASOURCE_UIDS,
    DATASOURCES,
    GATEWAY,
    GATEWAY_DIMS,
    GENERATOR,
    RESOURCE_KEYS,
    SELECTIONS,
    SERVICES,
    TEMPO_DIMS,
    all_panels,
    collector_refs,
    container_ports,
    dashboard_refs,
    load,
    prom_label,
    promql_refs,
    queries,
    rel,
    traceql_refs,
)
from traceql_grammar import TraceQLError, parse

from conftest import import_harness, requires_vllm
from vllm_journey_otel import schema as S


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
    phases = {S.SPAN_QUEUED, S.SPAN_PREFILL, S.SPAN_DECODE, S.SPAN_PREEMPTED}
    assert spans == phases | {S.SPAN_API, S.SPAN_API_INPUT, S.SPAN_API_OUTPUT}


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
    # opt-in step view) are covered in tests/engine/test_beyond_plain.py, vllm.in_flight
    # (a request in flight past the threshold) in tests/engine/test_in_flight.py, the
    # API server's (no HTTP server here) in tests/e2e/test_e2e_api_server.py, vllm.kv_held
    # (disaggregated serving) in tests/engine/test_disaggregation.py.
    api = {S.SPAN_API, S.SPAN_API_INPUT, S.SPAN_API_OUTPUT}
    plain = set(S.SPAN_NAMES) - {S.SPAN_WAIT, S.SPAN_STEP, S.SPAN_IN_FLIGHT, S.SPAN_KV_HELD, *api}
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
        # vllm.in_flight's attributes: tests/engine/test_in_flight.py asserts them;
        # the API server's: tests/e2e/test_e2e_api_server.py.
        if key in feature_only or (names and names <= {S.SPAN_IN_FLIGHT, *api}):
            continue
        if not names and key in S.attributes_of(S.SPAN_API):
            continue  # a collector policy on an API-server key: the e2e module emits it
        if key in RESOURCE_KEYS:
            ok = key in resource
        else:
            ok = any(key in emitted.get(n, set()) for n in (names or emitted))
        if not ok:
            missing.append((sorted(names or []), key))
    assert missing == []


# ---------------------------------------------------------------------------
# Units: what each latency query returns, against the panel's unit
# ---------------------------------------------------------------------------
# The gateway's spanmetrics histogram is in the unit its config names (ms, which
# also puts `_milliseconds` in the metric's name); Tempo's metrics generator
# observes span latency in seconds (its traces_spanmetrics_latency buckets), and
# TraceQL's quantile_over_time(duration) answers in seconds too.
UNIT_NAMES = {"ms": "ms", "s": "s", "us": "µs"}


def latency_unit(ds_type: str, text: str) -> tuple[str, bool] | None:
    """(the unit a latency query's values are in, whether the query scales them),
    or None for a query that is no latency quantile."""
    gateway_unit = UNIT_NAMES[GATEWAY["connectors"]["spanmetrics"]["histogram"]["unit"]]
    if ds_type == "prometheus":
        if "histogram_quantile(" not in text:
            return None
        base = "s" if TEMPO_LATENCY in text else gateway_unit if GATEWAY_LATENCY in text else None
        if base is None:
            return None
        if re.search(r"\)\s*/\s*1000\s*$", text):
            return {"ms": "s", "s": "ks"}[base], True
        if re.match(r"^\s*1000\s*\*", text):
            return {"s": "ms", "ms": "µs"}[base], True
        return base, False
    m = re.search(r"quantile_over_time\(\s*([\w.]+)", text)
    if m is None:
        return None
    field = m.group(1)
    if field == "duration":
        return "s", False
    suffix = field.rsplit("_", 1)[-1]
    return (UNIT_NAMES[suffix], False) if suffix in UNIT_NAMES else None


TEMPO_LATENCY = "traces_spanmetrics_latency_bucket"
GATEWAY_LATENCY = "traces_span_metrics_duration_milliseconds_bucket"


def unit_problems(dashboard: dict[str, Any]) -> list[str]:
    problems = []
    for panel in all_panels(dashboard):
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        for t in panel.get("targets", []):
            ds = (t.get("datasource") or panel["datasource"])["type"]
            got = latency_unit(ds, t.get("expr") or t.get("query") or "")
            if got is None:
                continue
            value_unit, scaled = got
            if value_unit != unit:
                problems.append(
                    f"{panel['title']} {t['refId']}: values in {value_unit}, panel {unit}"
                )
            if t.get("exemplar") and scaled:
                # Grafana draws exemplars at the raw observed value: a scale
                # factor in the query moves the line, not its exemplars.
                problems.append(f"{panel['title']} {t['refId']}: scaled query with exemplars")
    return problems


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=rel)
def test_latency_panels_units_match_their_queries_and_exemplars(path: Path) -> None:
    dashboard = load(path)
    assert unit_problems(dashboard) == []
    checked = [
        t
        for p in all_panels(dashboard)
        for t in p.get("targets", [])
        if latency_unit(
            (t.get("datasource") or p["datasource"])["type"], t.get("expr") or t.get("query") or ""
        )
    ]
    assert len(checked) >= 20, "the latency queries were not found"


def test_unit_check_catches_scaled_exemplars_and_wrong_units() -> None:
    q = f'histogram_quantile(0.99, sum by (le) (rate({TEMPO_LATENCY}{{span_name="x"}}[1m])))'
    ms = f'histogram_quantile(0.5, sum by (le) (rate({GATEWAY_LATENCY}{{span_name="x"}}[1m])))'

    def board(unit: str, *targets: dict[str, Any]) -> dict[str, Any]:
        panel = {"title": "p", "datasource": {"type": "prometheus"}, "targets": list(targets)}
        panel["fieldConfig"] = {"defaults": {"unit": unit}}
        return {"panels": [panel]}

    def prom(expr: str, exemplar: bool = False) -> dict[str, Any]:
        return {"refId": "A", "expr": expr, "exemplar": exemplar}

    assert unit_problems(board("s", prom(q, True), prom(ms + " / 1000"))) == []
    assert unit_problems(board("ms", prom("1000 * " + q, True)))  # exemplars 1000x off
    assert unit_problems(board("s", prom(ms)))  # ms plotted as s
    assert unit_problems(board("ms", prom(q)))


# ---------------------------------------------------------------------------
# TraceQL, rendered as Grafana sends it, through Tempo's grammar
# ---------------------------------------------------------------------------
def grafana_regex_format(values: list[str] | None) -> str:
    """Grafana's ``${var:regex}``: each value regex-escaped with one backslash,
    several in a group; "All" is the variable's allValue as is."""
    if values is None:
        return ".*"
    escaped = [re.sub(r"[\\^$*+?.()|\[\]{}/]", lambda m: "\\" + m.group(0), v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def render_traceql(query: str, selection: dict[str, list[str] | None]) -> str:
    for name, values in selection.items():
        query = query.replace(f"${{{name}:regex}}", grafana_regex_format(values))
    textboxes = {"slow": "10s", "min_preemptions": "1"}  # the textboxes' defaults
    for name, value in textboxes.items():
        query = query.replace(f"${name}", value)
    assert "$" not in query, f"a template variable is left in {query!r}"
    return query


def test_grafana_regex_format_escapes_as_grafana_does() -> None:
    assert grafana_regex_format(["Qwen/Qwen2.5"]) == "Qwen\\/Qwen2\\.5"
    assert grafana_regex_format(["a.b", "c"]) == "(a\\.b|c)"


@pytest.mark.parametrize("case", sorted(SELECTIONS))
@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=rel)
def test_every_traceql_query_parses_in_tempos_grammar(path: Path, case: str) -> None:
    tempo = [(t, q) for t, ds, q, _ in queries(load(path)) if ds == "tempo"]
    assert len(tempo) >= 20
    errors = []
    for title, query in tempo:
        try:
            parse(render_traceql(query, SELECTIONS[case]))
        except TraceQLError as exc:
            errors.append(f"{title}: {exc}")
    assert errors == []


def test_the_grammar_rejects_grafanas_escapes_in_a_double_quoted_string() -> None:
    one = SELECTIONS["one"]
    quoted = 'resource.vllm.model.name=~"${model:regex}"'
    with pytest.raises(TraceQLError):
        parse("{" + render_traceql(quoted, one) + "}")
    parse("{" + render_traceql(quoted.replace('"', "`"), one) + "}")
