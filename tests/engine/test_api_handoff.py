"""The API server's records leave on its own event loop: a real FastAPI app with
our middleware, called through ASGI in-process, its pipeline writing to a real
pipe. No thread of ours wakes in the API server for them (a nice-19 thread that
wakes takes the event loop's GIL, and on a busy CPU the loop waits for it)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import os
import select
import signal
import time
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from conftest import requires_vllm
from vllm_journey_otel.config import Config
from vllm_journey_otel.engine import api_server, hooks
from vllm_journey_otel.engine.frontend import install_middleware
from vllm_journey_otel.engine.pipe_sink import PipeSink
from vllm_journey_otel.engine.pipeline import PUBLISH_INTERVAL_NS, JourneyPipeline
from vllm_journey_otel.engine.state import _STATE
from vllm_journey_otel.journey import ApiJourney
from vllm_journey_otel.wire import read_frames


@pytest.fixture
def served() -> Iterator[tuple[Any, JourneyPipeline, int]]:
    """The plugin on, this process's pipeline on a pipe, a traced app."""
    assert hooks.install(Config(enabled=True))
    r, w = os.pipe()
    # The drain thread would wake only after an hour: whatever arrives was
    # handed on by the event loop.
    pipeline = JourneyPipeline(PipeSink(w), maintain_s=3600.0)
    with _STATE.lock:
        _STATE.pipeline, _STATE.pipeline_pid = pipeline, os.getpid()
    app = FastAPI()
    ids = iter(range(10**6))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        await request.json()
        request_id = f"cmpl-{next(ids)}"
        api = api_server.current()
        assert api is not None
        api.on_engine_request(SimpleNamespace(request_id=request_id, arrival_time=time.time()))
        api.on_handoff()
        api_server.on_last_output(request_id)
        return JSONResponse({"id": request_id})

    install_middleware(app)
    try:
        yield app, pipeline, r
    finally:
        hooks.uninstall()
        with contextlib.suppress(OSError):
            os.close(r)


def _records(fd: int) -> list[ApiJourney]:
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 1 << 20):
            data += chunk
    return [j for f in read_frames(io.BytesIO(data)) for j in f.journeys]


def test_event_loop_hands_on_every_record_the_burst_tail_by_its_timer(served) -> None:  # type: ignore[no-untyped-def]
    import httpx

    app, pipeline, r = served

    async def burst() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            replies = await asyncio.gather(
                *(client.post("/v1/completions", json={"prompt": f"p{i}"}) for i in range(40))
            )
            assert [reply.status_code for reply in replies] == [200] * 40, replies[0].text
            # The loop stays up for two hand-off intervals: the timer's turn.
            await asyncio.sleep(2 * PUBLISH_INTERVAL_NS / 1e9)

    asyncio.run(burst())
    got = _records(r)
    assert sorted(j.request_ids[0] for j in got) == sorted(f"cmpl-{i}" for i in range(40))
    assert pipeline.published == 40 and pipeline.exported == 0 and pipeline.queued == 0


