"""``vllm-journey perfetto``: journeys as a trace for ui.perfetto.dev (or chrome://tracing).

Runs in the CLI's process, offline: reads OTLP/JSON trace files, writes one file.
A process per vLLM instance (``host.name``, ``vllm.data_parallel.rank``,
``vllm.kv_transfer.role``) holds a track per journey (its request id) with its
spans as nested slices, args the attributes. A preemption is its vllm.preempted
slice plus an instant ``preempts <id>`` on the preempting request's track, with a
flow arrow when ``vllm.journey.preempted_by`` names a journey of the instance.
vllm.step spans become counter tracks per instance (batch size, KV-cache usage,
running and waiting requests, prefill and decode tokens) at each step's start.

Clocks: spans carry epoch ns (``*_unix_ns``) and so does the output. ``proto``
(Perfetto's TrackEvent protobuf, through the optional ``perfetto`` package) keeps
them exact, with a clock snapshot equating the trace clock to REALTIME. ``json``
(Chrome trace events: "X", "M", "C", "s"/"f") is in microseconds, parsed as
doubles by viewers: start and end are each rounded to the microsecond (nesting
holds) and the args keep each span's exact ``start_unix_ns`` and ``end_unix_ns``.

Bounded memory, two passes: pass 1 keeps a few numbers per journey and the
slowest ``--limit`` roots; pass 2 holds a kept journey's spans only until all of
them (counted in pass 1) were read. Each journey is drawn as ``slice_tree.py``'s
nested slices (clamped so nesting holds; args keep the span's times).
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple

import msgspec

from vllm_journey_otel import schema as S
from vllm_journey_otel.tools.slice_tree import Slice, tree, walk
from vllm_journey_otel.tools.tracefile import FileSpan, TraceFileError, read_spans

EXIT_OK, EXIT_EMPTY, EXIT_USAGE = 0, 1, 2  # as tools/cli.py
MAX_REPORTED = 20
# Journeys written by default (the slowest past that); --limit 0 writes all.
DEFAULT_LIMIT = 20_000
REQUIREMENT = "perfetto>=0.56"

_CYCLES = frozenset({S.SPAN_QUEUED, S.SPAN_SCHEDULED, S.SPAN_PREEMPTED})
_PHASES = frozenset({S.SPAN_PREFILL, S.SPAN_DECODE, S.SPAN_WAIT})
# Counter tracks from the vllm.step attributes: (track name, attribute).
COUNTERS = (
    ("batch size", S.STEP_BATCH_SIZE), ("KV-cache usage", S.KV_CACHE_USAGE),
    ("running", S.NUM_RUNNING), ("waiting", S.NUM_WAITING),
    ("prefill tokens", S.STEP_PREFILL_TOKENS), ("decode tokens", S.STEP_DECODE_TOKENS),
)  # fmt: skip
_DOUBLE_COUNTERS = frozenset({S.KV_CACHE_USAGE})
_SEQ = 1  # trusted_packet_sequence_id of every packet
_BOOTTIME, _REALTIME = 6, 1  # BuiltinClocks
_JOURNEY_UUID_BASE = 1 << 40


def _id(hex_id: str) -> int:
    """A span id as an int (smaller than its hex string in the pass-1 maps)."""
    try:
        return int(hex_id, 16) if hex_id else 0
    except ValueError:
        return hash(hex_id)


def _instance(resource: dict[str, Any]) -> tuple[str, str]:  # host, rank and role
    rank, role = resource.get(S.RES_DP_RANK), resource.get(S.RES_KV_ROLE)
    tag = " ".join(([] if rank is None else [f"dp={rank}"]) + ([] if role is None else [str(role)]))
    return str(resource.get(S.RES_HOST, "unknown host")), tag


class _Root(NamedTuple):
    span_id: str
    trace_id: str
    request_id: str
    instance: tuple[str, str]
    start_unix_ns: int
    end_unix_ns: int


@dataclass
class _Plan:
    """What pass 1 found: the kept journeys (by arrival) and where their spans are."""

    total: int
    steps: int
    instances: list[tuple[str, str]]
    journeys: list[_Root]
    # root span id -> spans of its journey; queued/scheduled/preempted id -> root id
    expected: dict[int, int]
    cycle_root: dict[int, int]
    index: dict[int, int] = field(default_factory=dict)  # root span id -> journey index
    # (instance index, request id) -> journey indices
    by_request: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    instance_ids: dict[tuple[str, str], int] = field(default_factory=dict)


def plan(spans: Iterable[FileSpan], limit: int) -> _Plan:
    """Pass 1: rank the roots (slowest ``limit`` kept; 0: all) and count each one's spans."""
    heap: list[tuple[int, str, _Root]] = []
    instances: dict[tuple[str, str], tuple[str, str]] = {}  # one tuple per instance
    cycle_parent: dict[int, int] = {}
    below: Counter[int] = Counter()  # span id -> spans whose parent it is
    total = steps = 0
    for s in spans:
        if s.name == S.SPAN_REQUEST:
            total += 1
            key = instances.setdefault(_instance(s.resource), _instance(s.resource))
            rid = str(s.attributes.get(S.REQUEST_ID, s.span_id))
            root = _Root(s.span_id, s.trace_id, rid, key, s.start_unix_ns, s.end_unix_ns)
            item = (s.end_unix_ns - s.start_unix_ns, s.span_id, root)
            if limit <= 0 or len(heap) < limit:
                heapq.heappush(heap, item)
            elif item[:2] > heap[0][:2]:
                heapq.heapreplace(heap, item)
        elif s.name in _CYCLES:
            parent = _id(s.parent_span_id)
            cycle_parent[_id(s.span_id)] = parent
            below[parent] += 1
        elif s.name in _PHASES:
            below[_id(s.parent_span_id)] += 1
        elif s.name == S.SPAN_STEP:
            steps += 1
            instances.setdefault(_instance(s.resource), _instance(s.resource))
    unique = {r.span_id: r for _, _, r in heap}  # a file given twice: one track
    kept = sorted(unique.values(), key=lambda r: (r.start_unix_ns, r.span_id))
    expected = {_id(r.span_id): 1 + below[_id(r.span_id)] for r in kept}
    cycle_root = {c: r for c, r in cycle_parent.items() if r in expected}
    for c, root_id in cycle_root.items():
        expected[root_id] += below[c]
    p = _Plan(total, steps, sorted(instances), kept, expected, cycle_root)
    p.instance_ids = {key: i for i, key in enumerate(p.instances)}
    for i, r in enumerate(kept):
        p.index[_id(r.span_id)] = i
        p.by_request.setdefault((p.instance_ids[r.instance], r.request_id), []).append(i)
    return p


