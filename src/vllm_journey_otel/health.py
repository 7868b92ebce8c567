"""The tracer's own health where spans are exported: counters, and few clear logs.

Process: the exporter process (``process`` mode) or the engine core (``thread``
mode). Threads: :class:`HealthExporter.export` runs on the SDK's
BatchSpanProcessor worker thread; :meth:`ExportHealth.spans_built` and the
queue-full count (:class:`SdkLogGate`, called on the thread that ends spans) on
the thread that builds spans. Each counter has one writer; readers may see a
slightly stale value, which is fine for a health report.

Why a log gate: the SDK logs every retry of a failing export ("Transient
error ...") and every span it drops from a full queue ("Queue full, dropping
span."), so a backend outage during a burst writes thousands of lines into
vLLM's log. The gate turns those records into counters (and remembers the last
reason); :class:`HealthExporter` then says once that export fails, with that
reason, every minute how much is lost while it lasts, and once that it works
again. With our logger at DEBUG the SDK's own records pass through too.

Counting relies on the SDK's log records, so it needs those loggers enabled at
WARNING (the exporter process configures that itself).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from .config import logger

# Loggers of the SDK's OTLP exporters and of its batch processor (SDK 1.3x-1.4x).
SDK_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.sdk._shared_internal",
    "opentelemetry.sdk.trace.export",
)
# Loggers that warn about what clients sent (a malformed tracestate, an id longer
# than the attribute limit): one line per request, nothing an operator can fix.
# Demoted to debug, counted.
INPUT_LOGGERS = ("opentelemetry.trace.span", "opentelemetry.attributes")
_FAILURE_PREFIXES = ("Transient error", "Failed to export", "Dropping span batch")
_QUEUE_FULL_PREFIX = "Queue full"
# While export keeps failing (or the queue keeps overflowing), one report a minute.
REPORT_PERIOD_S = 60.0


class ExportHealth:
    """Counters of one exporting process; ``lost_spans`` is what never left it."""

    def __init__(self, report_period_s: float = REPORT_PERIOD_S) -> None:
        self.journeys = 0
        self.spans_built = 0
        self.spans_exported = 0
        self.spans_failed = 0
        self.spans_dropped = 0  # the SDK's span queue was full
        self.engine_dropped = 0  # latest count the engine core reported with a batch
        self.last_reason = ""
        self.exporting = False  # a HealthExporter reports here (not OTEL_TRACES_EXPORTER=none)
        self.input_warnings = 0  # the SDK's complaints about client input, demoted
        # Span building waits for room while export works (the exporter process,
        # backpressure.py); False in thread mode, where a slow backend overflows.
        self.backpressure = False
        self._period_s = report_period_s
        self._outage_since: float | None = None
        self._failed_at_outage = 0
        self._last_failure_report = 0.0
        self._dropped_reported = 0
        self._last_drop_report = 0.0

    @property
    def lost_spans(self) -> int:
        """Spans built here that did not reach the backend (failed or dropped)."""
        return self.spans_failed + self.spans_dropped

    @property
    def backlog(self) -> int:
        """Spans built and not yet exported, failed or dropped: in the batch
        processor's queue or in the export under way (live, may be a span off)."""
        return self.spans_built - self.spans_exported - self.spans_failed - self.spans_dropped

    @property
    def in_outage(self) -> bool:
        """An export failed and none has succeeded since."""
        return self._outage_since is not None

    # -- export results (BatchSpanProcessor worker thread) -------------------
    def exported(self, n: int, endpoint: str) -> None:
        self.spans_exported += n
        if self._outage_since is not None:
            lost = self.spans_failed - self._failed_at_outage
            logger.warning(
                "journey-otel: export to %s works again after %.1f s; %d spans were lost "
                "meanwhile (serving was not affected)",
                endpoint,
                time.monotonic() - self._outage_since,
                lost,
            )
            self._outage_since = None

    def failed(self, n: int, endpoint: str) -> None:
        now = time.monotonic()
        if self._outage_since is None:
            self._outage_since = now
            self._failed_at_outage = self.spans_failed
            self._last_failure_report = now
            logger.warning(
                "journey-otel: exporting spans to %s fails (%s); serving is not affected, "
                "failed spans are dropped and counted; next report in %.0f s unless it recovers",
                endpoint,
                self.last_reason or "no reason given by the exporter",
                self._period_s,
            )
        elif now - self._last_failure_report >= self._period_s:
            self._last_failure_report = now
            logger.warning(
                "journey-otel: export to %s still fails after %.0f s (%s); %d spans lost so far",
                endpoint,
                now - self._outage_since,
                self.last_reason or "no reason given",
                self.spans_failed + n - self._failed_at_outage,
            )
        self.spans_failed += n

    # -- queue overflow (thread that ends spans) -----------------------------
    def dropped(self) -> None:
        self.spans_dropped += 1
        now = time.monotonic()
        first = self._dropped_reported == 0
        if first or now - self._last_drop_report >= self._period_s:
            if self.backpressure:  # the queue overflows only while export fails or is stuck
                cause = (
                    "while export fails or is stuck; a larger OTEL_BSP_MAX_QUEUE_SIZE "
                    "rides out longer outages (~3-5 KB a span)"
                )
            else:
                cause = (
                    "the backend is slower than the traffic or down: raise "
                    "OTEL_BSP_MAX_QUEUE_SIZE or lower the sampling ratio"
                )
            logger.warning(
                "journey-otel: the span export queue is full, spans are dropped (%d so far): %s",
                self.spans_dropped,
                cause,
            )
            self._dropped_reported = self.spans_dropped
            self._last_drop_report = now

    def settle(self) -> None:
        """At exit, after the final flush: whatever was built and neither exported
        nor failed was dropped (from a full queue, or left in it at the deadline).

        Exact, unlike the live count from the SDK's log records, which can be off
        by a span when the worker pops between the SDK's full check and its append.
        """
        if not self.exporting:
            return  # nothing was to be exported: nothing lost
        self.spans_dropped = max(0, self.spans_built - self.spans_exported - self.spans_failed)

    def summary(self) -> str:
        return (
            f"{self.journeys} journeys received, {self.spans_built} spans built, "
            f"{self.spans_exported} exported, {self.spans_failed} failed to export, "
            f"{self.spans_dropped} dropped from a full queue, "
            f"{self.engine_dropped} journeys dropped in the engine core, "
            f"{self.input_warnings} malformed client inputs ignored"
        )


