"""Where the exporter process runs: off the CPUs vLLM binds its threads to.

An observer must be the first to yield. vLLM's engine-core loop is one busy
thread per engine, and its CPU backend binds the model worker's threads to
cores of their own and busy-waits between steps: a slice of CPU that one of
our processes takes on those cores delays a step (docs/performance.md, "CPU
placement", shows what that cost).

Exporter process, main thread, first thing in ``main()``, before the process
starts any other thread, so every thread it starts later (the export stage's,
gRPC's) inherits both the priority (``VLLM_JOURNEY_OTEL_CPU_PRIORITY``: Linux
``SCHED_IDLE``, else nice 19; ``cpu_yield.py``) and the CPUs
(``VLLM_JOURNEY_OTEL_EXPORTER_CPUS``: by default every CPU it may use except
those vLLM's threads are bound to, read from the affinity of the threads of the
process trees the engine side named; where they are bound to all of them, the
CPUs it inherited from the thread that started it). A re-check thread follows bindings that
appear later (engine cores of other data-parallel ranks); its times are
``time.sleep`` seconds. What was applied, or refused, is said once in the log.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Sequence

from vllm_journey_otel.config import CPUS_ALL, CPUS_AUTO, EXPORTER_CPUS, parse_cpu_list
from vllm_journey_otel.cpu_yield import lower_priority
from vllm_journey_otel.log import logger

# After the first placement, the exporter looks at vLLM's bindings again after
# these many seconds, then every last one.
RECHECK_S = (5.0, 30.0, 60.0)


def format_cpus(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 5) -> ``"0-2,5"`` (Linux's cpulist format)."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    start = prev = -2
    for cpu in [*ordered, -2]:
        if cpu != prev + 1:
            if start >= 0:
                parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cpu
        prev = cpu
    return ",".join(parts)


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                text = f.read()
        except OSError:
            continue  # gone meanwhile
        ppid = int(text[text.rindex(b")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _is_vllm(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"vllm" in f.read()
    except OSError:
        return False


def _possible_cpus() -> Iterable[int]:
    """Every CPU id the kernel knows (``/sys/devices/system/cpu/possible``)."""
    try:
        with open("/sys/devices/system/cpu/possible") as f:
            cpus = parse_cpu_list(f.read().strip())
    except OSError:
        cpus = None
    return cpus or range(os.cpu_count() or 1)


def usable_cpus() -> set[int]:
    """The CPUs this process may be given, which what it inherited may not be:
    a vLLM started under ``taskset`` or ``numactl`` hands its narrower affinity
    to every child. Asked of the kernel itself: ``sched_setaffinity`` to every
    CPU keeps those of the process's cpuset (cgroup v1 or v2, a container's or
    the host's) and drops the rest; the affinity is put back at once. Main
    thread, before any other thread starts (it sets the calling thread's only)."""
    own = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, _possible_cpus())
        usable = os.sched_getaffinity(0)
    except OSError:  # refused outright (a seccomp filter): what it inherited
        return set(own)
    finally:
        os.sched_setaffinity(0, own)
    return set(usable) | set(own)


def bound_cpus(roots: Sequence[int], allowed: set[int]) -> set[int]:
    """CPUs that a thread of ``roots`` or of their descendants is bound to: a
    thread allowed on fewer CPUs than ``allowed`` (what this process may use)
    was bound by someone, vLLM's CPU backend or its user (taskset, numactl)."""
    kids = _children()
    seen: set[int] = set()
    # pid 1 is a root only where it is vLLM itself (a container's entry point),
    # never a host's init, whose tree is every process of the machine.
    todo = [pid for pid in roots if pid > 1 or (pid == 1 and _is_vllm(1))]
    bound: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo.extend(kids.get(pid, ()))
        if pid == os.getpid():
            continue  # our own threads: the ones we pin would count as vLLM's
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                cpus = os.sched_getaffinity(tid) & allowed
            except OSError:
                continue
            if cpus and cpus != allowed:
                bound |= cpus
    return bound


