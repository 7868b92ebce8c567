"""The SDK's OTLP span exporters (gRPC and HTTP/protobuf), fed our encoder's bytes.

Where: built once in the exporter process (or the engine core in ``thread``
mode) by ``exporters.build_exporters``; ``export`` runs on the export stage's
thread. Times: none of ours (the SDK's timeouts are its own).

Each class is the SDK's exporter, constructed exactly as the SDK's (the same
arguments, the same OTEL_EXPORTER_OTLP_* variables: endpoint, headers, TLS,
compression, timeout), with its transport, retries and self-metrics; only the
OTLP encoding is ours (``otlp_encoder.py``: the same message, a quarter of the
CPU). Where the SDK's internals differ from those checked below, the class
falls back to the SDK's own ``export`` and says so once in the log.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as SdkGrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as SdkHttpSpanExporter,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.semconv.attributes.http_attributes import HTTP_RESPONSE_STATUS_CODE

from vllm_journey_otel.export.otlp_encoder import OtlpEncoder
from vllm_journey_otel.log import logger


class Encoded:
    """A batch already encoded: the request's bytes and its span count."""

    __slots__ = ("count", "payload")

    def __init__(self, payload: bytes, count: int) -> None:
        self.payload = payload
        self.count = count

    def __len__(self) -> int:  # the SDK's _count_data: len(data)
        return self.count


class _TakesEncoded:
    """What both exporters add: spans arrive as ReadableSpans or, once
    :meth:`take_encoded` said yes, as Span fields our span builder encoded
    (``span_builder.SpanBuilder.encode``), all of one resource and scope."""

    _encoder: OtlpEncoder
    _fast: bool
    _wrapping: tuple[Resource, InstrumentationScope] | None = None

    def take_encoded(self, resource: Resource, scope: InstrumentationScope) -> bool:
        """Whether this exporter takes encoded spans (of this resource and scope) from now on."""
        if self._fast:
            self._wrapping = (resource, scope)
        return self._fast

    def _payload(self, spans: Sequence[Any]) -> bytes:
        if spans and isinstance(spans[0], bytes):
            if self._wrapping is None:
                raise TypeError("encoded spans given to an exporter that did not take them")
            return self._encoder.wrap(*self._wrapping, spans)
        return self._encoder.encode(spans)


def _fallback(exporter: object, missing: str) -> None:
    logger.info(
        "journey-otel exporter: %s lacks %s (checked against opentelemetry-exporter-otlp "
        "1.45); encoding with the SDK's own encoder",
        type(exporter).__mro__[1].__module__,
        missing,
    )


# The gRPC exporter's attributes used below (opentelemetry-exporter-otlp-proto-grpc
# 1.45: OTLPExporterMixin keeps its stub factory in ``_stub``, calls it on
# ``_channel`` in ``_initialize_channel_and_stub``, at start and again when an
# export meets UNAVAILABLE, and ``_export`` calls ``_client.Export``).
_GRPC_STUB_PARTS = ("_stub", "_channel", "_client", "_initialize_channel_and_stub")
_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _request_bytes(request: bytes | ExportTraceServiceRequest) -> bytes:
    """gRPC's request serializer: our bytes as they are, a message serialized."""
    if isinstance(request, bytes):
        return request
    serialized: bytes = request.SerializeToString()
    return serialized


class _BytesTraceStub:
    """The trace service's stub (``TraceServiceStub``: the same method, the same
    response) whose request is sent as given when it is already bytes."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.Export = channel.unary_unary(
            _EXPORT_METHOD,
            request_serializer=_request_bytes,
            response_deserializer=ExportTraceServiceResponse.FromString,
        )


class GrpcSpanExporter(_TakesEncoded, SdkGrpcSpanExporter):
    """OTLP/gRPC. The SDK's ``_export`` (opentelemetry-exporter-otlp-proto-grpc
    1.45: retries with backoff, channel re-creation, self-metrics) sends what
    ``_translate_data`` returns: our bytes, through a stub whose serializer
    passes bytes through (the SDK's would want the message, which would cost a
    parse and a serialization of every batch). Where the SDK keeps its stub
    elsewhere, our bytes are parsed into the message instead."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._encoder = OtlpEncoder()
        self._fast = callable(getattr(super(), "_export", None))
        if not self._fast:
            _fallback(self, "_export")
        if self._fast and all(hasattr(self, n) for n in _GRPC_STUB_PARTS):
            # The SDK re-creates its client from _stub when it re-creates the channel.
            self._stub = _BytesTraceStub
            self._client = _BytesTraceStub(self._channel)  # type: ignore[assignment]

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not self._fast:
            return super().export(spans)
        return self._export(Encoded(self._payload(spans), len(spans)))  # type: ignore[arg-type]

    def _translate_data(self, data: Any) -> Any:
        if isinstance(data, Encoded):
            # Asked of the client in use, at every export: a client the SDK made
            # some other way (another version) would fail to serialize bytes.
            if isinstance(getattr(self, "_client", None), _BytesTraceStub):
                return data.payload
            return ExportTraceServiceRequest.FromString(data.payload)
        return super()._translate_data(data)


# The HTTP exporter's attributes that export() below uses
# (opentelemetry-exporter-otlp-proto-http 1.45: OTLPSpanExporter.export).
_HTTP_PARTS = ("_shutdown", "_metrics", "_max_request_size", "_client")


class HttpSpanExporter(_TakesEncoded, SdkHttpSpanExporter):
    """OTLP/HTTP with protobuf. The SDK's ``export`` (1.45) encodes, checks the
    request's size, and posts through its client (compression, headers, TLS,
    retries); this is that method with our bytes in place of ``encode_spans``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._encoder = OtlpEncoder()
        missing = [name for name in _HTTP_PARTS if not hasattr(self, name)]
        self._fast = not missing
        if missing:
            _fallback(self, ", ".join(missing))

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not self._fast:
            return super().export(spans)
        if self._shutdown:
            logger.warning("journey-otel exporter: OTLP/HTTP exporter already shut down")
            return SpanExportResult.FAILURE
        with self._metrics.export_operation(len(spans)) as result:
            try:
                data = self._payload(spans)
            except Exception as error:  # as the SDK's: a batch that cannot be encoded fails
                logger.error("journey-otel exporter: could not encode a span batch: %s", error)
                result.error = error
                return SpanExportResult.FAILURE
            if 0 < self._max_request_size < len(data):
                logger.warning(
                    "journey-otel exporter: dropping a span batch of %d bytes: over the "
                    "exporter's max_request_size, %d bytes",
                    len(data),
                    self._max_request_size,
                )
                result.error = ValueError("request over max_request_size")
                return SpanExportResult.FAILURE
            sent = self._client.export(data)
            if not sent.success:
                result.error = sent.error
                if sent.status_code is not None:
                    result.error_attrs = {HTTP_RESPONSE_STATUS_CODE: sent.status_code}
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS


# The SDK's class, as its entry point loads it -> ours.
FAST_EXPORTERS: dict[type[SpanExporter], type[SpanExporter]] = {
    SdkGrpcSpanExporter: GrpcSpanExporter,
    SdkHttpSpanExporter: HttpSpanExporter,
}
