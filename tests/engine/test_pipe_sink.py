"""The engine side of the exporter pipes: frames spread over several exporters by
bytes sent, a full pipe skipped, a partial frame finished on its own pipe, a gone exporter left
out; and two real exporter processes fed by one sink deliver every span. And the exporter's
resource keeps its hash (the SDK's OTLP encoder hashes it once per span)."""

from __future__ import annotations

import contextlib
import fcntl
import io
import itertools
import os
import re
import threading
import time
from collections import deque
from collections.abc import Iterator

import pytest

from conftest import requires_vllm
from otlp_receiver import Receiver
from records import journeys
from services import wait_exited, wait_until
from vllm_journey_otel import schema as S
from vllm_journey_otel.engine.exporter_launch import F_SETPIPE_SZ
from vllm_journey_otel.engine.pipe_sink import PipeSink
from vllm_journey_otel.engine.pipeline import JourneyPipeline
from vllm_journey_otel.export.spans import plan_spans
from vllm_journey_otel.losses import Loss
from vllm_journey_otel.wire import read_frames


def ids(frames: list) -> list[str]:  # type: ignore[type-arg]
    return [j.request_id for f in frames for j in f.journeys]


@pytest.fixture
def pipes() -> Iterator[list[tuple[int, int]]]:
    made = [os.pipe() for _ in range(2)]
    yield made
    for r, w in made:
        for fd in (r, w):
            with contextlib.suppress(OSError):
                os.close(fd)


def read_all(fd: int) -> list:  # type: ignore[type-arg]
    with os.fdopen(os.dup(fd), "rb") as f:
        return list(read_frames(f))


def test_frames_go_to_the_exporter_sent_the_fewest_bytes(pipes) -> None:  # type: ignore[no-untyped-def]
    sink = PipeSink([w for _, w in pipes])
    assert sink.offer(journeys(2, 0))  # a tie: the first pipe
    assert sink.offer(journeys(2, 2))
    assert sink.offer(journeys(40, 100))  # a big frame (the drain thread's)...
    for k in range(4):  # ...then the small ones go to the other exporter
        assert sink.offer(journeys(2, 4 + 2 * k))
    sink.shutdown(1)
    first, second = (read_all(r) for r, _ in pipes)
    assert ids(first) == ["req-0", "req-1"] + [f"req-{i}" for i in range(100, 140)]
    assert ids(second) == [f"req-{i}" for i in (2, 3, *range(4, 12))]


def test_a_full_pipe_is_skipped_and_all_full_declines(pipes) -> None:  # type: ignore[no-untyped-def]
    (_r1, w1), (r2, w2) = pipes
    fcntl.fcntl(w1, F_SETPIPE_SZ, 4096)
    os.write(w1, b"\0" * 4096)  # full: that exporter is behind
    sink = PipeSink([w1, w2])
    for k in range(3):
        assert sink.offer(journeys(1, k))
    assert ids(list(read_frames(io.BytesIO(os.read(r2, 1 << 20))))) == ["req-0", "req-1", "req-2"]
    # Both full: the engine thread never blocks, the journeys stay in its queue.
    fcntl.fcntl(w2, F_SETPIPE_SZ, 4096)
    os.write(w2, b"\0" * 4096)
    assert not sink.offer(journeys(1, 9))
    assert not sink.pending and sink.losses.carried == 0


def test_every_pipe_full_declines_before_encoding_the_frame(pipes) -> None:  # type: ignore[no-untyped-def]
    """An owner whose exporters are behind hands on its whole queue every
    interval: with every pipe full, the frame is not encoded for nothing (a
    queue of 16,384 journeys took milliseconds of the engine thread's each time)."""
    (_r1, w1), (r2, w2) = pipes
    for w in (w1, w2):
        fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
        os.write(w, b"\0" * 4096)
    sink = PipeSink([w1, w2])
    encoded: list[int] = []
    frame = sink._frame

    def counted(batch, dropped):  # type: ignore[no-untyped-def]
        encoded.append(len(batch))
        return frame(batch, dropped)

    sink._frame = counted  # type: ignore[method-assign]
    batch = journeys(2000)
    for _ in range(5):
        assert not sink.offer(batch)
    assert encoded == [] and not sink.pending
    os.read(r2, 4096)  # that exporter read: room again
    assert sink.offer(batch)
    assert encoded == [2000] and sink.pending  # written in part; the rest is the drain's


def test_an_offer_declined_after_all_is_put_back_in_order(pipes) -> None:  # type: ignore[no-untyped-def]
    """A pipe whose exporter is gone polls as "room" (POLLERR); the write then
    finds it gone and the other pipe full: the queue goes back as it was."""
    (r1, w1), (_r2, w2) = pipes
    os.close(r1)  # that exporter is gone
    fcntl.fcntl(w2, F_SETPIPE_SZ, 4096)
    os.write(w2, b"\0" * 4096)  # the other one is behind
    sink = PipeSink([w1, w2])
    pipeline = JourneyPipeline(sink, start_thread=False)
    batch = journeys(50)
    for j in batch:
        pipeline.submit(j)
    assert sink.may_take()
    pipeline.publish_due(time.monotonic_ns(), force=True)
    assert list(pipeline._queue) == batch and pipeline.published == 0
    assert pipeline._declined and sink.exporters == 1  # the gone one left out


class CountingDeque(deque):  # type: ignore[type-arg]
    """The pipeline's queue, counting what is taken out of it."""

    taken = 0

    def popleft(self):  # type: ignore[no-untyped-def]
        self.taken += 1
        return super().popleft()


def test_a_declined_hand_off_leaves_the_queue_where_it_is(pipes) -> None:  # type: ignore[no-untyped-def]
    """While every pipe is full, the owner's hand-off (every interval) does not
    take its queue out and put it back: O(queue), milliseconds at 16,384."""
    (_r1, w1), (r2, w2) = pipes
    for w in (w1, w2):
        fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
        os.write(w, b"\0" * 4096)
    pipeline = JourneyPipeline(PipeSink([w1, w2]), start_thread=False)
    queue = pipeline._queue = CountingDeque()
    batch = journeys(3000)
    for j in batch:
        pipeline.submit(j)
    for _ in range(5):
        pipeline.publish_due(time.monotonic_ns(), force=True)
    assert queue.taken == 0 and list(queue) == batch  # untouched, in order
    # The owner's to retry at its next call: the drain thread sleeps on.
    assert pipeline._declined and not pipeline._wake.is_set()
    os.read(r2, 4096)  # that exporter read: room again
    pipeline.publish_due(time.monotonic_ns(), force=True)
    assert queue.taken == 3000 and pipeline.queued == 0
    assert not pipeline._declined and pipeline.published == 3000


