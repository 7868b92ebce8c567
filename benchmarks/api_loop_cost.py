"""What the API-server spans cost the API server's event loop, per request.

A real FastAPI app (the framework vLLM's server is) on one asyncio event loop,
called through ASGI in-process (no sockets, so nothing but the app and our code
runs): a JSON completion route and an event-stream route of CHUNKS chunks,
each calling our hooks as vLLM's AsyncLLM and OutputProcessor wrappers do
(one engine request, its hand-off, its last output). Three apps side by side:

* off: no middleware (API-server spans off);
* off-2: the same again, the A/A control;
* on: our middleware, records handed to this process's pipeline, which the
  event loop writes to a real exporter process itself (OTEL_TRACES_EXPORTER=none).

Blocks of REQUESTS requests per app, CONCURRENCY at a time (all started, then
all awaited: their objects are alive together, as under a busy server),
rotating, ROUNDS times. Printed: CPU
microseconds per request of the event-loop thread (``time.thread_time``) and of
the whole process (the drain thread included: it shares the GIL), median over
the blocks, and the differences on - off and off-2 - off (the resolution); and
the garbage collector's generation-0 collections per 1,000 requests (what an
app allocates is also what makes the collector run: under `vllm serve` a
collection lands on whichever allocation crosses its threshold).
Compare them with the API server's own CPU per request under `vllm serve`
(``benchmarks/serve_short.py``: about 2 ms per 8-token request on this machine)
for the share. What this cannot show is what a thread of ours costs the loop
when it takes the GIL on a saturated CPU: ``benchmarks/gil_wake_cost.py``.

    .venv/bin/python benchmarks/api_loop_cost.py [ROUNDS] [REQUESTS] [CHUNKS] [CONCURRENCY]
        [traceparent] [nogc] [parts]

``traceparent``: every request carries a client's ``traceparent`` (sampled),
as from a traced client: our span's parent, its trace the engine's.
``nogc``: the garbage collector off for the run (``gc.disable()``): what our
code takes without the collections its objects make the collector run.
``parts``: five more apps, our middleware's steps one by one (``part_app``,
inserted where ours is): ``layer`` (a pass-through middleware), ``+receipt``
(the request's object built, the server's own ``send`` and ``receive``
handed on), ``+wrap`` (ours handed on), ``+context`` (the context variable
set: the hooks find the request and do their work), ``+end`` (the request's
end, without the record: no pipeline), then ``on`` adds the record and its
hand-on. Each block's figure is paired with the ``off`` block of its round
(``loop_minus_off_paired_us``: median and quartiles) and each step with the
step before it (``parts_step_paired_us``). Run it with ``nogc`` and many
small blocks, ``100 480 8 48 nogc parts``: the CPU's speed drifts less
within a round than across the run. After each block, untimed, the loop
runs 60 ms on its own (the hand-on timer an ``on`` block left fires there)
and, with ``nogc``, the garbage is collected.
Every response must be a 200 (a route that FastAPI cannot resolve answers
422, and the run stops: a benchmark of error responses measures nothing).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

# At module level: FastAPI resolves the routes' annotations (strings here) in
# this module's globals; a name it cannot resolve makes a route answer 422.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")


def make_app(traced: bool, chunks: int) -> Any:
    from vllm_journey_otel.engine import api_server
    from vllm_journey_otel.engine.frontend import install_middleware

    app = FastAPI()
    counter = iter(range(10**9))

    def engine_request() -> str:
        """What the OutputProcessor.add_request / AsyncLLM.add_request wrappers do."""
        request_id = f"cmpl-{next(counter)}"
        api = api_server.current()
        if api is not None:
            api.on_engine_request(SimpleNamespace(request_id=request_id, arrival_time=time.time()))
            api.on_handoff()
        return request_id

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        request_id = engine_request()
        api_server.on_last_output(request_id)
        return JSONResponse({"id": request_id, "choices": [{"text": "x"}], "n": body["n"]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        await request.json()
        request_id = engine_request()

        async def events() -> Any:
            for i in range(chunks):
                yield f'data: {{"id": "{request_id}", "i": {i}}}\n\n'
            api_server.on_last_output(request_id)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    if traced:
        install_middleware(app)
    else:  # built now, without ours (the installed hook would insert it)
        from vllm_journey_otel.engine.state import _STATE

        _STATE.enabled = False
        app.middleware_stack = app.build_middleware_stack()
        _STATE.enabled = True
    return app


def part_app(chunks: int, steps: int) -> Any:
    """``parts``: our middleware's first ``steps`` steps (JourneyMiddleware.__call__'s,
    without its error handling), inserted where ours is (``install_middleware``:
    first of the app's user middleware): 0 a pass-through layer, 1 the request's
    object, 2 our ``send`` and ``receive``, 3 the context variable (the hooks
    find the request), 4 the request's end (run with no pipeline: ``_PIPELINE_OFF``)."""
    from starlette.middleware import Middleware

    from vllm_journey_otel.engine import api_server
    from vllm_journey_otel.engine.state import _STATE

    class Part:
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http" or not (_STATE.enabled and _STATE.config.api_spans):
                return await self.app(scope, receive, send)
            if steps == 0:
                return await self.app(scope, receive, send)
            req = api_server.ApiRequest(scope, time.monotonic_ns(), receive, send)
            token = api_server._CURRENT.set(req) if steps >= 3 else None
            try:
                if steps >= 2:
                    await self.app(scope, req.receive, req.send)
                else:
                    await self.app(scope, receive, send)
            finally:
                if token is not None:
                    api_server._CURRENT.reset(token)
                if steps >= 4:
                    api_server._finish(req)

    app = make_app(False, chunks)  # built without ours, then rebuilt with the part
    app.user_middleware.insert(0, Middleware(Part))
    _STATE.enabled = False  # (the installed hook would insert ours too)
    app.middleware_stack = app.build_middleware_stack()
    _STATE.enabled = True
    return app


# ``parts``: the apps of part_app's steps, in order (``on`` is the next).
PARTS = ("layer", "+receipt", "+wrap", "+context", "+end")
# The apps whose blocks run with no pipeline in this process (``+end``).
_PIPELINE_OFF = {"+end"}


# A traced client's headers (``traceparent`` on the command line), else none.
CLIENT_HEADERS: list[tuple[bytes, bytes]] = []


async def call(app: Any, path: str) -> None:
    body = json.dumps({"model": "m", "prompt": "hi", "n": 1}).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000),
        "headers": [(b"content-type", b"application/json"), (b"host", b"127.0.0.1"),
                    *CLIENT_HEADERS],
    }  # fmt: skip
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # the client stays: no disconnect
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and message["status"] != 200:
            raise SystemExit(f"{path} answered {message['status']}: the benchmark measures nothing")

    await app(scope, receive, send)


