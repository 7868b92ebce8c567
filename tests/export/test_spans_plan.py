"""The journey model and span plan, pure: no vLLM, no exporter.

Journeys are driven through RequestJourney's transitions with chosen monotonic
stamps, so the expected epoch times are exact.
"""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from vllm_journey_otel import schema as S
from vllm_journey_otel.engine.request_journey import RequestJourney
from vllm_journey_otel.export.span_builder import SpanBuilder
from vllm_journey_otel.export.spans import (
    client_context,
    parent_context,
    plan_spans,
    root_context,
)
from vllm_journey_otel.journey import (
    API_PARENT_KEY,
    STATUS_ABORTED,
    STATUS_ERROR,
    STATUS_LENGTH,
    FinishedJourney,
)

MS = 1_000_000
OFFSET = 1_700_000_000_000_000_000  # epoch ns at mono 0


def _journey(arrival_ms: float = 0.0) -> RequestJourney:
    arrival_s = (OFFSET + arrival_ms * MS) / 1e9 if arrival_ms >= 0 else 0.0
    return RequestJourney("r", arrival_s, 10 * MS, 0, prompt_tokens=100, max_tokens=8)


def _by_name(plan, name):  # type: ignore[no-untyped-def]
    return [p for p in plan if p.name == name]


def test_plain_plan_times_and_intervals() -> None:
    j = _journey(arrival_ms=5)
    j.scheduled(20 * MS, 1, 0, 100, 100, 0)
    j.tokens(30 * MS, 1, 1)
    j.tokens(40 * MS, 2, 2)
    fj = j.finish(50 * MS, 8, STATUS_LENGTH, "length", 8, 50 * MS)
    assert fj is not None
    plan = plan_spans(fj, OFFSET, uncertainty_ns=1500)
    root, queued, cycle, prefill, decode = plan
    assert (root.name, queued.name, cycle.name, prefill.name, decode.name) == (
        S.SPAN_REQUEST,
        S.SPAN_QUEUED,
        S.SPAN_SCHEDULED,
        S.SPAN_PREFILL,
        S.SPAN_DECODE,
    )
    # arrival, wall clock; vLLM keeps it as float seconds (sub-microsecond precision)
    assert abs(root.start_unix_ns - (OFFSET + 5 * MS)) < 1000
    assert (queued.start_unix_ns, queued.end_unix_ns) == (OFFSET + 10 * MS, OFFSET + 20 * MS)
    assert (prefill.start_unix_ns, prefill.end_unix_ns) == (OFFSET + 20 * MS, OFFSET + 30 * MS)
    assert (decode.start_unix_ns, decode.end_unix_ns) == (OFFSET + 30 * MS, OFFSET + 50 * MS)
    assert cycle.end_unix_ns == root.end_unix_ns == OFFSET + 50 * MS
    a = root.attributes
    assert a[S.QUEUED_MS] == pytest.approx(10.0)
    assert a[S.PREFILL_MS] == pytest.approx(10.0)
    assert a[S.TTFT_MS] == pytest.approx(25.0, abs=1e-3)  # arrival (5 ms) to first token (30 ms)
    assert a[S.DECODE_MS] == pytest.approx(20.0)
    assert a[S.CLOCK_UNCERTAINTY_US] == pytest.approx(1.5)
    assert prefill.parent == decode.parent == plan.index(cycle)
    assert queued.parent == cycle.parent == 0 and root.parent is None


def test_arrival_later_than_admission_is_clamped() -> None:
    """The API server's wall clock may run ahead of our anchor: never start after a child."""
    j = _journey(arrival_ms=15)  # "arrived" 5 ms after admission at 10 ms
    j.scheduled(20 * MS, 1, 0, 100, 100, 0)
    fj = j.finish(25 * MS, 1, STATUS_ABORTED, "abort", 0, None)
    assert fj is not None
    plan = plan_spans(fj, OFFSET)
    assert plan[0].start_unix_ns == plan[1].start_unix_ns == OFFSET + 10 * MS
    assert plan[0].attributes[S.QUEUED_MS] == pytest.approx(10.0)
    assert S.TTFT_MS not in plan[0].attributes


