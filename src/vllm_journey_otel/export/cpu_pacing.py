"""The exporter's threads give their CPU back to a spinning thread of vLLM's.

Where: the exporter process's main thread (span building) and its export
thread (``export_stage.py``); in ``thread`` mode the engine core's drain thread
and the stage's thread. Clock: ``time.monotonic_ns()``, its intervals only.

vLLM's shared-memory message queues (``MessageQueue`` of its
``device_communicators.shm_broadcast``, 0.30-0.33) wait with ``sched_yield()``
for a second after each message (the engine core for its workers' output, a
worker for the next step). On an EEVDF kernel (Linux 6.6 and later) each such yield hands the CPU to
whatever else is runnable there, at any priority, ``SCHED_IDLE`` included
(``cpu_yield.py``), until that task blocks or the next tick ends its slice: the
waiting thread of vLLM's learns of its message up to a tick late. So the
threads of ours that work through a backlog give the CPU back themselves: a
:class:`Pacer` calls ``sched_yield()`` once per ``YIELD_EVERY_NS`` of work,
which costs a system call where nothing else is runnable and returns the CPU
at once to a spinning thread of vLLM's (docs/performance.md, "vLLM's
spin-waits and the exporter"; ``benchmarks/yield_handover.py``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

# Work between two offers of the CPU: what a spinning thread of vLLM's waits at
# most for a CPU we hold, besides the unit of work in progress (a journey's
# spans, a batch's send). Where nothing else wants the CPU a yield is a system
# call; the exporter's CPU per journey alone on its CPU did not move measurably
# (docs/performance.md, "vLLM's spin-waits and the exporter").
YIELD_EVERY_NS = 50_000


def _sleep_zero() -> None:
    time.sleep(0)


# os.sched_yield releases the GIL from CPython 3.11.1 on; before, a yield would
# keep it (in ``thread`` mode, from the engine thread): there, as vLLM's own
# spin-wait does (vllm.distributed.utils.sched_yield), a zero sleep instead.
GIVE: Callable[[], None] = os.sched_yield if sys.version_info >= (3, 11, 1) else _sleep_zero


class Pacer:
    """A thread's offer of its CPU, once per ``every_ns`` of work (wall time).

    Call the pacer between two units of work, and :meth:`restart` after a
    wait of the thread's own (a thread that blocked gave the CPU back). One
    pacer per thread; ``clock`` and ``give`` are for tests.
    """

    __slots__ = ("_clock", "_due_mono_ns", "_every_ns", "_give", "yields")

    def __init__(
        self,
        every_ns: int = YIELD_EVERY_NS,
        clock: Callable[[], int] = time.monotonic_ns,
        give: Callable[[], None] = GIVE,
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
        ``sched_yield`` does not sleep: with nothing else runnable on this CPU
        it returns at once."""
        if self._clock() >= self._due_mono_ns:
            self._give()
            self.yields += 1
            self._due_mono_ns = self._clock() + self._every_ns
