"""Where a request's time went, from its spans: the figures of ``vllm-journey explain``.

Runs in the CLI's process (one thread). Times are the spans' epoch nanoseconds
(``*_unix_ns``); figures are milliseconds. Pure: works on
:class:`~vllm_journey_otel.tools.tracefile.FileSpan` records.

A journey's time is split into causes that tile its root span: before the
engine (the root's start, vLLM's arrival time in the API server, to the
scheduler's admission), queued (less the waits inside it, each a cause of its
own: ``wait:<reason>``), prefill, decode, preempted (less its waits), recompute
(the prefill of a cycle resumed after a preemption), and after the engine (the
last phase's end to the root's end). Every figure comes from a span or its
attributes; what the spans do not say is ``None`` ("not observed"), never 0.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from vllm_journey_otel import schema as S
from vllm_journey_otel.tools.tracefile import FileSpan

BEFORE = "before_engine"
QUEUED = "queued"
PREFILL = "prefill"
DECODE = "decode"
PREEMPTED = "preempted"
RECOMPUTE = "recompute"
AFTER = "after_engine"
WAIT = "wait:"  # + the wait's reason
# The causes, in the order of a journey (waits take their reason's name).
CAUSES = (BEFORE, QUEUED, PREFILL, DECODE, PREEMPTED, RECOMPUTE, AFTER)
LABELS = {
    BEFORE: "before the engine",
    QUEUED: "queued",
    PREFILL: "prefill",
    DECODE: "decode",
    PREEMPTED: "preempted",
    RECOMPUTE: "recompute prefill",
    AFTER: "after the engine",
}
# Spans whose attributes the explanation reads (the others come without).
EXPLAIN_ATTRIBUTES = frozenset(
    {S.SPAN_REQUEST, S.SPAN_SCHEDULED, S.SPAN_QUEUED, S.SPAN_PREEMPTED, S.SPAN_PREFILL,
     S.SPAN_DECODE, S.SPAN_WAIT}
)  # fmt: skip
_CHILDREN = (S.SPAN_QUEUED, S.SPAN_SCHEDULED, S.SPAN_PREEMPTED)
_GRANDCHILDREN = (S.SPAN_PREFILL, S.SPAN_DECODE, S.SPAN_WAIT)


def _ms(ns: int) -> float:
    return ns / 1e6


def label(cause: str) -> str:
    """A cause in words: ``wait:lora_slot`` -> ``waiting for lora_slot``."""
    if cause.startswith(WAIT):
        return f"waiting for {cause[len(WAIT) :]}"
    return LABELS.get(cause, cause)


@dataclass
class Segment:
    """One stretch of the journey: a cause, from and to (ms after the root's start)."""

    cause: str
    start_ms: float
    end_ms: float

    @property
    def ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass
class Preemption:
    """One preemption, as its span says."""

    at_ms: float  # after the root's start
    preempted_ms: float  # time spent preempted (its span)
    by: str | None  # the request whose KV allocation forced it; None: not named
    kv_cache_usage: float | None
    num_running: int | None
    num_waiting: int | None
    # The prefill of the cycle that resumed it (None: it never resumed).
    recompute_ms: float | None = None


_ADMISSION = ("kv_cache_usage", "num_running", "num_waiting")


@dataclass
class Explanation:
    """Everything ``explain`` says about one journey."""

    request_id: str
    trace_id: str
    status: str
    e2e_ms: float
    input_tokens: int | None
    cached_tokens: int | None
    output_tokens: int | None
    segments: list[Segment] = field(default_factory=list)
    # What the engine looked like at admission (the first vllm.queued): KV-cache
    # usage, running and waiting requests (this one among them).
    admission: tuple[float | None, int | None, int | None] | None = None
    preemptions: list[Preemption] = field(default_factory=list)
    prefill_chunks: int | None = None
    prefill_cached_tokens: int | None = None
    decode_tokens: int | None = None
    spec_acceptance: float | None = None

    def by_cause(self) -> dict[str, float]:
        """Milliseconds per cause, in journey order."""
        out: dict[str, float] = {}
        for s in self.segments:
            out[s.cause] = out.get(s.cause, 0.0) + s.ms
        return out

    @property
    def decode_ms_per_token(self) -> float | None:
        decode = self.by_cause().get(DECODE)
        if decode is None or not self.decode_tokens:
            return None
        return decode / self.decode_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "trace_id": self.trace_id,
            "status": self.status,
            "e2e_ms": self.e2e_ms,
            "input_tokens": self.input_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "by_cause_ms": self.by_cause(),
            "segments": [[s.cause, s.start_ms, s.end_ms] for s in self.segments],
            "admission": None
            if self.admission is None
            else dict(
                zip(("kv_cache_usage", "num_running", "num_waiting"), self.admission, strict=True)
            ),
            "preemptions": [vars(p) for p in self.preemptions],
            "prefill_chunks": self.prefill_chunks,
            "prefill_cached_tokens": self.prefill_cached_tokens,
            "decode_tokens": self.decode_tokens,
            "decode_ms_per_token": self.decode_ms_per_token,
            "spec_acceptance_rate": self.spec_acceptance,
        }