def journeys(
    spans: Iterable[FileSpan], p: _Plan
) -> Iterator[tuple[int, list[FileSpan]] | FileSpan]:
    """Pass 2: each kept journey (index, spans) once all its spans were read, and
    each vllm.step span, in file order. Consumes ``p.expected``."""
    pending: dict[int, list[FileSpan]] = {}
    for s in spans:
        if s.name == S.SPAN_STEP:
            yield s
            continue
        if s.name == S.SPAN_REQUEST:
            root: int | None = _id(s.span_id)
        elif s.name in _CYCLES:
            root = _id(s.parent_span_id)
        elif s.name in _PHASES:
            root = p.cycle_root.get(_id(s.parent_span_id))
        else:
            continue
        want = p.expected.get(root) if root is not None else None
        if root is None or want is None:
            continue
        buf = pending.setdefault(root, [])
        buf.append(s)
        if len(buf) >= want:
            del pending[root], p.expected[root]
            yield p.index[root], buf
    # Journeys that lost spans since pass 1 (a file being rewritten): what there is.
    for root, buf in pending.items():
        yield p.index[root], buf


class _Flow(NamedTuple):
    target: Slice  # the vllm.preempted slice
    source: int  # journey index of the preempting request
    flow_id: int


def _flows(p: _Plan, index: int, root: Slice, next_id: Callable[[], int]) -> list[_Flow]:
    """The preemptions of a journey whose preempting request is in the output."""
    instance = p.instance_ids[p.journeys[index].instance]
    out = []
    for c in root.children:
        by = c.span.attributes.get(S.PREEMPTED_BY) if c.span.name == S.SPAN_PREEMPTED else None
        for j in p.by_request.get((instance, str(by)), ()) if by is not None else ():
            src = p.journeys[j]
            if j != index and src.start_unix_ns <= c.start <= src.end_unix_ns:
                out.append(_Flow(c, j, next_id()))
                break
    return out


