"""``vllm-journey perfetto``: real journeys, converted, read back as Perfetto would.

Journeys come from vLLM's real Scheduler (a preemption, a LoRA-slot wait, the step
view on), through the project's own OTLP/JSON file exporter; a second instance is
the same file from another host. Each output is read back by a model of Trace
Processor's import rules (read in perfetto's sources: events sorted by timestamp,
ties in file order or, in JSON, longer slices first; BEGIN/END pairs nest on a
per-track stack; "X" slices nest by interval; a flow binds to the slice on top of
its track's stack), and the slices it yields are checked against the spans: one
track per request, every span a slice with its start and duration, nested as the
spans are, the preemption's flow, the step counters. The protobuf is decoded with
the perfetto package's own descriptors (its TraceProcessor needs a
trace_processor binary it downloads, which cannot be had here).
"""

from __future__ import annotations

import argparse
import json
import tracemalloc
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import import_harness, journeys_from_vllm
from vllm_journey_otel import schema as S
from vllm_journey_otel.engine import handoff
from vllm_journey_otel.tools import perfetto as P
from vllm_journey_otel.tools.tracefile import FileSpan, read_spans

OTHER_HOST = "other-host"


def _cli(argv: list[str]) -> int:
    """The subcommand as tools/cli.py wires it."""
    parser = argparse.ArgumentParser(prog="vllm-journey")
    P.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["perfetto", *argv])
    return int(args.func(args))


def _shift_ids(line: str, host: str) -> str:
    """One OTLP/JSON line as if from another host: new ids (a bijection), same times."""

    def shift(h: str) -> str:
        return f"{(int(h[0], 16) + 1) % 16:x}{h[1:]}" if h else h

    doc = json.loads(line)
    for rs in doc["resourceSpans"]:
        for kv in rs["resource"]["attributes"]:
            if kv["key"] == S.RES_HOST:
                kv["value"] = {"stringValue": host}
        for ss in rs["scopeSpans"]:
            for s in ss["spans"]:
                for k in ("traceId", "spanId", "parentSpanId"):
                    if k in s:
                        s[k] = shift(s[k])
    return json.dumps(doc)


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], Path]:
    """Two instances' trace files, and one file of the first with every span on its
    own line in reverse order (children before parents)."""
    harness = import_harness()
    from vllm.lora.request import LoRARequest

    from vllm_journey_otel.config import MODE_THREAD, Config
    from vllm_journey_otel.engine import hooks
    from vllm_journey_otel.export.file_exporter import OtlpJsonFileExporter
    from vllm_journey_otel.export.otlp_json import spans_to_json

    d = tmp_path_factory.mktemp("perfetto")
    path, memory = d / "a.otlp.jsonl", InMemorySpanExporter()
    cfg = Config(enabled=True, export_mode=MODE_THREAD, steps=True)
    assert hooks.install(cfg, exporters=[memory, OtlpJsonFileExporter(path)], batch=False)
    try:
        # KV pressure: r2 is preempted by r1 (tests/engine/test_beyond_plain.py).
        e = harness.Engine(num_blocks=8, max_num_batched_tokens=64, max_model_len=512)
        for i in range(4):
            e.add(f"r{i}", prompt_len=20 + 7 * i, max_tokens=12)
        e.run()
        assert sum(r.num_preemptions for r in e.requests.values()) > 0, "precondition"
        # One LoRA slot: b waits for it inside its vllm.queued (a vllm.wait).
        e = harness.Engine(max_loras=1)
        e.add("a", prompt_len=20, max_tokens=6, lora=LoRARequest("sql", 1, "/nonexistent/sql"))
        e.add("b", prompt_len=20, max_tokens=4, lora=LoRARequest("chat", 2, "/nonexistent/c"))
        e.run()
        e.add("gone", prompt_len=30, max_tokens=100)
        e.step()
        e.abort("gone")
        e.run()
        assert handoff.flush(10)
    finally:
        hooks.uninstall()
    other = d / "b.otlp.jsonl"
    other.write_text("".join(_shift_ids(ln, OTHER_HOST) + "\n" for ln in path.open()))
    reverse = d / "reversed.otlp.jsonl"
    spans = memory.get_finished_spans()
    reverse.write_text("".join(spans_to_json([s]) + "\n" for s in reversed(spans)))
    return [path, other], reverse


