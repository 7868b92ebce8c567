"""A lost exporter process is replaced (pipe_sink.PipeSink.maintain, exporter_launch.Restarts):
real exporter processes, SIGKILLed as an OOM killer would, a real OTLP receiver."""

from __future__ import annotations

import logging
import os
import re
import signal
from collections.abc import Iterator

import psutil
import pytest

from otlp_receiver import Receiver
from records import journeys
from services import wait_exited, wait_until
from vllm_journey_otel import schema as S
from vllm_journey_otel.engine.exporter_launch import (
    FIRST_DELAY_S,
    MAX_DELAY_S,
    MAX_PER_WINDOW,
    RESET_AFTER_S,
    WINDOW_S,
    Restarts,
)
from vllm_journey_otel.engine.pipe_sink import PipeSink
from vllm_journey_otel.engine.pipeline import JourneyPipeline


def test_backoff_doubles_in_a_row_and_the_window_caps_starts() -> None:
    r = Restarts()
    t = 0.0
    for delay in (FIRST_DELAY_S, 2 * FIRST_DELAY_S, 4 * FIRST_DELAY_S, 8 * FIRST_DELAY_S):
        assert r.lost(t) == delay  # each replacement died at once: a crash loop
        assert not r.may_start(t + delay - 0.01) and r.may_start(t + delay)
        r.did_start(t + delay, more_wanted=False)
        t += delay + 0.1
    # A fifth start within WINDOW_S waits for the first of the four to leave it.
    due = t + r.lost(t)
    assert not r.may_start(due)
    assert r.due == FIRST_DELAY_S + WINDOW_S and r.may_start(r.due)
    r.did_start(r.due, more_wanted=False)
    assert MAX_PER_WINDOW == 4
    for _ in range(10):
        r.did_start(r.last_start + WINDOW_S, more_wanted=False)
    assert r.delay_s == MAX_DELAY_S  # capped
    # A replacement that lived long is not part of a crash loop: the row starts again.
    assert r.lost(r.last_start + RESET_AFTER_S) == FIRST_DELAY_S


@pytest.fixture
def exporting(monkeypatch) -> Iterator[Receiver]:  # type: ignore[no-untyped-def]
    receiver = Receiver()
    receiver.start_grpc()
    for key in list(os.environ):
        if key.startswith(("OTEL_", "VLLM_JOURNEY_OTEL")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{receiver.grpc_port}"
    )
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    yield receiver
    receiver.stop()


def roots_of(receiver: Receiver, prefix: str = "req-") -> dict[str, object]:
    return {
        str(s.attrs[S.REQUEST_ID]): s
        for s in receiver.spans()
        if s.name == S.SPAN_REQUEST and str(s.attrs[S.REQUEST_ID]).startswith(prefix)
    }


def test_a_killed_exporter_is_replaced_and_journeys_flow_again(exporting, caplog) -> None:  # type: ignore[no-untyped-def]
    receiver = exporting
    caplog.set_level(logging.WARNING, logger="vllm.journey_otel")
    sink = PipeSink.start({"service.name": "restart"})
    pipeline = JourneyPipeline(sink, interval_s=0.02)
    old = sink.pid
    assert old is not None
    try:
        for j in journeys(5):
            pipeline.submit(j)
        wait_until(lambda: len(roots_of(receiver)) == 5, 60, 0.05, "the first journeys")
        # Delivered and acknowledged: a death now loses nothing it was sent.
        wait_until(lambda: sink.records_in_flight == 0, 10, 0.01, "the exporter's account")
        os.kill(old, signal.SIGKILL)  # as the OOM killer would
        # Noticed by the drain thread without a write (the pipe's reader closed);
        # the replacement starts FIRST_DELAY_S later.
        wait_until(lambda: sink.broken, 10, 0.002, "the loss noticed")
        for j in journeys(3, start=50):  # while none runs: dropped and counted
            pipeline.submit(j)
        pipeline.drain()
        assert pipeline.losses.by_reason() == {"no_exporter": 3}
        wait_until(lambda: not sink.broken and sink.exporters == 1, 30, 0.02, "a new exporter")
        new = sink.pids[-1]
        assert new != old and psutil.pid_exists(new)
        for j in journeys(5, start=100):
            pipeline.submit(j)
        wait_until(lambda: len(roots_of(receiver)) == 10, 60, 0.05, "journeys after the restart")
    finally:
        pipeline.shutdown(5)
    roots = roots_of(receiver)
    assert sorted(roots) == sorted(
        [f"req-{i}" for i in range(5)] + [f"req-{i}" for i in range(100, 105)]
    )
    for i in range(100, 105):  # the loss reaches the roots exported after it
        assert roots[f"req-{i}"].attrs[S.TRACER_DROPPED_JOURNEYS] == 3  # type: ignore[attr-defined]
    err = caplog.text
    assert (
        f"exporter process {old} is gone (0 left); 0 journeys it had been sent were lost with "
        f"it (counted in the next journeys' dropped_journeys); a new one starts in "
        f"{FIRST_DELAY_S:.1f} s" in err
    )
    assert f"exporter process {new} started in place of a lost one; 3 journeys were" in err


def test_no_replacement_after_shutdown(exporting) -> None:  # type: ignore[no-untyped-def]
    """A loss noticed, its replacement due, then vLLM shuts down: none starts."""
    sink = PipeSink.start({"service.name": "closing"})
    pid = sink.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_exited([pid], 10)
    sink.maintain()
    assert sink.broken and sink.restarts.due is not None
    sink.shutdown(5)
    sink.restarts.due = 0.0  # due long ago
    sink.maintain()
    assert sink.pids == [pid] and sink.restarts.count == 0 and sink.exporters == 0


