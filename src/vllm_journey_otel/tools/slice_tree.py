"""A journey's spans as nested slices: the tree ``vllm-journey perfetto`` draws.

Runs in the CLI's process (one thread; ``tools/perfetto.py``), offline, on spans read from
trace files. Times: the spans' epoch ns (``*_unix_ns``) as the files carry
them. A span sticking out of its parent or overlapping its previous sibling is
clamped so nesting holds (the root widens to hold ``vllm.kv_held``, which
follows it); a slice's ``args`` keep the span's exact times.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm_journey_otel import schema as S
from vllm_journey_otel.tools.tracefile import FileSpan


@dataclass
class Slice:
    """A span as a slice: its shown interval (clamped into its parent) and children."""

    span: FileSpan
    start: int
    end: int
    children: list[Slice] = field(default_factory=list)

    def args(self, times: bool) -> dict[str, Any]:
        """The span's attributes (the root's: and its trace id); with ``times`` or
        when clamped, its exact start and end."""
        a = dict(self.span.attributes)
        if self.span.name == S.SPAN_REQUEST:
            a["trace_id"] = self.span.trace_id
        if times or (self.start, self.end) != (self.span.start_unix_ns, self.span.end_unix_ns):
            a["start_unix_ns"], a["end_unix_ns"] = self.span.start_unix_ns, self.span.end_unix_ns
        return a


def tree(spans: list[FileSpan]) -> Slice | None:
    """A journey's spans as a tree of slices, children in time order, nested."""
    nodes = {s.span_id: Slice(s, s.start_unix_ns, s.end_unix_ns) for s in spans}
    root = next((n for n in nodes.values() if n.span.name == S.SPAN_REQUEST), None)
    if root is None:
        return None
    for n in nodes.values():
        parent = nodes.get(n.span.parent_span_id)
        if n is not root and parent is not None:
            parent.children.append(n)
            if n.span.name == S.SPAN_KV_HELD:
                root.end = max(root.end, n.end)
    _clamp(root)
    return root


def _clamp(node: Slice) -> None:
    node.children.sort(key=lambda c: (c.span.start_unix_ns, -c.span.end_unix_ns))
    low = node.start
    for c in node.children:
        c.start = min(max(c.start, low), node.end)
        c.end = max(min(c.end, node.end), c.start)
        low = c.end
        _clamp(c)


def walk(node: Slice) -> Iterator[tuple[bool, Slice]]:
    """(True, node) at its begin, (False, node) at its end, in time order."""
    yield True, node
    for c in node.children:
        yield from walk(c)
    yield False, node
