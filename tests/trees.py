"""Reassemble exported spans into journey trees and check the schema's invariants."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from opentelemetry.sdk.trace import ReadableSpan

from vllm_journey_otel import schema as S

PHASES_OF = {S.SPAN_SCHEDULED: (S.SPAN_PREFILL, S.SPAN_DECODE)}


API_SPANS = (S.SPAN_API, S.SPAN_API_INPUT, S.SPAN_API_OUTPUT)


@dataclass
class Node:
    span: ReadableSpan
    children: list[Node] = field(default_factory=list)
    # An engine root's vllm.api.request, when it hangs under one.
    api: Node | None = None

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def attrs(self) -> dict[str, object]:
        return dict(self.span.attributes or {})

    @property
    def start(self) -> int:
        assert self.span.start_time is not None
        return self.span.start_time

    @property
    def end(self) -> int:
        assert self.span.end_time is not None
        return self.span.end_time

    def shape(self) -> tuple[object, ...]:
        """The tree as nested tuples of span names, children in time order."""
        if not self.children:
            return (self.name,)
        return (self.name, tuple(c.shape() for c in self.children))

    def kids(self, name: str) -> list[Node]:
        return [c for c in self.children if c.name == name]


def api_requests(spans: Iterable[ReadableSpan]) -> list[Node]:
    """The API-server trees: each vllm.api.request with its input and output
    sides and the engine roots under it, children sorted by start time."""
    spans = list(spans)
    by_id = {s.context.span_id: Node(s) for s in spans if s.name in API_SPANS}
    roots = [n for n in by_id.values() if n.name == S.SPAN_API]
    for node in list(by_id.values()):
        if node.name != S.SPAN_API:
            parent = node.span.parent
            assert parent is not None and parent.span_id in by_id, node.name
            by_id[parent.span_id].children.append(node)
    for root in journeys(spans).values():
        if root.api is not None and root.api.span.context.span_id in by_id:
            by_id[root.api.span.context.span_id].children.append(root)
    for node in by_id.values():
        node.children.sort(key=lambda n: (n.start, n.end))
    return roots


def journeys(spans: Iterable[ReadableSpan]) -> dict[str, Node]:
    """request id -> root node, children sorted by start time."""
    # The step view's spans are traces of their own; an in-flight snapshot is no
    # part of the journey's tree (and may arrive before its root); the API
    # server's spans are above it (``Node.api``).
    spans = list(spans)
    api = {s.context.span_id: Node(s) for s in spans if s.name == S.SPAN_API}
    spans = [s for s in spans if s.name not in (S.SPAN_STEP, S.SPAN_IN_FLIGHT, *API_SPANS)]
    by_id = {s.context.span_id: Node(s) for s in spans}
    roots: dict[str, Node] = {}
    for node in by_id.values():
        parent = node.span.parent
        if node.name == S.SPAN_REQUEST:
            roots[str(node.attrs[S.REQUEST_ID])] = node
            node.api = api.get(parent.span_id) if parent is not None else None
        else:
            assert parent is not None, f"{node.name} has no parent"
            by_id[parent.span_id].children.append(node)
    for node in by_id.values():
        node.children.sort(key=lambda n: (n.start, n.end))
    return roots


def expected_shape(*cycles: str, preempted_at_end: bool = False) -> tuple[object, ...]:
    """Shape of a journey from its cycles: "PD" = prefill+decode, "P" = prefill only.

    Cycles after the first are preceded by a preemption.
    """
    kids: list[tuple[object, ...]] = [(S.SPAN_QUEUED,)]
    for i, c in enumerate(cycles):
        if i:
            kids.append((S.SPAN_PREEMPTED,))
        phases = [(S.SPAN_PREFILL,)] + ([(S.SPAN_DECODE,)] if c == "PD" else [])
        kids.append((S.SPAN_SCHEDULED, tuple(phases)))
    if preempted_at_end:
        kids.append((S.SPAN_PREEMPTED,))
    return (S.SPAN_REQUEST, tuple(kids))


def check_invariants(root: Node, check_kind: bool = True) -> None:
    """The rules of docs/spans.md: tiling, nesting, attribute keys, root kind."""
    if check_kind:  # one SERVER span per request: the API server's, if it is there
        assert root.span.kind.name == ("INTERNAL" if root.api is not None else "SERVER")
    assert root.start <= root.end
    # Disaggregated serving: the KV blocks kept after the end follow the root.
    held = [k for k in root.children if k.name == S.SPAN_KV_HELD]
    assert len(held) <= 1, root.shape()
    for h in held:
        assert h.start == root.end <= h.end and not h.children
        assert set(h.attrs) <= S.attributes_of(S.SPAN_KV_HELD), h.attrs
        assert (S.KV_HELD_MS in h.attrs) == (h.attrs[S.KV_HELD_RELEASED] is True), h.attrs
    kids = [k for k in root.children if k.name != S.SPAN_KV_HELD]
    assert kids and kids[0].name == S.SPAN_QUEUED, root.shape()
    # Queued, scheduled and preempted tile the root from admission to the end.
    for a, b in itertools.pairwise(kids):
        assert a.end == b.start, (a.name, b.name, a.end, b.start)
    assert kids[-1].end == root.end
    assert root.start <= kids[0].start
    names = [k.name for k in kids]
    assert set(names) <= {S.SPAN_QUEUED, S.SPAN_SCHEDULED, S.SPAN_PREEMPTED}
    # scheduled and preempted (or, for a streaming-input session, queued) alternate
    for a, b in itertools.pairwise(names):
        assert a != b, names
    cycle = 0
    prev = None
    for k in kids:
        assert root.start <= k.start <= k.end <= root.end
        allowed = S.attributes_of(k.name)
        assert set(k.attrs) <= allowed, set(k.attrs) - allowed
        for key in (S.PREFILL_DONE_TOKENS, S.DECODE_DONE_TOKENS, S.PHASE, S.SCHEDULER_STEP):
            assert key in k.attrs, (k.name, key)
        if k.name == S.SPAN_SCHEDULED:
            assert k.attrs[S.CYCLE] == cycle
            # Streaming input: a session's next segment starts after a queued span.
            assert k.attrs[S.SCHEDULE_KIND] == (
                S.SCHEDULE_FIRST
                if cycle == 0
                else S.SCHEDULE_NEXT_INPUT
                if prev == S.SPAN_QUEUED
                else S.SCHEDULE_RESUME
            )
            cycle += 1
            phases = k.children
            assert [p.name for p in phases] in (
                [S.SPAN_PREFILL],
                [S.SPAN_PREFILL, S.SPAN_DECODE],
            ), [p.name for p in phases]
            assert phases[0].start == k.start
            assert phases[-1].end == k.end
            for a, b in itertools.pairwise(phases):
                assert a.end == b.start
            for p in phases:
                assert set(p.attrs) <= S.attributes_of(p.name)
                assert k.start <= p.start <= p.end <= k.end
            assert S.PREFILL_CHUNKS in phases[0].attrs and S.CACHED_TOKENS in phases[0].attrs
        else:
            assert k.name != S.SPAN_QUEUED or k is kids[0] or S.SEGMENT in k.attrs
            # Only waits inside the queue, in time order, within their parent.
            assert all(w.name == S.SPAN_WAIT for w in k.children), k.shape()
            for w in k.children:
                assert k.start <= w.start <= w.end <= k.end
                assert w.attrs[S.WAIT_REASON] in S.WAIT_REASONS, w.attrs
                assert set(w.attrs) <= S.attributes_of(S.SPAN_WAIT), w.attrs
                if w.attrs[S.WAIT_REASON] != S.WAIT_REMOTE_KV:
                    assert set(w.attrs) == {S.WAIT_REASON}, w.attrs
                assert not w.children
            for a, b in itertools.pairwise(k.children):
                assert a.end <= b.start
        prev = k.name
    root_allowed = S.attributes_of(S.SPAN_REQUEST)
    assert set(root.attrs) <= root_allowed, set(root.attrs) - root_allowed
    assert root.attrs[S.NUM_PREEMPTIONS] == len(root.kids(S.SPAN_PREEMPTED))
