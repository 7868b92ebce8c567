"""Journeys out of trace files: two passes over the spans, bounded memory.

Runs in the CLI's process (one thread). Times are the spans' epoch ns
(``*_unix_ns``); figures are milliseconds.

A journey is what one user request went through: its ``vllm.api.request`` and
the engine's ``vllm.request`` under it where the file has the API server's
part, else the engine's ``vllm.request`` alone (API spans off, older files).
Under an API request with several engine requests (n>1) the one that ended
last is the journey's engine part (the user waited for it).

Pass 1 keeps a few numbers per journey (:class:`Journey`) and, per cycle or
queued/preempted span, its root and kind; pass 2 reads the phases again, for
the chosen journeys' explanations (:func:`explanations`) or for every
journey's causes (:func:`journey_causes`, what ``explain`` on a whole file and
``diff`` add up). ``read(attributes_of)`` must return a fresh span iterator
each call.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from vllm_journey_otel import schema as S
from vllm_journey_otel.tools.explain import (
    AS_CAUSE,
    CHILDREN,
    DECODE,
    EXPLAIN_ATTRIBUTES,
    GRANDCHILDREN,
    PREFILL,
    RECOMPUTE,
    WAIT,
    ApiSides,
    Bounds,
    Explanation,
    api_sides_of,
    edge_segments,
    explain,
)
from vllm_journey_otel.tools.tracefile import FileSpan

Reader = Callable[[frozenset[str] | None], Iterable[FileSpan]]
# Pass 1 reads the attributes of these only (the roots, the cycles' kinds, the
# API server's read before vLLM's stamp).
_PASS1 = frozenset({S.SPAN_REQUEST, S.SPAN_SCHEDULED, S.SPAN_API, S.SPAN_API_INPUT})
# Ways to rank journeys for --slowest.
BY_E2E = "e2e"
BY_TTFT = "ttft"
GROUPS = ("model", "lora", "dp_rank", "instance", "kv_role")


@dataclass
class Selection:
    """Which journeys to explain one by one."""

    request_ids: frozenset[str] = frozenset()
    trace_ids: frozenset[str] = frozenset()
    slowest: int = 0
    by: str = BY_E2E  # BY_E2E: the outermost span's duration; BY_TTFT: server TTFT


class _Root(NamedTuple):
    """What pass 1 keeps of an engine root: a few fields, not its attributes."""

    span_id: str
    trace_id: str
    request_id: str
    start_unix_ns: int
    end_unix_ns: int
    parent_span_id: str
    ttft_ms: float | None
    output_tokens: int | None
    groups: tuple[str, ...]


class Journey(NamedTuple):
    """One user request: the engine's root and/or the API server's part."""

    engine: _Root | None
    api: ApiSides | None

    @property
    def start(self) -> int:
        return self.api.start if self.api else self.engine.start_unix_ns  # type: ignore[union-attr]

    @property
    def end(self) -> int:
        return self.api.end if self.api else self.engine.end_unix_ns  # type: ignore[union-attr]

    @property
    def e2e_ms(self) -> float:
        return (self.end - self.start) / 1e6

    @property
    def ttft_ms(self) -> float | None:
        """Server TTFT: the API server's (receipt to the engine's first token
        there), where the file has the API server's part; else the engine's."""
        if self.api is not None:
            return self.api.ttft_ms
        return self.engine.ttft_ms if self.engine else None

    @property
    def request_id(self) -> str:
        if self.engine is not None:
            return self.engine.request_id
        return self.api.request_ids[0] if self.api and self.api.request_ids else ""

    @property
    def trace_id(self) -> str:
        return self.api.trace_id if self.api else self.engine.trace_id  # type: ignore[union-attr]

    def key(self, by: str) -> float:
        if by == BY_TTFT:
            t = self.ttft_ms
            return -1.0 if t is None else t  # not observed ranks last
        return self.e2e_ms


def _opt(a: dict[str, Any], key: str, kind: type) -> Any:
    v = a.get(key)
    return None if v is None else kind(v)


def _groups(s: FileSpan) -> tuple[str, ...]:
    r = s.resource
    return (
        str(r.get(S.RES_MODEL, "")),
        str(s.attributes.get(S.LORA_NAME, "")),
        str(r.get(S.RES_DP_RANK, "")),
        str(r.get(S.RES_HOST, "")),
        str(r.get(S.RES_KV_ROLE, "")),
    )


class JourneyIndex:
    """Every journey, and each child span's root and kind (by span id): the
    span's name, or ``resume`` for a cycle resumed after a preemption.

    An engine root belongs to the API request it is a child of (head-sampled)
    or, when it is a root of its own (kept by the engine's tail rule, linked),
    to the API request that names its request id in ``vllm.api.request_ids``."""

    def __init__(self, read: Reader) -> None:
        self.root_of: dict[str, tuple[str, str]] = {}
        roots: list[_Root] = []
        apis: dict[str, FileSpan] = {}  # attributes dropped: a few fields kept
        inputs: dict[str, tuple[int, Any]] = {}
        outputs: dict[str, int] = {}
        for s in read(_PASS1):
            if s.name == S.SPAN_REQUEST:
                a = s.attributes
                rid = str(a.get(S.REQUEST_ID, ""))
                ttft, tokens = _opt(a, S.TTFT_MS, float), _opt(a, S.GEN_AI_OUTPUT_TOKENS, int)
                roots.append(
                    _Root(s.span_id, s.trace_id, rid, s.start_unix_ns, s.end_unix_ns,
                          s.parent_span_id, ttft, tokens, _groups(s))
                )  # fmt: skip
            elif s.name in CHILDREN:
                resumed = s.attributes.get(S.SCHEDULE_KIND) == S.SCHEDULE_RESUME
                self.root_of[s.span_id] = (s.parent_span_id, "resume" if resumed else s.name)
            elif s.name == S.SPAN_API:
                apis[s.span_id] = s._replace(attributes=_api_attributes(s.attributes))
            elif s.name == S.SPAN_API_INPUT:
                inputs[s.parent_span_id] = (s.end_unix_ns, s.attributes.get(S.API_READ_MS))
            elif s.name == S.SPAN_API_OUTPUT:
                outputs[s.parent_span_id] = s.start_unix_ns
        self.journeys = _join(roots, apis, inputs, outputs)


_API_KEYS = (S.API_TTFT_MS, S.API_TTFB_MS, S.API_REQUEST_IDS, S.API_E2E_MS)


def _api_attributes(a: dict[str, Any]) -> dict[str, Any]:
    return {k: a[k] for k in _API_KEYS if k in a}


def _join(
    roots: list[_Root],
    apis: dict[str, FileSpan],
    inputs: dict[str, tuple[int, Any]],
    outputs: dict[str, int],
) -> list[Journey]:
    """Engine roots and API requests as journeys (see :class:`JourneyIndex`)."""
    api_of_request = {
        str(rid): span_id
        for span_id, s in apis.items()
        for rid in s.attributes.get(S.API_REQUEST_IDS) or ()
    }
    under: dict[str, list[_Root]] = {}
    journeys: list[Journey] = []
    for r in roots:
        if r.parent_span_id in apis:
            owner: str | None = r.parent_span_id
        else:  # a root of its own only when kept by the tail rule: joined by request id
            owner = None if r.parent_span_id else api_of_request.get(r.request_id)
        if owner is not None:
            under.setdefault(owner, []).append(r)
        else:
            journeys.append(Journey(r, None))
    for span_id, s in apis.items():
        engines = under.get(span_id, [])
        api = api_sides_of(s, inputs.get(span_id), outputs.get(span_id), len(engines))
        journeys.append(Journey(max(engines, key=lambda r: r.end_unix_ns, default=None), api))
    return journeys


def _chosen(journeys: list[Journey], sel: Selection) -> list[Journey]:
    def named(j: Journey) -> bool:
        ids = {j.request_id, *(j.api.request_ids if j.api else ())}
        return bool(ids & sel.request_ids) or j.trace_id in sel.trace_ids

    picked = [j for j in journeys if named(j)]
    if sel.slowest:
        slow = heapq.nlargest(sel.slowest, journeys, key=lambda j: j.key(sel.by))
        picked += [j for j in slow if j not in picked]
    return picked


def explanations(read: Reader, sel: Selection) -> tuple[list[Explanation], int]:
    """The journeys ``sel`` names, explained, and how many the files hold."""
    p1 = JourneyIndex(read)
    chosen = _chosen(p1.journeys, sel)
    spans: dict[str, list[FileSpan]] = {j.engine.span_id: [] for j in chosen if j.engine}
    full: dict[str, FileSpan] = {}
    if spans:
        for s in read(EXPLAIN_ATTRIBUTES):
            if s.name == S.SPAN_REQUEST:
                if s.span_id in spans:
                    full[s.span_id] = s
                continue
            if s.name in CHILDREN:
                owner = s.parent_span_id
            elif s.name in GRANDCHILDREN:
                owner = p1.root_of.get(s.parent_span_id, ("", ""))[0]
            else:
                continue
            if owner in spans:
                spans[owner].append(s)
    out = []
    for j in chosen:
        root = full.get(j.engine.span_id) if j.engine else None
        out.append(explain(root, spans.get(root.span_id, []) if root else [], j.api))
    return out, len(p1.journeys)


class _Tally:
    """One engine root's causes, added up span by span in any order (a few
    numbers); ``clip``: the outermost span's end, past which nothing counts."""

    __slots__ = ("causes", "clip", "first_start", "last_end")

    def __init__(self, clip: int | None) -> None:
        self.causes: dict[str, float] = {}
        self.clip = clip
        self.first_start: int | None = None
        self.last_end: int | None = None

    def add(self, cause: str, span: FileSpan, sign: float = 1.0) -> None:
        a, b = span.start_unix_ns, span.end_unix_ns
        if self.clip is not None:
            if a >= self.clip:  # wholly after the last byte: no part of the journey (as _clip)
                return
            b = min(b, self.clip)
        self.causes[cause] = self.causes.get(cause, 0.0) + sign * (b - a) / 1e6

    def child(self, span: FileSpan) -> None:
        if self.first_start is None or span.start_unix_ns < self.first_start:
            self.first_start = span.start_unix_ns
        if self.last_end is None or span.end_unix_ns > self.last_end:
            self.last_end = span.end_unix_ns


