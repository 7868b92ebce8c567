"""Exporter-side backpressure (backpressure.py): span building waits for room in
the SDK's span queue while export works, and never while it is down or stuck."""

from __future__ import annotations

import pytest

from vllm_journey_otel.backpressure import (
    MAX_CHUNK_SPANS,
    POLL_S,
    SDK_MAX_BATCH,
    SDK_MAX_QUEUE,
    STALL_S,
    SpanQueueRoom,
    bsp_sizes,
    spans_of,
)
from vllm_journey_otel.health import ExportHealth
from vllm_journey_otel.spans import plan_spans


class Worker:
    """Stands in for the SDK's batch worker thread, which this single-threaded
    test cannot run between the waiting loop's polls: each poll (a sleep) lets
    it export ``per_poll`` spans or fail them. The counters it moves are the real
    ExportHealth's, through its real methods."""

    def __init__(self, health: ExportHealth, per_poll: int = 0, fail: bool = False) -> None:
        self.health = health
        self.per_poll = per_poll
        self.fail = fail
        self.now = 0.0
        self.polls = 0

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self.polls += 1
        n = min(self.per_poll, self.health.backlog)
        if n and self.fail:
            self.health.failed(n, "test")
        elif n:
            self.health.exported(n, "test")


def _health(built: int) -> ExportHealth:
    h = ExportHealth()
    h.exporting = True
    h.spans_built = built
    return h


def test_waits_until_the_chunk_fits_while_export_works() -> None:
    health = _health(built=1000)
    worker = Worker(health, per_poll=50)
    room = SpanQueueRoom(health, 1000, 100, clock=worker.clock, sleep=worker.sleep)
    room.wait(160)  # 160 spans of room: the backlog must fall to 840
    assert health.backlog <= 1000 - 160
    assert worker.polls == 4 and room.waited_s == pytest.approx(4 * POLL_S)
    polls = worker.polls
    room.wait(160)  # room now: no wait
    assert worker.polls == polls


def test_never_waits_in_an_outage_or_without_an_exporter() -> None:
    health = _health(built=1000)
    worker = Worker(health, per_poll=100, fail=True)
    room = SpanQueueRoom(health, 1000, 100, clock=worker.clock, sleep=worker.sleep)
    room.wait(160)  # the first poll's export fails: outage, stop waiting
    assert worker.polls == 1 and health.in_outage
    room.wait(160)
    assert worker.polls == 1, "in an outage the queue drops as before; nobody waits"
    health.exported(1, "test")  # it works again: waiting resumes
    assert not health.in_outage
    room.wait(160)
    assert worker.polls > 1

    quiet = ExportHealth()  # OTEL_TRACES_EXPORTER=none: nothing is ever exported
    quiet.spans_built = 10_000
    idle = Worker(quiet)
    SpanQueueRoom(quiet, 100, 10, clock=idle.clock, sleep=idle.sleep).wait(16)
    assert idle.polls == 0


def test_a_stuck_export_is_waited_for_once_then_not_until_it_moves() -> None:
    health = _health(built=1000)
    worker = Worker(health, per_poll=0)  # an export that never returns
    room = SpanQueueRoom(health, 1000, 100, clock=worker.clock, sleep=worker.sleep)
    room.wait(160)
    assert room.stalls == 1 and worker.now == pytest.approx(STALL_S, abs=2 * POLL_S)
    polls = worker.polls
    room.wait(160)
    assert worker.polls == polls, "stuck: no second wait of STALL_S per chunk"
    health.exported(1, "test")  # the export returned: waiting applies again
    worker.per_poll = 100
    room.wait(160)
    assert worker.polls > polls and health.backlog <= 1000 - 160