def test_partial_frame_is_finished_on_its_own_pipe(pipes) -> None:  # type: ignore[no-untyped-def]
    (r1, w1), (r2, w2) = pipes
    for w in (w1, w2):
        fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    sink = PipeSink([w1, w2])
    big = journeys(200)  # far more than one 4 KiB pipe holds
    assert sink.offer(big)
    assert sink.pending
    got: dict[int, list] = {}  # type: ignore[type-arg]

    def reader(r: int) -> None:
        got[r] = read_all(r)

    threads = [threading.Thread(target=reader, args=(r,)) for r in (r1, r2)]
    for t in threads:
        t.start()
    assert not sink.offer(journeys(1, 500)), "the partial frame goes first"
    assert sink.consume(journeys(1, 500)) == 0
    assert not sink.pending
    sink.shutdown(1)
    for t in threads:
        t.join(10)
    assert ids(got[r1]) == [j.request_id for j in big]
    assert ids(got[r2]) == ["req-500"]


def test_a_partial_frame_whose_exporter_dies_is_counted_and_its_fd_never_written(pipes) -> None:  # type: ignore[no-untyped-def]
    """The start of a frame went to an exporter that then died: the rest is
    dropped and counted, and that descriptor number (which the next pipe opened
    may reuse) is never written to again."""
    (r1, w1), (r2, w2) = pipes
    fcntl.fcntl(w1, F_SETPIPE_SZ, 4096)
    sink = PipeSink([w1, w2])
    fcntl.fcntl(w2, F_SETPIPE_SZ, 4096)
    os.write(w2, b"\0" * 4096)  # the second one full: the big frame starts on w1
    big = journeys(200)
    assert sink.offer(big) and sink.pending
    os.close(r1)  # that exporter dies
    sink.maintain()  # the drain thread notices it (its pipe reports the reader gone)
    assert not sink.pending and sink.exporters == 1
    assert sink.losses[Loss.EXPORTER_DIED] == sink.losses.carried == 200
    os.read(r2, 4096)  # the second exporter catches up
    assert sink.consume(journeys(1, 300)) == 0
    got = read_frames(io.BytesIO(os.read(r2, 1 << 20)))
    frame = next(iter(got))
    assert ids([frame]) == ["req-300"]
    assert frame.engine_dropped == 200, "the loss travels to the roots"


def test_a_gone_exporter_is_left_out_then_none_is_broken(pipes) -> None:  # type: ignore[no-untyped-def]
    (r1, w1), (r2, w2) = pipes
    sink = PipeSink([w1, w2])
    os.close(r1)  # the first exporter died
    for k in range(3):
        assert sink.offer(journeys(1, k))
    assert sink.exporters == 1 and not sink.broken and sink.losses.carried == 0
    assert sink.consume(journeys(1, 3)) == 0
    os.close(r2)
    # The last one goes during the offer: declined, so the pipeline queues the
    # batch and its drain (consume) counts it as failed, once.
    assert not sink.offer(journeys(2, 4))
    assert sink.broken and sink.losses.carried == 0
    assert sink.consume(journeys(2, 4)) == 2
    assert sink.losses.by_reason() == {"no_exporter": 2}
    assert not sink.offer(journeys(1, 7))


def test_snapshots_lost_are_counted_as_snapshots_never_as_journeys(pipes) -> None:  # type: ignore[no-untyped-def]
    """With no exporter left, a batch of journeys and in-flight snapshots is
    lost: each counted under its own reason; only the journeys travel to the
    roots' dropped_journeys."""
    from vllm_journey_otel.journey import InFlight

    (r1, w1), _ = pipes
    sink = PipeSink(w1)
    os.close(r1)
    assert not sink.offer(journeys(1))  # the only exporter is gone: declined
    finished = journeys(3)
    snapshots = [InFlight(journey=j, seq=1, state=1, wait_reason=-1) for j in finished[:2]]
    assert sink.consume([*snapshots, finished[2]]) == 3
    assert sink.losses.by_reason() == {"no_exporter": 1, "snapshot": 2}
    assert sink.losses.carried == 1
    assert sink.losses.describe() == (
        "1 no exporter process was running; 2 in-flight snapshots not handed on"
    )


def test_two_real_exporters_deliver_every_span(monkeypatch, capfd) -> None:  # type: ignore[no-untyped-def]
    receiver = Receiver()
    receiver.start_grpc()
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{receiver.grpc_port}"
    )
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    try:
        sink = PipeSink.start({"service.name": "two"}, processes=2)
        assert sink.exporters == 2 and len(set(sink.pids)) == 2
        batch = journeys(40)
        for k in range(0, 40, 5):
            assert sink.consume(batch[k : k + 5]) == 0
        sink.shutdown(5)
        expected = sum(len(plan_spans(j, 0)) for j in batch)
        spans = wait_until(
            lambda: len(receiver.spans()) >= expected and receiver.spans(), 60, 0.1, "spans"
        )
        roots = [s for s in spans if s.name == S.SPAN_REQUEST]
        assert sorted(r.attrs[S.REQUEST_ID] for r in roots) == sorted(j.request_id for j in batch)
        assert len(spans) == expected
        # Each exporter got half the frames (equal sizes), and says so when it exits.
        wait_exited(sink.pids, 30)
        assert capfd.readouterr().err.count("20 journeys received, 100 spans built") == 2
    finally:
        receiver.stop()


def test_resource_hash_is_kept_and_equal_to_the_sdks() -> None:
    from opentelemetry.sdk.resources import Resource

    from vllm_journey_otel.export.exporters import make_resource

    resource = make_resource({S.RES_MODEL: "m", S.RES_PID: 7})
    plain = Resource(resource.attributes, resource.schema_url)
    assert hash(resource) == hash(plain) == hash(resource)
    assert resource == plain and {plain: 1}[resource] == 1
    assert resource.attributes[S.RES_SERVICE_NAME] == S.DEFAULT_SERVICE_NAME