def test_missing_arrival_uses_admission() -> None:
    j = _journey(arrival_ms=-1)
    fj = j.finish(12 * MS, 0, STATUS_ABORTED, "abort", 0, None)
    assert fj is not None
    plan = plan_spans(fj, OFFSET)
    assert [p.name for p in plan] == [S.SPAN_REQUEST, S.SPAN_QUEUED]
    assert plan[0].start_unix_ns == OFFSET + 10 * MS


def test_preemption_plan() -> None:
    j = _journey()
    j.scheduled(20 * MS, 1, 0, 50, 100, 0)
    j.stepped(2, 50, 100)
    j.tokens(30 * MS, 2, 1)
    j.preempted(40 * MS, 4, 103, 3, 0.97, 5, 7)
    j.scheduled(60 * MS, 9, 64, 96, 103, 3)  # 64 tokens back from the prefix cache
    j.stepped(10, 96, 103)
    j.tokens(70 * MS, 10, 4)
    fj = j.finish(80 * MS, 12, STATUS_LENGTH, "length", 8, 80 * MS)
    assert fj is not None
    plan = plan_spans(fj, OFFSET)
    names = [p.name for p in plan]
    assert names == [
        S.SPAN_REQUEST,
        S.SPAN_QUEUED,
        S.SPAN_SCHEDULED,
        S.SPAN_PREFILL,
        S.SPAN_DECODE,
        S.SPAN_PREEMPTED,
        S.SPAN_SCHEDULED,
        S.SPAN_PREFILL,
        S.SPAN_DECODE,
    ]
    c0, p0, d0, pre, c1, p1, _d1 = plan[2:]
    assert p0.attributes[S.PREFILL_CHUNKS] == 2
    assert d0.end_unix_ns == c0.end_unix_ns == pre.start_unix_ns == OFFSET + 40 * MS
    assert pre.end_unix_ns == c1.start_unix_ns == OFFSET + 60 * MS
    assert pre.attributes[S.KV_CACHE_USAGE] == pytest.approx(0.97)
    assert pre.attributes[S.NUM_RUNNING] == 5 and pre.attributes[S.NUM_WAITING] == 7
    assert pre.attributes[S.NUM_PREEMPTIONS] == 1
    assert c0.attributes[S.NUM_PREEMPTIONS] == 1
    assert c1.attributes[S.SCHEDULE_KIND] == S.SCHEDULE_RESUME and c1.attributes[S.CYCLE] == 1
    assert p1.attributes[S.CACHED_TOKENS] == 64  # recompute partly from prefix cache
    assert p1.attributes[S.PREFILL_CHUNKS] == 2
    assert p1.attributes[S.PREFILL_DONE_TOKENS] == 100
    # Request-level intervals use the first cycle (vLLM's FinishedRequestStats).
    assert plan[0].attributes[S.PREFILL_MS] == pytest.approx(10.0)
    assert plan[0].attributes[S.NUM_PREEMPTIONS] == 1


def test_preempted_before_first_token_then_token_in_flight() -> None:
    j = _journey()
    j.scheduled(20 * MS, 1, 0, 100, 100, 0)
    j.preempted(25 * MS, 2, 100, 0, 1.0, 1, 0)
    assert j.awaiting_token
    j.tokens(27 * MS, 2, 1)  # the step in flight delivers the first token
    assert not j.awaiting_token
    j.scheduled(40 * MS, 5, 0, 101, 101, 1)
    j.tokens(50 * MS, 5, 2)
    fj = j.finish(60 * MS, 7, STATUS_LENGTH, "length", 8, 60 * MS)
    assert fj is not None
    plan = plan_spans(fj, OFFSET)
    cycles = [i for i, p in enumerate(plan) if p.name == S.SPAN_SCHEDULED]
    first_kids = [p.name for p in plan if p.parent == cycles[0]]
    assert first_kids == [S.SPAN_PREFILL]
    assert plan[0].attributes[S.TTFT_MS] == pytest.approx(27.0, abs=1e-3)  # arrival(0) -> 27


