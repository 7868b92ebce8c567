"""How often our drain threads wake in a busy `vllm serve` whose exporters are behind.

Why: on a saturated host the exporters (SCHED_IDLE) fall behind within a
minute, every exporter pipe stays full, and every hand-off of the owner (the
engine thread, the API server's event loop) is declined or leaves the rest of
a frame. A drain thread that wakes to retry takes the GIL from its owner each
time (``benchmarks/gil_wake_cost.py``: the mechanism). This counts, per thread,
the wake-ups that cost: voluntary context switches (a thread that slept and
woke), with its CPU time and its time runnable but waiting for a CPU
(``/proc/<pid>/task/<tid>/{status,schedstat}``).

What: the busy server of ``plugin_toggle.py`` (one `vllm serve` of the tiny CPU
model, the plugin on with its defaults, ``wrk`` keeping CONCURRENCY short
requests in flight, placed as ``serve_short.py --pin 0:1 --pin-client 0``),
WARMUP seconds of load first (the exporters fall behind), then SECONDS
measured. Printed, per process (API server, engine core): each thread's CPU
µs, runnable-waiting µs and voluntary switches per request and per second for
our drain thread (``journey-drain``) and vLLM's busiest threads; vLLM's own
count of finished requests per second; and the spans that reached the
receiver per request in the window (well under 2: the exporters are behind).
``--env PYTHONPATH=<other src>:benchmarks/toggle_probe`` serves another
checkout's code (``git worktree add /tmp/before <commit>``).

    .venv/bin/python benchmarks/drain_wakes.py [--warmup 60] [--seconds 30]
        [--concurrency 48] [--tokens 8] [--env NAME=VALUE ...]

Times: the window is this process's ``time.monotonic``; the kernel's figures
are per thread since it started, differenced over the window.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from plugin_toggle import add_server_session, busy_server, finished  # noqa: E402

from otlp_receiver import Receiver  # noqa: E402

DRAIN_COMM = "journey-drain"


def threads(pid: int) -> dict[str, tuple[str, float, float, int]]:
    """tid -> (comm, CPU s, runnable-waiting s, voluntary switches)."""
    out: dict[str, tuple[str, float, float, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            run_ns, wait_ns, _ = (int(x) for x in (task / "schedstat").read_text().split())
            status = (task / "status").read_text()
        except (OSError, ValueError):
            continue  # the thread ended
        vol = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        out[task.name] = (comm, run_ns / 1e9, wait_ns / 1e9, vol)
    return out


def per_thread(
    before: dict[str, tuple[str, float, float, int]],
    after: dict[str, tuple[str, float, float, int]],
    requests: float,
    seconds: float,
) -> list[dict[str, Any]]:
    """Our drain thread and vLLM's three busiest, per request and per second."""
    rows = []
    for tid, (comm, run, wait, vol) in after.items():
        if tid not in before:
            continue
        _, run0, wait0, vol0 = before[tid]
        rows.append({
            "comm": comm, "tid": int(tid),
            "cpu_us_per_request": round((run - run0) / requests * 1e6, 2),
            "runnable_waiting_us_per_request": round((wait - wait0) / requests * 1e6, 2),
            "wakes_per_s": round((vol - vol0) / seconds, 2),
            "cpu_ms_per_s": round((run - run0) / seconds * 1e3, 3),
        })  # fmt: skip
    rows.sort(key=lambda r: -r["cpu_us_per_request"])
    return [r for r in rows if r["comm"] == DRAIN_COMM] + [
        r for r in rows if r["comm"] != DRAIN_COMM
    ][:3]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--warmup", type=float, default=60.0)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    add_server_session(p)
    args = p.parse_args()
    receiver = Receiver()
    receiver.start_grpc()
    try:
        with busy_server(args, receiver, args.warmup + args.seconds + 30) as (server, pids, _):
            time.sleep(args.warmup)
            roles = {"api_server": pids["api_server"], "engine_core": pids["engine_core"]}
            t0, n0, s0 = time.monotonic(), finished(server), len(receiver.spans())
            before = {role: threads(pid) for role, pid in roles.items()}
            time.sleep(args.seconds)
            after = {role: threads(pid) for role, pid in roles.items()}
            t1, n1, s1 = time.monotonic(), finished(server), len(receiver.spans())
    finally:
        receiver.stop()
    requests, seconds = n1 - n0, t1 - t0
    print(json.dumps({
        "warmup_s": args.warmup, "seconds": round(seconds, 1), "env": args.env,
        "requests_per_s": round(requests / seconds, 1),
        "spans_at_receiver_per_request": round((s1 - s0) / requests, 3),
        "threads": {
            role: per_thread(before[role], after[role], requests, seconds) for role in roles
        },
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