class SdkLogGate(logging.Filter):
    """Turns the SDK's per-retry and per-drop log records into :class:`ExportHealth` counts."""

    def __init__(self, health: ExportHealth) -> None:
        super().__init__("vllm_journey_otel.health")
        self.health = health

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        if record.name in INPUT_LOGGERS:
            self.health.input_warnings += 1
            return logger.isEnabledFor(logging.DEBUG)
        message = record.getMessage()
        if message.startswith(_QUEUE_FULL_PREFIX):
            self.health.dropped()
        elif message.startswith(_FAILURE_PREFIXES):
            self.health.last_reason = message[:300]
        else:
            return True
        return logger.isEnabledFor(logging.DEBUG)

    def install(self) -> None:
        for name in (*SDK_LOGGERS, *INPUT_LOGGERS):
            sdk_logger = logging.getLogger(name)
            if self not in sdk_logger.filters:
                # First in line: the SDK's own DuplicateFilter passes one record of a
                # kind per 20 s, and we must see (count) every one.
                sdk_logger.filters.insert(0, self)

    def uninstall(self) -> None:
        for name in (*SDK_LOGGERS, *INPUT_LOGGERS):
            logging.getLogger(name).removeFilter(self)


def endpoint_of(exporter: SpanExporter) -> str:
    """What an SDK exporter sends to, for log messages."""
    endpoint = getattr(exporter, "_endpoint", None)
    return str(endpoint) if endpoint else type(exporter).__name__


class HealthExporter(SpanExporter):
    """Wraps an SDK exporter: counts exported and failed spans, never raises."""

    def __init__(self, inner: SpanExporter, health: ExportHealth) -> None:
        self.inner = inner
        self.health = health
        health.exporting = True
        self.endpoint = endpoint_of(inner)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        n = len(spans)
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # the SDK's exporters should not raise; others may
            self.health.last_reason = f"{type(exc).__name__}: {exc}"[:300]
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.health.exported(n, self.endpoint)
        else:
            self.health.failed(n, self.endpoint)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)