def _annotate(a: Any, value: Any) -> None:
    """A span attribute value into a DebugAnnotation."""
    if isinstance(value, bool):
        a.bool_value = value
    elif isinstance(value, int) and -(1 << 63) <= value < (1 << 63):
        a.int_value = value
    elif isinstance(value, float):
        a.double_value = value
    elif isinstance(value, (list, tuple)):
        for v in value:
            _annotate(a.array_values.add(), v)
    else:
        a.string_value = str(value)


def _instance_name(host: str, tag: str) -> str:
    return f"vllm {host} {tag}" if tag else f"vllm {host}"


def _preempts(root: Slice) -> str:
    return f"preempts {root.span.attributes.get(S.REQUEST_ID, '')}"


class _ProtoWriter:
    """Perfetto's protobuf trace: TrackDescriptor packets first, then TrackEvents.

    Track uuids: instance i is 1 + 16 i (a process), + 1 its "requests" group,
    + 2 ... its counters; journey j is 2**40 + j."""

    def __init__(self, out: IO[bytes], pb: Any, builder: Any) -> None:
        self.pb = pb
        self.builder = builder(out)

    def _write(self, ts: int | None = None, **fields: Any) -> None:
        packet = self.pb.TracePacket(trusted_packet_sequence_id=_SEQ, **fields)
        if ts is not None:
            packet.timestamp = ts
        self.builder.write_packet(packet)

    def _track(self, **descriptor: Any) -> None:
        self._write(track_descriptor=descriptor)

    def begin(self, p: _Plan) -> None:
        t0 = min((r.start_unix_ns for r in p.journeys), default=0)
        clocks = [{"clock_id": c, "timestamp": t0} for c in (_BOOTTIME, _REALTIME)]
        self._write(t0, clock_snapshot={"clocks": clocks})
        td = self.pb.TrackDescriptor
        for i, (host, rank) in enumerate(p.instances):
            uuid = 1 + 16 * i
            name = _instance_name(host, rank)
            self._track(uuid=uuid, process={"pid": i + 1, "process_name": name})
            self._track(
                uuid=uuid + 1, parent_uuid=uuid, name="requests", child_ordering=td.EXPLICIT
            )
            for k, (counter, key) in enumerate(COUNTERS if p.steps else ()):
                self._track(uuid=uuid + 2 + k, parent_uuid=uuid, name=counter, description=key,
                            counter={})  # fmt: skip
        for j, r in enumerate(p.journeys):
            self._track(
                uuid=_JOURNEY_UUID_BASE + j,
                parent_uuid=2 + 16 * p.instance_ids[r.instance],
                name=r.request_id,
                description=f"trace {r.trace_id}",
                sibling_order_rank=min(j, (1 << 31) - 1),
                sibling_merge_behavior=td.SIBLING_MERGE_BEHAVIOR_NONE,
            )

    def journey(self, index: int, root: Slice, flows: list[_Flow]) -> None:
        te = self.pb.TrackEvent
        flow_into = {id(f.target): f.flow_id for f in flows}
        for f in flows:
            event = {"type": te.TYPE_INSTANT, "track_uuid": _JOURNEY_UUID_BASE + f.source,
                     "name": _preempts(root), "flow_ids": [f.flow_id]}  # fmt: skip
            self._write(f.target.start, track_event=event)
        track = _JOURNEY_UUID_BASE + index
        for begin, node in walk(root):
            if not begin:
                self._write(node.end, track_event={"type": te.TYPE_SLICE_END, "track_uuid": track})
                continue
            e = te(type=te.TYPE_SLICE_BEGIN, track_uuid=track, name=node.span.name)
            for k, v in node.args(times=False).items():
                _annotate(e.debug_annotations.add(name=k), v)
            if id(node) in flow_into:
                e.terminating_flow_ids.append(flow_into[id(node)])
            self._write(node.start, track_event=e)

    def step(self, instance: int, span: FileSpan) -> None:
        for k, (_, key) in enumerate(COUNTERS):
            value = span.attributes.get(key)
            if not isinstance(value, (int, float)):
                continue
            event: dict[str, Any] = {"type": self.pb.TrackEvent.TYPE_COUNTER,
                                     "track_uuid": 3 + 16 * instance + k}  # fmt: skip
            if key in _DOUBLE_COUNTERS:
                event["double_counter_value"] = float(value)
            else:
                event["counter_value"] = int(value)
            self._write(span.start_unix_ns, track_event=event)

    def close(self) -> None:
        pass


