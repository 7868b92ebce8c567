"""Installing and removing the plugin's wrappers on vLLM's classes.

Any vLLM process, the thread that loads plugins (``plugin.register``) or a
test. :func:`install` checks the vLLM version (``compat.py``), wraps the
Scheduler's methods (``scheduler_wrappers.py``) and the API server's
(``frontend.py``) once per process, and never raises: vLLM does not guard
plugin calls. :func:`unwrap` and :func:`uninstall` restore every original. No
timestamps.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.trace.export import SpanExporter

from vllm_journey_otel import schema as S
from vllm_journey_otel.config import ALL_VARIABLES, Config, sdk_disabled
from vllm_journey_otel.engine.compat import (
    ASYNC_LLM,
    FASTAPI,
    FINISHED_STATUSES,
    OUTPUT_PROCESSOR,
    PROC_MANAGER,
    SCHEDULER,
    SUPPORTED_VLLM,
    WAITING_STATUSES,
    check,
    patchable,
)
from vllm_journey_otel.engine.frontend import (
    _wrap_async_add_request,
    _wrap_build_middleware_stack,
    _wrap_finish_request,
    _wrap_output_add_request,
    _wrap_output_init,
    _wrap_proc_shutdown,
)
from vllm_journey_otel.engine.sampling import HeadSampler, TailRule
from vllm_journey_otel.engine.scheduler_wrappers import (
    _wrap_add_request,
    _wrap_free,
    _wrap_free_blocks,
    _wrap_init,
    _wrap_preempt,
    _wrap_schedule,
    _wrap_shutdown,
    _wrap_stopped,
    _wrap_update,
)
from vllm_journey_otel.engine.state import (
    _STATE,
    VllmMoved,
    _vllm,
    target_classes,
)
from vllm_journey_otel.log import logger

# The wrapper of each target of compat.TARGETS.
WRAPPERS: dict[tuple[str, str], Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    (SCHEDULER, "__init__"): _wrap_init,
    (SCHEDULER, "add_request"): _wrap_add_request,
    (SCHEDULER, "schedule"): _wrap_schedule,
    (SCHEDULER, "_preempt_request"): _wrap_preempt,
    (SCHEDULER, "update_from_output"): _wrap_update,
    (SCHEDULER, "_free_request"): _wrap_free,
    (SCHEDULER, "shutdown"): _wrap_shutdown,
    (SCHEDULER, "_free_blocks"): _wrap_free_blocks,
    (SCHEDULER, "_handle_stopped_request"): _wrap_stopped,
    (ASYNC_LLM, "add_request"): _wrap_async_add_request,
    (OUTPUT_PROCESSOR, "add_request"): _wrap_output_add_request,
    (OUTPUT_PROCESSOR, "__init__"): _wrap_output_init,
    (PROC_MANAGER, "shutdown"): _wrap_proc_shutdown,
    (OUTPUT_PROCESSOR, "_finish_request"): _wrap_finish_request,
    (FASTAPI, "build_middleware_stack"): _wrap_build_middleware_stack,
}


def _status_map(request_status: Any) -> dict[Any, tuple[int, str]]:
    """vLLM's terminal statuses -> (our finish status index, vLLM's finish reason)."""
    return {
        getattr(request_status, name): (S.FINISH_STATUSES.index(status), reason)
        for name, (status, reason) in FINISHED_STATUSES.items()
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
            try:
                version, scheduler_cls, request_status, _ = _vllm()
            except VllmMoved as exc:
                logger.warning(
                    "journey-otel: this vLLM does not have what the plugin hooks: %s; "
                    "journey tracing stays off (supported: vllm%s)",
                    exc,
                    SUPPORTED_VLLM,
                )
                return False
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
                getattr(request_status, name): S.WAIT_REASONS.index(reason)
                for name, reason in WAITING_STATUSES.items()
                if hasattr(request_status, name)
            }
            # Read once per process; trackers built from now on use them.
            _STATE.head = head if head is not None else HeadSampler.from_env(os.environ)
            _STATE.tail = tail if tail is not None else TailRule.from_env(os.environ)
            if not _STATE.installed:
                _wrap_targets(scheduler_cls)
                _STATE.installed = True
            _STATE.failed = False
            _STATE.enabled = True
            logger.info("journey-otel: %s; scheduler hooks installed", support.reason)
            return True
    except Exception:
        logger.warning("journey-otel: could not install; journey tracing stays off", exc_info=True)
        return False


def _wrap_targets(scheduler_cls: type) -> None:
    """Wrap every target of compat.TARGETS that this vLLM has as expected; say
    once what each optional one left out costs."""
    classes = target_classes(scheduler_cls)
    wrap, left_out = patchable(classes)
    for target in wrap:
        cls = classes[target.owner]
        assert cls is not None
        _patch(cls, target.method, WRAPPERS[(target.owner, target.method)])
    said: set[str] = set()
    for target in left_out:
        key = target.group or target.name
        members = [t for t in left_out if (t.group or t.name) == key]
        without = next((t.without for t in members if t.without), "")
        if without and key not in said:
            said.add(key)
            names = ", ".join(t.name for t in members)
            logger.info("journey-otel: %s not as expected (left out); %s", names, without)


def _patch(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    if (cls, name) in _STATE.originals:
        return  # wrapped already (an install that failed part-way): never wrap a wrapper
    own = name in cls.__dict__
    orig = getattr(cls, name)
    _STATE.originals[(cls, name)] = (orig, own)
    setattr(cls, name, make(orig))


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
