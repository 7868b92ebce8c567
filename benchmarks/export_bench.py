"""Export capacity: finished journeys per second turned into OTLP with no drops.

Feeds N finished journeys (5 spans each, 9 for the one in 7 with a preemption)
through the real pipeline (hand-off queue, drain thread, msgspec frames over a
pipe, the detached exporter process, OTLP gRPC) into an OTLP receiver running in
this process (after a warm-up: every exporter has exported a first batch), and
reports the rate at which the spans arrived, losses at every
stage, and CPU seconds: the drain thread, the rest of this process (mostly the
receiver) and the exporter process (and its CPU per journey by thread name: the
Python threads, ``python``, against the gRPC core's own).

    .venv/bin/python benchmarks/export_bench.py [N] [OFFERED_PER_S] [--receiver parse|count]
        [--exporters K] [--step K] [--api-parent] [--api-records]

Journeys are submitted in steps of 100 (``--step``), each followed by the engine
thread's hand-off (``publish_due``: a frame at most every 50 ms, when a pipe has
room); a busy server's small frames: ``--step 12`` at 240 journeys a second.
``OFFERED_PER_S`` 0 (the default) offers as fast as the pipeline takes journeys
without dropping any (the submit loop waits while more than 1,000 are queued):
the figure is the capacity of the pipeline. A positive rate offers at that
fixed rate and drops what the hand-off queue cannot hold, as the engine would:
the queue (16,384) and the pipe (1 MiB) absorb a few seconds of excess, so offer
for well over ten seconds to show that a rate is sustained.

``--receiver parse`` (default) is the test suite's receiver: Python gRPC server,
every request decoded into protobuf objects. ``--receiver count`` keeps the raw
request bytes and decodes them after the run, so the receiver's own cost is as
small as a Python gRPC server allows.

``--api-parent`` gives every journey the trace headers the API server hands
the engine core on the default path (its traceparent and its mark): the
engine's root is then the child of the API server's span.

``--api-records`` feeds the API server's records instead (``ApiJourney``, three
spans each), as its own exporter process receives them.

``--exporters K`` starts K exporter processes fed frames in turn
(VLLM_JOURNEY_OTEL_EXPORTER_PROCESSES).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from otlp_receiver import Receiver
from vllm_journey_otel import __version__
from vllm_journey_otel import schema as S
from vllm_journey_otel.engine.pipe_sink import PipeSink
from vllm_journey_otel.engine.pipeline import JourneyPipeline
from vllm_journey_otel.engine.request_journey import RequestJourney
from vllm_journey_otel.export.api_spans import plan_api
from vllm_journey_otel.export.spans import plan_spans
from vllm_journey_otel.journey import (
    API_PARENT_KEY,
    STATUS_LENGTH,
    ApiJourney,
    FinishedJourney,
    RootIds,
)

MS = 1_000_000
# What the plugin puts on the resource in vLLM (handoff._resource_attributes).
RESOURCE = {
    S.RES_SERVICE_NAME: "bench",
    S.RES_MODEL: "Qwen/Qwen2.5-0.5B-Instruct",
    S.RES_DP_RANK: 0,
    S.RES_VLLM_VERSION: "0.33.0",
    S.RES_PLUGIN_VERSION: __version__,
    S.RES_HOST: socket.gethostname(),
    S.RES_PID: os.getpid(),
}
MAX_QUEUE = 16384
WARMUP = 100  # journeys per exporter before the timing starts
# Lossless mode: the submit loop waits while more journeys than this are queued.
LOSSLESS_BACKLOG = 1000


def journeys(n: int, api_parent: bool = False) -> list[FinishedJourney]:
    """``api_parent``: each under an API server's span, as on the default path
    (the engine's trace headers are the API server's traceparent and its mark)."""
    out = []
    base = time.monotonic_ns()
    for i in range(n):
        t = base + i * MS
        headers = None
        if api_parent:
            tp = f"00-{i + 1:032x}-{i + 1:016x}-01"
            headers = {"traceparent": tp, API_PARENT_KEY: "1"}
        j = RequestJourney(
            f"cmpl-{i:016x}-0-abcdef12", time.time(), t, i, 100, 64, trace_headers=headers
        )
        j.scheduled(t + MS, i, 0, 100, 100, 0)
        j.tokens(t + 2 * MS, i, 1)
        if i % 7 == 0:
            j.preempted(t + 3 * MS, i, 100, 3, 0.97, 30, 4)
            j.scheduled(t + 4 * MS, i, 0, 103, 103, 3)
            j.tokens(t + 5 * MS, i, 4)
        out.append(j.finish(t + 9 * MS, i, STATUS_LENGTH, "length", 64, t + 9 * MS))
    return out


def api_records(n: int) -> list[ApiJourney]:
    """What an API server's exporter receives: one record per HTTP request (a
    streamed chat completion of 10 chunks, its span ids chosen at receipt)."""
    out = []
    base = time.monotonic_ns()
    for i in range(n):
        t = base + i * MS
        out.append(
            ApiJourney(
                ids=RootIds(i + 1, i + 1, i + 1), parent_headers=None, server_kind=True,
                head_sampled=True, method="POST", path="/v1/chat/completions", stream=True,
                disconnected=False, status_code=200, exception=None,
                request_ids=[f"chatcmpl-{i:032x}-0"], receipt_mono_ns=t,
                end_mono_ns=t + 90 * MS, arrival_time_s=time.time(),
                handoff_mono_ns=t + MS, first_body_mono_ns=t + 20 * MS,
                last_output_mono_ns=t + 89 * MS, chunks=10,
            )
        )  # fmt: skip
    return out


def count_spans(req: trace_service_pb2.ExportTraceServiceRequest) -> int:
    return sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)


class ParsingReceiver(Receiver):
    """The tests' receiver, counting spans and noting when the last ones came."""

    def __init__(self) -> None:
        super().__init__()
        self.spans_received = 0
        self.requests_seen = 0
        self.last_at = 0.0

    def add(self, req: trace_service_pb2.ExportTraceServiceRequest) -> None:
        n = count_spans(req)
        with self.lock:
            self.spans_received += n
            self.requests_seen += 1
            self.last_at = time.perf_counter()

    def start(self) -> int:
        return self.start_grpc()

    def settle(self) -> None:
        pass


