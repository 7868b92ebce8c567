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
only when they are full too.

During an outage (an export failed and none succeeded since, or none completed
for ``STALL_S``) the main thread does not wait: the queue drops as before,
counted and reported by ``health.py``, and the engine core is never held up
by a backend.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping

from .health import ExportHealth

# The SDK's default when OTEL_BSP_MAX_QUEUE_SIZE is unset or invalid.
SDK_MAX_QUEUE = 2048
# Room asked per journey: 5 spans, 4 more per preemption; few have more, and
# asking too much only waits a little longer.
SPANS_PER_JOURNEY = 16
# Journeys built between two checks at most (a drained backlog can make a frame
# large); fewer when the queue is small (SpanQueueRoom.chunk).
CHUNK_JOURNEYS = 64
# No export finished (success or failure) for this long while waiting: the
# exporter is stuck; stop waiting until one finishes.
STALL_S = 2.0
POLL_S = 0.002


def max_queue_size(env: Mapping[str, str] | None = None) -> int:
    """The batch processor's queue size, as the SDK reads it from OTEL_BSP_MAX_QUEUE_SIZE."""
    env = os.environ if env is None else env
    try:
        size = int(env.get("OTEL_BSP_MAX_QUEUE_SIZE", ""))
    except ValueError:
        return SDK_MAX_QUEUE
    return size if size > 0 else SDK_MAX_QUEUE


class SpanQueueRoom:
    """Waits, before a chunk of journeys is built, until the span queue can take it."""

    def __init__(
        self,
        health: ExportHealth,
        max_queue: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.health = health
        self.max_queue = max(1, max_queue)
        # Journeys per chunk: their spans must fit in half the queue, or a chunk
        # would overflow it however long we waited before building it.
        self.chunk = max(1, min(CHUNK_JOURNEYS, self.max_queue // 2 // SPANS_PER_JOURNEY))
        self._clock = clock
        self._sleep = sleep
        # Progress count (exported + failed) at which waiting was given up as
        # stuck: no waiting again until it moves.
        self._stuck_at: int | None = None
        self.waited_s = 0.0
        self.stalls = 0

    def _progress(self) -> int:
        return self.health.spans_exported + self.health.spans_failed

    def wait(self, journeys: int) -> None:
        """Return once ``journeys`` more journeys' spans fit in the queue, export
        is down, or export is stuck; never raises."""
        health = self.health
        if not health.exporting or health.in_outage:
            return
        need = min(journeys * SPANS_PER_JOURNEY, self.max_queue // 2)
        limit = self.max_queue - need
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
            while health.backlog > limit and not health.in_outage:
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
            self.waited_s += clock() - began
