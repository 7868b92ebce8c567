"""``vllm-journey explain`` in words: one journey's story and waterfall, or a
file's causes.

Runs in the CLI's process. Figures are milliseconds (from
``tools/explain.py``, which took them from the spans' epoch-ns times). A figure
the spans did not carry is written "not observed".
"""

from __future__ import annotations

from vllm_journey_otel import schema as S
from vllm_journey_otel.tools.explain import (
    AFTER,
    API_AFTER,
    API_BEFORE,
    API_INPUT,
    API_OUTPUT,
    API_READ,
    API_RENDER,
    BEFORE,
    DECODE,
    ENGINE_HANDBACK,
    ENGINE_INPUT,
    PREEMPTED,
    PREFILL,
    QUEUED,
    RECOMPUTE,
    WAIT,
    Explanation,
    label,
)
from vllm_journey_otel.tools.journey_files import FileShare

WIDTH = 60  # characters of the waterfall's time axis
_MARK = {
    API_READ: "r",
    API_RENDER: "t",
    API_INPUT: "i",
    ENGINE_INPUT: ">",
    ENGINE_HANDBACK: "<",
    API_OUTPUT: "o",
    BEFORE: ">",
    QUEUED: "q",
    PREFILL: "P",
    DECODE: "d",
    PREEMPTED: "x",
    RECOMPUTE: "R",
    AFTER: "<",
}
NOT_OBSERVED = "not observed"


def _mark(cause: str) -> str:
    return "w" if cause.startswith(WAIT) else _MARK.get(cause, "?")


def _pct(v: float | None) -> str:
    return NOT_OBSERVED if v is None else f"{100 * v:.0f}%"


def _n(v: int | float | None) -> str:
    return NOT_OBSERVED if v is None else str(v)


def _engine_then(kv: float | None, running: int | None, waiting: int | None) -> str:
    if kv is None and running is None and waiting is None:
        return f"what the engine looked like then: {NOT_OBSERVED}"
    return f"{_n(running)} running, {_n(waiting)} waiting, KV cache {_pct(kv)} used"


def waterfall(e: Explanation, width: int = WIDTH) -> list[str]:
    """One line per cause in journey order, its stretches drawn on a shared axis."""
    scale = width / e.e2e_ms if e.e2e_ms > 0 else 0.0
    rows: dict[str, list[str]] = {}
    for s in e.segments:
        row = rows.setdefault(s.cause, [" "] * width)
        a = min(width - 1, int(s.start_ms * scale))
        b = max(a + 1, min(width, round(s.end_ms * scale)))
        for i in range(a, b):
            row[i] = _mark(s.cause)
    totals = e.by_cause()
    return [
        f"  {label(cause):<28} |{''.join(row)}| {totals[cause]:9.1f} ms"
        for cause, row in rows.items()
    ]


def _headline(e: Explanation) -> list[str]:
    totals = e.by_cause()
    if not totals:
        return ["  no phase spans found for this request"]
    cause, ms = max(totals.items(), key=lambda kv: kv[1])
    share = ms / e.e2e_ms if e.e2e_ms > 0 else 0.0
    why = f"  Most of its time: {label(cause)}, {ms:.1f} ms ({100 * share:.0f}%)"
    if cause == QUEUED:
        why += "; at admission: " + _engine_then(*(e.admission or (None, None, None)))
    elif cause in (PREEMPTED, RECOMPUTE):
        named = sorted({p.by for p in e.preemptions if p.by is not None})
        who = ", ".join(named) if named else NOT_OBSERVED
        why += f"; preempted {len(e.preemptions)} time(s), caused by: {who}"
    elif cause == DECODE and e.decode_ms_per_token is not None:
        why += f"; {e.decode_tokens} tokens at {e.decode_ms_per_token:.2f} ms/token"
    return [why + "."]


