"""Requests that do not end: snapshots of journeys in flight past a threshold.

Engine-core process, the pipeline's drain thread (``pipeline.py`` calls
:meth:`InFlightWatch.due` about once a second): never the engine thread, which
pays nothing for this. Times: ``time.monotonic_ns()``, the engine clock of the
journeys' ``*_mono_ns`` stamps.

A request in flight ``VLLM_JOURNEY_OTEL_IN_FLIGHT_S`` after its admission,
head-sampled or (with the tail rule's ``in_flight`` reason, the default) dropped
by head sampling, becomes an :class:`~vllm_journey_otel.journey.InFlight` record: its
journey so far (a copy; the engine thread's state machine is only read), where
it is now and its open wait. Again at twice that age, four times, ... while it
stays. The drain thread also encodes and writes them (``pipeline.py``), so the
engine thread pays nothing for them. The record carries the ids its final root
will have (fixed now if they were not), so the snapshot nests under the final
journey once that arrives; a journey that finished meanwhile gets no snapshot.

Reading the engine thread's objects from this thread is safe under the GIL:
``list(dict.values())`` copies the scheduler's request table in one step, and
the fields read are ints, references and an append-only list copied the same
way. A field read a moment before the engine thread changes it makes the
snapshot that much older, nothing worse.
"""

from __future__ import annotations

import weakref
from typing import Any

from vllm_journey_otel import schema as S
from vllm_journey_otel.engine.request_journey import PREEMPTED, QUEUED, RUNNING, RequestJourney
from vllm_journey_otel.engine.state import _STATE, JOURNEY_ATTR
from vllm_journey_otel.journey import STATUS_ABORTED, FinishedJourney, InFlight, Snapshot

# The drain thread looks at most this often (it wakes about once a second,
# pipeline.MAINTAIN_S, and sooner when the engine thread needs it),
# and takes at most this many snapshots a check (the rest wait for the next).
CHECK_INTERVAL_S = 1.0
MAX_PER_CHECK = 256
_STATES = {
    QUEUED: S.IN_FLIGHT_STATES.index(S.IN_FLIGHT_QUEUED),
    RUNNING: S.IN_FLIGHT_STATES.index(S.IN_FLIGHT_RUNNING),
    PREEMPTED: S.IN_FLIGHT_STATES.index(S.IN_FLIGHT_PREEMPTED),
}


def snapshot_of(
    j: RequestJourney, state: int, now_ns: int, step: int, output_tokens: int
) -> FinishedJourney | None:
    """The journey so far, as a record; None if it finished meanwhile (``j`` is
    not changed but for its root ids, fixed now if they were not)."""
    ids = j.snapshot_ids()
    if ids is None:
        return None
    if j.segment and state == QUEUED:
        # A session between input segments: vLLM's count is the last segment's,
        # already in outputs_before (as RequestJourney.finish counts it).
        output_tokens = 0
    events = list(j.events)
    outputs = output_tokens + j.outputs_before
    end_chunks = j.prefill_chunks if state == RUNNING and not j.decoding else 0
    end = Snapshot(now_ns, step, j.prefill_hwm, outputs, j.num_preemptions, j.decoding)
    return FinishedJourney(
        j.request_id, j.arrival_time_s, j.admitted, events, end, end_chunks,
        STATUS_ABORTED, None, j.prompt_tokens, outputs, j.max_tokens, j.first_token_mono_ns,
        None, j.priority, j.lora_name, j.trace_headers, j.head_sampled, ids,
        j.session, j.spec_decode, j.drafts_proposed, j.drafts_accepted, *j.admitted_engine,
    )  # fmt: skip


class InFlightWatch:
    """The requests of one scheduler that are due a snapshot (drain thread).

    Holds the scheduler and its tracker weakly: a scheduler that is gone (or
    tracing switched off) yields nothing.
    """

    def __init__(self, scheduler: Any, threshold_s: float, tracker: Any) -> None:
        self._scheduler = weakref.ref(scheduler)
        self._tracker = weakref.ref(tracker)  # its step counter, read at a snapshot
        self.threshold_ns = int(threshold_s * 1e9)
        # request id -> its snapshot level: 1 once seen at the threshold, 2 at
        # twice it, ... (forgotten once the request is gone).
        self.level: dict[str, int] = {}
        self.last_check_ns = 0

    def due(self, now_ns: int, room: int = MAX_PER_CHECK) -> list[InFlight]:
        """Snapshots due at ``now_ns``, at most ``room`` (the rest wait for the next
        check); at most one check per CHECK_INTERVAL_S."""
        scheduler, tracker = self._scheduler(), self._tracker()
        if (
            scheduler is None or tracker is None or not _STATE.enabled or self.threshold_ns <= 0
            or now_ns - self.last_check_ns < CHECK_INTERVAL_S * 1e9
        ):  # fmt: skip
            return []
        self.last_check_ns = now_ns
        out: list[InFlight] = []
        seen: dict[str, int] = {}
        for request in list(scheduler.requests.values()):
            j: RequestJourney | None = getattr(request, JOURNEY_ATTR, None)
            state = -1 if j is None else j.state  # read once: the engine thread moves it
            if j is None or state not in _STATES:
                continue
            if not j.head_sampled and not _STATE.tail.in_flight:
                continue  # head-dropped, and the tail rule does not keep the stuck
            rid = j.request_id
            level = seen[rid] = self.level.get(rid, 0)
            age = now_ns - j.admitted.t_mono_ns
            if age < self.threshold_ns << level or len(out) >= room:
                continue
            while age >= self.threshold_ns << (level + 1):
                level += 1  # after a stall: the level of its age, not one per check
            record = snapshot_of(j, state, now_ns, tracker.step, int(request.num_output_tokens))
            if record is not None:
                out.append(InFlight(record, level + 1, _STATES[state], j.wait_reason))
                seen[rid] = level + 1
                # Kept at its end by the tail rule (a bool written under the GIL;
                # the engine thread reads it when the request finishes).
                j.seen_in_flight = True
        self.level = seen
        return out
