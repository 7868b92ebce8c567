"""Whether the exporter falls behind for want of CPU: said in its log, with what to change.

Where: the exporter process's main thread (span building, most of its work),
between two frames. Clocks: ``time.monotonic()`` for the report's period; the
kernel's counters of this thread (``/proc/thread-self/schedstat``: ns on a CPU
and ns runnable, waiting for one) are CPU-time counters, compared with each
other only.

The exporter runs at ``SCHED_IDLE`` (``cpu_yield.py``): where vLLM's processes
keep its CPUs busy it gets only their idle moments and the time vLLM's
spin-waits give away, and falls behind. The owner then says its queue grows or
drops journeys, and cannot tell a starved exporter from a slow backend (whose
case the export stage says itself, ``health.ExportHealth.backed_up``). This
process can: its thread waited for a CPU for half the time or more, longer
than it ran, while its owner held a backlog or dropped journeys and the
backend kept up. More exporter processes would share the
same busy CPUs; a CPU vLLM does not use, or fewer journeys, helps.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from vllm_journey_otel.config import EXPORTER_CPUS, SAMPLER_ARG
from vllm_journey_otel.export.health import REPORT_PERIOD_S
from vllm_journey_otel.wire import BEHIND_SHARE

SCHEDSTAT = "/proc/thread-self/schedstat"


def thread_schedstat(path: str = SCHEDSTAT) -> tuple[int, int] | None:
    """(ns on a CPU, ns runnable and waiting for one) of the calling thread;
    None where the kernel does not keep them."""
    try:
        with open(path) as f:
            run_ns, wait_ns, *_ = (int(part) for part in f.read().split())
    except (OSError, ValueError):
        return None
    return run_ns, wait_ns


class CpuShareWatch:
    """At most once per ``period_s``: a warning when this thread spent half the
    period or more runnable but waiting for a CPU, longer than it ran, while
    its owner was behind (``held`` past ``BEHIND_SHARE`` of ``queue_size``, or
    new drops) and the backend was not what it waited for (the export stage's
    backpressure, ``waited_s``, did not grow by a second or more: a slow
    backend is said by ``health.ExportHealth.backed_up``).

    ``held`` is the count the owner stores on its first exporter's counter
    (``engine/pipe_sink.py``); other exporters of an owner with several see its
    drops only.
    """

    def __init__(
        self,
        queue_size: int,
        period_s: float = REPORT_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
        read: Callable[[], tuple[int, int] | None] = thread_schedstat,
    ) -> None:
        self._behind = max(1, int(queue_size * BEHIND_SHARE))
        self._period_s = period_s
        self._clock = clock
        self._read = read
        self._since_mono_s = clock()
        self._stat = read()
        # The owner's drops and the stage's backpressure at the period's start;
        # None until the first frame (a replacement exporter's first frame
        # carries every drop of its owner's life).
        self._dropped: int | None = None
        self._waited_s = 0.0
        self._held_max = 0
        self.reports = 0

    def check(self, held: int, dropped: int, waited_s: float = 0.0) -> str | None:
        """Between two frames: ``held``, the finished journeys the owner holds
        (``wire.Acks``); ``dropped``, what it dropped so far; ``waited_s``, the
        export stage's backpressure so far. The warning to log, or None."""
        if self._dropped is None:
            self._dropped, self._waited_s = dropped, waited_s
        self._held_max = max(self._held_max, held)
        now_mono_s = self._clock()
        seconds = now_mono_s - self._since_mono_s
        if seconds < self._period_s or self._stat is None:
            return None
        stat = self._read()
        if stat is None:
            self._stat = None  # no schedstat here: nothing more to say
            return None
        run_ns, wait_ns = stat[0] - self._stat[0], stat[1] - self._stat[1]
        new_drops, held_max = dropped - self._dropped, self._held_max
        backend_s = waited_s - self._waited_s
        self._since_mono_s, self._stat, self._held_max = now_mono_s, stat, held
        self._dropped, self._waited_s = dropped, waited_s
        starved = wait_ns > run_ns and wait_ns >= seconds * 1e9 / 2
        behind = held_max >= self._behind or new_drops > 0
        if not (starved and behind) or backend_s >= 1.0:
            return None
        self.reports += 1
        return (
            f"journey-otel exporter: short of CPU: in the last {seconds:.0f} s its span "
            f"building waited {wait_ns / 1e9:.1f} s for a CPU and ran {run_ns / 1e9:.1f} s, "
            f"while its owner held up to {held_max} finished journeys and dropped "
            f"{max(0, new_drops)}: vLLM's processes keep its CPUs busy. Give it a CPU they do "
            f"not use ({EXPORTER_CPUS}), or lower the sampling ratio ({SAMPLER_ARG}); "
            f"more exporter processes would share the same CPUs"
        )