def _details(e: Explanation) -> list[str]:
    totals = e.by_cause()
    lines = []
    if QUEUED in totals or any(c.startswith(WAIT) for c in totals):
        lines.append(
            f"  queued {totals.get(QUEUED, 0.0):.1f} ms; at admission "
            + _engine_then(*(e.admission or (None, None, None)))
            + " (this request among the waiting)"
        )
    for cause, ms in totals.items():
        if cause.startswith(WAIT):
            lines.append(f"    {label(cause)}: {ms:.1f} ms")
    for i, p in enumerate(e.preemptions, 1):
        recompute = "never resumed" if p.recompute_ms is None else f"{p.recompute_ms:.1f} ms"
        lines.append(
            f"  preemption {i} at +{p.at_ms:.1f} ms by {p.by or NOT_OBSERVED}; "
            f"{_engine_then(p.kv_cache_usage, p.num_running, p.num_waiting)}; "
            f"preempted {p.preempted_ms:.1f} ms; recompute prefill {recompute}"
        )
    if PREFILL in totals:
        lines.append(
            f"  prefill {totals[PREFILL]:.1f} ms: {_n(e.prefill_chunks)} chunk(s), "
            f"{_n(e.prefill_cached_tokens)} tokens from the prefix cache"
        )
    if DECODE in totals:
        per = e.decode_ms_per_token
        rate = NOT_OBSERVED if per is None else f"{per:.2f} ms/token"
        spec = "" if e.spec_acceptance is None else f", draft acceptance {_pct(e.spec_acceptance)}"
        lines.append(
            f"  decode {totals[DECODE]:.1f} ms: {_n(e.decode_tokens)} tokens, {rate}{spec}"
        )
    lines += _edges(e, totals)
    if e.kv_from is not None:
        lines.append(f"  its kv_transfer_params name the source of its prompt's KV: {e.kv_from}")
    if e.kv_held_ms is not None:
        whom = "the decode instance" if e.kv_role == "prefill" else "its KV connector"
        lines.append(
            f"  after its end its KV blocks stayed held for {whom} "
            f"{e.kv_held_ms:.1f} ms (vllm.kv_held)"
        )
    return lines


def _edges(e: Explanation, totals: dict[str, float]) -> list[str]:
    """Before and after the engine: the API server's sides where the file has
    them, else the engine root's own edges."""
    if e.outermost != S.SPAN_API:
        lines = [f"  {label(c)}: {totals[c]:.1f} ms" for c in (BEFORE, AFTER) if c in totals]
        return [*lines, "  (no API-server spans in the file: the engine's part only)"]
    parts = [f"{label(c)} {totals[c]:.1f}" for c in API_BEFORE if c in totals]
    before = sum(totals.get(c, 0.0) for c in API_BEFORE)
    lines = [f"  before the engine {before:.1f} ms: " + ("; ".join(parts) or NOT_OBSERVED)]
    for side, ms, causes in (
        ("input", e.api_input_ms, (API_READ, API_RENDER, API_INPUT)),
        ("output", e.api_output_ms, (API_OUTPUT,)),
    ):
        overlap = None if ms is None else ms - sum(totals.get(c, 0.0) for c in causes)
        if overlap is not None and overlap > 0.001:
            lines.append(
                f"    the API server's {side} side ({ms:.1f} ms) overlapped the engine's "
                f"phases by {overlap:.1f} ms (counted there)"
            )
    after = sum(totals.get(c, 0.0) for c in (*API_AFTER, AFTER))
    parts = [f"{label(c)} {totals[c]:.1f}" for c in (*API_AFTER, AFTER) if c in totals]
    lines.append(f"  after the engine {after:.1f} ms: " + ("; ".join(parts) or NOT_OBSERVED))
    ttft, ttfb = e.server_ttft_ms, e.server_ttfb_ms
    lines.append(
        f"  server TTFT {NOT_OBSERVED if ttft is None else f'{ttft:.1f} ms'} (the first "
        f"token at the API server); first byte {NOT_OBSERVED if ttfb is None else f'{ttfb:.1f} ms'}"
    )
    if e.engine_after_response_ms is not None:
        lines.append(
            f"  the engine went on {e.engine_after_response_ms:.1f} ms after the last "
            "response byte (the API server ended the request: a stop string, a client gone)"
        )
    if e.engine_requests > 1:
        lines.append(f"  {e.engine_requests} engine requests (n>1): the one that ended last shown")
    return lines


def format_journey(e: Explanation) -> str:
    what = "the API server's" if e.outermost == S.SPAN_API else "the engine's"
    head = (
        f"{e.request_id or '(no request id)'}  trace {e.trace_id}  {e.status}, "
        f"{e.e2e_ms:.1f} ms end to end ({what} {e.outermost}); input "
        f"{_n(e.input_tokens)} tokens ({_n(e.cached_tokens)} cached), output {_n(e.output_tokens)}"
        + (f"; ran on {e.where}" if e.where else "")
    )
    return "\n".join([head, *_headline(e), *_details(e), "  waterfall:", *waterfall(e)])


def format_share(share: FileShare) -> str:
    d = share.to_dict()
    api, engine = share.outermost.get(S.SPAN_API, 0), share.outermost.get(S.SPAN_REQUEST, 0)
    lines = [
        f"{share.journeys} journeys, {share.total_ms / 1000:.2f} s of request-time in all "
        f"({api} from the API server's {S.SPAN_API}, {engine} from the engine's "
        f"{S.SPAN_REQUEST} alone); where it went:"
    ]
    for c in d["causes"]:
        top = ", ".join(f"{t['request_id']} {t['ms']:.1f} ms" for t in c["top"])
        lines.append(f"  {label(c['cause']):<28} {100 * c['share']:5.1f}%  {c['ms']:10.1f} ms"
                     f"   largest: {top}")  # fmt: skip
    return "\n".join(lines)
