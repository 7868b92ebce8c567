"""Planned spans to the SDK's :class:`ReadableSpan`, directly: no Tracer, no span processor.

Where: the exporter process's main thread, or the engine core's drain thread in
``thread`` mode. Times are the plan's ``*_unix_ns`` (epoch ns); nothing here
reads a clock.

What a Tracer would do for these spans, and only that (``tests/export/test_span_builder.py``
checks that the SDK's OTLP encoding of both is identical, span for span): ids
from our own generator (``rng.py``) unless the root's were chosen in the engine;
a root under the client's remote context keeps its trace id and ``tracestate``,
children take the root's; every span sampled (the decision was the engine's);
string attribute values cut at the attribute length limit, links beyond the link
limit dropped and counted, as the SDK's span limits do. Our spans carry far
fewer attributes than the SDK's 128 per span, so no attribute count is enforced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import AttributeValue

from vllm_journey_otel import rng
from vllm_journey_otel import schema as S
from vllm_journey_otel.export.otlp_encoder import OtlpEncoder, cut
from vllm_journey_otel.export.spans import PlannedSpan, trace_id_of

SAMPLED = TraceFlags(TraceFlags.SAMPLED)
ERROR_STATUS = Status(StatusCode.ERROR, "request finished with an error")
UNSET_STATUS = Status(StatusCode.UNSET)


def bounded(attrs: Mapping[str, AttributeValue], limit: int | None) -> dict[str, AttributeValue]:
    """``attrs`` with string values cut at ``limit`` characters (None: no limit),
    as the SDK's BoundedAttributes cuts them; the same dict when nothing is long."""
    if limit is None:
        return dict(attrs)
    for value in attrs.values():
        if isinstance(value, str):  # the common cases without a call of ours
            if len(value) <= limit:
                continue
        elif type(value) in _NUMBERS or not isinstance(value, tuple) or not _longer(value, limit):
            continue
        return {k: cut(v, limit) for k, v in attrs.items()}
    return attrs if isinstance(attrs, dict) else dict(attrs)


_NUMBERS = frozenset((int, float, bool))


def _longer(value: str | tuple[object, ...], limit: int) -> bool:
    if isinstance(value, str):
        return len(value) > limit
    return any(isinstance(v, str) and len(v) > limit for v in value)


