"""A real OTLP trace receiver for tests, gRPC and HTTP, on 127.0.0.1.

Built on opentelemetry-proto's generated service and messages, so tests can
assert on exactly what went over the wire (resource attributes, span kinds,
parent ids, timestamps).
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span


def value(v: AnyValue) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


@dataclass
class ReceivedSpan:
    span: Span
    resource: dict[str, object]

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def attrs(self) -> dict[str, object]:
        return {kv.key: value(kv.value) for kv in self.span.attributes}


class Receiver:
    """Collects ExportTraceServiceRequests from either transport."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.lock = threading.Lock()
        self.grpc_port = 0
        self.headers: list[dict[str, str]] = []  # request headers / gRPC metadata
        self.delay_s = 0.0  # a slow backend: every gRPC answer comes this much later
        self.http_port = 0
        self._grpc: grpc.Server | None = None
        self._http: ThreadingHTTPServer | None = None

    def add(self, req: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            self.requests.append(req)

    def spans(self) -> list[ReceivedSpan]:
        out = []
        with self.lock:
            for req in self.requests:
                for rs in req.resource_spans:
                    res = {kv.key: value(kv.value) for kv in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        out.extend(ReceivedSpan(s, res) for s in ss.spans)
        return out

    def start_grpc(self, port: int = 0, tls: tuple[bytes, bytes] | None = None) -> int:
        """Serve OTLP/gRPC on ``port`` (0: one ``services.free_port`` chooses);
        ``self.delay_s`` delays every answer.

        ``tls``: (certificate PEM, key PEM) to serve over TLS instead.

        Not the kernel's choice: a port from the ephemeral range, free while
        the receiver is stopped and restarted on it, could meanwhile become a
        connection's source port (the exporter's, connecting to it).
        """
        from services import free_port

        port = port or free_port()
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # type: ignore[no-untyped-def]
                if receiver.delay_s:
                    time.sleep(receiver.delay_s)
                receiver.headers.append(dict(context.invocation_metadata()))
                receiver.add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
        address = f"127.0.0.1:{port}"
        if tls is None:
            self.grpc_port = server.add_insecure_port(address)
        else:
            creds = grpc.ssl_server_credentials([(tls[1], tls[0])])
            self.grpc_port = server.add_secure_port(address, creds)
        server.start()
        self._grpc = server
        return self.grpc_port

    def start_http(self, tls: tuple[Path, Path] | None = None) -> int:
        """Serve OTLP/HTTP; ``tls``: (certificate file, key file) to serve HTTPS."""
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                req = trace_service_pb2.ExportTraceServiceRequest()
                req.ParseFromString(body)
                receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                receiver.add(req)
                payload = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(tls[0]), str(tls[1]))
            server.socket = ctx.wrap_socket(server.socket, server_side=True)
        self.http_port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self._http = server
        return self.http_port

    def stop_grpc(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=None).wait(5)
            self._grpc = None

    def stop(self) -> None:
        self.stop_grpc()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()


def running_receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.start_grpc()
    r.start_http()
    try:
        yield r
    finally:
        r.stop()


class _Ctx:
    def __init__(self, trace_id: int, span_id: int, remote: bool = False) -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.is_remote = remote


class _Kind:
    def __init__(self, name: str) -> None:
        self.name = name


class WireSpan:
    """A received protobuf span with the ReadableSpan attributes tests/trees.py reads."""

    _KINDS: ClassVar[dict[int, str]] = {
        1: "INTERNAL",
        2: "SERVER",
        3: "CLIENT",
        4: "PRODUCER",
        5: "CONSUMER",
    }

    def __init__(self, r: ReceivedSpan) -> None:
        s = r.span
        self.name = s.name
        self.attributes = r.attrs
        self.resource = r.resource
        self.start_time = s.start_time_unix_nano
        self.end_time = s.end_time_unix_nano
        self.context = _Ctx(int.from_bytes(s.trace_id, "big"), int.from_bytes(s.span_id, "big"))
        self.parent = (
            _Ctx(self.context.trace_id, int.from_bytes(s.parent_span_id, "big"))
            if s.parent_span_id
            else None
        )
        self.kind = _Kind(self._KINDS.get(s.kind, "UNSPECIFIED"))
        self.status_code = s.status.code


def wire_spans(receiver: Receiver) -> list[WireSpan]:
    return [WireSpan(r) for r in receiver.spans()]
