"""The Prometheus config and the dashboard's PromQL, against a real Prometheus.

``promtool check config`` runs on the shipped config. A real Prometheus
(Debian's ``prometheus`` package, 2.42 here; ``scripts/setup_backends.sh``
installs it) starts on loopback over a TSDB backfilled by ``promtool tsdb
create-blocks-from openmetrics`` with series shaped as the gateway's spanmetrics
connector, Tempo's metrics generator and the collectors' telemetry name them
(labels from the shipped configs and the schema). Every PromQL expression of the
dashboard goes through its query API with the template variables rendered the
way Grafana's Prometheus data source renders them (values with ``.`` ``/`` and
``-``), so a parse error fails here, and the overview's figures are evaluated by
Prometheus itself: 0 where nothing happened, one series per collector where
they are told apart, latencies in the panel's unit.

What stands in for a component that cannot run here: Grafana's interpolation of
template variables (``render_prom``, after ``interpolateQueryExpr`` and
``prometheusSpecialRegexEscape`` of grafana-prometheus' datasource.ts).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from deploy_kit import (
    DASHBOARD_FILES,
    GATEWAY,
    PROMETHEUS_FILE,
    SELECTIONS,
    all_panels,
    load,
    prom_label,
    queries,
    rel,
)

from services import free_port, wait_until
from vllm_journey_otel import schema as S

SPAN_LABELS = {
    prom_label(S.RES_MODEL): "Qwen/Qwen2.5-0.5B-Instruct",
    prom_label(S.RES_HOST): "vllm-0.node-a.svc",
    prom_label(S.RES_DP_RANK): "0",
}
STEP_S = 15
SPAN_MS = 80.0  # every backfilled span lasts this long


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is missing: scripts/setup_backends.sh installs Debian's prometheus"
    return found


def test_promtool_check_config() -> None:
    run = subprocess.run(
        [promtool(), "check", "config", str(PROMETHEUS_FILE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_promtool_rejects_a_broken_config(tmp_path: Path) -> None:
    broken = tmp_path / "prometheus.yml"
    broken.write_text(PROMETHEUS_FILE.read_text().replace("scrape_interval", "scrape_intervall"))
    run = subprocess.run(
        [promtool(), "check", "config", str(broken)], capture_output=True, text=True, check=False
    )
    assert run.returncode != 0


# ---------------------------------------------------------------------------
# Grafana's rendering of the template variables (it cannot run here)
# ---------------------------------------------------------------------------
def grafana_prom_regex_escape(value: str) -> str:
    """prometheusSpecialRegexEscape: regex metacharacters get a doubled backslash,
    so the PromQL string literal unquotes to a regex that matches them literally."""
    value = value.replace("\\", "\\\\\\\\")
    return re.sub(r"[$^*{}\[\]'+?.()|]", lambda m: "\\\\" + m.group(0), value)


def render_prom(expr: str, selection: dict[str, list[str] | None]) -> str:
    """A dashboard expression as Grafana sends it (multi-value variables with
    "All": allValue ``.*`` as is, one value escaped, several joined in a group)."""
    for name, values in selection.items():
        if values is None:
            text = ".*"
        else:
            escaped = [grafana_prom_regex_escape(v) for v in values]
            text = escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"
        expr = expr.replace(f"${name}", text)
    return expr.replace("$__rate_interval", "1m").replace("$__range", "30m")


def test_rendering_escapes_as_grafana_does() -> None:
    assert grafana_prom_regex_escape("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2\\\\.5-0\\\\.5B"
    out = render_prom('x{a=~"$model"}', {"model": ["a.b", "c"]})
    assert out == 'x{a=~"(a\\\\.b|c)"}'


# ---------------------------------------------------------------------------
# A real Prometheus over backfilled series
# ---------------------------------------------------------------------------
def scrape_targets(job: str) -> list[str]:
    for cfg in load(PROMETHEUS_FILE)["scrape_configs"]:
        if cfg["job_name"] == job:
            return [t for sc in cfg["static_configs"] for t in sc["targets"]]
    raise AssertionError(f"no scrape job {job!r} in {rel(PROMETHEUS_FILE)}")


def labels(**kv: str) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in kv.items()) + "}"


def openmetrics(start_s: int, points: int) -> str:
    """Series as the components name them: only vllm.request and vllm.queued spans
    (no preemption, every request finished by length), refused spans at every
    collector, and the latency histograms of the gateway (ms) and Tempo (s)."""
    times = [start_s + i * STEP_S for i in range(points)]
    (gateway,) = scrape_targets("spanmetrics")
    collectors = scrape_targets("otel-collector")
    base = {"service_name": "vllm", **SPAN_LABELS, "job": "spanmetrics", "instance": gateway}
    req = {**base, "span_name": S.SPAN_REQUEST, prom_label(S.FINISH_STATUS): S.FINISH_LENGTH}
    queued = {**base, "span_name": S.SPAN_QUEUED}
    per_step = 10  # spans per scrape interval
    out = ["# TYPE traces_span_metrics_calls counter"]
    for series in (req, queued):
        out += [f"traces_span_metrics_calls_total{labels(**series)} {i * per_step} {t}"
                for i, t in enumerate(times)]  # fmt: skip
    ms = GATEWAY["connectors"]["spanmetrics"]["histogram"]
    assert ms["unit"] == "ms"
    out.append("# TYPE traces_span_metrics_duration_milliseconds histogram")
    out += histogram("traces_span_metrics_duration_milliseconds", queued, times, per_step,
                     [10, 100, 1000], SPAN_MS)  # fmt: skip
    tempo = {**SPAN_LABELS, "service": "vllm", "span_name": S.SPAN_QUEUED, "job": "tempo"}
    out.append("# TYPE traces_spanmetrics_latency histogram")
    out += histogram("traces_spanmetrics_latency", tempo, times, per_step,
                     [0.01, 0.1, 1.0], SPAN_MS / 1000)  # fmt: skip
    out.append("# TYPE otelcol_receiver_refused_spans counter")
    for target in collectors:
        series = {"job": "otel-collector", "instance": target, "receiver": "otlp"}
        out += [f"otelcol_receiver_refused_spans_total{labels(**series)} {i} {t}"
                for i, t in enumerate(times)]  # fmt: skip
    return "\n".join([*out, "# EOF", ""])


def histogram(
    name: str, series: dict[str, str], times: list[int], per_step: int, bounds: list[float],
    value: float,
) -> list[str]:  # fmt: skip
    lines = []
    for le in [*bounds, float("inf")]:
        le_text = "+Inf" if le == float("inf") else repr(float(le))
        for i, t in enumerate(times):
            n = i * per_step if value <= le else 0
            lines.append(f"{name}_bucket{labels(**series, le=le_text)} {n} {t}")
    lines += [
        f"{name}_sum{labels(**series)} {i * per_step * value} {t}" for i, t in enumerate(times)
    ]
    lines += [f"{name}_count{labels(**series)} {i * per_step} {t}" for i, t in enumerate(times)]
    return lines


class Prometheus:
    def __init__(self, url: str, at_s: float) -> None:
        self.url, self.at_s = url, at_s

    def query(self, expr: str) -> dict[str, Any]:
        """The API's answer (``status`` ``success`` or ``error``, never raises on 4xx)."""
        data = urllib.parse.urlencode({"query": expr, "time": self.at_s}).encode()
        request = urllib.request.Request(f"{self.url}/api/v1/query", data=data)
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return json.load(r)  # type: ignore[no-any-return]
        except urllib.error.HTTPError as exc:  # 400/422: bad_data, the parse error
            return json.load(exc)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    server = shutil.which("prometheus")
    assert server, "prometheus is missing: scripts/setup_backends.sh installs Debian's prometheus"
    tmp = tmp_path_factory.mktemp("prometheus")
    now = int(time.time())
    start = now - 3 * 3600  # blocks for the past, well inside the retention
    points = 240  # one hour of 15 s scrapes
    (tmp / "data.om").write_text(openmetrics(start, points))
    tsdb = tmp / "tsdb"
    subprocess.run(
        [promtool(), "tsdb", "create-blocks-from", "openmetrics", str(tmp / "data.om"), str(tsdb)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (tmp / "prometheus.yml").write_text("global:\n  scrape_interval: 15s\n")
    port = free_port()
    log = (tmp / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [server, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tsdb}",
         f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1d"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-2000:]
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_until(ready, 60, 0.2, "Prometheus to be ready")
        yield Prometheus(url, start + (points - 20) * STEP_S)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def prom_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expr) of every PromQL of a dashboard; a variable's label_values()
    is Grafana's, not PromQL: its series selector is what Prometheus sees."""
    found = []
    for title, ds_type, text, _ in queries(dashboard):
        if ds_type != "prometheus":
            continue
        m = re.fullmatch(r"label_values\((.*),\s*\w+\)", text)
        found.append((title, m.group(1) if m else text))
    return found


@pytest.mark.parametrize("case", sorted(SELECTIONS))
@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=rel)
def test_every_dashboard_promql_parses_in_prometheus(
    prometheus: Prometheus, path: Path, case: str
) -> None:
    exprs = prom_queries(load(path))
    assert len(exprs) > 20
    errors = []
    for where, expr in exprs:
        answer = prometheus.query(render_prom(expr, SELECTIONS[case]))
        if answer["status"] != "success":
            errors.append(f"{where}: {answer.get('error')}")
    assert errors == []


def test_prometheus_rejects_what_grafanas_regex_format_would_send(prometheus: Prometheus) -> None:
    # The check above can fail: a single backslash before "." is no PromQL escape.
    answer = prometheus.query('traces_span_metrics_calls_total{vllm_model_name=~"Qwen2\\.5"}')
    assert answer["status"] == "error" and answer["errorType"] == "bad_data"


def panel_exprs(title: str) -> list[str]:
    (dashboard,) = [load(p) for p in DASHBOARD_FILES if p.name == "vllm-request-journey.json"]
    (panel,) = [p for p in all_panels(dashboard) if p["title"] == title]
    return [render_prom(t["expr"], SELECTIONS["all"]) for t in panel["targets"]]


def values(answer: dict[str, Any]) -> list[tuple[dict[str, str], float]]:
    assert answer["status"] == "success", answer
    return [(r["metric"], float(r["value"][1])) for r in answer["data"]["result"]]


@pytest.mark.parametrize(
    "title", ["Preemptions per request", "Requests sitting preempted", "Not stopped or length"]
)
def test_ratio_stats_show_zero_before_anything_happened(prometheus: Prometheus, title: str) -> None:
    """No preemption and no bad finish yet: the stat is 0, not "No data"."""
    (expr,) = panel_exprs(title)
    assert values(prometheus.query(expr)) == [({}, 0.0)]


def test_collector_losses_are_told_apart_per_collector(prometheus: Prometheus) -> None:
    refused = panel_exprs("Spans lost or kept in the collectors")[0]
    got = values(prometheus.query(refused))
    # One job scrapes both collectors: each must be its own series.
    assert sorted(m.get("instance", "") for m, _ in got) == sorted(scrape_targets("otel-collector"))


def test_latency_quantiles_are_in_the_panels_unit(prometheus: Prometheus) -> None:
    """The gateway's (ms) and Tempo's (s) p99 of the same spans agree in the panel."""
    exprs = panel_exprs("Queued: p50 / p95 / p99")
    (gateway_p99,) = values(prometheus.query(exprs[2]))
    (tempo_p99,) = values(prometheus.query(exprs[3]))
    # Both histograms put every span in the bucket (10, 100] ms = (0.01, 0.1] s.
    assert 0.01 < gateway_p99[1] <= 0.1 and 0.01 < tempo_p99[1] <= 0.1
