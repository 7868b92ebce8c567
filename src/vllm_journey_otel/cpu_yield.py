"""Our threads yield the CPU to vLLM's: the lowest CPU priority a thread may take.

Shared by both roles: the engine core's threads of ours (the pipeline's drain
thread; in ``thread`` mode the export stage's) and the exporter process's main
thread (whose later threads inherit it) lower their own priority with
:func:`lower_priority`, once when each starts. Where each role places itself on
the CPUs is its own: ``export/cpu_placement.py`` (the exporter, off the CPUs
vLLM binds) and ``engine/exporter_launch.py`` (which process trees it tells the
exporter to look at).

A priority is not enough where vLLM waits by spinning: its shared-memory
message queues (``vllm/distributed/device_communicators/shm_broadcast.py``,
0.30-0.33) wait with ``sched_yield()`` for a second after each message (the
engine core for its workers' output, a worker for the next step), and on an
EEVDF kernel (Linux 6.6 and later) each such yield hands the CPU to whatever
else is runnable there, at any priority, until that task blocks or the next
tick ends its slice: the waiting thread learns of its message up to a tick
late. So the threads of ours that work through a backlog (the exporter's span
building and export, in ``thread`` mode the drain thread's) give the CPU back
themselves: a :class:`Pacer` calls ``sched_yield()`` once per
``YIELD_EVERY_NS`` of work, which costs a system call where nothing else is
runnable and returns the CPU at once to a spinning thread of vLLM's
(docs/performance.md, "vLLM's spin-waits and the exporter";
``benchmarks/yield_handover.py``).

Nothing here needs a privilege: a thread may always lower its own priority
(SCHED_IDLE where the kernel allows it, nice 19 otherwise). Clock of the
pacer: ``time.monotonic_ns()`` (its intervals only).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from vllm_journey_otel.config import CPU_PRIORITY, PRIORITY_IDLE, PRIORITY_NORMAL

NICEST = 19

# Work between two offers of the CPU: what a spinning thread of vLLM's waits at
# most for a CPU we hold, besides the unit of work in progress (a journey's
# spans, a batch's send). A yield costs about a microsecond where nothing else
# waits for the CPU: 1 to 2 % of the work at this interval.
YIELD_EVERY_NS = 50_000


class Pacer:
    """A thread's offer of its CPU, once per ``every_ns`` of work (wall time).

    Call :meth:`restart` when the thread starts a run of work (after a wait:
    a blocked thread gave the CPU back already) and call the pacer between two
    units of work. One pacer per thread; ``clock`` and ``give`` are for tests.
    """

    __slots__ = ("_clock", "_due_mono_ns", "_every_ns", "_give", "yields")

    def __init__(
        self,
        every_ns: int = YIELD_EVERY_NS,
        clock: Callable[[], int] = time.monotonic_ns,
        give: Callable[[], None] = os.sched_yield,
    ) -> None:
        self._every_ns = every_ns
        self._clock = clock
        self._give = give
        self._due_mono_ns = clock() + every_ns
        self.yields = 0  # offers made, in all (tests and benchmarks)

    def restart(self) -> None:
        """A run of work begins: the interval counts from now."""
        self._due_mono_ns = self._clock() + self._every_ns

    def __call__(self) -> None:
        """Between two units of work: offer the CPU once the interval is up.
        ``os.sched_yield`` releases the GIL (CPython 3.11.1 and later, which
        vLLM's own spin-wait relies on too) and does not sleep: with nothing
        else runnable on this CPU it returns at once."""
        if self._clock() >= self._due_mono_ns:
            self._give()
            self.yields += 1
            self._due_mono_ns = self._clock() + self._every_ns


def lower_priority(setting: str, shares_gil: bool = False) -> str:
    """Lower the calling thread's CPU priority (Linux: threads started from it
    inherit it); returns what was applied, for the log. Never raises.

    ``shares_gil``: a thread of ours inside vLLM's engine core, sharing its GIL.
    It gets nice 19, not SCHED_IDLE: a SCHED_IDLE thread preempted while it
    holds the GIL runs again only when a CPU has nothing else to do, and the
    engine thread waiting for that GIL would wait as long; at nice 19 it still
    gets its small share and lets the GIL go within the switch interval.
    """
    if setting == PRIORITY_NORMAL:
        return f"unchanged ({CPU_PRIORITY}={PRIORITY_NORMAL})"
    refused = ""
    if setting == PRIORITY_IDLE and shares_gil:
        refused = "nice, not SCHED_IDLE, for a thread sharing the engine core's GIL: "
    elif setting == PRIORITY_IDLE:
        idle = getattr(os, "SCHED_IDLE", None)
        if idle is None:
            refused = "SCHED_IDLE does not exist on this platform; "
        else:
            try:
                os.sched_setscheduler(0, idle, os.sched_param(0))
                return "SCHED_IDLE"
            except OSError as exc:
                refused = f"SCHED_IDLE refused ({exc.strerror}); "
    try:
        # PRIO_PROCESS with 0 is the calling thread on Linux.
        if os.getpriority(os.PRIO_PROCESS, 0) < NICEST:
            os.setpriority(os.PRIO_PROCESS, 0, NICEST)
        return f"{refused}nice {NICEST}"
    except (OSError, AttributeError) as exc:
        return f"{refused}nice refused ({exc}): priority unchanged"
