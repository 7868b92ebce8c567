"""Wrappers around vLLM's v1 Scheduler: the only module that imports vLLM.

Process and thread: the wrappers run wherever a ``Scheduler`` lives, the
engine-core process, on the engine-core thread (the busy loop). Each wrapper

* calls the original exactly once, returns its value unchanged and lets its
  exceptions propagate;
* copies a few integers and one ``time.monotonic_ns()`` stamp into the request's
  :class:`~vllm_journey_otel.journey.RequestJourney`, which lives on the vLLM
  ``Request`` object (so it dies with it);
* never calls OpenTelemetry and never loops over the whole batch: per step it
  touches only the requests scheduled for the first time or resumed, and those
  still waiting for their first token of a cycle (the ``awaiting`` map);
* on any error of its own logs one warning and switches tracing off for the
  process; vLLM goes on untouched.

Hook points (vLLM 0.32 and 0.33):
``__init__`` (create the tracker and, once per process, the export pipeline),
``add_request`` (admission; an id already known is a streaming-input
continuation), ``schedule`` (first schedule or resume, prefill chunks),
``_preempt_request`` (preemption, read before vLLM resets ``num_computed_tokens``;
without it, ``SchedulerOutput.preempted_req_ids``), ``update_from_output``
(first token of a cycle; speculative-decoding drafts), ``_free_request`` (every
terminal transition), ``_handle_stopped_request`` when present (a streaming-input
session's segment ends), and ``shutdown`` (flush with a deadline).

Beyond the plain path, per step and only where configured: the LoRA adapter-slot
and remote-KV waits (vLLM's skipped requests, with a LoRA config or a KV
connector), status waits (grammar, remote KV: the blocked requests), the drafts
of a speculative step (the requests with drafts) and the opt-in step view (the
batch, on sampled steps). A preemption's cause is read from ``schedule()``'s
frame, at the preemption only.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

from opentelemetry.sdk.trace.export import SpanExporter

from . import __version__
from . import schema as S
from .compat import Support, check
from .config import ALL_VARIABLES, EXPORT_MODE, MODE_PROCESS, Config, logger
from .exporters import sdk_disabled
from .journey import (
    PREEMPTED,
    RUNNING,
    STATUS_ABORTED,
    STATUS_ERROR,
    STATUS_IGNORED,
    STATUS_LENGTH,
    STATUS_STOPPED,
    LinkTarget,
    RequestJourney,
    StepRecord,
)
from .pipeline import JourneyPipeline
from .rng import RNG
from .sampling import HeadSampler, TailRule
from .sinks import PipeSink, Sink, SpanSink

_now = time.monotonic_ns
_frame = sys._getframe
_WAIT_LORA = S.WAIT_REASONS.index(S.WAIT_LORA_SLOT)
_WAIT_STREAMING = S.WAIT_REASONS.index(S.WAIT_STREAMING_INPUT)
_WAIT_REMOTE_KV = S.WAIT_REASONS.index(S.WAIT_REMOTE_KV)
# A request status vLLM added after this was written: ended, reason unknown.
_UNKNOWN_STATUS = (STATUS_ABORTED, "abort")
# vLLM request statuses that mean "waiting for something specific" -> wait reason.
_STATUS_WAITS = {
    "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR": S.WAIT_REASONS.index(S.WAIT_GRAMMAR),
    "WAITING_FOR_REMOTE_KVS": S.WAIT_REASONS.index(S.WAIT_REMOTE_KV),
}

# Attribute names we set on vLLM objects.
TRACKER_ATTR = "_vjo_tracker"
JOURNEY_ATTR = "_vjo_journey"


def _vllm() -> tuple[str, type, type, Any]:
    """Import what we need from vLLM (here and only here)."""
    import vllm
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    version = str(getattr(vllm, "__version__", "0"))
    return version, Scheduler, RequestStatus, vllm


def _engine_proc_manager() -> type | None:
    """CoreEngineProcManager (API-server side: starts and stops engine cores)."""
    try:
        from vllm.v1.engine.utils import CoreEngineProcManager
    except Exception:
        return None
    return CoreEngineProcManager if isinstance(CoreEngineProcManager, type) else None


def _frontend_classes() -> tuple[type | None, type | None]:
    """AsyncLLM and OutputProcessor (API-server side), or None where missing."""
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.output_processor import OutputProcessor
    except Exception:
        return None, None
    return AsyncLLM, OutputProcessor


class _State:
    """Process-wide plugin state (one per process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.enabled = False
        self.installed = False
        self.config = Config()
        self.support: Support | None = None
        self.vllm_version = ""
        # (class, name) -> (original, whether the class defined it or inherited it)
        self.originals: dict[tuple[type, str], tuple[Callable[..., Any], bool]] = {}
        self.status_map: dict[Any, tuple[int, str]] = {}
        self.status_waits: dict[Any, int] = {}
        self.streaming_status: Any = None
        self.pipeline: JourneyPipeline | None = None
        self.pipeline_pid = 0
        # Tests inject an exporter; otherwise the OTEL_* variables decide.
        self.exporters: Sequence[SpanExporter] | None = None
        self.batch = True
        self.failed = False
        # Every live tracker, so a failure can drop their state at once.
        self.trackers: weakref.WeakSet[SchedulerTracker] = weakref.WeakSet()
        self.head = HeadSampler()
        self.tail = TailRule()


_STATE = _State()


def _fail(where: str) -> None:
    """Our own bookkeeping broke: warn once, switch tracing off, let vLLM go on."""
    if not _STATE.failed:
        _STATE.failed = True
        logger.warning(
            "journey-otel: internal error in the %s hook; journey tracing is now off "
            "for this process (vLLM is unaffected)",
            where,
            exc_info=True,
        )
    _STATE.enabled = False
    for tracker in list(_STATE.trackers):
        tracker.awaiting.clear()
        tracker.steps_open.clear()
        tracker.blocked.clear()


# ---------------------------------------------------------------------------
# Export pipeline, one per process, created where a Scheduler is built
# ---------------------------------------------------------------------------
def _resource_attributes(scheduler: Any) -> dict[str, Any]:
    vc = scheduler.vllm_config
    model = getattr(vc.model_config, "served_model_name", None) or getattr(
        vc.model_config, "model", ""
    )
    if isinstance(model, list | tuple):
        model = model[0] if model else ""
    return {
        S.RES_MODEL: str(model),
        S.RES_DP_RANK: int(getattr(vc.parallel_config, "data_parallel_rank", 0) or 0),
        S.RES_VLLM_VERSION: _STATE.vllm_version,
        S.RES_PLUGIN_VERSION: __version__,
        S.RES_HOST: socket.gethostname(),
        S.RES_PID: os.getpid(),
    }


def _make_sink(attributes: dict[str, Any]) -> Sink:
    """The exporter process, or span building in this process (thread mode, tests)."""
    if _STATE.exporters is None and _STATE.config.export_mode == MODE_PROCESS:
        try:
            return PipeSink.start(attributes, processes=_STATE.config.exporter_processes)
        except Exception:
            logger.warning(
                "journey-otel: could not start the exporter process; building spans "
                "in the engine core instead (%s=thread)",
                EXPORT_MODE,
                exc_info=True,
            )
    # No SdkLogQuieter here: the SDK's loggers are shared with vLLM's own tracing
    # in this process; export results are still counted by the export stage.
    return SpanSink.from_env(attributes, _STATE.exporters, threaded=_STATE.batch)


def _pipeline_for(scheduler: Any) -> JourneyPipeline:
    with _STATE.lock:
        pid = os.getpid()
        if _STATE.pipeline is None or _STATE.pipeline_pid != pid:
            cfg = _STATE.config
            _STATE.pipeline = JourneyPipeline(
                _make_sink(_resource_attributes(scheduler)),
                max_queue=cfg.queue_size,
                interval_s=cfg.export_interval_ms / 1000.0,
                cpu_priority=cfg.cpu_priority,
            )
            _STATE.pipeline_pid = pid
            # In-process engines exit through atexit; a forked engine core does
            # not run atexit, which is why Scheduler.shutdown flushes too.
            atexit.register(flush, cfg.shutdown_timeout_s)
        return _STATE.pipeline


def flush(timeout_s: float | None = None) -> bool:
    """Export every finished journey of this process within ``timeout_s``."""
    pipeline = _STATE.pipeline
    if pipeline is None or _STATE.pipeline_pid != os.getpid():
        return True
    t = _STATE.config.shutdown_timeout_s if timeout_s is None else timeout_s
    return pipeline.flush(t)


def pipeline() -> JourneyPipeline | None:
    """This process's export pipeline, if a Scheduler created one."""
    return _STATE.pipeline if _STATE.pipeline_pid == os.getpid() else None


# ---------------------------------------------------------------------------
# Per-scheduler bookkeeping
# ---------------------------------------------------------------------------
class SchedulerTracker:
    """Journey bookkeeping of one Scheduler instance (engine-core thread only)."""

    __slots__ = (
        "__weakref__",
        "awaiting",
        "blocked",
        "has_connector",
        "head",
        "hook_preempt",
        "in_update",
        "last_update_ids",
        "last_update_mono_ns",
        "max_loras",
        "num_sampled",
        "pipeline",
        "scheduler",
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
        self.tail = _STATE.tail
        self.step = 0
        # request id -> (Request, RequestJourney) for requests whose current cycle
        # has no token yet (or that were preempted before their first token).
        self.awaiting: dict[str, tuple[Any, RequestJourney]] = {}
        self.in_update = False
        self.update_mono_ns = 0
        self.last_update_mono_ns = 0
        self.last_update_ids: Any = ()
        vc = scheduler.vllm_config
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
        # A KV connector can put requests into WAITING_FOR_REMOTE_KVS in schedule().
        self.has_connector = getattr(scheduler, "connector", None) is not None
        # Step view: the fraction of steps recorded (0: off), and the recorded
        # steps whose output is not processed yet, by id() of their SchedulerOutput.
        cfg = _STATE.config
        self.steps_ratio = cfg.steps_ratio if cfg.steps else 0.0
        self.steps_open: dict[int, tuple[Any, ...]] = {}

    # add_request ----------------------------------------------------------
    def before_add(self, request: Any) -> bool:
        # A known id is the next input chunk of a streaming-input session, not a
        # new request.
        return bool(request.request_id in self.scheduler.requests)

    def after_add(self, request: Any, known: bool) -> None:
        if known:
            # Streaming input: the next input chunk of a session (or its end,
            # which vLLM turns into an abort, seen by _free_request).
            session = self.scheduler.requests.get(request.request_id)
            j = getattr(session, JOURNEY_ATTR, None)
            if (
                j is not None
                and j.wait_reason == _WAIT_STREAMING
                and session.status != self.streaming_status
            ):
                j.wait_ended(_now(), self.step, _WAIT_STREAMING)
            return
        sampled, root_ids = self.head.decide(request.trace_headers)
        if not sampled and not self.tail.active:
            return  # an unsampled request costs this decision and nothing else
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
            request.trace_headers,
            sampled,
            self.spec_decode,
            bool(getattr(request, "resumable", False)),
        )
        if root_ids is not None:  # the trace id the ratio was decided on
            j.root_ids = root_ids
        setattr(request, JOURNEY_ATTR, j)
        reason = self.status_waits.get(request.status)
        if reason is not None:  # a grammar to compile before it can be scheduled
            j.wait_began(j.admitted.t_mono_ns, self.step, reason)
            self.blocked[request.request_id] = (request, j, request.status)

    # schedule --------------------------------------------------------------
    def after_schedule(self, t: int, out: Any) -> None:
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
            deferred = getattr(self.scheduler, "deferred_waiting", None)
            if deferred:
                self._deferred_waits(t, step, deferred)
        ratio = self.steps_ratio
        if ratio and nst and (ratio >= 1.0 or RNG.random() < ratio):
            self._step_begin(t, step, out)

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

    def _blocked_waits(self, t: int, step: int) -> None:
        """Requests in a status wait: the wait ends when vLLM changes the status
        (it notices a compiled grammar or a finished KV load in schedule())."""
        done = [rid for rid, (req, _, status) in self.blocked.items() if req.status != status]
        for rid in done:
            _, j, status = self.blocked.pop(rid)
            j.wait_ended(t, step, self.status_waits[status])

    def _deferred_waits(self, t: int, step: int, deferred: Any) -> None:
        """Requests that schedule() skipped (vLLM's ``deferred_waiting``), only with
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

    # _preempt_request ------------------------------------------------------
    def before_preempt(self, request: Any) -> tuple[Any, ...] | None:
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
        """KV connector: the asynchronous loads the worker side reports finished
        (``finished_recving``) or failed (``failed_recving``) in this step's
        output. Read before the original runs: with vLLM's default
        ``kv_load_failure_policy="fail"`` it ends a failed request in there.
        Only with a KV connector and while some request is in a status wait
        (grammar or remote KV); O(loads reported)."""
        kco = getattr(mro, "kv_connector_output", None)
        if kco is None:
            return
        done = getattr(kco, "finished_recving", None)
        bad = getattr(kco, "failed_recving", None)
        if not done and not bad:
            return
        # Block-level failures (invalid_block_ids) cannot be told apart per
        # request before vLLM maps them: then success is unknown, not assumed.
        unknown = bool(getattr(kco, "invalid_block_ids", None))
        t = self.update_mono_ns
        step = self.step
        blocked = self.blocked
        waits = self.status_waits
        for rid in set(done or ()) | set(bad or ()):
            entry = blocked.get(rid)
            if entry is None:
                continue
            req, j, status = entry
            if waits.get(status) != _WAIT_REMOTE_KV:
                continue
            # vLLM fills PrefillStats at the first admission only: after a
            # preemption its count is not this load's (not observed: -1).
            stats = getattr(req, "prefill_stats", None)
            tokens = (
                getattr(stats, "num_external_cached_tokens", -1)
                if stats is not None and not req.num_preemptions
                else -1
            )
            failed = 1 if bad and rid in bad else (-1 if unknown else 0)
            j.kv_loaded(t, step, tokens if isinstance(tokens, int) else -1, failed)

    def after_update(self, scheduler_output: Any) -> None:
        t = self.update_mono_ns
        self.in_update = False
        self.last_update_mono_ns = t
        self.last_update_ids = scheduler_output.num_scheduled_tokens
        if self.steps_open:
            rec = self.steps_open.pop(id(scheduler_output), None)
            if rec is not None:
                step, t0, t1, *rest = rec
                self.pipeline.submit(StepRecord(step, t0, t1, _now(), *rest))
        # The last step before idling hands everything on: no later step would.
        self.pipeline.publish_due(t, force=not self.scheduler.requests)
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
    def after_free(self, request: Any) -> None:
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
        finished = j.finish(t, self.step, status, reason, out_tokens, last)
        if finished is None:
            return
        if not finished.head_sampled and not self.tail.keeps(
            status == STATUS_ERROR,
            status == STATUS_ABORTED,
            finished.end.num_preemptions,
            t - finished.admitted.t_mono_ns,
        ):
            return  # dropped by head sampling, not kept by the tail rule
        self.pipeline.submit(finished)
        if not self.in_update:
            self.pipeline.publish_due(t, force=True)  # an abort between steps


def _vllm_drafts(request: Any, j: RequestJourney) -> None:
    """The request's draft totals from vLLM's own per-request spec-decode metrics."""
    m = request.spec_decode_metrics
    if m is not None:
        j.drafts_so_far(m.num_draft_tokens, sum(i * c for i, c in enumerate(m.histogram)))


# ---------------------------------------------------------------------------
# The wrappers
# ---------------------------------------------------------------------------
def _tracker(scheduler: Any) -> SchedulerTracker | None:
    if not _STATE.enabled:
        return None
    return scheduler.__dict__.get(TRACKER_ATTR)  # type: ignore[no-any-return]


def _wrap_init(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        if not _STATE.enabled:
            return
        try:
            support = _STATE.support
            hook_preempt = support.hook_preempt if support is not None else True
            tracker = SchedulerTracker(self, _pipeline_for(self), hook_preempt)
            _STATE.trackers.add(tracker)
            self.__dict__[TRACKER_ATTR] = tracker
        except Exception:
            _fail("Scheduler.__init__")

    return __init__


def _around_request(
    where: str, before: str, after: str
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrapper factory for ``method(self, request, ...)``: ``tracker.<before>(request)``
    before the original, ``tracker.<after>(request, what before returned)`` after it."""

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def wrapper(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            tr = _tracker(self)
            if tr is None:
                return orig(self, request, *args, **kwargs)
            try:
                pre = getattr(tr, before)(request)
            except Exception:
                _fail(where)
                return orig(self, request, *args, **kwargs)
            result = orig(self, request, *args, **kwargs)
            try:
                getattr(tr, after)(request, pre)
            except Exception:
                _fail(where)
            return result

        return wrapper

    return make


_wrap_add_request = _around_request("add_request", "before_add", "after_add")
_wrap_preempt = _around_request("_preempt_request", "before_preempt", "after_preempt")


def _wrap_schedule(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        tr = _tracker(self)
        if tr is None:
            return orig(self, *args, **kwargs)
        t = _now()
        result = orig(self, *args, **kwargs)
        try:
            tr.after_schedule(t, result)
        except Exception:
            _fail("schedule")
        return result

    return schedule


def _wrap_stopped(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``_handle_stopped_request`` returns False when a streaming-input session
    stops a segment and goes on; it runs only for stopped requests."""

    @functools.wraps(orig)
    def _handle_stopped_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        # The segment's output count, before vLLM may clear it for the next one.
        out = request.num_output_tokens
        result = orig(self, request, *args, **kwargs)
        if result is False:
            tr = _tracker(self)
            if tr is not None:
                try:
                    tr.after_segment(request, out)
                except Exception:
                    _fail("_handle_stopped_request")
        return result

    return _handle_stopped_request


def _wrap_update(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def update_from_output(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        tr = _tracker(self)
        if tr is None:
            return orig(self, scheduler_output, *args, **kwargs)
        tr.before_update()
        if tr.blocked and tr.has_connector:
            try:
                tr.kv_transfers(args[0] if args else kwargs.get("model_runner_output"))
            except Exception:
                _fail("update_from_output")
                tr.in_update = False
                return orig(self, scheduler_output, *args, **kwargs)
        if not tr.spec_from_vllm and getattr(
            scheduler_output, "scheduled_spec_decode_tokens", None
        ):
            try:
                mro = args[0] if args else kwargs["model_runner_output"]
                tr.spec_verified(scheduler_output, mro)
            except Exception:
                _fail("update_from_output")
                tr.in_update = False
                return orig(self, scheduler_output, *args, **kwargs)
        try:
            result = orig(self, scheduler_output, *args, **kwargs)
        finally:
            tr.in_update = False
        try:
            tr.after_update(scheduler_output)
        except Exception:
            _fail("update_from_output")
        return result

    return update_from_output


def _wrap_free(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def _free_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(self, request, *args, **kwargs)
        tr = _tracker(self)
        if tr is not None:
            try:
                tr.after_free(request)
            except Exception:
                _fail("_free_request")
        return result

    return _free_request


def _wrap_shutdown(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(self, *args, **kwargs)
        # Requests aborted by the shutdown went through _free_request just
        # before this; export them and everything finished earlier.
        if self.__dict__.get(TRACKER_ATTR) is not None:
            try:
                if not flush():
                    logger.warning(
                        "journey-otel: not every journey was exported within %.1f s of shutdown",
                        _STATE.config.shutdown_timeout_s,
                    )
            except Exception:
                logger.warning("journey-otel: flush at shutdown failed", exc_info=True)
        return result

    return shutdown


# ---------------------------------------------------------------------------
# API-server side: keep the client's trace context without vLLM's tracing flag
# ---------------------------------------------------------------------------
# The client's W3C headers of the add_request call in progress (per asyncio task).
_TRACE_HEADERS: ContextVar[dict[str, str] | None] = ContextVar("vjo_trace_headers", default=None)


def _wrap_async_add_request(orig: Callable[..., Any]) -> Callable[..., Any]:
    """AsyncLLM.add_request drops ``trace_headers`` unless --otlp-traces-endpoint is set.

    We take them out of the call (so vLLM neither drops nor warns), keep them in a
    context variable for the duration of the call, and OutputProcessor.add_request
    puts them back on the EngineCoreRequest that goes to the engine core.
    """
    pos = list(inspect.signature(orig).parameters).index("trace_headers") - 1  # minus self

    @functools.wraps(orig)
    async def add_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _STATE.enabled:
            return await orig(self, *args, **kwargs)
        try:
            in_kwargs = "trace_headers" in kwargs
            headers: Any = kwargs["trace_headers"] if in_kwargs else None
            if not in_kwargs and len(args) > pos:
                headers = args[pos]
            keep = bool(headers) and self.observability_config.otlp_traces_endpoint is None
            if keep:
                if in_kwargs:
                    kwargs["trace_headers"] = None
                else:
                    args = (*args[:pos], None, *args[pos + 1 :])
                token = _TRACE_HEADERS.set(dict(headers))
        except Exception:
            _fail("AsyncLLM.add_request")
            return await orig(self, *args, **kwargs)
        if not keep:
            return await orig(self, *args, **kwargs)
        try:
            return await orig(self, *args, **kwargs)
        finally:
            _TRACE_HEADERS.reset(token)

    return add_request


# API-server side: this process's OutputProcessors, so that the shutdown grace
# can tell whether any request is in flight (their ``request_states``).
_OUTPUT_PROCESSORS: weakref.WeakSet[Any] = weakref.WeakSet()


def _wrap_output_init(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        with contextlib.suppress(TypeError):  # not weak-referenceable: no grace check
            _OUTPUT_PROCESSORS.add(self)

    return __init__


def _wrap_output_add_request(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if self not in _OUTPUT_PROCESSORS:  # built before the plugin loaded
            with contextlib.suppress(TypeError):
                _OUTPUT_PROCESSORS.add(self)
        headers = _TRACE_HEADERS.get()
        if headers is not None and getattr(request, "trace_headers", None) is None:
            try:
                request.trace_headers = headers
            except Exception:
                _fail("OutputProcessor.add_request")
        return orig(self, request, *args, **kwargs)

    return add_request


# vllm.v1.utils.shutdown waits this long when given no timeout (0.32, 0.33).
_VLLM_DEFAULT_PROCESS_TIMEOUT_S = 5.0


def _grace_for_engine_cores(manager: Any, timeout: float | None) -> None:
    """SIGTERM the engine cores and wait up to the grace for them to exit.

    Only when vLLM would kill them sooner (``timeout`` below the grace; None is
    vLLM's 5 s): on SIGTERM an engine core aborts its requests (our hooks hand
    those journeys to the exporter within milliseconds) and exits its busy loop;
    vLLM's own shutdown then finds it gone, or kills what is left as before.

    With the API server in this process, only when it has requests in flight:
    an idle engine core that exits by itself while the API server's output task
    still listens makes vLLM log a spurious EngineDeadError. Where the engine
    cores are managed by a process without an API server (--api-server-count > 1,
    --headless), in-flight requests cannot be seen: the grace always applies.
    """
    grace_s = _STATE.config.shutdown_grace_ms / 1000.0
    vllm_wait_s = _VLLM_DEFAULT_PROCESS_TIMEOUT_S if timeout is None else timeout
    if grace_s <= 0 or vllm_wait_s >= grace_s:
        return
    processors = list(_OUTPUT_PROCESSORS)
    if processors and not any(getattr(op, "request_states", True) for op in processors):
        return  # nothing in flight, nothing to save: vLLM's shutdown exactly as it is
    procs = [p for p in getattr(manager, "processes", ()) if p.is_alive()]
    if not procs:
        return
    stopped = getattr(manager, "manager_stopped", None)
    if stopped is not None:
        stopped.set()  # as vLLM's shutdown does first: an exit now is not a failure
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    alive = sum(p.is_alive() for p in procs)
    logger.info(
        "journey-otel: engine core shutdown grace %.0f ms: %d of %d exited by themselves",
        grace_s * 1000,
        len(procs) - alive,
        len(procs),
    )


def _wrap_proc_shutdown(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def shutdown(self: Any, timeout: float | None = None, *args: Any, **kwargs: Any) -> Any:
        if _STATE.enabled:
            try:
                _grace_for_engine_cores(self, timeout)
            except Exception:  # never in vLLM's way: its own shutdown goes on
                logger.debug("journey-otel: shutdown grace failed", exc_info=True)
        return orig(self, timeout, *args, **kwargs)

    return shutdown


_WRAPPERS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "__init__": _wrap_init,
    "add_request": _wrap_add_request,
    "schedule": _wrap_schedule,
    "_preempt_request": _wrap_preempt,
    "update_from_output": _wrap_update,
    "_free_request": _wrap_free,
    "shutdown": _wrap_shutdown,
    # Optional (streaming-input sessions); absent: a session is one long journey.
    "_handle_stopped_request": _wrap_stopped,
}


def _status_map(request_status: Any) -> dict[Any, tuple[int, str]]:
    table = {
        "FINISHED_STOPPED": (STATUS_STOPPED, "stop"),
        "FINISHED_LENGTH_CAPPED": (STATUS_LENGTH, "length"),
        "FINISHED_ABORTED": (STATUS_ABORTED, "abort"),
        "FINISHED_IGNORED": (STATUS_IGNORED, "length"),
        "FINISHED_ERROR": (STATUS_ERROR, "error"),
        # A stop on a detected repetition loop: "stopped", reason "repetition".
        "FINISHED_REPETITION": (STATUS_STOPPED, "repetition"),
    }
    return {
        getattr(request_status, name): value
        for name, value in table.items()
        if hasattr(request_status, name)
    }


def _declare_env_vars() -> None:
    """Tell vLLM our VLLM_JOURNEY_OTEL* variables are known.

    vLLM warns about unknown VLLM_* variables, and raises with
    --fail-on-environ-validation; the API server loads plugins before it checks.
    """
    import vllm.envs as envs

    table = getattr(envs, "environment_variables", None)
    if not isinstance(table, dict):
        return
    for name in ALL_VARIABLES:
        table.setdefault(name, functools.partial(os.environ.get, name))


def install(
    config: Config,
    exporters: Sequence[SpanExporter] | None = None,
    batch: bool = True,
    head: HeadSampler | None = None,
    tail: TailRule | None = None,
) -> bool:
    """Wrap the Scheduler's methods once per process. Returns True when tracing is on.

    Idempotent: a second call changes nothing but the enabled flag and, for
    tests, the injected exporters. Never raises.
    """
    try:
        with _STATE.lock:
            if not config.enabled:
                return False
            if sdk_disabled():
                logger.info("journey-otel: OTEL_SDK_DISABLED=true, journey tracing stays off")
                return False
            version, scheduler_cls, request_status, _ = _vllm()
            _declare_env_vars()
            support = check(version, scheduler_cls)
            if not support.ok:
                logger.warning("journey-otel: %s", support.reason)
                return False
            _STATE.config = config
            _STATE.support = support
            _STATE.vllm_version = version
            _STATE.exporters = exporters
            _STATE.batch = batch
            _STATE.status_map = _status_map(request_status)
            _STATE.streaming_status = getattr(request_status, "WAITING_FOR_STREAMING_REQ", None)
            _STATE.status_waits = {
                getattr(request_status, name): reason
                for name, reason in _STATUS_WAITS.items()
                if hasattr(request_status, name)
            }
            # Read once per process; trackers built from now on use them.
            _STATE.head = head if head is not None else HeadSampler.from_env(os.environ)
            _STATE.tail = tail if tail is not None else TailRule.from_env(os.environ)
            if not _STATE.installed:
                for name, make in _WRAPPERS.items():
                    if name == "_preempt_request" and not support.hook_preempt:
                        continue
                    if name == "_handle_stopped_request" and not _signature_has(
                        scheduler_cls, name, "request"
                    ):
                        continue
                    _patch(scheduler_cls, name, make)
                async_llm, output_processor = _frontend_classes()
                if _signature_has(async_llm, "add_request", "trace_headers") and _signature_has(
                    output_processor, "add_request", "request"
                ):
                    assert async_llm is not None and output_processor is not None
                    _patch(async_llm, "add_request", _wrap_async_add_request)
                    _patch(output_processor, "add_request", _wrap_output_add_request)
                    _patch(output_processor, "__init__", _wrap_output_init)
                else:
                    logger.info(
                        "journey-otel: AsyncLLM.add_request not as expected; the client's "
                        "trace context reaches journeys only with --otlp-traces-endpoint"
                    )
                manager = _engine_proc_manager()
                if _signature_has(manager, "shutdown", "timeout"):
                    assert manager is not None
                    _patch(manager, "shutdown", _wrap_proc_shutdown)
                _STATE.installed = True
            _STATE.failed = False
            _STATE.enabled = True
            logger.info("journey-otel: %s; scheduler hooks installed", support.reason)
            return True
    except Exception:
        logger.warning("journey-otel: could not install; journey tracing stays off", exc_info=True)
        return False


def _patch(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    own = name in cls.__dict__
    orig = getattr(cls, name)
    _STATE.originals[(cls, name)] = (orig, own)
    setattr(cls, name, make(orig))


def _signature_has(cls: type | None, name: str, param: str) -> bool:
    fn = getattr(cls, name, None) if cls is not None else None
    try:
        return fn is not None and param in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def unwrap() -> None:
    """Restore every original method; the pipeline stays (benchmarks toggle with this)."""
    with _STATE.lock:
        for (cls, name), (orig, own) in _STATE.originals.items():
            if own:
                setattr(cls, name, orig)
            else:
                delattr(cls, name)
        _STATE.originals.clear()
        _STATE.installed = False
        _STATE.enabled = False


def uninstall(timeout_s: float = 5.0) -> None:
    """Restore every original method and shut the pipeline down (tests)."""
    unwrap()
    with _STATE.lock:
        pipeline, _STATE.pipeline = _STATE.pipeline, None
    if pipeline is not None:
        pipeline.shutdown(timeout_s)


def enabled() -> bool:
    """Whether journey tracing is on in this process."""
    return _STATE.enabled
