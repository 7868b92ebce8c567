"""The API server's spans from its record (export/api_spans.py), built by our
SpanBuilder into the SDK's ReadableSpans, and the engine's side of the nesting.
The records are what engine/api_server.py records; tests/e2e/test_e2e_api_server.py
drives the real thing under `vllm serve`."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from vllm_journey_otel import schema as S
from vllm_journey_otel.engine.trace_headers import bounded_trace_headers
from vllm_journey_otel.export.api_spans import plan_api
from vllm_journey_otel.export.span_builder import SpanBuilder
from vllm_journey_otel.export.span_sink import SpanSink
from vllm_journey_otel.journey import API_PARENT_KEY, ApiJourney, RootIds

CLIENT_TRACE = 0x0AF7651916CD43DD8448EB211C80319C
CLIENT_SPAN = 0xB7AD6B7169203331
CLIENT = {"traceparent": f"00-{CLIENT_TRACE:032x}-{CLIENT_SPAN:016x}-01"}
MS = 1_000_000


def record(**kw: object) -> ApiJourney:
    base: dict[str, object] = dict(
        ids=RootIds(CLIENT_TRACE >> 64, CLIENT_TRACE & ((1 << 64) - 1), 0x1234),
        parent_headers=CLIENT, server_kind=True, head_sampled=True, method="POST",
        path="/v1/chat/completions", stream=True, disconnected=False, status_code=200,
        exception=None, request_ids=["chatcmpl-1"], receipt_mono_ns=10 * MS,
        end_mono_ns=60 * MS, arrival_time_s=0.0, handoff_mono_ns=15 * MS,
        first_body_mono_ns=30 * MS, last_output_mono_ns=58 * MS, chunks=9,
    )  # fmt: skip
    base.update(kw)
    return ApiJourney(**base)  # type: ignore[arg-type]


def build(rec: ApiJourney, offset_ns: int = 0):  # type: ignore[no-untyped-def]
    plan, parent, links = plan_api(rec, offset_ns)
    spans = SpanBuilder(Resource.create({}), SpanLimits()).build(plan, parent, links)
    return {s.name: s for s in spans}, spans


def test_a_stream_has_both_sides_inside_the_root_and_the_servers_figures() -> None:
    arrival_unix_ns = 1_700_000_000 * 10**9
    offset = arrival_unix_ns - 12 * MS  # vLLM's arrival stamp 2 ms after receipt
    by_name, spans = build(record(arrival_time_s=arrival_unix_ns / 1e9), offset)
    root, inp, out = by_name[S.SPAN_API], by_name[S.SPAN_API_INPUT], by_name[S.SPAN_API_OUTPUT]
    assert root.kind == SpanKind.SERVER and root.status.status_code == StatusCode.UNSET
    assert root.parent is not None and root.parent.span_id == CLIENT_SPAN
    assert root.context.trace_id == CLIENT_TRACE and root.context.span_id == 0x1234
    assert inp.parent.span_id == out.parent.span_id == 0x1234  # type: ignore[union-attr]
    assert (inp.start_time, inp.end_time) == (root.start_time, root.start_time + 5 * MS)  # type: ignore[operator]
    assert (out.start_time, out.end_time) == (root.start_time + 48 * MS, root.end_time)  # type: ignore[operator]
    a = root.attributes
    assert a[S.API_TTFB_MS] == 20.0 and a[S.API_E2E_MS] == 50.0 and a[S.API_STREAM] is True
    assert S.API_TTFT_MS not in a  # vLLM stamped no first token: missing, not zero
    assert a[S.API_REQUEST_IDS] == ("chatcmpl-1",) and S.ERROR_TYPE not in a
    assert inp.attributes[S.API_READ_MS] == 2.0 and inp.attributes[S.API_RENDER_MS] == 3.0
    assert out.attributes[S.API_CHUNKS] == 9
    for span in spans:
        assert set(span.attributes) <= S.attributes_of(span.name)


def test_the_servers_first_token_and_first_byte_are_two_figures() -> None:
    """TTFT: the read before vLLM's arrival stamp plus vLLM's own TTFT (its two
    wall-clock stamps); TTFB from the first body after the hand-off: a whole
    response's first byte is its end. A wall-clock step (an arrival stamp far
    outside the input side) leaves the TTFT out rather than wrong."""
    offset = 1_700_000_000 * 10**9
    arrival = offset + 12 * MS  # 2 ms after receipt (10 ms)
    rec = record(
        stream=False, first_body_mono_ns=60 * MS, arrival_time_s=arrival / 1e9,
        first_token_unix_ns=arrival + 5_250_000,
    )  # fmt: skip
    by_name, _ = build(rec, offset)
    a = by_name[S.SPAN_API].attributes
    assert a[S.API_TTFT_MS] == pytest.approx(7.25)
    assert by_name[S.SPAN_API_INPUT].attributes[S.API_READ_MS] == pytest.approx(2.0)
    assert a[S.API_TTFB_MS] == a[S.API_E2E_MS] == 50.0
    stepped, _ = build(rec, offset + 10_000 * MS)  # the wall clock 10 s off
    assert S.API_TTFT_MS not in stepped[S.SPAN_API].attributes
    assert S.API_READ_MS not in stepped[S.SPAN_API_INPUT].attributes


def test_under_another_http_server_span_ours_is_internal() -> None:
    by_name, _ = build(record(server_kind=False))
    assert by_name[S.SPAN_API].kind == SpanKind.INTERNAL


def test_turned_away_before_the_engine_is_an_error_with_the_input_side_only() -> None:
    rec = record(
        status_code=400, request_ids=[], handoff_mono_ns=None, first_body_mono_ns=None,
        last_output_mono_ns=None, stream=False,
    )  # fmt: skip
    by_name, spans = build(rec)
    root = by_name[S.SPAN_API]
    assert [s.name for s in spans] == [S.SPAN_API, S.SPAN_API_INPUT]
    assert root.status.status_code == StatusCode.ERROR and root.attributes[S.ERROR_TYPE] == "400"
    assert by_name[S.SPAN_API_INPUT].end_time == root.end_time
    # Missing is not zero: no first token, no read/render split without a hand-off.
    assert S.API_TTFB_MS not in root.attributes and not by_name[S.SPAN_API_INPUT].attributes


def test_a_4xx_after_the_engine_and_an_exception() -> None:
    by_name, _ = build(record(status_code=404))
    assert by_name[S.SPAN_API].status.status_code == StatusCode.UNSET  # the engine ran
    rec = record(status_code=0, exception="CancelledError", last_output_mono_ns=None,
                 responded=False)  # fmt: skip
    by_name, _ = build(rec)
    root = by_name[S.SPAN_API]
    assert S.API_E2E_MS not in root.attributes  # no last byte: no end to end, not 0
    assert root.attributes[S.ERROR_TYPE] == "CancelledError"
    assert S.HTTP_STATUS not in root.attributes
    assert S.SPAN_API_OUTPUT not in by_name  # no last output: no output side


def test_kept_by_the_tail_rule_a_root_in_the_clients_trace_linked_to_it() -> None:
    """Its ids stay those the engine's journeys were handed: their links reach it."""
    by_name, _ = build(record(head_sampled=False))
    root = by_name[S.SPAN_API]
    assert root.parent is None
    assert root.context.trace_id == CLIENT_TRACE and root.context.span_id == 0x1234
    assert [link.context.span_id for link in root.links] == [CLIENT_SPAN]
    assert root.attributes[S.SAMPLED_BY] == S.SAMPLED_TAIL


