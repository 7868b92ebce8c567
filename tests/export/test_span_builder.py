"""span_builder.SpanBuilder builds what the SDK's own Tracer builds from the same plan.

The reference is the SDK itself: a TracerProvider with an always-on sampler,
the same span limits and the same id sequence, each planned span started with
its explicit times under its parent and ended. The SDK's OTLP encoding of both
sets of spans must be identical (protobuf message equality), for journeys that
exercise every path: a client's remote parent with tracestate, a tail-kept
root linked to the client, an error, a preemption linked to its cause (root
ids chosen in the engine), an oversized request id, a step span, user limits.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import NonRecordingSpan, Status, StatusCode

from vllm_journey_otel import schema as S
from vllm_journey_otel.engine.request_journey import RequestJourney
from vllm_journey_otel.export.exporters import make_resource, span_limits
from vllm_journey_otel.export.span_builder import SpanBuilder
from vllm_journey_otel.export.spans import (
    PlannedSpan,
    plan_spans,
    plan_step,
    root_context,
    trace_id_of,
)
from vllm_journey_otel.journey import STATUS_ERROR, STATUS_LENGTH, FinishedJourney, StepRecord

MS = 1_000_000
OFFSET = 1_700_000_000_000_000_000
CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Sequence_(IdGenerator):
    """The SDK's side of a shared deterministic id sequence; the root's ids
    chosen in the engine come first when given."""

    def __init__(self, ids: Iterator[int]) -> None:
        self.ids = ids
        self.preset: list[int] = []

    def generate_span_id(self) -> int:
        return self.preset.pop(0) if self.preset else next(self.ids)

    def generate_trace_id(self) -> int:
        return self.preset.pop(0) if self.preset else next(self.ids)


def via_tracer(
    plan: list[PlannedSpan],
    parent: trace.SpanContext | None,
    links: list[trace.Link],
    resource: Resource,
    limits: SpanLimits,
    ids: Iterator[int],
) -> list[ReadableSpan]:
    gen = Sequence_(ids)
    provider = TracerProvider(
        resource=resource, sampler=ALWAYS_ON, id_generator=gen, span_limits=limits
    )
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer(S.SCOPE_NAME)
    ctx = (
        trace.set_span_in_context(NonRecordingSpan(parent), otel_context.Context())
        if parent is not None
        else otel_context.Context()
    )
    started: list[trace.Span] = []
    for p in plan:
        if p.parent is None and p.ids is not None:
            gen.preset = [trace_id_of(p.ids), p.ids.span_id] if parent is None else [p.ids.span_id]
        span = tracer.start_span(
            p.name,
            context=ctx if p.parent is None else trace.set_span_in_context(started[p.parent]),
            kind=p.kind,
            attributes=p.attributes,
            links=[*links, *p.links] if p.parent is None else p.links,
            start_time=p.start_unix_ns,
        )
        if p.error:
            span.set_status(Status(StatusCode.ERROR, "request finished with an error"))
        started.append(span)
    for p, span in zip(plan, started, strict=True):
        span.end(end_time=p.end_unix_ns)
    return list(memory.get_finished_spans())


def _journeys() -> list[FinishedJourney]:
    out = []

    def one(rid: str, **kw) -> RequestJourney:  # type: ignore[no-untyped-def]
        return RequestJourney(rid, (OFFSET + 9 * MS) / 1e9, 10 * MS, 0, 100, 8, **kw)

    plain = one("plain")
    plain.scheduled(20 * MS, 1, 0, 100, 100, 0)
    plain.tokens(30 * MS, 2, 1)
    out.append(plain.finish(40 * MS, 3, STATUS_LENGTH, "length", 8, 38 * MS))

    headers = {"traceparent": CLIENT, "tracestate": "vendor=abc,other=1"}
    child = one("client", trace_headers=headers)
    child.scheduled(20 * MS, 1, 0, 100, 100, 0)
    out.append(child.finish(25 * MS, 1, STATUS_ERROR, "error", 0, None))

    tail = one("tail", trace_headers=headers, head_sampled=False)
    tail.scheduled(20 * MS, 1, 0, 100, 100, 0)
    out.append(tail.finish(25 * MS, 1, STATUS_LENGTH, "length", 0, None))

    cause = one("cause-" + "x" * 3000)  # a client-chosen id far over the limit
    target = cause.link_target()
    victim = one("victim")
    victim.scheduled(20 * MS, 1, 0, 100, 100, 0)
    victim.tokens(22 * MS, 2, 1)
    victim.preempted(30 * MS, 3, 101, 1, 0.97, 5, 7, cause.request_id, target)
    victim.scheduled(35 * MS, 4, 0, 101, 101, 0)
    out.append(victim.finish(45 * MS, 5, STATUS_LENGTH, "length", 8, 44 * MS))
    cause.scheduled(30 * MS, 3, 0, 100, 100, 0)
    out.append(cause.finish(50 * MS, 6, STATUS_LENGTH, "length", 0, None))
    return [j for j in out if j is not None]


def _encoded(spans: list[ReadableSpan]) -> object:
    ordered = sorted(spans, key=lambda s: (s.context.trace_id, s.context.span_id))
    return encode_spans(ordered)


@pytest.mark.parametrize("length_limit", [None, "10"])
def test_journeys_encode_exactly_as_the_sdks_tracer_builds_them(
    length_limit: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if length_limit is not None:
        monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", length_limit)
    limits = span_limits()
    resource = make_resource({"vllm.model.name": "m"})
    ours, theirs = itertools.count(1 << 40), itertools.count(1 << 40)
    builder = SpanBuilder(resource, limits, span_id=ours.__next__, trace_id=ours.__next__)
    for j in _journeys():
        plan = plan_spans(j, OFFSET, 3000)
        parent, links = root_context(j)
        mine = builder.build(plan, parent, links)
        reference = via_tracer(plan_spans(j, OFFSET, 3000), parent, links, resource, limits, theirs)
        assert len(mine) == len(plan) >= 3, j.request_id
        assert _encoded(mine) == _encoded(reference), j.request_id
    # The long request id was cut as the SDK cuts it.
    cut = int(length_limit or 1024)
    victim = builder.build(plan_spans(_journeys()[3], OFFSET), None)
    (preempted,) = [s for s in victim if s.name == S.SPAN_PREEMPTED]
    assert len(str(preempted.attributes[S.PREEMPTED_BY])) == cut
    # Link attributes follow OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT, not the span one.
    link_cut = 1024 if length_limit is None else len(_journeys()[4].request_id)
    assert len(str(preempted.links[0].attributes[S.REQUEST_ID])) == link_cut


def test_a_step_span_with_more_links_than_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SPAN_LINK_COUNT_LIMIT", "2")
    limits = span_limits()
    resource = make_resource({})
    targets = []
    for k in range(3):
        j = RequestJourney(f"r{k}", 0.0, 10 * MS, 0, 10, 8)
        targets.append(j.link_target())
    step = StepRecord(7, 19 * MS, 20 * MS, 24 * MS, 3, 30, 0, 0, 0.5, 3, 0, targets)
    ours, theirs = itertools.count(1 << 41), itertools.count(1 << 41)
    builder = SpanBuilder(resource, limits, span_id=ours.__next__, trace_id=ours.__next__)
    mine = builder.build_step(plan_step(step, OFFSET))
    reference = via_tracer([plan_step(step, OFFSET)], None, [], resource, limits, theirs)
    assert mine.dropped_links == 1 and len(mine.links) == 2
    assert _encoded([mine]) == _encoded(reference)
