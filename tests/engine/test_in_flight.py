"""Requests that do not end: in-flight snapshots, from a real vLLM Scheduler.

A structured-output request whose grammar never compiles stays waiting in vLLM's
own queue (WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR) for as long as the test wants;
a long decode stays running. The drain thread exports a ``vllm.in_flight``
snapshot of each past the threshold, again at twice the age, and the final
journey, when the request ends, is the snapshot's parent.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import import_harness, requires_vllm
from services import wait_until
from vllm_journey_otel import schema as S
from vllm_journey_otel.config import Config
from vllm_journey_otel.engine import handoff, hooks, in_flight
from vllm_journey_otel.engine.sampling import HeadSampler, TailRule
from vllm_journey_otel.export.file_exporter import OtlpJsonFileExporter
from vllm_journey_otel.tools.summary import SUMMARY_ATTRIBUTES, format_text, summarize
from vllm_journey_otel.tools.timeline import collect, render
from vllm_journey_otel.tools.tracefile import read_spans

pytestmark = requires_vllm
harness = import_harness()
THRESHOLD_S = 0.3


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    monkeypatch.setattr(in_flight, "CHECK_INTERVAL_S", 0.05)
    exporter = InMemorySpanExporter()
    cfg = Config(enabled=True, in_flight_s=THRESHOLD_S, export_interval_ms=20)
    assert hooks.install(cfg, exporters=[exporter], batch=False)
    try:
        yield exporter
    finally:
        hooks.uninstall()


def _snapshots(exporter: InMemorySpanExporter, rid: str) -> list[Any]:
    return [
        s
        for s in exporter.get_finished_spans()
        if s.name == S.SPAN_IN_FLIGHT and s.attributes[S.REQUEST_ID] == rid
    ]


def test_a_request_waiting_for_its_grammar_is_seen_before_it_ends(
    watched: InMemorySpanExporter, tmp_path: Path
) -> None:
    e = harness.Engine()
    tp_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    e.add("stuck", prompt_len=16, max_tokens=4, json_schema='{"type": "object"}',
          trace_headers={"traceparent": f"00-{tp_trace}-00f067aa0ba902b7-01"})  # fmt: skip
    e.add("fine", prompt_len=16, max_tokens=4)
    for _ in range(30):  # "fine" ends; "stuck" waits for its grammar
        e.step()
    assert e.requests["stuck"].status.name == "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"
    added = time.monotonic()
    found = wait_until(lambda: _snapshots(watched, "stuck"), 10, 0.02, "a snapshot")
    first = min(found, key=lambda s: s.attributes[S.IN_FLIGHT_SNAPSHOT])
    assert time.monotonic() - added < THRESHOLD_S + 5
    a = first.attributes
    assert a[S.IN_FLIGHT_STATE] == S.IN_FLIGHT_QUEUED
    assert a[S.WAIT_REASON] == S.WAIT_GRAMMAR
    assert a[S.IN_FLIGHT_MS] >= THRESHOLD_S * 1000
    assert a[S.PREFILL_TOTAL_TOKENS] == 16 and a[S.DECODE_DONE_TOKENS] == 0
    assert first.context.trace_id == int(tp_trace, 16), "in the client's trace"
    events = {ev.name: ev.attributes for ev in first.events}
    assert events[S.SPAN_QUEUED][S.IN_FLIGHT_EVENT_OPEN] is True
    assert events[S.SPAN_WAIT][S.WAIT_REASON] == S.WAIT_GRAMMAR
    assert not _snapshots(watched, "fine"), "a request that ended has no snapshot"

    # Again at twice the age, and only then.
    def two() -> list[Any]:
        found = _snapshots(watched, "stuck")
        return found if len(found) >= 2 else []

    both = sorted(wait_until(two, 10, 0.02, "a second snapshot"),
                  key=lambda s: s.attributes[S.IN_FLIGHT_SNAPSHOT])  # fmt: skip
    levels = [s.attributes[S.IN_FLIGHT_SNAPSHOT] for s in both]
    assert levels == sorted(set(levels)), "one snapshot per level"
    for snap in both:  # level n: at least 2 ** (n - 1) thresholds old
        level = snap.attributes[S.IN_FLIGHT_SNAPSHOT]
        assert snap.attributes[S.IN_FLIGHT_MS] >= THRESHOLD_S * 1000 * 2 ** (level - 1)
    # It ends: the final journey's root is every snapshot's parent.
    e.compile_grammar("stuck")
    e.run()
    assert handoff.flush(10)
    (root,) = [s for s in watched.get_finished_spans()
               if s.name == S.SPAN_REQUEST and s.attributes[S.REQUEST_ID] == "stuck"]  # fmt: skip
    for snap in _snapshots(watched, "stuck"):
        assert snap.parent is not None and snap.parent.span_id == root.context.span_id
        assert snap.context.trace_id == root.context.trace_id
        assert root.start_time <= snap.start_time and snap.end_time <= root.end_time
    # The summary lists it, with the longest time it was seen in flight.
    path = tmp_path / "j.jsonl"
    OtlpJsonFileExporter(path).export(watched.get_finished_spans())
    d = summarize(read_spans([path], attributes_of=SUMMARY_ATTRIBUTES)).to_dict()
    (seen,) = d["in_flight"]
    longest = max(s.attributes[S.IN_FLIGHT_MS] for s in _snapshots(watched, "stuck"))
    assert seen == {
        "request_id": "stuck",
        "longest_seen_ms": round(longest, 3),
        "state": S.IN_FLIGHT_QUEUED,
        "wait_reason": S.WAIT_GRAMMAR,
        "ended": True,
    }
    assert "seen in flight past the threshold" in format_text(d)
    # The timeline marks each snapshot on the request's row, where it was taken.
    rows, _ = collect(lambda attributes_of: read_spans([path], attributes_of=attributes_of))
    (row,) = [r for r in rows if r.attrs.get(S.REQUEST_ID) == "stuck"]
    ticks = sorted(end for kind, start, end, _ in row.segments if kind == "snapshot")
    assert ticks == sorted(s.end_time for s in _snapshots(watched, "stuck"))
    assert all(start == end for kind, start, end, _ in row.segments if kind == "snapshot")
    assert render(rows, 1).count('["snapshot",') == len(ticks)  # each drawn on the page


def test_a_long_decode_is_seen_running(watched: InMemorySpanExporter) -> None:
    e = harness.Engine()
    e.add("long", prompt_len=16, max_tokens=1500)
    deadline = time.monotonic() + 10
    while not _snapshots(watched, "long") and time.monotonic() < deadline:
        e.step()
        time.sleep(0.002)  # a step of a real model takes milliseconds
    snap = min(_snapshots(watched, "long"), key=lambda s: s.attributes[S.IN_FLIGHT_SNAPSHOT])
    a = snap.attributes
    assert a[S.IN_FLIGHT_STATE] == S.IN_FLIGHT_RUNNING and S.WAIT_REASON not in a
    assert 0 < a[S.DECODE_DONE_TOKENS] < 1500
    names = [ev.name for ev in snap.events]
    assert names[:4] == [S.SPAN_QUEUED, S.SPAN_SCHEDULED, S.SPAN_PREFILL, S.SPAN_DECODE]
    open_ = {ev.name for ev in snap.events if ev.attributes[S.IN_FLIGHT_EVENT_OPEN]}
    assert open_ == {S.SPAN_SCHEDULED, S.SPAN_DECODE}
    e.abort("long")
    e.run()
    assert handoff.flush(10)
    (root,) = [s for s in watched.get_finished_spans() if s.name == S.SPAN_REQUEST]
    assert snap.parent.span_id == root.context.span_id
    assert snap.context.trace_id == root.context.trace_id


@pytest.mark.parametrize("tail", ["default", "without in_flight"])
def test_a_stuck_request_head_sampling_dropped(monkeypatch: pytest.MonkeyPatch, tail: str) -> None:
    """Under ratio sampling the stuck request is the one to see: with the tail
    rule's in_flight reason (the default) it gets its snapshots and its journey
    is kept at its end, as a root of its own trace with the snapshots under it;
    without that reason, neither."""
    monkeypatch.setattr(in_flight, "CHECK_INTERVAL_S", 0.05)
    exporter = InMemorySpanExporter()
    rule = TailRule() if tail == "default" else TailRule(in_flight=False)
    cfg = Config(enabled=True, in_flight_s=THRESHOLD_S, export_interval_ms=20)
    never = HeadSampler(parent_based=False, ratio=0.0)
    assert hooks.install(cfg, exporters=[exporter], batch=False, head=never, tail=rule)
    try:
        e = harness.Engine()
        e.add("stuck", prompt_len=16, max_tokens=4, json_schema='{"type": "object"}')
        e.add("fine", prompt_len=16, max_tokens=4)
        for _ in range(30):
            e.step()
        if tail == "default":
            wait_until(lambda: _snapshots(exporter, "stuck"), 10, 0.02, "a snapshot")
        else:
            time.sleep(THRESHOLD_S + 0.5)  # ten checks past the threshold: one would have come
        e.compile_grammar("stuck")
        e.run()
        assert handoff.flush(10)
    finally:
        hooks.uninstall()
    spans = exporter.get_finished_spans()
    roots = {s.attributes[S.REQUEST_ID]: s for s in spans if s.name == S.SPAN_REQUEST}
    snaps = _snapshots(exporter, "stuck")
    if tail != "default":
        assert roots == {} and snaps == [], "head-dropped, and nothing keeps it"
        return
    assert set(roots) == {"stuck"}, "the request that ended in time stays dropped"
    root = roots["stuck"]
    assert root.attributes[S.SAMPLED_BY] == S.SAMPLED_TAIL and root.parent is None
    for snap in snaps:
        assert snap.parent is not None and snap.parent.span_id == root.context.span_id
        assert snap.context.trace_id == root.context.trace_id


def test_off_with_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(in_flight, "CHECK_INTERVAL_S", 0.05)
    exporter = InMemorySpanExporter()
    assert hooks.install(
        Config(enabled=True, in_flight_s=0.0, export_interval_ms=20), exporters=[exporter],
        batch=False,
    )  # fmt: skip
    try:
        e = harness.Engine()
        e.add("stuck", prompt_len=16, max_tokens=4, json_schema='{"type": "object"}')
        assert e.requests["stuck"].status.name == "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"
        for _ in range(20):
            e.step()
        time.sleep(0.5)  # ten checks' worth: a snapshot would have come by now
        assert handoff.pipeline()._watchers == [], "nothing watches in-flight requests"
        assert handoff.flush(10)
        assert not [s for s in exporter.get_finished_spans() if s.name == S.SPAN_IN_FLIGHT]
    finally:
        hooks.uninstall()


def test_a_session_between_inputs_counts_its_tokens_once(watched: InMemorySpanExporter) -> None:
    """A streaming-input session waiting for its client's next input: vLLM still
    holds the last segment's tokens, which the journey already counted."""
    e = harness.Engine()
    e.add("s", prompt_len=8, max_tokens=4, resumable=True)
    for _ in range(20):
        e.step()
    assert e.requests["s"].status.name == "WAITING_FOR_STREAMING_REQ"
    found = wait_until(lambda: _snapshots(watched, "s"), 10, 0.02, "a snapshot")
    a = min(found, key=lambda s: s.attributes[S.IN_FLIGHT_SNAPSHOT]).attributes
    assert a[S.IN_FLIGHT_STATE] == S.IN_FLIGHT_QUEUED
    assert a[S.WAIT_REASON] == S.WAIT_STREAMING_INPUT
    assert a[S.DECODE_DONE_TOKENS] == 4
    e.end_session("s")
    e.run()
    assert handoff.flush(10)
    (root,) = [s for s in watched.get_finished_spans() if s.name == S.SPAN_REQUEST]
    assert root.attributes[S.GEN_AI_OUTPUT_TOKENS] == 4
