"""Export capacity: finished journeys per second turned into OTLP with no drops.

Feeds N finished journeys (6 spans each, 15 % with a preemption) through the
real pipeline (hand-off queue, drain thread, msgspec frames over a pipe, the
detached exporter process, OTLP gRPC) into an OTLP receiver running in this
process, at a fixed offered rate, and reports the rate received, drops at every
stage, and CPU seconds: this process's drain thread vs the exporter process.

    .venv/bin/python benchmarks/export_bench.py [N] [OFFERED_PER_S]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from otlp_receiver import Receiver
from vllm_journey_otel.journey import STATUS_LENGTH, RequestJourney
from vllm_journey_otel.pipeline import JourneyPipeline
from vllm_journey_otel.sinks import PipeSink

MS = 1_000_000


def journeys(n: int) -> list:  # type: ignore[type-arg]
    out = []
    base = time.monotonic_ns()
    for i in range(n):
        t = base + i * MS
        j = RequestJourney(f"cmpl-{i:016x}-0-abcdef12", time.time(), t, i, 100, 64)
        j.scheduled(t + MS, i, 0, 100, 100, 0)
        j.tokens(t + 2 * MS, i, 1)
        if i % 7 == 0:
            j.preempted(t + 3 * MS, i, 100, 3, 0.97, 30, 4)
            j.scheduled(t + 4 * MS, i, 0, 103, 103, 3)
            j.tokens(t + 5 * MS, i, 4)
        out.append(j.finish(t + 9 * MS, i, STATUS_LENGTH, "length", 64, t + 9 * MS))
    return out


def cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 50_000
    offered = float(sys.argv[2]) if len(sys.argv) > 2 else 10_000.0
    receiver = Receiver()
    receiver.start_grpc()
    os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = f"http://127.0.0.1:{receiver.grpc_port}"
    os.environ["OTEL_TRACES_EXPORTER"] = "otlp"
    batch = journeys(n)
    expected_spans = sum(6 if j.end.num_preemptions == 0 else 9 for j in batch)
    sink = PipeSink.start({"service.name": "bench"})
    pipeline = JourneyPipeline(sink, max_queue=16384, interval_s=0.05)
    exporter_pid = None
    for line in os.popen("pgrep -f vllm_journey_otel.exporter_process").read().split():
        exporter_pid = int(line)
    cpu0_self, cpu0_exp = time.process_time(), cpu_of(exporter_pid) if exporter_pid else 0.0
    t0 = time.perf_counter()
    for i, j in enumerate(batch):
        pipeline.submit(j)
        if i % 100 == 99:  # offered load: sleep to the schedule, in steps of 100
            ahead = (i + 1) / offered - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)
    submit_s = time.perf_counter() - t0
    cpu_self = time.process_time() - cpu0_self
    last_cpu_exp = cpu0_exp

    def sample_exporter_cpu() -> None:
        nonlocal last_cpu_exp
        try:
            if exporter_pid:
                last_cpu_exp = cpu_of(exporter_pid)
        except OSError:
            pass  # it exited: keep the last reading

    sample_exporter_cpu()
    pipeline.shutdown(5)  # EOF: the exporter exports the rest and exits

    def received() -> int:
        return sum(len(ss.spans) for r in receiver.requests for rs in r.resource_spans
                   for ss in rs.scope_spans)  # fmt: skip

    deadline = time.monotonic() + 120
    while received() < expected_spans and time.monotonic() < deadline:
        sample_exporter_cpu()
        time.sleep(0.05)
    done_s = time.perf_counter() - t0
    got = received()
    print(
        json.dumps(
            {
                "journeys": n,
                "offered_per_s": offered,
                "submit_s": round(submit_s, 2),
                "all_received_s": round(done_s, 2),
                "journeys_per_s_end_to_end": round(n / done_s),
                "spans_expected": expected_spans,
                "spans_received": got,
                "dropped_in_handoff": pipeline.dropped,
                "cpu_s_this_process_until_submitted": round(cpu_self, 2),
                "cpu_s_exporter_process_at_least": round(last_cpu_exp - cpu0_exp, 2),
            },
            indent=2,
        )
    )
    receiver.stop()


if __name__ == "__main__":
    main()