# -- what the spans say ---------------------------------------------------------
@dataclass
class Want:
    """A journey as the spans have it."""

    instance: tuple[str, str]
    request_id: str
    spans: list[FileSpan]
    parent: dict[str, str]  # span id -> parent span's name ("" for the root)


def _journeys(files: list[Path]) -> tuple[list[Want], list[FileSpan]]:
    spans = list(read_spans(files))
    by_id = {s.span_id: s for s in spans}
    out: dict[str, Want] = {}
    for s in spans:
        if s.name == S.SPAN_REQUEST:
            inst = P._instance(s.resource)
            out[s.span_id] = Want(inst, s.attributes[S.REQUEST_ID], [], {})
    for s in spans:
        root = s
        while root.name != S.SPAN_REQUEST and root.parent_span_id in by_id:
            root = by_id[root.parent_span_id]
        if root.span_id in out and s.name != S.SPAN_STEP:
            w = out[root.span_id]
            w.spans.append(s)
            parent = by_id.get(s.parent_span_id)
            w.parent[s.span_id] = parent.name if s is not root and parent else ""
    return list(out.values()), [s for s in spans if s.name == S.SPAN_STEP]


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, (tuple, list)) else v


# -- Trace Processor's import, modelled -------------------------------------------
@dataclass(eq=False)
class Slice:
    name: str
    ts: int
    dur: int | None
    args: dict[str, Any]
    parent: Slice | None
    flows_out: list[int] = field(default_factory=list)
    flows_in: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        assert self.dur is not None
        return self.ts + self.dur


