"""The engine step view's per-step record: what one scheduler step scheduled.

Engine-core process, engine-core thread, inside the wrapped ``schedule`` (a mixin
of ``tracker.SchedulerTracker``, on the steps the step view samples only).
Timestamps are engine monotonic (``time.monotonic_ns()``, ``*_mono_ns``); the
record is finished in ``after_update`` and handed on as a ``StepRecord``.
"""

from __future__ import annotations

import time
from typing import Any

from vllm_journey_otel.engine.state import JOURNEY_ATTR
from vllm_journey_otel.journey import LinkTarget

_now = time.monotonic_ns


class StepView:
    """``SchedulerTracker``'s step-view part: the state it reads is the tracker's."""

    __slots__ = ()
    scheduler: Any
    # Recorded steps whose output is not processed yet, by id() of their
    # SchedulerOutput.
    steps_open: dict[int, tuple[Any, ...]]

    def _step_begin(self, t: int, step: int, out: Any) -> None:
        """Step view only: what the step scheduled. O(batch), on sampled steps only."""
        s = self.scheduler
        get = s.requests.get
        prefill = decode = 0
        links: list[LinkTarget] = []
        append = links.append
        for rid, n in out.num_scheduled_tokens.items():
            req = get(rid)
            if req is None:
                continue
            # Decode: one new position (plus drafts) after the prompt and every
            # generated token; anything further behind is prompt or recompute.
            if req.num_computed_tokens - n >= req.num_tokens - 1 and (
                req.num_output_tokens > 0 or req.num_output_placeholders > 0
            ):
                decode += n
            else:
                prefill += n
            j = getattr(req, JOURNEY_ATTR, None)
            if j is not None and j.head_sampled:
                append(j.link or j.link_target())
        open_steps = self.steps_open
        if len(open_steps) >= 64:
            # Outputs never processed (an engine that dropped a batch): forget
            # them rather than grow. With async scheduling at most a few are open.
            open_steps.clear()
        open_steps[id(out)] = (
            step,
            t,
            _now(),
            len(out.num_scheduled_tokens),
            prefill,
            decode,
            len(out.preempted_req_ids),
            float(s.kv_cache_manager.usage),
            len(s.running),
            len(s.waiting),
            links,
        )
