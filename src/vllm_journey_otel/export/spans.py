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
outside its parent. One child follows its root instead: ``vllm.kv_held`` (the
prefill side of disaggregated serving), the request's KV blocks kept for the
decode instance after the request ended.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from vllm_journey_otel import schema as S
from vllm_journey_otel.journey import (
    API_PARENT_KEY,
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
# A W3C traceparent of version 00 (www.w3.org/TR/trace-context, "traceparent
# Header"), lowercase hex as the propagator's own pattern requires.
_TRACEPARENT_00 = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
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
    # Span events: (name, epoch ns, attributes); an in-flight snapshot's spans so far.
    events: list[tuple[str, int, dict[str, AttributeValue]]] = field(default_factory=list)


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


def progress(s: Snapshot, j: FinishedJourney) -> dict[str, AttributeValue]:
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
    planner = _Planner(j, offset_ns)
    for ev in j.events:
        planner.on(ev)
    return planner.finish(uncertainty_ns)


class _Planner:
    """One journey's plan, built event by event (one method per event kind).

    The open spans are plan indexes: the cycle (``vllm.scheduled``), its phase
    (prefill or decode), the preemption, the queue span that waits hang under
    (``vllm.queued``, then each ``vllm.preempted``) and its open wait.
    """

    def __init__(self, j: FinishedJourney, offset_ns: int) -> None:
        self.j = j
        self.offset_ns = offset_ns
        admit_u = j.admitted.t_mono_ns + offset_ns
        start = admit_u
        if j.arrival_time_s > 0:
            start = min(start, int(j.arrival_time_s * 1e9))
        self.root_start = start
        self.root_end = max(j.end.t_mono_ns + offset_ns, start)
        self.first_sched = next((e for e in j.events if isinstance(e, Scheduled)), None)
        queued_end = self.first_sched.at if self.first_sched is not None else j.end
        # Under the API server's vllm.api.request the engine's root is INTERNAL:
        # one SERVER span per request. Kept by the tail rule it is a root of its
        # own trace (linked to the API server's span): SERVER again.
        nested = (
            j.head_sampled and j.trace_headers is not None and API_PARENT_KEY in j.trace_headers
        )
        kind = SpanKind.INTERNAL if nested else SpanKind.SERVER
        root = PlannedSpan(S.SPAN_REQUEST, start, self.root_end, None, kind=kind)
        queued = PlannedSpan(
            S.SPAN_QUEUED, self.at(j.admitted), self.at(queued_end), ROOT, progress(queued_end, j)
        )
        for key, value in (
            (S.KV_CACHE_USAGE, j.admitted_kv_cache_usage),
            (S.NUM_RUNNING, j.admitted_num_running),
            (S.NUM_WAITING, j.admitted_num_waiting),
        ):
            if value is not None:  # missing is not zero
                queued.attributes[key] = value
        self.plan = [root, queued]
        self.cycle = -1
        self.cycle_idx: int | None = None
        self.phase_idx: int | None = None
        self.preempt_idx: int | None = None
        self.queue_idx: int | None = 1
        self.wait_idx: int | None = None
        self.decode_drafts = (0, 0)  # draft totals when the open decode span started
        self.segment = 0  # streaming-input sessions: the current input segment
        if j.session:
            queued.attributes[S.SEGMENT] = 0

    # -- times and spans ------------------------------------------------------
    def at_mono(self, t_mono_ns: int) -> int:
        """An engine stamp in epoch ns, clamped into the root."""
        u = t_mono_ns + self.offset_ns
        return self.root_start if u < self.root_start else min(u, self.root_end)

    def at(self, s: Snapshot) -> int:
        return self.at_mono(s.t_mono_ns)

    def open(self, span: PlannedSpan) -> int:
        self.plan.append(span)
        return len(self.plan) - 1

    def close(
        self, idx: int | None, s: Snapshot, extra: dict[str, AttributeValue] | None = None
    ) -> None:
        if idx is None:
            return
        span = self.plan[idx]
        span.end_unix_ns = max(span.start_unix_ns, self.at(s))
        span.attributes.update(progress(s, self.j))
        if extra:
            span.attributes.update(extra)

    def end_wait(self, u: int) -> None:
        if self.wait_idx is not None:
            span = self.plan[self.wait_idx]
            span.end_unix_ns = max(span.start_unix_ns, u)
            self.wait_idx = None

    def close_cycle(self, s: Snapshot, prefill_chunks: int, proposed: int, accepted: int) -> None:
        """The cycle ends (preemption, segment end, the journey's end): its
        phase (prefill, with its chunks, or decode, with its drafts), then itself."""
        phase = self.phase_idx
        if phase is not None and self.plan[phase].name == S.SPAN_PREFILL:
            self.close(phase, s, {S.PREFILL_CHUNKS: prefill_chunks})
        else:
            extra: dict[str, AttributeValue] = {}
            if self.j.spec_decode:
                _drafts(extra, proposed - self.decode_drafts[0], accepted - self.decode_drafts[1])
            self.close(phase, s, extra)
        self.close(self.cycle_idx, s)
        self.cycle_idx = self.phase_idx = None

    # -- events -----------------------------------------------------------------
    def on(self, ev: object) -> None:
        handler = _HANDLERS.get(type(ev))
        if handler is not None:
            handler(self, ev)

    def on_kv_loaded(self, ev: KvLoaded) -> None:
        span = self.plan[self.wait_idx] if self.wait_idx is not None else None
        if span is None or span.attributes[S.WAIT_REASON] != S.WAIT_REMOTE_KV:
            return
        ms = (self.at_mono(ev.t_mono_ns) - span.start_unix_ns) / 1e6
        span.attributes[S.KV_TRANSFER_MS] = max(ms, 0.0)
        if ev.tokens >= 0:
            span.attributes[S.KV_TRANSFER_TOKENS] = ev.tokens
        if ev.failed >= 0:
            span.attributes[S.KV_TRANSFER_FAILED] = ev.failed > 0

    def on_wait(self, ev: WaitBegan | WaitEnded) -> None:
        u = self.at_mono(ev.t_mono_ns)
        self.end_wait(u)
        if isinstance(ev, WaitBegan) and self.queue_idx is not None:
            reason = S.WAIT_REASONS[ev.reason]
            self.wait_idx = self.open(
                PlannedSpan(S.SPAN_WAIT, u, u, self.queue_idx, {S.WAIT_REASON: reason})
            )

    def on_scheduled(self, ev: Scheduled) -> None:
        t = self.at(ev.at)
        self.end_wait(t)
        self.queue_idx = None
        # A resume; the first cycle; or the first cycle of a session's next input.
        if ev.resume:
            kind = S.SCHEDULE_RESUME
        else:
            kind = S.SCHEDULE_NEXT_INPUT if self.cycle >= 0 else S.SCHEDULE_FIRST
        self.close(self.preempt_idx, ev.at)
        self.preempt_idx = None
        self.cycle += 1
        attrs: dict[str, AttributeValue] = {S.SCHEDULE_KIND: kind, S.CYCLE: self.cycle}
        if self.j.session:
            attrs[S.SEGMENT] = self.segment
        if self.j.lora_name:
            attrs[S.LORA_NAME] = self.j.lora_name
        self.cycle_idx = self.open(PlannedSpan(S.SPAN_SCHEDULED, t, t, ROOT, attrs))
        self.phase_idx = self.open(
            PlannedSpan(S.SPAN_PREFILL, t, t, self.cycle_idx, {S.CACHED_TOKENS: ev.cached_tokens})
        )

    def on_first_token(self, ev: FirstToken) -> None:
        phase = self.phase_idx
        if self.cycle_idx is None or phase is None or self.plan[phase].name != S.SPAN_PREFILL:
            return
        t = self.at(ev.at)
        self.close(phase, ev.at, {S.PREFILL_CHUNKS: ev.prefill_chunks})
        self.phase_idx = self.open(PlannedSpan(S.SPAN_DECODE, t, t, self.cycle_idx))
        self.decode_drafts = (ev.drafts_proposed, ev.drafts_accepted)

    def on_segment_ended(self, ev: SegmentEnded) -> None:
        if self.cycle_idx is None:
            return
        self.close_cycle(ev.at, ev.prefill_chunks, ev.drafts_proposed, ev.drafts_accepted)
        # Back in the queue for the next input segment.
        self.segment += 1
        t = self.at(ev.at)
        queued = PlannedSpan(S.SPAN_QUEUED, t, t, ROOT, {S.SEGMENT: self.segment})
        self.preempt_idx = self.queue_idx = self.open(queued)

    def on_preempted(self, ev: Preempted) -> None:
        if self.cycle_idx is None:
            return
        self.close_cycle(ev.at, ev.prefill_chunks, ev.drafts_proposed, ev.drafts_accepted)
        observed = (
            (S.KV_CACHE_USAGE, ev.kv_cache_usage),
            (S.NUM_RUNNING, ev.num_running),
            (S.NUM_WAITING, ev.num_waiting),
            (S.PREEMPTED_BY, ev.cause_id),
        )
        t = self.at(ev.at)
        preempted = PlannedSpan(
            S.SPAN_PREEMPTED,
            t,
            t,
            ROOT,
            {k: v for k, v in observed if v is not None},
            links=[link_to(ev.cause_link)] if ev.cause_link is not None else [],
        )
        self.preempt_idx = self.queue_idx = self.open(preempted)

    # -- the end ------------------------------------------------------------------
    def finish(self, uncertainty_ns: int) -> list[PlannedSpan]:
        """The end closes whatever is open; the root gets its attributes."""
        j = self.j
        self.end_wait(self.at(j.end))
        self.close_cycle(j.end, j.end_prefill_chunks, j.drafts_proposed, j.drafts_accepted)
        self.close(self.preempt_idx, j.end)
        root = self.plan[ROOT]
        root.attributes = _root_attributes(
            j, self.first_sched, self.root_start, self.offset_ns, uncertainty_ns
        )
        root.error = j.status == _STATUS_ERROR
        root.ids = j.root_ids
        _kv_handoff(self.plan, j, self.offset_ns)
        return self.plan


_HANDLERS: dict[type, Callable[[_Planner, Any], None]] = {
    KvLoaded: _Planner.on_kv_loaded,
    WaitBegan: _Planner.on_wait,
    WaitEnded: _Planner.on_wait,
    Scheduled: _Planner.on_scheduled,
    FirstToken: _Planner.on_first_token,
    SegmentEnded: _Planner.on_segment_ended,
    Preempted: _Planner.on_preempted,
}


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


def _kv_handoff(plan: list[PlannedSpan], j: FinishedJourney, offset_ns: int) -> None:
    """Disaggregated serving: the decode side's remote KV on the root; the
    prefill side's hold of its KV blocks, after the root's end, as a child."""
    root = plan[ROOT]
    remote = j.kv_remote
    if remote is not None:
        if remote.request_id is not None:
            root.attributes[S.KV_REMOTE_REQUEST_ID] = remote.request_id
        if remote.engine_id is not None:
            root.attributes[S.KV_REMOTE_ENGINE_ID] = remote.engine_id
    held = j.kv_held
    if held is None:
        return
    start = root.end_unix_ns
    end = max(start, held.end_mono_ns + offset_ns)
    attrs: dict[str, AttributeValue] = {}
    if held.blocks >= 0:
        attrs[S.KV_HELD_BLOCKS] = held.blocks
    if held.released:  # else it was held at least this long: not its length
        attrs[S.KV_HELD_MS] = (end - start) / _NS_PER_MS
    root.attributes.update(attrs)
    attrs[S.KV_HELD_RELEASED] = held.released
    plan.append(PlannedSpan(S.SPAN_KV_HELD, start, end, ROOT, attrs))


def _kv_link(j: FinishedJourney) -> list[trace.Link]:
    """The decode side's link to the prefill side's journey of the same request."""
    remote = j.kv_remote
    if remote is None or remote.link is None:
        return []
    ids = remote.link.ids
    ctx = SpanContext(trace_id_of(ids), ids.span_id, True, TraceFlags(TraceFlags.SAMPLED))
    attrs: dict[str, AttributeValue] = {}
    if remote.request_id is not None:
        attrs[S.KV_REMOTE_REQUEST_ID] = remote.request_id
    if remote.engine_id is not None:
        attrs[S.KV_REMOTE_ENGINE_ID] = remote.engine_id
    return [trace.Link(ctx, attrs)]


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
    if "tracestate" not in trace_headers:
        # The common case: a version-00 traceparent of exactly 55 characters and
        # no tracestate (the default path's headers: the API server's
        # traceparent and its mark, which the propagator does not read), parsed
        # here without the propagator's Context objects and its regex per call.
        # Any other form goes to the propagator, whose rules this shortcut
        # follows (tests/export/test_spans_plan.py compares the two).
        header = trace_headers.get("traceparent")
        if type(header) is str and len(header) == 55:
            match = _TRACEPARENT_00.fullmatch(header)
            if match is not None:
                trace_id, span_id = int(match[1], 16), int(match[2], 16)
                if not (trace_id and span_id):
                    return None  # all-zero ids: invalid, as the propagator says
                flags = TraceFlags(int(match[3], 16))
                return SpanContext(trace_id, span_id, is_remote=True, trace_flags=flags)
    ctx = trace.get_current_span(parent_context(trace_headers)).get_span_context()
    return ctx if ctx.is_valid else None


def root_context(j: FinishedJourney) -> tuple[SpanContext | None, list[trace.Link]]:
    """Parent span context and links of a journey's root.

    Head-sampled: a child of the client's span. Kept by the tail rule: the client's
    trace was not sampled (its spans are not exported), so a new root with a link
    to the client's span.
    """
    client = client_context(j.trace_headers)
    links = _kv_link(j)
    if j.head_sampled:
        return client, links
    return None, ([trace.Link(client)] if client is not None else []) + links
