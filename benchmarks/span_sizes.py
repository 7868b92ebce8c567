"""What a collector receives per journey: spans, OTLP bytes, gzipped bytes.

Journeys are recorded from vLLM's real Scheduler (tests/harness.py: fabricated
model outputs, one sampled token per step) with the plugin's hooks installed,
built into spans by the plugin's own export path (the span plan and span
builder, as in the exporter process) into an in-memory exporter, then encoded
with the SDK's OTLP protobuf encoder (``encode_spans``, what the OTLP exporters
send) in batches of the export stage's size (2,048 spans). Workload mixes:

* ``short``: prompts of 64..512 tokens, 16..256 output tokens, KV cache ample;
* ``long-chunked``: prompts of 1,500..3,500 tokens, chunked prefill at 512
  tokens a step (``--max-num-batched-tokens 512``);
* ``preempting``: as ``short``, KV cache at ~45 % of peak need (preemptions);
* ``short+steps``: as ``short`` with the step view on (``VLLM_JOURNEY_OTEL_STEPS=1``,
  every step): ``vllm.step`` spans are their own traces, counted apart.

Every request comes, as with the product's defaults, from the API server: its
trace headers name a ``vllm.api.request`` span, the engine's journey is its
child, and the API server's own three spans (``vllm.api.request``,
``vllm.api.input``, ``vllm.api.output``: built from a record of the request's
API-side times, half streams, by the same code as the API server's exporter,
with the API server's resource) are counted with the journey; ``--engine-only``
leaves them out (``VLLM_JOURNEY_OTEL_API_SPANS=0``).

Per mix: journeys, spans per journey (mean, p50, p99), OTLP bytes per span and
per journey (mean, p99: a span's own message plus its share of the batch's
resource/scope envelope), and bytes per journey after gzip of each export batch
(level 6, as gRPC's gzip; OTLP/HTTP uses level 9, also shown), for 2,048-span
batches and for 128-span ones (a load-balancing exporter splits an agent's
batch over the gateways). Then, per 1,000 journeys/s, the spans/s and MB/s a
gateway tier receives. Request ids are shaped like vLLM's OpenAI server's
(``cmpl-<32 hex>-0-<8 hex>``); trace ids are random, as in production.

    .venv/bin/python benchmarks/span_sizes.py [JOURNEYS_PER_MIX] [--running N] [--seed S]
        [--mixes short,long-chunked,preempting,short+steps] [--engine-only]

Defaults: 5,000 journeys per mix, 64 running; about a minute on 2 vCPUs.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
os.environ.setdefault("OTEL_SERVICE_NAME", "vllm")

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import harness
from vllm_journey_otel import schema as S
from vllm_journey_otel.config import Batching, Config
from vllm_journey_otel.engine import handoff, hooks
from vllm_journey_otel.export.api_spans import plan_api
from vllm_journey_otel.export.exporters import make_resource, span_limits
from vllm_journey_otel.export.span_builder import SpanBuilder
from vllm_journey_otel.journey import API_PARENT_KEY, ApiJourney, RootIds

MIXES: dict[str, dict[str, Any]] = {
    "short": {"prompt": (64, 512), "out": (16, 256), "chunk": 2048, "kv": None},
    "long-chunked": {"prompt": (1500, 3500), "out": (16, 128), "chunk": 512, "kv": None},
    "preempting": {"prompt": (64, 512), "out": (16, 256), "chunk": 2048, "kv": 0.45},
    "short+steps": {"prompt": (64, 512), "out": (16, 256), "chunk": 2048, "kv": None, "steps": 1},
}
SMALL_BATCH = 128


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def drive(
    mix: dict[str, Any], n: int, running: int, rng: random.Random, api: dict[str, RootIds] | None
) -> dict[str, int]:
    """Run ``n`` journeys of the mix through a real Scheduler until all finished;
    ``api``: each request under an API-server span, whose ids it records."""
    (p_lo, p_hi), (o_lo, o_hi) = mix["prompt"], mix["out"]
    peak_blocks = running * ((p_hi + o_hi) // harness.BLOCK_SIZE + 1)
    blocks = int(peak_blocks * mix["kv"]) + 64 if mix["kv"] else peak_blocks * 2
    e = harness.Engine(
        max_num_seqs=running,
        max_num_batched_tokens=mix["chunk"],
        max_model_len=4096,
        num_blocks=blocks,
    )
    s = e.scheduler
    added = steps = preemptions = 0
    while added < n or s.requests:
        while added < n and len(s.requests) < running + running // 8:
            rid = f"cmpl-{rng.getrandbits(128):032x}-0-{rng.getrandbits(32):08x}"
            prompt = rng.choices(range(10, 1000), k=rng.randint(p_lo, p_hi))
            headers = None
            if api is not None:
                ids = RootIds(rng.getrandbits(64), rng.getrandbits(64) | 1, rng.getrandbits(64) | 1)
                api[rid] = ids
                traceparent = f"00-{ids.trace_hi:016x}{ids.trace_lo:016x}-{ids.span_id:016x}-01"
                headers = {"traceparent": traceparent, API_PARENT_KEY: "1"}
            e.add(rid, prompt=prompt, max_tokens=rng.randint(o_lo, o_hi), trace_headers=headers)
            e.requests.pop(rid, None)  # the harness need not hold finished requests
            added += 1
        so = e.schedule()
        preemptions += len(so.preempted_req_ids)
        e.update()
        e.outputs.clear()
        steps += 1
    return {"steps": steps, "preemptions": preemptions, "kv_blocks": blocks}


def framed(size: int) -> int:
    """The bytes a length-delimited field of ``size`` bytes adds beyond its own:
    a one-byte tag and the varint length."""
    n = 1
    while size >= 0x80:
        size >>= 7
        n += 1
    return 1 + n


def encode(spans: list[ReadableSpan], batch: int) -> dict[str, Any]:
    """``spans`` exported in batches of ``batch``: OTLP bytes per span id (its own
    message plus its share of the batch's envelope), total bytes, gzipped totals
    per level, and the bytes of the spans' links."""
    per_span: dict[int, float] = {}
    total = link_bytes = 0
    gz = {6: 0, 9: 0}
    for i in range(0, len(spans), batch):
        req = encode_spans(spans[i : i + batch])
        data = req.SerializeToString()
        total += len(data)
        for level in gz:
            gz[level] += len(gzip.compress(data, compresslevel=level, mtime=0))
        own: dict[int, int] = {}
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    size = sp.ByteSize()
                    own[int.from_bytes(sp.span_id, "big")] = size + framed(size)
                    link_bytes += sum(lk.ByteSize() + framed(lk.ByteSize()) for lk in sp.links)
        share = (len(data) - sum(own.values())) / len(own)
        for sid, size in own.items():
            per_span[sid] = size + share
    return {"per_span": per_span, "total": total, "gzip": gz, "link_bytes": link_bytes}


def api_spans(roots: list[ReadableSpan], api: dict[str, RootIds], rng: random.Random) -> list:
    """The API server's spans of each request whose engine root is in ``roots``:
    times around the engine's (its receipt 1-3 ms before, its last byte 1-3 ms
    after), half streamed; built with the API server's resource."""
    builder = SpanBuilder(
        make_resource({S.RES_MODEL: "tiny-llama", S.RES_PID: 4321}), span_limits()
    )
    out = []
    for i, root in enumerate(roots):
        rid = str((root.attributes or {})[S.REQUEST_ID])
        start, end = root.start_time or 0, root.end_time or 0
        stream = i % 2 == 0
        rec = ApiJourney(
            ids=api[rid], parent_headers=None, server_kind=True, head_sampled=True,
            method="POST", path="/v1/chat/completions" if stream else "/v1/completions",
            stream=stream, disconnected=False, status_code=200, exception=None,
            request_ids=[rid], receipt_mono_ns=start - rng.randint(1, 3) * 10**6,
            end_mono_ns=end + rng.randint(1, 3) * 10**6, responded=True,
            arrival_time_s=start / 1e9, handoff_mono_ns=start + 200_000,
            first_body_mono_ns=start + (end - start) // 4 if stream else end + 10**6,
            last_output_mono_ns=end + 500_000, chunks=rng.randint(16, 256) if stream else 1,
        )  # fmt: skip
        out += builder.build(*plan_api(rec, 0))
    return out


def measure(
    name: str, n: int, running: int, seed: int, exp: InMemorySpanExporter, with_api: bool
) -> dict:
    mix = MIXES[name]
    hooks.install(Config(enabled=True, steps=bool(mix.get("steps"))), exporters=[exp], batch=False)
    exp.clear()
    t0 = time.perf_counter()
    api: dict[str, RootIds] | None = {} if with_api else None
    engine = drive(mix, n, running, random.Random(seed), api)
    assert handoff.flush(30.0)
    spans = list(exp.get_finished_spans())
    if api is not None:  # the API server's exporter sends its own batches (its resource)
        roots_ = [sp for sp in spans if sp.name == S.SPAN_REQUEST]
        spans += api_spans(roots_, api, random.Random(seed + 1))
    drive_s = time.perf_counter() - t0
    steps = [sp for sp in spans if sp.name == S.SPAN_STEP]
    journey_spans = [sp for sp in spans if sp.name != S.SPAN_STEP]
    by_trace: dict[int, list[ReadableSpan]] = defaultdict(list)
    for sp in journey_spans:
        by_trace[sp.context.trace_id].append(sp)
    roots = [sp for sp in journey_spans if sp.name == S.SPAN_REQUEST]
    if api is not None:  # every engine root and its API request in one trace
        assert len([sp for sp in journey_spans if sp.name == S.SPAN_API]) == n
    assert len(roots) == len(by_trace) == n, (len(roots), len(by_trace), n)
    big = Batching().max_batch
    enc = encode(spans, big)
    per_span, total, gz = enc["per_span"], enc["total"], enc["gzip"]
    small = encode(spans, SMALL_BATCH)
    small_total, small_gz = small["total"], small["gzip"]
    counts = [len(v) for v in by_trace.values()]
    jbytes = [sum(per_span[sp.context.span_id] for sp in v) for v in by_trace.values()]
    sbytes = [per_span[sp.context.span_id] for sp in journey_spans]
    step_bytes = [per_span[sp.context.span_id] for sp in steps]
    names = Counter(sp.name for sp in journey_spans)
    by_name: dict[str, list[ReadableSpan]] = defaultdict(list)
    for sp in journey_spans:
        by_name[sp.name].append(sp)
    preempted = sum(1 for r in roots if (r.attributes or {}).get(S.NUM_PREEMPTIONS))
    chunks = [
        (sp.attributes or {}).get(S.PREFILL_CHUNKS, 0)
        for sp in journey_spans
        if sp.name == S.SPAN_PREFILL
    ]
    # Everything the mix sent (step spans included), per journey.
    out: dict[str, Any] = {
        "mix": name,
        "api_server_spans": with_api,
        "journeys": n,
        "engine": {**engine, "running": running, "drive_s": round(drive_s, 1)},
        "journeys_preempted": preempted,
        "output_tokens_mean": round(
            statistics.fmean(int((r.attributes or {})[S.GEN_AI_OUTPUT_TOKENS]) for r in roots), 1
        ),
        "prefill_chunks_per_prefill_span": round(statistics.fmean(chunks), 2),
        "spans_per_journey": {
            "mean": round(statistics.fmean(counts), 2),
            "p50": pct(counts, 50),
            "p99": pct(counts, 99),
            "max": max(counts),
        },
        "span_names_per_journey": {k: round(v / n, 2) for k, v in sorted(names.items())},
        "otlp_bytes_per_span_by_name": {
            k: round(statistics.fmean(per_span[sp.context.span_id] for sp in v))
            for k, v in sorted(by_name.items())
        },
        "otlp_bytes_per_span": {
            "mean": round(statistics.fmean(sbytes)),
            "p99": round(pct(sbytes, 99)),
        },
        "otlp_bytes_per_journey": {
            "mean": round(statistics.fmean(jbytes)),
            "p99": round(pct(jbytes, 99)),
        },
        "per_journey_all_spans": {
            "spans": round(len(spans) / n, 2),
            "otlp_bytes": round(total / n),
            f"gzip6_bytes_batches_of_{big}": round(gz[6] / n),
            f"gzip9_bytes_batches_of_{big}": round(gz[9] / n),
            f"otlp_bytes_batches_of_{SMALL_BATCH}": round(small_total / n),
            f"gzip6_bytes_batches_of_{SMALL_BATCH}": round(small_gz[6] / n),
        },
        "gzip6_ratio": round(total / gz[6], 2),
    }
    if steps:
        links = [len(sp.links) for sp in steps]
        out["step_view"] = {
            "step_spans": len(steps),
            "step_spans_per_journey": round(len(steps) / n, 2),
            "links_per_step_mean": round(statistics.fmean(links), 1),
            "links_per_journey": round(sum(links) / n, 1),
            "otlp_bytes_per_link": round(enc["link_bytes"] / max(1, sum(links))),
            "otlp_bytes_per_step_span_mean": round(statistics.fmean(step_bytes)),
            "otlp_bytes_per_step_span_p99": round(pct(step_bytes, 99)),
        }
    all_ = out["per_journey_all_spans"]
    out["gateway_per_1000_journeys_per_s"] = {
        "spans_per_s": round(1000 * all_["spans"]),
        "MB_per_s_otlp": round(all_["otlp_bytes"] * 1000 / 1e6, 2),
        "MB_per_s_gzip": round(all_[f"gzip6_bytes_batches_of_{big}"] * 1000 / 1e6, 2),
        f"MB_per_s_gzip_batches_of_{SMALL_BATCH}": round(
            all_[f"gzip6_bytes_batches_of_{SMALL_BATCH}"] * 1000 / 1e6, 2
        ),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("journeys", nargs="?", type=int, default=5000)
    ap.add_argument("--running", type=int, default=64, help="max_num_seqs of each engine")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument(
        "--engine-only", action="store_true", help="without the API server's spans (API_SPANS=0)"
    )
    args = ap.parse_args()
    exp = InMemorySpanExporter()
    results = []
    try:
        for name in args.mixes.split(","):
            r = measure(name, args.journeys, args.running, args.seed, exp, not args.engine_only)
            print(json.dumps(r), flush=True)
            results.append(r)
    finally:
        hooks.uninstall()
    big = Batching().max_batch
    print(
        "\n| mix | journeys | spans/journey mean (p50, p99) | OTLP B/span mean (p99) "
        "| OTLP B/journey mean (p99) | all spans/journey | OTLP B/journey, all spans "
        f"| gzip B/journey ({big}; {SMALL_BATCH}-span batches) "
        "| per 1,000 journeys/s: spans/s, MB/s OTLP, MB/s gzip |"
    )
    print("|" + "---|" * 9)
    for r in results:
        sp, bs, bj = r["spans_per_journey"], r["otlp_bytes_per_span"], r["otlp_bytes_per_journey"]
        a, g = r["per_journey_all_spans"], r["gateway_per_1000_journeys_per_s"]
        print(
            f"| {r['mix']} | {r['journeys']:,} | {sp['mean']} ({sp['p50']}, {sp['p99']}) "
            f"| {bs['mean']} ({bs['p99']}) | {bj['mean']:,} ({bj['p99']:,}) | {a['spans']} "
            f"| {a['otlp_bytes']:,} | {a[f'gzip6_bytes_batches_of_{big}']:,}; "
            f"{a[f'gzip6_bytes_batches_of_{SMALL_BATCH}']:,} "
            f"| {g['spans_per_s']:,}, {g['MB_per_s_otlp']}, {g['MB_per_s_gzip']} |"
        )


if __name__ == "__main__":
    main()
