"""Malformed trace context and request ids sent to a real `vllm serve`, and
where their journeys must land (tests/e2e/test_e2e_reliability.py's backend
faults test sends them on its recovered backend)."""

from __future__ import annotations

from typing import Any

from otlp_receiver import Receiver, wire_spans
from services import VllmServer, wait_until
from vllm_journey_otel import schema as S

GOOD_TP = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
BAD_TRACEPARENTS = [
    "", "garbage", GOOD_TP.upper(), GOOD_TP + "-extra", GOOD_TP[:-1], "ff" + GOOD_TP[2:],
    "00-" + "0" * 32 + "-" + "b" * 16 + "-01", "00-" + "a" * 32 + "-" + "0" * 16 + "-01",
    "00-" + "g" * 32 + "-" + "b" * 16 + "-01", GOOD_TP[:-2] + "zz", "x" * 8000,
]  # fmt: skip
BAD_TRACESTATES = ["=,==,", "k=" + "v" * 9000, ",".join(f"k{i}=v" for i in range(200))]


def send_bad_input(server: VllmServer, receiver: Receiver) -> int:
    """Malformed trace context and request ids; returns how many inputs were tried."""
    import httpx

    body = {"model": server.model, "prompt": "bad input", "max_tokens": 2}
    tried = 0
    with httpx.Client(base_url=server.url, timeout=60) as http:

        def post(headers: list[tuple[str, str | bytes]], rid: str) -> Any:
            nonlocal tried
            tried += 1
            r = http.post("/v1/completions", json=body, headers=[("X-Request-Id", rid), *headers])
            assert r.status_code == 200, (headers, r.text[:200])
            return r

        for i, tp in enumerate(BAD_TRACEPARENTS):
            post([("traceparent", tp)], f"badtp-{i}")
        for i, ts in enumerate(BAD_TRACESTATES):
            post([("traceparent", GOOD_TP), ("tracestate", ts)], f"badts-{i}")
        post([("traceparent", GOOD_TP), ("traceparent", "00-" + "c" * 32 + "-" + "d" * 16 + "-01")],
             "duptp")  # fmt: skip
        odd = 'odd id ü ✓ "quoted" <tag> ;,= \\ /../%00'
        post([], "")  # an empty id
        r = http.post("/v1/completions", json=body,
                      headers=[("X-Request-Id", odd.encode())])  # fmt: skip
        tried += 1
        assert r.status_code == 200
        post([], "long-" + "x" * 5000)
        # Rejected before admission: no journey, the server goes on.
        r = http.post("/v1/completions", json={**body, "max_tokens": 10**9})
        tried += 1
        assert r.status_code == 400

    def roots() -> dict[str, Any]:
        found = {}
        for s in wire_spans(receiver):
            rid = str(s.attributes.get(S.REQUEST_ID, ""))
            if s.name == S.SPAN_REQUEST and rid.startswith(("cmpl-bad", "cmpl-dup", "cmpl-long")):
                found[rid] = s
        return found

    expected = len(BAD_TRACEPARENTS) + len(BAD_TRACESTATES) + 2
    got = wait_until(
        lambda: (f := roots()) and len(f) >= expected and f, 30, what="bad-input roots"
    )

    # Each engine root hangs under the API server's span (its own exporter's).
    def api_parents() -> dict[int, int | None]:
        apis = {s.context.span_id: (s.parent.span_id if s.parent else None)
                for s in wire_spans(receiver) if s.name == S.SPAN_API}  # fmt: skip
        return apis if all(r.parent and r.parent.span_id in apis for r in got.values()) else {}

    api_parent = wait_until(api_parents, 30, what="the API server's spans above them")
    for rid, span in got.items():
        if rid.startswith("cmpl-badtp-"):
            # Its own trace: the API server's span is the root, the engine's under it.
            assert api_parent[span.parent.span_id] is None, rid
        elif rid.startswith("cmpl-badts-"):  # the client's span is the API span's parent
            assert api_parent[span.parent.span_id] == int("b" * 16, 16), rid
        elif rid.startswith("cmpl-long-"):
            assert len(rid) == 1024, "attribute values are cut at the length limit"
    return tried
