"""An in-flight snapshot as a span: where a request that has not ended is now.

Where spans are built (the exporter process's main thread, or the drain thread
in thread mode). Clocks as in ``spans.py``: engine monotonic stamps become epoch
ns by the anchor's offset.

One ``vllm.in_flight`` span per snapshot, from the journey's start to the
snapshot: a child of the root the final journey will have (its ids were fixed
when the snapshot was taken), in the client's trace when there is one. The
journey's spans so far are its events (name, start, duration so far, still
open), not spans: the final journey brings the spans themselves, and span
metrics computed per span name must not count a phase twice.
"""

from __future__ import annotations

from opentelemetry.trace import SpanContext, TraceFlags
from opentelemetry.util.types import AttributeValue

from vllm_journey_otel import schema as S
from vllm_journey_otel.export.spans import (
    ROOT,
    PlannedSpan,
    client_context,
    plan_spans,
    progress,
    trace_id_of,
)
from vllm_journey_otel.journey import InFlight

_NS_PER_MS = 1e6


def plan_in_flight(
    rec: InFlight, offset_ns: int, uncertainty_ns: int = 0
) -> tuple[PlannedSpan, SpanContext | None]:
    """The snapshot's span and its parent (the final root's context; None when
    the record carries no root ids, which the engine always sets)."""
    j = rec.journey
    plan = plan_spans(j, offset_ns, uncertainty_ns)
    root = plan[ROOT]
    end = root.end_unix_ns
    attrs: dict[str, AttributeValue] = {
        S.REQUEST_ID: j.request_id,
        S.IN_FLIGHT_STATE: S.IN_FLIGHT_STATES[rec.state],
        S.IN_FLIGHT_MS: (end - root.start_unix_ns) / _NS_PER_MS,
        S.IN_FLIGHT_SNAPSHOT: rec.seq,
        **progress(j.end, j),
    }
    if 0 <= rec.wait_reason < len(S.WAIT_REASONS):
        attrs[S.WAIT_REASON] = S.WAIT_REASONS[rec.wait_reason]
    events: list[tuple[str, int, dict[str, AttributeValue]]] = [
        (
            p.name,
            p.start_unix_ns,
            {
                S.IN_FLIGHT_EVENT_MS: (p.end_unix_ns - p.start_unix_ns) / _NS_PER_MS,
                S.IN_FLIGHT_EVENT_OPEN: p.end_unix_ns >= end,
                **(
                    {S.WAIT_REASON: p.attributes[S.WAIT_REASON]}
                    if S.WAIT_REASON in p.attributes
                    else {}
                ),
            },
        )
        for p in sorted(plan[1:], key=lambda p: p.start_unix_ns)
    ]
    span = PlannedSpan(S.SPAN_IN_FLIGHT, root.start_unix_ns, end, None, attrs, events=events)
    if j.root_ids is None:
        return span, None
    client = client_context(j.trace_headers) if j.head_sampled else None
    trace_id = client.trace_id if client is not None else trace_id_of(j.root_ids)
    state = client.trace_state if client is not None else None
    parent = SpanContext(trace_id, j.root_ids.span_id, True, TraceFlags(TraceFlags.SAMPLED), state)
    return span, parent
