"""serve_short.py --gc: the garbage collections of a `vllm serve`'s processes.

Imported by every Python process that has this folder on ``PYTHONPATH`` and
``VJO_GC_PROBE_OUT`` set (what ``serve_short.py --gc`` gives the servers it
starts: the API server, and the engine core and model worker that inherit its
environment). In each, on the thread that triggered a collection (in vLLM's
processes mostly the main thread): ``gc.callbacks`` note each collection's
start (``time.monotonic_ns()``, CLOCK_MONOTONIC: the benchmark's clock too),
its duration on that clock and in the thread's CPU time
(``time.thread_time_ns()``: a collection preempted by another process lasts
longer than it works), its generation and how many unreachable objects it
found (``collected``: cyclic garbage, freed by the collector). Appended to
``$VJO_GC_PROBE_OUT/<pid>.txt``, one ``start_mono_ns wall_ns cpu_ns generation
collected`` line per collection.

Lines are written at most a second after they were taken (a process that
vLLM ends with ``os._exit`` runs no exit hook) and at exit; a forked child
starts its own files. A benchmark tool, not part of the package.
"""

import atexit
import gc
import os
import time

_OUT = os.environ.get("VJO_GC_PROBE_OUT")
_FLUSH_NS = 1_000_000_000


class _Probe:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.seen: list[str] = []
        self.start = (0, 0)
        self.flushed_ns = time.monotonic_ns()

    def note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.start = time.monotonic_ns(), time.thread_time_ns()
            return
        now_ns = time.monotonic_ns()
        wall = now_ns - self.start[0]
        cpu = time.thread_time_ns() - self.start[1]
        self.seen.append(f"{self.start[0]} {wall} {cpu} {info['generation']} {info['collected']}\n")
        if now_ns - self.flushed_ns > _FLUSH_NS:
            self.flush()

    def flush(self) -> None:
        if os.getpid() != self.pid:
            return
        self.flushed_ns = time.monotonic_ns()
        if self.seen:
            with open(os.path.join(_OUT or ".", f"{self.pid}.txt"), "a") as f:
                f.writelines(self.seen)
            self.seen.clear()

    def forked(self) -> None:
        self.__init__()  # type: ignore[misc]


if _OUT:
    _PROBE = _Probe()
    gc.callbacks.append(_PROBE.note)
    atexit.register(_PROBE.flush)
    os.register_at_fork(after_in_child=_PROBE.forked)