def test_an_arrival_stamp_far_outside_the_input_side_says_nothing() -> None:
    """A wall-clock step between vLLM's stamp and our anchor: no read/render split."""
    offset = 1_700_000_000 * 10**9
    far = (offset + 200 * MS) / 1e9  # after the end of the request
    by_name, _ = build(record(arrival_time_s=far), offset)
    assert not by_name[S.SPAN_API_INPUT].attributes


def test_stamps_outside_the_root_are_clamped_into_it() -> None:
    by_name, _ = build(record(handoff_mono_ns=5 * MS, last_output_mono_ns=70 * MS))
    root = by_name[S.SPAN_API]
    for name in (S.SPAN_API_INPUT, S.SPAN_API_OUTPUT):
        span = by_name[name]
        assert root.start_time <= span.start_time <= span.end_time <= root.end_time  # type: ignore[operator]


def test_the_engine_keeps_the_api_servers_mark_only_with_a_parent() -> None:
    marked = {**CLIENT, API_PARENT_KEY: "1", "x-other": "y"}
    assert bounded_trace_headers(marked) == {**CLIENT, API_PARENT_KEY: "1"}
    assert bounded_trace_headers({API_PARENT_KEY: "1"}) is None
    assert bounded_trace_headers({**CLIENT, API_PARENT_KEY: "yes"}) == CLIENT


def test_the_api_servers_exporter_counts_its_records_as_journeys() -> None:
    """Its exit line (exporter_process.py) says what it received, and is logged
    at all only when it received something."""
    memory = InMemorySpanExporter()
    sink = SpanSink.from_env({"service.name": "api"}, exporters=[memory], threaded=False)
    assert sink.consume([record(), record(stream=False)]) == 0
    sink.flush(5)
    assert sink.health.journeys == 2
    assert len(memory.get_finished_spans()) == sink.health.spans_built == 6
    assert sink.health.summary().startswith("2 journeys received, 6 spans built, 6 exported")