def test_the_backlog_may_reach_a_batch_so_the_sdk_worker_wakes() -> None:
    """The SDK's worker exports when its queue holds a full batch (else only on
    its timer): waiting below that would make export run on the timer alone.
    A queue of 2,048 with the exporter's 2,048-span batches (a user who set
    only OTEL_BSP_MAX_QUEUE_SIZE) must not wait at half the queue."""
    health = _health(built=1500)  # queued, below a batch: the worker sleeps
    worker = Worker(health, per_poll=1)
    room = SpanQueueRoom(health, 2048, 2048, clock=worker.clock, sleep=worker.sleep)
    assert room.budget == 16, "a chunk still brings something"
    room.wait(16)
    assert worker.polls == 0
    health.spans_built = 2048 + 16  # a batch in flight and more queued
    worker.per_poll = 1024  # the batch's export returns
    room.wait(16)
    assert worker.polls == 1 and health.backlog <= 2048


def test_chunk_budget_is_the_queue_above_one_batch() -> None:
    h = ExportHealth()
    assert SpanQueueRoom(h, 32768, 2048).budget == MAX_CHUNK_SPANS
    assert SpanQueueRoom(h, 200, 50).budget == 150
    assert SpanQueueRoom(h, 40, 10).budget == 30


def test_spans_of_bounds_the_plan_of_every_journey_shape() -> None:
    """The chunking counts on spans_of() being at least what spans.py builds."""
    from vllm_journey_otel.journey import STATUS_ABORTED, STATUS_LENGTH, RequestJourney

    shapes = []
    for preemptions in (0, 1, 5):
        j = RequestJourney("r", 0.0, 10, 0, 100, 64)
        j.wait_began(11, 0, 0)
        j.wait_ended(12, 0)
        step = 1
        for _ in range(preemptions):
            j.scheduled(20 * step, step, 0, 50, 100, 0)
            j.stepped(step + 1, 50, 100)
            j.tokens(20 * step + 5, step + 1, 1)
            j.preempted(20 * step + 9, step + 2, 100, 1, 0.9, 8, 3)
            step += 3
        j.scheduled(20 * step, step, 0, 100, 101, 1)
        j.tokens(20 * step + 5, step, 2)
        shapes.append(j.finish(20 * step + 9, step + 1, STATUS_LENGTH, "length", 9, 20 * step))
    queued = RequestJourney("q", 0.0, 10, 0, 100, 64)
    shapes.append(queued.finish(30, 2, STATUS_ABORTED, "abort", 0, None))
    for fj in shapes:
        assert fj is not None
        assert spans_of(fj) >= len(plan_spans(fj, 0)), len(fj.events)


def test_queue_and_batch_read_as_the_sdk_reads_them() -> None:
    assert bsp_sizes({}) == (SDK_MAX_QUEUE, SDK_MAX_BATCH)
    env = {"OTEL_BSP_MAX_QUEUE_SIZE": "32768", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "2048"}
    assert bsp_sizes(env) == (32768, 2048)
    assert bsp_sizes({"OTEL_BSP_MAX_QUEUE_SIZE": "lots"}) == (SDK_MAX_QUEUE, SDK_MAX_BATCH)
    assert bsp_sizes({"OTEL_BSP_MAX_QUEUE_SIZE": "0"}) == (SDK_MAX_QUEUE, SDK_MAX_BATCH)
    assert bsp_sizes({"OTEL_BSP_MAX_QUEUE_SIZE": "100"}) == (100, 100)  # batch <= queue


def _frame_of(n: int):  # type: ignore[no-untyped-def]
    import time as _time

    from vllm_journey_otel.journey import STATUS_LENGTH, RequestJourney
    from vllm_journey_otel.sinks import Frame

    out = []
    base = _time.monotonic_ns()
    for i in range(n):
        t = base + i * 1_000_000
        j = RequestJourney(f"req-{i}", _time.time(), t, i, 100, 8)
        j.scheduled(t + 1_000, i, 0, 100, 100, 0)
        j.tokens(t + 2_000, i, 1)
        out.append(j.finish(t + 3_000, i, STATUS_LENGTH, "length", 8, t + 3_000))
    return Frame(out, 0)