def _tally(s: FileSpan, tallies: dict[str, _Tally], root_of: dict[str, tuple[str, str]]) -> None:
    if s.name in CHILDREN:
        t = tallies.get(s.parent_span_id)
        if t is not None:
            t.child(s)
            if s.name in AS_CAUSE:
                t.add(AS_CAUSE[s.name], s)
        return
    owner, kind = root_of.get(s.parent_span_id, ("", ""))
    t = tallies.get(owner)
    if t is None:
        return
    if s.name == S.SPAN_WAIT and kind in AS_CAUSE:
        t.add(WAIT + str(s.attributes.get(S.WAIT_REASON, "unknown")), s)
        t.add(AS_CAUSE[kind], s, -1.0)  # the wait is carved out of its parent
    elif s.name == S.SPAN_PREFILL:
        t.add(RECOMPUTE if kind == "resume" else PREFILL, s)
    elif s.name == S.SPAN_DECODE:
        t.add(DECODE, s)


class JourneyCauses(NamedTuple):
    """One journey's figures, as ``explain`` would split it (ms)."""

    journey: Journey
    causes: dict[str, float]  # tiles the outermost span
    phases_observed: bool  # the engine's phases are in the file


def journey_causes(read: Reader) -> tuple[Iterator[JourneyCauses], int]:
    """Every journey's causes (the same figures :func:`explain` gives it, added
    up span by span: a few numbers per journey), and how many there are."""
    p1 = JourneyIndex(read)
    tallies = {
        j.engine.span_id: _Tally(j.api.end if j.api else None) for j in p1.journeys if j.engine
    }
    for s in read(frozenset({S.SPAN_WAIT})):
        if s.name in CHILDREN or s.name in GRANDCHILDREN:
            _tally(s, tallies, p1.root_of)

    def each() -> Iterator[JourneyCauses]:
        for j in p1.journeys:
            t = tallies.get(j.engine.span_id) if j.engine else None
            first = t.first_start if t else None
            last = t.last_end if t else None
            causes = dict(t.causes) if t else {}
            bounds = Bounds(j.start, j.end, first, last)
            before, after = edge_segments(bounds, j.api, j.start, j.engine is not None)
            for seg in (*before, *after):
                causes[seg.cause] = causes.get(seg.cause, 0.0) + seg.ms
            yield JourneyCauses(j, causes, first is not None)

    return each(), len(p1.journeys)


