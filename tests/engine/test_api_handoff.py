"""The API server's records leave on its own event loop: a real FastAPI app with
our middleware, called through ASGI in-process, its pipeline writing to a real
pipe. No thread of ours wakes in the API server for them (a nice-19 thread that
wakes takes the event loop's GIL, and on a busy CPU the loop waits for it)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import time
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
