"""Summarise journeys from spans: per-phase latency, preemptions, statuses, tokens,
time in each waiting reason, speculative-decoding acceptance.

Streaming: keeps one small record per journey (not its spans), so 100,000
journeys fit in tens of MB. Pure: works on :class:`~vllm_journey_otel.tools.tracefile.FileSpan`.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from vllm_journey_otel import schema as S
from vllm_journey_otel.tools.tracefile import FileSpan

PHASES = (
    ("queued", S.QUEUED_MS),
    ("ttft", S.TTFT_MS),
    ("prefill", S.PREFILL_MS),
    ("decode", S.DECODE_MS),
)
PERCENTILES = (50, 90, 95, 99)
# The only spans whose attributes the summary reads.
SUMMARY_ATTRIBUTES = frozenset(
    {S.SPAN_REQUEST, S.SPAN_WAIT, S.SPAN_IN_FLIGHT, S.SPAN_API, S.SPAN_KV_HELD}
)
# The API server's part (vllm.api.*): root attributes, and its two sides' durations.
API_PHASES = (("api:ttft", S.API_TTFT_MS), ("api:ttfb", S.API_TTFB_MS), ("api:e2e", S.API_E2E_MS))
API_SIDES = {S.SPAN_API_INPUT: "api:input", S.SPAN_API_OUTPUT: "api:output"}


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..100)."""
    if not sorted_values:
        raise ValueError("no values")
    k = max(0, min(len(sorted_values) - 1, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


class _Journey(NamedTuple):
    """What the summary needs of one root: a few numbers, not its attribute dict."""

    request_id: str
    trace_id: str
    duration_ms: float
    status: str
    phases: tuple[float | None, ...]
    preemptions: int
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    # Speculative decoding (None without it): drafts proposed, accepted, rate.
    drafts: tuple[int, int, float | None] | None
    # The engine core's data-parallel rank (its resource; "" where none is named).
    rank: str


def _journey(span: FileSpan) -> _Journey:
    a = span.attributes
    drafts = None
    if S.SPEC_DRAFTS_PROPOSED in a:
        rate = a.get(S.SPEC_ACCEPTANCE_RATE)
        drafts = (
            int(a[S.SPEC_DRAFTS_PROPOSED]),
            int(a.get(S.SPEC_DRAFTS_ACCEPTED, 0)),
            float(rate) if rate is not None else None,
        )
    return _Journey(
        str(a.get(S.REQUEST_ID, "")),
        span.trace_id,
        (span.end_unix_ns - span.start_unix_ns) / 1e6,
        str(a.get(S.FINISH_STATUS, "unknown")),
        tuple(float(a[key]) if key in a else None for _, key in PHASES),
        int(a.get(S.NUM_PREEMPTIONS, 0)),
        int(a.get(S.GEN_AI_INPUT_TOKENS, 0)),
        int(a.get(S.GEN_AI_OUTPUT_TOKENS, 0)),
        int(a.get(S.GEN_AI_CACHE_READ_TOKENS, 0)),
        drafts,
        str(span.resource.get(S.RES_DP_RANK, "")),
    )


@dataclass
class Summary:
    """What ``vllm-journey summary`` prints."""

    journeys: int = 0
    spans: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    phases_ms: dict[str, list[float]] = field(default_factory=dict)
    preempted_requests: int = 0
    preemptions: int = 0
    preempted_ms: list[float] = field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    slowest: list[tuple[float, str, str, int]] = field(default_factory=list)
    # vllm.wait durations by reason.
    waits_ms: dict[str, list[float]] = field(default_factory=dict)
    # Remote KV loads (remote_kv waits whose transfer end was reported).
    kv_transfer_ms: list[float] = field(default_factory=list)
    kv_transfer_failed: int = 0
    # KV blocks kept for the connector after the end (disaggregated prefill side).
    kv_held_ms: list[float] = field(default_factory=list)
    kv_held_unreleased: int = 0
    spec_requests: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    acceptance_rates: list[float] = field(default_factory=list)
    # Requests seen in flight past the threshold (vllm.in_flight snapshots), by
    # the root span id they belong to: (request id, longest in flight seen in ms,
    # state then, wait reason then).
    in_flight: dict[str, tuple[str, float, str, str | None]] = field(default_factory=dict)
    # The API server's part: its phases (API_PHASES, API_SIDES), requests that
    # failed (the root's error.type) and clients that went away.
    api_ms: dict[str, list[float]] = field(default_factory=dict)
    api_requests: int = 0
    api_failed: int = 0
    api_disconnected: int = 0
    ended: set[str] = field(default_factory=set)  # root span ids whose journey is here
    # Engine journeys' durations by data-parallel rank (shown with several ranks).
    by_rank_ms: dict[str, list[float]] = field(default_factory=dict)

    def _kv_dict(self) -> dict[str, Any]:
        """The KV hand-offs: remote loads (decode side), holds (prefill side)."""
        return {
            "kv_transfer": (
                {"ms": stats(self.kv_transfer_ms), "failed": self.kv_transfer_failed}
                if self.kv_transfer_ms
                else None
            ),
            "kv_held": (
                {"ms": stats(self.kv_held_ms), "unreleased": self.kv_held_unreleased}
                if self.kv_held_ms or self.kv_held_unreleased
                else None
            ),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "journeys": self.journeys,
            "spans": self.spans,
            "finish_status": dict(self.statuses),
            "phases_ms": {name: stats(v) for name, v in self.phases_ms.items()},
            "api_server": (
                {
                    "requests": self.api_requests,
                    "failed": self.api_failed,
                    "disconnected": self.api_disconnected,
                    "phases_ms": {name: stats(v) for name, v in self.api_ms.items()},
                }
                if self.api_requests
                else None
            ),
            "preemption": {
                "preempted_requests": self.preempted_requests,
                "preemptions": self.preemptions,
                "time_lost_ms_total": round(sum(self.preempted_ms), 3),
                "time_lost_ms_per_preempted_request": stats(self.preempted_ms),
            },
            "tokens": {
                "input": self.input_tokens,
                "output": self.output_tokens,
                "cached_input": self.cached_tokens,
            },
            "waits_ms": {reason: stats(v) for reason, v in sorted(self.waits_ms.items())},
            **self._kv_dict(),
            "speculative_decoding": (
                {
                    "requests": self.spec_requests,
                    "drafts_proposed": self.drafts_proposed,
                    "drafts_accepted": self.drafts_accepted,
                    "acceptance_rate": (
                        round(self.drafts_accepted / self.drafts_proposed, 4)
                        if self.drafts_proposed
                        else None
                    ),
                    "acceptance_rate_per_request": stats(self.acceptance_rates),
                }
                if self.spec_requests
                else None
            ),
            "by_data_parallel_rank": (
                {rank: stats(v) for rank, v in sorted(self.by_rank_ms.items(), key=_by_rank)}
                if len(self.by_rank_ms) > 1
                else None
            ),
            "slowest": [
                {"duration_ms": round(d, 3), "request_id": rid, "trace_id": tid, "preemptions": n}
                for d, rid, tid, n in sorted(self.slowest, reverse=True)
            ],
            "in_flight": [
                {
                    "request_id": rid,
                    "longest_seen_ms": round(ms, 3),
                    "state": state,
                    "wait_reason": reason,
                    "ended": root in self.ended,
                }
                for root, (rid, ms, state, reason) in sorted(
                    self.in_flight.items(), key=lambda kv: -kv[1][1]
                )
            ],
        }


def summarize(spans: Iterable[FileSpan], top: int = 10) -> Summary:
    """One pass over the spans; roots and preempted spans are all it keeps."""
    summary = Summary(phases_ms={name: [] for name, _ in PHASES})
    roots: dict[str, _Journey] = {}
    lost_by_parent: dict[str, float] = {}
    for span in spans:
        summary.spans += 1
        if span.name == S.SPAN_REQUEST:
            roots[span.span_id] = _journey(span)
        elif span.name == S.SPAN_WAIT:
            reason = str(span.attributes.get(S.WAIT_REASON, "unknown"))
            summary.waits_ms.setdefault(reason, []).append(
                (span.end_unix_ns - span.start_unix_ns) / 1e6
            )
            transfer = span.attributes.get(S.KV_TRANSFER_MS)
            if isinstance(transfer, int | float):
                summary.kv_transfer_ms.append(float(transfer))
                if span.attributes.get(S.KV_TRANSFER_FAILED) is True:
                    summary.kv_transfer_failed += 1
        elif span.name == S.SPAN_KV_HELD:
            held = span.attributes.get(S.KV_HELD_MS)
            if isinstance(held, int | float):
                summary.kv_held_ms.append(float(held))
            else:  # still held at shutdown: its length is not known
                summary.kv_held_unreleased += 1
        elif span.name == S.SPAN_IN_FLIGHT:
            _in_flight(summary, span)
        elif span.name == S.SPAN_API:
            _api(summary, span)
        elif span.name in API_SIDES:
            ms = (span.end_unix_ns - span.start_unix_ns) / 1e6
            summary.api_ms.setdefault(API_SIDES[span.name], []).append(ms)
        elif span.name == S.SPAN_PREEMPTED:
            lost_by_parent[span.parent_span_id] = (
                lost_by_parent.get(span.parent_span_id, 0.0)
                + (span.end_unix_ns - span.start_unix_ns) / 1e6
            )
    slowest: list[tuple[float, str, str, int]] = []
    for span_id, j in roots.items():
        summary.journeys += 1
        summary.ended.add(span_id)
        summary.statuses[j.status] += 1
        summary.by_rank_ms.setdefault(j.rank, []).append(j.duration_ms)
        for (name, _), value in zip(PHASES, j.phases, strict=True):
            if value is not None:  # missing is not zero: absent intervals are not counted
                summary.phases_ms[name].append(value)
        if j.preemptions:
            summary.preempted_requests += 1
            summary.preemptions += j.preemptions
            summary.preempted_ms.append(lost_by_parent.get(span_id, 0.0))
        summary.input_tokens += j.input_tokens
        summary.output_tokens += j.output_tokens
        summary.cached_tokens += j.cached_tokens
        if j.drafts is not None:
            summary.spec_requests += 1
            summary.drafts_proposed += j.drafts[0]
            summary.drafts_accepted += j.drafts[1]
            if j.drafts[2] is not None:  # nothing proposed: no rate, not 0
                summary.acceptance_rates.append(j.drafts[2])
        item = (j.duration_ms, j.request_id, j.trace_id, j.preemptions)
        if len(slowest) < top:
            heapq.heappush(slowest, item)
        else:
            heapq.heappushpop(slowest, item)
    summary.slowest = slowest
    return summary


def _api(summary: Summary, span: FileSpan) -> None:
    summary.api_requests += 1
    summary.api_failed += S.ERROR_TYPE in span.attributes
    summary.api_disconnected += span.attributes.get(S.API_DISCONNECTED) is True
    for name, key in API_PHASES:
        value = span.attributes.get(key)
        if isinstance(value, int | float):  # missing is not zero
            summary.api_ms.setdefault(name, []).append(float(value))


def _in_flight(summary: Summary, span: FileSpan) -> None:
    """A snapshot: keep the request's longest-seen one (one without its time in
    flight is not counted: missing is not zero)."""
    a = span.attributes
    ms = a.get(S.IN_FLIGHT_MS)
    if not isinstance(ms, int | float):
        return
    seen = summary.in_flight.get(span.parent_span_id)
    if seen is None or ms > seen[1]:
        reason = a.get(S.WAIT_REASON)
        summary.in_flight[span.parent_span_id] = (
            str(a.get(S.REQUEST_ID, "")),
            float(ms),
            str(a.get(S.IN_FLIGHT_STATE, "unknown")),
            None if reason is None else str(reason),
        )


def _by_rank(item: tuple[str, Any]) -> tuple[int, str]:
    """Ranks in numeric order (2 before 10), an unnamed one first."""
    rank = item[0]
    return (int(rank), "") if rank.isdigit() else (-1, rank)


def stats(values: list[float]) -> dict[str, float] | None:
    """Percentiles, count and max of ``values`` (ms); None without any."""
    if not values:
        return None
    v = sorted(values)
    out = {f"p{q}": round(percentile(v, q), 3) for q in PERCENTILES}
    out["count"] = len(v)
    out["max"] = round(v[-1], 3)
    return out


def _kv_lines(kv: dict[str, Any] | None, held: dict[str, Any] | None) -> list[str]:
    lines = []
    if kv:
        lines.append(
            f"remote KV loads: {kv['ms']['count']} reported done, {kv['failed']} of them failed"
        )
    if held:
        count = held["ms"]["count"] if held["ms"] else 0
        lines.append(
            f"KV blocks kept for the KV connector after the end (a prefill instance's: "
            f"for the decode side): {count} released, "
            f"{held['unreleased']} still held at shutdown"
        )
    return lines


def _rank_lines(ranks: dict[str, Any] | None) -> list[str]:
    """An engine journey's duration, by the rank of the engine core that served it."""
    if not ranks:
        return []
    lines = ["", f"{'engine journey (ms) by data-parallel rank':<44}{'count':>8}{'p50':>10}"
                 f"{'p99':>10}{'max':>10}"]  # fmt: skip
    for rank, st in ranks.items():
        lines.append(
            f"  rank {rank or '(none)':<37}{st['count']:>8}{st['p50']:>10.2f}"
            f"{st['p99']:>10.2f}{st['max']:>10.2f}"
        )
    return lines


def format_text(d: dict[str, Any]) -> str:
    """A terminal table of :meth:`Summary.to_dict`."""
    lines = [
        f"journeys: {d['journeys']}   spans: {d['spans']}",
        "finish status: " + ", ".join(f"{k}={v}" for k, v in sorted(d["finish_status"].items())),
        "",
        f"{'phase (ms)':<12}{'count':>8}"
        + "".join(f"{'p' + str(q):>10}" for q in PERCENTILES)
        + f"{'max':>10}",
    ]
    rows = list(d["phases_ms"].items())
    api = d.get("api_server")
    if api:  # the API server's part: server-side TTFT and end to end, its two sides
        rows += [(name, api["phases_ms"].get(name)) for name, _ in API_PHASES]
        rows += [(name, api["phases_ms"].get(name)) for name in API_SIDES.values()]
    # Waits inside the queue, one row per reason seen (e.g. "wait:lora_slot").
    rows += [(f"wait:{reason}", stats) for reason, stats in d.get("waits_ms", {}).items()]
    kv = d.get("kv_transfer")
    if kv:  # remote KV loads: the transfer part of wait:remote_kv
        rows.append(("kv_transfer", kv["ms"]))
    held = d.get("kv_held")
    if held and held["ms"]:  # the prefill side's hold of the blocks for the decode side
        rows.append(("kv_held", held["ms"]))
    width = max(12, *(len(name) + 2 for name, _ in rows))
    lines[3] = f"{'phase (ms)':<{width}}" + lines[3][12:]
    for name, stats in rows:
        if stats is None:
            lines.append(f"{name:<{width}}{0:>8}" + f"{'-':>10}" * (len(PERCENTILES) + 1))
            continue
        lines.append(
            f"{name:<{width}}{stats['count']:>8}"
            + "".join(f"{stats['p' + str(q)]:>10.2f}" for q in PERCENTILES)
            + f"{stats['max']:>10.2f}"
        )
    p = d["preemption"]
    lines += [
        "",
        f"preempted requests: {p['preempted_requests']}   preemptions: {p['preemptions']}   "
        f"time lost to preemption: {p['time_lost_ms_total']:.1f} ms",
        f"tokens: input {d['tokens']['input']} (cached {d['tokens']['cached_input']}), "
        f"output {d['tokens']['output']}",
    ]
    if api:
        lines.append(
            f"API server: {api['requests']} requests, {api['failed']} failed, "
            f"{api['disconnected']} clients went away"
        )
    spec = d.get("speculative_decoding")
    if spec:
        per = spec["acceptance_rate_per_request"]
        rate = spec["acceptance_rate"]
        lines.append(
            f"speculative decoding: {spec['requests']} requests, drafts accepted "
            f"{spec['drafts_accepted']} of {spec['drafts_proposed']}"
            + (f" ({rate:.1%})" if rate is not None else "")
            + (f"; per request: median {per['p50']:.1%}, max {per['max']:.1%}" if per else "")
        )
    lines += _kv_lines(kv, held)
    lines += _rank_lines(d.get("by_data_parallel_rank"))
    if d["slowest"]:
        lines += ["", "slowest requests:", f"  {'ms':>10}  {'preempt':>7}  trace_id  request_id"]
        for s in d["slowest"]:
            lines.append(
                f"  {s['duration_ms']:>10.2f}  {s['preemptions']:>7}  {s['trace_id']}  "
                f"{s['request_id']}"
            )
    if d.get("in_flight"):
        lines += [
            "",
            "seen in flight past the threshold (vllm.in_flight snapshots):",
            f"  {'longest ms':>12}  {'then':<10} {'waiting for':<26} ended  request_id",
        ]
        for f in d["in_flight"]:
            lines.append(
                f"  {f['longest_seen_ms']:>12.1f}  {f['state']:<10} {f['wait_reason'] or '-':<26} "
                f"{'yes' if f['ended'] else 'no':<6} {f['request_id']}"
            )
    return "\n".join(lines)
