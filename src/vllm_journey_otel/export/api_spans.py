"""The API server's part of a request as spans: ``vllm.api.request`` and its two sides.

Where spans are built (the exporter process's main thread, or the drain thread
in thread mode). Clocks: the record's ``*_mono_ns`` are the API-server
process's CLOCK_MONOTONIC, the system-wide clock the engine core stamps with
too, so the same anchor's offset makes them epoch ns; vLLM's ``arrival_time_s``
and the first token's ``first_token_unix_ns`` are wall clock: the server TTFT
is the read before vLLM's arrival stamp plus vLLM's own TTFT (first token
minus arrival), and absent where that stamp says nothing (a wall-clock step).

The tree: ``vllm.api.request`` (receipt to the last response byte) with
``vllm.api.input`` (receipt to the hand-off to the engine core) and
``vllm.api.output`` (the engine's last output reaching the API server to the
last byte). The engine's ``vllm.request`` trees hang under the root: the API
server handed them its ids in the trace headers (no round trip). Children are
clamped into the root.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import SpanContext, SpanKind
from opentelemetry.util.types import AttributeValue

from vllm_journey_otel import schema as S
from vllm_journey_otel.export.spans import ROOT, PlannedSpan, client_context
from vllm_journey_otel.journey import ApiJourney

_NS_PER_MS = 1e6
# How far vLLM's wall-clock arrival stamp may fall outside the input side
# before it is taken for a wall-clock step rather than clock disagreement.
_CLOCKS_NS = 1_000_000


def _ms(a_ns: int, b_ns: int) -> float:
    return max(0.0, (b_ns - a_ns) / _NS_PER_MS)


def failed(rec: ApiJourney) -> bool:
    """The request failed: the application raised, the server answered 5xx, or
    it was turned away before it reached the engine (4xx: nothing generated)."""
    if rec.exception is not None or rec.status_code >= 500:
        return True
    return rec.status_code >= 400 and not rec.request_ids


def _root_attributes(
    rec: ApiJourney, start: int, end: int, offset_ns: int
) -> dict[str, AttributeValue]:
    attrs: dict[str, AttributeValue] = {
        S.HTTP_METHOD: rec.method,
        S.URL_PATH: rec.path,
        S.API_STREAM: rec.stream,
        S.API_DISCONNECTED: rec.disconnected,
        S.SAMPLED_BY: S.SAMPLED_HEAD if rec.head_sampled else S.SAMPLED_TAIL,
    }
    if rec.responded:  # missing is not zero: no last byte, no end to end
        attrs[S.API_E2E_MS] = _ms(start, end)
    if rec.request_ids:
        attrs[S.API_REQUEST_IDS] = tuple(rec.request_ids)
    if rec.status_code:
        attrs[S.HTTP_STATUS] = rec.status_code
    if rec.first_body_mono_ns is not None:  # missing is not zero
        attrs[S.API_TTFB_MS] = _ms(start, rec.first_body_mono_ns + offset_ns)
    if failed(rec):
        attrs[S.ERROR_TYPE] = rec.exception or str(rec.status_code)
    return attrs


def plan_api(
    rec: ApiJourney, offset_ns: int
) -> tuple[list[PlannedSpan], SpanContext | None, list[trace.Link]]:
    """The plan (root first), the root's parent and its links.

    Head-sampled: a child of the parent (the client's span, or the HTTP
    instrumentation's). Kept by the tail rule: its parent's trace was not
    sampled, so a root of its own in that trace, linked to the parent; its ids
    stay those the engine's journeys were handed, so their links reach it.
    """
    start = rec.receipt_mono_ns + offset_ns
    end = max(start, rec.end_mono_ns + offset_ns)

    def at(mono_ns: int) -> int:
        return min(max(start, mono_ns + offset_ns), end)

    root = PlannedSpan(
        S.SPAN_API,
        start,
        end,
        None,
        _root_attributes(rec, start, end, offset_ns),
        kind=SpanKind.SERVER if rec.server_kind else SpanKind.INTERNAL,
        error=failed(rec),
        ids=rec.ids,
    )
    handoff = at(rec.handoff_mono_ns) if rec.handoff_mono_ns is not None else end
    input_attrs: dict[str, AttributeValue] = {}
    arrival = int(rec.arrival_time_s * 1e9)
    # vLLM's wall-clock stamp, inside the input side up to the clocks' agreement;
    # far outside it (a wall-clock step) it says nothing: both figures absent.
    if (
        rec.arrival_time_s > 0
        and rec.handoff_mono_ns is not None
        and start - _CLOCKS_NS <= arrival <= handoff + _CLOCKS_NS
    ):
        # The server TTFT: the read before vLLM's stamp, then vLLM's own TTFT
        # (first token minus arrival, both its wall clock): no wall-clock time
        # is subtracted from a converted monotonic one. Missing is not zero.
        first = rec.first_token_unix_ns
        latency_ms = None if first is None else max(0.0, (first - arrival) / _NS_PER_MS)
        arrival = min(max(start, arrival), handoff)
        read_ms = _ms(start, arrival)
        input_attrs[S.API_READ_MS] = read_ms
        input_attrs[S.API_RENDER_MS] = _ms(arrival, handoff)
        if latency_ms is not None:
            root.attributes[S.API_TTFT_MS] = read_ms + latency_ms
    plan = [root, PlannedSpan(S.SPAN_API_INPUT, start, handoff, ROOT, input_attrs)]
    if rec.last_output_mono_ns is not None:
        plan.append(
            PlannedSpan(
                S.SPAN_API_OUTPUT,
                at(rec.last_output_mono_ns),
                end,
                ROOT,
                {S.API_CHUNKS: rec.chunks},
            )
        )
    parent = client_context(rec.parent_headers)
    if rec.head_sampled:
        return plan, parent, []
    # ``rec.ids`` carry the parent's trace id (chosen so at receipt): without a
    # parent the builder puts the root in that trace.
    return plan, None, [trace.Link(parent)] if parent is not None else []