def choose_cpus(
    setting: str | tuple[int, ...], allowed: set[int], bound: set[int], inherited: set[int]
) -> tuple[set[int] | None, str]:
    """The exporter's CPUs (None: leave them as inherited) and why, for the log."""
    if setting == CPUS_ALL:
        return None, f"its CPUs as inherited, {format_cpus(inherited)} ({EXPORTER_CPUS}={CPUS_ALL})"
    if isinstance(setting, tuple):
        wanted = set(setting) & allowed
        if not wanted:
            return set(allowed), (
                f"every CPU it may use, {format_cpus(allowed)}: none of {EXPORTER_CPUS}="
                f"{format_cpus(setting)} is allowed to this process"
            )
        return wanted, f"CPUs {format_cpus(wanted)} ({EXPORTER_CPUS})"
    if not bound:
        return set(allowed), f"every CPU it may use, {format_cpus(allowed)} (vLLM binds no thread)"
    rest = allowed - bound
    if not rest:
        # Every CPU carries a thread vLLM bound there. Spread over all of them,
        # an exporter thread can wait behind a model worker's busy-waiting
        # thread, where SCHED_IDLE gets next to nothing and its tiny weight
        # gives the load balancer no reason to move it; the CPUs it inherited
        # are those of a thread of its owner (the engine core or the API
        # server), whose idle moments it takes.
        return None, (
            f"its CPUs as inherited, {format_cpus(inherited)}: vLLM's threads are bound to "
            f"every CPU it may use, {format_cpus(allowed)}"
        )
    return rest, (
        f"CPUs {format_cpus(rest)}, off {format_cpus(bound)} where vLLM's threads are bound"
    )


def pin_this_process(cpus: set[int]) -> None:
    """Every thread of this process onto ``cpus`` (affinity is per thread on Linux)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            continue  # a thread that ended meanwhile


class ExporterPlacement:
    """The exporter process's priority and CPUs (exporter process, main thread;
    the re-check on a daemon thread of its own)."""

    def __init__(self, priority: str, cpus: str | tuple[int, ...], roots: Sequence[int]) -> None:
        self.priority = priority
        self.setting = cpus
        self.roots = list(roots)
        affinity = hasattr(os, "sched_getaffinity")
        # What it was started with: the CPUs of the thread that started it (the
        # owner's main thread, or its drain thread for a replacement).
        self.inherited: set[int] = set(os.sched_getaffinity(0)) if affinity else set()
        self.allowed: set[int] = usable_cpus() if affinity else set()
        self.current = self.inherited

    def _place(self) -> str:
        if not self.allowed:
            return "its CPUs unchanged (no CPU affinity on this platform)"
        bound = bound_cpus(self.roots, self.allowed) if self.setting == CPUS_AUTO else set()
        cpus, why = choose_cpus(self.setting, self.allowed, bound, self.inherited)
        target = self.inherited if cpus is None else cpus
        if target != self.current:
            pin_this_process(target)
            self.current = target
        return why

    def apply(self) -> str:
        """Priority and CPUs now; returns the log line's text. Never raises."""
        try:
            return f"CPU priority {lower_priority(self.priority)}; {self._place()}"
        except Exception as exc:  # placement must never stop the exporter
            return f"CPU placement failed ({exc!r}); running as inherited"

    def start_rechecks(self) -> None:
        """Follow vLLM's bindings as they appear (only with the automatic choice)."""
        if self.setting != CPUS_AUTO or not self.allowed:
            return
        threading.Thread(target=self._recheck, name="journey-otel-cpus", daemon=True).start()

    def _recheck(self) -> None:
        waits = iter(RECHECK_S)
        wait = next(waits)
        while True:
            time.sleep(wait)
            before = self.current
            try:
                why = self._place()
            except Exception:  # a /proc read that raced with a process's exit
                logger.debug("journey-otel exporter: CPU re-check failed", exc_info=True)
                continue
            if self.current != before:
                logger.info("journey-otel exporter: now on %s", why)
            wait = next(waits, wait)
