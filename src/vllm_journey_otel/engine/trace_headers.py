"""The trace headers a journey keeps: the client's W3C context, bounded.

Engine-core process, engine-core thread (``tracker.after_add``, at admission),
and an API server's event loop (``api_server.py``, at receipt). No clock.
A journey holds its headers until it ends and sends them through the exporter
pipe, so a client cannot make them grow.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm_journey_otel.journey import API_PARENT_KEY

# W3C trace context sizes: a version-00 traceparent is 55 characters (later
# versions may append fields); tracestate SHOULD be kept up to 512 characters and
# is cut at list-member boundaries beyond that.
TRACEPARENT_MAX = 256
TRACESTATE_MAX = 512


def bounded_trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The client's ``traceparent``/``tracestate`` with bounded sizes, and the
    API server's mark (journey.API_PARENT_KEY: the parent is its span), nothing else.

    A journey holds these until it ends and sends them through the exporter pipe,
    so a client cannot make either grow: an oversized traceparent is dropped (the
    journey becomes its own root), a long tracestate keeps its first members.
    """
    out: dict[str, str] = {}
    tp = headers.get("traceparent")
    if isinstance(tp, str) and len(tp) <= TRACEPARENT_MAX:
        out["traceparent"] = tp
    ts = headers.get("tracestate")
    if isinstance(ts, str) and ts:
        if len(ts) > TRACESTATE_MAX:
            kept = ""
            for member in ts.split(","):
                candidate = f"{kept},{member}" if kept else member
                if len(candidate) > TRACESTATE_MAX:
                    break
                kept = candidate
            ts = kept
        if ts:
            out["tracestate"] = ts
    if out and headers.get(API_PARENT_KEY) == "1":
        out[API_PARENT_KEY] = "1"
    return out or None
