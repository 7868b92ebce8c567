"""Waits inside the queue that vLLM expresses as a request status or a skip.

Engine-core process, engine-core thread, inside the wrapped ``schedule`` (a
mixin of ``tracker.SchedulerTracker``): a grammar to compile or a remote KV load
(a request status), an adapter slot (a request schedule() skipped). Per step,
only while such a wait is open or with a LoRA config or a KV connector.
Timestamps are the step's engine monotonic stamp (``*_mono_ns``).
"""

from __future__ import annotations

from typing import Any

from vllm_journey_otel import schema as S
from vllm_journey_otel.engine.request_journey import RequestJourney
from vllm_journey_otel.engine.state import JOURNEY_ATTR

_WAIT_LORA = S.WAIT_REASONS.index(S.WAIT_LORA_SLOT)


class QueueWaits:
    """``SchedulerTracker``'s queue-wait part: the state it reads is the tracker's."""

    __slots__ = ()
    scheduler: Any
    max_loras: int
    # vLLM request status -> our wait reason; the requests in such a wait.
    status_waits: dict[Any, int]
    blocked: dict[str, tuple[Any, RequestJourney, Any]]

    def _blocked_waits(self, t: int, step: int) -> None:
        """Requests in a status wait: the wait ends when vLLM changes the status
        (it notices a compiled grammar or a finished KV load in schedule())."""
        done = [rid for rid, (req, _, status) in self.blocked.items() if req.status != status]
        for rid in done:
            _, j, status = self.blocked.pop(rid)
            j.wait_ended(t, step, self.status_waits[status])

    def _deferred_waits(self, t: int, step: int, deferred: Any) -> None:
        """Requests that schedule() skipped (``deferred_waiting``, ``skipped_waiting``
        in 0.30: compat.FIELDS), only with
        a LoRA config or a KV connector; O(skipped requests).

        * Waiting for remote KV: the connector started an asynchronous load
          (status WAITING_FOR_REMOTE_KVS); tracked in ``blocked`` from then on.
        * Waiting for an adapter slot: ``max_loras`` adapters were in use by
          running requests and the request's own was not one of them.
        """
        active: set[int] | None = None
        blocked = self.blocked
        for req in deferred:
            j = getattr(req, JOURNEY_ATTR, None)
            if j is None:
                continue
            status = req.status
            reason = self.status_waits.get(status)
            if reason is not None:
                rid = req.request_id
                if rid not in blocked:
                    j.wait_began(t, step, reason)
                    blocked[rid] = (req, j, status)
                continue
            lora = req.lora_request
            if lora is None or not self.max_loras:
                continue
            if active is None:
                active = {
                    r.lora_request.lora_int_id
                    for r in self.scheduler.running
                    if r.lora_request is not None and r.lora_request.lora_int_id > 0
                }
            if len(active) >= self.max_loras and lora.lora_int_id not in active:
                j.wait_began(t, step, _WAIT_LORA)
            elif j.wait_reason == _WAIT_LORA:
                j.wait_ended(t, step, _WAIT_LORA)
