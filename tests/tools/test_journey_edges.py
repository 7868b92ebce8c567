"""The whole journey at its edges: API requests the served tests do not make.

Span records as a trace file holds them (FileSpan, the readers' input), for the
cases a served burst with head sampling at 100 % never produces: an engine
journey kept by the tail rule (a root of its own, linked), an API request
whose engine spans are not in the file, one turned away, the engine still
working after the last byte (a stop string) or admitted only after the client
left, no read/render split, n=2. For each, ``explain`` and the streaming
tally behind the whole-file shares and ``diff`` must agree, and the causes
must tile the outermost span; what was not observed is absent, not 0.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

import pytest

from vllm_journey_otel import schema as S
from vllm_journey_otel.tools import diff as D
from vllm_journey_otel.tools import explain as X
from vllm_journey_otel.tools import journey_files as J
from vllm_journey_otel.tools.timeline import collect
from vllm_journey_otel.tools.tracefile import FileSpan

MS = 1_000_000
T0 = 1_700_000_000_000_000_000
_ids = itertools.count(1)


def _span(
    name: str, parent: str, a_ms: float, b_ms: float, trace: str = "t", **attrs: object
) -> FileSpan:
    return FileSpan(name, trace, f"s{next(_ids)}", parent, T0 + int(a_ms * MS),
                    T0 + int(b_ms * MS), dict(attrs), {})  # fmt: skip


def _engine(rid: str, parent: str, start: float, phases: list[tuple[str, float, float]],
            trace: str = "t") -> list[FileSpan]:  # fmt: skip
    """An engine root with queued / scheduled (prefill, decode) children."""
    end = max(b for _, _, b in phases)
    root = _span(S.SPAN_REQUEST, parent, start, end, trace, **{
        S.REQUEST_ID: rid, S.FINISH_STATUS: "length", S.GEN_AI_OUTPUT_TOKENS: 11})  # fmt: skip
    out = [root]
    for kind, a, b in phases:
        if kind == "queued":
            out.append(_span(S.SPAN_QUEUED, root.span_id, a, b, trace))
        else:  # a cycle: prefill for its first 10 %, decode after
            cyc = _span(S.SPAN_SCHEDULED, root.span_id, a, b, trace,
                        **{S.SCHEDULE_KIND: S.SCHEDULE_FIRST})  # fmt: skip
            mid = a + (b - a) / 10
            out += [cyc, _span(S.SPAN_PREFILL, cyc.span_id, a, mid, trace),
                    _span(S.SPAN_DECODE, cyc.span_id, mid, b, trace)]  # fmt: skip
    return out


def _api(start: float, end: float, ids: tuple[str, ...], handoff: float | None,
         output: float | None, read_ms: float | None = 1.0, responded: bool = True,
         trace: str = "t") -> list[FileSpan]:  # fmt: skip
    attrs: dict[str, object] = {S.API_TTFT_MS: (end - start) / 2}
    if ids:
        attrs[S.API_REQUEST_IDS] = ids
    if responded:
        attrs[S.API_E2E_MS] = end - start
    root = _span(S.SPAN_API, "client", start, end, trace, **attrs)
    out = [root]
    if handoff is not None:
        extra = {} if read_ms is None else {S.API_READ_MS: read_ms}
        out.append(_span(S.SPAN_API_INPUT, root.span_id, start, handoff, trace, **extra))
    if output is not None:
        out.append(_span(S.SPAN_API_OUTPUT, root.span_id, output, end, trace))
    return out


def _under(api: list[FileSpan], spans: list[FileSpan]) -> list[FileSpan]:
    root = spans[0]
    return [root._replace(parent_span_id=api[0].span_id), *spans[1:]]


def _case(name: str) -> list[FileSpan]:
    rid = f"{name}-r"  # request ids are unique, as vLLM's are
    if name == "tail_kept":  # the engine root is a root of its own; named in request_ids
        api = _api(0, 100, (rid,), handoff=10, output=95)
        return api + _engine(rid, "", 5, [("queued", 12, 20), ("cycle", 20, 93)], trace="u")
    if name == "engine_not_in_file":
        return _api(0, 100, (rid,), handoff=10, output=95)
    if name == "turned_away":
        return _api(0, 8, (), handoff=6, output=None, responded=True)
    if name == "stop_string":  # the engine ends after the last byte
        api = _api(0, 100, (rid,), handoff=10, output=90)
        return api + _under(api, _engine(rid, "", 5, [("queued", 12, 20), ("cycle", 20, 130)]))
    if name == "gone_while_queued":  # admitted after the client left
        api = _api(0, 50, (rid,), handoff=10, output=None, responded=False)
        return api + _under(api, _engine(rid, "", 5, [("queued", 12, 70), ("cycle", 70, 90)]))
    if name == "no_read_ms":
        api = _api(0, 100, (rid,), handoff=10, output=95, read_ms=None)
        return api + _under(api, _engine(rid, "", 5, [("queued", 12, 20), ("cycle", 20, 93)]))
    if name == "n2":
        api = _api(0, 100, (f"{name}-r0", f"{name}-r1"), handoff=10, output=95)
        one = _under(api, _engine(f"{name}-r0", "", 5, [("queued", 12, 20), ("cycle", 20, 80)]))
        two = _under(api, _engine(f"{name}-r1", "", 5, [("queued", 12, 20), ("cycle", 20, 92)]))
        return api + one + two
    if name == "engine_only":
        return _engine(rid, "client", 0, [("queued", 3, 20), ("cycle", 20, 60)])
    raise AssertionError(name)


CASES = ["tail_kept", "engine_not_in_file", "turned_away", "stop_string", "gone_while_queued",
         "no_read_ms", "n2", "engine_only"]  # fmt: skip


def _reader(spans: list[FileSpan]) -> J.Reader:
    def read(attributes_of: frozenset[str] | None) -> Iterable[FileSpan]:
        empty: dict[str, object] = {}
        return [s if attributes_of is None or s.name in attributes_of
                else s._replace(attributes=empty) for s in spans]  # fmt: skip

    return read


@pytest.mark.parametrize("name", CASES)
def test_explain_and_the_tally_agree_and_tile(name: str) -> None:
    spans = _case(name)
    read = _reader(spans)
    (e,), total = J.explanations(read, J.Selection(slowest=5))
    assert total == 1, "one request, one journey"
    each, _ = J.journey_causes(read)
    (jc,) = list(each)
    assert e.by_cause() == pytest.approx(jc.causes, abs=1e-6)
    assert sum(e.by_cause().values()) == pytest.approx(e.e2e_ms, abs=1e-6)
    outer = next(
        s for s in spans if s.name == (S.SPAN_API if name != "engine_only" else S.SPAN_REQUEST)
    )
    assert e.e2e_ms == pytest.approx((outer.end_unix_ns - outer.start_unix_ns) / MS)
    (row,), drawn_total = collect(read)
    assert drawn_total == 1 and (row.start, row.end) == (outer.start_unix_ns, outer.end_unix_ns)
    assert row.explanation() is not None and row.explanation().by_cause() == e.by_cause()  # type: ignore[union-attr]


def test_what_each_case_says() -> None:
    def causes(name: str) -> dict[str, float]:
        (e,), _ = J.explanations(_reader(_case(name)), J.Selection(slowest=1))
        return e.by_cause()

    c = causes("tail_kept")  # joined by request id: the engine's phases are the journey's
    assert c[X.QUEUED] == pytest.approx(8) and c[X.ENGINE_INPUT] == pytest.approx(2)
    c = causes("engine_not_in_file")
    assert c[X.ENGINE_UNSEEN] == pytest.approx(85) and X.ENGINE_INPUT not in c
    c = causes("turned_away")
    assert c == pytest.approx({X.API_READ: 1, X.API_RENDER: 5, X.ENGINE_INPUT: 2})
    (e,), _ = J.explanations(_reader(_case("stop_string")), J.Selection(slowest=1))
    assert e.engine_after_response_ms == pytest.approx(30)
    assert X.ENGINE_HANDBACK not in e.by_cause() and X.API_OUTPUT not in e.by_cause()
    c = causes("gone_while_queued")  # nothing of the engine's phases inside the span
    assert c == pytest.approx({X.API_READ: 1, X.API_RENDER: 9, X.ENGINE_INPUT: 2, X.QUEUED: 38})
    c = causes("no_read_ms")
    assert c[X.API_INPUT] == pytest.approx(10) and X.API_READ not in c
    (e,), _ = J.explanations(_reader(_case("n2")), J.Selection(slowest=1))
    assert e.engine_requests == 2 and e.request_id == "n2-r1"  # the one that ended last


def test_diff_observes_only_what_the_spans_observe() -> None:
    spans = [s for name in CASES for s in _case(name)]
    sample = D.from_reader(_reader(spans))
    assert sample.count == len(CASES)

    def count(phase: str) -> int:
        return len(sample.sorted_values(phase))

    # Engine phases: the journeys whose engine spans are in the file (6 of 8).
    assert count(X.QUEUED) == count(X.PREEMPTED) == 6
    # The output side: where there is one; engine input: where the engine's spans are.
    assert count(X.API_OUTPUT) == 5  # all but turned_away, gone_while_queued, engine_only
    assert count(X.ENGINE_INPUT) == 5  # not engine_not_in_file, turned_away, engine_only
    assert count(X.ENGINE_UNSEEN) == 0
    assert count(X.BEFORE) == 1  # engine_only
    # End to end: not for the request that never responded.
    assert count(D.E2E) == len(CASES) - 1
    assert all(not math.isnan(v) for v in sample.sorted_values(D.E2E))


def test_a_wait_in_one_file_only_is_zero_in_the_other() -> None:
    plain = _case("engine_only")
    root = plain[0]
    queued = next(s for s in plain if s.name == S.SPAN_QUEUED)
    wait = _span(S.SPAN_WAIT, queued.span_id, 5, 15, **{S.WAIT_REASON: S.WAIT_GRAMMAR})
    waited = [*plain, wait]
    base = D.from_reader(_reader(plain + _case("tail_kept")))
    new = D.from_reader(_reader(_case("tail_kept") + waited))  # the wait in its last journey
    phase = X.WAIT + S.WAIT_GRAMMAR
    assert base.sorted_values(phase) == [0.0, 0.0]
    assert new.sorted_values(phase) == pytest.approx([0.0, 10.0])
    d = D.diff(base, new)
    assert d.phase(phase) is not None and d.phase(phase).new_n == 2  # type: ignore[union-attr]
    assert root.name == S.SPAN_REQUEST
