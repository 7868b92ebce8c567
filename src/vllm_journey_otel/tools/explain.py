"""Where a request's time went, from its spans: the figures of ``vllm-journey explain``.

Runs in the CLI's process (one thread). Times are the spans' epoch nanoseconds
(``*_unix_ns``); figures are milliseconds. Pure: works on
:class:`~vllm_journey_otel.tools.tracefile.FileSpan` records; reading them out
of files is ``tools/journey_files.py``.

A journey's time is split into causes that tile its outermost span. With the
API server's spans (``vllm.api.request``, the default) that is what the user
waited: the read before vLLM's arrival stamp (``api_read``), rendering,
tokenizing and the hand-off to the engine core (``api_render``; ``api_input``
when the split was not observed), the engine's input queue up to admission
(``engine_input``), the engine's phases, the last output's way back to the API
server (``engine_handback``) and the API server's output side (``api_output``).
Without them (API spans off, older files) the outermost span is the engine's
``vllm.request``: before the engine (vLLM's arrival stamp to the scheduler's
admission), the phases, and after the engine (the last phase's end to the
root's end). The engine's phases: queued (less the waits inside it, each a
cause of its own: ``wait:<reason>``), prefill, decode, preempted (less its
waits), recompute (the prefill of a cycle resumed after a preemption). Every
figure comes from a span or its attributes; what the spans do not say is
``None`` ("not observed"), never 0.
"""

from __future__ import annotations

