"""The API server's part of each request: an ASGI middleware and its per-request record.

API-server process (each one of ``--api-server-count``), its asyncio event
loop thread: the middleware runs in the request's task, the hooks of
``frontend.py`` in the request's task (``AsyncLLM.add_request``,
``OutputProcessor.add_request``) and in vLLM's output-handler task
(``OutputProcessor._finish_request``). Times: ``time.monotonic_ns()`` of this
process (CLOCK_MONOTONIC, the engine core's clock too); vLLM's arrival stamp
is its wall clock (``time.time()``).

Per request, on the event loop: a few clock reads and a small record, no span:
the finished :class:`~vllm_journey_otel.journey.ApiJourney` goes to this
process's pipeline, and the event loop itself hands the pipeline's queue to the
exporter process (``export/api_spans.py`` builds the spans there): at a request's
end when the last hand-off is ``PUBLISH_INTERVAL_NS`` old, else from one timer
that long after. One msgspec encode and one non-blocking write per hand-off; a
full pipe's leftovers are retried by the next hand-off, and the pipeline's
drain thread wakes only when the timer finds no request ended since it was set
with something still left, and otherwise once a second (a thread of ours that
wakes in this process takes the event loop's GIL: ``pipeline.py``). The span's
ids are chosen at receipt and handed to the engine core in the trace headers,
so the engine's journeys nest under it without a round trip.

Which requests get a span: every one that reached the engine (an
``AsyncLLM.add_request`` ran in its task), and every POST turned away with an
error before it did (a prompt too long: an error span with no engine child).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from typing import Any

from opentelemetry import trace as otel_trace

from vllm_journey_otel.engine.handoff import _pipeline_for, pipeline
from vllm_journey_otel.engine.pipeline import PUBLISH_INTERVAL_NS, JourneyPipeline
from vllm_journey_otel.engine.sampling import client_trace
from vllm_journey_otel.engine.state import _STATE, _fail
from vllm_journey_otel.engine.trace_headers import bounded_trace_headers
from vllm_journey_otel.journey import API_PARENT_KEY, ApiJourney, RootIds
from vllm_journey_otel.log import logger
from vllm_journey_otel.rng import RNG

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_LOW64 = (1 << 64) - 1
_EVENT_STREAM = b"text/event-stream"

# The request in progress, per asyncio task (tasks copy it: a stream's body
# task sees the request that started it).
_CURRENT: ContextVar[ApiRequest | None] = ContextVar("vjo_api_request", default=None)
# The pending hand-off timer (at most one), the loop it is on, and when the
# request that set it ended (this process's monotonic ns).
_TIMER: list[tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle, int]] = []
# When the last request ended (traced or not), monotonic ns.
_LAST_END_NS = [0]
# Engine request id -> its API request, until the engine's last output for it
# reaches this process (OutputProcessor._finish_request, in another task).
_BY_ENGINE_ID: dict[str, ApiRequest] = {}


def current() -> ApiRequest | None:
    """The API request of the running task, if it is traced."""
    return _CURRENT.get()


def _parent(scope: Scope) -> tuple[dict[str, str] | None, bool, tuple[int, int] | None]:
    """The parent's W3C headers, whether our span is the SERVER span, and the
    parent's (trace id, flags) (``sampling.client_trace``'s, parsed once).

    A recording span current here is another instrumentation's HTTP server span
    (FastAPI's, through ``opentelemetry-instrument``): ours is its INTERNAL child.
    Otherwise the client's own ``traceparent``, if it sent one.
    """
    span = otel_trace.get_current_span()
    if span.is_recording():
        ctx = span.get_span_context()
        parent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
        headers = {"traceparent": parent}
        if ctx.trace_state:
            headers["tracestate"] = ctx.trace_state.to_header()
        return headers, False, (ctx.trace_id, int(ctx.trace_flags)) if ctx.is_valid else None
    found: dict[str, str] = {}
    for name, value in scope.get("headers", ()):
        if name == b"traceparent":
            found["traceparent"] = value.decode("latin-1")
        elif name == b"tracestate":  # several headers are one list (W3C)
            text = value.decode("latin-1")
            found["tracestate"] = f"{found['tracestate']},{text}" if "tracestate" in found else text
    client = client_trace(found.get("traceparent")) if found else None
    if client is None:
        return None, True, None  # no valid parent: no tracestate either
    # The sizes the engine keeps (a client cannot make the record grow): a
    # traceparent past them is dropped, and the request starts its own trace.
    bounded = bounded_trace_headers(found)
    return bounded, True, client if bounded and "traceparent" in bounded else None


# ASGI spec versions before the one whose servers raise from ``send`` for a
# client gone (2.4); another version is parsed (``_send_raises``).
_SEND_NEVER_RAISES = frozenset(("2.0", "2.1", "2.2", "2.3"))


def _send_raises(scope: Scope) -> bool:
    """Whether the server's ``send`` may raise ``OSError`` for a client gone (ASGI 2.4+)."""
    version = str((scope.get("asgi") or {}).get("spec_version", "2.0"))
    if version in _SEND_NEVER_RAISES:
        return False
    try:
        major, minor, *_ = (int(part) for part in f"{version}.0".split("."))
    except ValueError:  # not a version: assume it may (the exact, slower send)
        return True
    return (major, minor) >= (2, 4)


class ApiRequest:
    """One traced HTTP request, filled in as it goes (event-loop thread only)."""

    __slots__ = (
        "_receive",
        "_send",
        "_send_raises",
        "arrival_time_s",
        "chunks",
        "disconnected",
        "done",
        "end_ns",
        "engine_headers",
        "engine_stats",
        "exception",
        "first_body_ns",
        "handoff_ns",
        "ids",
        "last_output_ns",
        "method",
        "parent_headers",
        "path",
        "receipt_ns",
        "request_ids",
        "sampled",
        "server_kind",
        "status_code",
        "stream",
    )

    def __init__(self, scope: Scope, receipt_ns: int, receive: Receive, send: Send) -> None:
        self.receipt_ns = receipt_ns
        self._receive = receive
        self._send = send
        self._send_raises = _send_raises(scope)
        self.method = str(scope.get("method", ""))
        self.path = str(scope.get("path", ""))
        self.parent_headers, self.server_kind, client = _parent(scope)
        sampled, drawn = _STATE.head.decide_client(client)
        if client is not None:
            trace_id = client[0]
        elif drawn is not None:  # the ratio decided on this trace id: keep it
            trace_id = (drawn.trace_hi << 64) | drawn.trace_lo
        else:
            trace_id = RNG.getrandbits(128) or 1
        self.ids = RootIds(trace_id >> 64, trace_id & _LOW64, RNG.getrandbits(64) or 1)
        self.sampled = sampled
        flags = "01" if sampled else "00"
        self.engine_headers = {
            "traceparent": f"00-{trace_id:032x}-{self.ids.span_id:016x}-{flags}",
            API_PARENT_KEY: "1",
        }
        if self.parent_headers and "tracestate" in self.parent_headers:
            self.engine_headers["tracestate"] = self.parent_headers["tracestate"]
        self.request_ids: list[str] = []
        # vLLM's per-request stats objects (RequestStateStats), read at the end.
        self.engine_stats: list[Any] = []
        self.arrival_time_s = 0.0
        self.handoff_ns: int | None = None
        self.first_body_ns: int | None = None
        self.last_output_ns: int | None = None
        self.end_ns: int | None = None
        self.status_code = 0
        self.stream = False
        self.disconnected = False
        self.exception: str | None = None
        self.chunks = 0
        # The middleware finished with it: a task it left behind (a background
        # response) is no longer its part.
        self.done = False

    # -- hooks of frontend.py ---------------------------------------------------
    def on_engine_request(self, request: Any) -> bool:
        """OutputProcessor.add_request: an engine request of ours (n>1: each
        child). False: the HTTP request is over (a task it left running)."""
        if self.done:
            return False
        request.trace_headers = self.engine_headers
        request_id = str(request.request_id)
        self.request_ids.append(request_id)
        _BY_ENGINE_ID[request_id] = self
        if not self.arrival_time_s:
            self.arrival_time_s = float(getattr(request, "arrival_time", 0.0) or 0.0)
        return True

    def on_engine_state(self, state: Any) -> None:
        """After OutputProcessor.add_request: its request state's stats (None
        where vLLM keeps none), where vLLM stamps the first token's arrival."""
        stats = getattr(state, "stats", None)
        if stats is not None:
            self.engine_stats.append(stats)

    def on_handoff(self) -> None:
        """AsyncLLM.add_request returned: the request went to the engine core."""
        if not self.done:
            self.handoff_ns = time.monotonic_ns()

    # -- ASGI messages ------------------------------------------------------------
    def send(self, message: Message) -> Awaitable[None]:
        """The app's ``send``: notes the message and returns the server's own
        awaitable, so a message costs no coroutine of ours (a stream sends one
        per token) where the server never raises from it (ASGI before 2.4:
        uvicorn says a client is gone through ``receive``)."""
        kind = message.get("type")
        if kind == "http.response.body":
            # One clock read for both: a one-body response's first byte is its last.
            now_ns = 0
            if message.get("body"):
                self.chunks += 1
                if self.first_body_ns is None and self.handoff_ns is not None:
                    self.first_body_ns = now_ns = time.monotonic_ns()
            if not message.get("more_body", False):
                self.end_ns = now_ns or time.monotonic_ns()
        elif kind == "http.response.start":
            self.status_code = int(message.get("status", 0))
            for name, value in message.get("headers", ()):
                if name.lower() == b"content-type":
                    self.stream = value.startswith(_EVENT_STREAM)
        if self._send_raises:
            return self._send_noting_gone(message)
        return self._send(message)

    async def _send_noting_gone(self, message: Message) -> None:
        """An ASGI 2.4 server's ``send`` raises ``OSError`` once the client is
        gone (which Starlette's responses re-raise as ``ClientDisconnect``)."""
        try:
            await self._send(message)
        except OSError:
            if self.end_ns is None or message.get("more_body", False):
                self.disconnected = True
            raise

    async def receive(self) -> Message:
        """The app's ``receive``: a disconnect before the response's end marks
        the request (uvicorn, ASGI 2.3, tells the app so)."""
        message = await self._receive()
        if message.get("type") == "http.disconnect" and self.end_ns is None:
            self.disconnected = True
        return message

    def record(self, now_ns: int) -> ApiJourney:
        return ApiJourney(
            ids=self.ids,
            parent_headers=self.parent_headers,
            server_kind=self.server_kind,
            head_sampled=self.sampled,
            method=self.method,
            path=self.path,
            stream=self.stream,
            disconnected=self.disconnected,
            status_code=self.status_code,
            exception=self.exception,
            request_ids=self.request_ids,
            receipt_mono_ns=self.receipt_ns,
            end_mono_ns=self.end_ns if self.end_ns is not None else now_ns,
            responded=self.end_ns is not None,
            arrival_time_s=self.arrival_time_s,
            handoff_mono_ns=self.handoff_ns,
            first_body_mono_ns=self.first_body_ns,
            last_output_mono_ns=self.last_output_ns,
            chunks=self.chunks,
            first_token_unix_ns=first_token_unix_ns(self.engine_stats),
        )


def first_token_unix_ns(engine_stats: list[Any]) -> int | None:
    """When the engine's first token reached this process, epoch ns: vLLM's
    stamp of it (``RequestStateStats.arrival_time + first_token_latency``, both
    its wall clock, the figure of its own ``time_to_first_token``; fields as in
    vLLM 0.30-0.33), the earliest over the request's engine requests. None:
    no first token (0.0 is vLLM's "not yet")."""
    best = 0.0
    for stats in engine_stats:
        latency = getattr(stats, "first_token_latency", 0.0)
        arrival = getattr(stats, "arrival_time", 0.0)
        if latency > 0.0 and arrival > 0.0 and (not best or arrival + latency < best):
            best = arrival + latency
    return int(best * 1e9) if best else None


def on_last_output(request_id: str) -> None:
    """OutputProcessor._finish_request: the engine's last output for a request."""
    req = _BY_ENGINE_ID.pop(request_id, None)
    if req is not None:
        req.last_output_ns = time.monotonic_ns()


def _traced(req: ApiRequest) -> bool:
    """Reached the engine, or a POST turned away with an error before it did."""
    if req.request_ids:
        return True
    return req.method == "POST" and (req.status_code >= 400 or req.exception is not None)


async def _over_send(message: Message) -> None:
    # As uvicorn answers a message after the response completed.
    raise RuntimeError(f"Unexpected ASGI message {message.get('type')!r} after the response")


async def _over_receive() -> Message:
    return {"type": "http.disconnect"}  # ASGI: what receive says once the response is sent


def _finish(req: ApiRequest) -> None:
    now_ns = _LAST_END_NS[0] = time.monotonic_ns()  # sampled or not: traffic
    req.done = True
    # The server's send and receive are the connection's: a task that outlives
    # the request (vLLM's output handler copies the context of the request that
    # started it) must not keep that connection's objects alive through it.
    req._send, req._receive = _over_send, _over_receive
    for request_id in req.request_ids:  # aborted: their last output never came
        if _BY_ENGINE_ID.get(request_id) is req:
            del _BY_ENGINE_ID[request_id]
    if not _traced(req):
        return
    if not req.sampled:
        end = req.end_ns if req.end_ns is not None else now_ns
        # As export/api_spans.failed: raised, 5xx, or turned away before the engine.
        error = req.exception is not None or req.status_code >= 500
        error = error or (req.status_code >= 400 and not req.request_ids)
        if not _STATE.tail.keeps(error, req.disconnected, 0, end - req.receipt_ns):
            return
    target = pipeline()
    if target is not None:
        target.submit(req.record(now_ns))
        _hand_on(target, now_ns)


def _hand_on(target: JourneyPipeline, now_ns: int) -> None:
    """Event loop: hand the queue to the exporter if the last hand-off is old
    enough, else once a timer fires (so the last requests of a burst leave
    within ``PUBLISH_INTERVAL_NS`` too)."""
    target.publish_due(now_ns)
    _arm(target, now_ns)


def _arm(target: JourneyPipeline, now_ns: int) -> None:
    """One timer on this loop while anything is left to hand on."""
    if not target.left or not target.sink.takes_offers:
        return  # (thread mode: the drain thread builds the spans, every interval)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no loop here: the drain thread's backstop hands it on
        return
    if _TIMER and _TIMER[0][0] is loop:
        return  # one is pending (a timer of a loop that has closed never fires)
    _TIMER[:] = [(loop, loop.call_later(PUBLISH_INTERVAL_NS / 1e9, _publish_now), now_ns)]


def _publish_now() -> None:
    """The timer: hand on what is left. No request ended since it was set: the
    last call for a while (``idle``: what the pipe cannot take now is the drain
    thread's). Else the event loop keeps it: the timer is set again while
    anything is left (a full pipe: the exporter behind)."""
    set_ns = _TIMER[0][2] if _TIMER else 0
    _TIMER.clear()
    target = pipeline()  # this process's pipeline now (a test may have replaced it)
    try:
        if target is not None:
            now_ns = time.monotonic_ns()
            idle = _LAST_END_NS[0] <= set_ns
            target.publish_due(now_ns, force=True, idle=idle)
            if not idle:
                _arm(target, now_ns)
    except Exception:
        _fail("API-server hand-off")


class JourneyMiddleware:
    """Pure ASGI middleware, outermost of vLLM's (``frontend.py`` inserts it).

    Its own cost per request: a few clock reads, the record, and the request's
    own ``send`` (no coroutine per message; a clock read at the first body and
    the last) and ``receive`` in place of the server's. On ``lifespan.shutdown``
    it flushes this process's pipeline (the API server's exit does not run
    atexit where it is a multiprocessing child); ``lifespan.startup`` starts it.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind == "lifespan":
            return await self.app(scope, _lifespan(scope, receive), send)
        if kind != "http" or not (_STATE.enabled and _STATE.config.api_spans):
            return await self.app(scope, receive, send)
        try:
            req = ApiRequest(scope, time.monotonic_ns(), receive, send)
        except Exception:
            _fail("API-server middleware")
            return await self.app(scope, receive, send)
        token = _CURRENT.set(req)
        try:
            await self.app(scope, req.receive, req.send)
        except BaseException as exc:
            if not req.disconnected:  # else the app's way of stopping for it
                req.exception = type(exc).__name__
            raise
        finally:
            _CURRENT.reset(token)
            try:
                _finish(req)
            except Exception:
                _fail("API-server middleware")


def _lifespan(scope: Scope, receive: Receive) -> Receive:
    """The app's start-up starts this process's pipeline (the exporter process:
    before the first request, not on it); its shutdown flushes it."""

    async def receive_() -> Message:
        message = await receive()
        kind = message.get("type")
        state = getattr(scope.get("app"), "state", None)
        if kind == "lifespan.startup" and _STATE.enabled and _STATE.config.api_spans:
            if getattr(state, "vllm_config", None) is not None:
                try:
                    _pipeline_for(state, engine=False)
                except Exception:
                    _fail("API-server start-up")
        elif kind == "lifespan.shutdown":
            target = pipeline()
            if target is not None:
                try:
                    target.flush(_STATE.config.shutdown_timeout_s)
                except Exception:  # never in the way of vLLM's shutdown
                    logger.debug("journey-otel: API-server flush failed", exc_info=True)
        return message

    return receive_