def test_a_full_pipe_is_the_event_loops_to_retry_while_requests_end(served, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The exporter behind (its pipe full): while requests keep ending, the
    event loop retries the hand-off itself (its timer set again while anything
    is left) and the drain thread never wakes (each wake-up takes the loop's
    GIL); once they stop, the timer finds none ended since it was set and
    leaves what is left to the drain thread, which delivers every record."""
    import fcntl

    import httpx

    from vllm_journey_otel.engine.exporter_launch import F_SETPIPE_SZ

    app, pipeline, r = served
    # The timer's interval long against the gaps between two requests' ends
    # here (10 ms, and whatever a loaded machine adds): none finds them idle.
    monkeypatch.setattr(api_server, "PUBLISH_INTERVAL_NS", 300_000_000)
    w = pipeline.sink._fds[0]
    fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    os.write(w, b"\0" * 4096)  # the pipe full
    wakes: list[int] = []
    pipeline.watch(lambda now_ns, room: wakes.append(now_ns) or [])

    async def traffic() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for _ in range(80):  # a request every 10 ms: the timer's turn comes three times
                reply = await client.post("/v1/completions", json={"prompt": "p"})
                assert reply.status_code == 200
                await asyncio.sleep(0.01)
            assert pipeline.queued == 80 and pipeline._declined
            assert wakes == [], f"the drain thread woke {len(wakes)} times while requests ended"
            # No request from now on: the timer's next turn leaves them to the drain thread.
            deadline = time.monotonic() + 10
            while not wakes and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert wakes, "the drain thread was not woken when the requests stopped"

    asyncio.run(traffic())
    assert len(os.read(r, 4096)) == 4096  # the exporter reads: room again
    os.set_blocking(r, False)
    data, deadline = b"", time.monotonic() + 10
    while time.monotonic() < deadline and (pipeline.left or pipeline.exported < 80 or not data):
        with contextlib.suppress(BlockingIOError):
            data += os.read(r, 1 << 16)
        time.sleep(0.01)
    with contextlib.suppress(BlockingIOError):
        data += os.read(r, 1 << 16)  # what the last write left
    got = [j for f in read_frames(io.BytesIO(data)) for j in f.journeys]
    assert sorted(j.request_ids[0] for j in got) == sorted(f"cmpl-{i}" for i in range(80))
    assert pipeline.exported == 80 and pipeline.published == 0


@requires_vllm
def test_the_first_token_is_vllms_stamp_the_earliest_of_the_engine_requests() -> None:
    """Read from vLLM's own RequestStateStats: arrival plus first_token_latency
    (its time_to_first_token); a request that got no token yet (0.0) counts not."""
    from vllm.v1.metrics.stats import RequestStateStats

    none_yet = RequestStateStats(arrival_time=1_700_000_000.5)
    late = RequestStateStats(arrival_time=1_700_000_000.5, first_token_latency=0.25)
    early = RequestStateStats(arrival_time=1_700_000_000.5, first_token_latency=0.125)
    assert api_server.first_token_unix_ns([]) is None
    assert api_server.first_token_unix_ns([none_yet]) is None
    got = api_server.first_token_unix_ns([none_yet, late, early])
    assert got == pytest.approx(1_700_000_000_625_000_000, abs=1_000)


_APP_ERRORS = {"runtime": RuntimeError, "timeout": TimeoutError, "oserror": OSError}


def test_a_client_gone_mid_stream_under_an_asgi_2_4_server_is_a_disconnect(served) -> None:  # type: ignore[no-untyped-def]
    """An ASGI 2.4 server's ``send`` raises OSError once the client is gone
    (uvicorn, ASGI 2.3, says so through ``receive`` instead): the request is
    disconnected mid-response, not an error; an app that fails mid-stream is,
    whatever it raised (a TimeoutError or another OSError of its own too)."""
    from fastapi.responses import StreamingResponse
    from starlette.requests import ClientDisconnect

    app, pipeline, r = served
    ids = iter(range(100))
    kept: list[Any] = []  # requests a task outlives (vLLM's output handler keeps its context)

    @app.get("/stream")
    async def stream(fail: int = -1, error: str = "runtime") -> Any:
        async def chunks() -> Any:
            for i in range(5):
                if i == fail:
                    raise _APP_ERRORS[error]("the app's own failure")
                yield f"data: {i}\n\n"

        api = api_server.current()
        assert api is not None
        kept.append(api)
        api.on_engine_request(SimpleNamespace(request_id=f"s{next(ids)}", arrival_time=1.0))
        return StreamingResponse(chunks(), media_type="text/event-stream")

    sends: list[weakref.ref[Any]] = []

    async def call(query: bytes, raise_at_body: int, spec: str = "2.4") -> BaseException | None:
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": spec},
            "http_version": "1.1", "method": "GET", "scheme": "http", "path": "/stream",
            "raw_path": b"/stream", "query_string": query, "root_path": "",
            "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000), "headers": [],
        }  # fmt: skip
        bodies = 0

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(3600)  # the client never says it left
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal bodies
            if message["type"] == "http.response.body":
                bodies += 1
                if bodies == raise_at_body:
                    raise OSError("the client is gone")

        sends.append(weakref.ref(send))
        try:
            await app(scope, receive, send)
        except BaseException as exc:  # what the app raised is the subject
            return exc
        return None

    cases = {
        "s0": (b"", 3, "2.4"),  # the server's send raises at the third chunk
        "s1": (b"", 0, "2.4"),  # the whole stream is sent
        "s2": (b"fail=2", 0, "2.4"),  # the app raises after two chunks
        "s3": (b"fail=2&error=timeout", 0, "2.4"),
        "s4": (b"fail=2&error=oserror", 0, "2.3"),  # no 2.3 server's send raises
        "s5": (b"fail=2&error=timeout", 0, "2.3"),
    }

    async def run() -> dict[str, BaseException | None]:
        return {k: await call(*args) for k, args in cases.items()}

    raised = asyncio.run(run())
    assert isinstance(raised["s0"], ClientDisconnect) and raised["s1"] is None
    # Starlette re-raises any OSError of a 2.4 stream as ClientDisconnect, the
    # app's own TimeoutError too (s3): our send saw no failure, so the record
    # keeps it as the error that escaped, not as a client gone.
    assert [type(raised[k]) for k in ("s2", "s3", "s4", "s5")] == [
        RuntimeError, ClientDisconnect, OSError, TimeoutError
    ]  # fmt: skip
    pipeline.publish_due(time.monotonic_ns(), force=True)
    got = {j.request_ids[0]: j for j in _records(r)}
    assert sorted(got) == sorted(cases)
    # Gone: the three chunks handed to the server, the last of which it refused.
    assert (got["s0"].disconnected, got["s0"].exception, got["s0"].responded) == (True, None, False)
    assert got["s0"].chunks == 3 and got["s0"].stream
    assert (got["s1"].disconnected, got["s1"].exception, got["s1"].responded) == (False, None, True)
    assert got["s1"].chunks == 5 and got["s1"].first_body_mono_ns is None  # no hand-off stamped
    for key, error in (("s2", "RuntimeError"), ("s3", "ClientDisconnect"), ("s4", "OSError"),
                       ("s5", "TimeoutError")):  # fmt: skip
        assert (got[key].disconnected, got[key].exception) == (False, error), key
        assert got[key].chunks == 2 and not got[key].responded
    # The requests outlive their responses here; the servers' send functions do not.
    assert len(kept) == len(cases)
    raised.clear()  # their tracebacks hold the calls' frames
    gc.collect()
    assert [s() for s in sends] == [None] * len(cases)


def test_a_forked_child_has_no_pipeline_of_its_parent(served) -> None:  # type: ignore[no-untyped-def]
    """``pipeline()`` knows this process's pid without a system call; a forked
    child (vLLM's engine cores, where started by fork) must not take its
    parent's pipeline, whose threads and pipe are the parent's."""
    from vllm_journey_otel.engine.handoff import pipeline as current_pipeline

    _, pipeline, _ = served
    assert current_pipeline() is pipeline
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once, whatever happens
        code = 1
        try:
            os.close(r)
            os.write(w, b"none" if current_pipeline() is None else b"parent's")
            code = 0
        finally:
            os._exit(code)  # never the rest of pytest, nor the parent's atexit
    os.close(w)
    ready: list[int] = []
    try:
        ready, _, _ = select.select([r], [], [], 30)
        assert ready, "the forked child said nothing within 30 s"
        assert os.read(r, 64) == b"none"
    finally:
        os.close(r)
        if not ready:  # stuck (in another library's at-fork handler?): not our wait
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert current_pipeline() is pipeline


def test_the_clients_traceparent_decides_and_parents_the_engines_headers(served) -> None:  # type: ignore[no-untyped-def]
    """A client's valid traceparent is the parent: its trace id goes on to the
    engine, its sampled flag decides (parent-based, the default); an invalid
    one is no parent at all (a trace of our own, sampled)."""
    import httpx

    app, pipeline, r = served
    trace = "0af7651916cd43dd8448eb211c80319c"
    cases = {
        "sampled": f"00-{trace}-b7ad6b7169203331-01",
        "unsampled": f"00-{trace}-b7ad6b7169203331-00",
        "invalid": f"00-{'0' * 32}-b7ad6b7169203331-01",
        # Valid, but past the size the engine keeps: dropped, as no parent.
        "too long": f"00-{trace}-b7ad6b7169203331-00" + " " * 300,
    }

    async def send() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for tp in cases.values():
                reply = await client.post("/v1/completions", json={}, headers={"traceparent": tp})
                assert reply.status_code == 200

    in_order: list[Any] = []
    on_engine_request = api_server.ApiRequest.on_engine_request

    def noting(self, request):  # type: ignore[no-untyped-def]
        in_order.append(self)
        return on_engine_request(self, request)

    api_server.ApiRequest.on_engine_request = noting  # type: ignore[method-assign]
    try:
        asyncio.run(send())
    finally:
        api_server.ApiRequest.on_engine_request = on_engine_request  # type: ignore[method-assign]
    seen = dict(zip(cases, in_order, strict=True))
    for name, flags in (("sampled", "01"), ("unsampled", "00")):
        req = seen[name]
        assert req.parent_headers == {"traceparent": cases[name]}
        assert (req.ids.trace_hi << 64 | req.ids.trace_lo) == int(trace, 16)
        assert req.sampled is (flags == "01") and req.server_kind
        engine_tp = req.engine_headers["traceparent"]
        assert engine_tp == f"00-{trace}-{req.ids.span_id:016x}-{flags}"
    for name in ("invalid", "too long"):  # no parent: a trace of its own, sampled
        own = seen[name]
        assert not own.parent_headers and own.sampled
        assert own.ids.trace_hi << 64 | own.ids.trace_lo != int(trace, 16)
    got = _records(r) if pipeline.flush(5) else []
    assert len(got) == 3 and all(j.head_sampled for j in got)  # unsampled: no record