def test_what_a_killed_exporter_held_is_counted_on_later_roots(exporting, caplog) -> None:  # type: ignore[no-untyped-def]
    """Journeys in the pipe and in the exporter (built, waiting for a backend that
    never answers) when it is SIGKILLed: the engine side counts exactly those
    its exporter had not accounted for (wire.Acks), says so in one line, and
    the roots exported after the replacement carry the count."""
    from fault_proxy import BLACKHOLE, FORWARD, FaultProxy

    receiver = exporting
    proxy = FaultProxy(receiver.grpc_port)
    proxy.set_mode(BLACKHOLE)
    os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = f"http://127.0.0.1:{proxy.port}"
    caplog.set_level(logging.WARNING, logger="vllm.journey_otel")
    sink = PipeSink.start({"service.name": "held"})
    pipeline = JourneyPipeline(sink, interval_s=0.02)
    old = sink.pid
    assert old is not None
    try:
        for j in journeys(300):
            pipeline.submit(j)
        pipeline.drain()
        # Every frame is in the pipe or the exporter; none can be delivered.
        wait_until(lambda: sink.records_in_flight == 300, 30, 0.02, "300 journeys sent")
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: sink.broken, 10, 0.002, "the loss noticed")
        assert sink.losses.by_reason() == {"exporter_died": 300}
        proxy.set_mode(FORWARD)
        wait_until(lambda: not sink.broken and sink.exporters == 1, 30, 0.02, "a new exporter")
        for j in journeys(5, start=1000):
            pipeline.submit(j)
        wait_until(lambda: len(roots_of(receiver)) == 5, 60, 0.05, "journeys after the restart")
    finally:
        pipeline.shutdown(5)
        proxy.close()
    for root in roots_of(receiver).values():
        assert root.attrs[S.TRACER_DROPPED_JOURNEYS] == 300  # type: ignore[attr-defined]
    assert f"exporter process {old} is gone (0 left); 300 journeys it had been sent" in caplog.text
    # And once more, with the reason, in the process's account at its end.
    assert (
        "records lost in this process over its run: "
        "300 lost with an exporter process that died holding them" in caplog.text
    )


# An owner that stands for the engine core, its drain thread running: its
# exporter started; once the test stopped that exporter, its journeys handed on
# until the pipe is full and its queue holds the rest; with "drained", once the
# test continued the exporter, until it holds none; then it waits to be killed.
KILLED_OWNER = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from records import journeys
from vllm_journey_otel.engine.pipe_sink import PipeSink
from vllm_journey_otel.engine.pipeline import JourneyPipeline

sink = PipeSink.start({"service.name": "owner-killed", "process.pid": os.getpid()})
pipeline = JourneyPipeline(sink, max_queue=1_000_000, interval_s=0.02)
print(sink.pid, flush=True)
sys.stdin.readline()  # its exporter is stopped now
for chunk in range(int(sys.argv[2])):
    for j in journeys(100, start=chunk * 100):
        pipeline.submit(j)
    pipeline.publish_due(time.monotonic_ns(), force=True)
print(pipeline.queued, flush=True)
if sys.argv[3] == "drained":
    sys.stdin.readline()  # its exporter runs again
    # Every journey handed on, written whole, and accounted for by the exporter.
    total = int(sys.argv[2]) * 100
    held = sink._acks[sink._fds[0]]  # the count its exporter reads (wire.Acks)
    while (pipeline.published + pipeline.exported < total or sink.records_in_flight
           or sink.pending or held.held()):
        time.sleep(0.01)
    print("drained", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("end", ["backlog", "drained"])
def test_an_owner_killed_is_accounted_for(exporting, tmp_path, end: str) -> None:  # type: ignore[no-untyped-def]
    """vLLM SIGKILLs an engine core that does not exit at once; one whose
    exporter fell behind dies holding finished journeys, with no time for a
    word. Its exporter says how many (wire.Acks' second count): what it
    received plus what it reports lost is every journey the owner finished;
    an owner killed once it had handed everything on lost nothing, and its
    exporter says nothing of the kind."""
    import subprocess
    import sys
    from pathlib import Path

    chunks = 300  # 30,000 journeys: several times what the pipe holds
    log = tmp_path / "owner.log"
    tests_dir = str(Path(__file__).resolve().parents[1])
    with log.open("w") as err:
        owner = subprocess.Popen(
            [sys.executable, "-c", KILLED_OWNER, tests_dir, str(chunks), end],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
    assert owner.stdin is not None and owner.stdout is not None
    exporter = int(owner.stdout.readline())
    os.kill(exporter, signal.SIGSTOP)  # behind: it reads nothing while the owner hands on
    try:
        owner.stdin.write("go\n")
        owner.stdin.flush()
        assert int(owner.stdout.readline()) > 0, "the pipe filled and the owner kept the rest"
        if end == "drained":
            os.kill(exporter, signal.SIGCONT)
            owner.stdin.write("go on\n")
            owner.stdin.flush()
            assert owner.stdout.readline().strip() == "drained"
        owner.kill()  # as vLLM kills an engine core that lingers
        owner.wait()
    finally:
        os.kill(exporter, signal.SIGCONT)
    wait_exited([exporter], 60)
    text = log.read_text()
    received = re.search(r"exporter: (\d+) journeys received", text)
    assert received, text
    held = re.search(r"its owner \(pid (\d+)\) ended holding (\d+) finished journeys", text)
    if end == "drained":
        assert held is None and int(received[1]) == chunks * 100, text
        return
    assert held, text
    assert int(held[1]) == owner.pid
    assert int(received[1]) + int(held[2]) == chunks * 100
    assert "WARNING journey-otel exporter: " in text