def test_tokens_returns_whether_a_first_token_is_still_awaited() -> None:
    """The per-step caller drops a request from its watch list on tokens()'s answer:
    it must be awaiting_token after the call, in every state."""
    j = _journey()
    seen = []

    def tokens(t_ms: int, step: int, out: int) -> None:
        got = j.tokens(t_ms * MS, step, out)
        assert got == j.awaiting_token, (j.state, out)
        seen.append(got)

    tokens(11, 0, 0)  # queued: nothing awaited
    j.scheduled(20 * MS, 1, 0, 50, 100, 0)
    tokens(21, 1, 0)  # running, prefill chunk without a token
    j.preempted(25 * MS, 2, 50, 0, 1.0, 1, 0)
    tokens(26, 2, 0)  # preempted before any token: still awaited
    tokens(27, 2, 1)  # the token of the step in flight: TTFT, nothing more awaited
    j.scheduled(40 * MS, 5, 0, 101, 101, 1)
    tokens(45, 5, 1)  # resumed, no new token in this cycle yet
    tokens(50, 6, 2)  # the cycle's first token
    tokens(55, 7, 3)  # decoding
    assert seen == [False, True, True, False, True, False, False]
    fj = j.finish(60 * MS, 8, STATUS_LENGTH, "length", 3, 55 * MS)
    assert fj is not None
    tokens(61, 8, 3)  # finished
    assert fj.first_token_mono_ns == 27 * MS


def test_transitions_out_of_order_are_ignored() -> None:
    j = _journey()
    j.preempted(11 * MS, 0, 0, 0, 0.5, 0, 0)  # queued: nothing to preempt
    j.tokens(12 * MS, 0, 1)  # queued: no cycle
    j.stepped(0, 0, 10)
    assert j.events == [] and j.num_preemptions == 0
    j.scheduled(20 * MS, 1, 0, 10, 100, 0)
    assert not j.scheduled(21 * MS, 2, 0, 10, 100, 0)  # already running
    fj = j.finish(30 * MS, 3, STATUS_ABORTED, "abort", 0, None)
    assert fj is not None
    assert j.finish(31 * MS, 3, STATUS_ABORTED, "abort", 0, None) is None


def test_error_status_and_trace_parent() -> None:
    j = RequestJourney(
        "e",
        0.0,
        10 * MS,
        0,
        4,
        4,
        trace_headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    )
    j.scheduled(20 * MS, 1, 0, 4, 4, 0)
    fj = j.finish(30 * MS, 1, STATUS_ERROR, "error", 0, None)
    assert fj is not None
    builder = SpanBuilder(Resource({}), SpanLimits())
    spans = {s.name: s for s in builder.build(plan_spans(fj, OFFSET), *root_context(fj))}
    root = spans[S.SPAN_REQUEST]
    assert root.status.status_code.name == "ERROR"
    assert root.attributes[S.FINISH_STATUS] == S.FINISH_ERROR
    assert root.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert spans[S.SPAN_PREFILL].parent.span_id == spans[S.SPAN_SCHEDULED].context.span_id
    assert root.start_time == OFFSET + 10 * MS and root.end_time == OFFSET + 30 * MS


def test_finished_journey_roundtrips_through_msgspec() -> None:
    import msgspec

    j = _journey()
    j.scheduled(20 * MS, 1, 0, 100, 100, 0)
    j.tokens(30 * MS, 1, 1)
    j.preempted(40 * MS, 2, 101, 1, 0.9, 1, 2)
    fj = j.finish(45 * MS, 2, STATUS_ABORTED, "abort", 1, None)
    raw = msgspec.msgpack.encode(fj)
    back = msgspec.msgpack.decode(raw, type=FinishedJourney)
    assert back == fj
    assert plan_spans(back, OFFSET) == plan_spans(fj, OFFSET)


