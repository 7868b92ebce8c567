"""The SDK's ReadableSpans to OTLP protobuf bytes, written directly.

Where: the export stage's thread ("journey-otel-export") of the exporter
process (or of the engine core in ``thread`` mode). Times are the spans' own
epoch ns (``start_time``, ``end_time``, event stamps); nothing here reads a clock.

Why: the SDK's encoder (``encode_spans``, opentelemetry-exporter-otlp-proto-common
1.45) builds one protobuf message object per attribute, per value, per event
and per link, and was most of the exporter's CPU (docs/performance.md, "Export
capacity"). This module writes the same message as bytes, field by field, with
the encoded form of each attribute kept for the (key, value) pairs that repeat
(names of models, phases, finish reasons, small counts) and, for a double
(durations: mostly unique), the encoded head of its key. Its output parses to
exactly the message ``encode_spans`` builds for the same spans
(``tests/export/test_otlp_encoder.py`` compares them span for span, for every
kind of span we emit and for values of each type), so what a backend receives
is unchanged; only the exporter's CPU is.

The wire format: https://protobuf.dev/programming-guides/encoding/ ; the
messages: opentelemetry-proto's ``trace/v1/trace.proto`` and ``common/v1/common.proto``
(proto3: a scalar at its default is left out; a message field that is set is
written even when empty, as the SDK sets ``status``).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status
from opentelemetry.trace.span import TraceState

_FIXED64 = struct.Struct("<Q").pack
_FIXED32 = struct.Struct("<I").pack
_DOUBLE = struct.Struct("<d").pack

# SpanKind -> the proto's enum (SPAN_KIND_INTERNAL = 1, ...; SDK value + 1).
_KIND = {kind: bytes((0x30, kind.value + 1)) for kind in SpanKind}  # field 6, varint

# Span.flags / Link.flags: SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK, | IS_REMOTE.
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200

# Encoded attributes kept for the (key, value) pairs that repeat; cleared when
# this many are kept (unique values, such as request ids, must not grow it).
_CACHE_LIMIT = 8192


def _varint(n: int) -> bytes:
    if n < 0:  # int64: two's complement, ten bytes
        n += 1 << 64
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes((i,)) for i in range(0x80)]
_NOTHING_DROPPED = (0, 0, 0)
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field: ``tag`` is (number << 3) | 2."""
    n = len(payload)
    return bytes((tag, n)) + payload if n < 0x80 else bytes((tag,)) + _varint(n) + payload


def _string(tag: int, text: str) -> bytes:
    return _field(tag, text.encode("utf-8")) if text else b""


def _any_value(value: Any) -> bytes:
    """An AnyValue's body, as the SDK's ``_encode_value`` chooses its case."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"  # a set oneof is written at its default
    if isinstance(value, str):
        return _field(0x0A, value.encode("utf-8"))
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(f"integer {value} out of int64 range")
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if isinstance(value, bytes):
        return _field(0x3A, value)
    if isinstance(value, Sequence):
        return _field(0x2A, b"".join([_field(0x0A, _any_value(v)) for v in value]))
    if isinstance(value, Mapping):
        kvs = [_field(0x0A, _key_value(str(k), v)) for k, v in value.items()]
        return _field(0x32, b"".join(kvs))
    raise TypeError(f"invalid attribute value type {type(value).__name__}")


def _cache_key(tag: int, key: str, value: Any) -> tuple[tuple[Any, ...], bool]:
    """The attribute's key in the cache, and whether to keep it there: Python
    calls True, 1 and 1.0 equal, and 0.0 and -0.0, which OTLP tells apart, so
    the key holds each value's type (each element's, in a tuple) and floats
    (durations, mostly unique) are not kept."""
    if isinstance(value, float):
        return (), False
    if isinstance(value, tuple):
        if any(isinstance(v, float) for v in value):
            return (), False
        return (tag, key, value, tuple, *map(type, value)), True
    return (tag, key, value, type(value)), True


# Values whose encoded attribute is kept under (tag, key, value, type) without
# looking further: exactly these types (a subclass, such as an IntEnum, takes
# the general path).
_KEPT_SCALARS = frozenset((str, int, bool))


def cut(value: Any, limit: int) -> Any:
    """``value`` with its string, or a tuple's strings, cut at ``limit``
    characters (the SDK's BoundedAttributes rule); any other value as it is."""
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, tuple) and value and isinstance(value[0], str):
        return tuple(v[:limit] if isinstance(v, str) else v for v in value)
    return value