def test_an_exporter_gone_in_the_middle_of_a_frame(pipes) -> None:  # type: ignore[no-untyped-def]
    (r1, w1), (r2, w2) = pipes
    fcntl.fcntl(w1, F_SETPIPE_SZ, 4096)
    sink = PipeSink([w1, w2])
    assert sink.offer(journeys(200))  # its start in the first pipe, the rest pending
    assert sink.pending
    os.close(r1)
    # The partial frame is lost (and counted); the new batch goes to the other one.
    sink.losses.add(Loss.QUEUE_FULL, 7)  # and the queue had dropped 7 (one account)
    assert sink.consume(journeys(1, 500)) == 0
    assert sink.losses[Loss.EXPORTER_DIED] == 200 and sink.exporters == 1 and not sink.pending
    sink.shutdown(1)
    (frame,) = read_all(r2)
    assert ids([frame]) == ["req-500"]
    # The pipeline never heard of the 200 (offer had taken them): the next frame
    # carries them with the queue's drops (to the roots' attribute).
    assert frame.engine_dropped == 7 + 200
    assert sink.losses.by_reason() == {"queue_full": 7, "exporter_died": 200}


def test_paced_reader_frames_split_anywhere_and_reads_spaced(pipes) -> None:  # type: ignore[no-untyped-def]
    """The exporter's paced read (wire.read_frames with pace_s): frames cut at any
    byte by the pipe come out whole and in order, without waiting while one is
    incomplete; once the reader has caught up, its next read waits out the pace
    (a writer meanwhile wakes nobody); a frame cut short by end-of-file is dropped."""
    (r, w), _ = pipes
    frames = [PipeSink._frame(journeys(3, 10 * k), 0) for k in range(6)]
    split = b"".join(frames[:4])
    cut_a, cut_b = len(b"".join(frames[:2])) + 2, len(b"".join(frames[:3])) + 7
    got: list[tuple[float, list[str]]] = []

    def writer() -> None:
        # Frames 0-3 in three bursts cut mid-header and mid-payload, 20 ms apart;
        # then, 50 ms later, frames 4-5 whole; then a truncated frame.
        for a, b in itertools.pairwise([0, cut_a, cut_b, len(split)]):
            os.write(w, split[a:b])
            time.sleep(0.02)
        time.sleep(0.05)
        os.write(w, frames[4] + frames[5])
        os.write(w, PipeSink._frame(journeys(1, 99), 0)[:-3])
        os.close(w)

    t = threading.Thread(target=writer)
    began = time.monotonic()
    t.start()
    with os.fdopen(os.dup(r), "rb") as f:
        for frame in read_frames(f, pace_s=1.0):
            got.append((time.monotonic() - began, [j.request_id for j in frame.journeys]))
    t.join()
    want = [f"req-{10 * k + i}" for k in range(6) for i in range(3)]
    assert [i for _, f in got for i in f] == want
    at = [t for t, _ in got]
    # Frames 0-3: as their bytes came (no pause inside a frame), within ~0.05 s
    # (bounded with room for a loaded machine: well before the pause's end).
    assert at[3] < 0.8
    # Frames 4-5 were written at ~0.11 s; the reader, caught up after frame 3
    # (~0.04 s), read again only after the pause: at >= 1 s, not at 0.11.
    assert at[4] >= 1.0


def test_paced_reader_does_not_pause_inside_a_frame(pipes) -> None:  # type: ignore[no-untyped-def]
    """A frame larger than the pipe arrives in pieces: the reader keeps reading
    while a frame is incomplete instead of pausing after every piece."""
    (r, w), _ = pipes
    fcntl.fcntl(w, F_SETPIPE_SZ, 65536)
    big = PipeSink._frame(journeys(4000), 0)
    assert len(big) > 8 * 65536, "precondition: many pipe-fulls"
    t = threading.Thread(target=lambda: (os.write(w, big), os.close(w)))
    began = time.monotonic()
    t.start()
    with os.fdopen(os.dup(r), "rb") as f:
        frames = [(time.monotonic(), frame) for frame in read_frames(f, pace_s=2.0)]
    t.join()
    ((at, frame),) = frames
    assert len(frame.journeys) == 4000
    assert at - began < 2.0  # one pause per piece would take over 16 s


def test_paced_reader_reads_again_at_once_when_half_the_pipe_came(pipes) -> None:  # type: ignore[no-untyped-def]
    """Where the system leaves the pipe at 64 KiB, a pause after a read of half
    of it or more could let the pipe fill and the engine side's writes be
    declined: such a read is followed by the next one at once."""
    (r, w), _ = pipes
    fcntl.fcntl(w, F_SETPIPE_SZ, 65536)
    first = PipeSink._frame(journeys(300), 0)
    assert 32768 <= len(first) < 65536, f"precondition: {len(first)} bytes"
    os.write(w, first)

    def later() -> None:
        time.sleep(0.1)
        os.write(w, PipeSink._frame(journeys(1, 500), 0))
        os.close(w)

    t = threading.Thread(target=later)
    with os.fdopen(os.dup(r), "rb") as f:
        began = time.monotonic()
        t.start()
        at = [time.monotonic() - began for _ in read_frames(f, pace_s=3.0)]
    t.join()
    assert len(at) == 2
    assert at[1] < 2.0, f"the second frame came out {at[1]:.2f} s in (pace 3 s)"


def test_paced_reader_busy_with_its_frames_reads_again_at_once(pipes) -> None:  # type: ignore[no-untyped-def]
    """An exporter whose handling of a read's frames took half the pace or more
    is near its capacity: a pause would cost it throughput, so it reads again
    at once (the pause is for an exporter with time to spare)."""
    (r, w), _ = pipes
    os.write(w, PipeSink._frame(journeys(2), 0))

    def later() -> None:
        time.sleep(0.1)
        os.write(w, PipeSink._frame(journeys(1, 500), 0))
        os.close(w)

    t = threading.Thread(target=later)
    at = []
    with os.fdopen(os.dup(r), "rb") as f:
        began = time.monotonic()
        t.start()
        for _ in read_frames(f, pace_s=2.0):
            at.append(time.monotonic() - began)
            if len(at) == 1:
                time.sleep(1.2)  # handling the first read's frames: 0.6 of the pace
    t.join()
    assert len(at) == 2
    assert at[1] < 1.8, f"the second frame came out {at[1]:.2f} s in (pace 2 s)"


