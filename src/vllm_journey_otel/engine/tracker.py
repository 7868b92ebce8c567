"""Journey bookkeeping of one vLLM Scheduler: the tracker the wrappers call.

Engine-core process and thread (vLLM's busy loop), inside the wrapped Scheduler
methods. Each copies a few integers and one ``time.monotonic_ns()`` stamp
(engine monotonic, ``*_mono_ns``) into the request's ``RequestJourney``, never
calls OpenTelemetry and never loops over the whole batch: per step only the
requests scheduled or resumed, those awaiting a cycle's first token and, where
configured, the skipped and blocked ones and a speculative step's drafts.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from vllm_journey_otel import schema as S
from vllm_journey_otel.engine.compat import PAUSE_STATE, SKIPPED_REQUESTS, field_name
from vllm_journey_otel.engine.disaggregation import KvHandoff
from vllm_journey_otel.engine.pipeline import JourneyPipeline
from vllm_journey_otel.engine.queue_waits import QueueWaits
from vllm_journey_otel.engine.request_journey import PREEMPTED, RUNNING, RequestJourney
from vllm_journey_otel.engine.state import _STATE, JOURNEY_ATTR
from vllm_journey_otel.engine.step_view import StepView
from vllm_journey_otel.engine.trace_headers import bounded_trace_headers
from vllm_journey_otel.journey import (
    STATUS_ABORTED,
    STATUS_ERROR,
    StepRecord,
    api_server_traceparent,
)
from vllm_journey_otel.rng import RNG

_now = time.monotonic_ns
_frame = sys._getframe
_WAIT_STREAMING = S.WAIT_REASONS.index(S.WAIT_STREAMING_INPUT)
# A request status vLLM added after this was written: ended, reason unknown.
_UNKNOWN_STATUS = (STATUS_ABORTED, "abort")


class SchedulerTracker(QueueWaits, StepView):
    """Journey bookkeeping of one Scheduler instance (engine-core thread only)."""

    __slots__ = (
        "__weakref__",
        "awaiting",
        "blocked",
        "engine_seen",
        "has_connector",
        "head",
        "hook_preempt",
        "in_update",
        "keep_headers",
        "kv",
        "last_update_ids",
        "last_update_mono_ns",
        "max_loras",
        "num_sampled",
        "parent_based",
        "pause_field",
        "pipeline",
        "scheduler",
        "skipped_field",
        "spec_decode",
        "spec_from_vllm",
        "status_map",
        "status_waits",
        "step",
        "steps_open",
        "steps_ratio",
        "streaming_status",
        "tail",
        "update_mono_ns",
    )

    def __init__(self, scheduler: Any, pipeline: JourneyPipeline, hook_preempt: bool) -> None:
        self.scheduler = scheduler
        self.pipeline = pipeline
        self.hook_preempt = hook_preempt
        self.status_map = _STATE.status_map
        self.head = _STATE.head
        self.parent_based = self.head.parent_based
        self.tail = _STATE.tail
        # vLLM's KV cache usage and request counts (running, waiting), read at
        # the first admission after they may have changed otherwise (schedule,
        # update, a preempted or freed request, a streaming session's next
        # input) and carried through the admissions after it, sampled or not:
        # between steps vLLM adds requests in a burst, and adding one allocates
        # no block and adds one to its waiting count (0.30-0.33: ``waiting`` or
        # the queue it keeps beside it). None: to be read. Read again when the
        # running count moved (a preemption between steps: vLLM's
        # reset_prefix_cache at a pause, also where _preempt_request is not hooked).
        self.engine_seen: tuple[float, int, int] | None = None
        self.step = 0
        # request id -> (Request, RequestJourney) for requests whose current cycle
        # has no token yet (or that were preempted before their first token).
        self.awaiting: dict[str, tuple[Any, RequestJourney]] = {}
        self.in_update = False
        self.update_mono_ns = 0
        self.last_update_mono_ns = 0
        self.last_update_ids: Any = ()
        vc = scheduler.vllm_config
        # vLLM copies trace_headers into every output (update_from_output, 0.30-0.33)
        # for its own tracing alone: without it they are taken at admission, then cleared.
        obs = getattr(vc, "observability_config", None)
        self.keep_headers = getattr(obs, "otlp_traces_endpoint", None) is not None
        self.spec_decode = getattr(vc, "speculative_config", None) is not None
        # vLLM keeps per-request draft counts itself when asked to
        # (--per-request-spec-decode-metrics): then they are read at transitions
        # only, and nothing is done per step.
        self.spec_from_vllm = self.spec_decode and (
            getattr(scheduler, "spec_decode_metrics_level", "none") != "none"
        )
        # Tokens a step samples besides accepted drafts (0 for pooling models).
        self.num_sampled = int(getattr(scheduler, "num_sampled_tokens_per_step", 1))
        lora = getattr(vc, "lora_config", None)
        self.max_loras = int(lora.max_loras) if lora is not None else 0
        # Waits that vLLM expresses as a request status (grammar, remote KV):
        # status -> reason, and the requests in such a wait (checked per step).
        self.status_waits: dict[Any, int] = _STATE.status_waits
        self.streaming_status = _STATE.streaming_status
        self.blocked: dict[str, tuple[Any, RequestJourney, Any]] = {}
        # A KV connector can put requests into WAITING_FOR_REMOTE_KVS in schedule(),
        # and keep an ended request's KV blocks for another instance.
        self.has_connector = getattr(scheduler, "connector", None) is not None
        self.kv = KvHandoff(scheduler, pipeline) if self.has_connector else None
        # Where this release keeps the requests schedule() skipped (compat.FIELDS).
        self.skipped_field = field_name(SKIPPED_REQUESTS, _STATE.vllm_version, scheduler)
        # Where it keeps its pause state (None: unknown, assume it may be paused).
        self.pause_field = field_name(PAUSE_STATE, _STATE.vllm_version, scheduler)
        # Step view: the fraction of steps recorded (0: off), and the recorded
        # steps whose output is not processed yet, by id() of their SchedulerOutput.
        cfg = _STATE.config
        self.steps_ratio = cfg.steps_ratio if cfg.steps else 0.0
        self.steps_open: dict[int, tuple[Any, ...]] = {}

    def drop_state(self) -> None:
        """Tracing went off in this process (``state._fail``): nothing is tracked."""
        for tracked in (self.awaiting, self.blocked, self.steps_open):
            tracked.clear()
        if self.kv is not None:
            self.kv.held.clear()

    # add_request ----------------------------------------------------------
    def before_add(self, request: Any) -> bool:
        # A known id is the next input chunk of a streaming-input session, not a
        # new request.
        return bool(request.request_id in self.scheduler.requests)

    def after_add(self, request: Any, known: bool) -> None:
        if known:
            # Streaming input: the next input chunk of a session (or its end,
            # which vLLM turns into an abort, seen by _free_request). The
            # session may have gone back to vLLM's queue.
            self.engine_seen = None
            session = self.scheduler.requests.get(request.request_id)
            j = getattr(session, JOURNEY_ATTR, None)
            if (
                j is not None
                and j.wait_reason == _WAIT_STREAMING
                and session.status != self.streaming_status
            ):
                j.wait_ended(_now(), self.step, _WAIT_STREAMING)
            return
        headers = request.trace_headers
        root_ids = None
        tp = None
        if headers is not None:
            if not self.keep_headers:
                request.trace_headers = None
            if self.parent_based:
                tp = api_server_traceparent(headers)
        if tp is not None:
            # The API server's own headers (the default path): its sampling
            # decision is in their flags (HeadSampler.decide reads the same), and
            # they are bounded already.
            sampled = tp[-1] == "1"
        else:
            sampled, root_ids = self.head.decide(headers)
        if not sampled and not self.tail.active:
            seen = self.engine_seen
            if seen is not None:  # it joined vLLM's queue all the same
                self.engine_seen = (seen[0], seen[1], seen[2] + 1)
            return  # an unsampled request costs this decision and nothing else
        if tp is None and headers is not None:
            headers = bounded_trace_headers(headers)
        sp = request.sampling_params
        lora = request.lora_request
        j = RequestJourney(
            request.request_id,
            request.arrival_time,
            _now(),
            self.step,
            request.num_prompt_tokens,
            sp.max_tokens if sp is not None else None,
            request.priority,
            lora.lora_name if lora is not None else None,
            headers,
            sampled,
            self.spec_decode,
            bool(getattr(request, "resumable", False)),
        )
        if root_ids is not None:  # the trace id the ratio was decided on
            j.root_ids = root_ids
        # What the engine looked like when it was admitted, by vLLM's own counts
        # (its waiting count includes the queues it keeps beside `waiting`).
        s = self.scheduler
        seen = self.engine_seen
        if seen is not None and seen[1] == len(s.running):
            seen = (seen[0], seen[1], seen[2] + 1)  # this request joined the queue
        else:
            running, waiting = s.get_request_counts()
            seen = (float(s.get_kv_cache_usage()), running, waiting)
        j.admitted_engine = self.engine_seen = seen
        setattr(request, JOURNEY_ATTR, j)
        reason = self.status_waits.get(request.status)
        if reason is not None:  # a grammar to compile before it can be scheduled
            j.wait_began(j.admitted.t_mono_ns, self.step, reason)
            self.blocked[request.request_id] = (request, j, request.status)

    # schedule --------------------------------------------------------------
    def after_schedule(self, t: int, out: Any) -> None:
        self.engine_seen = None  # schedule() allocated and preempted
        self.step += 1
        step = self.step
        requests = self.scheduler.requests
        nst = out.num_scheduled_tokens
        if not self.hook_preempt:
            for rid in out.preempted_req_ids:
                req = requests.get(rid)
                j = getattr(req, JOURNEY_ATTR, None)
                if j is not None:
                    # KV usage and queue lengths at the moment are unknown here.
                    j.preempted(t, step, j.prefill_hwm, req.num_output_tokens, None, None, None)
        awaiting = self.awaiting
        new_ids = [nr.req_id for nr in out.scheduled_new_reqs]
        # V1 model runner: resumed requests are listed apart. V2 runner (0.33's GPU
        # default): they are in scheduled_new_reqs. The journey's own state tells
        # a first schedule from a resume either way.
        new_ids.extend(out.scheduled_cached_reqs.resumed_req_ids)
        for rid in new_ids:
            req = requests.get(rid)
            j = getattr(req, JOURNEY_ATTR, None)
            if j is None:
                continue
            if self.spec_from_vllm:
                _vllm_drafts(req, j)
            after = req.num_computed_tokens
            if j.scheduled(
                t, step, after - nst.get(rid, 0), after, req.num_tokens, req.num_output_tokens
            ):
                awaiting[rid] = (req, j)
        for rid, (req, j) in awaiting.items():
            # Skips the cycles that started in this very step (stepped() would too).
            if j.last_cycle_step != step:
                n = nst.get(rid)
                if n:
                    after = req.num_computed_tokens
                    j.stepped(step, after - n, after)
        if self.blocked:
            self._blocked_waits(t, step)
        if self.max_loras or self.has_connector:
            field = self.skipped_field
            deferred = getattr(self.scheduler, field, None) if field else None
            if deferred:
                self._deferred_waits(t, step, deferred)
        ratio = self.steps_ratio
        if ratio and nst and (ratio >= 1.0 or RNG.random() < ratio):
            self._step_begin(t, step, out)

    # _preempt_request ------------------------------------------------------
    def before_preempt(self, request: Any) -> tuple[Any, ...] | None:
        self.engine_seen = None  # its blocks are freed (in schedule(), or between steps)
        if getattr(request, JOURNEY_ATTR, None) is None:
            return None
        s = self.scheduler
        # The cause: schedule() preempts while it allocates KV blocks for the
        # running request in its local ``request`` (both policies; with PRIORITY
        # the victim is the lowest-priority running request). Frames: 0 this,
        # 1 our wrapper, 2 its caller. Read only at a preemption.
        cause_id = link = None
        caller = _frame(2)
        if caller.f_code.co_name == "schedule":
            cause = caller.f_locals.get("request")
            cid = getattr(cause, "request_id", None)
            if cause is not request and isinstance(cid, str):
                cause_id = cid
                cj = getattr(cause, JOURNEY_ATTR, None)
                if cj is not None and cj.head_sampled:
                    link = cj.link_target()
        # Read before vLLM frees the blocks and resets num_computed_tokens: the
        # usage that forced the preemption, and the progress it throws away.
        return (
            request.num_computed_tokens,
            request.num_output_tokens,
            float(s.kv_cache_manager.usage),
            len(s.running),
            len(s.waiting),
            cause_id,
            link,
        )

    def after_preempt(self, request: Any, pre: tuple[Any, ...] | None) -> None:
        j = getattr(request, JOURNEY_ATTR, None)
        if pre is None or j is None:
            return
        if self.spec_from_vllm:
            _vllm_drafts(request, j)
        j.preempted(_now(), self.step, *pre)
        if not j.awaiting_token:
            self.awaiting.pop(request.request_id, None)

    # _handle_stopped_request (streaming input) --------------------------------
    def after_segment(self, request: Any, output_tokens: int) -> None:
        """A resumable request stopped and stays: its input segment ended."""
        j = getattr(request, JOURNEY_ATTR, None)
        if j is None:
            return
        t = self.update_mono_ns if self.in_update else _now()
        if self.spec_from_vllm:
            _vllm_drafts(request, j)
        waiting = request.status == self.streaming_status
        j.segment_ended(
            t,
            self.step,
            output_tokens,
            request.num_computed_tokens,
            _WAIT_STREAMING if waiting else -1,
        )
        self.awaiting.pop(request.request_id, None)

    # update_from_output ----------------------------------------------------
    def before_update(self) -> None:
        self.in_update = True
        self.update_mono_ns = _now()

    def spec_verified(self, scheduler_output: Any, mro: Any) -> None:
        """Speculative decoding: drafts proposed and accepted per request this step.

        Read before the original runs, so a request that finishes in it still
        counts its last step; the same arithmetic as vLLM's spec-decode stats.
        O(requests with drafts), and only with speculative decoding.
        """
        get = self.scheduler.requests.get
        index = mro.req_id_to_index.get
        sampled = mro.sampled_token_ids
        if not sampled and self.num_sampled:
            return  # nothing generated: vLLM counts no verify step
        invalid = getattr(scheduler_output, "num_invalid_spec_tokens", None)
        k = self.num_sampled
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            req = get(rid)
            j = getattr(req, JOURNEY_ATTR, None)
            if j is None or not drafts:
                continue
            if req.num_stale_output_tokens > 0 and req.drop_stale_output:
                continue  # vLLM discards this output
            i = index(rid)
            n = len(sampled[i]) if sampled and i is not None else 0
            if not n and k:
                continue
            proposed = len(drafts)
            if invalid:
                proposed -= invalid.get(rid, 0)
            j.verified(proposed, n - k if n > k else 0)

    def kv_transfers(self, mro: Any) -> None:
        """KV connector: the transfers this step's output reports (disaggregation.py).
        Only while some request is in a status wait."""
        kco = getattr(mro, "kv_connector_output", None)
        if kco is not None and self.kv is not None:
            self.kv.outputs(kco, self.update_mono_ns, self.step, self)

    def after_update(self, scheduler_output: Any) -> None:
        t = self.update_mono_ns
        self.in_update = False
        self.last_update_mono_ns = t
        self.last_update_ids = scheduler_output.num_scheduled_tokens
        self.engine_seen = None  # blocks freed, KV transfers done
        if self.steps_open:
            rec = self.steps_open.pop(id(scheduler_output), None)
            if rec is not None:
                step, t0, t1, *rest = rec
                self.pipeline.submit(StepRecord(step, t0, t1, _now(), *rest))
        # Finished journeys go on at most every PUBLISH_INTERVAL_NS, and at the
        # last step before idling: no later step would (idle as vLLM's busy loop
        # sees it: no request left, sessions waiting for input, a pause). An
        # unpaused batch with running requests is not idle, which is read first
        # (vLLM's own count is three calls). A pause that vLLM's loop enters
        # without stepping again (nothing finished in its last step) leaves
        # the queue to the drain thread, within a second.
        pl, s = self.pipeline, self.scheduler
        if t >= pl.due_ns:
            pl.publish_due(t, force=True)
        if (
            pl.left
            and (not s.running or self.pause_field is None or getattr(s, self.pause_field))
            and not s.has_unfinished_requests()
        ):
            pl.publish_due(t, force=True, idle=True)  # what is left then: the drain thread's
        awaiting = self.awaiting
        if not awaiting:
            return
        step = self.step
        done = None
        for rid, (req, j) in awaiting.items():
            if not j.tokens(t, step, req.num_output_tokens):
                if done is None:
                    done = [rid]
                else:
                    done.append(rid)
        if done:
            for rid in done:
                del awaiting[rid]

    # _free_request ---------------------------------------------------------
    def after_free(self, request: Any, kv_params: Any = None) -> None:
        """``kv_params``: the connector's ``kv_transfer_params`` for the response."""
        self.engine_seen = None
        j: RequestJourney | None = getattr(request, JOURNEY_ATTR, None)
        if j is None:
            return
        setattr(request, JOURNEY_ATTR, None)
        rid = request.request_id
        self.awaiting.pop(rid, None)
        if self.blocked:
            self.blocked.pop(rid, None)
        out_tokens = request.num_output_tokens
        last: int | None
        if self.in_update:
            t = self.update_mono_ns
            last = t
        else:
            t = _now()
            # Finished outside update_from_output (an abort): its last token came
            # with the last processed step if it was in that batch and decoding.
            last = (
                self.last_update_mono_ns
                if j.state == RUNNING and j.decoding and rid in self.last_update_ids
                else None
            )
        state = j.state
        if (state == RUNNING and not j.decoding) or (
            state == PREEMPTED and j.first_token_mono_ns is None
        ):
            j.tokens(t, self.step, out_tokens)  # a first token that came with the end
        if self.spec_from_vllm:
            _vllm_drafts(request, j)
        status, reason = self.status_map.get(request.status, _UNKNOWN_STATUS)
        kv = self.kv
        held = kv is not None and kv.keeps_blocks(request, j)
        finished = j.finish(t, self.step, status, reason, out_tokens, last)
        if finished is None:
            return
        if not finished.head_sampled and not self.tail.keeps(
            status == STATUS_ERROR,
            status == STATUS_ABORTED,
            finished.end.num_preemptions,
            t - finished.admitted.t_mono_ns,
            j.seen_in_flight,
        ):
            return  # dropped by head sampling, not kept by the tail rule
        if kv is not None:
            finished = kv.ended(request, finished, kv_params, held)
            if finished is None:
                return  # handed on when vLLM frees its KV blocks
        self.pipeline.submit(finished)
        if not self.in_update:
            # An abort between steps: the last call before vLLM idles, if nothing is left.
            idle = not self.scheduler.has_unfinished_requests()
            self.pipeline.publish_due(t, force=True, idle=idle)


def _vllm_drafts(request: Any, j: RequestJourney) -> None:
    """The request's draft totals from vLLM's own per-request spec-decode metrics."""
    m = request.spec_decode_metrics
    if m is not None:
        j.drafts_so_far(m.num_draft_tokens, sum(i * c for i, c in enumerate(m.histogram)))
