"""The owner's hand-off to exporters that have fallen behind: its cost per try.

Why: an owner (the engine thread, an API server's event loop) hands its whole
queue on every hand-off interval (50 ms). While its exporters are behind,
every pipe is full and the hand-off is declined; what it costs each time is
the owner's, for as long as they stay behind.

What: a real ``PipeSink`` on a pipe of 4 KiB filled by nothing reading it (an
exporter that has fallen behind), offered a queue of N finished journeys
(``tests/records.py``) ROUNDS times; then the owner's whole hand-off, a real
``JourneyPipeline`` holding the N journeys on that sink, its ``publish_due``
ROUNDS times (what the engine thread and the event loop pay every interval).
Prints the median times of a declined offer and a declined hand-off, and that
a first byte of room lets the next hand-off write them all. With
``PYTHONPATH=<another checkout's src>`` the same for that code.

    .venv/bin/python benchmarks/declined_handoff.py [N] [ROUNDS]

Clock: ``time.perf_counter_ns()``, intervals only.
"""

from __future__ import annotations

import fcntl
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from records import journeys
from vllm_journey_otel.engine.pipe_sink import PipeSink
from vllm_journey_otel.engine.pipeline import JourneyPipeline

F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ (Linux), not in Python 3.11's fcntl


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    r, w = os.pipe()
    fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    os.write(w, b"\0" * 4096)
    sink = PipeSink(w)
    batch = journeys(n)
    times_ns = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        declined = not sink.offer(batch)
        times_ns.append(time.perf_counter_ns() - t0)
        assert declined
    pipeline = JourneyPipeline(sink, max_queue=n, start_thread=False)
    for j in batch:
        pipeline.submit(j)
    handoff_ns = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        pipeline.publish_due(time.monotonic_ns(), force=True)
        handoff_ns.append(time.perf_counter_ns() - t0)
        assert pipeline.queued == n
    os.read(r, 4096)
    pipeline.publish_due(time.monotonic_ns(), force=True)
    print(
        json.dumps(
            {
                "journeys_queued": n,
                "declined_offer_us_median": round(statistics.median(times_ns) / 1e3, 1),
                "declined_offer_us_max": round(max(times_ns) / 1e3, 1),
                "declined_handoff_us_median": round(statistics.median(handoff_ns) / 1e3, 1),
                "declined_handoff_us_max": round(max(handoff_ns) / 1e3, 1),
                "with_room_the_next_handoff_takes_all": pipeline.published == n,
            }
        )
    )


if __name__ == "__main__":
    main()