def _opt_int(a: dict[str, Any], key: str) -> int | None:
    return int(a[key]) if key in a else None


def _opt_float(a: dict[str, Any], key: str) -> float | None:
    return float(a[key]) if key in a else None


def _carve(span: FileSpan, cause: str, waits: list[FileSpan], t0: int, out: list[Segment]) -> None:
    """A queued or preempted span as segments: its waits, and the rest as ``cause``."""
    t = span.start_unix_ns
    for w in sorted(waits, key=lambda w: w.start_unix_ns):
        a, b = max(t, w.start_unix_ns), min(span.end_unix_ns, w.end_unix_ns)
        if b <= a:
            continue
        if a > t:
            out.append(Segment(cause, _ms(t - t0), _ms(a - t0)))
        reason = str(w.attributes.get(S.WAIT_REASON, "unknown"))
        out.append(Segment(WAIT + reason, _ms(a - t0), _ms(b - t0)))
        t = b
    if span.end_unix_ns > t:
        out.append(Segment(cause, _ms(t - t0), _ms(span.end_unix_ns - t0)))


def explain(root: FileSpan, spans: Iterable[FileSpan]) -> Explanation:
    """The explanation of one journey: its root and the spans below it."""
    a = root.attributes
    t0 = root.start_unix_ns
    kids: dict[str, list[FileSpan]] = {}
    for s in spans:
        kids.setdefault(s.parent_span_id, []).append(s)
    # The journey's phases (an in-flight snapshot under the root is no phase).
    children = sorted(
        (c for c in kids.get(root.span_id, []) if c.name in _CHILDREN),
        key=lambda s: s.start_unix_ns,
    )
    e = Explanation(
        str(a.get(S.REQUEST_ID, "")),
        root.trace_id,
        str(a.get(S.FINISH_STATUS, "unknown")),
        _ms(root.end_unix_ns - root.start_unix_ns),
        _opt_int(a, S.GEN_AI_INPUT_TOKENS),
        _opt_int(a, S.GEN_AI_CACHE_READ_TOKENS),
        _opt_int(a, S.GEN_AI_OUTPUT_TOKENS),
        spec_acceptance=_opt_float(a, S.SPEC_ACCEPTANCE_RATE),
    )
    if children and children[0].start_unix_ns > t0:
        e.segments.append(Segment(BEFORE, 0.0, _ms(children[0].start_unix_ns - t0)))
    resume_pending: Preemption | None = None
    for c in children:
        below = sorted(kids.get(c.span_id, []), key=lambda s: s.start_unix_ns)
        if c.name == S.SPAN_QUEUED:
            if e.admission is None:
                e.admission = (
                    _opt_float(c.attributes, S.KV_CACHE_USAGE),
                    _opt_int(c.attributes, S.NUM_RUNNING),
                    _opt_int(c.attributes, S.NUM_WAITING),
                )
            _carve(c, QUEUED, [s for s in below if s.name == S.SPAN_WAIT], t0, e.segments)
        elif c.name == S.SPAN_PREEMPTED:
            p = _preemption(c, t0)
            e.preemptions.append(p)
            resume_pending = p
            _carve(c, PREEMPTED, [s for s in below if s.name == S.SPAN_WAIT], t0, e.segments)
        elif c.name == S.SPAN_SCHEDULED:
            resumed = c.attributes.get(S.SCHEDULE_KIND) == S.SCHEDULE_RESUME
            _cycle(e, below, resumed, resume_pending, t0)
            resume_pending = None
    last_end = max((c.end_unix_ns for c in children), default=t0)
    if children and root.end_unix_ns > last_end:
        e.segments.append(Segment(AFTER, _ms(last_end - t0), e.e2e_ms))
    return e