class CountingReceiver:
    """OTLP/gRPC that keeps the raw request bytes; decoded by ``settle`` after the run."""

    def __init__(self) -> None:
        self.raw: list[bytes] = []
        self.lock = threading.Lock()
        self.spans_received = 0
        self.requests_seen = 0
        self.last_at = 0.0
        self._server: grpc.Server | None = None

    def _export(self, request: bytes, context: Any) -> bytes:
        with self.lock:
            self.raw.append(request)
            self.requests_seen += 1
            self.last_at = time.perf_counter()
        return b""  # an empty ExportTraceServiceResponse

    def start(self) -> int:
        handler = grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService",
            {"Export": grpc.unary_unary_rpc_method_handler(self._export)},
        )
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self._server = server
        return port

    def settle(self) -> None:
        with self.lock:
            raw, self.raw = self.raw, []
        for data in raw:
            self.spans_received += count_spans(
                trace_service_pb2.ExportTraceServiceRequest.FromString(data)
            )

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait(5)


def cpu_of(path: str) -> float:
    """User + system CPU seconds of a process or thread from its /proc stat file."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuWatch:
    """The latest CPU reading of a process that may exit (then: its last reading)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.start = self.last = self._read(0.0)

    def _read(self, default: float) -> float:
        try:
            return cpu_of(self.path)
        except (OSError, ValueError, IndexError):
            return default

    def sample(self) -> None:
        self.last = self._read(self.last)

    @property
    def used(self) -> float:
        return self.last - self.start


