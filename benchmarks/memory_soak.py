"""Memory over many requests on a real Scheduler with journey tracing on.

Runs journeys through a real Scheduler (256 running, churn, preemptions) with the
plugin on (exporter process, OTEL_TRACES_EXPORTER=none: the engine side does
all its work) and prints this process's RSS every 10,000 finished requests; the
same run with the plugin off gives the baseline. Flat means: no growth from
finished requests.

    .venv/bin/python benchmarks/memory_soak.py [REQUESTS] [on|off]
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")

import scheduler_bench as sb

from vllm_journey_otel import hooks
from vllm_journey_otel.config import Config


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    mode = sys.argv[2] if len(sys.argv) > 2 else "on"
    if mode == "on":
        hooks.install(Config(enabled=True))
    d = sb.Driver(mode, 256, 5)
    samples = []
    next_mark = 10_000
    while d.finished < total:
        d.step()
        if d.finished >= next_mark:
            gc.collect()
            samples.append((d.finished, round(rss_mib(), 1)))
            next_mark += 10_000
    tracker = d.engine.scheduler.__dict__.get(hooks.TRACKER_ATTR)
    print(json.dumps({
        "mode": mode,
        "finished": d.finished,
        "preemptions": d.preemptions,
        "rss_mib_every_10k": samples,
        "awaiting_left": len(tracker.awaiting) if tracker else None,
        "dropped": hooks.pipeline().dropped if hooks.pipeline() else None,
    }))  # fmt: skip
    if mode == "on":
        hooks.uninstall()


if __name__ == "__main__":
    main()
