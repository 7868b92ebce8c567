"""Exporter-side backpressure: build spans only as fast as they are exported.

Process and thread: the exporter process's main thread (``exporter_process.py``),
between chunks of a frame; the counters it reads are written by the batch
processor's worker thread (:class:`~vllm_journey_otel.health.HealthExporter`) and
by this thread (spans built, queue-full drops). Clock: ``time.monotonic``.

Why: the main thread decodes frames and builds spans (~90 us per journey); the
SDK's BatchSpanProcessor worker encodes and exports them (~150 us per journey,
the same GIL). At full load the builder outran the worker, the span queue
overflowed, and the SDK dropped *single spans*: journeys arrived with holes (a
root without its decode span, children without their root) while the CPU spent
building the dropped spans was wasted (``benchmarks/export_bench.py``: ~20 % of
the spans lost at the capacity rate). Waiting for room instead backs a full load
up into the pipe and the engine core's bounded queue, which drop *whole
journeys*, counted on the roots as ``vllm.journey.tracer.dropped_journeys``,
only when they are full too. A backend that answers, only slowly, therefore
shows as engine-side drops too; this module says so in the exporter's log.

During an outage (an export failed and none succeeded since, or none completed
for ``STALL_S``) the main thread does not wait: the queue drops as before,
counted and reported by ``health.py``, and the engine core is never held up
by a backend that is down.

Only the first exporter's queue is watched when OTEL_TRACES_EXPORTER names
several (each has its own batch processor and queue).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping

from .config import EXPORTER_PROCESSES, logger
from .health import REPORT_PERIOD_S, ExportHealth
from .journey import FinishedJourney, Record

# The SDK's defaults when OTEL_BSP_MAX_QUEUE_SIZE / _MAX_EXPORT_BATCH_SIZE are
# unset or invalid.
SDK_MAX_QUEUE = 2048
SDK_MAX_BATCH = 512
# Spans a chunk may bring at least, even into a queue barely larger than a batch.
MIN_CHUNK_SPANS = 16
# And at most (about 64 journeys): building in small chunks interleaves with the
# worker's export more finely; whole frames as chunks measured ~3 % more CPU per
# journey (benchmarks/export_bench.py, three alternating runs each).
MAX_CHUNK_SPANS = 384
# No export finished (success or failure) for this long while waiting: the
# exporter is stuck; stop waiting until one finishes.
STALL_S = 2.0
POLL_S = 0.002


def _positive(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        value = int(env.get(name, ""))
    except ValueError:
        return default
    return value if value > 0 else default


def bsp_sizes(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """The batch processor's (queue size, export batch size), read from
    OTEL_BSP_MAX_QUEUE_SIZE / OTEL_BSP_MAX_EXPORT_BATCH_SIZE as the SDK reads them."""
    env = os.environ if env is None else env
    queue = _positive(env, "OTEL_BSP_MAX_QUEUE_SIZE", SDK_MAX_QUEUE)
    batch = _positive(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", SDK_MAX_BATCH)
    return queue, min(batch, queue)


def spans_of(record: Record) -> int:
    """At most how many spans a record becomes (spans.py): a root and a queued
    span, and at most two per event (a cycle: scheduled and prefill); a step, one."""
    if isinstance(record, FinishedJourney):
        return 2 + 2 * len(record.events)
    return 1


class SpanQueueRoom:
    """Waits, before a chunk of journeys is built, until the span queue can take it.

    The SDK's worker exports when the queue holds a full batch (or every
    OTEL_BSP_SCHEDULE_DELAY): the backlog is allowed to reach that, or export
    would only run on the timer. A chunk brings at most ``budget`` spans: what
    is left of the queue above one batch, and no more than ``MAX_CHUNK_SPANS``.
    """

    def __init__(
        self,
        health: ExportHealth,
        max_queue: int,
        batch: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.health = health
        self.max_queue = max(1, max_queue)
        self.wake = max(1, min(batch, self.max_queue))
        self.budget = max(MIN_CHUNK_SPANS, min(MAX_CHUNK_SPANS, self.max_queue - self.wake))
        self._clock = clock
        self._sleep = sleep
        self._stopping = stopping
        # Progress count (exported + failed) at which waiting was given up as
        # stuck: no waiting again until it moves.
        self._stuck_at: int | None = None
        self.waited_s = 0.0
        self.stalls = 0
        self._reported_waited_s = 0.0
        self._last_report = -REPORT_PERIOD_S

    def _progress(self) -> int:
        return self.health.spans_exported + self.health.spans_failed

    def wait(self, spans: int) -> None:
        """Return once ``spans`` more spans fit in the queue, export is down or
        stuck, or the process is stopping; never raises."""
        health = self.health
        if not health.exporting or health.in_outage:
            return
        # The queue and one batch in flight hold no more than this: anything
        # above was dropped by an SDK whose drop record the log gate did not
        # recognise (older SDKs word it differently). Count it, or the backlog
        # would stay inflated and every chunk wait for nothing.
        excess = health.backlog - (self.max_queue + self.wake)
        if excess > 0:
            health.spans_dropped += excess
        limit = max(self.max_queue - spans, self.wake)
        if health.backlog <= limit:
            return
        progress = self._progress()
        if self._stuck_at is not None:
            if progress == self._stuck_at:
                return
            self._stuck_at = None
        clock = self._clock
        began = last_move = clock()
        try:
            while health.backlog > limit and not health.in_outage and not self._stopping():
                self._sleep(POLL_S)
                now = clock()
                moved = self._progress()
                if moved != progress:
                    progress, last_move = moved, now
                elif now - last_move >= STALL_S:
                    self._stuck_at = progress
                    self.stalls += 1
                    return
        finally:
            now = clock()
            self.waited_s += now - began
            self._report(now)

    def _report(self, now: float) -> None:
        """A warning a minute at most while export is the bottleneck."""
        waited = self.waited_s - self._reported_waited_s
        if waited < 1.0 or now - self._last_report < REPORT_PERIOD_S:
            return
        logger.warning(
            "journey-otel exporter: export is slower than the traffic: waited %.1f s "
            "for room in the span queue (%.1f s in all); finished journeys back up "
            "into the engine core, which drops whole journeys when its queue is "
            "full. A faster or closer backend, more exporter processes (%s) if "
            "this process's CPU is the limit, or a lower sampling ratio",
            waited,
            self.waited_s,
            EXPORTER_PROCESSES,
        )
        self._reported_waited_s = self.waited_s
        self._last_report = now
