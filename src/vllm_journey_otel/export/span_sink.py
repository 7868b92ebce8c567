"""Span building for a batch of finished journeys, into the export stage.

The exporter process's main thread (``process`` mode), or the engine core's
drain thread (``thread`` mode). Clock: the plan's stamps are engine monotonic
(``*_mono_ns``), converted to epoch with this process's anchor (``clock.py``:
CLOCK_MONOTONIC is system-wide, so the exporter's anchor converts the engine
core's stamps on the same host).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.trace import Link, SpanContext
from opentelemetry.util.types import AttributeValue

from vllm_journey_otel import schema as S
from vllm_journey_otel.clock import ClockAnchor
from vllm_journey_otel.config import (
    EXPORT_MODE,
    QUEUE_SIZE,
    TRACES_EXPORTER,
    Config,
    batching_from_env,
    endpoint_name,
    exporter_names,
)
from vllm_journey_otel.export.api_spans import plan_api
from vllm_journey_otel.export.cpu_pacing import Pacer
from vllm_journey_otel.export.export_stage import ExportStage
from vllm_journey_otel.export.exporters import (
    build_exporters,
    make_resource,
    span_limits,
)
from vllm_journey_otel.export.health import ExportHealth
from vllm_journey_otel.export.in_flight_spans import plan_in_flight
from vllm_journey_otel.export.otlp_encoder import OtlpEncoder
from vllm_journey_otel.export.span_builder import SpanBuilder
from vllm_journey_otel.export.spans import ROOT, plan_spans, plan_step, root_context
from vllm_journey_otel.journey import ApiJourney, InFlight, Record, StepRecord
from vllm_journey_otel.log import logger
from vllm_journey_otel.losses import Loss, LossAccount
from vllm_journey_otel.wire import Acks


class SpanSink:
    """Build spans in this process and hand them to the export stage."""

    def __init__(
        self,
        builder: SpanBuilder,
        stage: ExportStage,
        clock: ClockAnchor | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        self.builder = builder
        self.stage = stage
        self.health = stage.health
        self._clock = clock or ClockAnchor()
        self._stop = stop
        # This process's loss account (in thread mode the pipeline adopts it).
        self.losses = LossAccount()
        # Set: the stage takes Span fields encoded here (otlp_exporters.py), not ReadableSpans.
        self.encoder: OtlpEncoder | None = None
        # The records accounted for (wire.Acks, exporter process only): those
        # that failed to build (this thread) and those whose spans are through
        # an export (the stage's thread: ``_marks`` holds each record's last
        # span's number in the order the stage takes them).
        self.acks: Acks | None = None
        self._marks: deque[int] = deque()
        self._spans_added = 0
        self._records_unbuilt = 0
        self._records_through = 0
        self._acks_lock = threading.Lock()
        stage.on_exported = self._through
        # The building thread's offers of its CPU, once per YIELD_EVERY_NS of work.
        self.pace = Pacer()

    @classmethod
    def from_env(
        cls,
        resource_attributes: Mapping[str, Any],
        exporters: Sequence[SpanExporter] | None = None,
        threaded: bool = True,
        health: ExportHealth | None = None,
        stop: Callable[[], bool] | None = None,
        cpu_priority: str = Config.cpu_priority,
        in_engine: bool = False,
    ) -> SpanSink:
        """Exporters, resource, limits and batching from the OTEL_* variables
        (``exporters`` given: those, for tests)."""
        names: list[str] = []
        if exporters is None:
            try:
                names = exporter_names()
                exporters = build_exporters()
            except Exception as exc:  # a bad OTEL_TRACES_EXPORTER must not stop vLLM
                logger.warning("journey-otel: %s; journeys are recorded but not exported", exc)
                exporters = []
            else:
                if not exporters:
                    logger.info("%s=none: journeys are recorded but not exported.", TRACES_EXPORTER)
        batching = batching_from_env()
        stage = ExportStage(
            exporters,
            health or ExportHealth(),
            max_batch=batching.max_batch,
            delay_s=batching.delay_ms / 1000.0,
            max_pending=batching.max_pending,
            threaded=threaded,
            endpoint=endpoint_name(names),
            cpu_priority=cpu_priority,
            shares_gil=in_engine,
        )
        builder = SpanBuilder(make_resource(resource_attributes), span_limits())
        sink = cls(builder, stage, stop=stop)
        # Where every exporter takes them (the SDK's OTLP ones, as ours), spans are
        # encoded here straight from their plans, without the SDK's span objects.
        if exporters and all(_takes_encoded(e, builder) for e in exporters):
            sink.encoder = OtlpEncoder()
        return sink

    def may_take(self) -> bool:
        return False  # building spans is not for the engine thread: always queue

    def offer(self, batch: Sequence[Record], engine_dropped: int = 0) -> bool:
        return False

    takes_offers = False
    broken = False  # spans are built in this process: never without a receiving end
    replacing = False  # nothing to replace: spans are built in this process
    unsent = 0  # it writes nothing: a batch it takes is built and exported

    def note_held(self, queued: int) -> None:
        """Nothing to tell: the queue and the spans die with this one process."""

    @property
    def drop_advice(self) -> str:
        return (
            f"building spans in this process cannot keep up: use {EXPORT_MODE}=process, "
            f"lower the sampling ratio, or raise {QUEUE_SIZE} for bursts"
        )

    @property
    def pending(self) -> bool:
        return False

    def maintain(self) -> None:
        pass  # nothing here goes away

    def consume(
        self, batch: Sequence[Record], engine_dropped: int = 0, deadline: float | None = None
    ) -> int:
        # Building spans takes CPU, not a wait; the stage may make us wait for
        # the backend (backpressure), until ``deadline`` at most.
        unbuilt: list[Record] = []
        health = self.health
        health.engine_dropped = max(health.engine_dropped, engine_dropped)
        built: list[Any] = []  # ReadableSpans, or their OTLP fields (self.encoder)
        pace = self.pace
        for journey in batch:
            pace()  # a spinning thread of vLLM's on this CPU gets it back (cpu_pacing.py)
            try:
                spans = self._spans(journey)
            except Exception:
                self._records_unbuilt += 1
                self._ack()
                unbuilt.append(journey)
                if self.losses[Loss.UNBUILT] + len(unbuilt) == 1:
                    logger.warning(
                        "journey-otel: could not build spans for a journey; "
                        "later failures are counted silently",
                        exc_info=True,
                    )
            else:
                built.extend(spans)
                if spans:
                    self._spans_added += len(spans)
                    self._marks.append(self._spans_added)
                else:
                    self._records_unbuilt += 1
                    self._ack()
            if len(built) >= ADD_SPANS:
                health.spans_built += len(built)
                self.stage.add(built, self._stop, deadline)
                built = []
        health.spans_built += len(built)
        self.stage.add(built, self._stop, deadline)
        # (An in-flight snapshot that failed counts as a snapshot, not a journey.)
        return self.losses.lose(Loss.UNBUILT, unbuilt)

    def _through(self, spans_through: int) -> None:
        """The stage's thread: records whose last span is through an export are accounted for."""
        marks, through = self._marks, 0
        while marks and marks[0] <= spans_through:
            marks.popleft()
            through += 1
        if through:
            self._records_through += through
            self._ack()

    def _ack(self) -> None:
        if self.acks is not None:
            with self._acks_lock:
                self.acks.write(self._records_through + self._records_unbuilt)

    def _spans(self, journey: Record) -> list[Any]:
        # One offset per record, the wall clock's at the record's first stamp
        # (clock.py): its intervals stay the monotonic clock's own.
        links: Sequence[Link] = ()
        parent: SpanContext | None = None
        if isinstance(journey, StepRecord):
            plan = [plan_step(journey, self._clock.at(journey.start_mono_ns).offset_ns)]
        elif isinstance(journey, InFlight):
            offset_ns = self._clock.at(journey.journey.admitted.t_mono_ns).offset_ns
            span, parent = plan_in_flight(journey, offset_ns)
            plan = [span]
        elif isinstance(journey, ApiJourney):
            # A journey received (the API server's exporter says so at exit).
            self.health.journeys += 1
            offset_ns = self._clock.at(journey.receipt_mono_ns).offset_ns
            plan, parent, links = plan_api(journey, offset_ns)
            self._health_attributes(plan[ROOT].attributes)
        else:
            self.health.journeys += 1
            anchor = self._clock.at(journey.admitted.t_mono_ns)
            plan = plan_spans(journey, anchor.offset_ns, anchor.uncertainty_ns)
            self._health_attributes(plan[ROOT].attributes)
            parent, links = root_context(journey)
        if self.encoder is not None:
            return self.builder.encode(self.encoder, plan, parent, links)
        return self.builder.build(plan, parent, links)

    def _health_attributes(self, root: dict[str, AttributeValue]) -> None:
        root[S.TRACER_DROPPED_JOURNEYS] = self.health.engine_dropped
        root[S.TRACER_LOST_SPANS] = self.health.lost_spans

    def flush(self, timeout_s: float) -> bool:
        """Export what was built within ``timeout_s``."""
        return self.stage.flush(timeout_s)

    def shutdown(self, timeout_s: float) -> None:
        self.stage.shutdown(timeout_s)


def _takes_encoded(exporter: SpanExporter, builder: SpanBuilder) -> bool:
    take = getattr(exporter, "take_encoded", None)
    return callable(take) and bool(take(builder.resource, builder.scope))


# Spans handed to the export stage at a time: a large frame (a drain of the
# whole queue) waits for room piecewise instead of holding all its spans.
ADD_SPANS = 512
