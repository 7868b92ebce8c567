"""The tracer's own health where spans are exported: counters, and few clear logs.

Process: the exporter process (``process`` mode) or the engine core (``thread``
mode). Threads: :meth:`ExportHealth.exported` and :meth:`ExportHealth.failed`
run on the export stage's thread (``export_stage.py``), with the counts of each
``SpanExportResult``; :meth:`ExportHealth.backed_up` and the span counts on the
thread that builds spans. Each counter has one writer; readers may see a
slightly stale value, which is fine for a health report. Clock:
``time.monotonic()``.

Every count comes from what the export stage saw (results, spans handed to it),
never from log text. The SDK's exporters log every retry of a failing export
("Transient error ... retrying"), which during an outage would write thousands
of lines into vLLM's log: :class:`SdkLogQuieter` demotes those records to debug
and keeps the last one's text as the *reason* our own single warning gives
(the SDK offers no other way to learn why an export failed: its
``SpanExportResult`` carries none; opentelemetry-sdk 1.45). The health then says
once that export fails, with that reason, every minute how much is lost while it
lasts, and once that it works again.
"""

from __future__ import annotations

import logging
import time

from vllm_journey_otel.log import logger

# Loggers of the SDK's OTLP exporters (logger names, opentelemetry-sdk 1.3x-1.45).
SDK_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
)
# Loggers that warn about what clients sent (a malformed tracestate, an id longer
# than the attribute limit): one line per request, nothing an operator can fix.
# Demoted to debug, counted.
INPUT_LOGGERS = ("opentelemetry.trace.span", "opentelemetry.attributes")
_FAILURE_PREFIXES = ("Transient error", "Failed to export", "Dropping span batch")
# While export keeps failing (or stays slower than the traffic), one report a minute.
REPORT_PERIOD_S = 60.0


class ExportHealth:
    """Counters of one exporting process; ``lost_spans`` is what never left it."""

    def __init__(self, report_period_s: float = REPORT_PERIOD_S) -> None:
        self.journeys = 0
        self.spans_built = 0
        self.spans_exported = 0
        self.spans_failed = 0
        self.spans_left = 0  # still unexported when the final flush's deadline passed
        self.engine_dropped = 0  # latest count the engine core reported with a batch
        self.last_reason = ""
        self.exporting = False  # an export stage reports here (not OTEL_TRACES_EXPORTER=none)
        self.input_warnings = 0  # the SDK's complaints about client input, demoted
        self._period_s = report_period_s
        self._outage_since: float | None = None
        self._failed_at_outage = 0
        self._last_failure_report = 0.0
        self._waited_s = 0.0  # the span builder waited for the stage, since the last report
        self._last_wait_report = -report_period_s

    @property
    def lost_spans(self) -> int:
        """Spans built here that did not reach the backend."""
        return self.spans_failed + self.spans_left

    @property
    def in_outage(self) -> bool:
        """An export failed and none has succeeded since."""
        return self._outage_since is not None

    # -- export results (the export stage's thread, "journey-otel-export") ----
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

    # -- backpressure (thread that builds spans) -----------------------------
    def backed_up(self, waited_s: float) -> None:
        """The span builder waited ``waited_s`` for the export stage to take more."""
        self._waited_s += waited_s
        now = time.monotonic()
        if self._waited_s >= 1.0 and now - self._last_wait_report >= self._period_s:
            logger.warning(
                "journey-otel exporter: export is slower than the traffic (waited %.1f s for "
                "the backend since the last report); the excess waits in the pipe and the "
                "engine core's queue, which drops whole journeys when full (counted)",
                self._waited_s,
            )
            self._waited_s = 0.0
            self._last_wait_report = now

    def settle(self) -> None:
        """At exit, after the final flush: what was built and neither exported nor
        failed was still waiting when the deadline passed."""
        if not self.exporting:
            return  # nothing was to be exported: nothing lost
        self.spans_left = max(0, self.spans_built - self.spans_exported - self.spans_failed)

    def summary(self) -> str:
        return (
            f"{self.journeys} journeys received, {self.spans_built} spans built, "
            f"{self.spans_exported} exported, {self.spans_failed} failed to export, "
            f"{self.spans_left} left unexported at exit, "
            f"{self.engine_dropped} journeys dropped in the engine core, "
            f"{self.input_warnings} malformed client inputs ignored"
        )


class SdkLogQuieter(logging.Filter):
    """Demotes the SDK's per-retry export records to debug, keeping the last
    one's text as the reason of our own warning; counts (and demotes) the SDK's
    complaints about client input (a malformed ``tracestate``)."""

    def __init__(self, health: ExportHealth) -> None:
        super().__init__("vllm_journey_otel.export.health")
        self.health = health

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        if record.name in INPUT_LOGGERS:
            self.health.input_warnings += 1
            return logger.isEnabledFor(logging.DEBUG)
        message = record.getMessage()
        if not message.startswith(_FAILURE_PREFIXES):
            return True
        self.health.last_reason = message[:300]
        return logger.isEnabledFor(logging.DEBUG)

    def install(self) -> None:
        for name in (*SDK_LOGGERS, *INPUT_LOGGERS):
            sdk_logger = logging.getLogger(name)
            if self not in sdk_logger.filters:
                # First in line: the SDK's own DuplicateFilter passes one record of a
                # kind per 20 s, and the reason must be the latest.
                sdk_logger.filters.insert(0, self)

    def uninstall(self) -> None:
        for name in (*SDK_LOGGERS, *INPUT_LOGGERS):
            logging.getLogger(name).removeFilter(self)