class Recording:
    """A real SpanSink (in-memory exporter) whose consume calls are recorded."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )

        from vllm_journey_otel.provider import make_tracer_provider
        from vllm_journey_otel.sinks import SpanSink

        self.memory = InMemorySpanExporter()
        self.sink = SpanSink(make_tracer_provider({}, exporters=[self.memory], batch=False))
        self.chunks: list[list[str]] = []
        orig = self.sink.consume

        def consume(batch, engine_dropped=0, deadline=None):  # type: ignore[no-untyped-def]
            self.chunks.append([j.request_id for j in batch])
            return orig(batch, engine_dropped, deadline)

        self.sink.consume = consume  # type: ignore[method-assign]


def test_a_frame_is_built_in_chunks_that_fit_the_queue_above_a_batch() -> None:
    from vllm_journey_otel.exporter_process import consume

    rec = Recording()
    room = SpanQueueRoom(rec.sink.health, 200, 50)  # budget 150 spans
    frame = _frame_of(100)  # 100 journeys of 5 spans each (spans_of: 6)
    consume(rec.sink, frame, room)  # type: ignore[arg-type]
    assert [i for c in rec.chunks for i in c] == [f"req-{i}" for i in range(100)]
    assert all(sum(spans_of(j) for j in frame.journeys if j.request_id in c) <= 150
               for c in map(set, rec.chunks))  # fmt: skip
    assert len(rec.chunks) == 4  # 25 journeys (150 spans) per chunk
    assert len(rec.memory.get_finished_spans()) == sum(
        len(plan_spans(j, 0)) for j in frame.journeys
    )


def test_a_stop_request_reads_what_is_in_the_pipe_then_ends() -> None:
    """The exporter's SIGTERM is a flag: the reader hands out every frame already
    in the pipe (and in its buffer), once each, then ends without waiting for
    more, although the writer is still there."""
    import os
    import threading

    from vllm_journey_otel.sinks import FrameReader, PipeSink

    r, w = os.pipe()
    stop = threading.Event()
    try:
        frames = [PipeSink._frame(_frame_of(3).journeys, 0) for _ in range(5)]
        os.write(w, b"".join(frames) + frames[0][:7])  # and a partial frame
        got: list[object] = []
        with os.fdopen(os.dup(r), "rb") as f:
            reader = FrameReader()
            for frame in reader.frames(f, pace_s=0.05, stop=stop.is_set):
                got.append(frame)
                stop.set()  # SIGTERM after the first frame
        assert len(got) == 5, "every whole frame in the pipe, none twice"
    finally:
        os.close(r)
        os.close(w)


def test_exporter_env_fits_the_batch_to_a_users_queue() -> None:
    from vllm_journey_otel.exporter_launch import EXPORTER_BSP_DEFAULTS, exporter_env

    assert {k: exporter_env({})[k] for k in EXPORTER_BSP_DEFAULTS} == EXPORTER_BSP_DEFAULTS
    # A queue below our 2,048-span batch: the SDK would refuse the batch and the
    # exporter would not start. Half the queue instead.
    small = exporter_env({"OTEL_BSP_MAX_QUEUE_SIZE": "1000"})
    assert small["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] == "500"
    assert (
        exporter_env({"OTEL_BSP_MAX_QUEUE_SIZE": "100000"})["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"]
        == "2048"
    )
    # Empty is unset (a compose file's VAR: ${VAR}); a value int() refuses is left
    # to the SDK (it warns and uses its default) and sizes nothing here.
    assert exporter_env({"OTEL_BSP_MAX_QUEUE_SIZE": " "})["OTEL_BSP_MAX_QUEUE_SIZE"] == "32768"
    odd = exporter_env({"OTEL_BSP_MAX_QUEUE_SIZE": "²"})
    assert odd["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] == "2048"
    # What the user set is theirs.
    both = {"OTEL_BSP_MAX_QUEUE_SIZE": "1000", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "900"}
    assert exporter_env(both)["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] == "900"