async def block(app: Any, requests: int, concurrency: int) -> tuple[float, float, float]:
    t0, p0 = time.thread_time(), time.process_time()
    g0 = gc.get_stats()[0]["collections"]
    paths = ("/v1/completions", "/v1/chat/completions")
    for first in range(0, requests, concurrency):  # CONCURRENCY requests in flight at once
        n = min(concurrency, requests - first)
        await asyncio.gather(*(call(app, paths[(first + i) % 2]) for i in range(n)))
    return (
        (time.thread_time() - t0) / requests * 1e6,
        (time.process_time() - p0) / requests * 1e6,
        (gc.get_stats()[0]["collections"] - g0) / requests * 1000,
    )


def paired(values: list[float], off: list[float]) -> dict[str, float]:
    """Median and quartiles of each round's figure minus that round's ``off``."""
    diffs = [a - b for a, b in zip(values, off, strict=True)]
    q1, _, q3 = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else (diffs * 3)
    return {"median": round(statistics.median(diffs), 2), "p25": round(q1, 2), "p75": round(q3, 2)}


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    requests = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    chunks = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    concurrency = int(sys.argv[4]) if len(sys.argv) > 4 else 48
    if "nogc" in sys.argv[5:]:  # our work alone, without the collections it causes
        gc.disable()
    if "traceparent" in sys.argv[5:]:
        tp = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        CLIENT_HEADERS.append((b"traceparent", tp))
    from vllm_journey_otel.config import Config
    from vllm_journey_otel.engine import hooks
    from vllm_journey_otel.engine.handoff import _pipeline_for

    assert hooks.install(Config(enabled=True))
    owner = SimpleNamespace(
        vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(served_model_name="bench", model="bench"),
            parallel_config=SimpleNamespace(data_parallel_rank=0),
        )
    )
    pipeline = _pipeline_for(owner)
    from vllm_journey_otel.engine import api_server

    apps = {"off": make_app(False, chunks), "off-2": make_app(False, chunks),
            "on": make_app(True, chunks)}  # fmt: skip
    if "parts" in sys.argv[5:]:
        for steps, name in enumerate(PARTS):
            apps[name] = part_app(chunks, steps)
    own_pipeline = api_server.pipeline
    loop_us: dict[str, list[float]] = {k: [] for k in apps}
    proc_us: dict[str, list[float]] = {k: [] for k in apps}
    gen0: dict[str, list[float]] = {k: [] for k in apps}

    async def run() -> None:
        names = list(apps)
        for name in names:
            api_server.pipeline = (lambda: None) if name in _PIPELINE_OFF else own_pipeline
            await block(apps[name], requests // 4, concurrency)  # warm-up
        for r in range(rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                api_server.pipeline = (lambda: None) if name in _PIPELINE_OFF else own_pipeline
                a, b, c = await block(apps[name], requests, concurrency)
                # Untimed: the hand-on timer a block left fires here, not in
                # the next block (and, with ``nogc``, its cyclic garbage goes).
                await asyncio.sleep(0.06)
                if not gc.isenabled():
                    gc.collect()
                loop_us[name].append(a)
                proc_us[name].append(b)
                gen0[name].append(c)

    asyncio.run(run())
    api_server.pipeline = own_pipeline
    pipeline.flush(10)
    med = {k: round(statistics.median(v), 2) for k, v in loop_us.items()}
    pmed = {k: round(statistics.median(v), 2) for k, v in proc_us.items()}
    print(json.dumps({
        "rounds": rounds, "requests_per_block": requests, "stream_chunks": chunks,
        "concurrency": concurrency,
        "client_traceparent": bool(CLIENT_HEADERS),
        "loop_thread_cpu_us_per_request": med,
        "process_cpu_us_per_request": pmed,
        "loop_on_minus_off_us": round(med["on"] - med["off"], 2),
        "loop_off2_minus_off_us (A/A)": round(med["off-2"] - med["off"], 2),
        "process_on_minus_off_us": round(pmed["on"] - pmed["off"], 2),
        "process_off2_minus_off_us (A/A)": round(pmed["off-2"] - pmed["off"], 2),
        "loop_minus_off_paired_us": {
            k: paired(v, loop_us["off"]) for k, v in loop_us.items() if k != "off"
        },
        # Each step of ``parts`` paired with the step before it (``layer``: with off).
        "parts_step_paired_us": {
            name: paired(loop_us[name], loop_us[before])
            for before, name in zip(("off", *PARTS), (*PARTS, "on"), strict=True)
            if name in loop_us and before in loop_us
        },
        "gc_gen0_collections_per_1000_requests": {
            k: round(statistics.median(v), 1) for k, v in gen0.items()
        },
        "records_handed_on": pipeline.published + pipeline.exported,
        "records_lost": pipeline.losses.by_reason(),
    }, indent=2))  # fmt: skip
    hooks.uninstall()


if __name__ == "__main__":
    main()