class ThreadsWatch:
    """The CPU of each thread of a process that may exit, summed by the
    thread's name (``comm``): the Python threads are "python" (the main
    thread and the export stage's), the gRPC core's name their own."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = self._read()
        self.last = dict(self.start)

    def _read(self) -> dict[int, tuple[str, float]]:
        out = {}
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{self.pid}/task")]
        except OSError:
            return {}
        for tid in tids:
            try:
                with open(f"/proc/{self.pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
                out[tid] = (name, cpu_of(f"/proc/{self.pid}/task/{tid}/stat"))
            except (OSError, ValueError, IndexError):  # the thread ended meanwhile
                continue
        return out

    def sample(self) -> None:
        self.last.update(self._read())

    def used_by_name(self) -> dict[str, float]:
        used: dict[str, float] = {}
        for tid, (name, cpu) in self.last.items():
            before = self.start.get(tid, (name, 0.0))[1]  # a thread started since: all of it
            used[name] = used.get(name, 0.0) + cpu - before
        return used


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", nargs="?", type=int, default=50_000)
    ap.add_argument("offered_per_s", nargs="?", type=float, default=0.0)
    ap.add_argument("--receiver", choices=("parse", "count"), default="parse")
    ap.add_argument("--exporters", type=int, default=1)
    ap.add_argument("--step", type=int, default=100, help="journeys finished per scheduler step")
    ap.add_argument(
        "--api-records",
        action="store_true",
        help="the API server's records (its exporter's input) instead of engine journeys",
    )
    ap.add_argument(
        "--api-parent",
        action="store_true",
        help="journeys under an API server's span, as on the default path",
    )
    args = ap.parse_args()
    n, offered, step = args.n, args.offered_per_s, max(1, args.step)

    receiver: ParsingReceiver | CountingReceiver = (
        ParsingReceiver() if args.receiver == "parse" else CountingReceiver()
    )
    port = receiver.start()
    os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = f"http://127.0.0.1:{port}"
    os.environ["OTEL_TRACES_EXPORTER"] = "otlp"
    warmup: list[Any]
    if args.api_records:
        warmup, batch = api_records(WARMUP * args.exporters), api_records(n)
        expected_spans = sum(len(plan_api(j, 0)[0]) for j in warmup + batch)
    else:
        warmup, batch = (
            journeys(WARMUP * args.exporters, args.api_parent),
            journeys(n, args.api_parent),
        )
        expected_spans = sum(len(plan_spans(j, 0)) for j in warmup + batch)
    sink = PipeSink.start(RESOURCE, processes=args.exporters)
    assert len(sink.pids) == args.exporters
    # Timing starts once every exporter has started up and exported a first batch.
    for k in range(args.exporters):
        sink.consume(warmup[k * WARMUP : (k + 1) * WARMUP])
    deadline = time.monotonic() + 60
    while receiver.requests_seen < args.exporters and time.monotonic() < deadline:
        time.sleep(0.01)
    pipeline = JourneyPipeline(sink, max_queue=MAX_QUEUE, interval_s=0.05)
    assert pipeline._thread is not None and pipeline._thread.native_id is not None
    exporter_cpus = [CpuWatch(f"/proc/{pid}/stat") for pid in sink.pids]
    exporter_threads = [ThreadsWatch(pid) for pid in sink.pids]
    drain_cpu = CpuWatch(f"/proc/self/task/{pipeline._thread.native_id}/stat")
    self_cpu0 = time.process_time()
    wait: Callable[[int], None]
    if offered > 0:

        def wait(i: int) -> None:  # the schedule, in steps
            ahead = (i + 1) / offered - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)
    else:

        def wait(i: int) -> None:  # back-pressure instead of drops
            while pipeline.queued > LOSSLESS_BACKLOG:
                time.sleep(0.005)

    t0 = time.perf_counter()
    t0_mono_ns = time.monotonic_ns()
    for i, j in enumerate(batch):
        pipeline.submit(j)
        if i % step == step - 1:  # a scheduler step that finished `step` requests
            pipeline.publish_due(time.monotonic_ns())
            wait(i)
            if (i + 1) % (100 * step) == 0:
                for watch in exporter_cpus:
                    watch.sample()
                for threads in exporter_threads:
                    threads.sample()
                drain_cpu.sample()
    submit_s = time.perf_counter() - t0
    t1_mono_ns = time.monotonic_ns()
    drain_cpu.sample()  # before shutdown ends the thread
    pipeline.shutdown(5)  # EOF: the exporter exports the rest and exits

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(alive(pid) for pid in sink.pids):
        for watch in exporter_cpus:
            watch.sample()
        for threads in exporter_threads:
            threads.sample()
        time.sleep(0.05)
    exporters_exited = not any(alive(pid) for pid in sink.pids)
    exporter_cpu = sum(watch.used for watch in exporter_cpus)
    by_thread: dict[str, float] = {}
    for threads in exporter_threads:
        for name, used in threads.used_by_name().items():
            by_thread[name] = by_thread.get(name, 0.0) + used
    time.sleep(0.2)  # the last answer is on its way to the exporter before it exits
    self_cpu = time.process_time() - self_cpu0
    receiver.settle()
    got = receiver.spans_received
    done_s = receiver.last_at - t0
    print(
        json.dumps(
            {
                "journeys": n,
                "offered_per_s": offered or "as fast as taken, no drops",
                "receiver": args.receiver,
                "exporter_processes": args.exporters,
                "submit_s": round(submit_s, 2),
                # The submission's window on CLOCK_MONOTONIC (yield_handover.py).
                "submit_mono_ns": [t0_mono_ns, t1_mono_ns],
                "last_span_received_s": round(done_s, 2),
                "journeys_per_s_end_to_end": round(n / done_s),
                "spans_expected": expected_spans,
                "spans_received": got,
                # Spans that did not arrive, lost at any stage (hand-off, pipe,
                # the exporter's span queue, export): the rate counts only if 0.
                "spans_lost": expected_spans - got,
                "journeys_lost_in_handoff": pipeline.losses.by_reason(),
                "exporters_exited": exporters_exited,
                "cpu_s_drain_thread": round(drain_cpu.used, 2),
                "cpu_s_rest_of_this_process": round(self_cpu - drain_cpu.used, 2),
                "cpu_s_exporter_processes": round(exporter_cpu, 2),
                "exporter_cpu_us_per_journey": round(exporter_cpu / n * 1e6),
                # By thread name, until each exporter's last reading before it
                # exited (its final moments are in the line above only).
                "exporter_cpu_us_per_journey_by_thread": {
                    name: round(used / n * 1e6, 1)
                    for name, used in sorted(by_thread.items(), key=lambda kv: -kv[1])
                },
            },
            indent=2,
        )
    )
    receiver.stop()


if __name__ == "__main__":
    main()
