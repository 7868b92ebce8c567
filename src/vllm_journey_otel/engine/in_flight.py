"""Requests that do not end: snapshots of journeys in flight past a threshold.

Engine-core process, the pipeline's drain thread (``pipeline.py`` calls
:meth:`InFlightWatch.due` about once a second): never the engine thread, which
pays nothing for this. Times: ``time.monotonic_ns()``, the engine clock of the
journeys' ``*_mono_ns`` stamps.

A head-sampled request in flight ``VLLM_JOURNEY_OTEL_IN_FLIGHT_S`` after its
admission becomes an :class:`~vllm_journey_otel.journey.InFlight` record: its
journey so far (a copy; the engine thread's state machine is only read), where
it is now and its open wait. Again at twice that age, four times, ... while it
stays. The record carries the ids its final root will have (chosen now if none
were), so the snapshot nests under the final journey once that arrives.

Reading the engine thread's objects from this thread is safe under the GIL:
``list(dict.values())`` copies the scheduler's request table in one step, and
the fields read are ints, references and an append-only list copied the same
way. A field read a moment before the engine thread changes it makes the
snapshot that much older, nothing worse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_journey_otel import schema as S
from vllm_journey_otel.engine.request_journey import PREEMPTED, QUEUED, RUNNING, RequestJourney
from vllm_journey_otel.engine.state import JOURNEY_ATTR
from vllm_journey_otel.journey import STATUS_ABORTED, FinishedJourney, InFlight, Snapshot

# The drain thread looks at most this often (it wakes every export interval).
CHECK_INTERVAL_S = 1.0
_STATES = {
    QUEUED: S.IN_FLIGHT_STATES.index(S.IN_FLIGHT_QUEUED),
    RUNNING: S.IN_FLIGHT_STATES.index(S.IN_FLIGHT_RUNNING),
    PREEMPTED: S.IN_FLIGHT_STATES.index(S.IN_FLIGHT_PREEMPTED),
}


def snapshot_of(j: RequestJourney, now_ns: int, step: int, output_tokens: int) -> FinishedJourney:
    """The journey so far, as a record (``j`` is not changed but for its root ids)."""
    j.link_target()  # the final root's ids, fixed from now on
    events = list(j.events)
    outputs = output_tokens + j.outputs_before
    end_chunks = j.prefill_chunks if j.state == RUNNING and not j.decoding else 0
    end = Snapshot(now_ns, step, j.prefill_hwm, outputs, j.num_preemptions, j.decoding)
    return FinishedJourney(
        j.request_id, j.arrival_time_s, j.admitted, events, end, end_chunks,
        STATUS_ABORTED, None, j.prompt_tokens, outputs, j.max_tokens, j.first_token_mono_ns,
        None, j.priority, j.lora_name, j.trace_headers, j.head_sampled, j.root_ids,
        j.session, j.spec_decode, j.drafts_proposed, j.drafts_accepted, *j.admitted_engine,
    )  # fmt: skip


class InFlightWatch:
    """The requests of one scheduler that are due a snapshot (drain thread)."""

    def __init__(self, scheduler: Any, threshold_s: float, step: Callable[[], int]) -> None:
        self.scheduler = scheduler
        self.threshold_ns = int(threshold_s * 1e9)
        self._step = step  # the tracker's step counter, read when a snapshot is taken
        # request id -> snapshots taken so far (forgotten once the request is gone).
        self.taken: dict[str, int] = {}
        self.last_check_ns = 0

    def due(self, now_ns: int) -> list[InFlight]:
        """Snapshots due at ``now_ns``; at most one check per CHECK_INTERVAL_S."""
        if self.threshold_ns <= 0 or now_ns - self.last_check_ns < CHECK_INTERVAL_S * 1e9:
            return []
        self.last_check_ns = now_ns
        out: list[InFlight] = []
        seen: dict[str, int] = {}
        for request in list(self.scheduler.requests.values()):
            j: RequestJourney | None = getattr(request, JOURNEY_ATTR, None)
            if j is None or not j.head_sampled or j.state not in _STATES:
                continue
            rid = j.request_id
            taken = self.taken.get(rid, 0)
            seen[rid] = taken
            if now_ns - j.admitted.t_mono_ns < self.threshold_ns << taken:
                continue  # next at the threshold times 2 ** (snapshots so far)
            record = snapshot_of(j, now_ns, self._step(), int(request.num_output_tokens))
            out.append(InFlight(record, taken + 1, _STATES[j.state], j.wait_reason))
            seen[rid] = taken + 1
        self.taken = seen
        return out
