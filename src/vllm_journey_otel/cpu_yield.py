"""Our threads yield the CPU to vLLM's: the lowest CPU priority a thread may take.

Shared by both roles: the engine core's threads of ours (the pipeline's drain
thread; in ``thread`` mode the export stage's) and the exporter process's main
thread (whose later threads inherit it) lower their own priority with
:func:`lower_priority`, once when each starts. Where each role places itself on
the CPUs is its own: ``export/cpu_placement.py`` (the exporter, off the CPUs
vLLM binds) and ``engine/exporter_launch.py`` (which process trees it tells the
exporter to look at).

A priority is not enough where vLLM gives its CPU away itself (its spin-waits
on ``sched_yield()``): the exporter's threads also give it back between two
units of work (``export/cpu_pacing.py``).

Nothing here needs a privilege: a thread may always lower its own priority
(SCHED_IDLE where the kernel allows it, nice 19 otherwise). No timestamps.
"""

from __future__ import annotations

import os

from vllm_journey_otel.config import CPU_PRIORITY, PRIORITY_IDLE, PRIORITY_NORMAL

NICEST = 19


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
