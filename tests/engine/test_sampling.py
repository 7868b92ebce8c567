"""Head sampling at admission and the in-engine tail rule."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import import_harness, requires_vllm
from vllm_journey_otel import schema as S
from vllm_journey_otel.config import MODE_THREAD, Config
from vllm_journey_otel.engine import handoff, hooks, sampling, state
from vllm_journey_otel.engine.sampling import HeadSampler, TailRule
from vllm_journey_otel.journey import API_PARENT_KEY

TRACE = "0af7651916cd43dd8448eb211c80319c"
SPAN = "b7ad6b7169203331"


def tp(flags: str) -> dict[str, str]:
    return {"traceparent": f"00-{TRACE}-{SPAN}-{flags}"}


@pytest.mark.parametrize(
    ("env", "parent_based", "ratio"),
    [
        ({}, True, 1.0),
        ({"OTEL_TRACES_SAMPLER": "always_off"}, False, 0.0),
        ({"OTEL_TRACES_SAMPLER": "parentbased_always_off"}, True, 0.0),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}, False, 0.25),
        (
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"},
            True,
            0.0,
        ),
    ],
)
def test_head_sampler_from_standard_variables(env, parent_based, ratio) -> None:  # type: ignore[no-untyped-def]
    assert HeadSampler.from_env(env) == HeadSampler(parent_based, ratio)


def test_head_sampler_bad_values_warn(caplog) -> None:  # type: ignore[no-untyped-def]
    with caplog.at_level(logging.WARNING, logger="vllm.journey_otel"):
        assert HeadSampler.from_env({"OTEL_TRACES_SAMPLER": "sometimes"}) == HeadSampler()
        assert HeadSampler.from_env(
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}
        ) == HeadSampler(False, 1.0)
    assert "OTEL_TRACES_SAMPLER" in caplog.text and "OTEL_TRACES_SAMPLER_ARG" in caplog.text


def test_head_sampler_follows_the_parent_flag() -> None:
    never = HeadSampler(parent_based=True, ratio=0.0)
    assert never.sampled(tp("01"))
    assert not never.sampled(tp("00"))
    assert not never.sampled({"traceparent": "00-garbage"})  # malformed: a root, ratio 0
    assert not HeadSampler(parent_based=True, ratio=1.0).sampled(tp("00"))
    assert HeadSampler(parent_based=False, ratio=1.0).sampled(tp("00"))
    half = HeadSampler(parent_based=False, ratio=0.5)
    share = sum(half.sampled(None) for _ in range(4000)) / 4000
    assert 0.45 < share < 0.55


def _w3c_decision(sampler: HeadSampler, headers: dict[str, str]) -> bool:
    """The decision from the full W3C parse (the SDK propagator's rules)."""
    client = sampling.client_trace(headers.get("traceparent"))
    if client is not None and sampler.parent_based:
        return (client[1] & 1) == 1
    return sampler.ratio >= 1.0


def test_the_api_servers_headers_are_decided_without_a_w3c_parse(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The headers the API server hands the engine core (its traceparent and its
    mark: every request in the default configuration) are decided from their
    version and flags alone, as the full parse decides them; anything else (a
    tracestate, a client's own headers, a mark on a traceparent of another
    length, version or flags than the API server writes) is parsed. The ids are
    not checked: whoever sets the internal mark vouches for them."""
    mark = {API_PARENT_KEY: "1"}
    ours = [{**tp(flags), **mark} for flags in ("00", "01")]
    others = [
        *(tp(f"{flags:02x}") for flags in (0, 1, 3)),
        *({**tp(f"{flags:02x}"), **mark} for flags in range(2, 256)),
        {**tp("0F"), **mark},
        {**tp("01"), **mark, "traceparent": f"ff-{TRACE}-{SPAN}-01"},
        {**tp("01"), **mark, "traceparent": f" 00-{TRACE}-{SPAN[:15]}-01"},
        {**tp("01"), **mark, "tracestate": "k=v"},
        {"traceparent": f"01-{TRACE}-{SPAN}-01-extra", **mark},
    ]
    for sampler in (HeadSampler(True, 0.0), HeadSampler(True, 1.0), HeadSampler(False, 0.0)):
        for headers in [*ours, *others]:
            assert sampler.decide(headers) == (_w3c_decision(sampler, headers), None), headers
    # The one intended difference: ids the full parse rejects (all zeros) under
    # the mark are taken as written; the API server never writes such ids.
    zero_ids = {"traceparent": f"00-{'0' * 32}-{SPAN}-01", **mark}
    assert HeadSampler(True, 0.0).decide(zero_ids) == (True, None)
    assert _w3c_decision(HeadSampler(True, 0.0), zero_ids) is False
    parsed: list[str | None] = []
    real = sampling.client_trace
    monkeypatch.setattr(sampling, "client_trace", lambda t: parsed.append(t) or real(t))
    for headers in ours:
        HeadSampler(True, 0.0).decide(headers)
    assert parsed == []
    for headers in others:
        HeadSampler(True, 0.0).decide(headers)
    assert len(parsed) == len(others)


def test_tail_rule_from_env(caplog) -> None:  # type: ignore[no-untyped-def]
    assert TailRule.from_env({}) == TailRule(True, True, True, None, in_flight=True)
    assert not TailRule.from_env({"VLLM_JOURNEY_OTEL_TAIL": "none"}).active
    rule = TailRule.from_env(
        {"VLLM_JOURNEY_OTEL_TAIL": "error", "VLLM_JOURNEY_OTEL_TAIL_SLOW_MS": "250"}
    )
    assert rule == TailRule(False, True, False, 250_000_000, in_flight=False)
    assert rule.keeps(False, False, 0, 300_000_000) and not rule.keeps(False, True, 3, 1)
    with caplog.at_level(logging.WARNING, logger="vllm.journey_otel"):
        TailRule.from_env({"VLLM_JOURNEY_OTEL_TAIL": "preempted,weird"})
    assert "weird" in caplog.text


@requires_vllm
def test_ratio_zero_keeps_only_the_tail(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    harness = import_harness()
    exporter = InMemorySpanExporter()
    assert hooks.install(
        Config(enabled=True, export_mode=MODE_THREAD),
        exporters=[exporter],
        batch=False,
        head=HeadSampler(parent_based=True, ratio=0.0),
        tail=TailRule(),
    )
    try:
        e = harness.Engine(num_blocks=5, max_num_batched_tokens=64, max_model_len=512)
        e.add("A", prompt_len=14, max_tokens=20, trace_headers=tp("00"))
        e.step()
        e.step()
        e.add("B", prompt_len=32, max_tokens=5, trace_headers=tp("00"))  # will be preempted
        e.add("C", prompt_len=8, max_tokens=3, trace_headers=tp("01"))  # sampled parent
        e.add("D", prompt_len=8, max_tokens=40)  # no parent, ratio 0, aborted below
        e.step()
        e.abort("D")
        e.run()
        assert handoff.flush(10)
        assert e.requests["B"].num_preemptions > 0 and e.requests["A"].num_preemptions == 0
        spans = exporter.get_finished_spans()
    finally:
        hooks.uninstall()
    roots = {s.attributes[S.REQUEST_ID]: s for s in spans if s.name == S.SPAN_REQUEST}
    assert set(roots) == {"B", "C", "D"}  # A: unsampled, uneventful, dropped
    assert roots["C"].attributes[S.SAMPLED_BY] == S.SAMPLED_HEAD
    assert roots["C"].parent is not None and roots["C"].parent.span_id == int(SPAN, 16)
    b = roots["B"]
    assert b.attributes[S.SAMPLED_BY] == S.SAMPLED_TAIL
    # The client's trace was not sampled: a new root, linked to the client's span.
    assert b.parent is None and b.context.trace_id != int(TRACE, 16)
    assert [(link.context.trace_id, link.context.span_id) for link in b.links] == [
        (int(TRACE, 16), int(SPAN, 16))
    ]
    assert roots["D"].attributes[S.FINISH_STATUS] == S.FINISH_ABORTED
    assert roots["D"].attributes[S.SAMPLED_BY] == S.SAMPLED_TAIL
    assert not roots["D"].links


@requires_vllm
def test_unsampled_without_tail_records_nothing() -> None:
    harness = import_harness()
    exporter = InMemorySpanExporter()
    assert hooks.install(
        Config(enabled=True, export_mode=MODE_THREAD),
        exporters=[exporter],
        batch=False,
        head=HeadSampler(parent_based=True, ratio=0.0),
        tail=TailRule(False, False, False, None, in_flight=False),
    )
    try:
        e = harness.Engine()
        req = e.add("x", prompt_len=10, max_tokens=3)
        assert getattr(req, state.JOURNEY_ATTR, None) is None  # no state at all
        e.run()
        assert handoff.flush(10)
    finally:
        hooks.uninstall()
    assert exporter.get_finished_spans() == ()


@requires_vllm
@pytest.mark.parametrize("parent_based", [True, False])
def test_admission_takes_the_api_servers_headers_as_they_are(monkeypatch, parent_based) -> None:  # type: ignore[no-untyped-def]
    """On a real Scheduler: with parent-based sampling, the API server's headers
    (its traceparent and mark) are decided by their flags without the sampler
    and kept as they came (bounded already); a client's own headers go through
    the sampler and are bounded (other keys dropped, a long tracestate cut).
    Without parent-based sampling every request goes through the sampler."""
    harness = import_harness()
    from vllm_journey_otel.engine.trace_headers import TRACESTATE_MAX

    decided: list[object] = []
    real = HeadSampler.decide
    monkeypatch.setattr(HeadSampler, "decide", lambda s, h: decided.append(h) or real(s, h))
    exporter = InMemorySpanExporter()
    assert hooks.install(
        Config(enabled=True, export_mode=MODE_THREAD),
        exporters=[exporter],
        batch=False,
        head=HeadSampler(parent_based=parent_based, ratio=1.0 if not parent_based else 0.0),
        tail=TailRule(False, False, False, None, in_flight=False),
    )
    mark = {API_PARENT_KEY: "1"}
    long_state = ",".join(f"k{i}=v{i}" for i in range(400))
    client = {**tp("01"), "tracestate": long_state, "cookie": "secret"}
    try:
        e = harness.Engine()
        api_headers = {**tp("01"), **mark}
        api_on = e.add("api-on", prompt_len=10, max_tokens=2, trace_headers=api_headers)
        api_off = e.add("api-off", prompt_len=10, max_tokens=2, trace_headers={**tp("00"), **mark})
        own = e.add("client", prompt_len=10, max_tokens=2, trace_headers=dict(client))
        kept = {
            rid: j.trace_headers
            for rid, req in (("api-on", api_on), ("api-off", api_off), ("client", own))
            if (j := getattr(req, state.JOURNEY_ATTR, None)) is not None
        }
        e.run()
        assert handoff.flush(10)
    finally:
        hooks.uninstall()
    if parent_based:
        assert decided == [client], "only the client's own headers take the sampler"
        assert set(kept) == {"api-on", "client"}, "api-off: its flags say not sampled"
    else:
        assert len(decided) == 3
        assert set(kept) == {"api-on", "api-off", "client"}
    if parent_based:
        assert kept["api-on"] is api_headers, "bounded already: not copied"
    assert kept["api-on"] == {**tp("01"), **mark}
    assert set(kept["client"]) == {"traceparent", "tracestate"}
    assert 0 < len(kept["client"]["tracestate"]) <= TRACESTATE_MAX
    spans = exporter.get_finished_spans()
    roots = {s.attributes[S.REQUEST_ID]: s for s in spans if s.name == S.SPAN_REQUEST}
    assert set(roots) == set(kept)
    assert roots["api-on"].parent is not None and roots["api-on"].parent.span_id == int(SPAN, 16)


def _sdk_samples(ratio: float, trace_id: int) -> bool:
    """The SDK's own TraceIdRatioBased decision for a span of this trace."""
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    return TraceIdRatioBased(ratio).should_sample(None, trace_id, "x").decision.is_sampled()


@pytest.mark.parametrize("ratio", [0.001, 0.25, 0.5, 0.9])
def test_ratio_decides_on_the_client_trace_id_as_the_sdk_does(ratio: float) -> None:
    import random

    sampler = HeadSampler(parent_based=False, ratio=ratio)
    gen = random.Random(7)
    agreed = kept = 0
    for _ in range(3000):
        trace_id = gen.getrandbits(128) or 1
        headers = {"traceparent": f"00-{trace_id:032x}-{SPAN}-{gen.choice(['00', '01'])}"}
        mine, ids = sampler.decide(headers)
        assert ids is None  # the client's trace: the root takes its trace id
        assert sampler.decide(dict(headers))[0] == mine  # every journey of the trace agrees
        agreed += mine == _sdk_samples(ratio, trace_id)
        kept += mine
    assert agreed == 3000
    assert 0 < kept < 3000 or ratio < 0.01


@pytest.mark.parametrize("parent_based", [False, True])
def test_ratio_for_a_new_trace_picks_the_trace_id_it_decided_on(parent_based: bool) -> None:
    sampler = HeadSampler(parent_based=parent_based, ratio=0.5)
    outcomes = set()
    for headers in [None, {}, {"traceparent": "00-garbage"}] * 200:
        mine, ids = sampler.decide(headers)
        assert ids is not None
        trace_id = (ids.trace_hi << 64) | ids.trace_lo
        assert mine == _sdk_samples(0.5, trace_id)
        outcomes.add(mine)
    assert outcomes == {True, False}


@requires_vllm
def test_journeys_of_one_trace_get_one_decision_on_a_real_scheduler() -> None:
    """traceidratio, tail rule off: siblings of one client trace (as n=2 makes
    them) are kept or dropped together, and every root of a new trace that is
    exported carries a trace id the SDK's own sampler keeps."""
    harness = import_harness()
    exporter = InMemorySpanExporter()
    ratio = 0.5
    assert hooks.install(
        Config(enabled=True, export_mode=MODE_THREAD),
        exporters=[exporter],
        batch=False,
        head=HeadSampler(parent_based=False, ratio=ratio),
        tail=TailRule(False, False, False, None, in_flight=False),
    )
    traces = [(0x1F << 96) | (k * 0x9E3779B97F4A7C15 % (1 << 64)) for k in range(1, 13)]
    try:
        e = harness.Engine(num_blocks=40, max_num_batched_tokens=256, max_model_len=512)
        for k, trace_id in enumerate(traces):
            headers = {"traceparent": f"00-{trace_id:032x}-{SPAN}-00"}
            for sibling in ("a", "b"):
                e.add(f"t{k}{sibling}", prompt_len=6, max_tokens=2, trace_headers=dict(headers))
        for k in range(24):
            e.add(f"own{k}", prompt_len=6, max_tokens=2)
        e.run()
        assert handoff.flush(10)
        spans = exporter.get_finished_spans()
    finally:
        hooks.uninstall()
    roots = {s.attributes[S.REQUEST_ID]: s for s in spans if s.name == S.SPAN_REQUEST}
    for k, trace_id in enumerate(traces):
        expected = _sdk_samples(ratio, trace_id)
        assert (f"t{k}a" in roots) == (f"t{k}b" in roots) == expected, k
    own = [r for rid, r in roots.items() if rid.startswith("own")]
    assert own and all(_sdk_samples(ratio, r.context.trace_id) for r in own)
    assert all(r.parent is None for r in own)


@pytest.mark.parametrize(
    "header",
    [
        f"00-{TRACE}-{SPAN}-01",
        f"00-{TRACE}-{SPAN}-00",
        f"  00-{TRACE}-{SPAN}-01  ",
        f"01-{TRACE}-{SPAN}-01-future-fields",
        f"00-{TRACE}-{SPAN}-01-suffix",  # version 00 allows no suffix
        f"ff-{TRACE}-{SPAN}-01",
        f"00-{'0' * 32}-{SPAN}-01",
        f"00-{TRACE}-{'0' * 16}-01",
        f"00-{TRACE.upper()}-{SPAN}-01",
        f"00-{TRACE}-{SPAN}",
        "garbage",
        "",
    ],
)
def test_the_engines_parent_is_the_propagators_parent(header: str) -> None:
    """Head sampling reads a traceparent exactly as the exporter's W3C propagator
    does: a parent for one is a parent for the other, with the same trace id."""
    from vllm_journey_otel.engine.sampling import client_trace
    from vllm_journey_otel.export.spans import client_context

    mine = client_trace(header)
    theirs = client_context({"traceparent": header})
    assert (mine is None) == (theirs is None), header
    if mine is not None and theirs is not None:
        assert mine[0] == theirs.trace_id and (mine[1] & 1) == int(theirs.trace_flags.sampled)


@pytest.mark.parametrize("vllm_tracing", [False, True])
def test_trace_headers_read_at_admission_not_copied_into_every_output(
    vllm_tracing, tracing
) -> None:  # type: ignore[no-untyped-def]
    """vLLM copies a request's trace_headers into each of its outputs (serialised
    in the engine core, decoded in the API server, per token) for its own
    tracing alone. Without it the tracker takes them at admission and no output
    carries them; the journey is still in the client's trace. With vLLM's own
    tracing on (--otlp-traces-endpoint) they are left for it, on every output."""
    harness = import_harness()
    endpoint = "http://127.0.0.1:1" if vllm_tracing else None
    e = harness.Engine(otlp_traces_endpoint=endpoint)
    e.add("traced", prompt_len=10, max_tokens=4, trace_headers=tp("01"))
    e.add("plain", prompt_len=10, max_tokens=4)
    e.run()
    assert len(e.outputs["traced"]) == 4
    assert e.outputs_with_headers == ({"traced": 4} if vllm_tracing else {})
    root = tracing.journeys()["traced"].span
    assert root.context.trace_id == int(TRACE, 16) and root.parent.span_id == int(SPAN, 16)


@requires_vllm
def test_admissions_count_the_unsampled_requests_queued_beside_them() -> None:
    """Between two steps the tracker carries vLLM's counts from one admission to
    the next of the same burst: an unsampled request in between (no journey)
    still joined vLLM's queue, and the next admission's waiting count says so."""
    harness = import_harness()
    exporter = InMemorySpanExporter()
    assert hooks.install(
        Config(enabled=True, export_mode=MODE_THREAD),
        exporters=[exporter],
        batch=False,
        head=HeadSampler(parent_based=True, ratio=1.0),
        tail=TailRule(False, False, False, None, in_flight=False),
    )
    try:
        e = harness.Engine()
        s = e.scheduler
        seen = {}
        for rid, flags in (("a", "01"), ("b", "00"), ("c", "01"), ("d", "01")):
            e.add(rid, prompt_len=10, max_tokens=3, trace_headers=tp(flags))
            seen[rid] = s.get_request_counts()
        e.run()
        assert handoff.flush(10)
    finally:
        hooks.uninstall()
    spans = exporter.get_finished_spans()
    roots = {
        s.context.span_id: s.attributes[S.REQUEST_ID] for s in spans if s.name == S.SPAN_REQUEST
    }
    queued = {roots[s.parent.span_id]: s for s in spans if s.name == S.SPAN_QUEUED and s.parent}
    assert sorted(queued) == ["a", "c", "d"]  # b was not sampled
    for rid, span in queued.items():
        assert (span.attributes[S.NUM_RUNNING], span.attributes[S.NUM_WAITING]) == seen[rid]
    assert seen["c"] == (0, 3)
