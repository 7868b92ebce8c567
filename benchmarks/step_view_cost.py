"""Engine-thread cost of the step view (VLLM_JOURNEY_OTEL_STEPS=1) per recorded step.

A real Scheduler with RUNNING requests (the scheduler_bench workload) runs with the
step view on until the batch is full; then, on a real SchedulerOutput of that
batch, the step view's engine-thread work is timed in isolation, best of several
repeats (robust to a shared, noisy machine): the walk over the batch
(``_step_begin``: prefill/decode split, links) and the hand-off of the record
(``StepRecord`` plus its msgpack encoding, what the exporter pipe carries). The
same scheduler's median ``schedule`` + ``update_from_output`` time is printed for
scale. With the step view off the cost is one check per step (not measurable
here).

    .venv/bin/python benchmarks/step_view_cost.py [RUNNING ...]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")

import scheduler_bench as sb

from vllm_journey_otel.config import Config
from vllm_journey_otel.engine import hooks
from vllm_journey_otel.engine.state import TRACKER_ATTR
from vllm_journey_otel.journey import StepRecord
from vllm_journey_otel.wire import ENCODER


def measure(running: int) -> dict[str, object]:
    hooks.install(Config(enabled=True, steps=True))
    d = sb.Driver("steps", running, 5)
    for _ in range(80):
        d.step()
    step_ms = statistics.median(d.times[-40:]) * 1e3
    s = d.engine.scheduler
    tracker = s.__dict__[TRACKER_ATTR]
    d.top_up()
    so = s.schedule()  # a real output of a full batch (left unprocessed)
    batch = len(so.num_scheduled_tokens)
    t = time.monotonic_ns()
    reps = 200
    walk = min(timeit.repeat(lambda: tracker._step_begin(t, 1, so), number=reps, repeat=7)) / reps
    step, t0, t1, *rest = tracker.steps_open[id(so)]

    def hand_off() -> bytes:
        return ENCODER.encode([StepRecord(step, t0, t1, time.monotonic_ns(), *rest)])

    send = min(timeit.repeat(hand_off, number=reps, repeat=7)) / reps
    size = len(hand_off())
    tracker.steps_open.clear()
    hooks.uninstall()
    return {
        "running": running,
        "batch": batch,
        "links": len(rest[-1]),
        "step_ms_median": round(step_ms, 3),
        "walk_us": round(walk * 1e6, 1),
        "hand_off_us": round(send * 1e6, 1),
        "record_bytes": size,
        "us_per_request": round((walk + send) * 1e6 / batch, 3),
        "share_of_step": round((walk + send) * 1e3 / step_ms, 4),
    }


def main() -> None:
    sizes = [int(x) for x in sys.argv[1:]] or [64, 256, 1024]
    for n in sizes:
        print(json.dumps(measure(n)), flush=True)


if __name__ == "__main__":
    main()
