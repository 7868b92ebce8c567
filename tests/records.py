"""Finished journeys built through the real state machine, for sink and pipeline tests."""

from __future__ import annotations

import random
import time
from pathlib import Path

from vllm_journey_otel.engine.request_journey import RequestJourney
from vllm_journey_otel.journey import STATUS_ABORTED, STATUS_LENGTH, FinishedJourney

MS = 1_000_000


def journeys(n: int, start: int = 0) -> list[FinishedJourney]:
    """``n`` plain journeys ``req-<start>`` ..., 1 ms per phase, engine monotonic clock."""
    out = []
    base = time.monotonic_ns()
    for i in range(start, start + n):
        t = base + i * MS
        j = RequestJourney(f"req-{i}", time.time(), t, i, 100, 8)
        j.scheduled(t + MS, i, 0, 100, 100, 0)
        j.tokens(t + 2 * MS, i, 1)
        out.append(j.finish(t + 3 * MS, i, STATUS_LENGTH, "length", 8, t + 3 * MS))
    return out


def write_trace_file(path: Path, n: int, seed: int = 7) -> None:
    """``n`` journeys ``req-0`` ... (about 6 spans each, 15 % preempted, 2 % aborted)
    through the real journey model, span plan and builder, written by the real
    OTLP/JSON file exporter: a big trace file in seconds."""
    from vllm_journey_otel.export.export_stage import ExportStage
    from vllm_journey_otel.export.exporters import make_resource, span_limits
    from vllm_journey_otel.export.file_exporter import OtlpJsonFileExporter
    from vllm_journey_otel.export.health import ExportHealth
    from vllm_journey_otel.export.span_builder import SpanBuilder
    from vllm_journey_otel.export.spans import plan_spans

    rng = random.Random(seed)
    exporter = OtlpJsonFileExporter(path, max_bytes=1 << 40)
    stage = ExportStage([exporter], ExportHealth(), max_batch=2048)
    builder = SpanBuilder(make_resource({}), span_limits())
    offset = time.time_ns() - time.monotonic_ns()
    t = 0
    for i in range(n):
        t += rng.randint(1, 5) * MS
        j = RequestJourney(f"req-{i}", (t + offset) / 1e9, t, i, 100, 64)
        now = t + rng.randint(0, 50) * MS
        j.scheduled(now, i, 0, 100, 100, 0)
        now += rng.randint(5, 30) * MS
        j.tokens(now, i, 1)
        out = 1
        if rng.random() < 0.15:
            now += 20 * MS
            j.preempted(now, i, 100, 10, 0.98, 30, 5)
            now += rng.randint(10, 200) * MS
            j.scheduled(now, i, 0, 110, 110, 10)
            now += 10 * MS
            j.tokens(now, i, 11)
            out = 11
        now += rng.randint(50, 500) * MS
        status = STATUS_ABORTED if rng.random() < 0.02 else STATUS_LENGTH
        fj = j.finish(now, i, status, "length", out + 50, now)
        assert fj is not None
        stage.add(builder.build(plan_spans(fj, offset), None))
    assert stage.shutdown(600), "the generator could not write every span"
