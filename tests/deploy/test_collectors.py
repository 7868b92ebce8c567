"""The collector configs (agent, gateway, Jaeger v2) and Tempo's: pipelines wired, tail
sampling policies, span metrics, and every schema name they use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from deploy_kit import (
    AGENT_FILE,
    GATEWAY,
    GATEWAY_DIMS,
    GATEWAY_FILE,
    JAEGER_FILE,
    KIT_FILES,
    LOADBALANCER_FILE,
    PROMETHEUS_FILE,
    SERVICES,
    TEMPO,
    collector_refs,
    load,
    pipeline_problems,
    policies,
    policies_keeping,
    rel,
    schema_token_problems,
)

from conftest import import_harness, journeys_from_vllm
from vllm_journey_otel import schema as S
from vllm_journey_otel.engine import handoff


@pytest.mark.parametrize(
    "path", [AGENT_FILE, GATEWAY_FILE, LOADBALANCER_FILE, JAEGER_FILE], ids=rel
)
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
    ottl = {p["name"]: p["ottl_condition"]["span"] for p in by_type["ottl_condition"]}
    assert ottl == {
        "preempted": [f'name == "{S.SPAN_PREEMPTED}"'],
        "in-flight": [f'name == "{S.SPAN_IN_FLIGHT}"'],
    }
    # The final journey of a trace kept for its snapshot arrives later: the
    # decision cache keeps it.
    cache = GATEWAY["processors"]["tail_sampling"]["decision_cache"]
    assert cache["sampled_cache_size"] >= GATEWAY["processors"]["tail_sampling"]["num_traces"]
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


def test_collector_and_tempo_configs_use_schema_names() -> None:
    *_, problems = collector_refs()
    assert problems == []


@pytest.mark.parametrize(
    "path",
    KIT_FILES,
    ids=rel,
)
def test_every_schema_looking_token_in_deploy_is_in_the_schema(path: Path) -> None:
    assert schema_token_problems(path.read_text(), rel(path)) == []


def test_token_check_catches_a_misspelt_key() -> None:
    assert schema_token_problems('key: "vllm.journey.finish_status"', "x") == []
    assert schema_token_problems("key: vllm.journey.finsh_status", "x")
    assert schema_token_problems('{name="vllm.prefil"}', "x")


@journeys_from_vllm
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
        assert handoff.flush(10)
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