def test_finish_carries_every_field_to_its_place() -> None:
    """finish() builds the record positionally: each field gets its own value
    (every value below is distinct, so a swap of two fields fails)."""
    tp = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    j = RequestJourney(
        "rid-7", 1234.5, 10 * MS, 3, 77, 55, priority=4, lora_name="sql",
        trace_headers={"traceparent": tp}, head_sampled=False, spec_decode=True, session=False,
    )  # fmt: skip
    j.scheduled(20 * MS, 4, 0, 50, 77, 0)
    j.tokens(25 * MS, 5, 5)  # the first token
    j.drafts_so_far(9, 6)
    target = j.link_target()
    fj = j.finish(30 * MS, 6, STATUS_ABORTED, "abort", 8, 29 * MS)
    assert fj is not None
    assert (fj.request_id, fj.arrival_time_s, fj.prompt_tokens, fj.max_tokens) == (
        "rid-7", 1234.5, 77, 55
    )  # fmt: skip
    assert fj.admitted.t_mono_ns == 10 * MS and fj.admitted.step == 3
    assert fj.end.t_mono_ns == 30 * MS and fj.end.step == 6
    assert fj.end_prefill_chunks == 0 and [e.at.step for e in fj.events] == [4, 5]
    assert (fj.status, fj.finish_reason, fj.output_tokens) == (STATUS_ABORTED, "abort", 8)
    assert (fj.first_token_mono_ns, fj.last_token_mono_ns) == (25 * MS, 29 * MS)
    assert (fj.priority, fj.lora_name) == (4, "sql")
    assert fj.trace_headers == {"traceparent": tp}
    assert (fj.head_sampled, fj.session, fj.spec_decode) == (False, False, True)
    assert fj.root_ids == target.ids
    assert (fj.drafts_proposed, fj.drafts_accepted) == (9, 6)


def test_trace_headers_are_bounded_and_malformed_ones_make_a_root() -> None:
    from opentelemetry import trace

    from vllm_journey_otel.engine.trace_headers import TRACESTATE_MAX, bounded_trace_headers
    from vllm_journey_otel.export.spans import parent_context

    good = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    kept = bounded_trace_headers({"traceparent": good, "tracestate": "x=1", "cookie": "secret"})
    assert kept == {"traceparent": good, "tracestate": "x=1"}, "only the W3C headers are kept"
    assert bounded_trace_headers({"traceparent": "0" * 10_000}) is None
    long_state = ",".join(f"v{i}=" + "z" * 20 for i in range(100))
    state = bounded_trace_headers({"traceparent": good, "tracestate": long_state})
    assert state is not None
    assert 0 < len(state["tracestate"]) <= TRACESTATE_MAX
    assert long_state.startswith(state["tracestate"] + ",")  # whole members only
    bad = [
        "", "garbage", good.upper(), good + "-extra", good[:-1], "ff" + good[2:],
        "00-" + "0" * 32 + "-" + "b" * 16 + "-01", "00-" + "a" * 32 + "-" + "0" * 16 + "-01",
    ]  # fmt: skip
    for tp in bad:
        ctx = parent_context(bounded_trace_headers({"traceparent": tp, "tracestate": "=,=="}))
        assert not trace.get_current_span(ctx).get_span_context().is_valid, tp
    ctx = parent_context(bounded_trace_headers({"traceparent": good}))
    assert trace.get_current_span(ctx).get_span_context().trace_id == int("a" * 32, 16)