def _us(ns: int) -> int:
    return (ns + 500) // 1000


class _JsonWriter:
    """The Chrome trace-event JSON object format, streamed one event at a time.
    pid: 1 + instance index; tid: 1 + instances + journey index (step counters:
    the pid)."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.encode = msgspec.json.Encoder().encode
        self.first = True
        self.plan: _Plan | None = None

    def _emit(self, ph: str, name: str, where: tuple[int, int], **fields: Any) -> None:
        self.out.write(b'{"traceEvents":[\n' if self.first else b",\n")
        self.first = False
        pid, tid = where
        self.out.write(self.encode({"ph": ph, "name": name, "pid": pid, "tid": tid, **fields}))

    def _where(self, index: int) -> tuple[int, int]:
        assert self.plan is not None
        p = self.plan
        return p.instance_ids[p.journeys[index].instance] + 1, len(p.instances) + 1 + index

    def begin(self, p: _Plan) -> None:
        self.plan = p
        for i, (host, rank) in enumerate(p.instances):
            self._emit(
                "M", "process_name", (i + 1, i + 1), args={"name": _instance_name(host, rank)}
            )
            self._emit("M", "process_sort_index", (i + 1, i + 1), args={"sort_index": i})
        for j, r in enumerate(p.journeys):
            self._emit("M", "thread_name", self._where(j), args={"name": r.request_id})
            self._emit("M", "thread_sort_index", self._where(j), args={"sort_index": j})

    def journey(self, index: int, root: Slice, flows: list[_Flow]) -> None:
        for f in flows:
            ts, src = _us(f.target.start), self._where(f.source)
            self._emit("i", _preempts(root), src, cat="vllm", ts=ts, s="t")
            self._emit("s", "preemption", src, cat="vllm", ts=ts, id=f.flow_id)
        here = self._where(index)
        for begin, node in walk(root):
            if begin:
                ts, args = _us(node.start), node.args(times=True)
                self._emit("X", node.span.name, here, cat="vllm", ts=ts, dur=_us(node.end) - ts,
                           args=args)  # fmt: skip
        for f in flows:
            self._emit("f", "preemption", here, cat="vllm", ts=_us(f.target.start), id=f.flow_id,
                       bp="e")  # fmt: skip

    def step(self, instance: int, span: FileSpan) -> None:
        a = span.attributes
        args = {name: a[key] for name, key in COUNTERS if isinstance(a.get(key), (int, float))}
        if args:
            where = (instance + 1, instance + 1)
            self._emit("C", "vllm.step", where, ts=_us(span.start_unix_ns), args=args)

    def close(self) -> None:
        self.out.write(b'{"traceEvents":[' if self.first else b"\n")
        self.out.write(b"]}\n")


_Writer = _ProtoWriter | _JsonWriter


def convert(
    read: Callable[[frozenset[str] | None], Iterable[FileSpan]],
    out: Path,
    make_writer: Callable[[IO[bytes]], _Writer],
    limit: int,
) -> tuple[int, int, int]:
    """Both passes (``read(attributes_of)`` returns a fresh span iterator each time);
    ``out`` is written only if there is a journey. (journeys written, in all, steps)."""
    p = plan(read(frozenset({S.SPAN_REQUEST})), limit)
    if not p.journeys:
        return 0, p.total, 0
    flow_ids = iter(range(1, 1 << 62))
    steps = 0
    with open(out, "wb") as f:
        writer = make_writer(f)
        writer.begin(p)
        for item in journeys(read(None), p):
            if isinstance(item, FileSpan):
                instance = p.instance_ids.get(_instance(item.resource))
                if instance is not None:
                    steps += 1
                    writer.step(instance, item)
                continue
            root = tree(item[1])
            if root is not None:
                writer.journey(item[0], root, _flows(p, item[0], root, flow_ids.__next__))
        writer.close()
    return len(p.journeys), p.total, steps


def _proto_modules() -> tuple[Any, Any] | str:
    """perfetto's TracePacket protos and streaming builder, or why they cannot be used."""
    try:
        from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb  # type: ignore[import-untyped, import-not-found, unused-ignore]
        from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except Exception as e:  # ImportError, or protobuf's VersionError for its gencode
        return f"the proto format needs the perfetto package ({REQUIREMENT}): {e}"
    return pb, StreamingTraceProtoBuilder


