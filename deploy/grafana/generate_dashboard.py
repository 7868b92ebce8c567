"""Writes dashboards/vllm-request-journey.json from the span schema.

    PYTHONPATH=src python deploy/grafana/generate_dashboard.py        # rewrite the JSON
    PYTHONPATH=src python deploy/grafana/generate_dashboard.py --check  # exit 1 if stale

Every span name and attribute key comes from ``vllm_journey_otel.schema``, and the
Prometheus label of an attribute is derived the way the span-metrics components
derive it (dots become underscores). tests/deploy/ checks the committed
JSON independently (it reads the keys back out of the JSON with regular
expressions) and that it equals this script's output, so edit the script, not the
JSON, then run it.

Data sources (uids from ../grafana/provisioning/datasources/datasources.yaml):
  prometheus  the gateway's span metrics, computed on every span before sampling
              (traces_span_metrics_*), Tempo's span metrics on the kept traces
              (traces_spanmetrics_*, with exemplars) and the collectors' telemetry
  tempo       TraceQL search and TraceQL metrics over the kept traces
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from vllm_journey_otel import schema as S

OUT = Path(__file__).parent / "dashboards" / "vllm-request-journey.json"

PROM = {"type": "prometheus", "uid": "prometheus"}
TEMPO = {"type": "tempo", "uid": "tempo"}

# Gateway spanmetrics connector (namespace traces.span.metrics, unit ms).
CALLS = "traces_span_metrics_calls_total"
DURATION_BUCKET = "traces_span_metrics_duration_milliseconds_bucket"
DURATION_SUM = "traces_span_metrics_duration_milliseconds_sum"
# Tempo's metrics generator (seconds), which carries the exemplars.
TEMPO_LATENCY_BUCKET = "traces_spanmetrics_latency_bucket"


def label(key: str) -> str:
    """Prometheus label of a span-metrics dimension: vllm.journey.x -> vllm_journey_x."""
    return key.replace(".", "_")


MODEL = label(S.RES_MODEL)
INSTANCE = label(S.RES_HOST)
DP_RANK = label(S.RES_DP_RANK)
FINISH = label(S.FINISH_STATUS)
KIND = label(S.SCHEDULE_KIND)
SAMPLED_BY = label(S.SAMPLED_BY)

# Template-variable filter for PromQL, and for TraceQL (model and instance only:
# the data-parallel rank is an int attribute, which TraceQL cannot regex-match).
# TraceQL's are backtick (raw) strings: Grafana's regex format escapes "." and "/"
# with a backslash, which Tempo's lexer (Go's strconv.Unquote) rejects inside
# double quotes; in a raw string the backslash reaches the regex as it should.
SEL = f'{MODEL}=~"$model", {INSTANCE}=~"$instance", {DP_RANK}=~"$dp_rank"'
TQL_SEL = (
    f"resource.{S.RES_MODEL}=~`${{model:regex}}` && resource.{S.RES_HOST}=~`${{instance:regex}}`"
)


def prom(expr: str, legend: str, ref: str = "A", exemplar: bool = False) -> dict[str, Any]:
    return {
        "refId": ref,
        "datasource": PROM,
        "expr": expr,
        "legendFormat": legend,
        "range": True,
        "exemplar": exemplar,
    }


def traceql_metrics(query: str, ref: str = "A") -> dict[str, Any]:
    return {
        "refId": ref,
        "datasource": TEMPO,
        "queryType": "traceql",
        "query": query,
        "metricsQueryType": "range",
        "limit": 20,
        "tableType": "traces",
    }


def traceql_search(query: str, ref: str = "A") -> dict[str, Any]:
    return {
        "refId": ref,
        "datasource": TEMPO,
        "queryType": "traceql",
        "query": query,
        "limit": 50,
        "spss": 3,
        "tableType": "traces",
    }


class Board:
    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.y = 0
        self.x = 0
        self.row_h = 0
        self.next_id = 1

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {
                "id": self._id(),
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_h
            self.x = 0
            self.row_h = 0

    def add(self, panel: dict[str, Any], w: int, h: int) -> None:
        if self.x + w > 24:
            self._newline()
        panel["id"] = self._id()
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def timeseries(
    title: str,
    description: str,
    targets: list[dict[str, Any]],
    unit: str,
    datasource: dict[str, str] = PROM,
    stack: bool = False,
) -> dict[str, Any]:
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": datasource,
        "targets": targets,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "custom": {
                    "drawStyle": "line",
                    "lineWidth": 1,
                    "fillOpacity": 20 if stack else 0,
                    "showPoints": "never",
                    "stacking": {"mode": "normal" if stack else "none", "group": "A"},
                },
            },
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(title: str, description: str, target: dict[str, Any], unit: str) -> dict[str, Any]:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": PROM,
        "targets": [target],
        "fieldConfig": {"defaults": {"unit": unit, "decimals": 2}, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        },
    }


def otelcol_rate(counter: str) -> str:
    """Rate of a collector counter, with or without the _total suffix (versions differ)."""
    return f'rate({{__name__=~"{counter}(_total)?"}}[$__rate_interval])'


def rate(metric: str, matchers: str) -> str:
    return f"rate({metric}{{{matchers}}}[$__rate_interval])"


def quantiles_panel(span: str, what: str) -> dict[str, Any]:
    """p50/p95/p99 of one phase from the gateway (all spans) + exemplars from Tempo."""
    m = f'span_name="{span}", {SEL}'
    # The panel is in seconds, the unit of Tempo's histogram: Grafana draws
    # exemplars at their raw value (no scaling in the query applies to them), so
    # the gateway's millisecond quantiles are the ones converted.
    targets = [
        prom(
            f"histogram_quantile({q}, sum by (le) ({rate(DURATION_BUCKET, m)})) / 1000",
            f"p{int(q * 100)}",
            ref,
        )
        for ref, q in (("A", 0.5), ("B", 0.95), ("C", 0.99))
    ]
    # Kept traces only: shown as a dotted line, there for its exemplars (each one
    # a trace that Tempo has; click it to open the journey).
    targets.append(
        prom(
            f"histogram_quantile(0.99, sum by (le) ({rate(TEMPO_LATENCY_BUCKET, m)}))",
            "p99 of kept traces (exemplars)",
            "D",
            exemplar=True,
        )
    )
    panel = timeseries(
        f"{what}: p50 / p95 / p99",
        f"Duration of `{span}` spans. p50/p95/p99 from the gateway's span metrics "
        "(every journey, before tail sampling). The dotted line is p99 of the traces "
        "the gateway kept (Tempo's metrics generator); its exemplars link to traces.",
        targets,
        "s",
    )
    panel["fieldConfig"]["overrides"].append(
        {
            "matcher": {"id": "byName", "options": "p99 of kept traces (exemplars)"},
            "properties": [
                {"id": "custom.lineStyle", "value": {"fill": "dot", "dash": [2, 4]}},
            ],
        }
    )
    return panel


def traceql_quantiles(span: str, what: str) -> dict[str, Any]:
    q = f'{{name="{span}" && {TQL_SEL}}} | quantile_over_time(duration, .5, .95, .99)'
    return timeseries(
        f"{what} (TraceQL metrics)",
        f"p50/p95/p99 of `{span}` computed by Tempo from the stored traces "
        "(TraceQL metrics over local blocks). These are the KEPT traces: biased "
        "towards slow, preempted and aborted journeys by the tail sampler.",
        [traceql_metrics(q)],
        "s",
        TEMPO,
    )


def build() -> dict[str, Any]:
    b = Board()
    req = f'span_name="{S.SPAN_REQUEST}", {SEL}'
    pre = f'span_name="{S.SPAN_PREEMPTED}", {SEL}'
    sched = f'span_name="{S.SPAN_SCHEDULED}", {SEL}'
    bad = f'{FINISH}=~"{S.FINISH_ABORTED}|{S.FINISH_ERROR}|{S.FINISH_IGNORED}"'
    resumed = f'{KIND}="{S.SCHEDULE_RESUME}"'

    # ------------------------------------------------------------------ overview
    b.row("Overview")
    b.add(
        stat(
            "Requests / s",
            f"Finished journeys per second (`{S.SPAN_REQUEST}` spans, all of them).",
            prom(f"sum({rate(CALLS, req)})", "requests/s"),
            "reqps",
        ),
        6,
        4,
    )
    b.add(
        stat(
            "Preemptions per request",
            f"`{S.SPAN_PREEMPTED}` spans per `{S.SPAN_REQUEST}`.",
            prom(
                f"(sum({rate(CALLS, pre)}) or vector(0)) / sum({rate(CALLS, req)})",
                "preemptions/request",
            ),
            "none",
        ),
        6,
        4,
    )
    b.add(
        stat(
            "Requests sitting preempted",
            "Seconds spent preempted per second: the average number of requests "
            "that are preempted at any moment (time lost to preemption).",
            prom(f"sum({rate(DURATION_SUM, pre)}) / 1000 or vector(0)", "preempted"),
            "none",
        ),
        6,
        4,
    )
    b.add(
        stat(
            "Not stopped or length",
            f"Share of requests whose `{S.FINISH_STATUS}` is "
            f"`{S.FINISH_ABORTED}`, `{S.FINISH_ERROR}` or `{S.FINISH_IGNORED}`.",
            prom(
                f"(sum({rate(CALLS, req + ', ' + bad)}) or vector(0)) / sum({rate(CALLS, req)})",
                "share",
            ),
            "percentunit",
        ),
        6,
        4,
    )

    # ------------------------------------------------------- phases (span metrics)
    b.row("Where the time goes (span metrics, every journey)")
    b.add(quantiles_panel(S.SPAN_QUEUED, "Queued"), 12, 8)
    b.add(quantiles_panel(S.SPAN_PREFILL, "Prefill"), 12, 8)
    b.add(quantiles_panel(S.SPAN_DECODE, "Decode"), 12, 8)
    b.add(quantiles_panel(S.SPAN_PREEMPTED, "Preempted"), 12, 8)

    # ------------------------------------------------------- the API server's part
    b.row("The API server's part (span metrics, every request)")
    b.add(quantiles_panel(S.SPAN_API, "Server end to end (receipt to last byte)"), 8, 8)
    b.add(quantiles_panel(S.SPAN_API_INPUT, "API input side (read, render, hand-off)"), 8, 8)
    b.add(quantiles_panel(S.SPAN_API_OUTPUT, "API output side (last output to last byte)"), 8, 8)
    api_cols = ", ".join(
        f"span.{k}"
        for k in (S.API_TTFT_MS, S.API_TTFB_MS, S.API_E2E_MS, S.URL_PATH, S.HTTP_STATUS,
                  S.API_STREAM, S.API_DISCONNECTED)
    )  # fmt: skip
    b.add(
        {
            "type": "table",
            "title": "Slowest first tokens at the server",
            "description": f"`{S.SPAN_API}` spans (kept traces, newest 50) with the server's "
            f"time to first token (`{S.API_TTFT_MS}`: receipt to the engine's first token "
            f"reaching the API server, any response), its time to first byte (`{S.API_TTFB_MS}`: "
            "a stream's first chunk, a whole response's body, which is its end to end) and "
            "end to end. Compare with the engine's `vllm.journey.ttft_ms` in the trace: "
            "the difference is the API server's input side and the output's way "
            "from the engine core to the API server.",
            "datasource": TEMPO,
            "targets": [
                traceql_search(f'{{name="{S.SPAN_API}" && {TQL_SEL}}} | select({api_cols})')
            ],
            "fieldConfig": {"defaults": {}, "overrides": []},
            "options": {
                "showHeader": True,
                "sortBy": [{"displayName": S.API_TTFT_MS, "desc": True}],
            },
        },
        24,
        8,
    )

    # ---------------------------------------------------- phases (TraceQL metrics)
    b.row("Where the time goes (TraceQL metrics, kept traces)")
    for span, what in (
        (S.SPAN_QUEUED, "Queued"),
        (S.SPAN_PREFILL, "Prefill"),
        (S.SPAN_DECODE, "Decode"),
        (S.SPAN_PREEMPTED, "Preempted"),
    ):
        b.add(traceql_quantiles(span, what), 6, 8)

    # ---------------------------------------------------------------- preemption
    b.row("Preemption")
    b.add(
        timeseries(
            "Preemption rate",
            f"`{S.SPAN_PREEMPTED}` spans per second (one per preemption), and "
            f"resumed running cycles (`{S.SPAN_SCHEDULED}` with "
            f"`{S.SCHEDULE_KIND}` = `{S.SCHEDULE_RESUME}`).",
            [
                prom(f"sum({rate(CALLS, pre)})", "preemptions/s"),
                prom(
                    f"sum({rate(CALLS, sched + ', ' + resumed)})",
                    "resumes/s",
                    "B",
                ),
            ],
            "ops",
        ),
        8,
        8,
    )
    b.add(
        timeseries(
            "Time lost to preemption",
            "Seconds per second spent preempted (waiting to be resumed), next to the "
            f"seconds per second of running cycles by `{S.SCHEDULE_KIND}`: "
            f"`{S.SCHEDULE_RESUME}` cycles start with the recompute of what the "
            "preemption threw away.",
            [
                prom(f"sum({rate(DURATION_SUM, pre)}) / 1000 or vector(0)", "preempted"),
                prom(
                    f"sum by ({KIND}) ({rate(DURATION_SUM, sched)}) / 1000",
                    f"running, {{{{{KIND}}}}}",
                    "B",
                ),
            ],
            "s",
            stack=False,
        ),
        8,
        8,
    )
    b.add(
        timeseries(
            "KV-cache usage at preemption",
            f"`{S.KV_CACHE_USAGE}` on `{S.SPAN_PREEMPTED}` (0..1, just before the "
            "victim's blocks were freed), from the kept traces.",
            [
                traceql_metrics(
                    f'{{name="{S.SPAN_PREEMPTED}" && {TQL_SEL}}} | '
                    f"quantile_over_time(span.{S.KV_CACHE_USAGE}, .5, .99)"
                )
            ],
            "percentunit",
            TEMPO,
        ),
        8,
        8,
    )

    # ------------------------------------------------------------------ outcomes
    b.row("Outcomes")
    b.add(
        {
            "type": "piechart",
            "title": "Finish status",
            "description": f"`{S.FINISH_STATUS}` of the journeys in the time range.",
            "datasource": PROM,
            "targets": [
                prom(
                    f"sum by ({FINISH}) (increase({CALLS}{{{req}}}[$__range]))",
                    f"{{{{{FINISH}}}}}",
                )
            ],
            "fieldConfig": {"defaults": {"unit": "short"}, "overrides": []},
            "options": {
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "pieType": "donut",
                "legend": {"displayMode": "table", "placement": "right", "values": ["value"]},
            },
        },
        8,
        8,
    )
    b.add(
        timeseries(
            "Finish status over time",
            f"Requests per second by `{S.FINISH_STATUS}`.",
            [prom(f"sum by ({FINISH}) ({rate(CALLS, req)})", f"{{{{{FINISH}}}}}")],
            "reqps",
            stack=True,
        ),
        8,
        8,
    )
    b.add(
        timeseries(
            "Time to first token (TraceQL metrics)",
            f"p50/p95/p99 of `{S.TTFT_MS}` on `{S.SPAN_REQUEST}` (arrival to first "
            "token), kept traces.",
            [
                traceql_metrics(
                    f'{{name="{S.SPAN_REQUEST}" && {TQL_SEL}}} | '
                    f"quantile_over_time(span.{S.TTFT_MS}, .5, .95, .99)"
                )
            ],
            "ms",
            TEMPO,
        ),
        8,
        8,
    )

    # ------------------------------------------------------- tokens and the cache
    b.row("Tokens and the prefix cache")
    b.add(
        timeseries(
            "Prefix-cache hit tokens",
            f"Prompt tokens served from the prefix cache at first schedule "
            f"(`{S.GEN_AI_CACHE_READ_TOKENS}`) next to all prompt tokens "
            f"(`{S.GEN_AI_INPUT_TOKENS}`), summed over the kept traces.",
            [
                traceql_metrics(
                    f'{{name="{S.SPAN_REQUEST}" && {TQL_SEL}}} | '
                    f"sum_over_time(span.{S.GEN_AI_CACHE_READ_TOKENS})",
                    "A",
                ),
                traceql_metrics(
                    f'{{name="{S.SPAN_REQUEST}" && {TQL_SEL}}} | '
                    f"sum_over_time(span.{S.GEN_AI_INPUT_TOKENS})",
                    "B",
                ),
            ],
            "short",
            TEMPO,
        ),
        12,
        8,
    )
    b.add(
        timeseries(
            "Cached tokens per prefill",
            f"p50/p95 of `{S.CACHED_TOKENS}` on `{S.SPAN_PREFILL}`: tokens already "
            "computed when a running cycle started (the prefix-cache hit of that cycle).",
            [
                traceql_metrics(
                    f'{{name="{S.SPAN_PREFILL}" && {TQL_SEL}}} | '
                    f"quantile_over_time(span.{S.CACHED_TOKENS}, .5, .95)"
                )
            ],
            "short",
            TEMPO,
        ),
        12,
        8,
    )
    buckets = ((0, 512), (512, 2048), (2048, 8192), (8192, None))
    targets = []
    for i, (lo, hi) in enumerate(buckets):
        cond = f"span.{S.GEN_AI_INPUT_TOKENS} >= {lo}"
        if hi is not None:
            cond += f" && span.{S.GEN_AI_INPUT_TOKENS} < {hi}"
        t = traceql_metrics(
            f'{{name="{S.SPAN_REQUEST}" && {cond} && {TQL_SEL}}} | '
            f"quantile_over_time(span.{S.QUEUED_MS}, .95)",
            "ABCD"[i],
        )
        targets.append(t)
    b.add(
        timeseries(
            "Prompt length vs queue time",
            f"p95 of `{S.QUEUED_MS}` by prompt length (`{S.GEN_AI_INPUT_TOKENS}`): "
            "A < 512, B 512-2047, C 2048-8191, D >= 8192 tokens; kept traces. The "
            "table below lists both per request.",
            targets,
            "ms",
            TEMPO,
        ),
        24,
        8,
    )

    # ------------------------------------------------------ slowest / preempted
    select = (
        f"select(span.{S.REQUEST_ID}, span.{S.FINISH_STATUS}, span.{S.NUM_PREEMPTIONS}, "
        f"span.{S.QUEUED_MS}, span.{S.TTFT_MS}, span.{S.GEN_AI_INPUT_TOKENS}, "
        f"span.{S.GEN_AI_CACHE_READ_TOKENS}, span.{S.GEN_AI_OUTPUT_TOKENS})"
    )
    b.row("Requests to look at")
    b.add(
        {
            "type": "table",
            "title": "Slowest requests",
            "description": f"`{S.SPAN_REQUEST}` spans longer than $slow (TraceQL "
            "search over the kept traces; newest 50 matches, sorted by duration). "
            "Click a trace id to open the journey.",
            "datasource": TEMPO,
            "targets": [
                traceql_search(
                    f'{{name="{S.SPAN_REQUEST}" && duration > $slow && {TQL_SEL}}} | {select}'
                )
            ],
            "fieldConfig": {"defaults": {}, "overrides": []},
            "options": {"showHeader": True, "sortBy": [{"displayName": "Duration", "desc": True}]},
        },
        12,
        10,
    )
    b.add(
        {
            "type": "table",
            "title": "Most preempted requests",
            "description": f"`{S.SPAN_REQUEST}` spans with `{S.NUM_PREEMPTIONS}` >= "
            "$min_preemptions (newest 50 matches). Click a trace id to open the journey.",
            "datasource": TEMPO,
            "targets": [
                traceql_search(
                    f'{{name="{S.SPAN_REQUEST}" && span.{S.NUM_PREEMPTIONS} >= $min_preemptions'
                    f" && {TQL_SEL}}} | {select}"
                )
            ],
            "fieldConfig": {"defaults": {}, "overrides": []},
            "options": {
                "showHeader": True,
                "sortBy": [{"displayName": S.NUM_PREEMPTIONS, "desc": True}],
            },
        },
        12,
        10,
    )

    in_flight = ", ".join(
        f"span.{k}"
        for k in (S.REQUEST_ID, S.IN_FLIGHT_STATE, S.WAIT_REASON, S.IN_FLIGHT_MS,
                  S.IN_FLIGHT_SNAPSHOT, S.DECODE_DONE_TOKENS)
    )  # fmt: skip
    b.add(
        {
            "type": "table",
            "title": "Requests seen in flight past the threshold",
            "description": f"`{S.SPAN_IN_FLIGHT}` snapshots: requests still in flight "
            "VLLM_JOURNEY_OTEL_IN_FLIGHT_S (default 60 s) after admission, where they "
            "were then and what they waited for (newest 50). A stuck request shows here "
            "while it is stuck; its trace gets the final journey when it ends.",
            "datasource": TEMPO,
            "targets": [
                traceql_search(f'{{name="{S.SPAN_IN_FLIGHT}" && {TQL_SEL}}} | select({in_flight})')
            ],
            "fieldConfig": {"defaults": {}, "overrides": []},
            "options": {
                "showHeader": True,
                "sortBy": [{"displayName": S.IN_FLIGHT_MS, "desc": True}],
            },
        },
        24,
        8,
    )

    # ------------------------------------------- waits and speculative decoding
    b.row("Waiting inside the queue, and speculative decoding")
    wait = f'span_name="{S.SPAN_WAIT}", {SEL}'
    reason = label(S.WAIT_REASON)
    b.add(
        timeseries(
            "Time waiting, by reason: p95",
            f"p95 duration of `{S.SPAN_WAIT}` spans by `{S.WAIT_REASON}` "
            f"({', '.join(S.WAIT_REASONS)}): the part of the queue that was not "
            "waiting for a free slot but for a grammar, remote KV blocks, the next "
            "input chunk or a LoRA slot.",
            [
                prom(
                    f"histogram_quantile(0.95, sum by (le, {reason}) "
                    f"({rate(DURATION_BUCKET, wait)}))",
                    f"{{{{{reason}}}}}",
                )
            ],
            "ms",
        ),
        8,
        8,
    )
    b.add(
        timeseries(
            "Requests waiting, by reason",
            f"Seconds spent in `{S.SPAN_WAIT}` per second, by `{S.WAIT_REASON}`: the "
            "average number of requests waiting for that reason at any moment.",
            [
                prom(
                    f"sum by ({reason}) ({rate(DURATION_SUM, wait)}) / 1000",
                    f"{{{{{reason}}}}}",
                )
            ],
            "none",
            stack=True,
        ),
        8,
        8,
    )
    b.add(
        timeseries(
            "Draft acceptance rate per request",
            f"p10/p50/p90 of `{S.SPEC_ACCEPTANCE_RATE}` on `{S.SPAN_REQUEST}` "
            f"(accepted / proposed draft tokens over the request; requests with "
            f"`{S.SPEC_DRAFTS_PROPOSED}` > 0, kept traces). Empty without speculative "
            "decoding.",
            [
                traceql_metrics(
                    f'{{name="{S.SPAN_REQUEST}" && span.{S.SPEC_DRAFTS_PROPOSED} > 0'
                    f" && {TQL_SEL}}} | "
                    f"quantile_over_time(span.{S.SPEC_ACCEPTANCE_RATE}, .1, .5, .9)"
                )
            ],
            "percentunit",
            TEMPO,
        ),
        8,
        8,
    )

    kv = f'name="{S.SPAN_WAIT}" && span.{S.WAIT_REASON}="{S.WAIT_REMOTE_KV}" && {TQL_SEL}'
    b.add(
        timeseries(
            "Remote KV transfer per request: p50 / p95 / p99",
            f"`{S.KV_TRANSFER_MS}` on `{S.SPAN_WAIT}` spans of reason "
            f"`{S.WAIT_REMOTE_KV}` (disaggregated prefill, offloading): from the "
            "schedule() that started a request's asynchronous KV load to the step its "
            "connector reported it done (kept traces). Empty without a KV connector.",
            [
                traceql_metrics(
                    f"{{{kv} && span.{S.KV_TRANSFER_MS} >= 0}} | "
                    f"quantile_over_time(span.{S.KV_TRANSFER_MS}, .5, .95, .99)"
                )
            ],
            "ms",
            TEMPO,
        ),
        12,
        8,
    )
    b.add(
        timeseries(
            "Remote KV loads: done and failed per second",
            f"`{S.SPAN_WAIT}` spans of reason `{S.WAIT_REMOTE_KV}` by "
            f"`{S.KV_TRANSFER_FAILED}` (kept traces): a failed load is recomputed, or "
            'ends the request with an error under kv_load_failure_policy="fail".',
            [
                traceql_metrics(f"{{{kv} && span.{S.KV_TRANSFER_FAILED} = false}} | rate()", "A"),
                traceql_metrics(f"{{{kv} && span.{S.KV_TRANSFER_FAILED} = true}} | rate()", "B"),
            ],
            "reqps",
            TEMPO,
        ),
        12,
        8,
    )

    # ------------------------------------------------------------ tracer health
    b.row("Tracer health")
    b.add(
        timeseries(
            "How journeys were kept",
            f"Exported journeys by `{S.SAMPLED_BY}`: `{S.SAMPLED_HEAD}` (sampled at "
            f"admission) or `{S.SAMPLED_TAIL}` (head sampling dropped it, the "
            "plugin's tail rule kept it). Journeys dropped by head sampling and not "
            "kept are never exported, so they do not appear here.",
            [prom(f"sum by ({SAMPLED_BY}) ({rate(CALLS, req)})", f"{{{{{SAMPLED_BY}}}}}")],
            "reqps",
            stack=True,
        ),
        8,
        8,
    )
    b.add(
        timeseries(
            "Clock uncertainty",
            f"p50/p99 of `{S.CLOCK_UNCERTAINTY_US}` on `{S.SPAN_REQUEST}`: half-width "
            "of the wall/monotonic reading used to place the journey's spans (kept traces).",
            [
                traceql_metrics(
                    f'{{name="{S.SPAN_REQUEST}" && {TQL_SEL}}} | '
                    f"quantile_over_time(span.{S.CLOCK_UNCERTAINTY_US}, .5, .99)"
                )
            ],
            "µs",
            TEMPO,
        ),
        8,
        8,
    )
    b.add(
        timeseries(
            "Spans lost or kept in the collectors",
            "Spans refused by the collectors' receivers (memory limiter) or failed "
            "by their exporters, and the gateway's tail-sampling decisions per "
            "policy. Losses inside vLLM are in the panel 'Lost before export'.",
            [
                prom(
                    # By instance: the agent and the gateway are scraped under one job.
                    f"sum by (instance) ({otelcol_rate('otelcol_receiver_refused_spans')})",
                    "refused, {{instance}}",
                ),
                prom(
                    "sum by (instance, exporter) "
                    f"({otelcol_rate('otelcol_exporter_send_failed_spans')})",
                    "export failed, {{instance}} {{exporter}}",
                    "B",
                ),
                prom(
                    "sum by (policy, sampled) "
                    f"({otelcol_rate('otelcol_processor_tail_sampling_count_traces_sampled')})",
                    "tail sampling {{policy}} sampled={{sampled}}",
                    "C",
                ),
            ],
            "ops",
        ),
        8,
        8,
    )

    b.add(
        timeseries(
            "Lost before export (inside vLLM)",
            f"Running totals carried on every `{S.SPAN_REQUEST}` root, per instance: "
            f"`{S.TRACER_DROPPED_JOURNEYS}`, journeys the engine core dropped (its "
            f"hand-off queue full, or the exporter process gone), and "
            f"`{S.TRACER_LOST_SPANS}`, spans the plugin's exporter could not deliver "
            "(export failed, or its queue full). A step up means loss since the "
            "previous journey; both restart from 0 with vLLM.",
            [
                traceql_metrics(
                    f'{{name="{S.SPAN_REQUEST}" && {TQL_SEL}}} | '
                    f"max_over_time(span.{S.TRACER_DROPPED_JOURNEYS}) by (resource.host.name)"
                ),
                traceql_metrics(
                    f'{{name="{S.SPAN_REQUEST}" && {TQL_SEL}}} | '
                    f"max_over_time(span.{S.TRACER_LOST_SPANS}) by (resource.host.name)",
                    "B",
                ),
            ],
            "short",
            TEMPO,
        ),
        24,
        8,
    )

    def query_var(name: str, lab: str, label_text: str) -> dict[str, Any]:
        return {
            "name": name,
            "label": label_text,
            "type": "query",
            "datasource": PROM,
            "query": {
                "qryType": 1,
                "query": f'label_values({CALLS}{{span_name="{S.SPAN_REQUEST}"}}, {lab})',
                "refId": "PrometheusVariableQueryEditor-VariableQuery",
            },
            "definition": f'label_values({CALLS}{{span_name="{S.SPAN_REQUEST}"}}, {lab})',
            "refresh": 2,
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
            "current": {"text": "All", "value": "$__all"},
            "sort": 1,
        }

    return {
        "uid": "vllm-request-journey",
        "title": "vLLM request journey",
        "description": "Every vLLM request's journey through the scheduler (queued, "
        "scheduled, prefill, decode, preempted) from vllm-journey-otel traces.",
        "tags": ["vllm", "llm", "traces", "opentelemetry"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "links": [
            {
                "title": "Jaeger",
                "type": "link",
                "url": "http://localhost:16686/search?service=vllm",
                "targetBlank": True,
                "icon": "external link",
            }
        ],
        "templating": {
            "list": [
                query_var("model", MODEL, "Model"),
                query_var("instance", INSTANCE, "Instance (host)"),
                query_var("dp_rank", DP_RANK, "Data-parallel rank"),
                {
                    "name": "slow",
                    "label": "Slow if longer than",
                    "type": "textbox",
                    "query": "10s",
                    "current": {"text": "10s", "value": "10s"},
                },
                {
                    "name": "min_preemptions",
                    "label": "Min preemptions",
                    "type": "textbox",
                    "query": "1",
                    "current": {"text": "1", "value": "1"},
                },
            ]
        },
        "annotations": {"list": []},
        "panels": b.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            print(f"{OUT} is stale: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
