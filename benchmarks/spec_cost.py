"""Engine-thread cost of speculative-decoding accounting per step.

A real Scheduler with the n-gram proposer (3 draft tokens) and RUNNING decoding
requests; on a real SchedulerOutput of a full decode batch (every request with
drafts) and its fabricated ModelRunnerOutput, the plugin's per-step work
(``SchedulerTracker.spec_verified``: drafts proposed and accepted per request) is
timed in isolation, best of several repeats (robust to a shared, noisy machine).
Without speculative decoding the cost is one attribute read per step. For scale,
the median time of vLLM's own ``schedule`` + ``update_from_output`` (plugin on) on
the last decode steps.

    .venv/bin/python benchmarks/spec_cost.py [RUNNING ...]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")

from vllm.v1.outputs import ModelRunnerOutput

import harness
from vllm_journey_otel.config import Config
from vllm_journey_otel.engine import hooks
from vllm_journey_otel.engine.state import TRACKER_ATTR


def measure(running: int) -> dict[str, object]:
    hooks.install(Config(enabled=True))
    e = harness.Engine(
        num_spec_tokens=3,
        max_num_seqs=running,
        max_num_batched_tokens=max(2048, 8 * running),
        num_blocks=running * 20 + 64,
    )
    e.accept_for = lambda rid, i, n: i % (n + 1)
    for i in range(running):
        e.add(f"r{i}", prompt_len=32, max_tokens=10_000)
    s = e.scheduler
    times: list[float] = []

    def timed(f):  # type: ignore[no-untyped-def]
        def call(*a, **kw):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                times.append(time.perf_counter() - t0)

        return call

    # Time vLLM's own calls only (sync: schedule, update, schedule, update, ...).
    s.schedule = timed(s.schedule)
    s.update_from_output = timed(s.update_from_output)
    for _ in range(20):  # prefill, then decode steps with drafts
        e.step()
    del s.schedule, s.update_from_output
    pairs = zip(times[-20::2], times[-19::2], strict=True)
    step_ms = statistics.median(a + b for a, b in pairs) * 1e3
    tracker = s.__dict__[TRACKER_ATTR]
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    drafted = sum(1 for r in ids if so.scheduled_spec_decode_tokens.get(r))
    mro = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] * (1 + i % 4) for i in range(len(ids))],
    )
    reps = 200
    cost = min(timeit.repeat(lambda: tracker.spec_verified(so, mro), number=reps, repeat=7)) / reps
    hooks.uninstall()
    return {
        "running": running,
        "requests_with_drafts": drafted,
        "scheduler_step_ms_median": round(step_ms, 3),
        "spec_verified_us": round(cost * 1e6, 1),
        "us_per_request": round(cost * 1e6 / max(1, drafted), 3),
        "share_of_step": round(cost * 1e3 / step_ms, 4),
    }


def main() -> None:
    sizes = [int(x) for x in sys.argv[1:]] or [64, 256]
    for n in sizes:
        print(json.dumps(measure(n)), flush=True)


if __name__ == "__main__":
    main()
