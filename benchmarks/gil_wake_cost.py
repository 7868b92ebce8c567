"""What a wake-up of our nice-19 drain thread costs the thread that owns the GIL, on a busy CPU.

The mechanism behind the API server's lost requests/s: CPython hands the GIL
to a thread that asks for it and then makes the holder wait until that thread
has actually run (``FORCE_SWITCHING``), and a nice-19 thread on a CPU that
nice-0 threads keep busy waits in the kernel's run queue for its turn. Each
wake-up of such a thread can therefore stall the owner (vLLM's event loop or
engine thread) for as long as the kernel keeps the thread waiting.

This process and COMPETITORS busy processes (nice 0, each spinning in pure
Python) are pinned to one CPU: a saturated CPU, as on a busy server. The main
thread is the owner: it runs UNITS units of pure-Python work (about 16 µs of
CPU each) and calls the pipeline's ``publish_due`` after each, as the engine
thread and the event loop do. Its wall time per unit and its CPU time per
unit are recorded. Modes, in rotating blocks in one run:

* off: no pipeline, no thread of ours;
* off-2: the same again, the A/A control;
* wake-50ms: a real :class:`JourneyPipeline` on a real pipe whose drain thread
  wakes every 50 ms (``maintain_s=0.05``: what it did when it woke every export
  interval);
* on-demand: the same pipeline with the default (wakes once a second, or when
  the owner's offer is declined).

    .venv/bin/python benchmarks/gil_wake_cost.py [--blocks 12] [--units 60000] [--competitors 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from records import journeys  # noqa: E402


def spin() -> None:
    while True:
        pass


def work(n: int = 300) -> int:
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def drain_reader(fd: int) -> None:
    while os.read(fd, 1 << 16):
        pass


def slow_reader(fd: int, cpu: int) -> None:
    """An exporter that is behind (short of CPU): 4 KiB every 50 ms, on the
    other CPU, in its own process (a thread here would take the owner's GIL)."""
    os.sched_setaffinity(0, {cpu})
    while os.read(fd, 4096):
        time.sleep(0.05)


def block(mode: str, units: int) -> tuple[float, float]:
    """Wall and CPU µs per unit of the owner thread in one block of ``mode``."""
    from vllm_journey_otel.engine.pipe_sink import PipeSink
    from vllm_journey_otel.engine.pipeline import JourneyPipeline

    pipeline: JourneyPipeline | None = None
    r = w = -1
    reader: threading.Thread | multiprocessing.Process
    if mode in ("wake-50ms", "on-demand", "behind"):
        r, w = os.pipe()
        if mode == "behind":
            reader = multiprocessing.Process(target=slow_reader, args=(r, other_cpu()))
        else:
            reader = threading.Thread(target=drain_reader, args=(r,), daemon=True)
        reader.start()
        kw: dict[str, Any] = {"maintain_s": 0.05} if mode == "wake-50ms" else {}
        pipeline = JourneyPipeline(PipeSink(w), **kw)
        if mode == "behind":  # the pipe full from the start, as after a while behind
            with contextlib.suppress(BlockingIOError):
                while True:
                    os.write(w, b"\0" * 4096)
    finished = iter(journeys(units // 50 + 1))
    t0, c0 = time.perf_counter(), time.thread_time()
    for i in range(units):
        work()
        if pipeline is not None:
            if i % 50 == 0:  # a journey finishes now and then
                pipeline.submit(next(finished))
            pipeline.publish_due(time.monotonic_ns())  # hands on every PUBLISH_INTERVAL_NS
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    if pipeline is not None:
        pipeline._queue.clear()  # (behind: what is queued would take minutes to read)
        pipeline.shutdown(1.0)  # closes the write end: the reader sees end-of-file
        if isinstance(reader, multiprocessing.Process):
            reader.kill()
        reader.join(5.0)
        os.close(r)
    return wall / units * 1e6, cpu / units * 1e6


def other_cpu() -> int:
    mine = os.sched_getaffinity(0)
    return min((set(range(os.cpu_count() or 1)) - mine) or mine)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--units", type=int, default=60000, help="about 2 s of work a block")
    p.add_argument("--competitors", type=int, default=1)
    p.add_argument("--cpu", type=int, default=max(os.sched_getaffinity(0)))
    p.add_argument("--modes", type=lambda text: text.split(","),
                   default=["off", "off-2", "wake-50ms", "on-demand"])  # fmt: skip
    args = p.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    rivals = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.competitors)]
    for rival in rivals:
        rival.start()  # inherits the affinity: the same CPU
    modes = args.modes
    wall: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for m in modes:
            block(m, args.units // 4)  # warm-up
        for b in range(args.blocks):
            for m in modes[b % len(modes) :] + modes[: b % len(modes)]:
                a, c = block(m, args.units)
                wall[m].append(a)
                cpu[m].append(c)
    finally:
        for rival in rivals:
            rival.kill()
    med = {m: statistics.median(v) for m, v in wall.items()}

    def ratio(m: str) -> dict[str, float]:
        pairs = sorted(x / y for x, y in zip(wall[m], wall["off"], strict=True))
        return {"median": round(statistics.median(pairs), 3), "min": round(pairs[0], 3),
                "max": round(pairs[-1], 3)}  # fmt: skip

    print(json.dumps({
        "blocks": args.blocks, "units_per_block": args.units, "competitors": args.competitors,
        "cpu": args.cpu,
        "owner_wall_us_per_unit_median": {m: round(v, 1) for m, v in med.items()},
        "owner_cpu_us_per_unit_median": {m: round(statistics.median(v), 1) for m, v in cpu.items()},
        "wall_vs_off (per block)": {m: ratio(m) for m in modes if m != "off"},
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
