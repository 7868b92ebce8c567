"""From a finished journey to spans.

Where spans are built (the exporter process's main thread, or the drain thread
in thread mode; never the engine thread), :func:`plan_spans` (pure) turns a
:class:`~vllm_journey_otel.journey.FinishedJourney` and a clock offset into
:class:`PlannedSpan` records with epoch times, the tree shape and the
attributes. All the tiling and clamping rules live here; ``span_builder.py``
makes the SDK's spans of a plan, under the client's trace context
(:func:`root_context`) when there is one.

Clock rules: monotonic engine stamps (``*_mono_ns``) become epoch (``*_unix_ns``)
by adding the anchor's offset; the request's wall-clock arrival is used as is.
Every child is clamped into its parent, so a small disagreement between the
API server's wall clock and our anchor can shorten a span but never puts one
outside its parent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from vllm_journey_otel import schema as S
from vllm_journey_otel.journey import (
    FinishedJourney,
    FirstToken,
    KvLoaded,
    LinkTarget,
    Preempted,
    RootIds,
    Scheduled,
    SegmentEnded,
    Snapshot,
    StepRecord,
    WaitBegan,
    WaitEnded,
)

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
    links: list[trace.Link] = field(default_factory=list)
    # Root only: ids chosen in advance because other spans link to this root.
    ids: RootIds | None = None


def trace_id_of(ids: RootIds) -> int:
    return (ids.trace_hi << 64) | ids.trace_lo


def link_to(target: LinkTarget) -> trace.Link:
    """A link to another journey's root (head-sampled: in its client's trace, if any)."""
    client = trace.get_current_span(parent_context(target.trace_headers)).get_span_context()
    ids = target.ids
    trace_id = client.trace_id if client.is_valid else trace_id_of(ids)
    ctx = SpanContext(trace_id, ids.span_id, False, TraceFlags(TraceFlags.SAMPLED))
    return trace.Link(ctx, {S.REQUEST_ID: target.request_id})


def _drafts(attrs: dict[str, AttributeValue], proposed: int, accepted: int) -> None:
    attrs[S.SPEC_DRAFTS_PROPOSED] = proposed
    attrs[S.SPEC_DRAFTS_ACCEPTED] = accepted
    if proposed > 0:  # no drafts: the rate is unobserved, not 0
        attrs[S.SPEC_ACCEPTANCE_RATE] = accepted / proposed


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

    def at_mono(t_mono_ns: int) -> int:
        u = t_mono_ns + offset_ns
        return root_start if u < root_start else root_end if u > root_end else u

    def at(s: Snapshot) -> int:
        return at_mono(s.t_mono_ns)

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
    # The open queue span (vllm.queued, then each vllm.preempted) and its open wait.
    queue_idx: int | None = 1
    wait_idx: int | None = None
    # Draft totals when the open decode span started.
    decode_drafts = (0, 0)
    # Streaming-input sessions: the current input segment.
    segment = 0
    if j.session:
        plan[1].attributes[S.SEGMENT] = 0

    def end_wait(u: int) -> None:
        nonlocal wait_idx
        if wait_idx is not None:
            span = plan[wait_idx]
            span.end_unix_ns = max(span.start_unix_ns, u)
            wait_idx = None

    def close_decode(s: Snapshot, proposed: int, accepted: int) -> None:
        extra: dict[str, AttributeValue] = {}
        if j.spec_decode:
            _drafts(extra, proposed - decode_drafts[0], accepted - decode_drafts[1])
        close(phase_idx, s, extra)

    def close(idx: int | None, s: Snapshot, extra: dict[str, AttributeValue] | None = None) -> None:
        if idx is None:
            return
        span = plan[idx]
        span.end_unix_ns = max(span.start_unix_ns, at(s))
        span.attributes.update(_progress(s, j))
        if extra:
            span.attributes.update(extra)

    for ev in j.events:
        if isinstance(ev, KvLoaded):
            span = plan[wait_idx] if wait_idx is not None else None
            if span is not None and span.attributes[S.WAIT_REASON] == S.WAIT_REMOTE_KV:
                ms = (at_mono(ev.t_mono_ns) - span.start_unix_ns) / 1e6
                span.attributes[S.KV_TRANSFER_MS] = max(ms, 0.0)
                if ev.tokens >= 0:
                    span.attributes[S.KV_TRANSFER_TOKENS] = ev.tokens
                if ev.failed >= 0:
                    span.attributes[S.KV_TRANSFER_FAILED] = ev.failed > 0
            continue
        if isinstance(ev, WaitBegan | WaitEnded):
            u = at_mono(ev.t_mono_ns)
            end_wait(u)
            if isinstance(ev, WaitBegan) and queue_idx is not None:
                reason = S.WAIT_REASONS[ev.reason]
                plan.append(PlannedSpan(S.SPAN_WAIT, u, u, queue_idx, {S.WAIT_REASON: reason}))
                wait_idx = len(plan) - 1
            continue
        t = at(ev.at)
        if isinstance(ev, Scheduled):
            end_wait(t)
            queue_idx = None
            # A resume; the first cycle; or the first cycle of a session's next input.
            kind = (
                S.SCHEDULE_RESUME
                if ev.resume
                else S.SCHEDULE_NEXT_INPUT
                if cycle >= 0
                else S.SCHEDULE_FIRST
            )
            close(preempt_idx, ev.at)
            preempt_idx = None
            cycle += 1
            plan.append(
                PlannedSpan(
                    S.SPAN_SCHEDULED,
                    t,
                    t,
                    ROOT,
                    {S.SCHEDULE_KIND: kind, S.CYCLE: cycle},
                )
            )
            cycle_idx = len(plan) - 1
            if j.session:
                plan[cycle_idx].attributes[S.SEGMENT] = segment
            if j.lora_name:
                plan[cycle_idx].attributes[S.LORA_NAME] = j.lora_name
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
            decode_drafts = (ev.drafts_proposed, ev.drafts_accepted)
        elif isinstance(ev, SegmentEnded):
            if cycle_idx is None:
                continue
            if phase_idx is not None and plan[phase_idx].name == S.SPAN_PREFILL:
                close(phase_idx, ev.at, {S.PREFILL_CHUNKS: ev.prefill_chunks})
            else:
                close_decode(ev.at, ev.drafts_proposed, ev.drafts_accepted)
            close(cycle_idx, ev.at)
            cycle_idx = phase_idx = None
            # Back in the queue for the next input segment.
            segment += 1
            plan.append(PlannedSpan(S.SPAN_QUEUED, t, t, ROOT, {S.SEGMENT: segment}))
            preempt_idx = queue_idx = len(plan) - 1
        elif isinstance(ev, Preempted):
            if cycle_idx is None:
                continue
            if phase_idx is not None and plan[phase_idx].name == S.SPAN_PREFILL:
                close(phase_idx, ev.at, {S.PREFILL_CHUNKS: ev.prefill_chunks})
            else:
                close_decode(ev.at, ev.drafts_proposed, ev.drafts_accepted)
            close(cycle_idx, ev.at)
            cycle_idx = phase_idx = None
            observed = (
                (S.KV_CACHE_USAGE, ev.kv_cache_usage),
                (S.NUM_RUNNING, ev.num_running),
                (S.NUM_WAITING, ev.num_waiting),
                (S.PREEMPTED_BY, ev.cause_id),
            )
            plan.append(
                PlannedSpan(
                    S.SPAN_PREEMPTED,
                    t,
                    t,
                    ROOT,
                    {k: v for k, v in observed if v is not None},
                    links=[link_to(ev.cause_link)] if ev.cause_link is not None else [],
                )
            )
            preempt_idx = queue_idx = len(plan) - 1

    # The end closes whatever is open.
    end_wait(at(j.end))
    if phase_idx is not None and plan[phase_idx].name == S.SPAN_PREFILL:
        close(phase_idx, j.end, {S.PREFILL_CHUNKS: j.end_prefill_chunks})
    else:
        close_decode(j.end, j.drafts_proposed, j.drafts_accepted)
    close(cycle_idx, j.end)
    close(preempt_idx, j.end)

    root.attributes = _root_attributes(j, first_sched, root_start, offset_ns, uncertainty_ns)
    root.error = j.status == _STATUS_ERROR
    root.ids = j.root_ids
    return plan


_STATUS_ERROR = S.FINISH_STATUSES.index(S.FINISH_ERROR)


def plan_step(rec: StepRecord, offset_ns: int) -> PlannedSpan:
    """The vllm.step span of a sampled scheduler step (its own trace), in epoch ns."""
    start = rec.start_mono_ns + offset_ns
    end = max(start, rec.end_mono_ns + offset_ns)
    attrs: dict[str, AttributeValue] = {
        S.SCHEDULER_STEP: rec.step,
        S.STEP_BATCH_SIZE: rec.batch_size,
        S.STEP_PREFILL_TOKENS: rec.prefill_tokens,
        S.STEP_DECODE_TOKENS: rec.decode_tokens,
        S.STEP_NUM_PREEMPTIONS: rec.num_preemptions,
        S.STEP_SCHEDULE_MS: max(0.0, (rec.scheduled_mono_ns - rec.start_mono_ns) / _NS_PER_MS),
        S.KV_CACHE_USAGE: rec.kv_cache_usage,
        S.NUM_RUNNING: rec.num_running,
        S.NUM_WAITING: rec.num_waiting,
    }
    return PlannedSpan(S.SPAN_STEP, start, end, None, attrs, links=[link_to(t) for t in rec.links])


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
    if j.spec_decode:
        _drafts(attrs, j.drafts_proposed, j.drafts_accepted)
    if j.session:
        # Segments that ran: the first, and each next input that was scheduled.
        ran = sum(isinstance(e, Scheduled) and not e.resume for e in j.events)
        attrs[S.NUM_SEGMENTS] = max(1, ran)
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


def client_context(trace_headers: dict[str, str] | None) -> SpanContext | None:
    """The client's span context (remote), or None without a valid one."""
    if not trace_headers:
        return None
    ctx = trace.get_current_span(parent_context(trace_headers)).get_span_context()
    return ctx if ctx.is_valid else None


def root_context(j: FinishedJourney) -> tuple[SpanContext | None, list[trace.Link]]:
    """Parent span context and links of a journey's root.

    Head-sampled: a child of the client's span. Kept by the tail rule: the client's
    trace was not sampled (its spans are not exported), so a new root with a link
    to the client's span.
    """
    client = client_context(j.trace_headers)
    if j.head_sampled:
        return client, []
    return None, [trace.Link(client)] if client is not None else []
