"""vLLM's spin-wait beside a busy exporter: how late vLLM learns of its message.

Why: vLLM's shared-memory message queues (``shm_broadcast.MessageQueue``,
0.30-0.33: the engine core waiting for its workers' output, a worker waiting
for the next step) wait by spinning on ``sched_yield()`` for a second after
each message. On an EEVDF kernel (Linux 6.6 and later) each yield hands the
CPU to any other runnable task on that CPU, whatever its priority, until that
task blocks or a tick ends its slice; SCHED_IDLE does not keep the exporter
out of that time. A waiting thread of vLLM's then learns of its message that
much later: its step starts late.

What: vLLM's own ``MessageQueue``. A writer process on WRITER_CPU enqueues its
``time.monotonic_ns()`` every PERIOD ms; a reader process on READER_CPU
dequeues it (vLLM's own wait) and notes how late each message was. Beside the
reader, on READER_CPU, per mode:

* ``alone``: nothing else (the floor);
* ``exporter``: the real exporter process (``VLLM_JOURNEY_OTEL_EXPORTER_CPUS``
  = READER_CPU, its default priority), fed finished journeys at RATE a second
  through the real pipeline by ``export_bench.py --receiver count`` (itself on
  WRITER_CPU); RATE 0 feeds them as fast as the exporter takes them, as a
  server whose exporter has fallen behind does;
* ``before``: the same with another checkout's code (``--before PATH``: its
  ``src`` on ``PYTHONPATH``, ``git worktree add /tmp/before <commit>``).

Modes run in turn within each block, the order rotated by block. Only
the messages sent while journeys were being submitted count (the window that
``export_bench.py`` reports); ``alone`` counts a window of the same length.
Per mode it prints the reader's delay, pooled over the blocks (median, p90,
p99, mean, in µs) and each block's median, p99 and mean; the exporter's CPU
per journey and the spans lost, as ``export_bench.py`` measured them. (The
delay includes the writer's own ``enqueue``, its pickling: some tens of µs
in ``alone`` too.)

    .venv/bin/python benchmarks/yield_handover.py [--blocks 4] [--rate 600]
        [--seconds 10] [--period-ms 2] [--modes alone,exporter[,before]]
        [--before /tmp/before/src] [--cpus 0:1]

Clock: every stamp is ``time.monotonic_ns()`` (CLOCK_MONOTONIC, one clock for
all processes of the host).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
# RATE 0: as fast as the pipeline takes them (export_bench.py's 0), about this
# many a second for SECONDS (an exporter with a CPU to itself).
CAPACITY_GUESS = 1200


def _writer(handle_box: Any, stop: Any, cpu: int, period_s: float) -> None:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    os.sched_setaffinity(0, {cpu})
    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=10)
    handle_box.put(mq.export_handle())
    mq.wait_until_ready()
    while not stop.is_set():
        time.sleep(period_s)
        mq.enqueue(time.monotonic_ns())
    mq.enqueue(None)


def _reader(handle: Any, out: Any, cpu: int) -> None:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    os.sched_setaffinity(0, {cpu})
    mq = MessageQueue.create_from_handle(handle, 0)
    mq.wait_until_ready()
    stamps: list[tuple[int, int]] = []  # (sent_mono_ns, delay_ns)
    while True:
        sent_mono_ns = mq.dequeue()
        if sent_mono_ns is None:
            break
        stamps.append((sent_mono_ns, time.monotonic_ns() - sent_mono_ns))
    out.put(stamps)


def _load(mode: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """The exporter's load for one window (None for ``alone``: a sleep as long)."""
    if mode == "alone":
        t0_mono_ns = time.monotonic_ns()
        time.sleep(args.seconds)
        return {"submit_mono_ns": [t0_mono_ns, time.monotonic_ns()]}
    env = dict(os.environ, VLLM_JOURNEY_OTEL_EXPORTER_CPUS=str(args.reader_cpu))
    if mode == "before":
        env["PYTHONPATH"] = args.before
    cmd = [
        sys.executable,
        str(ROOT / "export_bench.py"),
        str(int((args.rate or CAPACITY_GUESS) * args.seconds)),
        str(args.rate),
        "--step",
        str(args.step),
        "--receiver",
        "count",
    ]
    done = subprocess.run(
        cmd,
        env=env,
        capture_output=True,
        text=True,
        timeout=args.seconds * 4 + 120,
        preexec_fn=lambda: os.sched_setaffinity(0, {args.writer_cpu}),
    )
    out = done.stdout
    if done.returncode != 0 or "{" not in out:
        raise SystemExit(f"export_bench failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out[out.index("{") :])
    return result


def one_window(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    handle_box, out, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    writer = ctx.Process(
        target=_writer, args=(handle_box, stop, args.writer_cpu, args.period_ms / 1e3)
    )
    writer.start()
    handle = handle_box.get(timeout=120)
    reader = ctx.Process(target=_reader, args=(handle, out, args.reader_cpu))
    reader.start()
    try:
        result = _load(mode, args) or {}
    finally:
        stop.set()
    stamps = out.get(timeout=120)
    writer.join(30)
    reader.join(30)
    from_mono_ns, to_mono_ns = result["submit_mono_ns"]
    delays = [d / 1e3 for sent_mono_ns, d in stamps if from_mono_ns <= sent_mono_ns <= to_mono_ns]
    if not delays:
        raise SystemExit(f"{mode}: no message was dequeued in the window (the writer or reader)")
    return {
        "mode": mode,
        "messages": len(delays),
        "delay_us_median": statistics.median(delays),
        "delay_us_p99": _pct(delays, 0.99),
        "delay_us_mean": statistics.fmean(delays),
        "delays_us": delays,
        "exporter_cpu_us_per_journey": result.get("exporter_cpu_us_per_journey"),
        "spans_lost": result.get("spans_lost"),
    }


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(windows: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in modes:
        mine = [w for w in windows if w["mode"] == mode]
        pooled = [d for w in mine for d in w["delays_us"]]
        cpu = [w["exporter_cpu_us_per_journey"] for w in mine if w["exporter_cpu_us_per_journey"]]
        out[mode] = {
            "windows": len(mine),
            "messages": len(pooled),
            "delay_us": {
                "median": round(statistics.median(pooled), 1),
                "p90": round(_pct(pooled, 0.9), 1),
                "p99": round(_pct(pooled, 0.99), 1),
                "mean": round(statistics.fmean(pooled), 1),
            },
            "block_medians_us": [round(w["delay_us_median"], 1) for w in mine],
            "block_p99s_us": [round(w["delay_us_p99"], 1) for w in mine],
            "block_means_us": [round(w["delay_us_mean"], 1) for w in mine],
            "exporter_cpu_us_per_journey": cpu,
            "spans_lost": [w["spans_lost"] for w in mine if w["spans_lost"] is not None],
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--rate", type=float, default=600.0, help="journeys a second")
    p.add_argument("--step", type=int, default=12, help="journeys per hand-off step")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--period-ms", type=float, default=2.0)
    p.add_argument("--modes", default="alone,exporter")
    p.add_argument("--before", default="")
    p.add_argument("--cpus", default="0:1", help="WRITER_CPU:READER_CPU")
    args = p.parse_args()
    args.writer_cpu, args.reader_cpu = (int(c) for c in args.cpus.split(":"))
    modes = args.modes.split(",")
    if "before" in modes and not args.before:
        raise SystemExit("--modes before needs --before PATH (another checkout's src)")
    windows = []
    for block in range(args.blocks):
        order = modes[block % len(modes) :] + modes[: block % len(modes)]
        for mode in order:
            w = one_window(mode, args)
            windows.append(w)
            print(
                json.dumps({k: v for k, v in w.items() if k != "delays_us"} | {"block": block}),
                flush=True,
            )
    print(json.dumps(summary(windows, modes), indent=2))


if __name__ == "__main__":
    main()