def test_reader_on_a_drained_non_blocking_pipe_returns(pipes) -> None:  # type: ignore[no-untyped-def]
    """The exporter's last drain at SIGTERM: what is in the pipe comes out, then
    the read ends instead of blocking (the writer is still open)."""
    (r, w), _ = pipes
    for k in range(2):
        os.write(w, PipeSink._frame(journeys(2, 10 * k), 0))
    os.set_blocking(r, False)
    with os.fdopen(os.dup(r), "rb") as f:
        assert ids(list(read_frames(f))) == ["req-0", "req-1", "req-10", "req-11"]


def test_drop_warning_names_the_lever_of_each_sink(caplog: pytest.LogCaptureFixture) -> None:
    """A full engine queue is logged with what to change: more exporter processes
    when the pipes are full, the process mode when spans are built in-process."""
    import logging

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from vllm_journey_otel.export.span_sink import SpanSink

    r, w = os.pipe()
    sinks = [
        PipeSink(w),
        SpanSink.from_env({}, exporters=[InMemorySpanExporter()], threaded=False),
    ]
    try:
        for sink, lever in zip(
            sinks,
            ("VLLM_JOURNEY_OTEL_EXPORTER_PROCESSES", "VLLM_JOURNEY_OTEL_EXPORT_MODE=process"),
            strict=True,
        ):
            caplog.clear()
            pipeline = JourneyPipeline(sink, max_queue=2, start_thread=False)
            for j in journeys(5):
                pipeline.submit(j)
            assert pipeline.losses[Loss.QUEUE_FULL] == 3 and pipeline.queued == 2
            with caplog.at_level(logging.WARNING, logger="vllm.journey_otel"):
                pipeline._report_drops()
            messages = [m.getMessage() for m in caplog.records]
            assert len(messages) == 1 and "3 finished journeys dropped so far" in messages[0]
            assert lever in messages[0], messages[0]
    finally:
        for fd in (r, w):
            with contextlib.suppress(OSError):
                os.close(fd)


def test_drain_thread_leaves_the_queue_to_a_stepping_engine(pipes) -> None:  # type: ignore[no-untyped-def]
    """The drain thread is a backstop: while the engine thread calls publish_due,
    the queue is the engine's, declined offers and a frame's rest too (a drain
    would take the GIL from it and split its frames); when the engine says it
    is about to idle, or stopped calling, the drain thread takes over."""
    from vllm_journey_otel.engine.pipeline import PUBLISH_INTERVAL_NS, JourneyPipeline

    r, w = pipes[0]
    fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    sink = PipeSink(w)
    pipeline = JourneyPipeline(sink, start_thread=False)
    t0 = time.monotonic_ns()
    assert not pipeline.engine_hands_on(t0)  # the engine never called: drain
    for j in journeys(2):
        pipeline.submit(j)
    pipeline.publish_due(t0)
    assert pipeline.published == 2 and pipeline.queued == 0
    # Journeys finished since: the engine hands them on at its next due step.
    for j in journeys(2, start=2):
        pipeline.submit(j)
    assert pipeline.engine_hands_on(t0 + PUBLISH_INTERVAL_NS)
    assert pipeline.due_ns == t0 + PUBLISH_INTERVAL_NS, "the engine calls again from then"
    # Due a step's length ago, still the engine's; the engine stopped calling
    # (a step that takes seconds): drain.
    assert pipeline.engine_hands_on(t0 + 2 * PUBLISH_INTERVAL_NS)
    assert not pipeline.engine_hands_on(t0 + 3 * PUBLISH_INTERVAL_NS)
    # A full pipe: the engine's offer is declined, and still the engine's to
    # retry while it calls (a drain would only take the GIL from it).
    for size in (1024, 1):  # writes up to PIPE_BUF are all or nothing: fill every byte
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(w, b"\0" * size)
    pipeline.publish_due(t0 + PUBLISH_INTERVAL_NS)
    assert pipeline.queued == 2, "declined: left in the queue"
    assert pipeline.engine_hands_on(t0 + PUBLISH_INTERVAL_NS)
    assert not pipeline.engine_hands_on(t0 + 4 * PUBLISH_INTERVAL_NS), "it stopped calling"
    # The engine about to idle with the pipe still full: the drain thread's.
    pipeline.publish_due(t0 + PUBLISH_INTERVAL_NS, force=True, idle=True)
    assert pipeline.queued == 2 and pipeline._wake.is_set()
    assert not pipeline.engine_hands_on(t0 + PUBLISH_INTERVAL_NS)
    # Room again and the next offer goes through: the engine's queue once more.
    os.read(r, 1 << 16)
    for j in journeys(1, start=4):
        pipeline.submit(j)
    pipeline.publish_due(t0 + 2 * PUBLISH_INTERVAL_NS)
    assert pipeline.queued == 0 and pipeline.published == 5
    assert pipeline.engine_hands_on(t0 + 2 * PUBLISH_INTERVAL_NS + 1)


def test_exporter_builds_no_faster_than_it_exports(monkeypatch, capfd) -> None:  # type: ignore[no-untyped-def]
    """A backend slower than span building, with a small export stage: the
    exporter process waits for the backend instead of dropping single spans
    (journeys with holes), so every span of every journey arrives."""
    receiver = Receiver()
    receiver.start_grpc()
    receiver.delay_s = 0.02  # every export answered 20 ms late: ~2,500 spans/s at most
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{receiver.grpc_port}"
    )
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "200")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "50")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    try:
        sink = PipeSink.start({"service.name": "room"})
        assert sink.pid
        batch = journeys(400)  # ~2,000 spans, ten times the queue, in one frame
        assert sink.consume(batch) == 0
        sink.shutdown(5)
        expected = sum(len(plan_spans(j, 0)) for j in batch)
        assert expected >= 10 * 200
        # End-of-file: the exporter exports what it built, then exits.
        assert not wait_exited([sink.pid], 60)
        assert len(receiver.spans()) == expected
        err = capfd.readouterr().err
        assert f"400 journeys received, {expected} spans built, {expected} exported" in err, err
        assert "0 left unexported at exit" in err, err
        # Its CPU in all, at exit: start-up and 2,000 spans are not free.
        cpu = re.search(r"exporter pid=(\d+)\).* ([0-9.]+) s of CPU$", err, re.M)
        assert cpu is not None and int(cpu[1]) == sink.pid and float(cpu[2]) > 0, err
    finally:
        receiver.stop()