from collections.abc import Iterable
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
# The API server's part (vllm.api.*), where the file has it.
API_READ = "api_read"
API_RENDER = "api_render"
API_INPUT = "api_input"
ENGINE_INPUT = "engine_input"
ENGINE_HANDBACK = "engine_handback"
API_OUTPUT = "api_output"
# The engine's part of a request whose engine spans are not in the file (head
# sampling dropped them, or another file has them): not observed, not a phase.
ENGINE_UNSEEN = "engine_unseen"
# The causes, in the order of a journey (waits take their reason's name).
CAUSES = (
    API_READ, API_RENDER, API_INPUT, ENGINE_INPUT, ENGINE_UNSEEN, BEFORE,
    QUEUED, PREFILL, DECODE, PREEMPTED, RECOMPUTE,
    AFTER, ENGINE_HANDBACK, API_OUTPUT,
)  # fmt: skip
# Before and after the engine, as the API server's spans split them.
API_BEFORE = (API_READ, API_RENDER, API_INPUT, ENGINE_INPUT)
API_AFTER = (ENGINE_HANDBACK, API_OUTPUT)
LABELS = {
    API_READ: "read (before vLLM's stamp)",
    API_RENDER: "render, tokenize, hand-off",
    API_INPUT: "API server's input side",
    ENGINE_INPUT: "engine input queue",
    ENGINE_HANDBACK: "last output to API server",
    ENGINE_UNSEEN: "in the engine (its spans not in the file)",
    API_OUTPUT: "API server's output side",
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
# The engine root's phases, and the spans below them.
CHILDREN = (S.SPAN_QUEUED, S.SPAN_SCHEDULED, S.SPAN_PREEMPTED)
GRANDCHILDREN = (S.SPAN_PREFILL, S.SPAN_DECODE, S.SPAN_WAIT)
# Phases that are causes of their own (less the waits inside them).
AS_CAUSE = {S.SPAN_QUEUED: QUEUED, S.SPAN_PREEMPTED: PREEMPTED}


def _where_and_kv(e: Explanation, root: FileSpan) -> None:
    """The engine's instance (its resource) and its KV hand-off (root attributes)."""
    r, a = root.resource, root.attributes
    parts = [str(r[S.RES_HOST])] if S.RES_HOST in r else []
    if S.RES_DP_RANK in r:
        parts.append(f"data-parallel rank {r[S.RES_DP_RANK]}")
    if S.RES_KV_ROLE in r:
        parts.append(f"{r[S.RES_KV_ROLE]} instance")
    e.where = ", ".join(parts)
    e.kv_role = str(r[S.RES_KV_ROLE]) if S.RES_KV_ROLE in r else None
    e.kv_held_ms = _opt_float(a, S.KV_HELD_MS)
    remote = a.get(S.KV_REMOTE_REQUEST_ID)
    if remote is not None or S.KV_REMOTE_ENGINE_ID in a:
        engine = a.get(S.KV_REMOTE_ENGINE_ID)
        e.kv_from = (f"request {remote}" if remote else "a request it does not name") + (
            f" of engine {engine}" if engine else ""
        )


def _ms(ns: int) -> float:
    return ns / 1e6


def label(cause: str) -> str:
    """A cause in words: ``wait:lora_slot`` -> ``waiting for lora_slot``."""
    if cause.startswith(WAIT):
        return f"waiting for {cause[len(WAIT) :]}"
    return LABELS.get(cause, cause)


@dataclass
class Segment:
    """One stretch of the journey: a cause, from and to (ms after the outermost span's start)."""

    cause: str
    start_ms: float
    end_ms: float

    @property
    def ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass
class Preemption:
    """One preemption, as its span says."""

    at_ms: float  # after the outermost span's start
    preempted_ms: float  # time spent preempted (its span)
    by: str | None  # the request whose KV allocation forced it; None: not named
    kv_cache_usage: float | None
    num_running: int | None
    num_waiting: int | None
    # The prefill of the cycle that resumed it (None: it never resumed).
    recompute_ms: float | None = None


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
    # The span the causes tile: vllm.api.request (what the user waited) where
    # the file has the API server's part, else the engine's vllm.request.
    outermost: str = S.SPAN_REQUEST
    # vllm.api.ttft_ms: receipt to the engine's first token at the API server.
    server_ttft_ms: float | None = None
    # vllm.api.ttfb_ms: receipt to the first response bytes after the hand-off
    # (a stream's first chunk; a whole response's body).
    server_ttfb_ms: float | None = None
    # Engine requests under the API request (n>1: the one that ended last is shown).
    engine_requests: int = 1
    # The API server's input and output sides as their spans say (they can
    # overlap the engine's phases: a request admitted before the API server's
    # hand-off returned; the causes give that stretch to the engine).
    api_input_ms: float | None = None
    api_output_ms: float | None = None
    # The engine's phases went on this long after the last response byte (the
    # API server ended the request itself: a stop string, a client gone).
    engine_after_response_ms: float | None = None
    # Where the engine ran it: host, data-parallel rank, disaggregated role.
    where: str = ""
    # Disaggregated serving: the prefill side's hold of its KV blocks for the
    # decode side (ms, None: not held or not released); the decode side's source.
    kv_held_ms: float | None = None
    kv_from: str | None = None
    kv_role: str | None = None

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
            "outermost": self.outermost,
            "server_ttft_ms": self.server_ttft_ms,
            "server_ttfb_ms": self.server_ttfb_ms,
            "engine_requests": self.engine_requests,
            "api_input_ms": self.api_input_ms,
            "api_output_ms": self.api_output_ms,
            "engine_after_response_ms": self.engine_after_response_ms,
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
            "where": self.where,
            "kv_held_ms": self.kv_held_ms,
            "kv_from": self.kv_from,
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


class ApiSides(NamedTuple):
    """The API server's part of one request (its ``vllm.api.*`` spans), as far
    as the file has it: a few numbers, so a file's worth fit in memory."""

    span_id: str
    trace_id: str
    start: int  # vllm.api.request: receipt
    end: int  # ... the last response byte
    ttft_ms: float | None  # vllm.api.ttft_ms
    ttfb_ms: float | None  # vllm.api.ttfb_ms
    read_ms: float | None  # vllm.api.input's vllm.api.read_ms
    handoff: int | None  # vllm.api.input's end; None: no input side in the file
    output_start: int | None  # vllm.api.output's start; None: no output side
    request_ids: tuple[str, ...] = ()
    engine_requests: int = 1
    responded: bool = True  # a last byte was sent (vllm.api.e2e_ms is set)


def api_sides(
    root: FileSpan, inp: FileSpan | None, out: FileSpan | None, engine_requests: int = 1
) -> ApiSides:
    """The API server's part from its spans: root, input side, output side."""
    read_ms = None if inp is None else inp.attributes.get(S.API_READ_MS)
    return api_sides_of(
        root, None if inp is None else (inp.end_unix_ns, read_ms),
        None if out is None else out.start_unix_ns, engine_requests,
    )  # fmt: skip


def api_sides_of(
    root: FileSpan, inp: tuple[int, Any] | None, output_start: int | None, engines: int = 1
) -> ApiSides:
    """The API server's part from its root span, the input side's end and
    ``vllm.api.read_ms`` (None: no input side), and the output side's start."""
    a = root.attributes
    ttft, ttfb = a.get(S.API_TTFT_MS), a.get(S.API_TTFB_MS)
    ids = tuple(str(i) for i in a.get(S.API_REQUEST_IDS) or ())
    handoff, read_ms = inp if inp is not None else (None, None)
    return ApiSides(
        root.span_id, root.trace_id, root.start_unix_ns, root.end_unix_ns,
        None if ttft is None else float(ttft), None if ttfb is None else float(ttfb),
        None if read_ms is None else float(read_ms),
        handoff, output_start, ids, max(engines, len(ids)), S.API_E2E_MS in a,
    )  # fmt: skip


class Bounds(NamedTuple):
    """Where one journey's outermost span and its engine phases begin and end
    (epoch ns); ``first``/``last``: the first phase's start and the last one's
    end, None without a phase."""

    start: int
    end: int
    first: int | None
    last: int | None


def edge_segments(
    b: Bounds, api: ApiSides | None, t0: int, engine_seen: bool = True
) -> tuple[list[Segment], list[Segment]]:
    """The stretches before the first phase and after the last, as causes.

    With the API server's spans: up to vLLM's arrival stamp (``vllm.api.read_ms``),
    to the hand-off (the input side's end), to admission; after the last phase:
    to the output side's start, to the last byte. Without: before / after the
    engine. Each point is clamped between the previous one and the phases (two
    processes' clocks agree only to a few microseconds), so stretches never
    overlap and, with the phases, tile the outermost span. ``engine_seen``
    False: the engine's spans of an API request are not in the file."""
    before: list[tuple[str, int]] = []
    after: list[tuple[str, int]] = []
    if api is None:
        if b.first is not None:
            before.append((BEFORE, b.first))
            after.append((AFTER, b.end))
    else:
        out = api.output_start
        if api.handoff is not None and api.read_ms is not None:
            arrival = b.start + int(api.read_ms * 1e6)
            before += [(API_READ, arrival), (API_RENDER, api.handoff)]
        elif api.handoff is not None:
            before.append((API_INPUT, api.handoff))
        # Without a phase (aborted before admission) the engine's input queue runs
        # to the output side, or to the end; the engine's spans not in the file,
        # that stretch was not observed.
        admitted = b.first if b.first is not None else (out if out is not None else b.end)
        unseen = not engine_seen and bool(api.request_ids)
        before.append((ENGINE_UNSEEN if unseen else ENGINE_INPUT, admitted))
        after = [(ENGINE_HANDBACK, out)] if out is not None else []
        after.append((API_OUTPUT if out is not None else AFTER, b.end))
    limit = min(b.first, b.end) if b.first is not None else b.end
    head, reached = _stretches(before, b.start, limit, t0)
    tail, _ = _stretches(after, b.last if b.last is not None else reached, b.end, t0)
    return head, tail


def _stretches(
    points: list[tuple[str, int]], cursor: int, limit: int, t0: int
) -> tuple[list[Segment], int]:
    """Consecutive stretches from ``cursor`` to each point in turn (clamped to
    ``limit``), and where they reached."""
    out = []
    for cause, point in points:
        p = min(max(point, cursor), limit)
        if p > cursor:
            out.append(Segment(cause, _ms(cursor - t0), _ms(p - t0)))
        cursor = p
    return out, cursor


def _clip(segments: list[Segment], e2e_ms: float) -> list[Segment]:
    """Phases past the outermost span's end (the engine still working after the
    last response byte: a stop string, a client gone) are cut at it; the
    overrun is reported on its own."""
    return [
        Segment(s.cause, s.start_ms, min(s.end_ms, e2e_ms)) for s in segments if s.start_ms < e2e_ms
    ]


def explain(
    root: FileSpan | None, spans: Iterable[FileSpan], api: ApiSides | None = None
) -> Explanation:
    """The explanation of one journey: its engine root and the spans below it,
    and the API server's part where the file has it (``api``). ``root`` None: a
    request whose engine part is not in the file, or that never reached the
    engine (turned away)."""
    engine_seen = root is not None
    if root is None:
        if api is None:
            raise ValueError("a journey needs its engine root or its API server's part")
        rid = api.request_ids[0] if api.request_ids else ""
        status = "engine spans not in the file" if rid else "no engine request (turned away)"
        root = FileSpan(S.SPAN_API, api.trace_id, api.span_id, "", api.start, api.end,
                        {S.REQUEST_ID: rid, S.FINISH_STATUS: status}, {})  # fmt: skip
    a = root.attributes
    t0 = api.start if api is not None else root.start_unix_ns
    end = api.end if api is not None else root.end_unix_ns
    kids: dict[str, list[FileSpan]] = {}
    for s in spans:
        kids.setdefault(s.parent_span_id, []).append(s)
    # The journey's phases (an in-flight snapshot under the root is no phase).
    children = sorted(
        (c for c in kids.get(root.span_id, []) if c.name in CHILDREN),
        key=lambda s: s.start_unix_ns,
    )
    e = Explanation(
        str(a.get(S.REQUEST_ID, "")),
        api.trace_id if api is not None else root.trace_id,
        str(a.get(S.FINISH_STATUS, "unknown")),
        _ms(end - t0),
        _opt_int(a, S.GEN_AI_INPUT_TOKENS),
        _opt_int(a, S.GEN_AI_CACHE_READ_TOKENS),
        _opt_int(a, S.GEN_AI_OUTPUT_TOKENS),
        spec_acceptance=_opt_float(a, S.SPEC_ACCEPTANCE_RATE),
    )
    if engine_seen:
        _where_and_kv(e, root)
    if api is not None:
        e.outermost = S.SPAN_API
        e.server_ttft_ms, e.server_ttfb_ms = api.ttft_ms, api.ttfb_ms
        e.engine_requests = api.engine_requests
        if api.handoff is not None:
            e.api_input_ms = _ms(max(api.handoff, t0) - t0)
        if api.output_start is not None:
            e.api_output_ms = _ms(end - min(api.output_start, end))
    bounds = Bounds(
        t0,
        end,
        children[0].start_unix_ns if children else None,
        max(c.end_unix_ns for c in children) if children else None,
    )
    before, after = edge_segments(bounds, api, t0, engine_seen)
    e.segments += before
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
    if api is not None and bounds.last is not None and bounds.last > bounds.end:
        e.engine_after_response_ms = _ms(bounds.last - bounds.end)
        e.segments = _clip(e.segments, e.e2e_ms)
    e.segments += after
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
