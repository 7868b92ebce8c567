"""From a finished journey to spans.

Two steps, both where spans are built (the exporter process, or the drain thread
in thread mode; never the engine thread):

1. :func:`plan_spans` (pure) turns a :class:`~vllm_journey_otel.journey.FinishedJourney`
   and a clock offset into :class:`PlannedSpan` records with epoch times, the tree
   shape and the attributes. All the tiling and clamping rules live here.
2. :func:`emit_spans` hands the plan to an OpenTelemetry tracer with explicit
   start and end times, under the client's trace context when there is one.

Clock rules: monotonic engine stamps (``*_mono_ns``) become epoch (``*_unix_ns``)
by adding the anchor's offset; the request's wall-clock arrival is used as is.
Every child is clamped into its parent, so a small disagreement between the
API server's wall clock and our anchor can shorten a span but never puts one
outside its parent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from . import schema as S
from .journey import FinishedJourney, FirstToken, Preempted, Scheduled, Snapshot

_PROPAGATOR = TraceContextTextMapPropagator()
_NS_PER_MS = 1e6

# Index of the root in a plan; its children's ``parent`` is this.
ROOT = 0


@dataclass
class PlannedSpan:
    """One span to emit. ``parent`` indexes the plan (None for the root)."""

    name: str
    start_unix_ns: int
    end_unix_ns: int
    parent: int | None
    attributes: dict[str, AttributeValue] = field(default_factory=dict)
    kind: SpanKind = SpanKind.INTERNAL
    error: bool = False


def _progress(s: Snapshot, j: FinishedJourney) -> dict[str, AttributeValue]:
    attrs: dict[str, AttributeValue] = {
        S.PREFILL_DONE_TOKENS: s.prefill_done_tokens,
        S.PREFILL_TOTAL_TOKENS: j.prompt_tokens,
        S.DECODE_DONE_TOKENS: s.decode_done_tokens,
        S.PHASE: S.PHASE_DECODE if s.decoding else S.PHASE_PREFILL,
        S.NUM_PREEMPTIONS: s.num_preemptions,
        S.SCHEDULER_STEP: s.step,
    }
    if j.max_tokens is not None:
        attrs[S.DECODE_MAX_TOKENS] = j.max_tokens
    return attrs


def _ms(a_ns: int | None, b_ns: int | None) -> float | None:
    """``b - a`` in ms, or None when either end was not observed (never 0 for missing)."""
    if a_ns is None or b_ns is None:
        return None
    return max(0.0, (b_ns - a_ns) / _NS_PER_MS)


def plan_spans(j: FinishedJourney, offset_ns: int, uncertainty_ns: int = 0) -> list[PlannedSpan]:
    """The span tree of one journey, in epoch ns.

    ``unix_ns = mono_ns + offset_ns``. Invariants of the result: element 0 is the
    root; queued, scheduled and preempted spans are the root's children, in time
    order, without overlap; prefill and decode are children of their scheduled
    span and tile it; every span lies within its parent.
    """
    admit_u = j.admitted.t_mono_ns + offset_ns
    end_u = j.end.t_mono_ns + offset_ns
    root_start = admit_u
    if j.arrival_time_s > 0:
        root_start = min(root_start, int(j.arrival_time_s * 1e9))
    root_end = max(end_u, root_start)

    def at(s: Snapshot) -> int:
        u = s.t_mono_ns + offset_ns
        return root_start if u < root_start else root_end if u > root_end else u

    plan: list[PlannedSpan] = []
    root = PlannedSpan(S.SPAN_REQUEST, root_start, root_end, None, kind=SpanKind.SERVER)
    plan.append(root)

    first_sched = next((e for e in j.events if isinstance(e, Scheduled)), None)
    queued_end = first_sched.at if first_sched is not None else j.end
    plan.append(
        PlannedSpan(S.SPAN_QUEUED, at(j.admitted), at(queued_end), ROOT, _progress(queued_end, j))
    )

    cycle = -1
    cycle_idx: int | None = None  # plan index of the open vllm.scheduled span
    phase_idx: int | None = None  # plan index of the open prefill/decode span
    preempt_idx: int | None = None  # plan index of the open vllm.preempted span

    def close(idx: int | None, s: Snapshot, extra: dict[str, AttributeValue] | None = None) -> None:
        if idx is None:
            return
        span = plan[idx]
        span.end_unix_ns = max(span.start_unix_ns, at(s))
        span.attributes.update(_progress(s, j))
        if extra:
            span.attributes.update(extra)

    for ev in j.events:
        t = at(ev.at)
        if isinstance(ev, Scheduled):
            close(preempt_idx, ev.at)
            preempt_idx = None
            cycle += 1
            plan.append(
                PlannedSpan(
                    S.SPAN_SCHEDULED,
                    t,
                    t,
                    ROOT,
                    {
                        S.SCHEDULE_KIND: S.SCHEDULE_RESUME if ev.resume else S.SCHEDULE_FIRST,
                        S.CYCLE: cycle,
                    },
                )
            )
            cycle_idx = len(plan) - 1
            plan.append(
                PlannedSpan(S.SPAN_PREFILL, t, t, cycle_idx, {S.CACHED_TOKENS: ev.cached_tokens})
            )
            phase_idx = len(plan) - 1
        elif isinstance(ev, FirstToken):
            if cycle_idx is None or phase_idx is None or plan[phase_idx].name != S.SPAN_PREFILL:
                continue
            close(phase_idx, ev.at, {S.PREFILL_CHUNKS: ev.prefill_chunks})
            plan.append(PlannedSpan(S.SPAN_DECODE, t, t, cycle_idx))
            phase_idx = len(plan) - 1
        elif isinstance(ev, Preempted):
            if cycle_idx is None:
                continue
            if phase_idx is not None and plan[phase_idx].name == S.SPAN_PREFILL:
                close(phase_idx, ev.at, {S.PREFILL_CHUNKS: ev.prefill_chunks})
            else:
                close(phase_idx, ev.at)
            close(cycle_idx, ev.at)
            cycle_idx = phase_idx = None
            observed = (
                (S.KV_CACHE_USAGE, ev.kv_cache_usage),
                (S.NUM_RUNNING, ev.num_running),
                (S.NUM_WAITING, ev.num_waiting),
            )
            plan.append(
                PlannedSpan(
                    S.SPAN_PREEMPTED, t, t, ROOT, {k: v for k, v in observed if v is not None}
                )
            )
            preempt_idx = len(plan) - 1

    # The end closes whatever is open.
    if phase_idx is not None and plan[phase_idx].name == S.SPAN_PREFILL:
        close(phase_idx, j.end, {S.PREFILL_CHUNKS: j.end_prefill_chunks})
    else:
        close(phase_idx, j.end)
    close(cycle_idx, j.end)
    close(preempt_idx, j.end)

    root.attributes = _root_attributes(j, first_sched, root_start, offset_ns, uncertainty_ns)
    root.error = j.status == _STATUS_ERROR
    return plan


_STATUS_ERROR = S.FINISH_STATUSES.index(S.FINISH_ERROR)


def _root_attributes(
    j: FinishedJourney,
    first_sched: Scheduled | None,
    root_start_unix_ns: int,
    offset_ns: int,
    uncertainty_ns: int,
) -> dict[str, AttributeValue]:
    attrs: dict[str, AttributeValue] = {
        S.REQUEST_ID: j.request_id,
        S.GEN_AI_INPUT_TOKENS: j.prompt_tokens,
        S.GEN_AI_OUTPUT_TOKENS: j.output_tokens,
        S.FINISH_STATUS: S.FINISH_STATUSES[j.status],
        S.NUM_PREEMPTIONS: j.end.num_preemptions,
        S.CLOCK_UNCERTAINTY_US: uncertainty_ns / 1e3,
        S.SAMPLED_BY: S.SAMPLED_HEAD if j.head_sampled else S.SAMPLED_TAIL,
    }
    if j.max_tokens is not None:
        attrs[S.GEN_AI_MAX_TOKENS] = j.max_tokens
    if j.finish_reason is not None:
        attrs[S.GEN_AI_FINISH_REASONS] = (j.finish_reason,)
    if j.priority:
        attrs[S.PRIORITY] = j.priority
    if j.lora_name:
        attrs[S.LORA_NAME] = j.lora_name
    sched_mono = first_sched.at.t_mono_ns if first_sched is not None else None
    if first_sched is not None:
        attrs[S.GEN_AI_CACHE_READ_TOKENS] = first_sched.cached_tokens
    first_tok_unix = None if j.first_token_mono_ns is None else j.first_token_mono_ns + offset_ns
    intervals = (
        (S.QUEUED_MS, _ms(j.admitted.t_mono_ns, sched_mono)),
        (S.TTFT_MS, _ms(root_start_unix_ns, first_tok_unix)),
        (S.PREFILL_MS, _ms(sched_mono, j.first_token_mono_ns)),
        (S.DECODE_MS, _ms(j.first_token_mono_ns, j.last_token_mono_ns)),
    )
    for key, value in intervals:
        if value is not None:
            attrs[key] = value
    return attrs


def parent_context(trace_headers: dict[str, str] | None) -> otel_context.Context:
    """The client's context from W3C ``traceparent``/``tracestate``, or an empty one.

    Malformed headers give an empty context: the journey becomes its own root.
    """
    if not trace_headers:
        return otel_context.Context()
    return _PROPAGATOR.extract(trace_headers, context=otel_context.Context())


def root_context(j: FinishedJourney) -> tuple[otel_context.Context, list[trace.Link]]:
    """Parent context and links of a journey's root.

    Head-sampled: a child of the client's span. Kept by the tail rule: the client's
    trace was not sampled (its spans are not exported), so a new root with a link
    to the client's span.
    """
    parent = parent_context(j.trace_headers)
    if j.head_sampled:
        return parent, []
    client = trace.get_current_span(parent).get_span_context()
    links = [trace.Link(client)] if client.is_valid else []
    return otel_context.Context(), links


def emit_spans(
    plan: Sequence[PlannedSpan],
    tracer: trace.Tracer,
    parent: otel_context.Context,
    links: Sequence[trace.Link] = (),
) -> None:
    """Create and end every planned span with its explicit times."""
    spans: list[trace.Span] = []
    for p in plan:
        ctx = parent if p.parent is None else trace.set_span_in_context(spans[p.parent])
        span = tracer.start_span(
            p.name,
            context=ctx,
            kind=p.kind,
            attributes=p.attributes,
            links=links if p.parent is None else (),
            start_time=p.start_unix_ns,
            record_exception=False,
            set_status_on_exception=False,
        )
        if p.error:
            span.set_status(Status(StatusCode.ERROR, "request finished with an error"))
        spans.append(span)
    # End children before parents, as a live trace would.
    for p, span in reversed(list(zip(plan, spans, strict=True))):
        span.end(end_time=p.end_unix_ns)