def test_flush_keeps_its_deadline_when_the_exporter_does_not_read(pipes) -> None:  # type: ignore[no-untyped-def]
    """Scheduler.shutdown and atexit flush with a deadline: an exporter that reads
    slowly (waiting for a slow backend) or not at all must not hold them past it."""

    r, w = pipes[0]
    fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    pipeline = JourneyPipeline(PipeSink(w), start_thread=False)
    for j in journeys(2000):
        pipeline.submit(j)
    began = time.monotonic()
    assert not pipeline.flush(0.3)
    assert time.monotonic() - began < 2.0
    # The rest of the frame is pending (its journeys already counted as handed
    # on); a second flush with the pipe still full gives up in time too.
    assert pipeline.sink.pending
    began = time.monotonic()
    assert not pipeline.flush(0.2)
    assert time.monotonic() - began < 2.0
    # The reader catches up: everything arrives, once, in order.
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.extend(ids(read_all(r))))
    reader.start()
    assert pipeline.flush(10.0)
    pipeline.shutdown(5.0)
    reader.join(10)
    assert got == [f"req-{i}" for i in range(2000)]


def test_flush_keeps_its_deadline_while_the_drain_thread_writes(pipes) -> None:  # type: ignore[no-untyped-def]
    """The drain thread blocked on a full pipe holds the sink for a bounded time
    (DRAIN_WRITE_S), so a flush with a deadline (Scheduler.shutdown, atexit)
    returns in time; shutdown does not close the pipe under a writer."""
    from vllm_journey_otel.engine.pipeline import DRAIN_WRITE_S, JourneyPipeline

    r, w = pipes[0]
    fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    pipeline = JourneyPipeline(PipeSink(w), interval_s=0.01)
    try:
        for j in journeys(2000):
            pipeline.submit(j)
        wait_until(lambda: pipeline.sink.pending or None, 5, 0.01, "the drain thread writing")
        began = time.monotonic()
        assert not pipeline.flush(0.3)
        assert time.monotonic() - began < 0.3 + DRAIN_WRITE_S + 1.0
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.extend(ids(read_all(r))))
        reader.start()
        wait_until(lambda: not pipeline.sink.pending or None, 30, 0.02, "the pipe drained")
    finally:
        pipeline.shutdown(5.0)
    reader.join(10)
    assert got == [f"req-{i}" for i in range(2000)]


def test_drain_thread_is_a_backstop_in_action_and_survives_errors(pipes) -> None:  # type: ignore[no-untyped-def]
    """Once the engine stops stepping the drain thread (within its once-a-second
    wake-up; every 10 ms while the sink has trouble) takes what is queued. An
    error in a drain is logged, its journeys counted as failed, and the thread
    goes on."""

    r, w = pipes[0]
    sink = PipeSink(w)
    orig = sink.consume
    calls = {"n": 0}

    def consume(batch, engine_dropped=0, deadline=None):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug of ours in the first drain")
        return orig(batch, engine_dropped, deadline)

    sink.consume = consume  # type: ignore[method-assign]
    reader_got: list[str] = []
    reader = threading.Thread(target=lambda: reader_got.extend(ids(read_all(r))))
    reader.start()
    pipeline = JourneyPipeline(sink, interval_s=0.01)
    try:
        batch = journeys(60)
        for j in batch[:40]:  # the engine's own hand-offs (the drain thread leaves
            pipeline.submit(j)  # them alone: test_drain_thread_leaves_the_queue...)
            pipeline.publish_due(time.monotonic_ns(), force=True)
        assert pipeline.published == 40
        # The engine stops stepping with journeys queued: the drain thread takes
        # them. Its first attempt raises: those journeys are counted as failed,
        # the thread goes on and takes the next ones.
        for j in batch[40:50]:
            pipeline.submit(j)
        wait_until(
            lambda: pipeline.losses[Loss.WRITE_FAILED] == 10 or None, 5, 0.01, "the failed drain"
        )
        for j in batch[50:]:
            pipeline.submit(j)
        wait_until(lambda: pipeline.exported == 10 or None, 5, 0.01, "the next drain")
        assert pipeline._thread is not None and pipeline._thread.is_alive()
    finally:
        pipeline.shutdown(5.0)
        reader.join(10)
    lost = {j.request_id for j in batch[40:50]}
    assert sorted(reader_got) == sorted(j.request_id for j in batch if j.request_id not in lost)


def test_thread_mode_engine_thread_never_offers() -> None:
    """Span building in the engine core (thread mode) is the drain thread's: the
    engine thread's publish_due returns at once instead of popping the queue and
    putting it back every interval."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from vllm_journey_otel.export.span_sink import SpanSink

    memory = InMemorySpanExporter()
    sink = SpanSink.from_env({}, exporters=[memory], threaded=False)
    pipeline = JourneyPipeline(sink, start_thread=False)
    batch = journeys(3)
    for j in batch:
        pipeline.submit(j)
    first = pipeline._queue[0]
    pipeline.publish_due(time.monotonic_ns(), force=True)
    assert pipeline.queued == 3 and pipeline._queue[0] is first and pipeline.published == 0
    assert not pipeline.engine_hands_on(), "the drain thread must do the work"
    assert pipeline.drain() == 3 and pipeline.exported == 3
    assert len(memory.get_finished_spans()) == sum(len(plan_spans(j, 0)) for j in batch)


def test_sigterm_reads_every_frame_already_in_the_pipe(monkeypatch, capfd) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM while the exporter is busy (a slow backend, frames waiting in the
    pipe and its buffer): it stops waiting for the backend, builds every journey
    that is already there, and exits; none is lost unread or uncounted."""
    import signal

    receiver = Receiver()
    receiver.start_grpc()
    receiver.delay_s = 0.05
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{receiver.grpc_port}"
    )
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "200")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "50")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    try:
        sink = PipeSink.start({"service.name": "term"})
        assert sink.pid
        batch = journeys(300)
        for k in range(0, 300, 30):  # ten frames
            assert sink.consume(batch[k : k + 30]) == 0
        # It is at work (its first records accounted for: its signal handling
        # is in place), building and waiting for room, most frames still to read.
        wait_until(lambda: sink.records_in_flight < 300 or None, 60, 0.005, "the exporter at work")
        os.kill(sink.pid, signal.SIGTERM)
        assert not wait_exited([sink.pid], 60)
        err = capfd.readouterr().err
        assert "300 journeys received, 1500 spans built" in err, err
        sink.shutdown(1.0)
    finally:
        receiver.stop()


