"""Disaggregated prefill/decode: the KV hand-off per request, as the traces show
it, and what the plugin costs on both instances.

A prefill and a decode `vllm serve` of the tiny CPU model with the plugin's
defaults and the test proxy in front (tests/pd_serving.py: the KV moves through
tests/file_kv_connector.py, whole blocks via files, which stands in for NIXL).
REQUESTS completions of a ~790-token prompt (each its own, so no prefix cache
helps) and 8 output tokens go through the proxy, CONCURRENCY at a time,
alternating the decode side's load path: ``sync`` (loaded before the forward
pass) and ``async`` (in the worker's background while the request waits in
WAITING_FOR_REMOTE_KVS). Prints quantiles (ms) per path of:

* prefill side: ``vllm.journey.kv_held.ms`` (its blocks held for the decode
  side, the request's end to vLLM freeing them) and its engine end to end;
* decode side: the ``remote_kv`` wait, the load within it as the engine saw it
  (``vllm.journey.kv_transfer.ms``), its TTFT (``vllm.journey.ttft_ms``);
* the proxy's span (the client's whole request);

the CPU the plugin's exporter processes (each instance's engine core's and API
server's) used per request and per second of the run, beside what they use as
long with nothing to export (the control), and a waterfall of one async
request's trace. The servers run the product's defaults (OTLP batches of up to
500 ms).

    .venv/bin/python benchmarks/pd_handoff.py [REQUESTS] [CONCURRENCY]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serve_rounds import cpu_s, roles  # noqa: E402

from fixtures.tiny_model import build  # noqa: E402
from otlp_receiver import ReceivedSpan, Receiver  # noqa: E402
from pd_serving import PdServing  # noqa: E402
from services import http_json, wait_until  # noqa: E402
from vllm_journey_otel import schema as S  # noqa: E402

PROMPT = " ".join(f"word{i}" for i in range(150))
IDLE_S = 10.0


def quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    v = sorted(values)
    pick = lambda q: round(v[min(len(v) - 1, int(q * len(v)))], 2)  # noqa: E731
    return {"n": len(v), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": pick(1.0)}


def send(url: str, model: str, i: int) -> tuple[str, str]:
    """One request through the proxy; (its traceparent's trace id, its load path)."""
    load = "async" if i % 2 else "sync"
    trace_id = f"{i + 1:032x}"
    body = {"model": model, "prompt": f"request {i} {PROMPT}", "max_tokens": 8,
            "ignore_eos": True, "temperature": 0.0}  # fmt: skip
    headers = {"traceparent": f"00-{trace_id}-{i + 1:016x}-01", "x-pd-load": load}
    http_json(url + "/v1/completions", body, timeout=300, headers=headers)
    return trace_id, load


def figures(spans: list[ReceivedSpan], paths: dict[str, str]) -> dict[str, Any]:
    by_trace: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for s in spans:
        by_trace[s.span.trace_id.hex()].append(s)
    out: dict[str, dict[str, list[float]]] = {p: defaultdict(list) for p in ("sync", "async")}
    for trace_id, load in paths.items():
        f = out[load]
        trace = by_trace[trace_id]
        by_id = {s.span.span_id: s for s in trace}
        for s in trace:
            role = s.resource.get(S.RES_KV_ROLE)
            if s.name == S.SPAN_REQUEST and role == "prefill":
                f["prefill kv_held"].append(float(s.attrs[S.KV_HELD_MS]))
                f["prefill e2e"].append(
                    (s.span.end_time_unix_nano - s.span.start_time_unix_nano) / 1e6
                )
            elif s.name == S.SPAN_REQUEST and role == "decode":
                f["decode ttft"].append(float(s.attrs[S.TTFT_MS]))
            elif s.name == S.SPAN_WAIT and s.attrs.get(S.WAIT_REASON) == S.WAIT_REMOTE_KV:
                f["decode remote_kv wait"].append(
                    (s.span.end_time_unix_nano - s.span.start_time_unix_nano) / 1e6
                )
                if S.KV_TRANSFER_MS in s.attrs:
                    f["decode kv_transfer"].append(float(s.attrs[S.KV_TRANSFER_MS]))
            elif (
                s.resource.get("service.name") == "pd-proxy" and s.span.parent_span_id not in by_id
            ):
                f["proxy (whole request)"].append(
                    (s.span.end_time_unix_nano - s.span.start_time_unix_nano) / 1e6
                )
    return {p: {k: quantiles(v) for k, v in f.items()} for p, f in out.items()}


def waterfall(trace: list[ReceivedSpan], width: int = 48) -> list[str]:
    """One trace as text: a row per span in tree order, its bar on a shared scale."""
    by_id = {s.span.span_id: s for s in trace}
    kids: dict[bytes, list[ReceivedSpan]] = defaultdict(list)
    for s in trace:
        kids[s.span.parent_span_id if s.span.parent_span_id in by_id else b""].append(s)
    t0 = min(s.span.start_time_unix_nano for s in trace)
    t1 = max(s.span.end_time_unix_nano for s in trace)
    scale = width / max(1, t1 - t0)
    rows: list[str] = []

    def walk(parent: bytes, depth: int) -> None:
        for s in sorted(kids[parent], key=lambda x: x.span.start_time_unix_nano):
            a = int((s.span.start_time_unix_nano - t0) * scale)
            b = max(a + 1, int((s.span.end_time_unix_nano - t0) * scale))
            who = s.resource.get(S.RES_KV_ROLE) or s.resource.get("service.name", "")
            label = f"{'  ' * depth}{s.name}"[:34]
            ms = (s.span.end_time_unix_nano - s.span.start_time_unix_nano) / 1e6
            link = "  -> link" if s.span.links else ""
            rows.append(
                f"{who:>8} {label:<34} |{' ' * a}{'#' * (b - a):<{width - a}}| {ms:7.1f} ms{link}"
            )
            walk(s.span.span_id, depth + 1)

    walk(b"", 0)
    return rows


def main() -> None:
    requests = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    concurrency = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    model = build(ROOT / ".cache" / "tiny-llama")
    receiver = Receiver()
    receiver.start_grpc()
    tmp = Path(tempfile.mkdtemp(prefix="pd-handoff-"))
    # The product's default batching (tests/services.py shortens it for tests).
    env = {"OTEL_BSP_SCHEDULE_DELAY": "500"}
    pd = PdServing.start(model, tmp, receiver.grpc_port, lease_s=30.0, env=env)
    try:
        send(pd.proxy_url, pd.decode.model, 10_000)  # one of each path first, uncounted
        send(pd.proxy_url, pd.decode.model, 10_001)
        exporters = roles(pd.prefill.pid)["exporters"]  # every exporter on the machine
        # The control: what the exporters spend with nothing to export, as long.
        idle0 = sum(cpu_s(p) for p in exporters)
        time.sleep(IDLE_S)
        idle_cpu_per_s = (sum(cpu_s(p) for p in exporters) - idle0) / IDLE_S
        before = {p: cpu_s(p) for p in exporters}
        spans_before = len(receiver.spans())
        t0 = time.monotonic()
        with ThreadPoolExecutor(concurrency) as pool:
            paths = dict(
                pool.map(lambda i: send(pd.proxy_url, pd.decode.model, i), range(requests))
            )
        want = set(paths)

        def arrived() -> bool:
            done = {s.span.trace_id.hex() for s in receiver.spans() if S.KV_HELD_MS in s.attrs}
            return want <= done

        wait_until(arrived, 120, 0.5, "every prefill journey")
        wall = time.monotonic() - t0
        each = {p: round(cpu_s(p) - before[p], 3) for p in exporters}
        cpu = sum(each.values())
    finally:
        pd.stop()
        receiver.stop()
    spans = receiver.spans()
    result = {
        "requests": requests,
        "concurrency": concurrency,
        "exporter_processes": len(exporters),
        "wall_s": round(wall, 1),
        "exporter_cpu_ms_per_s": round(cpu / wall * 1e3, 1),
        "exporter_idle_cpu_ms_per_s": round(idle_cpu_per_s * 1e3, 1),
        "exporter_cpu_us_per_request": round(cpu / requests * 1e6),
        "exporter_cpu_us_per_request_above_idle": round(
            (cpu - idle_cpu_per_s * wall) / requests * 1e6
        ),
        "exporter_cpu_s_each": each,
        "spans_per_request": round((len(receiver.spans()) - spans_before) / requests, 1),
        "ms": figures(spans, paths),
    }
    print(json.dumps(result, indent=1))
    one = next(t for t, p in paths.items() if p == "async")
    print("\none async request's trace:")
    print("\n".join(waterfall([s for s in spans if s.span.trace_id.hex() == one])))


if __name__ == "__main__":
    main()
