"""The threads of ours that work through a backlog offer their CPU back
(``cpu_pacing.Pacer``): span building between journeys, the export stage between
sends. Real sink, stage and exporters; the pacer's clock and yield are replaced
only where a test counts its offers.

What the offers are for (a spinning thread of vLLM's on the same CPU learns
of its message late without them) is a kernel's scheduling at work, shown by
``benchmarks/yield_handover.py``, not asserted here: a timed test on a shared
2-CPU machine would measure the machine."""

from __future__ import annotations

import os
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from records import journeys
from services import wait_until
from vllm_journey_otel.export.cpu_pacing import YIELD_EVERY_NS, Pacer
from vllm_journey_otel.export.export_stage import ExportStage
from vllm_journey_otel.export.health import ExportHealth
from vllm_journey_otel.export.span_sink import SpanSink
from vllm_journey_otel.export.spans import plan_spans


def test_the_pacer_offers_the_cpu_once_per_interval_of_work() -> None:
    now = [0]
    offered: list[int] = []
    pace = Pacer(every_ns=100, clock=lambda: now[0], give=lambda: offered.append(now[0]))
    for t in range(0, 1000, 10):  # units of work of 10 ns
        now[0] = t
        pace()
    assert offered == list(range(100, 1000, 100))
    assert pace.yields == 9
    now[0] = 5_000  # after a wait: the thread gave its CPU back by blocking
    pace.restart()
    now[0] = 5_090
    pace()
    assert offered[-1] == 900  # the interval counts from the restart
    now[0] = 5_100
    pace()
    assert offered[-1] == 5_100


def test_the_default_pacer_yields_for_real_and_returns() -> None:
    pace = Pacer()
    assert pace._give is os.sched_yield  # the kernel's; releases the GIL on 3.11.1+
    assert 0 < YIELD_EVERY_NS <= 100_000  # a spinning thread of vLLM's waits at most this
    pace._due_mono_ns = 0
    pace()
    assert pace.yields == 1


def test_span_building_offers_the_cpu_between_journeys() -> None:
    memory = InMemorySpanExporter()
    sink = SpanSink.from_env({}, exporters=[memory], threaded=False)
    batch = journeys(40)
    built_at_offer: list[int] = []
    # Every call offers: the offers fall between journeys, one before each.
    sink.pace = Pacer(every_ns=0, give=lambda: built_at_offer.append(sink._spans_added))
    sink.consume(batch)
    sink.flush(5)
    sizes = [len(plan_spans(j, 0)) for j in batch]
    assert len(memory.get_finished_spans()) == sum(sizes)
    assert built_at_offer == [sum(sizes[:k]) for k in range(len(batch))]


def test_span_building_paces_with_the_real_clock_and_yield() -> None:
    memory = InMemorySpanExporter()
    sink = SpanSink.from_env({}, exporters=[memory], threaded=False)
    batch = journeys(400)  # tens of ms of work: many intervals of YIELD_EVERY_NS
    sink.consume(batch)
    assert 1 <= sink.pace.yields <= len(batch)
    assert len(memory.get_finished_spans()) == sum(len(plan_spans(j, 0)) for j in batch)


class Sends(SpanExporter):
    def __init__(self) -> None:
        self.batches = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.batches += 1
        return SpanExportResult.SUCCESS


def test_the_export_thread_offers_the_cpu_between_sends() -> None:
    sends = Sends()
    stage = ExportStage([sends], ExportHealth(), max_batch=10, delay_s=0.05)
    offers: list[int] = []
    stage.pace = Pacer(every_ns=0, give=lambda: offers.append(sends.batches))
    memory = InMemorySpanExporter()  # only a source of real spans
    sink = SpanSink.from_env({}, exporters=[memory], threaded=False)
    sink.consume(journeys(20))
    spans = list(memory.get_finished_spans())
    for i in range(0, len(spans), 10):
        stage.add(spans[i : i + 10])
    assert stage.flush(10)
    wait_until(lambda: sends.batches * 10 >= len(spans), timeout=10)
    # One offer before each send, none in the middle of one.
    assert offers == list(range(sends.batches))
    stage.shutdown(5)