def test_waits_inside_the_queue_plan() -> None:
    """A wait that ends while queued, one closed by the schedule, one inside a preemption."""
    from vllm_journey_otel.journey import WaitBegan

    lora = S.WAIT_REASONS.index(S.WAIT_LORA_SLOT)
    j = _journey()
    j.wait_began(12 * MS, 1, lora)
    j.wait_began(13 * MS, 1, lora)  # already waiting for it: nothing new
    j.wait_ended(14 * MS, 2)
    j.wait_ended(14 * MS, 2)  # no open wait: nothing
    j.wait_began(16 * MS, 3, lora)
    j.scheduled(20 * MS, 4, 0, 100, 100, 0)
    j.wait_began(21 * MS, 4, lora)  # running: not a wait in the queue
    j.preempted(25 * MS, 5, 50, 0, 0.9, 1, 0)
    j.wait_began(27 * MS, 6, lora)
    assert sum(isinstance(e, WaitBegan) for e in j.events) == 3
    fj = j.finish(30 * MS, 7, STATUS_ABORTED, "abort", 0, None)
    assert fj is not None
    plan = plan_spans(fj, OFFSET)
    queued = plan.index(_by_name(plan, S.SPAN_QUEUED)[0])
    preempted = plan.index(_by_name(plan, S.SPAN_PREEMPTED)[0])
    waits = [
        (p.parent, (p.start_unix_ns - OFFSET) // MS, (p.end_unix_ns - OFFSET) // MS)
        for p in _by_name(plan, S.SPAN_WAIT)
    ]
    assert waits == [(queued, 12, 14), (queued, 16, 20), (preempted, 27, 30)]
    for w in _by_name(plan, S.SPAN_WAIT):
        assert w.attributes == {S.WAIT_REASON: S.WAIT_LORA_SLOT}


def test_remote_kv_transfer_figures_on_their_wait_only() -> None:
    """The transfer's end lands on the open remote_kv wait: its duration from the
    wait's start, tokens and outcome; unknown outcome and tokens are absent; a
    report with no remote_kv wait open is ignored."""
    kv = S.WAIT_REASONS.index(S.WAIT_REMOTE_KV)
    lora = S.WAIT_REASONS.index(S.WAIT_LORA_SLOT)
    j = _journey()
    j.wait_began(12 * MS, 1, lora)
    j.kv_loaded(13 * MS, 1, 40, 0)  # a LoRA wait: not a transfer
    j.wait_began(14 * MS, 2, kv)  # the LoRA wait ends, the load starts
    j.kv_loaded(17 * MS, 3, -1, -1)  # done; tokens and outcome not known
    j.scheduled(20 * MS, 4, 39, 40, 40, 0)
    j.kv_loaded(21 * MS, 4, 40, 1)  # running: not in a wait
    j.preempted(25 * MS, 5, 40, 1, 0.9, 1, 0)
    j.wait_began(26 * MS, 6, kv)
    j.kv_loaded(28 * MS, 7, 40, 1)  # failed
    fj = j.finish(30 * MS, 8, STATUS_ABORTED, "abort", 1, None)
    assert fj is not None
    lora_wait, first, second = _by_name(plan_spans(fj, OFFSET), S.SPAN_WAIT)
    assert lora_wait.attributes == {S.WAIT_REASON: S.WAIT_LORA_SLOT}
    assert first.attributes == {S.WAIT_REASON: S.WAIT_REMOTE_KV, S.KV_TRANSFER_MS: 3.0}
    assert second.attributes == {
        S.WAIT_REASON: S.WAIT_REMOTE_KV,
        S.KV_TRANSFER_MS: 2.0,
        S.KV_TRANSFER_TOKENS: 40,
        S.KV_TRANSFER_FAILED: True,
    }


def test_spec_decode_plan_per_decode_span() -> None:
    j = RequestJourney("r", 0.0, 10 * MS, 0, prompt_tokens=100, max_tokens=50, spec_decode=True)
    j.scheduled(20 * MS, 1, 0, 100, 100, 0)
    j.tokens(30 * MS, 1, 1)
    j.verified(3, 2)
    j.verified(3, 0)
    j.preempted(40 * MS, 3, 100, 5, 0.5, 1, 0)
    j.verified(3, 3)  # async: output of a step in flight at the preemption
    j.scheduled(50 * MS, 4, 0, 105, 105, 5)
    j.tokens(60 * MS, 4, 6)
    j.verified(4, 1)
    fj = j.finish(70 * MS, 5, STATUS_LENGTH, "length", 8, 70 * MS)
    assert fj is not None
    plan = plan_spans(fj, OFFSET)
    d1, d2 = _by_name(plan, S.SPAN_DECODE)
    assert (d1.attributes[S.SPEC_DRAFTS_PROPOSED], d1.attributes[S.SPEC_DRAFTS_ACCEPTED]) == (6, 2)
    assert d1.attributes[S.SPEC_ACCEPTANCE_RATE] == pytest.approx(1 / 3)
    assert (d2.attributes[S.SPEC_DRAFTS_PROPOSED], d2.attributes[S.SPEC_DRAFTS_ACCEPTED]) == (4, 1)
    root = plan[0].attributes
    # The root counts every verify step, the one in flight at the preemption too.
    assert (root[S.SPEC_DRAFTS_PROPOSED], root[S.SPEC_DRAFTS_ACCEPTED]) == (13, 6)


def test_step_records_and_journeys_share_the_pipe_and_link() -> None:
    """What the exporter process receives: journeys and step records in one frame;
    a step's links resolve to the roots of the journeys it names."""
    from vllm_journey_otel.export.span_sink import SpanSink
    from vllm_journey_otel.journey import StepRecord
    from vllm_journey_otel.wire import DECODER, ENCODER, Frame

    j = _journey()
    j.scheduled(20 * MS, 1, 0, 100, 100, 0)
    target = j.link_target()
    assert j.link_target() is target  # chosen once
    fj = j.finish(25 * MS, 1, STATUS_ABORTED, "abort", 0, None)
    assert fj is not None and fj.root_ids == target.ids
    step = StepRecord(1, 19 * MS, 20 * MS, 24 * MS, 1, 100, 0, 0, 0.5, 1, 0, [target])
    frame = DECODER.decode(ENCODER.encode(Frame([fj, step], 0)))
    back = frame.journeys
    assert back == [fj, step]

    exporter = InMemorySpanExporter()
    assert SpanSink.from_env({}, exporters=[exporter], threaded=False).consume(back) == 0
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root, step_span = spans[S.SPAN_REQUEST], spans[S.SPAN_STEP]
    assert step_span.parent is None
    assert step_span.context.trace_id != root.context.trace_id
    (link,) = step_span.links
    assert (link.context.trace_id, link.context.span_id) == (
        root.context.trace_id,
        root.context.span_id,
    )
    assert step_span.attributes[S.STEP_SCHEDULE_MS] == pytest.approx(1.0)
    assert step_span.attributes[S.STEP_PREFILL_TOKENS] == 100


def test_ids_and_sampling_ignore_vllms_seeded_global_random() -> None:
    """vLLM seeds the global ``random`` (seed 0 by default) in the engine core: ids
    drawn from it would repeat after every restart and on every replica."""
    import random

    from vllm_journey_otel import rng
    from vllm_journey_otel.engine.sampling import HeadSampler

    def draw() -> tuple[object, ...]:
        random.seed(0)  # what vLLM does at start-up
        target = _journey().link_target()
        sampled = [HeadSampler(ratio=0.5).sampled(None) for _ in range(64)]
        return target.ids, rng.trace_id(), rng.span_id(), tuple(sampled)

    first, second = draw(), draw()
    for a, b in zip(first, second, strict=True):
        assert a != b
    state = random.getstate()
    draw()
    random.seed(0)
    assert random.getstate() == state, "vLLM's own random stream is not consumed"


_TRACE = "0af7651916cd43dd8448eb211c80319c"
_SPAN = "b7ad6b7169203331"


class _Str(str):
    pass


@pytest.mark.parametrize(
    "headers",
    [
        {"traceparent": f"00-{_TRACE}-{_SPAN}-01"},
        {"traceparent": f"00-{_TRACE}-{_SPAN}-00"},  # not sampled by the client
        {"traceparent": f"00-{_TRACE}-{_SPAN}-ff"},  # flags beyond sampled
        {"traceparent": f"00-{'0' * 32}-{_SPAN}-01"},  # invalid trace id
        {"traceparent": f"00-{_TRACE}-{'0' * 16}-01"},  # invalid span id
        {"traceparent": f"00-{_TRACE.upper()}-{_SPAN}-01"},  # uppercase hex: invalid
        {"traceparent": f"ff-{_TRACE}-{_SPAN}-01"},  # version ff: invalid
        {"traceparent": f"01-{_TRACE}-{_SPAN}-01"},  # a later version
        {"traceparent": f"01-{_TRACE}-{_SPAN}-01-more"},  # a later version, extended
        {"traceparent": f"00-{_TRACE}-{_SPAN}-01-more"},  # version 00 extended: invalid
        {"traceparent": f" 00-{_TRACE}-{_SPAN}-01"},  # surrounding space
        {"traceparent": f"00-{_TRACE}-{_SPAN}-0x"},
        {"traceparent": f"00_{_TRACE}-{_SPAN}-01"},
        {"traceparent": f"00-{_TRACE}-{_SPAN}-01", "tracestate": "vendor=1,other=two"},
        # The API server's headers (its traceparent and its mark): the default path.
        {"traceparent": f"00-{_TRACE}-{_SPAN}-01", API_PARENT_KEY: "1"},
        {"traceparent": f"00-{_TRACE}-{_SPAN}-00", API_PARENT_KEY: "1"},
        {"traceparent": f"00-{_TRACE}-{_SPAN}-01", API_PARENT_KEY: "1", "tracestate": "v=1"},
        {"traceparent": f"00-{_TRACE}-{_SPAN}-01", "other": "x"},
        {"traceparent": f"00-{_TRACE}-{_SPAN}-01 "},  # 56 characters: trailing space
        {"traceparent": f"00-{_TRACE}-{_SPAN}-01\t"},
        {"traceparent": f"00-{_TRACE}-{_SPAN}-01\n"},
        {"traceparent": _Str(f"00-{_TRACE}-{_SPAN}-01")},  # a str subclass
        {"traceparent": [f"00-{_TRACE}-{_SPAN}-01"]},  # not a str
        {"tracestate": "vendor=1"},
        {"other": "x"},
        {},
    ],
)
def test_the_client_context_is_what_the_propagator_reads(headers: dict[str, str]) -> None:
    """client_context parses the common traceparent itself; every header,
    common or not, must read as the SDK's W3C propagator reads it."""
    theirs = trace.get_current_span(parent_context(headers)).get_span_context()
    ours = client_context(headers)
    if not theirs.is_valid:
        assert ours is None
        return
    assert ours is not None
    assert (ours.trace_id, ours.span_id, ours.trace_flags, ours.is_remote) == (
        theirs.trace_id,
        theirs.span_id,
        theirs.trace_flags,
        theirs.is_remote,
    )
    assert ours.trace_state == theirs.trace_state


def test_the_api_servers_headers_are_parsed_without_the_propagator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default path (every journey under an API-server span) takes the
    direct parse: the exporter pays no propagator per journey for it."""
    import vllm_journey_otel.export.spans as spans

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the propagator was called")

    monkeypatch.setattr(spans._PROPAGATOR, "extract", refuse)
    ctx = client_context({"traceparent": f"00-{_TRACE}-{_SPAN}-01", API_PARENT_KEY: "1"})
    assert ctx is not None
    assert (ctx.trace_id, ctx.span_id, int(ctx.trace_flags)) == (int(_TRACE, 16), int(_SPAN, 16), 1)
