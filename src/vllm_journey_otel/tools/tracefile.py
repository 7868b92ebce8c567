"""Read spans from OTLP/JSON-lines trace files, streaming, with clear errors.

Accepts the files ``OtlpJsonFileExporter`` writes (and the Collector's file
exporter): one ``ExportTraceServiceRequest`` per line. A bad line is reported
with its file and line number and skipped; reading goes on.

Pure: no vLLM, no SDK.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from vllm_journey_otel.export.otlp_json import value


class TraceFileError(Exception):
    """A trace file that cannot be read at all (missing, unreadable)."""


class FileSpan(NamedTuple):
    """One span of a trace file. Times are epoch ns."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_unix_ns: int
    end_unix_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]


# Typed views of an OTLP/JSON line: msgspec decodes straight into them (much
# faster than generic dicts) and skips every field we do not read.
class _KeyValue(msgspec.Struct):
    key: str
    value: dict[str, Any] = msgspec.field(default_factory=dict)


class _Span(msgspec.Struct, rename="camel"):
    trace_id: str = ""
    span_id: str = ""
    parent_span_id: str = ""
    name: str = ""
    start_time_unix_nano: int | str = 0
    end_time_unix_nano: int | str = 0
    attributes: list[_KeyValue] = msgspec.field(default_factory=list)


class _ScopeSpans(msgspec.Struct):
    spans: list[_Span] = msgspec.field(default_factory=list)


class _Resource(msgspec.Struct):
    attributes: list[_KeyValue] = msgspec.field(default_factory=list)


class _ResourceSpans(msgspec.Struct, rename="camel"):
    resource: _Resource = msgspec.field(default_factory=_Resource)
    scope_spans: list[_ScopeSpans] = msgspec.field(default_factory=list)


class _Request(msgspec.Struct, rename="camel"):
    resource_spans: list[_ResourceSpans] = msgspec.field(default_factory=list)


_decode = msgspec.json.Decoder(_Request).decode


def _attributes(kvs: list[_KeyValue]) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in kvs}


def read_spans(
    paths: Iterable[str | Path],
    on_error: Callable[[str], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
    attributes_of: frozenset[str] | None = None,
) -> Iterator[FileSpan]:
    """Every span of every file, in file order. Bad lines go to ``on_error``;
    ``on_progress`` gets the bytes read so far every 1,000 lines. With
    ``attributes_of``, only spans of those names get their attributes decoded
    (the others come with an empty dict: most of the reading time goes there)."""
    done = 0
    empty: dict[str, Any] = {}
    for path in paths:
        p = Path(path)
        try:
            f = open(p, encoding="utf-8", errors="replace")  # noqa: SIM115
        except OSError as e:
            raise TraceFileError(f"{p}: cannot open: {e.strerror or e}") from e
        with f:
            for lineno, line in enumerate(f, 1):
                done += len(line)
                if on_progress is not None and lineno % 1000 == 0:
                    on_progress(done)
                if not line.strip():
                    continue
                try:
                    request = _decode(line)
                    for rs in request.resource_spans:
                        resource = _attributes(rs.resource.attributes)
                        for ss in rs.scope_spans:
                            for span in ss.spans:
                                wanted = attributes_of is None or span.name in attributes_of
                                yield FileSpan(
                                    span.name,
                                    span.trace_id,
                                    span.span_id,
                                    span.parent_span_id,
                                    int(span.start_time_unix_nano),
                                    int(span.end_time_unix_nano),
                                    _attributes(span.attributes) if wanted else empty,
                                    resource,
                                )
                except (ValueError, TypeError, KeyError, AttributeError, msgspec.DecodeError) as e:
                    if on_error is not None:
                        on_error(f"{p}:{lineno}: not an OTLP/JSON trace line ({e})")
