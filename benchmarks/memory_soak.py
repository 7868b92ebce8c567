"""Memory over many requests on a real Scheduler with journey tracing on.

Runs journeys through a real Scheduler (256 running, churn, preemptions) with the
plugin on (exporter process, OTEL_TRACES_EXPORTER=none: the engine side does
all its work) and prints this process's RSS every 10,000 finished requests; the
same run with the plugin off gives the baseline. Flat means: no growth from
finished requests.

With the backend in trouble (``down``: connection refused; ``blackhole``: a TCP
proxy that accepts and never answers), the exporter process really exports
(OTLP gRPC, OTEL_EXPORTER_OTLP_TIMEOUT=1) and its RSS is printed too: what a
long outage costs, with the SDK's queue bounding it.

    .venv/bin/python benchmarks/memory_soak.py [REQUESTS] [on|off|down|blackhole]
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
MODE = sys.argv[2] if len(sys.argv) > 2 else "on"
if MODE in ("down", "blackhole"):
    from fault_proxy import BLACKHOLE, DOWN, FaultProxy

    PROXY = FaultProxy(upstream_port=9)  # nothing behind it: never forwards
    PROXY.set_mode(DOWN if MODE == "down" else BLACKHOLE)
    os.environ["OTEL_TRACES_EXPORTER"] = "otlp"
    os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = f"http://127.0.0.1:{PROXY.port}"
    os.environ["OTEL_EXPORTER_OTLP_TIMEOUT"] = "1"
else:
    os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")

import scheduler_bench as sb  # noqa: E402

from vllm_journey_otel.config import Config  # noqa: E402
from vllm_journey_otel.engine import handoff, hooks, state  # noqa: E402


def rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    mode = MODE
    traced = mode != "off"
    if traced:
        hooks.install(Config(enabled=True))
    d = sb.Driver("on" if traced else "off", 256, 5)
    samples = []
    next_mark = 10_000
    while d.finished < total:
        d.step()
        if d.finished >= next_mark:
            gc.collect()
            sample = [d.finished, round(rss_mib(), 1)]
            pipeline = handoff.pipeline()
            pid = getattr(pipeline.sink, "pid", None) if pipeline else None
            if pid:
                sample.append(round(rss_mib(pid), 1))
            samples.append(tuple(sample))
            next_mark += 10_000
    tracker = d.engine.scheduler.__dict__.get(state.TRACKER_ATTR)
    print(json.dumps({
        "mode": mode,
        "finished": d.finished,
        "preemptions": d.preemptions,
        "rss_mib_every_10k (finished, engine[, exporter])": samples,
        "awaiting_left": len(tracker.awaiting) if tracker else None,
        "lost": handoff.pipeline().losses.by_reason() if handoff.pipeline() else None,
    }))  # fmt: skip
    if traced:
        hooks.uninstall()


if __name__ == "__main__":
    main()
