"""What each part of the API-server spans' work on the event loop costs, per request.

``api_loop_cost.py`` reads the whole (our middleware and hooks in a real
FastAPI app, against the same app without them); this one takes it apart, in
one process, each part timed alone on this process's event loop thread
(``time.perf_counter``, the best of REPEATS repeats of N calls):

* ``receipt``: the request's object (``ApiRequest``: the parent's lookup, the
  head-sampling decision, the span's ids, the engine's traceparent), and the
  parent's lookup and the traceparent's formatting alone;
* ``stream``: the 11 ASGI messages of an 8-token event stream (start, 9 bodies,
  the last) sent through the middleware's ``send``, against the server's own
  ``send`` awaited directly;
* ``end``: a finished request's end (``_finish``: its record, the queue, the
  hand-on to this process's pipeline, which writes to a real exporter
  process with ``OTEL_TRACES_EXPORTER=none``), as the difference between
  building and finishing requests and only building them; the pipeline is
  flushed between repeats, untimed, so that none is dropped;
* ``tracked_objects``: what the garbage collector tracks per request in
  flight, 48 event streams of a real FastAPI app held open at once (through
  ASGI, as ``api_loop_cost.py`` drives it), with our middleware and without:
  what a request adds to the objects whose count makes the collector run,
  and which (``gc.get_objects()`` by type, after a collection).

    .venv/bin/python benchmarks/api_parts_cost.py [N] [REPEATS]

Clock: ``time.perf_counter`` (wall time of a loop that never waits).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import time
import timeit
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI, Request  # module level: the route's annotations name them
from fastapi.responses import StreamingResponse

os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # api_loop_cost

HEADERS = [  # what the OpenAI Python client sends
    (b"host", b"127.0.0.1:8000"), (b"accept-encoding", b"gzip, deflate"),
    (b"connection", b"keep-alive"), (b"accept", b"application/json"),
    (b"content-type", b"application/json"), (b"user-agent", b"AsyncOpenAI/Python 1.0"),
    (b"x-stainless-lang", b"python"), (b"x-stainless-os", b"Linux"),
    (b"authorization", b"Bearer x"), (b"content-length", b"120"),
]  # fmt: skip
SCOPE = {
    "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
    "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
    "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
    "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000), "headers": HEADERS,
}  # fmt: skip
START = {"type": "http.response.start", "status": 200,
         "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]}  # fmt: skip
BODY = {"type": "http.response.body", "body": b'data: {"x": 1}\n\n', "more_body": True}
LAST = {"type": "http.response.body", "body": b"", "more_body": False}
STREAM = [START] + [BODY] * 9 + [LAST]


async def receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


async def send(message: dict[str, Any]) -> None:
    pass


IN_FLIGHT = 48  # event streams held open at once


async def tracked_per_request(
    traced: bool, in_flight: int = IN_FLIGHT
) -> tuple[float, Counter[str]]:
    """Objects the collector tracks per request while ``in_flight`` event
    streams are held open (after their first chunk), and their types."""
    from api_loop_cost import call

    from vllm_journey_otel.engine import api_server
    from vllm_journey_otel.engine.frontend import install_middleware
    from vllm_journey_otel.engine.state import _STATE

    app, gate, ids = FastAPI(), asyncio.Event(), iter(range(10**9))
    held = [0]  # streams waiting at the gate

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        await request.json()
        rid = f"chatcmpl-{next(ids)}"
        api = api_server.current()
        if api is not None:  # as vLLM's wrappers of frontend.py call them
            api.on_engine_request(SimpleNamespace(request_id=rid, arrival_time=time.time()))
            api.on_handoff()

        async def events() -> Any:
            yield "data: 1\n\n"
            held[0] += 1
            await gate.wait()
            api_server.on_last_output(rid)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    if traced:
        install_middleware(app)
    else:  # built now, without ours
        _STATE.enabled = False
        app.middleware_stack = app.build_middleware_stack()
        _STATE.enabled = True
    counts: list[tuple[int, Counter[str]]] = []
    for n in (4, in_flight):  # the first: warm-up (the app's lazy set-up)
        gate.clear()
        held[0] = 0
        gc.collect()
        before = Counter(type(o).__name__ for o in gc.get_objects())
        tasks = [asyncio.create_task(call(app, "/v1/chat/completions")) for _ in range(n)]
        while held[0] < n:  # every stream open, its first chunk sent
            ended = [t for t in tasks if t.done()]
            if ended:  # a request that did not stream: say why, do not wait for it
                raise SystemExit(f"a request ended before its stream was held: {ended[0]!r}")
            await asyncio.sleep(0)
        gc.collect()
        during = Counter(type(o).__name__ for o in gc.get_objects())
        gate.set()
        await asyncio.gather(*tasks)
        counts.append((n, during - before))
    n, added = counts[-1]
    return sum(added.values()) / n, added


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 50_000
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    from vllm_journey_otel.config import Config
    from vllm_journey_otel.engine import api_server, hooks
    from vllm_journey_otel.engine.handoff import _pipeline_for

    assert hooks.install(Config(enabled=True))
    owner = SimpleNamespace(
        vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(served_model_name="bench", model="bench"),
            parallel_config=SimpleNamespace(data_parallel_rank=0),
        )
    )
    pipeline = _pipeline_for(owner)
    ids = iter(range(10**12))

    def best(stmt: Any, number: int = n) -> float:
        # The collector on, as in the other parts (timeit turns it off by default).
        runs = timeit.repeat(stmt, "gc.enable()", number=number, repeat=repeats, globals=globals())
        return min(runs) / number * 1e6

    def finished() -> api_server.ApiRequest:
        """A request as it ends: its engine request, hand-off and last output seen."""
        req = api_server.ApiRequest(SCOPE, time.monotonic_ns(), receive, send)
        rid = f"chatcmpl-{next(ids)}"
        req.on_engine_request(SimpleNamespace(request_id=rid, arrival_time=time.time()))
        req.on_handoff()
        api_server.on_last_output(rid)
        req.end_ns = time.monotonic_ns()
        return req

    async def stream(through: Any) -> None:
        for message in STREAM:
            await through(message)

    async def loop_parts() -> dict[str, float]:
        out: dict[str, list[float]] = {"direct": [], "ours": [], "build": [], "build+end": []}
        for _ in range(repeats):
            for label in ("direct", "ours"):
                t0 = time.perf_counter()
                for _ in range(n // 10):
                    if label == "ours":
                        req = api_server.ApiRequest(SCOPE, 1, receive, send)
                        req.handoff_ns = 1
                        await stream(req.send)
                    else:
                        await stream(send)
                out[label].append((time.perf_counter() - t0) / (n // 10) * 1e6)
            for label in ("build", "build+end"):
                t0 = time.perf_counter()
                for _ in range(n // 10):
                    req = finished()
                    if label == "build+end":
                        api_server._finish(req)
                out[label].append((time.perf_counter() - t0) / (n // 10) * 1e6)
            pipeline.flush(30)  # untimed: the next repeat starts with an empty queue
        return {k: min(v) for k, v in out.items()}

    receipt = best(lambda: api_server.ApiRequest(SCOPE, 1, receive, send))
    parent = best(lambda: api_server._parent(SCOPE))
    trace_id, span_id = (1 << 127) | 12345, (1 << 63) | 678
    traceparent = best(lambda: f"00-{trace_id:032x}-{span_id:016x}-01")
    parts = asyncio.run(loop_parts())
    tracked = {k: asyncio.run(tracked_per_request(k == "on")) for k in ("off", "on")}
    added = tracked["on"][1] - tracked["off"][1]
    pipeline.flush(10)
    print(json.dumps({
        "calls_per_repeat": n, "repeats": repeats,
        "receipt_us (ApiRequest)": round(receipt, 3),
        "  of which the parent's lookup": round(parent, 3),
        "  of which the engine's traceparent": round(traceparent, 3),
        "stream_of_11_messages_us": {
            "direct": round(parts["direct"], 3),
            "through ours, receipt included": round(parts["ours"], 3),
            "ours - direct - receipt": round(parts["ours"] - parts["direct"] - receipt, 3),
        },
        "end_us (_finish: record, queue, hand-on)": round(parts["build+end"] - parts["build"], 3),
        "tracked_objects_per_request_in_flight": {
            "off": round(tracked["off"][0], 1),
            "on": round(tracked["on"][0], 1),
            "ours, by type (types with more)": {
                k: round(v / IN_FLIGHT, 2) for k, v in added.most_common(12)
            },
        },
        "records_lost": pipeline.losses.by_reason(),
    }, indent=2))  # fmt: skip
    hooks.uninstall()


if __name__ == "__main__":
    main()
