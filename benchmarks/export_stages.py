"""Where the exporter process spends its time, stage by stage, per journey.

The exporter's work for one frame of journeys, each stage timed on its own in
this process (the same code the exporter process runs, on the same journeys as
``export_bench.py``), repeated in rounds so a noisy machine shows as spread:

* ``decode``: msgspec frames to :class:`FinishedJourney` (``wire.read_frames``);
* ``plan``: ``spans.plan_spans`` and ``spans.root_context``;
* ``build``: ``span_builder.SpanBuilder`` (the SDK's ReadableSpans, directly);
* ``otlp_encode``: the SDK's OTLP encoder (``encode_spans``, what the OTLP
  exporters call) on those spans, in batches of the export stage's size;
* ``serialize``: protobuf bytes of those requests (gRPC does this on send);
* ``ours_encode``: our encoder on the same ReadableSpans (``otlp_encoder.OtlpEncoder``:
  the same bytes as the two above);
* ``ours_from_plan``: what the exporter runs instead of ``build`` and the
  encoding, with OTLP exporters only: each plan straight to OTLP Span fields
  (``SpanBuilder.encode``) and the batch's request around them (``OtlpEncoder.wrap``);
  gRPC sends those bytes as they are (``otlp_exporters.py``);
* ``receiver_parse``: what a Python receiver pays to decode them again.

    .venv/bin/python benchmarks/export_stages.py [N] [ROUNDS] [api-parent|api-records]

``api-parent``: every journey under an API server's span, as on the default
path (``export_bench.py --api-parent``); ``api-records``: the API server's
records instead, as its own exporter receives them (``--api-records``).

The cyclic GC is tuned as in the exporter process.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent))

from export_bench import RESOURCE, api_records, journeys

from vllm_journey_otel.config import Batching
from vllm_journey_otel.engine.pipe_sink import PipeSink
from vllm_journey_otel.export.api_spans import plan_api
from vllm_journey_otel.export.exporter_process import tune_gc
from vllm_journey_otel.export.exporters import make_resource, span_limits
from vllm_journey_otel.export.otlp_encoder import OtlpEncoder
from vllm_journey_otel.export.span_builder import SpanBuilder
from vllm_journey_otel.export.spans import plan_spans, root_context
from vllm_journey_otel.journey import ApiJourney
from vllm_journey_otel.wire import DECODER

FRAME_JOURNEYS = 100


def plan_of(record: Any) -> tuple[Any, tuple[Any, Any]]:
    """A record's span plan and its root's (parent, links), as the exporter makes them."""
    if isinstance(record, ApiJourney):
        plan, parent, links = plan_api(record, 0)
        return plan, (parent, links)
    return plan_spans(record, 0, 0), root_context(record)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    kind = sys.argv[3] if len(sys.argv) > 3 else "journeys"
    if kind not in ("journeys", "api-parent", "api-records"):
        raise SystemExit(f"unknown record kind {kind!r}: api-parent or api-records")
    records = api_records(n) if kind == "api-records" else journeys(n, kind == "api-parent")
    batch_size = Batching().max_batch
    frames = [
        PipeSink._frame(records[i : i + FRAME_JOURNEYS], 0)[4:] for i in range(0, n, FRAME_JOURNEYS)
    ]
    tune_gc()  # as the exporter process does
    builder = SpanBuilder(make_resource(RESOURCE), span_limits())
    encoder = OtlpEncoder()
    fused = SpanBuilder(make_resource(RESOURCE), span_limits())
    times: dict[str, list[float]] = {}

    def timed(stage: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        times.setdefault(stage, []).append((time.perf_counter() - t0) / n * 1e6)
        return out

    spans_per_journey = 0.0
    bytes_per_span = 0.0
    for _ in range(rounds):
        decoded = timed("decode", lambda: [j for f in frames for j in DECODER.decode(f).journeys])
        plans = timed(
            "plan",
            lambda: [plan_of(j) for j in decoded],  # noqa: B023
        )
        built = timed("build", lambda: [builder.build(p, *ctx) for p, ctx in plans])  # noqa: B023
        spans = [s for group in built for s in group]
        requests = timed(
            "otlp_encode",
            lambda: [
                encode_spans(spans[i : i + batch_size])  # noqa: B023
                for i in range(0, len(spans), batch_size)  # noqa: B023
            ],
        )
        data = timed("serialize", lambda: [r.SerializeToString() for r in requests])  # noqa: B023
        timed(
            "ours_encode",
            lambda: [
                encoder.encode(spans[i : i + batch_size])  # noqa: B023
                for i in range(0, len(spans), batch_size)  # noqa: B023
            ],
        )

        def from_plan() -> list[bytes]:
            fields = [f for p, ctx in plans for f in fused.encode(encoder, p, *ctx)]  # noqa: B023
            return [
                encoder.wrap(fused.resource, fused.scope, fields[i : i + batch_size])
                for i in range(0, len(fields), batch_size)
            ]

        timed("ours_from_plan", from_plan)
        timed(
            "receiver_parse",
            lambda: [trace_service_pb2.ExportTraceServiceRequest.FromString(d) for d in data],  # noqa: B023
        )
        spans_per_journey = len(spans) / n
        bytes_per_span = sum(map(len, data)) / len(spans)
    sdk_stages = ("decode", "plan", "build", "otlp_encode", "serialize")
    our_stages = ("decode", "plan", "ours_from_plan")
    medians = {k: statistics.median(v) for k, v in times.items()}
    sdk_total = sum(medians[k] for k in sdk_stages)
    total = sum(medians[k] for k in our_stages)
    print(
        json.dumps(
            {
                "journeys": n,
                "rounds": rounds,
                "spans_per_journey": round(spans_per_journey, 2),
                "otlp_bytes_per_span": round(bytes_per_span),
                "us_per_journey_median_(min,max)": {
                    k: f"{medians[k]:.1f} ({min(v):.1f}, {max(v):.1f})" for k, v in times.items()
                },
                "exporter_total_us_per_journey": round(total, 1),
                "with_the_sdks_encoder_us_per_journey": round(sdk_total, 1),
                "exporter_journeys_per_s_on_one_core": round(1e6 / total),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
