"""Send trace files to an OTLP endpoint (gRPC or HTTP/protobuf), unchanged.

Each line of an OTLP/JSON file becomes the protobuf request it encodes and is
sent as is: same ids, times, attributes and resources, so a file can be loaded
into any backend later.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from urllib.parse import urlparse

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from vllm_journey_otel.export.otlp_json import json_to_request

PROTOCOLS = ("grpc", "http/protobuf")


def _grpc_sender(
    endpoint: str, timeout_s: float
) -> tuple[Callable[[object], None], Callable[[], None]]:
    u = urlparse(endpoint if "://" in endpoint else "http://" + endpoint)
    target = f"{u.hostname}:{u.port or 4317}"
    channel = (
        grpc.secure_channel(target, grpc.ssl_channel_credentials())
        if u.scheme == "https"
        else grpc.insecure_channel(target)
    )
    stub = trace_service_pb2_grpc.TraceServiceStub(channel)  # type: ignore[no-untyped-call]

    def send(request: object) -> None:
        stub.Export(request, timeout=timeout_s)

    return send, channel.close


def _http_sender(
    endpoint: str, timeout_s: float
) -> tuple[Callable[[object], None], Callable[[], None]]:
    url = (
        endpoint
        if urlparse(endpoint).path not in ("", "/")
        else endpoint.rstrip("/") + "/v1/traces"
    )

    def send(request: object) -> None:
        body = request.SerializeToString()  # type: ignore[attr-defined]
        req = urllib.request.Request(
            url, data=body, headers={"Content-Type": "application/x-protobuf"}, method="POST"
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read()

    return send, lambda: None


def replay(
    paths: Iterable[str | Path],
    endpoint: str,
    protocol: str = "grpc",
    timeout_s: float = 10.0,
    on_error: Callable[[str], None] | None = None,
) -> tuple[int, int]:
    """Send every line; returns (requests sent, spans sent). Raises on transport errors."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, not {protocol!r}")
    send, close = (_grpc_sender if protocol == "grpc" else _http_sender)(endpoint, timeout_s)
    sent = spans = 0
    try:
        for path in paths:
            with open(path, encoding="utf-8", errors="replace") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        request = json_to_request(line)
                    except Exception as e:
                        if on_error is not None:
                            on_error(f"{path}:{lineno}: not an OTLP/JSON trace line ({e})")
                        continue
                    send(request)
                    sent += 1
                    spans += sum(
                        len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans
                    )
    finally:
        close()
    return sent, spans