def test_a_batch_after_an_unfinished_frame_waits_behind_it(pipes) -> None:  # type: ignore[no-untyped-def]
    """The engine thread's offer can leave a partial frame just after drain()
    looked; the drain's own batch, whose write then misses its deadline, goes
    behind that frame (same exporter) instead of being lost."""
    r, w = pipes[0]
    fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    sink = PipeSink(w)
    assert sink.offer(journeys(40))  # more than the pipe holds: the rest pending
    assert sink.pending
    assert sink.consume(journeys(10, start=40), 0, time.monotonic() + 0.05) == 0
    assert sink.pending and sink.losses.carried == 0
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.extend(ids(read_all(r))))
    reader.start()
    assert sink.flush(10.0)
    sink.shutdown(1.0)
    reader.join(10)
    assert got == [f"req-{i}" for i in range(50)]


def test_a_stop_request_reads_what_is_in_the_pipe_then_ends() -> None:
    """The exporter's SIGTERM is a flag: the reader hands out every frame already
    in the pipe (and in its buffer), once each, then ends without waiting for
    more, although the writer is still there."""
    from vllm_journey_otel.wire import FrameReader

    r, w = os.pipe()
    stop = threading.Event()
    try:
        frames = [PipeSink._frame(journeys(3), 0) for _ in range(5)]
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


def test_a_stop_request_during_the_pace_ends_the_read_without_waiting_it_out() -> None:
    """The paced read sleeps between reads; a SIGTERM meanwhile is noticed within
    the stop poll (0.25 s), not after the rest of the pace: a container's stop
    grace is short."""
    from vllm_journey_otel.wire import FrameReader

    r, w = os.pipe()
    stop = threading.Event()
    try:
        os.write(w, PipeSink._frame(journeys(2), 0))
        got: list[object] = []
        timer = threading.Timer(0.1, stop.set)  # once the reader is in its pause
        with os.fdopen(os.dup(r), "rb") as f:
            for frame in FrameReader().frames(f, pace_s=5.0, stop=stop.is_set):
                got.append(frame)
                began = time.monotonic()
                timer.start()
            ended = time.monotonic() - began
        timer.join()
        assert len(got) == 1
        assert ended < 2.0, f"the read ended {ended:.2f} s after its first frame (pace 5 s)"
    finally:
        os.close(r)
        os.close(w)


def test_drain_thread_sleeps_while_the_owner_hands_on_even_when_declined(pipes) -> None:  # type: ignore[no-untyped-def]
    """The drain thread shares the owner's GIL at nice 19: while the owner calls
    it must not wake, neither on a timer nor for a declined offer (each wake-up
    makes the owner wait for it on a busy CPU; with the exporters behind, the
    owner's offers are declined every interval). The owner's last call before
    idling with something left wakes it, and it finishes the owner's work."""
    from vllm_journey_otel.engine.pipeline import PUBLISH_INTERVAL_NS, JourneyPipeline

    r, w = pipes[0]
    fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    wakes: list[int] = []
    pipeline = JourneyPipeline(PipeSink(w), interval_s=0.005, maintain_s=3600.0)
    pipeline.watch(lambda now_ns, room: wakes.append(now_ns) or [])
    reader = threading.Thread(target=lambda: os.read(r, 1 << 16), daemon=True)
    try:
        batch = iter(journeys(400))
        t = time.monotonic_ns()
        for _ in range(100):  # the owner hands on every interval
            pipeline.submit(next(batch))
            t += PUBLISH_INTERVAL_NS
            pipeline.publish_due(t)
            os.read(r, 1 << 16)  # the exporter keeps up
            time.sleep(0.005)
        assert pipeline.published == 100 and pipeline.queued == 0
        assert wakes == [], f"the drain thread woke {len(wakes)} times"
        # The exporter falls behind: the owner's offers are declined, call after call.
        for size in (1024, 1):
            with contextlib.suppress(BlockingIOError):
                while True:
                    os.write(w, b"\0" * size)
        for j in journeys(3, start=1000):
            pipeline.submit(j)
            pipeline.publish_due(time.monotonic_ns(), force=True)
            time.sleep(0.05)  # ten of the drain thread's intervals
        assert pipeline.queued == 3 and pipeline._declined
        assert wakes == [], f"the drain thread woke {len(wakes)} times while declined"
        pipeline.publish_due(time.monotonic_ns(), force=True, idle=True)  # about to idle
        wait_until(lambda: wakes, 10, 0.01, "the drain thread woken by the idle owner")
        reader.start()  # room again; the owner has stopped calling
        wait_until(lambda: not pipeline.left and pipeline.exported == 3, 10, 0.01, "written whole")
    finally:
        pipeline.shutdown(2.0)


def test_the_owner_finishes_its_own_partial_frame_before_the_next(pipes) -> None:  # type: ignore[no-untyped-def]
    """A frame a full pipe took only in part: the owner's next hand-offs write
    its rest (one non-blocking write each, no drain thread), then the new
    journeys after it, in order; one that comes while none of the rest fits
    waits in the queue."""
    from vllm_journey_otel.engine.pipeline import PUBLISH_INTERVAL_NS, JourneyPipeline

    r, w = pipes[0]
    fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    pipeline = JourneyPipeline(PipeSink(w), start_thread=False)
    first = journeys(100)
    for j in first:
        pipeline.submit(j)
    t = time.monotonic_ns()
    pipeline.publish_due(t)
    assert pipeline.published == 100 and pipeline.sink.pending
    got = bytearray()
    late = journeys(2, start=100)
    pipeline.submit(late[0])
    t += PUBLISH_INTERVAL_NS
    pipeline.publish_due(t)  # the pipe still full: declined, left in the queue
    assert pipeline.queued == 1 and pipeline.sink.pending
    for j in late[1:]:
        pipeline.submit(j)
    while pipeline.sink.pending or pipeline.queued:
        got += os.read(r, 4096)  # the exporter reads a pipe's worth
        t += PUBLISH_INTERVAL_NS
        pipeline.publish_due(t)
    got += os.read(r, 1 << 16)
    assert pipeline.published == 102 and pipeline.exported == 0  # all by the owner
    frames = list(read_frames(io.BytesIO(bytes(got))))
    assert ids(frames) == [j.request_id for j in first + late]