@dataclass
class View:
    """What a viewer shows: tracks (by key) with names, slices and counters."""

    track_name: dict[Any, str] = field(default_factory=dict)
    track_group: dict[Any, str] = field(default_factory=dict)  # track -> instance name
    slices: dict[Any, list[Slice]] = field(default_factory=lambda: defaultdict(list))
    counters: dict[tuple[str, str], list[tuple[int, float]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    overlaps: int = 0
    active_flows: set[int] = field(default_factory=set)
    dropped_flows: int = 0

    def flow(self, s: Slice, fid: int, out: bool) -> None:
        """FlowTracker: an id's first slice starts the arrow, a later one ends it;
        an end with no start is dropped."""
        if out and fid not in self.active_flows:
            self.active_flows.add(fid)
            s.flows_out.append(fid)
        elif not out and fid in self.active_flows:
            self.active_flows.remove(fid)
            s.flows_in.append(fid)
        else:
            self.dropped_flows += 1


def _push(view: View, stacks: dict[Any, list[Slice]], track: Any, s: Slice) -> None:
    """SliceTracker: pop what ended (a slice ending at the new one's start too,
    except instant on instant), then nest the new slice on top."""
    stack = stacks[track]
    while stack and stack[-1].dur is not None:
        top = stack[-1]
        if top.end < s.ts or (top.end == s.ts and not (top.dur == 0 and s.dur == 0)):
            stack.pop()
        else:
            break
    if stack and s.dur is not None and stack[-1].dur is not None and s.ts + s.dur > stack[-1].end:
        view.overlaps += 1
    s.parent = stack[-1] if stack else None
    stack.append(s)
    view.slices[track].append(s)


def _proto_value(a: Any) -> Any:
    kind = a.WhichOneof("value")
    return [_proto_value(x) for x in a.array_values] if kind is None else getattr(a, kind)


def _proto_view(data: bytes) -> View:
    pb = pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2")
    trace = pb.Trace.FromString(data)
    view, tracks, events = View(), {}, []
    for i, packet in enumerate(trace.packet):
        assert packet.trusted_packet_sequence_id == P._SEQ
        if packet.HasField("track_descriptor"):
            tracks[packet.track_descriptor.uuid] = packet.track_descriptor
        elif packet.HasField("track_event"):
            assert packet.track_event.track_uuid in tracks, "descriptors come first"
            events.append((packet.timestamp, i, packet.track_event))
    for uuid, d in tracks.items():
        group = d
        while not group.HasField("process"):
            group = tracks[group.parent_uuid]
        view.track_name[uuid] = d.name or d.process.process_name
        view.track_group[uuid] = group.process.process_name
    stacks: dict[Any, list[Slice]] = defaultdict(list)
    te = pb.TrackEvent
    for ts, _, e in sorted(events, key=lambda x: (x[0], x[1])):
        if e.type == te.TYPE_COUNTER:
            value = (
                e.double_counter_value if e.HasField("double_counter_value") else e.counter_value
            )
            d = tracks[e.track_uuid]
            view.counters[(view.track_group[e.track_uuid], d.name)].append((ts, value))
        elif e.type == te.TYPE_SLICE_END:
            stack = stacks[e.track_uuid]
            while stack[-1].dur is not None:  # a finished instant
                stack.pop()
            stack[-1].dur = ts - stack[-1].ts
            stack.pop()
        else:
            args = {a.name: _proto_value(a) for a in e.debug_annotations}
            dur = 0 if e.type == te.TYPE_INSTANT else None
            s = Slice(e.name, ts, dur, args, None)
            _push(view, stacks, e.track_uuid, s)
            for fid in e.flow_ids:
                view.flow(s, fid, out=True)
            for fid in e.terminating_flow_ids:
                view.flow(s, fid, out=False)
    assert all(not [s for s in st if s.dur is None] for st in stacks.values()), "all ended"
    return view


def _json_view(data: bytes) -> View:
    doc = json.loads(data)
    view, stacks = View(), defaultdict(list)
    processes = {}
    big = 1 << 62
    # The sorter's key for JSON: ts, then ("E" first, none here) "X" longer first, then
    # file order.
    events = sorted(
        enumerate(doc["traceEvents"]),
        key=lambda x: (x[1].get("ts", -1), big - x[1].get("dur", 0), x[0]),
    )
    for _, e in events:
        where = (e["pid"], e["tid"])
        if e["ph"] == "M":
            if e["name"] == "process_name":
                processes[e["pid"]] = e["args"]["name"]
            elif e["name"] == "thread_name":
                view.track_name[where] = e["args"]["name"]
        elif e["ph"] == "C":
            for k, v in e["args"].items():
                view.counters[(processes[e["pid"]], k)].append((e["ts"], v))
        elif e["ph"] in "Xi":
            assert isinstance(e["ts"], int) and isinstance(e.get("dur", 0), int)
            _push(
                view,
                stacks,
                where,
                Slice(e["name"], e["ts"], e.get("dur", 0), e.get("args", {}), None),
            )
        elif e["ph"] in "sf":
            assert e["cat"] == "vllm" and e["name"] == "preemption"
            top = stacks[where][-1]
            view.flow(top, e["id"], out=e["ph"] == "s")
    for track in view.slices:
        view.track_group[track] = processes[track[0]]
    return view


# -- checks ---------------------------------------------------------------------
def _to_unit(ns: int, fmt: str) -> int:
    return ns if fmt == "proto" else (ns + 500) // 1000


def _check_journeys(view: View, wants: list[Want], fmt: str) -> None:
    tracks = {(view.track_group[t], view.track_name[t]): t for t in view.slices}
    assert len(tracks) == len(view.slices) == len(wants), "one track per journey"
    assert view.overlaps == 0
    for w in wants:
        track = tracks[(P._instance_name(*w.instance), w.request_id)]
        slices = [s for s in view.slices[track] if not s.name.startswith("preempts ")]
        assert len(slices) == len(w.spans)
        got = {(s.name, s.ts, s.dur): s for s in slices}
        for span in w.spans:
            ts = _to_unit(span.start_unix_ns, fmt)
            s = got[(span.name, ts, _to_unit(span.end_unix_ns, fmt) - ts)]
            assert (s.parent.name if s.parent else "") == w.parent[span.span_id]
            if s.parent is not None:
                assert s.parent.ts <= s.ts and s.end <= s.parent.end
            args = {k: _plain(v) for k, v in s.args.items()}
            exact = {"start_unix_ns": span.start_unix_ns, "end_unix_ns": span.end_unix_ns}
            if fmt == "json":
                assert {k: args.pop(k) for k in exact} == exact
            if span.name == S.SPAN_REQUEST:
                assert args.pop("trace_id") == span.trace_id
            assert args == {k: _plain(v) for k, v in span.attributes.items()}
        # Per track, slices nest or are disjoint (no partial overlap).
        for a in slices:
            for b in slices:
                if a is not b and a.ts < b.end and b.ts < a.end:
                    inside = a.ts <= b.ts and b.end <= a.end
                    assert inside or (b.ts <= a.ts and a.end <= b.end), (a.name, b.name)


def _check_preemption(view: View, wants: list[Want], fmt: str) -> None:
    tracks = {(view.track_group[t], view.track_name[t]): t for t in view.slices}
    flows_out = {f: s for ss in view.slices.values() for s in ss for f in s.flows_out}
    flows_in = {f: s for ss in view.slices.values() for s in ss for f in s.flows_in}
    preempted = [(w, s) for w in wants for s in w.spans if s.name == S.SPAN_PREEMPTED]
    assert preempted and len(flows_in) == len(flows_out) == len(preempted)
    assert not view.active_flows and not view.dropped_flows
    for w, span in preempted:
        group = P._instance_name(*w.instance)
        target = next(
            s
            for s in view.slices[tracks[(group, w.request_id)]]
            if s.name == S.SPAN_PREEMPTED and s.ts == _to_unit(span.start_unix_ns, fmt)
        )
        assert target.args[S.PREEMPTED_BY] == span.attributes[S.PREEMPTED_BY]
        (fid,) = target.flows_in
        source = flows_out[fid]
        # The arrow starts at the instant on the preempting request's own track,
        # in the same instance, at the moment of the preemption.
        assert source.name == f"preempts {w.request_id}" and source.dur == 0
        assert source.ts == target.ts
        src_track = next(t for t, ss in view.slices.items() if source in ss)
        assert view.track_group[src_track] == group
        assert view.track_name[src_track] == span.attributes[S.PREEMPTED_BY]
        assert source.parent is not None and source.parent.name in (S.SPAN_PREFILL, S.SPAN_DECODE)


def _check_counters(view: View, steps: list[FileSpan], fmt: str) -> None:
    assert steps, "precondition: the step view is on"
    want: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for s in sorted(steps, key=lambda s: s.start_unix_ns):
        group = P._instance_name(*P._instance(s.resource))
        for name, key in P.COUNTERS:
            want[(group, name)].append((_to_unit(s.start_unix_ns, fmt), s.attributes[key]))
    assert {k: sorted(v) for k, v in view.counters.items()} == {
        k: sorted(v) for k, v in want.items()
    }
    assert len(view.counters) == 2 * len(P.COUNTERS)  # per instance


@pytest.mark.parametrize("fmt", ["proto", "json"])
@journeys_from_vllm
def test_journeys_tracks_slices_flows_counters(
    traced: tuple[list[Path], Path], tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    files, _ = traced
    out = tmp_path / ("t.perfetto-trace" if fmt == "proto" else "t.json")
    if fmt == "proto":
        pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2")
    assert _cli([*map(str, files), "-o", str(out)]) == 0  # the format from the suffix
    wants, steps = _journeys(files)
    assert f"{len(wants)} of {len(wants)} journeys, {len(steps)} steps ({fmt})" in (
        capsys.readouterr().out
    )
    view = _proto_view(out.read_bytes()) if fmt == "proto" else _json_view(out.read_bytes())
    assert set(view.track_group.values()) >= {"vllm " + OTHER_HOST + " dp=0"}
    assert len({w.request_id for w in wants}) == len(wants) // 2, "same ids, two instances"
    _check_journeys(view, wants, fmt)
    _check_preemption(view, wants, fmt)
    _check_counters(view, steps, fmt)
    waits = [s for ss in view.slices.values() for s in ss if s.name == S.SPAN_WAIT]
    assert waits and all(w.parent and w.parent.name == S.SPAN_QUEUED for w in waits)


@journeys_from_vllm
def test_span_order_and_duplicates_do_not_matter(
    traced: tuple[list[Path], Path], tmp_path: Path
) -> None:
    files, reverse = traced
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert _cli([str(files[0]), "-o", str(a)]) == 0
    assert _cli([str(reverse), "-o", str(b)]) == 0

    def events(path: Path) -> list[str]:
        # Journeys are written as they complete, so in another order; flow ids too.
        doc = json.loads(path.read_bytes())
        return sorted(
            json.dumps({k: v for k, v in e.items() if k != "id"}) for e in doc["traceEvents"]
        )

    assert events(a) == events(b)
    # The same file twice: each journey once (step counters are not deduplicated).
    assert _cli([str(files[0]), str(files[0]), "-o", str(b)]) == 0
    assert [e for e in events(a) if '"C"' not in e] == [e for e in events(b) if '"C"' not in e]


@journeys_from_vllm
def test_limit_keeps_the_slowest(traced: tuple[list[Path], Path], tmp_path: Path) -> None:
    files, _ = traced
    out = tmp_path / "slow.json"
    assert _cli([str(files[0]), "-o", str(out), "--limit", "3"]) == 0
    view = _json_view(out.read_bytes())
    roots = [s for s in read_spans(files[:1]) if s.name == S.SPAN_REQUEST]
    roots.sort(key=lambda s: s.start_unix_ns - s.end_unix_ns)
    assert sorted(view.track_name.values()) == sorted(r.attributes[S.REQUEST_ID] for r in roots[:3])
    wants = [w for w in _journeys(files[:1])[0] if w.request_id in view.track_name.values()]
    _check_journeys(view, wants, "json")


@journeys_from_vllm
def test_without_the_perfetto_package(
    traced: tuple[list[Path], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    files, _ = traced
    monkeypatch.setattr(P, "_proto_modules", lambda: "no perfetto here")
    out = tmp_path / "t.perfetto-trace"
    assert _cli([str(files[0]), "-o", str(out), "--format", "proto"]) == 2
    assert "no perfetto here" in capsys.readouterr().err and not out.exists()
    assert _cli([str(files[0]), "-o", str(out)]) == 0
    assert "writing Chrome JSON instead" in capsys.readouterr().err
    assert json.loads(out.read_bytes())["traceEvents"]


def test_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o.json"
    assert _cli([str(tmp_path / "missing.jsonl"), "-o", str(out)]) == 2
    assert "cannot open" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("{not json\n")
    assert _cli([str(empty), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "empty.jsonl:1: not an OTLP/JSON trace line" in err and "no vllm.request" in err
    assert not out.exists()
    assert _cli([str(empty), "-o", str(out), "--limit", "-1"]) == 2
    with pytest.raises(SystemExit):
        _cli(["--help"])
    assert "--limit" in capsys.readouterr().out


def test_memory_grows_little_with_the_journeys(tmp_path: Path) -> None:
    """Journeys from the real journey model and file exporter (tests/records.py):
    three times the journeys (and file) cost pass 1 a few hundred bytes a journey
    more, pass 2 nothing: the peak is one decoded trace line, not the file."""
    from records import write_trace_file

    peaks, sizes = [], []
    for n in (1500, 4500):
        trace, out = tmp_path / f"{n}.jsonl", tmp_path / f"{n}.json"
        write_trace_file(trace, n)
        tracemalloc.start()
        try:
            assert _cli([str(trace), "-o", str(out), "--limit", "100"]) == 0
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        sizes.append(trace.stat().st_size)
        view = _json_view(out.read_bytes())
        assert len(view.slices) == 100 and view.overlaps == 0
    assert peaks[1] - peaks[0] < (sizes[1] - sizes[0]) / 5, (peaks, sizes)