def _run(args: argparse.Namespace) -> int:
    out = Path(args.output)
    fmt = args.format or ("json" if out.suffix.lower() == ".json" else "proto")
    if args.limit < 0:
        print("vllm-journey: --limit must be 0 (all) or more", file=sys.stderr)
        return EXIT_USAGE
    modules = _proto_modules() if fmt == "proto" else None
    if isinstance(modules, str):
        if args.format == "proto":
            print(f"vllm-journey: {modules}", file=sys.stderr)
            return EXIT_USAGE
        print(f"vllm-journey: {modules}; writing Chrome JSON instead", file=sys.stderr)
        fmt, modules = "json", None
    bad, passes = [0], [0]

    def error(message: str) -> None:
        bad[0] += 1
        if bad[0] <= MAX_REPORTED:
            print(f"vllm-journey: {message}", file=sys.stderr)

    def read(attributes_of: frozenset[str] | None) -> Iterable[FileSpan]:
        passes[0] += 1  # bad lines are reported on the first pass only
        return read_spans(args.files, error if passes[0] == 1 else None, None, attributes_of)

    def make_writer(f: IO[bytes]) -> _Writer:
        return _JsonWriter(f) if modules is None else _ProtoWriter(f, *modules)

    try:
        shown, total, steps = convert(read, out, make_writer, args.limit)
    except TraceFileError as e:
        print(f"vllm-journey: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"vllm-journey: {out}: cannot write: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    if bad[0] > MAX_REPORTED:
        print(f"vllm-journey: ... {bad[0]} bad lines in all", file=sys.stderr)
    if not shown:
        print("vllm-journey: no vllm.request spans found", file=sys.stderr)
        return EXIT_EMPTY
    print(f"{out}: {shown} of {total} journeys, {steps} steps ({fmt}); open it in ui.perfetto.dev")
    return EXIT_OK


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``perfetto`` on the CLI's subparsers."""
    p = sub.add_parser(
        "perfetto",
        help="a trace for ui.perfetto.dev: a track per request, counters per step",
        description="Write journeys as a Perfetto trace: a process per vLLM instance, a track "
        "per request with its phases as nested slices, preemptions as flow arrows, vllm.step "
        "counters. Times are epoch ns. Exit codes: 0 ok, 1 no journey, 2 usage/unreadable.",
    )
    p.add_argument("files", nargs="+", help="OTLP/JSON-lines trace files")
    p.add_argument("-o", "--output", default="journeys.perfetto-trace", help="file to write")
    p.add_argument("--format", choices=("proto", "json"), help="proto: Perfetto protobuf (the "
                   "perfetto package); json: Chrome trace events. Default: json for *.json, "
                   "else proto (json without perfetto)")  # fmt: skip
    limit_help = f"journeys to write, the slowest kept (default {DEFAULT_LIMIT}; 0: all)"
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help=limit_help)
    p.set_defaults(func=_run)