def test_an_owner_calling_through_an_exporter_outage_counts_its_journeys_lost(pipes) -> None:  # type: ignore[no-untyped-def]
    """No exporter left (its pipe broke): the journeys of an owner that keeps
    calling are counted lost for that reason (the drain thread takes them on
    at once), not left to fill the queue and be counted as a full queue."""
    from vllm_journey_otel.engine.pipeline import PUBLISH_INTERVAL_NS

    r, w = pipes[0]
    pipeline = JourneyPipeline(PipeSink(w), interval_s=0.01, maintain_s=3600.0)
    try:
        os.close(r)  # the exporter is gone
        t = time.monotonic_ns()
        for i in range(30):
            pipeline.submit(journeys(1, start=i)[0])
            t += PUBLISH_INTERVAL_NS
            pipeline.publish_due(t)  # the owner keeps calling (its clock: every interval)
            time.sleep(0.01)
        assert pipeline.sink.broken
        wait_until(
            lambda: pipeline.losses[Loss.NO_EXPORTER] + pipeline.losses[Loss.WRITE_FAILED]
            + pipeline.losses[Loss.EXPORTER_DIED] == 30 or None,
            10, 0.01, "every journey counted lost",
        )  # fmt: skip
        assert pipeline.losses[Loss.NO_EXPORTER] > 0 and pipeline.losses[Loss.QUEUE_FULL] == 0
        assert pipeline.queued == 0
    finally:
        pipeline.shutdown(1.0)


def test_a_long_queue_goes_on_in_parts_of_owner_batch(pipes) -> None:  # type: ignore[no-untyped-def]
    """A queue that grew while the exporters were behind: each of the owner's
    calls encodes at most OWNER_BATCH journeys (a bounded pause of its thread),
    the rest at its next calls, in order."""
    from vllm_journey_otel.engine.pipeline import OWNER_BATCH, PUBLISH_INTERVAL_NS

    r, w = pipes[0]
    pipeline = JourneyPipeline(PipeSink(w), start_thread=False)
    for j in journeys(OWNER_BATCH + 10):
        pipeline.submit(j)
    t = time.monotonic_ns()
    pipeline.publish_due(t)
    assert pipeline.published == OWNER_BATCH and pipeline.queued == 10
    got = bytearray()
    os.set_blocking(r, False)
    while pipeline.left:
        with contextlib.suppress(BlockingIOError):
            got += os.read(r, 1 << 20)
        t += PUBLISH_INTERVAL_NS
        pipeline.publish_due(t)
    with contextlib.suppress(BlockingIOError):
        got += os.read(r, 1 << 20)
    assert pipeline.published == OWNER_BATCH + 10
    frames = list(read_frames(io.BytesIO(bytes(got))))
    assert [len(f.journeys) for f in frames] == [OWNER_BATCH, 10]
    assert ids(frames) == [f"req-{i}" for i in range(OWNER_BATCH + 10)]


def test_an_owner_that_stops_calling_leaves_its_partial_frame_to_the_drain_thread(pipes) -> None:  # type: ignore[no-untyped-def]
    """The rest of a frame, and a queue, left by an owner that stopped calling
    without saying it would (a paused engine): the drain thread writes them at
    its next maintenance wake-up."""
    from vllm_journey_otel.engine.pipeline import JourneyPipeline

    r, w = pipes[0]
    fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    pipeline = JourneyPipeline(PipeSink(w), interval_s=0.005, maintain_s=0.2)
    try:
        for j in journeys(100):
            pipeline.submit(j)
        pipeline.publish_due(time.monotonic_ns())
        assert pipeline.sink.pending
        for j in journeys(3, start=100):
            pipeline.submit(j)
        got = bytearray()

        def done() -> bool:
            with contextlib.suppress(BlockingIOError):
                got.extend(os.read(r, 1 << 16))
            return not pipeline.left and pipeline.exported == 3

        os.set_blocking(r, False)
        wait_until(done, 10, 0.01, "the drain thread finished the owner's work")
        with contextlib.suppress(BlockingIOError):
            got.extend(os.read(r, 1 << 16))  # what its last write left
    finally:
        pipeline.shutdown(2.0)
    frames = list(read_frames(io.BytesIO(bytes(got))))
    assert ids(frames) == [f"req-{i}" for i in range(103)]


def test_the_drain_thread_is_named_where_the_os_shows_threads(pipes) -> None:  # type: ignore[no-untyped-def]
    """top -H, ps -L and py-spy show which thread of a vLLM process is ours."""
    from vllm_journey_otel.engine.pipeline import DRAIN_THREAD_COMM, JourneyPipeline

    pipeline = JourneyPipeline(PipeSink(pipes[0][1]))
    try:

        def named() -> bool:
            thread = pipeline._thread
            assert thread is not None and thread.native_id is not None
            with open(f"/proc/self/task/{thread.native_id}/comm") as f:
                return f.read().strip() == DRAIN_THREAD_COMM

        wait_until(named, 10, 0.01, "the drain thread's OS name")
    finally:
        pipeline.shutdown(1.0)


def test_an_offer_declined_while_the_drain_thread_writes_is_the_owners_next(pipes) -> None:  # type: ignore[no-untyped-def]
    """The owner's offer is declined while the drain thread holds the sink (it
    is writing): the owner's next call hands it on, after what the drain
    thread wrote, without waking it again."""
    from vllm_journey_otel.engine.pipeline import PUBLISH_INTERVAL_NS, JourneyPipeline

    sink = PipeSink(pipes[0][1])
    pipeline = JourneyPipeline(sink, start_thread=False)
    first, second = journeys(2)
    t = time.monotonic_ns()
    with sink._lock:  # the sink busy: every offer is declined
        pipeline.submit(first)
        pipeline.publish_due(t, force=True)
        assert pipeline.queued == 1 and pipeline._declined and not pipeline._wake.is_set()
    pipeline.submit(second)
    pipeline.publish_due(t + PUBLISH_INTERVAL_NS)
    assert pipeline.queued == 0 and pipeline.published == 2 and not pipeline._declined
    pipeline.shutdown(2.0)
    assert ids(read_all(pipes[0][0])) == ["req-0", "req-1"]


