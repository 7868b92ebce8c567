"""The export stage: spans in, batches out through the SDK's own exporters.

Where: spans are added by the exporter process's main thread (or, in ``thread``
mode, by the engine core's drain thread); batches are exported on the stage's
own thread, "journey-otel-export". Times are ``time.monotonic()`` seconds.

This replaces the SDK's BatchSpanProcessor, whose queue drops single spans when
it is full (journeys with holes) and whose ``force_flush`` ignores its timeout:

* **Backpressure, not holes.** At most ``max_pending`` spans wait (by default
  two batches) besides the batch being exported. :meth:`add` blocks while that
  is full, so the exporter process stops reading its pipe, the pipe fills, and
  the engine core drops *whole journeys* (counted on the roots) once its own
  bounded queue is full too: the pipe is the queue. A slow or failing backend
  backs up the same way; nothing is dropped inside the stage.
* **Batches** of at most ``max_batch`` spans leave when full or when their
  oldest span waited ``delay_s``, or at a flush.
* **Results** come from each ``SpanExporter.export``'s :class:`SpanExportResult`
  (an exception counts as a failure), into :class:`~.health.ExportHealth`; the
  first exporter's results are the health counts (others, from
  ``OTEL_TRACES_EXPORTER=a,b``, are exported to and not counted).
* **Deadlines**: :meth:`flush` and :meth:`shutdown` return at their deadline
  whatever an exporter does; an export already under way finishes on the
  stage's thread (the SDK's exporters bound it by their own timeout).

``threaded=False`` exports each :meth:`add` at once on the caller's thread
(tests with an in-memory exporter).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from vllm_journey_otel.config import Config
from vllm_journey_otel.cpu_yield import lower_priority
from vllm_journey_otel.export.cpu_pacing import Pacer
from vllm_journey_otel.export.health import ExportHealth
from vllm_journey_otel.log import logger


class ExportStage:
    """Batching and export of ReadableSpans (see the module docstring)."""

    def __init__(
        self,
        exporters: Sequence[SpanExporter],
        health: ExportHealth,
        max_batch: int = 2048,
        delay_s: float = 0.5,
        max_pending: int | None = None,
        threaded: bool = True,
        endpoint: str = "",
        cpu_priority: str = Config.cpu_priority,
        shares_gil: bool = False,
    ) -> None:
        self.exporters = list(exporters)
        self.health = health
        health.exporting = bool(self.exporters)
        self.max_batch = max(1, max_batch)
        self.delay_s = max(0.0, delay_s)
        self.max_pending = max(self.max_batch, max_pending or 2 * self.max_batch)
        self.endpoint = endpoint or (type(self.exporters[0]).__name__ if self.exporters else "")
        self._cond = threading.Condition()
        self._pending: list[ReadableSpan] = []
        self._oldest = 0.0  # when the first pending span was added
        self._added = 0  # spans added, in all
        self._done = 0  # spans exported or failed, in all
        # Told the count of spans through an export (exported or failed), in the
        # order they were added, after each export, on the thread that exported.
        self.on_exported: Callable[[int], None] | None = None
        self._through = 0
        self._flush_to = 0  # export everything up to this count now
        self._stopping = False
        self.waited_s = 0.0  # add() waiting for room, in all: export is the bottleneck
        self._cpu_priority = cpu_priority
        self._shares_gil = shares_gil  # thread mode: the engine core's GIL
        self._waiting = 0  # add() calls waiting for room: a batch is due at once
        self._dead = False  # the stage's thread ended: export inline from then on
        # The stage's thread offers its CPU between two sends (cpu_pacing.py).
        self.pace = Pacer()
        self._thread: threading.Thread | None = None
        if threaded and self.exporters:
            self._thread = threading.Thread(
                target=self._run, name="journey-otel-export", daemon=True
            )
            self._thread.start()

    # -- the adding thread ----------------------------------------------------
    def add(
        self,
        spans: Sequence[ReadableSpan],
        stop: Callable[[], bool] | None = None,
        deadline: float | None = None,
    ) -> None:
        """Queue ``spans`` for export; blocks while the stage is full (backpressure).

        ``stop`` returning True (the exporter's SIGTERM), or ``deadline``
        (``time.monotonic()``: a flush at the engine core's shutdown in thread
        mode) passed: no more waiting, the spans are queued over the bound.
        """
        if not spans:
            return
        if not self.exporters:  # OTEL_TRACES_EXPORTER=none: recorded, not exported
            self._through += len(spans)  # and through: nothing more happens to them
            self._tell_exported()
            return
        if self._thread is None or self._dead:
            self._export(spans)
            return
        with self._cond:
            if len(self._pending) + len(spans) > self.max_pending and self._pending:
                began = time.monotonic()
                self._waiting += 1
                self._cond.notify_all()  # what is pending is due now
                try:
                    while (
                        self._pending
                        and len(self._pending) + len(spans) > self.max_pending
                        and not self._stopping
                        and not self._dead
                        and not (stop is not None and stop())
                        and not (deadline is not None and time.monotonic() >= deadline)
                    ):
                        self._cond.wait(0.25)  # a SIGTERM is noticed within this
                finally:
                    self._waiting -= 1
                waited = time.monotonic() - began
                self.waited_s += waited
                self.health.backed_up(waited)
            first = not self._pending
            if first:
                self._oldest = time.monotonic()
            self._pending.extend(spans)
            self._added += len(spans)
            if first or len(self._pending) >= self.max_batch:
                self._cond.notify_all()  # a batch's delay starts, or a batch is full

    # -- the stage's thread ---------------------------------------------------
    def _due(self, now: float) -> bool:
        pending = self._pending
        return bool(pending) and (
            len(pending) >= self.max_batch
            or now - self._oldest >= self.delay_s
            or self._flush_to > self._done
            or self._waiting > 0
            or self._stopping
        )

    def _run(self) -> None:
        # In thread mode this is a thread of ours in vLLM's engine core: it
        # yields first (cpu_yield.py); in the exporter process it inherited that.
        lower_priority(self._cpu_priority, shares_gil=self._shares_gil)
        try:
            self._loop()
        except Exception:  # never leave add() waiting on a thread that is gone
            logger.warning(
                "journey-otel: the export thread failed; exporting inline", exc_info=True
            )
        finally:
            with self._cond:
                self._dead = True
                self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._due(now := time.monotonic()):
                    if self._stopping and not self._pending:
                        return
                    wait = self._oldest + self.delay_s - now if self._pending else None
                    self._cond.wait(wait)
                    self.pace.restart()
                batch = self._pending[: self.max_batch]
                del self._pending[: self.max_batch]
                if not self._pending:
                    self._oldest = time.monotonic()  # the next span starts a new delay
                self._cond.notify_all()  # room for add()
            self.pace()  # between two sends; a wait above restarts the interval
            self._export(batch)
            with self._cond:
                self._done += len(batch)
                self._cond.notify_all()

    def _export(self, batch: Sequence[ReadableSpan]) -> None:
        for i, exporter in enumerate(self.exporters):
            try:
                result = exporter.export(batch)
            except Exception as exc:  # the SDK's exporters do not raise; others may
                self.health.last_reason = f"{type(exc).__name__}: {exc}"[:300]
                result = SpanExportResult.FAILURE
            if i == 0:
                if result is SpanExportResult.SUCCESS:
                    self.health.exported(len(batch), self.endpoint)
                else:
                    self.health.failed(len(batch), self.endpoint)
        self._through += len(batch)
        self._tell_exported()

    def _tell_exported(self) -> None:
        if self.on_exported is not None:
            try:
                self.on_exported(self._through)
            except Exception:  # accounting must never stop the export
                logger.debug("journey-otel: export accounting failed", exc_info=True)

    # -- any thread -------------------------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """Export everything added so far within ``timeout_s``; True when done."""
        if self._thread is None:
            return True
        if self._dead:  # export what the thread left, here
            with self._cond:
                batch, self._pending = self._pending, []
            if batch:
                self._export(batch)
            return True
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            target = self._added
            self._flush_to = max(self._flush_to, target)
            self._cond.notify_all()
            while self._done < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    @property
    def backlog(self) -> int:
        """Spans added and not yet exported or failed."""
        return self._added - self._done

    def shutdown(self, timeout_s: float) -> bool:
        """Flush within ``timeout_s``, stop the thread, shut the exporters down
        (on a thread of their own, waited for until the deadline); True when
        everything was exported or failed in time."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        done = self.flush(timeout_s)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))

        def close() -> None:
            for exporter in self.exporters:
                try:
                    exporter.shutdown()
                except Exception:
                    logger.debug("journey-otel: exporter shutdown failed", exc_info=True)

        closer = threading.Thread(target=close, name="journey-otel-close", daemon=True)
        closer.start()
        closer.join(max(0.0, deadline - time.monotonic()))
        return done