def _key_value(key: str, value: Any) -> bytes:
    return _string(0x0A, key) + _field(0x12, _any_value(value))


class OtlpEncoder:
    """ExportTraceServiceRequest bytes for a batch of spans (one thread's)."""

    def __init__(self) -> None:
        self._attributes: dict[tuple[Any, ...], bytes] = {}
        self._float_heads: dict[tuple[int, str], bytes] = {}
        self._resources: dict[Resource, bytes] = {}
        self._scopes: dict[InstrumentationScope | None, bytes] = {}
        self._names: dict[tuple[str, int], bytes] = {}  # name and kind's value, encoded
        self._statuses: dict[tuple[Any, str | None], bytes] = {}
        self._status_objects: dict[Status, bytes] = {}
        self._trace_id = -1
        self._trace_field = b""

    def _attrs(
        self,
        tag: int,
        attributes: Mapping[str, Any] | None,
        out: list[bytes] | None = None,
        limit: int | None = None,
    ) -> list[bytes]:
        """Each attribute as a whole field ``tag`` (its KeyValue), kept if it
        repeats, appended to ``out`` (a new list when None), which is returned.
        A value of a type OTLP has no case for is left out, as the SDK's
        encoder leaves it out. ``limit``: strings cut at that many characters
        (a tuple's strings too), as the SDK's BoundedAttributes cuts them.

        The common cases first, without a call: a string, integer or bool kept
        under its own key; a float (a duration: mostly unique, never kept)
        written behind the encoded head of its (tag, key), which is kept."""
        if out is None:
            out = []
        if not attributes:
            return out
        cache = self._attributes
        heads = self._float_heads
        for key, value in attributes.items():
            kind = type(value)
            if kind is float:
                head = heads.get((tag, key))
                if head is None:
                    head = self._float_head(tag, key)
                    if head is None:
                        continue
                out.append(head + _DOUBLE(value))
                continue
            if kind in _KEPT_SCALARS:
                if kind is str and limit is not None and len(value) > limit:
                    value = value[:limit]
                encoded = cache.get((tag, key, value, kind))
                if encoded is not None:
                    out.append(encoded)
                    continue
            elif limit is not None:
                value = cut(value, limit)
            encoded = self._attr(tag, key, value)
            if encoded is not None:
                out.append(encoded)
        return out

    def _float_head(self, tag: int, key: str) -> bytes | None:
        """Field ``tag`` of a KeyValue whose value is a double, up to the
        double's 8 bytes (its lengths are fixed); None for a key that is not a string."""
        if not isinstance(key, str):  # the SDK's KeyValue refuses it: left out
            return None
        key_field = _string(0x0A, key)
        # KeyValue.value (field 2, 9 bytes) holding AnyValue.double_value (field 4, fixed64).
        body_len = len(key_field) + 11
        head = bytes((tag,)) + _varint(body_len) + key_field + b"\x12\x09\x21"
        if len(self._float_heads) >= _CACHE_LIMIT:
            self._float_heads.clear()
        self._float_heads[(tag, key)] = head
        return head

    def _attr(self, tag: int, key: str, value: Any) -> bytes | None:
        """One attribute the fast cases did not take; kept if it may repeat."""
        if not isinstance(key, str):  # the SDK's KeyValue refuses it: left out
            return None
        cache = self._attributes
        hashed, keep = _cache_key(tag, key, value)
        try:
            encoded = cache.get(hashed) if keep else None
        except TypeError:  # unhashable (a list): not kept
            encoded, keep = None, False
        if encoded is None:
            try:
                encoded = _field(tag, _key_value(key, value))
            except Exception:  # as the SDK's encoder: that attribute is left out
                return None
            if keep:
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                cache[hashed] = encoded
        return encoded

    def _resource(self, resource: Resource) -> bytes:
        encoded = self._resources.get(resource)
        if encoded is None:
            body = b"".join(self._attrs(0x0A, resource.attributes))
            # ResourceSpans.resource (field 1), always set.
            encoded = self._resources[resource] = _field(0x0A, body)
        return encoded

    def _scope(self, scope: InstrumentationScope | None) -> bytes:
        encoded = self._scopes.get(scope)
        if encoded is None:
            body = b""
            if scope is not None:
                body = _string(0x0A, scope.name) + _string(0x12, scope.version or "")
                body += b"".join(self._attrs(0x1A, scope.attributes))
            encoded = _field(0x0A, body)  # ScopeSpans.scope
            # A scope's hash leaves its attributes out: one that has some is not kept.
            if scope is None or not scope.attributes:
                self._scopes[scope] = encoded
        return encoded

    def encode(self, spans: Sequence[ReadableSpan]) -> bytes:
        """The request, grouped by resource then scope, in first-seen order (as the SDK's)."""
        groups: dict[Resource, dict[InstrumentationScope | None, list[bytes]]] = {}
        for span in spans:
            scopes = groups.setdefault(span.resource, {})
            scopes.setdefault(span.instrumentation_scope or None, []).append(self._span(span))
        return b"".join(
            self._resource_spans(resource, scopes) for resource, scopes in groups.items()
        )

    def wrap(
        self, resource: Resource, scope: InstrumentationScope, spans: Sequence[bytes]
    ) -> bytes:
        """The request of spans already encoded (:meth:`span`), all of one resource and scope."""
        return self._resource_spans(resource, {scope: spans})

    def _resource_spans(
        self, resource: Resource, scopes: Mapping[InstrumentationScope | None, Sequence[bytes]]
    ) -> bytes:
        body = [self._resource(resource)]
        for scope, encoded in scopes.items():
            scope_body = [self._scope(scope), *encoded]
            if scope is not None and scope.schema_url:
                scope_body.append(_string(0x1A, scope.schema_url))
            body.append(_field(0x12, b"".join(scope_body)))  # ResourceSpans.scope_spans
        body.append(_string(0x1A, resource.schema_url))
        return _field(0x0A, b"".join(body))  # ExportTraceServiceRequest.resource_spans

    def _span(self, span: ReadableSpan) -> bytes:
        ctx = span.get_span_context()
        assert ctx is not None  # a ReadableSpan always has one
        return self.span(
            ctx, span.parent, span.name, span.kind, span.start_time or 0, span.end_time or 0,
            span.attributes, span.events, span.links, span.status,
            (span.dropped_attributes, span.dropped_events, span.dropped_links),
        )  # fmt: skip

    def span(
        self,
        ctx: SpanContext,
        parent: SpanContext | None,
        name: str,
        kind: SpanKind,
        start_time: int,
        end_time: int,
        attributes: Mapping[str, Any] | None,
        events: Sequence[Any],
        links: Sequence[Any],
        status: Status,
        dropped: tuple[int, int, int] = _NOTHING_DROPPED,
    ) -> bytes:
        """ScopeSpans.spans (field 2): one Span; ``dropped``: its attributes,
        events and links dropped by the span limits."""
        return self.span_of_ids(
            ctx.trace_id, ctx.span_id, ctx.trace_state,
            None if not parent else parent.span_id, parent is not None and parent.is_remote,
            name, kind, start_time, end_time, attributes, events, links, status, dropped,
        )  # fmt: skip

    def span_of_ids(
        self,
        trace_id: int,
        span_id: int,
        trace_state: TraceState | None,
        parent_span_id: int | None,
        parent_is_remote: bool,
        name: str,
        kind: SpanKind,
        start_time: int,
        end_time: int,
        attributes: Mapping[str, Any] | None,
        events: Sequence[Any],
        links: Sequence[Any],
        status: Status,
        dropped: tuple[int, int, int] = _NOTHING_DROPPED,
        limit: int | None = None,
    ) -> bytes:
        """:meth:`span` of the ids themselves (the span builder's path, which
        makes no SpanContext): ``parent_span_id`` None for a root; ``limit``
        the span attributes' length limit (:meth:`_attrs`)."""
        if trace_id != self._trace_id:  # a journey's spans share theirs
            self._trace_id = trace_id
            self._trace_field = b"\x0a\x10" + trace_id.to_bytes(16, "big")
        # parts[0]: the field's own tag and length, written last (one join, no copy).
        parts = [b"", self._trace_field, b"\x12\x08" + span_id.to_bytes(8, "big")]
        if trace_state:
            parts.append(_string(0x1A, _trace_state(trace_state)))
        if parent_span_id is not None:
            parts.append(b"\x22\x08" + parent_span_id.to_bytes(8, "big"))
        # Keyed on the kind's plain value: an Enum member's hash is a Python call.
        named = (name, kind._value_)
        head = self._names.get(named)
        if head is None:
            head = _string(0x2A, name) + _KIND[kind]
            if len(self._names) < _CACHE_LIMIT:
                self._names[named] = head
        parts.append(head)
        if start_time:
            parts.append(b"\x39" + _FIXED64(start_time))
        if end_time:
            parts.append(b"\x41" + _FIXED64(end_time))
        self._attrs(0x4A, attributes, parts, limit)
        if dropped != _NOTHING_DROPPED:
            for tag, count in zip((b"\x50", b"\x60", b"\x70"), dropped, strict=True):
                if count:  # fields 10, 12, 14 (a parser takes fields in any order)
                    parts.append(tag + _varint(count))
        for event in events:
            parts.append(_field(0x5A, self._event(event.name, event.timestamp, event)))
        for link in links:
            parts.append(_field(0x6A, self._link(link.context, link)))
        parts.append(self._status(status))
        parts.append(_FLAGS_REMOTE if parent_is_remote else _FLAGS_LOCAL)
        parts[0] = b"\x12" + _varint(sum(map(len, parts)))  # ScopeSpans.spans (field 2)
        return b"".join(parts)

    def _status(self, status: Status) -> bytes:
        """Span.status (field 15). Kept per Status object (the span builder's
        are constants; a Status hashes by identity), else per code and description."""
        encoded = self._status_objects.get(status)
        if encoded is not None:
            return encoded
        keyed = (status.status_code, status.description)
        encoded = self._statuses.get(keyed)
        if encoded is None:
            encoded = _field(0x7A, _status(status.status_code.value, status.description))
            if len(self._statuses) < _CACHE_LIMIT:
                self._statuses[keyed] = encoded
        if len(self._status_objects) < _CACHE_LIMIT:
            self._status_objects[status] = encoded
        return encoded

    def _event(self, name: str, timestamp: int, event: Any) -> bytes:
        parts = [b"\x09" + _FIXED64(timestamp) if timestamp else b"", _string(0x12, name)]
        self._attrs(0x1A, event.attributes, parts)
        if event.dropped_attributes:
            parts.append(b"\x20" + _varint(event.dropped_attributes))
        return b"".join(parts)

    def _link(self, ctx: SpanContext, link: Any) -> bytes:
        parts = [
            b"\x0a\x10" + ctx.trace_id.to_bytes(16, "big"),
            b"\x12\x08" + ctx.span_id.to_bytes(8, "big"),
        ]
        self._attrs(0x22, link.attributes, parts)
        if link.dropped_attributes:
            parts.append(b"\x28" + _varint(link.dropped_attributes))
        parts.append(b"\x35" + _FIXED32(_flags(ctx)))  # field 6, fixed32
        return b"".join(parts)


def _trace_state(state: TraceState | None) -> str:
    return ",".join(f"{k}={v}" for k, v in state.items()) if state is not None else ""


_FLAGS_LOCAL = b"\x85\x01" + _FIXED32(_HAS_IS_REMOTE)  # Span.flags: field 16, fixed32
_FLAGS_REMOTE = b"\x85\x01" + _FIXED32(_HAS_IS_REMOTE | _IS_REMOTE)


def _flags(context: SpanContext | None) -> int:
    """As the SDK's ``_span_flags``: whether the parent (or linked) context is remote."""
    if context and context.is_remote:
        return _HAS_IS_REMOTE | _IS_REMOTE
    return _HAS_IS_REMOTE


def _status(code: int, description: str | None) -> bytes:
    body = _string(0x12, description or "")
    return body + (b"\x18" + _varint(code) if code else b"")
