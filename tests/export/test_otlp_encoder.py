"""otlp_encoder.OtlpEncoder writes the message the SDK's own encoder builds.

The reference is the SDK itself (``encode_spans``, what its OTLP exporters
call): our bytes, parsed by protobuf, must equal its message for the same
spans (protobuf message equality: every field, its presence and its order in
repeated fields). The spans are the ones we emit (engine journeys of every
path, a step span with its batch's links, an in-flight snapshot with its
events, API-server journeys) and hand-made ones with a value of every type
OTLP has, empty and non-ASCII strings, negative and 64-bit integers, dropped
counts, remote links, two resources and a span without a scope.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from http import HTTPStatus

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState
from test_api_spans import record
from test_span_builder import _journeys

from vllm_journey_otel import schema as S
from vllm_journey_otel.engine.request_journey import RequestJourney
from vllm_journey_otel.export import otlp_encoder
from vllm_journey_otel.export.api_spans import plan_api
from vllm_journey_otel.export.exporters import make_resource, span_limits
from vllm_journey_otel.export.in_flight_spans import plan_in_flight
from vllm_journey_otel.export.otlp_encoder import OtlpEncoder
from vllm_journey_otel.export.span_builder import SpanBuilder
from vllm_journey_otel.export.spans import PlannedSpan, plan_spans, plan_step, root_context
from vllm_journey_otel.journey import InFlight, StepRecord

MS = 1_000_000


def same_as_sdk(spans: Sequence[ReadableSpan], encoder: OtlpEncoder | None = None) -> None:
    ours = ExportTraceServiceRequest.FromString((encoder or OtlpEncoder()).encode(spans))
    reference = encode_spans(spans)
    assert ours == reference, "our OTLP bytes differ from the SDK's encoding"
    assert ours.SerializeToString(deterministic=True) == reference.SerializeToString(
        deterministic=True
    )


def _plans() -> list[tuple[list[PlannedSpan], SpanContext | None, Sequence[trace.Link]]]:
    """A plan of every kind we emit, with its parent and root links."""
    out: list[tuple[list[PlannedSpan], SpanContext | None, Sequence[trace.Link]]] = []
    finished = _journeys()
    for journey in finished:
        out.append((plan_spans(journey, 1_700_000_000 * 10**9, 3), *root_context(journey)))
    targets = [RequestJourney(f"r{k}", 0.0, 10 * MS, 0, 10, 8).link_target() for k in range(3)]
    step = StepRecord(7, 19 * MS, 20 * MS, 24 * MS, 3, 30, 0, 0, 0.5, 3, 0, targets)
    out.append(([plan_step(step, 1_700_000_000 * 10**9)], None, ()))
    snapshot = InFlight(journey=finished[0], seq=2, state=1, wait_reason=0)
    span, parent = plan_in_flight(snapshot, 1_700_000_000 * 10**9)
    out.append(([span], parent, ()))
    for rec in (
        record(),
        record(status_code=400, request_ids=[], handoff_mono_ns=None),  # turned away
        record(exception="CancelledError", disconnected=True, parent_headers=None),
        record(head_sampled=False),  # kept by the tail rule: a root linked to the client
    ):
        out.append(plan_api(rec, 1_700_000_000 * 10**9))
    return out


def _builder() -> SpanBuilder:
    ids = itertools.count(1 << 40)
    return SpanBuilder(
        make_resource({"vllm.engine.role": "test"}), span_limits(), ids.__next__, ids.__next__
    )


def our_spans() -> list[ReadableSpan]:
    builder = _builder()
    return [s for plan, parent, links in _plans() for s in builder.build(plan, parent, links)]


def test_every_span_we_emit_encodes_as_the_sdk_encodes_it() -> None:
    spans = our_spans()
    kinds = {s.name for s in spans}
    assert {"vllm.request", "vllm.step", "vllm.api.request"} <= kinds, kinds
    assert any(s.events for s in spans) and any(s.links for s in spans)
    same_as_sdk(spans)
    encoder = OtlpEncoder()  # the second batch through the same encoder: from its cache
    same_as_sdk(spans, encoder)
    same_as_sdk(list(reversed(spans)), encoder)


@pytest.mark.parametrize(("link_limit", "length_limit"), [(None, None), ("1", None), (None, "5")])
def test_spans_encoded_from_their_plans_are_the_spans_the_builder_builds(
    link_limit: str | None, length_limit: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exporter's path without the SDK's span objects (SpanBuilder.encode,
    OtlpEncoder.wrap) sends what building ReadableSpans and encoding them sends;
    with a length limit, the encoder cuts strings (a tuple's too: the finish
    reasons) as the builder's BoundedAttributes rule does."""
    if link_limit is not None:  # the step span's links cut, counted as dropped
        monkeypatch.setenv("OTEL_SPAN_LINK_COUNT_LIMIT", link_limit)
    if length_limit is not None:  # request ids, finish reasons ("length",), model names
        monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", length_limit)
    built, encoded, encoder = _builder(), _builder(), OtlpEncoder()
    spans, fields = [], []
    for plan, parent, links in _plans():
        spans += built.build(plan, parent, links)
        fields += encoded.encode(encoder, plan, parent, links)
    assert len(fields) == len(spans) > 20
    wrapped = encoder.wrap(encoded.resource, encoded.scope, fields)
    assert ExportTraceServiceRequest.FromString(wrapped) == encode_spans(spans)
    assert any(s.dropped_links for s in spans) is (link_limit is not None)
    longest = max(len(v) for s in spans for v in s.attributes.values() if isinstance(v, str))
    assert (longest <= 5) is (length_limit is not None)
    key = S.GEN_AI_FINISH_REASONS
    reasons = [s.attributes[key] for s in spans if key in s.attributes]
    assert reasons
    assert all(len(r[0]) <= 5 for r in reasons) is (length_limit is not None)