class SpanBuilder:
    """Builds the ReadableSpans of journey plans and step plans for one resource."""

    def __init__(
        self,
        resource: Resource,
        limits: SpanLimits,
        span_id: Callable[[], int] = rng.span_id,
        trace_id: Callable[[], int] = rng.trace_id,
    ) -> None:
        self.resource = resource
        # What provider.get_tracer(S.SCOPE_NAME) would name the spans' scope.
        self.scope = InstrumentationScope(S.SCOPE_NAME, None, None, None)
        # As the SDK's Span applies them: span attributes, link attributes, links.
        self.max_span_attribute_length = limits.max_span_attribute_length
        self.max_attribute_length = limits.max_attribute_length
        self.max_links = limits.max_links
        self.max_events = limits.max_events
        self._span_id = span_id
        self._trace_id = trace_id

    def _links(self, links: Sequence[trace.Link]) -> Sequence[trace.Link]:
        limit = self.max_attribute_length
        out = [
            trace.Link(link.context, bounded(link.attributes or {}, limit))
            if link.attributes
            else link
            for link in links
            # The SDK's rule for keeping a link (opentelemetry-sdk 1.45, _is_valid_link).
            if link.context.is_valid or link.attributes or link.context.trace_state
        ]
        if self.max_links is not None and len(out) > self.max_links:
            return BoundedList.from_seq(self.max_links, out)
        return out

    def _events(self, p: PlannedSpan) -> Sequence[Event]:
        limit = self.max_attribute_length
        events = [Event(name, bounded(a, limit), t) for name, t, a in p.events]
        if self.max_events is not None and len(events) > self.max_events:
            return BoundedList.from_seq(self.max_events, events)
        return events

    def _ids(
        self, plan: Sequence[PlannedSpan], parent: SpanContext | None
    ) -> tuple[int, TraceState | None, SpanContext | None, list[int]]:
        """The plan's trace id and tracestate, its root's parent (None: a root
        of its own trace) and each planned span's id."""
        root = plan[0]
        if parent is not None and parent.is_valid:
            trace_id, trace_state = parent.trace_id, parent.trace_state
        else:
            parent = None
            trace_id = trace_id_of(root.ids) if root.ids is not None else self._trace_id()
            trace_state = None
        new_id = self._span_id
        first = root.ids.span_id if root.ids is not None else new_id()
        span_ids = [first, *[new_id() for _ in range(len(plan) - 1)]]
        return trace_id, trace_state, parent, span_ids

    def _resolve(
        self,
        plan: Sequence[PlannedSpan],
        parent: SpanContext | None,
    ) -> list[tuple[PlannedSpan, SpanContext, SpanContext | None, dict[str, AttributeValue]]]:
        """Each planned span's context, its parent's, and its attributes cut to the limit."""
        trace_id, trace_state, parent, span_ids = self._ids(plan, parent)
        contexts = [SpanContext(trace_id, i, False, SAMPLED, trace_state) for i in span_ids]
        limit = self.max_span_attribute_length
        return [
            (p, contexts[i], parent if p.parent is None else contexts[p.parent],
             bounded(p.attributes, limit))
            for i, p in enumerate(plan)
        ]  # fmt: skip

    def build(
        self,
        plan: Sequence[PlannedSpan],
        parent: SpanContext | None,
        root_links: Sequence[trace.Link] = (),
    ) -> list[ReadableSpan]:
        """The spans of one plan (element 0 its root) under ``parent``, the
        client's remote context (None: the root starts a trace of its own)."""
        spans = []
        for i, (p, context, parent_context, attributes) in enumerate(self._resolve(plan, parent)):
            links = [*root_links, *p.links] if i == 0 else p.links
            spans.append(
                ReadableSpan(
                    p.name,
                    context=context,
                    parent=parent_context,
                    resource=self.resource,
                    attributes=attributes,
                    links=self._links(links) if links else (),
                    kind=p.kind,
                    status=ERROR_STATUS if p.error else UNSET_STATUS,
                    start_time=p.start_unix_ns,
                    end_time=p.end_unix_ns,
                    instrumentation_scope=self.scope,
                    events=self._events(p) if p.events else (),
                )
            )
        return spans

    def encode(
        self,
        encoder: OtlpEncoder,
        plan: Sequence[PlannedSpan],
        parent: SpanContext | None,
        root_links: Sequence[trace.Link] = (),
    ) -> list[bytes]:
        """What :meth:`build` builds, as OTLP Span fields (``otlp_encoder.OtlpEncoder.span_of_ids``)
        without the SDK's span objects: for exporters that take them
        (``otlp_exporters.py``); ``encoder.wrap`` makes the request."""
        trace_id, trace_state, parent, span_ids = self._ids(plan, parent)
        root_parent = None if parent is None else parent.span_id
        remote = parent is not None and parent.is_remote
        limit = self.max_span_attribute_length
        out = []
        for i, p in enumerate(plan):
            links = [*root_links, *p.links] if i == 0 else p.links
            kept_links = self._links(links) if links else ()
            events = self._events(p) if p.events else ()
            if p.parent is None:
                parent_id, parent_remote = root_parent, remote
            else:
                parent_id, parent_remote = span_ids[p.parent], False
            out.append(
                encoder.span_of_ids(
                    trace_id, span_ids[i], trace_state, parent_id, parent_remote,
                    p.name, p.kind, p.start_unix_ns, p.end_unix_ns,
                    p.attributes, events, kept_links,
                    ERROR_STATUS if p.error else UNSET_STATUS,
                    (0, getattr(events, "dropped", 0), getattr(kept_links, "dropped", 0)),
                    limit,  # the encoder cuts the long strings as it writes them
                )
            )  # fmt: skip
        return out

    def build_step(self, planned: PlannedSpan) -> ReadableSpan:
        """A vllm.step span: the root of a trace of its own."""
        return self.build([planned], None)[0]

    def encode_step(self, encoder: OtlpEncoder, planned: PlannedSpan) -> bytes:
        return self.encode(encoder, [planned], None)[0]
