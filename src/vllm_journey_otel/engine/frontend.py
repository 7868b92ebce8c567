"""API-server side: the client's trace context, the API-server spans' hooks, and
the engine cores' shutdown grace.

API-server process, its asyncio event loop thread (``AsyncLLM.add_request``,
``OutputProcessor``, ``FastAPI.build_middleware_stack``) and the thread that shuts vLLM down
(``CoreEngineProcManager.shutdown``). Times: ``time.monotonic()`` for the grace's
deadline.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from vllm_journey_otel.engine.api_server import JourneyMiddleware, current, on_last_output
from vllm_journey_otel.engine.handoff import _pipeline_for, pipeline
from vllm_journey_otel.engine.state import _STATE, _fail
from vllm_journey_otel.log import logger

# The client's W3C headers of the add_request call in progress (per asyncio task).
_TRACE_HEADERS: ContextVar[dict[str, str] | None] = ContextVar("vjo_trace_headers", default=None)


def _take_headers(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any], pos: int) -> Any:
    """The call's arguments without ``trace_headers`` where vLLM would drop
    them (no --otlp-traces-endpoint), and those headers (None: left as they are)."""
    in_kwargs = "trace_headers" in kwargs
    headers: Any = kwargs["trace_headers"] if in_kwargs else None
    if not in_kwargs and len(args) > pos:
        headers = args[pos]
    if not headers or self.observability_config.otlp_traces_endpoint is not None:
        return args, None
    if in_kwargs:
        kwargs["trace_headers"] = None
    else:
        args = (*args[:pos], None, *args[pos + 1 :])
    return args, dict(headers)


def _wrap_async_add_request(orig: Callable[..., Any]) -> Callable[..., Any]:
    """AsyncLLM.add_request drops ``trace_headers`` unless --otlp-traces-endpoint is set.

    We take them out of the call (so vLLM neither drops nor warns), keep them in a
    context variable for the duration of the call, and OutputProcessor.add_request
    puts them back on the EngineCoreRequest that goes to the engine core. Under
    an API-server span (api_server.py) that span's ids go instead, and the
    call's return is the hand-off to the engine core.
    """
    pos = list(inspect.signature(orig).parameters).index("trace_headers") - 1  # minus self

    @functools.wraps(orig)
    async def add_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _STATE.enabled:
            return await orig(self, *args, **kwargs)
        try:
            api = current()
            args, headers = _take_headers(self, args, kwargs, pos)
            token = _TRACE_HEADERS.set(headers) if headers is not None else None
        except Exception:
            _fail("AsyncLLM.add_request")
            return await orig(self, *args, **kwargs)
        try:
            out = await orig(self, *args, **kwargs)
        finally:
            if token is not None:
                _TRACE_HEADERS.reset(token)
        if api is not None:
            try:
                api.on_handoff()
                if pipeline() is None:  # the app's start-up found no vLLM config: once
                    _pipeline_for(self, engine=False)
            except Exception:
                _fail("AsyncLLM.add_request")
        return out

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
        api = current()
        headers = _TRACE_HEADERS.get()
        ours = False
        try:
            if api is not None and _STATE.enabled and api.on_engine_request(request):
                ours = True
            elif headers is not None and getattr(request, "trace_headers", None) is None:
                request.trace_headers = headers
        except Exception:
            _fail("OutputProcessor.add_request")
        result = orig(self, request, *args, **kwargs)
        if ours and api is not None:
            # vLLM's request state, keyed by the request id (``request_states``,
            # 0.30-0.33): an optional figure, so a vLLM without it costs the
            # TTFT only, never the tracing.
            states = getattr(self, "request_states", None)
            if isinstance(states, dict):
                api.on_engine_state(states.get(request.request_id))
        return result

    return add_request


def _wrap_finish_request(orig: Callable[..., Any]) -> Callable[..., Any]:
    """OutputProcessor._finish_request: the engine's last output for a request
    reached this process (output-handler task, once per finished request)."""

    @functools.wraps(orig)
    def _finish_request(self: Any, req_state: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            on_last_output(req_state.request_id)
        except Exception:
            _fail("OutputProcessor._finish_request")
        return orig(self, req_state, *args, **kwargs)

    return _finish_request


def _wrap_build_middleware_stack(orig: Callable[..., Any]) -> Callable[..., Any]:
    """FastAPI.build_middleware_stack: our middleware outermost of the app's own
    (inside the server-error handler, and inside an HTTP instrumentation that
    wraps the built stack), and this process's pipeline started with the app."""

    @functools.wraps(orig)
    def build_middleware_stack(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _STATE.enabled and _STATE.config.api_spans:
            try:
                install_middleware(self)
            except Exception:
                _fail("FastAPI.build_middleware_stack")
        return orig(self, *args, **kwargs)

    return build_middleware_stack


def install_middleware(app: Any) -> None:
    """Insert :class:`JourneyMiddleware` into ``app`` once (it starts this
    process's pipeline when the app starts)."""
    from starlette.middleware import Middleware

    if not any(getattr(m, "cls", None) is JourneyMiddleware for m in app.user_middleware):
        app.user_middleware.insert(0, Middleware(JourneyMiddleware))


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
