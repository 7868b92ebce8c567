"""OTLP JSON encoding of spans, and reading it back.

The format is the OTLP/JSON protobuf mapping the Collector's ``file`` exporter
writes and its ``otlpjsonfile`` receiver reads: one ``ExportTraceServiceRequest``
per line, lowerCamelCase field names, trace and span ids as hex strings (not the
protobuf JSON mapping's base64), enums as integers, 64-bit integers as decimal
strings. The protobuf message itself comes from the SDK's own OTLP encoder, so
the JSON carries exactly what the OTLP exporters would send.

Pure functions; no vLLM.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any

from google.protobuf import json_format  # type: ignore[import-untyped]
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan

_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _hex_ids(obj: Any) -> None:
    """Rewrite base64 ids to hex in place (spans and their links)."""
    for key in _ID_KEYS:
        value = obj.get(key)
        if value:
            obj[key] = base64.b64decode(value).hex()
    for link in obj.get("links", ()):
        _hex_ids(link)


def _b64_ids(obj: Any) -> None:
    for key in _ID_KEYS:
        value = obj.get(key)
        if value:
            obj[key] = base64.b64encode(bytes.fromhex(value)).decode()
    for link in obj.get("links", ()):
        _b64_ids(link)


def request_to_json(request: ExportTraceServiceRequest) -> str:
    """One compact OTLP/JSON line (no newline) for a protobuf request."""
    doc = json_format.MessageToDict(request, use_integers_for_enums=True)
    for rs in doc.get("resourceSpans", ()):
        for ss in rs.get("scopeSpans", ()):
            for span in ss.get("spans", ()):
                _hex_ids(span)
    return json.dumps(doc, separators=(",", ":"))


def spans_to_json(spans: Sequence[ReadableSpan]) -> str:
    """One OTLP/JSON line for SDK spans, through the SDK's OTLP protobuf encoder."""
    return request_to_json(encode_spans(spans))


def json_to_request(line: str) -> ExportTraceServiceRequest:
    """Parse one OTLP/JSON line back into the protobuf request (for replay)."""
    doc = json.loads(line)
    for rs in doc.get("resourceSpans", ()):
        for ss in rs.get("scopeSpans", ()):
            for span in ss.get("spans", ()):
                _b64_ids(span)
    request = ExportTraceServiceRequest()
    json_format.ParseDict(doc, request, ignore_unknown_fields=True)
    return request


def value(v: dict[str, Any]) -> Any:
    """The Python value of an OTLP/JSON ``AnyValue``."""
    if "stringValue" in v:
        return v["stringValue"]
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "arrayValue" in v:
        return tuple(value(x) for x in v["arrayValue"].get("values", ()))
    return None