@dataclass
class FileShare:
    """Where all the request-time of a file went, and who dominates each cause."""

    journeys: int
    total_ms: float
    by_cause_ms: dict[str, float]
    top: dict[str, list[tuple[str, float]]]  # cause -> [(request id, ms)], largest first
    outermost: dict[str, int]  # journeys by the span their causes tile

    def to_dict(self) -> dict[str, Any]:
        total = self.total_ms or 1.0
        return {
            "journeys": self.journeys,
            "request_time_ms": self.total_ms,
            "outermost": self.outermost,
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


def file_share(read: Reader, top: int = 3) -> FileShare:
    """Each cause's share of all request-time in the files (the outermost spans:
    ``vllm.api.request`` where the file has it), and its ``top`` largest requests.
    Streaming: a few numbers per journey, whatever the spans' order."""
    each, n = journey_causes(read)
    by_cause: dict[str, float] = {}
    heaps: dict[str, list[tuple[float, str]]] = {}
    outermost = {S.SPAN_API: 0, S.SPAN_REQUEST: 0}
    total = 0.0
    for jc in each:
        j = jc.journey
        total += j.e2e_ms
        outermost[S.SPAN_API if j.api else S.SPAN_REQUEST] += 1
        for cause, ms in jc.causes.items():
            by_cause[cause] = by_cause.get(cause, 0.0) + ms
            heap = heaps.setdefault(cause, [])
            if len(heap) < top:
                heapq.heappush(heap, (ms, j.request_id))
            elif (ms, j.request_id) > heap[0]:
                heapq.heapreplace(heap, (ms, j.request_id))
    tops = {c: [(rid, ms) for ms, rid in sorted(h, reverse=True)] for c, h in heaps.items()}
    return FileShare(n, total, by_cause, tops, outermost)
