"""An exporter behind for want of CPU says so (export/cpu_share.py): the rule
with its own clock and counters, then the kernel's counters of a real thread
at SCHED_IDLE beside a real busy process on its CPU, and alone."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from vllm_journey_otel.config import EXPORTER_CPUS, SAMPLER_ARG
from vllm_journey_otel.export.cpu_share import CpuShareWatch, thread_schedstat

S = 1_000_000_000


class Counters:
    """The clock and the thread's (run, wait) ns, set by the test."""

    def __init__(self) -> None:
        self.now = 0.0
        self.stat: tuple[int, int] | None = (0, 0)

    def watch(self, queue_size: int = 1000) -> CpuShareWatch:
        return CpuShareWatch(queue_size, 60.0, lambda: self.now, lambda: self.stat)


def test_starved_while_the_owner_is_behind_is_said_once_a_period() -> None:
    c = Counters()
    watch = c.watch()
    c.now, c.stat = 30.0, (1 * S, 20 * S)
    assert watch.check(held=900, dropped=0) is None  # not a period yet
    c.now, c.stat = 61.0, (2 * S, 45 * S)
    note = watch.check(held=10, dropped=0)  # the most it held in the period counts
    assert note is not None
    assert "short of CPU: in the last 61 s its span building waited 45.0 s" in note
    assert "ran 2.0 s, while its owner held up to 900 finished journeys and dropped 0" in note
    assert EXPORTER_CPUS in note and SAMPLER_ARG in note
    assert watch.check(held=900, dropped=0) is None  # the next period starts now
    assert watch.reports == 1


def test_new_drops_alone_make_the_owner_behind() -> None:
    c = Counters()
    watch = c.watch()
    assert watch.check(held=0, dropped=0) is None
    c.now, c.stat = 60.0, (1 * S, 40 * S)
    note = watch.check(held=0, dropped=4000)
    assert note is not None and "dropped 4000" in note
    c.now, c.stat = 120.0, (2 * S, 80 * S)
    assert watch.check(held=0, dropped=4000) is None  # no new drop, nothing held


def test_a_replacement_exporters_first_frame_is_its_baseline() -> None:
    c = Counters()
    watch = c.watch()
    c.now, c.stat = 60.0, (1 * S, 40 * S)
    # Its owner's drops of its whole life, before this exporter existed.
    assert watch.check(held=0, dropped=5000) is None
    c.now, c.stat = 120.0, (2 * S, 80 * S)
    note = watch.check(held=0, dropped=5100)
    assert note is not None and "dropped 100:" in note


def test_a_slow_backend_is_not_blamed_on_the_cpu() -> None:
    c = Counters()
    watch = c.watch()
    assert watch.check(held=0, dropped=0, waited_s=2.0) is None
    c.now, c.stat = 60.0, (1 * S, 50 * S)
    # The stage waited 5 s more for the backend: the export stage says that.
    assert watch.check(held=900, dropped=100, waited_s=7.0) is None
    c.now, c.stat = 120.0, (2 * S, 100 * S)
    assert watch.check(held=900, dropped=200, waited_s=7.5) is not None


@pytest.mark.parametrize(
    ("run_s", "wait_s", "held", "dropped", "why"),
    [
        (30, 10, 900, 100, "ran more than it waited: a slow backend or enough CPU"),
        (5, 20, 900, 100, "waited longer than it ran, for less than half the minute"),
        (1, 40, 249, 0, "waited, but its owner was not behind (below a quarter of 1000)"),
    ],
)
def test_nothing_to_say(run_s: int, wait_s: int, held: int, dropped: int, why: str) -> None:
    c = Counters()
    watch = c.watch()
    assert watch.check(0, 0) is None
    c.now, c.stat = 60.0, (run_s * S, wait_s * S)
    assert watch.check(held, dropped) is None, why


def test_without_the_kernels_counters_it_stays_silent() -> None:
    c = Counters()
    c.stat = None
    watch = c.watch()
    c.now = 600.0
    assert watch.check(held=10_000, dropped=10_000) is None
    assert thread_schedstat("/proc/thread-self/no-such-file") is None


def _watched_thread(cpu: int, seconds: float) -> list[str]:
    """A thread on ``cpu`` at SCHED_IDLE, busy for ``seconds`` while its owner
    is behind, its watch's period 0.5 s; what the watch said."""
    notes: list[str] = []

    def body() -> None:
        os.sched_setaffinity(0, {cpu})
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        watch = CpuShareWatch(queue_size=100, period_s=0.5)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sum(range(2000))  # a unit of work, then the check between two frames
            note = watch.check(held=100, dropped=0)
            if note:
                notes.append(note)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return notes


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="no schedstat")
def test_a_real_thread_starved_by_a_busy_process_on_its_cpu_is_told_apart() -> None:
    run0, wait0 = thread_schedstat() or (0, 0)
    sum(range(2_000_000))
    time.sleep(0.01)  # the kernel adds a running thread's time at its next switch
    run1, _ = thread_schedstat() or (0, 0)
    assert run1 > run0 >= 0 and wait0 >= 0  # the kernel's counters of this thread

    cpu = max(os.sched_getaffinity(0))
    busy = subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )
    try:
        starved = _watched_thread(cpu, 2.0)
    finally:
        busy.kill()
        busy.wait()
    assert starved and "short of CPU" in starved[0], starved
    # The same thread with its CPU to itself runs more than it waits: nothing said.
    assert _watched_thread(cpu, 1.2) == []
