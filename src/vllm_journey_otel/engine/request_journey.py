"""A request's journey while it is in the engine: the state machine of its lifecycle.

Pure: imports neither vLLM nor OpenTelemetry. The scheduler hooks
(``tracker.py``) read a few integers off vLLM objects and call the transition
methods of :class:`RequestJourney`; when the request ends,
:meth:`RequestJourney.finish` returns a
:class:`~vllm_journey_otel.journey.FinishedJourney`, which the exporter turns
into spans later, in another process or thread.

Threading and clocks
--------------------
* Every method of :class:`RequestJourney` runs on the engine-core thread, inside
  a scheduler call. They do integer copies and one struct allocation at most:
  no OTel calls, no string formatting, no loops over the batch.
* ``*_mono_ns`` values are ``time.monotonic_ns()`` of the engine-core process
  (CLOCK_MONOTONIC, the same clock as vLLM's ``time.monotonic()`` event stamps).
* ``arrival_time_s`` is vLLM's ``Request.arrival_time``: *wall clock* seconds
  taken by the API server (``time.time()``). It is never subtracted from a
  monotonic value; ``spans.py`` converts monotonic values to epoch first.

State machine
-------------
QUEUED --scheduled--> RUNNING --preempted--> PREEMPTED --scheduled--> RUNNING ...
any state --finish--> FINISHED

Orders that async scheduling produces are accepted: a token can arrive for a
request that was preempted in the meantime (it counts for TTFT but opens no
decode span, the cycle already ended), a request can finish or be aborted
between schedule and update, and transitions that make no sense in the current
state (e.g. a preemption of a queued request) are ignored rather than raised.
"""

from __future__ import annotations

import threading
from typing import Final

from vllm_journey_otel.journey import (
    Event,
    FinishedJourney,
    FirstToken,
    KvLoaded,
    LinkTarget,
    Preempted,
    RootIds,
    Scheduled,
    SegmentEnded,
    Snapshot,
    WaitBegan,
    WaitEnded,
)
from vllm_journey_otel.rng import RNG

# Root ids are chosen once per journey, by whichever thread needs them first.
_IDS_LOCK = threading.Lock()
# Journey states (small ints: compared on the engine thread).
QUEUED: Final = 0
RUNNING: Final = 1
PREEMPTED: Final = 2
FINISHED: Final = 3


