"""Exporter-side backpressure (backpressure.py): span building waits for room in
the SDK's span queue while export works, and never while it is down or stuck."""

from __future__ import annotations

import pytest

from vllm_journey_otel.backpressure import (
    POLL_S,
    SDK_MAX_QUEUE,
    STALL_S,
    SpanQueueRoom,
    max_queue_size,
)
from vllm_journey_otel.health import ExportHealth


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
    room = SpanQueueRoom(health, max_queue=1000, clock=worker.clock, sleep=worker.sleep)
    room.wait(10)  # needs 160 spans of room: the backlog must fall to 840
    assert health.backlog <= 1000 - 160
    assert worker.polls == 4 and room.waited_s == pytest.approx(4 * POLL_S)
    polls = worker.polls
    room.wait(10)  # room now: no wait
    assert worker.polls == polls


def test_never_waits_in_an_outage_or_without_an_exporter() -> None:
    health = _health(built=1000)
    worker = Worker(health, per_poll=100, fail=True)
    room = SpanQueueRoom(health, max_queue=1000, clock=worker.clock, sleep=worker.sleep)
    room.wait(10)  # the first poll's export fails: outage, stop waiting
    assert worker.polls == 1 and health.in_outage
    room.wait(10)
    assert worker.polls == 1, "in an outage the queue drops as before; nobody waits"
    health.exported(1, "test")  # it works again: waiting resumes
    assert not health.in_outage
    room.wait(10)
    assert worker.polls > 1

    quiet = ExportHealth()  # OTEL_TRACES_EXPORTER=none: nothing is ever exported
    quiet.spans_built = 10_000
    idle = Worker(quiet)
    SpanQueueRoom(quiet, 100, clock=idle.clock, sleep=idle.sleep).wait(10)
    assert idle.polls == 0


def test_a_stuck_export_is_waited_for_once_then_not_until_it_moves() -> None:
    health = _health(built=1000)
    worker = Worker(health, per_poll=0)  # an export that never returns
    room = SpanQueueRoom(health, max_queue=1000, clock=worker.clock, sleep=worker.sleep)
    room.wait(10)
    assert room.stalls == 1 and worker.now == pytest.approx(STALL_S, abs=2 * POLL_S)
    polls = worker.polls
    room.wait(10)
    assert worker.polls == polls, "stuck: no second wait of STALL_S per chunk"
    health.exported(1, "test")  # the export returned: waiting applies again
    worker.per_poll = 100
    room.wait(10)
    assert worker.polls > polls and health.backlog <= 1000 - 160


def test_a_queue_smaller_than_the_chunk_never_deadlocks() -> None:
    health = _health(built=0)
    worker = Worker(health, per_poll=1)
    room = SpanQueueRoom(health, max_queue=40, clock=worker.clock, sleep=worker.sleep)
    room.wait(64)  # asks at most half the queue: an empty queue always fits
    assert worker.polls == 0
    health.spans_built = 40
    room.wait(64)
    assert health.backlog <= 20


def test_queue_size_read_as_the_sdk_reads_it() -> None:
    assert max_queue_size({}) == SDK_MAX_QUEUE
    assert max_queue_size({"OTEL_BSP_MAX_QUEUE_SIZE": "32768"}) == 32768
    assert max_queue_size({"OTEL_BSP_MAX_QUEUE_SIZE": "lots"}) == SDK_MAX_QUEUE
    assert max_queue_size({"OTEL_BSP_MAX_QUEUE_SIZE": "0"}) == SDK_MAX_QUEUE
