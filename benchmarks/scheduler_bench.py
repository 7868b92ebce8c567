"""Engine-thread overhead of journey tracing on a real vLLM Scheduler.

For each batch size (running requests), three engines run side by side in one
process, interleaved block by block so machine noise hits all alike:

* ``off``: the plugin's wrappers removed (vLLM's own methods);
* ``off2``: a second engine with the plugin off, the A/A control: its ratio to
  ``off`` is what this benchmark reads for two identical engines, so any other
  ratio within that spread is not resolved;
* ``on``: every journey recorded and exported (to an OTLP receiver in a child
  process... here: the detached exporter process with OTEL_TRACES_EXPORTER=none,
  so the engine side does all its real work: record, encode, pipe);
* ``ratio0``: head sampling ratio 0 with the default tail rule (every journey
  still recorded; only preempted, errored and aborted ones exported);
* ``ratio0_notail``: head sampling ratio 0 and no tail rule
  (``VLLM_JOURNEY_OTEL_TAIL=none``): an unsampled request costs the sampling
  decision and a missing-attribute check per hook;
* ``steps`` (with ``--step-view``): as ``on``, plus the engine step view
  (``VLLM_JOURNEY_OTEL_STEPS=1``, every step recorded with links to its batch).

Only the scheduler's own calls are timed (``schedule`` + ``update_from_output``);
building the fabricated model output is not. Churn: requests finish every step
(max_tokens 32..160) and new ones arrive to keep the batch full; the KV cache is
sized for about 90 % of the peak so some requests are preempted.

    .venv/bin/python benchmarks/scheduler_bench.py [--sizes 64,256,1024] [--blocks 12]
        [--step-view] [--traceparent]

``--traceparent``: every request carries the trace headers the API-server spans
give it (on by default in the product): sampled for ``off``/``on``, not sampled
for the ``ratio0`` engines (the API server's head decision is in its flags).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")

from vllm.v1.outputs import ModelRunnerOutput

import harness
from vllm_journey_otel.config import Config
from vllm_journey_otel.engine import hooks
from vllm_journey_otel.engine.sampling import HeadSampler, TailRule
from vllm_journey_otel.journey import API_PARENT_KEY

PROMPT = 64


class Driver:
    """One engine with its own churn and its own step timings."""

    def __init__(self, name: str, n: int, seed: int, flags: str | None = None) -> None:
        self.name = name
        self.n = n
        self.rng = random.Random(seed)
        # Every request with the trace headers the API-server spans give it
        # (its span's traceparent, FLAGS the API server's sampling decision).
        self.flags = flags
        blocks_per_req = (PROMPT + 160) // harness.BLOCK_SIZE + 1
        self.engine = harness.Engine(
            max_num_seqs=n,
            max_num_batched_tokens=max(2048, 4 * n),
            max_model_len=1024,
            num_blocks=int(n * blocks_per_req * 0.45) + 64,
        )
        self.next_id = 0
        self.times: list[float] = []
        self.finished = 0
        self.steps = 0
        self.preemptions = 0

    def top_up(self) -> None:
        s = self.engine.scheduler
        while len(s.requests) < self.n + self.n // 8:
            rid = f"{self.name}-{self.next_id}"
            self.next_id += 1
            prompt = [self.rng.randint(10, 1000) for _ in range(PROMPT)]
            headers = None
            if self.flags is not None:
                ids = f"{self.rng.getrandbits(128):032x}-{self.rng.getrandbits(64):016x}"
                headers = {"traceparent": f"00-{ids}-{self.flags}", API_PARENT_KEY: "1"}
            self.engine.add(
                rid, prompt=prompt, max_tokens=self.rng.randint(32, 160), trace_headers=headers
            )
            self.engine.requests.pop(rid, None)  # keep the harness from holding requests

    def step(self) -> None:
        s = self.engine.scheduler
        self.top_up()
        before = len(s.requests)
        t0 = time.perf_counter()
        so = s.schedule()
        t1 = time.perf_counter()
        ids = list(so.num_scheduled_tokens)
        sampled = [[7] if not s.requests[r].is_prefill_chunk else [] for r in ids]
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        t2 = time.perf_counter()
        s.update_from_output(so, mro)
        t3 = time.perf_counter()
        self.times.append((t1 - t0) + (t3 - t2))
        self.finished += before - len(s.requests)
        self.preemptions += len(so.preempted_req_ids)
        self.steps += 1


def run(
    n: int,
    blocks: int,
    steps_per_block: int,
    warmup: int,
    step_view: bool = False,
    traceparent: bool = False,
) -> dict[str, object]:
    on_cfg = Config(enabled=True)
    # The API server's decision in each request's flags: sampled, or (ratio 0) not.
    yes, no = ("01", "00") if traceparent else (None, None)
    # Build each engine in its mode (the tracker is attached at construction and
    # keeps the sampler it was built with).
    hooks.unwrap()
    off = Driver("off", n, 1, yes)
    off2 = Driver("off2", n, 1, yes)
    hooks.install(on_cfg, head=HeadSampler(parent_based=True, ratio=0.0))
    ratio0 = Driver("ratio0", n, 1, no)
    no_tail = TailRule(preempted=False, error=False, aborted=False, in_flight=False)
    hooks.install(on_cfg, head=HeadSampler(parent_based=True, ratio=0.0), tail=no_tail)
    ratio0_notail = Driver("ratio0_notail", n, 1, no)
    hooks.install(on_cfg, head=HeadSampler(), tail=TailRule())
    on = Driver("on", n, 1, yes)
    drivers = [off, off2, on, ratio0, ratio0_notail]
    unwrapped = (off, off2)
    if step_view:
        hooks.install(Config(enabled=True, steps=True), head=HeadSampler())
        drivers.append(Driver("steps", n, 1, yes))  # its tracker keeps the step view on
    for d in drivers:
        if d in unwrapped:
            hooks.unwrap()
        else:
            hooks.install(on_cfg)
        for _ in range(warmup):
            d.step()
        d.times.clear()
        d.finished = d.steps = d.preemptions = 0
    per_block: dict[str, list[float]] = {d.name: [] for d in drivers}
    gc.collect()
    for b in range(blocks):
        k = b % len(drivers)
        order = drivers[k:] + drivers[:k]
        for d in order:
            if d in unwrapped:
                hooks.unwrap()
            else:
                hooks.install(on_cfg)
            start = len(d.times)
            for _ in range(steps_per_block):
                d.step()
            per_block[d.name].append(statistics.median(d.times[start:]))
    hooks.install(on_cfg)

    def ratio_stats(name: str) -> dict[str, float]:
        ratios = sorted(a / b for a, b in zip(per_block[name], per_block["off"], strict=True))
        return {
            "median": round(statistics.median(ratios), 4),
            "p10": round(ratios[len(ratios) // 10], 4),
            "p90": round(ratios[(9 * len(ratios)) // 10], 4),
        }

    def us_per_journey(d: Driver) -> float:
        # Total extra engine time over the same number of steps, per finished journey.
        extra_s = (statistics.fmean(d.times) - statistics.fmean(off.times)) * d.steps
        return round(extra_s / max(1, d.finished) * 1e6, 2)

    return {
        "running": n,
        "traceparent": traceparent,
        "steps_per_mode": on.steps,
        "step_ms_median": {d.name: round(statistics.median(d.times) * 1e3, 3) for d in drivers},
        "ratio_vs_off": {d.name: ratio_stats(d.name) for d in drivers if d is not off},
        "journeys_finished": {d.name: d.finished for d in drivers},
        "engine_us_per_journey": {d.name: us_per_journey(d) for d in drivers if d is not off},
        "preemptions": {d.name: d.preemptions for d in drivers},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--steps", type=int, default=40, help="steps per block")
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--step-view", action="store_true", help="add the step-view engine")
    ap.add_argument(
        "--traceparent",
        action="store_true",
        help="every request carries a traceparent, as under the API-server spans (the default)",
    )
    args = ap.parse_args()
    results = []
    for n in (int(x) for x in args.sizes.split(",")):
        r = run(n, args.blocks, args.steps, args.warmup, args.step_view, args.traceparent)
        print(json.dumps(r), flush=True)
        results.append(r)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_rss_mib": round(rss, 1)}))
    hooks.uninstall()


if __name__ == "__main__":
    main()