def _preemption(span: FileSpan, t0: int) -> Preemption:
    a = span.attributes
    by = a.get(S.PREEMPTED_BY)
    return Preemption(
        _ms(span.start_unix_ns - t0),
        _ms(span.end_unix_ns - span.start_unix_ns),
        str(by) if by is not None else None,
        _opt_float(a, S.KV_CACHE_USAGE),
        _opt_int(a, S.NUM_RUNNING),
        _opt_int(a, S.NUM_WAITING),
    )


def _cycle(
    e: Explanation, below: list[FileSpan], resumed: bool, pre: Preemption | None, t0: int
) -> None:
    """A running cycle: its prefill (a recompute after a preemption) and decode."""
    prefill_done: int | None = None
    for s in below:
        start, end = _ms(s.start_unix_ns - t0), _ms(s.end_unix_ns - t0)
        if s.name == S.SPAN_PREFILL:
            e.segments.append(Segment(RECOMPUTE if resumed else PREFILL, start, end))
            prefill_done = _opt_int(s.attributes, S.DECODE_DONE_TOKENS)
            if resumed and pre is not None:
                pre.recompute_ms = end - start
            elif not resumed and e.prefill_chunks is None:
                e.prefill_chunks = _opt_int(s.attributes, S.PREFILL_CHUNKS)
                e.prefill_cached_tokens = _opt_int(s.attributes, S.CACHED_TOKENS)
        elif s.name == S.SPAN_DECODE:
            e.segments.append(Segment(DECODE, start, end))
            done = _opt_int(s.attributes, S.DECODE_DONE_TOKENS)
            if done is not None and prefill_done is not None:
                e.decode_tokens = (e.decode_tokens or 0) + max(0, done - prefill_done)


# ---------------------------------------------------------------------------
# Reading journeys out of trace files (two passes, bounded memory)
# ---------------------------------------------------------------------------
Reader = Callable[[frozenset[str] | None], Iterable[FileSpan]]
# Pass 1 reads the attributes of these only (the roots, and the cycles' kinds).
_PASS1 = frozenset({S.SPAN_REQUEST, S.SPAN_SCHEDULED})


@dataclass
class Selection:
    """Which journeys to explain one by one."""

    request_ids: frozenset[str] = frozenset()
    trace_ids: frozenset[str] = frozenset()
    slowest: int = 0


class _Root(NamedTuple):
    """What pass 1 keeps of a root: a few fields, not its attributes."""

    span_id: str
    trace_id: str
    request_id: str
    start_unix_ns: int
    end_unix_ns: int


def _pass1(read: Reader) -> tuple[list[_Root], dict[str, tuple[str, str]]]:
    """Every root, and each child span's root and kind (by span id): the span's
    name, or ``resume`` for a cycle resumed after a preemption."""
    roots: list[_Root] = []
    root_of: dict[str, tuple[str, str]] = {}
    for s in read(_PASS1):
        if s.name == S.SPAN_REQUEST:
            rid = str(s.attributes.get(S.REQUEST_ID, ""))
            roots.append(_Root(s.span_id, s.trace_id, rid, s.start_unix_ns, s.end_unix_ns))
        elif s.name in _CHILDREN:
            resumed = s.attributes.get(S.SCHEDULE_KIND) == S.SCHEDULE_RESUME
            root_of[s.span_id] = (s.parent_span_id, "resume" if resumed else s.name)
    return roots, root_of


def _chosen(roots: list[_Root], sel: Selection) -> list[_Root]:
    picked = [r for r in roots if r.request_id in sel.request_ids or r.trace_id in sel.trace_ids]
    if sel.slowest:
        slow = heapq.nlargest(sel.slowest, roots, key=lambda r: r.end_unix_ns - r.start_unix_ns)
        picked += [r for r in slow if r not in picked]
    return picked


def explanations(read: Reader, sel: Selection) -> tuple[list[Explanation], int]:
    """The journeys ``sel`` names, explained, and how many the files hold."""
    roots, root_of = _pass1(read)
    chosen = _chosen(roots, sel)
    spans: dict[str, list[FileSpan]] = {r.span_id: [] for r in chosen}
    full: dict[str, FileSpan] = {}
    if spans:
        for s in read(EXPLAIN_ATTRIBUTES):
            if s.name == S.SPAN_REQUEST:
                if s.span_id in spans:
                    full[s.span_id] = s
                continue
            if s.name in _CHILDREN:
                owner = s.parent_span_id
            elif s.name in _GRANDCHILDREN:
                owner = root_of.get(s.parent_span_id, ("", ""))[0]
            else:
                continue
            if owner in spans:
                spans[owner].append(s)
    return [explain(full[r.span_id], spans[r.span_id]) for r in chosen], len(roots)