def _span(name: str, attributes: dict[str, object], **kw: object) -> ReadableSpan:
    ctx = SpanContext(0xABC, 0x123, False, TraceFlags(1), kw.pop("trace_state", None))  # type: ignore[arg-type]
    base: dict[str, object] = dict(
        context=ctx, parent=None, resource=Resource({"service.name": "s"}),
        attributes=attributes, kind=SpanKind.INTERNAL, status=Status(StatusCode.UNSET),
        start_time=10, end_time=20, instrumentation_scope=InstrumentationScope("scope"),
    )  # fmt: skip
    base.update(kw)
    return ReadableSpan(name, **base)  # type: ignore[arg-type]


VALUES: dict[str, object] = {
    "str": "text", "empty": "", "unicode": "préemption ✓ 日本", "true": True, "false": False,
    "zero": 0, "one": 1, "negative": -5, "int64_max": (1 << 63) - 1, "int64_min": -(1 << 63),
    "two_bytes": 300, "float": 2.5, "float_zero": 0.0, "float_negative": -1e-300,
    "strs": ("a", "", "ü"), "ints": (1, -2, 1 << 40), "floats": (0.5, 1.0), "bools": (True, False),
    "empty_tuple": (), "bytes": b"\x00\xff", "none": None, "map": {"k": 1, "l": ("x",)},
    "list": [1, "mixed"], "long": "x" * 5000, "int_enum": HTTPStatus.OK, "inf": float("inf"),
    "k" * 200: 1.5, "float_again": 3.25,  # a double behind a key of 200 bytes; a second key
}  # fmt: skip


def test_every_value_type_and_field_encodes_as_the_sdk_encodes_it() -> None:
    remote = SpanContext(0xDEF, 0x456, True, TraceFlags(1), TraceState([("v", "1")]))
    local = SpanContext(0xDEF, 0x789, False, TraceFlags(0))
    links = [trace.Link(remote, {"why": "cause", "n": 3, "w": 0.5}), trace.Link(local)]
    events = [Event("e1", {"a": 1, "b": "x", "float": 2.5}, 15), Event("e2", None, 16)]
    other = Resource({"service.name": "other", "n": 2}, "https://schema/1")
    spans = [
        _span("all values", VALUES, trace_state=TraceState([("vendor", "abc"), ("k", "v")])),
        _span(
            "kind server, error",
            {"a": 1},
            kind=SpanKind.SERVER,
            parent=remote,
            status=Status(StatusCode.ERROR, "it broke"),
        ),
        _span(
            "kind client, ok", {}, kind=SpanKind.CLIENT, parent=local, status=Status(StatusCode.OK)
        ),
        _span("links and events", {"a": True}, links=links, events=events, kind=SpanKind.PRODUCER),
        _span(
            "dropped",
            {"a": 1.0},
            links=BoundedList.from_seq(1, links * 3),
            events=BoundedList.from_seq(1, events),
            kind=SpanKind.CONSUMER,
        ),
        _span("other resource", {"a": 1}, resource=other),
        _span("no scope", {"a": "1"}, instrumentation_scope=None),
        _span(
            "scoped",
            {"a": "1"},
            instrumentation_scope=InstrumentationScope(
                "scope2", "1.2", "https://schema/2", {"scope.attr": 7}
            ),
        ),
        _span("no times", {"a": "1"}, start_time=0, end_time=0),
    ]
    same_as_sdk(spans)


def test_a_value_otlp_cannot_carry_is_left_out_as_the_sdk_leaves_it_out() -> None:
    bad = {
        "ok": 1,
        "object": object(),
        "huge": 1 << 70,
        5: "key not a string",
        6: 1.5,
        "after": "x",
    }
    same_as_sdk([_span("bad", bad)])


def test_scopes_of_one_name_with_other_attributes_are_encoded_each_time() -> None:
    """A scope's hash leaves its attributes out: the encoder must not reuse one's."""
    encoder = OtlpEncoder()
    for n in range(3):
        scope = InstrumentationScope("scope", "1", None, {"n": n})
        same_as_sdk([_span("scoped", {"a": 1}, instrumentation_scope=scope)], encoder)


def test_the_cache_tells_apart_values_python_calls_equal(monkeypatch: pytest.MonkeyPatch) -> None:
    """True == 1 == 1.0 in Python (one dict key); OTLP has a case for each."""
    values = (True, 1, 1.0, False, 0, 0.0, -0.0, "1", (1,), (True,), (1.0,), ("1",))
    spans = [_span(repr(v), {"v": v}) for v in values]
    encoder = OtlpEncoder()
    same_as_sdk(spans, encoder)
    same_as_sdk(spans[::-1], encoder)
    monkeypatch.setattr(otlp_encoder, "_CACHE_LIMIT", 3)  # cleared as it fills
    same_as_sdk([_span("many", {f"k{i}": i for i in range(20)}) for _ in range(3)], encoder)


def test_attribute_length_limits_apply_before_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "10")
    builder = SpanBuilder(make_resource({}), span_limits())
    spans = [s for j in _journeys() for s in builder.build(plan_spans(j, 0, 0), *root_context(j))]
    assert max(len(v) for s in spans for v in s.attributes.values() if isinstance(v, str)) <= 10
    same_as_sdk(spans)
