"""Hand-off from the engine thread to the span-building thread.

The engine thread calls :meth:`JourneyPipeline.submit` with a finished journey:
one length check and one ``deque.append`` (atomic under the GIL), nothing else.
When the queue is full the journey is dropped and counted, never blocking the
engine. A daemon thread ("vllm-journey-otel") wakes every ``interval`` to drain
the queue, convert clocks, build spans and pass them to the SDK's span
processors (whose own BatchSpanProcessor thread does the network export).

Process: the engine-core process, created after fork/spawn. Thread-safety:
``submit`` is called by one thread (the engine thread); draining is serialised by
a lock so :meth:`flush` may be called from any thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from opentelemetry.sdk.trace import TracerProvider

from . import schema as S
from .clock import ClockAnchor
from .config import logger
from .journey import FinishedJourney
from .spans import emit_spans, parent_context, plan_spans

_DROP_LOG_PERIOD_S = 60.0


class JourneyPipeline:
    """Bounded queue of finished journeys plus the thread that turns them into spans."""

    def __init__(
        self,
        provider: TracerProvider,
        max_queue: int = 16384,
        interval_s: float = 0.1,
        clock: ClockAnchor | None = None,
        start_thread: bool = True,
    ) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer(S.SCOPE_NAME)
        self._queue: deque[FinishedJourney] = deque()
        self._max_queue = max_queue
        self._interval_s = interval_s
        self._clock = clock or ClockAnchor()
        self._drain_lock = threading.Lock()
        self._stop = threading.Event()
        # Counters. ``dropped`` is written by the engine thread only; the others
        # by whichever thread holds the drain lock.
        self.dropped = 0
        self.exported = 0
        self.failed = 0
        self._dropped_logged = 0
        self._last_drop_log = 0.0
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(target=self._run, name="vllm-journey-otel", daemon=True)
            self._thread.start()

    # -- engine thread -----------------------------------------------------
    def submit(self, journey: FinishedJourney) -> None:
        """Queue a finished journey (engine thread). O(1), never blocks, never raises."""
        if len(self._queue) >= self._max_queue:
            self.dropped += 1
            return
        self._queue.append(journey)

    # -- span-building thread ----------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.drain()

    def drain(self, deadline: float | None = None) -> int:
        """Build and hand to the SDK every queued journey; returns how many.

        ``deadline`` is a ``time.monotonic()`` value after which it stops early.
        """
        n = 0
        with self._drain_lock:
            while self._queue:
                if deadline is not None and time.monotonic() >= deadline:
                    break
                journey = self._queue.popleft()
                try:
                    anchor = self._clock.anchor
                    plan = plan_spans(journey, anchor.offset_ns, anchor.uncertainty_ns)
                    emit_spans(plan, self._tracer, parent_context(journey.trace_headers))
                    self.exported += 1
                except Exception:
                    self.failed += 1
                    if self.failed == 1:
                        logger.warning(
                            "journey-otel: could not build spans for a journey; "
                            "later failures are counted silently",
                            exc_info=True,
                        )
                n += 1
            self._report_drops()
        return n

    def _report_drops(self) -> None:
        dropped = self.dropped
        now = time.monotonic()
        if dropped > self._dropped_logged and now - self._last_drop_log >= _DROP_LOG_PERIOD_S:
            logger.warning(
                "journey-otel: %d finished journeys dropped so far (queue full at %d); "
                "raise VLLM_JOURNEY_OTEL_QUEUE_SIZE or lower the sampling ratio",
                dropped,
                self._max_queue,
            )
            self._dropped_logged = dropped
            self._last_drop_log = now

    # -- any thread --------------------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """Drain the queue and flush the SDK's processors within ``timeout_s``.

        Returns True if everything queued was exported in time.
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        self.drain(deadline)
        remaining_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
        ok = bool(self.provider.force_flush(remaining_ms)) if remaining_ms > 0 else False
        return ok and not self._queue

    def shutdown(self, timeout_s: float) -> bool:
        """Stop the thread, flush within ``timeout_s``, shut the provider down."""
        self._stop.set()
        ok = self.flush(timeout_s)
        if self._thread is not None:
            self._thread.join(timeout=0.1)
        self.provider.shutdown()
        return ok

    @property
    def queued(self) -> int:
        """Journeys waiting for the span-building thread."""
        return len(self._queue)
