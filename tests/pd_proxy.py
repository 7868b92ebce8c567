"""A disaggregated-serving proxy for the tests: each OpenAI request goes to the
prefill instance first (``max_tokens`` 1, ``kv_transfer_params``
``do_remote_decode``), then to the decode instance with the
``kv_transfer_params`` the prefill instance returned, as vLLM's own toy proxy,
llm-d's and Dynamo's do. Unlike vLLM's toy proxy it forwards trace context: it
runs under OpenTelemetry's own FastAPI and httpx instrumentations (PyPI), so its
SERVER span is the parent of both instances' spans, exported over OTLP as
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` says.

Its own process (``python tests/pd_proxy.py --port P --prefill URL --decode
URL``), one event loop; a request header ``x-pd-load: async|sync`` is passed to
the decode instance as ``kv_transfer_params["load"]`` (tests/file_kv_connector.py
then loads that request's KV in its worker's background or before the forward).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

# What vLLM's toy proxy sends the prefill instance (NIXL's keys, no remote yet).
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def make_app(prefill: str, decode: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=300)

    async def forward(request: Request, path: str) -> Response:
        body: dict[str, Any] = await request.json()
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
        first.pop("max_completion_tokens", None)
        first.pop("stream_options", None)
        r = await client.post(prefill + path, json=first)
        if r.status_code != 200:
            return JSONResponse(r.json(), status_code=r.status_code)
        params = dict(r.json().get("kv_transfer_params") or {})
        load = request.headers.get("x-pd-load")
        if load:
            params["load"] = load
        second = {**body, "kv_transfer_params": params}
        if not body.get("stream"):
            r = await client.post(decode + path, json=second)
            return JSONResponse(r.json(), status_code=r.status_code)

        async def chunks() -> AsyncIterator[bytes]:
            async with client.stream("POST", decode + path, json=second) as s:
                async for chunk in s.aiter_bytes():
                    yield chunk

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.get("/health")
    async def health() -> Response:
        return Response(json.dumps({"ok": True}), media_type="application/json")

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    args = ap.parse_args()
    provider = TracerProvider(resource=Resource.create({"service.name": "pd-proxy"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    HTTPXClientInstrumentor().instrument()
    app = make_app(args.prefill, args.decode)
    FastAPIInstrumentor.instrument_app(app)
    try:
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    finally:
        provider.shutdown()  # export what is left at SIGTERM/SIGINT


if __name__ == "__main__":
    main()