@requires_vllm
def test_the_engines_last_step_before_idling_hands_on_with_a_session_waiting(pipes) -> None:  # type: ignore[no-untyped-def]
    """vLLM's busy loop idles while a streaming-input session waits for its next
    input (the request stays in the scheduler's table): the journeys the last
    step finished are handed on by that step, not left for the drain thread's
    next wake-up (an hour here). A real Scheduler."""
    from conftest import import_harness
    from vllm_journey_otel.config import Config
    from vllm_journey_otel.engine import hooks
    from vllm_journey_otel.engine.state import _STATE

    harness = import_harness()
    r, w = pipes[0]
    assert hooks.install(Config(enabled=True))
    pipeline = JourneyPipeline(PipeSink(w), maintain_s=3600.0)
    with _STATE.lock:
        _STATE.pipeline, _STATE.pipeline_pid = pipeline, os.getpid()
    try:
        e = harness.Engine()
        s = e.add("s", prompt_len=20, max_tokens=2, resumable=True)
        e.add("a", prompt_len=10, max_tokens=2)
        e.add("b", prompt_len=10, max_tokens=3)
        waiting = harness.RequestStatus.WAITING_FOR_STREAMING_REQ
        for _ in range(20):
            if "b" not in e.scheduler.requests and s.status == waiting:
                break
            e.step()
        assert "b" not in e.scheduler.requests and "s" in e.scheduler.requests
        assert not e.scheduler.has_unfinished_requests()  # vLLM's loop idles now
        assert pipeline.queued == 0 and pipeline.published == 2
        assert sorted(ids(read_all_now(r))) == ["a", "b"]
    finally:
        hooks.uninstall()


@requires_vllm
def test_the_engines_last_step_before_a_pause_hands_on(pipes) -> None:  # type: ignore[no-untyped-def]
    """vLLM pauses all scheduling (PAUSED_ALL: a weight update) with requests
    still running, right after a step that finished one (vLLM's loop steps once
    more then, for its finished ids): that step hands on the journeys finished
    before it, though the next hand-off is not due (an hour here) and the drain
    thread would not come for an hour either. A real Scheduler."""
    from vllm.v1.core.sched.interface import PauseState

    from conftest import import_harness
    from vllm_journey_otel.config import Config
    from vllm_journey_otel.engine import hooks
    from vllm_journey_otel.engine.state import _STATE, TRACKER_ATTR

    harness = import_harness()
    r, w = pipes[0]
    assert hooks.install(Config(enabled=True))
    pipeline = JourneyPipeline(PipeSink(w), maintain_s=3600.0)
    with _STATE.lock:
        _STATE.pipeline, _STATE.pipeline_pid = pipeline, os.getpid()
    try:
        e = harness.Engine()
        assert e.scheduler.__dict__[TRACKER_ATTR].pause_field is not None
        e.add("a", prompt_len=10, max_tokens=2)
        e.add("long", prompt_len=10, max_tokens=200)
        for _ in range(20):
            if "a" not in e.scheduler.requests:
                break
            e.step()
        assert "a" not in e.scheduler.requests and pipeline.queued + pipeline.published == 1
        e.abort("long")  # between steps: handed on at once, as an abort is
        pipeline.due_ns = time.monotonic_ns() + 3600 * 10**9  # no hand-off due
        e.add("b", prompt_len=10, max_tokens=2)
        e.add("c", prompt_len=10, max_tokens=200)
        for _ in range(20):
            if "b" not in e.scheduler.requests:
                break
            e.step()
        assert "b" not in e.scheduler.requests and pipeline.queued == 1, "precondition"
        e.scheduler.set_pause_state(PauseState.PAUSED_ALL)
        e.step()
        assert e.scheduler.running and not e.scheduler.has_unfinished_requests()
        assert pipeline.queued == 0
        assert sorted(ids(read_all_now(r))) == ["a", "b", "long"]
    finally:
        hooks.uninstall()


def read_all_now(fd: int) -> list:  # type: ignore[type-arg]
    """The frames in the pipe so far (its writer stays open)."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 1 << 20):
            data += chunk
    return list(read_frames(io.BytesIO(data)))


def test_a_backlog_is_said_before_the_queue_fills(pipes, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    """An exporter that reads nothing: the journeys wait in the pipeline and in a
    frame the drain thread cannot finish. Once they pass a quarter of the
    queue's bound, the drain thread says so, once (then at most once a
    minute), with what to change, and nothing has been dropped yet."""
    import logging

    from vllm_journey_otel.wire import BEHIND_SHARE

    _, w = pipes[0]
    fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    sink = PipeSink(w)
    pipeline = JourneyPipeline(sink, max_queue=400, interval_s=0.01)
    caplog.set_level(logging.WARNING, logger="vllm.journey_otel")

    def said() -> list[str]:
        return [m.getMessage() for m in caplog.records if "wait in this process" in m.getMessage()]

    try:
        for j in journeys(int(400 * BEHIND_SHARE) - 1):
            pipeline.submit(j)
        pipeline.publish_due(time.monotonic_ns(), force=True)
        wait_until(lambda: sink.pending or None, 10, 0.01, "the pipe full, a frame unfinished")
        pipeline._report_backlog()  # below the share: silent (as the drain thread's tries)
        assert said() == []
        for j in journeys(60, start=1000):
            pipeline.submit(j)
        wait_until(lambda: said() or None, 10, 0.01, "the drain thread to say the backlog")
        pipeline._report_backlog()  # within the minute: not again
        messages = said()
        assert len(messages) == 1, messages
        assert "past 400 the queue drops them" in messages[0]
        assert "VLLM_JOURNEY_OTEL_EXPORTER_PROCESSES" in messages[0]
        assert int(messages[0].split("journey-otel: ")[1].split()[0]) >= 400 * BEHIND_SHARE
        assert pipeline.losses[Loss.QUEUE_FULL] == 0
    finally:
        pipeline.shutdown(0.1)