class RequestJourney:
    """Mutable per-request state while the request is in flight.

    Owned by the engine-core thread. Lives on the vLLM ``Request`` object, so it
    dies with it; :meth:`finish` detaches everything a span needs into an
    immutable :class:`FinishedJourney`.
    """

    __slots__ = (
        "admitted",
        "admitted_engine",
        "arrival_time_s",
        "cycle_out_start",
        "decoding",
        "drafts_accepted",
        "drafts_proposed",
        "events",
        "first_token_mono_ns",
        "frontier",
        "head_sampled",
        "input_offset",
        "last_cycle_step",
        "link",
        "lora_name",
        "max_tokens",
        "num_preemptions",
        "outputs_before",
        "prefill_chunks",
        "prefill_hwm",
        "prefill_target",
        "priority",
        "prompt_tokens",
        "request_id",
        "root_ids",
        "seen_in_flight",
        "segment",
        "session",
        "spec_decode",
        "state",
        "trace_headers",
        "vllm_prompt",
        "wait_reason",
    )

    def __init__(
        self,
        request_id: str,
        arrival_time_s: float,
        t_mono_ns: int,
        step: int,
        prompt_tokens: int,
        max_tokens: int | None,
        priority: int = 0,
        lora_name: str | None = None,
        trace_headers: dict[str, str] | None = None,
        head_sampled: bool = True,
        spec_decode: bool = False,
        session: bool = False,
    ) -> None:
        self.request_id = request_id
        # Streaming-input sessions: the segment number, outputs of the segments
        # before this one, and the positions vLLM counts as computed that are not
        # input (kept outputs of earlier segments, which it folds into the prompt).
        self.session = session
        self.segment = 0
        self.outputs_before = 0
        self.input_offset = 0
        self.frontier = 0
        self.vllm_prompt = prompt_tokens
        self.spec_decode = spec_decode
        self.drafts_proposed = 0
        self.drafts_accepted = 0
        self.root_ids: RootIds | None = None
        self.link: LinkTarget | None = None
        # The scheduler's counters at admission (KV usage, running, waiting).
        self.admitted_engine: tuple[float | None, int | None, int | None] = (None, None, None)
        # Reason of the open wait inside the queue (-1: none).
        self.wait_reason = -1
        self.head_sampled = head_sampled
        # Head-dropped and snapshotted in flight (set by the drain thread, read at
        # the end by the engine thread: the tail rule keeps it).
        self.seen_in_flight = False
        self.arrival_time_s = arrival_time_s
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.priority = priority
        self.lora_name = lora_name
        # Bounded by the caller (bounded_trace_headers): the engine thread skips
        # the copy for the API server's headers, which are bounded already.
        self.trace_headers = trace_headers
        self.state = QUEUED
        self.events: list[Event] = []
        self.num_preemptions = 0
        self.prefill_hwm = 0
        self.prefill_chunks = 0
        self.prefill_target = prompt_tokens
        self.cycle_out_start = 0
        self.decoding = False
        self.first_token_mono_ns: int | None = None
        self.last_cycle_step = -1
        self.admitted = Snapshot(t_mono_ns, step, 0, 0, 0, False)

    # -- helpers -----------------------------------------------------------
    def _snap(self, t_mono_ns: int, step: int, output_tokens: int) -> Snapshot:
        return Snapshot(
            t_mono_ns,
            step,
            self.prefill_hwm,
            output_tokens,
            self.num_preemptions,
            self.decoding,
        )

    def _progress(self, computed_tokens: int) -> None:
        computed_tokens -= self.input_offset
        done = computed_tokens if computed_tokens < self.prompt_tokens else self.prompt_tokens
        if done > self.prefill_hwm:
            self.prefill_hwm = done

    @property
    def awaiting_token(self) -> bool:
        """True while a token is still expected to mark the first one (cycle or request)."""
        if self.state == RUNNING:
            return not self.decoding
        return self.state == PREEMPTED and self.first_token_mono_ns is None

    def link_target(self) -> LinkTarget:
        """This journey's root as a link target; picks the root's ids on first use
        (the same immutable object after that: a step view links it every step)."""
        target = self.link
        if target is None:
            # Once per journey, by the engine thread or the drain thread's
            # in-flight snapshot (in_flight.py), whichever comes first.
            with _IDS_LOCK:
                target = self._link_locked()
        return target

    def _link_locked(self) -> LinkTarget:
        target = self.link
        if target is None:
            ids = self.root_ids  # chosen at admission when a ratio decided on them
            if ids is None:
                bits = RNG.getrandbits  # not vLLM's seeded global random (rng.py)
                ids = self.root_ids = RootIds(bits(64), bits(64) or 1, bits(64) or 1)
            # The journey's bounded headers: the API server's own dict (shared
            # with vLLM's request when its tracing keeps them) or a bounded copy;
            # nothing writes to either after admission.
            target = self.link = LinkTarget(self.request_id, ids, self.trace_headers)
        return target

    def snapshot_ids(self) -> RootIds | None:
        """Drain thread: the ids the root will have, fixed now if need be; None
        once the journey finished (its root took the ids it had then)."""
        with _IDS_LOCK:
            return None if self.state == FINISHED else self._link_locked().ids

    # -- transitions -------------------------------------------------------
    def wait_began(self, t_mono_ns: int, step: int, reason: int) -> None:
        """In the queue, the request now waits for ``reason`` (no-op if it already does)."""
        if self.state in (QUEUED, PREEMPTED) and self.wait_reason != reason:
            if self.wait_reason >= 0:
                self.events.append(WaitEnded(t_mono_ns, step))
            self.wait_reason = reason
            self.events.append(WaitBegan(t_mono_ns, step, reason))

    def wait_ended(self, t_mono_ns: int, step: int, reason: int = -1) -> None:
        """The open wait's cause went away while the request is still in the queue
        (``reason``: only if that is the open wait's reason; -1: whichever)."""
        if self.wait_reason >= 0 and (reason < 0 or reason == self.wait_reason):
            self.wait_reason = -1
            if self.state in (QUEUED, PREEMPTED):
                self.events.append(WaitEnded(t_mono_ns, step))

    def kv_loaded(self, t_mono_ns: int, step: int, tokens: int, failed: int) -> None:
        """KV connector: the open remote-KV wait's load finished (or failed)."""
        if self.state in (QUEUED, PREEMPTED) and self.wait_reason >= 0:
            self.events.append(KvLoaded(t_mono_ns, step, tokens, failed))

    def drafts_so_far(self, proposed: int, accepted: int) -> None:
        """Speculative decoding: the request's totals, as vLLM's own per-request
        metrics counted them (read at a transition instead of every step)."""
        if self.state != FINISHED:
            self.drafts_proposed = proposed
            self.drafts_accepted = accepted

    def verified(self, proposed: int, accepted: int) -> None:
        """Speculative decoding: one verify step's drafts (proposed, accepted)."""
        if self.state != FINISHED:
            self.drafts_proposed += proposed
            self.drafts_accepted += accepted

    def scheduled(
        self,
        t_mono_ns: int,
        step: int,
        computed_before: int,
        computed_after: int,
        num_tokens: int,
        output_tokens: int,
    ) -> bool:
        """A cycle starts: the request was admitted into the running set.

        ``computed_before`` is vLLM's ``num_computed_tokens`` before this step's
        tokens (the prefix-cache hit), ``computed_after`` after them, and
        ``num_tokens`` the prompt plus outputs that the cycle must (re)compute.
        Returns False (and records nothing) if the request is already running,
        e.g. a streaming-input continuation.
        """
        if self.state not in (QUEUED, PREEMPTED):
            return False
        output_tokens += self.outputs_before
        if self.segment and self.state == QUEUED:
            # The next input segment of a session: vLLM's prompt is now the
            # history (frontier) plus the new input.
            self.input_offset += self.frontier - self.vllm_prompt
            self.prompt_tokens += num_tokens - self.frontier
            self.vllm_prompt = num_tokens
        resume = self.state == PREEMPTED
        self.state = RUNNING
        self.wait_reason = -1
        self.decoding = False
        self.prefill_chunks = 1
        self.prefill_target = num_tokens
        self.cycle_out_start = output_tokens
        self.last_cycle_step = step
        hwm = self.prefill_hwm
        # _snap() and _progress() inlined: this runs for every cycle, cold.
        self.events.append(
            Scheduled(
                Snapshot(t_mono_ns, step, hwm, output_tokens, self.num_preemptions, False),
                resume,
                computed_before,
            )
        )
        done = computed_after - self.input_offset
        if done > self.prompt_tokens:
            done = self.prompt_tokens
        if done > hwm:
            self.prefill_hwm = done
        return True

    def stepped(self, step: int, computed_before: int, computed_after: int) -> None:
        """The running request got tokens in scheduler step ``step`` (prefill progress)."""
        if self.state != RUNNING or self.decoding or step == self.last_cycle_step:
            return
        if computed_before < self.prefill_target:
            self.prefill_chunks += 1
        self._progress(computed_after)

    def tokens(self, t_mono_ns: int, step: int, output_tokens: int) -> bool:
        """Model output was processed; ``output_tokens`` is the request's total now.

        Returns :attr:`awaiting_token` after it (the per-step caller needs both:
        one call instead of two)."""
        output_tokens += self.outputs_before
        state = self.state
        if state == RUNNING:
            if self.decoding:
                return False
            if output_tokens > self.cycle_out_start:
                self.prefill_hwm = self.prompt_tokens
                self.decoding = True
                if self.first_token_mono_ns is None:
                    self.first_token_mono_ns = t_mono_ns
                self.events.append(
                    FirstToken(
                        # _snap() inlined (decoding is now True)
                        Snapshot(
                            t_mono_ns,
                            step,
                            self.prefill_hwm,
                            output_tokens,
                            self.num_preemptions,
                            True,
                        ),
                        self.prefill_chunks,
                        self.drafts_proposed,
                        self.drafts_accepted,
                    )
                )
                return False
            return True
        if state == PREEMPTED and self.first_token_mono_ns is None:
            if output_tokens > 0:
                # Async scheduling: the token of a step that was in flight when the
                # request was preempted. It is the request's first token (TTFT), but
                # its cycle is over, so no decode span starts.
                self.first_token_mono_ns = t_mono_ns
                return False
            return True
        return False

    def preempted(
        self,
        t_mono_ns: int,
        step: int,
        computed_tokens: int,
        output_tokens: int,
        kv_cache_usage: float | None,
        num_running: int | None,
        num_waiting: int | None,
        cause_id: str | None = None,
        cause_link: LinkTarget | None = None,
    ) -> None:
        """The running cycle ends by preemption (``computed_tokens`` read before vLLM resets it)."""
        if self.state != RUNNING:
            return
        output_tokens += self.outputs_before
        self._progress(computed_tokens)
        self.num_preemptions += 1
        self.events.append(
            Preempted(
                self._snap(t_mono_ns, step, output_tokens),
                0 if self.decoding else self.prefill_chunks,
                kv_cache_usage,
                num_running,
                num_waiting,
                self.drafts_proposed,
                self.drafts_accepted,
                cause_id,
                cause_link,
            )
        )
        self.state = PREEMPTED
        self.decoding = False

    def segment_ended(
        self,
        t_mono_ns: int,
        step: int,
        output_tokens: int,
        frontier: int,
        wait_reason: int,
    ) -> None:
        """Streaming input: the segment stopped and the session went back to the
        queue. ``output_tokens`` is the segment's (read before vLLM clears it),
        ``frontier`` vLLM's computed tokens kept for the next segment, and
        ``wait_reason`` >= 0 when it now waits for the client's next input."""
        if self.state != RUNNING:
            return
        # The stop may come with the cycle's first token, before update's end.
        self.tokens(t_mono_ns, step, output_tokens)
        output_tokens += self.outputs_before
        self.events.append(
            SegmentEnded(
                self._snap(t_mono_ns, step, output_tokens),
                0 if self.decoding else self.prefill_chunks,
                self.drafts_proposed,
                self.drafts_accepted,
            )
        )
        self.outputs_before = output_tokens
        self.frontier = frontier
        self.segment += 1
        self.state = QUEUED
        self.decoding = False
        self.wait_reason = -1
        if wait_reason >= 0:
            self.wait_began(t_mono_ns, step, wait_reason)

    def finish(
        self,
        t_mono_ns: int,
        step: int,
        status: int,
        finish_reason: str | None,
        output_tokens: int,
        last_token_mono_ns: int | None,
    ) -> FinishedJourney | None:
        """The request ended. Returns the immutable record, or None if it already ended."""
        if self.state == FINISHED:
            return None
        if self.segment and self.state == QUEUED:
            # A session ended between segments: vLLM's count is still the last
            # segment's (counted when it ended) or 0 (next input not yet run).
            output_tokens = 0
        output_tokens += self.outputs_before
        end_chunks = self.prefill_chunks if self.state == RUNNING and not self.decoding else 0
        with _IDS_LOCK:  # a snapshot fixing the ids now would fix them too late
            root_ids = self.root_ids
            self.state = FINISHED
        # Positional, in field order (keywords cost ~0.25 us more per journey on
        # the engine thread); tests/export/test_spans_plan.py round-trips every field.
        journey = FinishedJourney(
            self.request_id,
            self.arrival_time_s,
            self.admitted,
            self.events,
            Snapshot(
                t_mono_ns,
                step,
                self.prefill_hwm,
                output_tokens,
                self.num_preemptions,
                self.decoding,
            ),
            end_chunks,
            status,
            finish_reason,
            self.prompt_tokens,
            output_tokens,
            self.max_tokens,
            self.first_token_mono_ns,
            last_token_mono_ns if output_tokens > 0 else None,
            self.priority,
            self.lora_name,
            self.trace_headers,  # bounded, never written after admission
            self.head_sampled,
            root_ids,
            self.session,
            self.spec_decode,
            self.drafts_proposed,
            self.drafts_accepted,
            *self.admitted_engine,
        )
        self.events = []
        return journey