@dataclass
class FileShare:
    """Where all the request-time of a file went, and who dominates each cause."""

    journeys: int
    total_ms: float
    by_cause_ms: dict[str, float]
    top: dict[str, list[tuple[str, float]]]  # cause -> [(request id, ms)], largest first

    def to_dict(self) -> dict[str, Any]:
        total = self.total_ms or 1.0
        return {
            "journeys": self.journeys,
            "request_time_ms": self.total_ms,
            "causes": [
                {
                    "cause": cause,
                    "ms": ms,
                    "share": ms / total,
                    "top": [{"request_id": r, "ms": m} for r, m in self.top.get(cause, [])],
                }
                for cause, ms in sorted(self.by_cause_ms.items(), key=lambda kv: -kv[1])
            ],
        }


class _Tally:
    """One root's causes, added up span by span in any order (a few numbers)."""

    __slots__ = ("causes", "first_start", "last_end")

    def __init__(self) -> None:
        self.causes: dict[str, float] = {}
        self.first_start: int | None = None
        self.last_end: int | None = None

    def add(self, cause: str, ms: float) -> None:
        self.causes[cause] = self.causes.get(cause, 0.0) + ms

    def child(self, span: FileSpan) -> None:
        if self.first_start is None or span.start_unix_ns < self.first_start:
            self.first_start = span.start_unix_ns
        if self.last_end is None or span.end_unix_ns > self.last_end:
            self.last_end = span.end_unix_ns


_AS_CAUSE = {S.SPAN_QUEUED: QUEUED, S.SPAN_PREEMPTED: PREEMPTED}


def _tally(s: FileSpan, tallies: dict[str, _Tally], root_of: dict[str, tuple[str, str]]) -> None:
    ms = _ms(s.end_unix_ns - s.start_unix_ns)
    if s.name in _CHILDREN:
        t = tallies.get(s.parent_span_id)
        if t is not None:
            t.child(s)
            if s.name in _AS_CAUSE:
                t.add(_AS_CAUSE[s.name], ms)
        return
    owner, kind = root_of.get(s.parent_span_id, ("", ""))
    t = tallies.get(owner)
    if t is None:
        return
    if s.name == S.SPAN_WAIT and kind in _AS_CAUSE:
        t.add(WAIT + str(s.attributes.get(S.WAIT_REASON, "unknown")), ms)
        t.add(_AS_CAUSE[kind], -ms)  # the wait is carved out of its parent
    elif s.name == S.SPAN_PREFILL:
        t.add(RECOMPUTE if kind == "resume" else PREFILL, ms)
    elif s.name == S.SPAN_DECODE:
        t.add(DECODE, ms)


def file_share(read: Reader, top: int = 3) -> FileShare:
    """Each cause's share of all request-time in the files, and its ``top`` largest
    requests. Streaming: a few numbers per journey, whatever the spans' order."""
    roots, root_of = _pass1(read)
    tallies = {r.span_id: _Tally() for r in roots}
    for s in read(frozenset({S.SPAN_WAIT})):
        if s.name in _CHILDREN or s.name in _GRANDCHILDREN:
            _tally(s, tallies, root_of)
    by_cause: dict[str, float] = {}
    heaps: dict[str, list[tuple[float, str]]] = {}
    for r in roots:
        t = tallies[r.span_id]
        # As explain() does: only a stretch that is there.
        if t.first_start is not None and t.first_start > r.start_unix_ns:
            t.add(BEFORE, _ms(t.first_start - r.start_unix_ns))
        if t.last_end is not None and r.end_unix_ns > t.last_end:
            t.add(AFTER, _ms(r.end_unix_ns - t.last_end))
        rid = r.request_id
        for cause, ms in t.causes.items():
            by_cause[cause] = by_cause.get(cause, 0.0) + ms
            heap = heaps.setdefault(cause, [])
            if len(heap) < top:
                heapq.heappush(heap, (ms, rid))
            elif (ms, rid) > heap[0]:
                heapq.heapreplace(heap, (ms, rid))
    total = sum(_ms(r.end_unix_ns - r.start_unix_ns) for r in roots)
    tops = {c: [(rid, ms) for ms, rid in sorted(h, reverse=True)] for c, h in heaps.items()}
    return FileShare(len(roots), total, by_cause, tops)
