"""The wrappers of vLLM's Scheduler methods.

Engine-core process, engine-core thread. Each calls the original exactly once,
returns its value unchanged and lets its exceptions propagate; around it, the
tracker's bookkeeping (``tracker.py``), whose errors switch tracing off for the
process (``state._fail``) and never reach vLLM; a wrapper whose original ran a
failing hook inside it (a preemption inside ``schedule``) skips its own after
that. ``schedule`` takes one
``time.monotonic_ns()`` stamp (engine monotonic clock) before the original.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm_journey_otel.engine.disaggregation import RELEASE_MARK
from vllm_journey_otel.engine.handoff import _pipeline_for, flush
from vllm_journey_otel.engine.in_flight import InFlightWatch
from vllm_journey_otel.engine.state import _STATE, TRACKER_ATTR, _fail
from vllm_journey_otel.engine.tracker import SchedulerTracker, _now
from vllm_journey_otel.log import logger


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
            if _STATE.config.in_flight_s > 0:  # snapshots of requests that do not end
                watch = InFlightWatch(self, _STATE.config.in_flight_s, tracker)
                tracker.pipeline.watch(watch.due)
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
            if not _STATE.enabled:  # a hook inside the original failed: off since
                return result
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
        if not _STATE.enabled:  # a hook inside schedule (a preemption) failed
            return result
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
        if tr.blocked and tr.kv is not None:
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
        if not _STATE.enabled:  # a hook inside the update (_free_request) failed
            return result
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
                # vLLM 0.30-0.33 return (kv_transfer_params, ec_transfer_params).
                tr.after_free(request, result[0] if isinstance(result, tuple) else None)
            except Exception:
                _fail("_free_request")
        return result

    return _free_request


def _wrap_free_blocks(orig: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM frees an ended request's KV blocks: a held journey's hold ends."""

    @functools.wraps(orig)
    def _free_blocks(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(self, request, *args, **kwargs)
        tr = _tracker(self)
        if tr is not None and tr.kv is not None and tr.kv.held:
            try:
                tr.kv.released(request.request_id, tr.update_mono_ns if tr.in_update else _now())
            except Exception:
                _fail("_free_blocks")
        return result

    setattr(_free_blocks, RELEASE_MARK, True)
    return _free_blocks


def _wrap_shutdown(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(self, *args, **kwargs)
        # Requests aborted by the shutdown went through _free_request just
        # before this; export them and everything finished earlier.
        tr = self.__dict__.get(TRACKER_ATTR)
        if tr is not None:
            try:
                if tr.kv is not None and _STATE.enabled:
                    tr.kv.release_all(_now())  # KV still held for a decode side
                if not flush():
                    logger.warning(
                        "journey-otel: not every journey was exported within %.1f s of shutdown",
                        _STATE.config.shutdown_timeout_s,
                    )
            except Exception:
                logger.warning("journey-otel: flush at shutdown failed", exc_info=True)
        return result

    return shutdown
