"""Journeys from vLLM's real Scheduler under KV-cache pressure, drawn in the terminal.

No GPU, no server, no collector: vLLM's own Scheduler runs on the CPU with
fabricated model outputs (tests/harness.py), the plugin is loaded through vLLM's
plugin mechanism exactly as `vllm serve` loads it, and the spans come back from
the plugin's real export path (an in-memory exporter instead of OTLP).

    VLLM_JOURNEY_OTEL=1 python examples/scheduler_demo.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
os.environ.setdefault("VLLM_JOURNEY_OTEL", "1")
os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from vllm.plugins import load_general_plugins

from vllm_journey_otel import hooks
from vllm_journey_otel import schema as S
from vllm_journey_otel.config import from_env

WIDTH = 72
GLYPH = {S.SPAN_QUEUED: ".", S.SPAN_PREFILL: "P", S.SPAN_DECODE: "=", S.SPAN_PREEMPTED: "x"}


def main() -> None:
    load_general_plugins()  # the entry point, as vLLM loads it in every process
    exporter = InMemorySpanExporter()
    # Same configuration, but spans kept in memory for drawing.
    hooks.install(from_env(), exporters=[exporter], batch=False)
    import harness  # real Scheduler + fabricated model runner

    engine = harness.Engine(
        num_blocks=12, max_num_batched_tokens=64, max_model_len=512, max_num_seqs=8
    )
    for i in range(6):
        engine.add(f"req-{i}", prompt_len=20 + 17 * i, max_tokens=24 + 4 * i)
        engine.step()
    steps = engine.run()
    engine.scheduler.shutdown()
    spans = exporter.get_finished_spans()
    roots = sorted((s for s in spans if s.name == S.SPAN_REQUEST), key=lambda s: s.start_time)
    t0 = min(s.start_time for s in roots)
    t1 = max(s.end_time for s in roots)
    scale = (WIDTH - 1) / max(1, t1 - t0)
    print(
        f"{len(roots)} journeys, {len(spans)} spans, {steps} scheduler steps after the last arrival"
    )
    print(
        f"legend: . queued  P prefill  = decode  x preempted   (time -> {(t1 - t0) / 1e6:.2f} ms)\n"
    )
    for root in roots:
        row = [" "] * WIDTH
        for s in spans:
            if s.context.trace_id != root.context.trace_id or s.name not in GLYPH:
                continue
            a, b = int((s.start_time - t0) * scale), int((s.end_time - t0) * scale)
            for x in range(a, max(a, b) + 1):
                row[x] = GLYPH[s.name]
        attrs = root.attributes or {}
        print(
            f"{attrs[S.REQUEST_ID]:>6} |{''.join(row)}| "
            f"in={attrs[S.GEN_AI_INPUT_TOKENS]} out={attrs[S.GEN_AI_OUTPUT_TOKENS]} "
            f"preempted={attrs[S.NUM_PREEMPTIONS]} {attrs[S.FINISH_STATUS]}"
        )
    hooks.uninstall()


if __name__ == "__main__":
    main()
