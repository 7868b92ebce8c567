"""A request still in flight is seen before it ends: a real `vllm serve`, both layouts.

With ``VLLM_JOURNEY_OTEL_IN_FLIGHT_S=0.3``, four concurrent 2,000-token completions
stay in flight for seconds: the real OTLP receiver gets ``vllm.in_flight``
snapshots of the traced one before its final journey, which is their parent.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import requires_vllm
from otlp_receiver import wire_spans
from services import VllmServer
from serving import LAYOUTS, client, journeys_in_trace, new_traceparent, start_servers
from vllm_journey_otel import schema as S

pytestmark = [requires_vllm, pytest.mark.e2e]


@pytest.fixture(scope="module")
def servers(model_dir, module_receiver, tmp_path_factory) -> Iterator[dict[str, VllmServer]]:  # type: ignore[no-untyped-def]
    """Both layouts' servers, started together (each test stops its own)."""
    env = {"VLLM_JOURNEY_OTEL_IN_FLIGHT_S": "0.3", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    started = start_servers(
        model_dir, tmp_path_factory.mktemp("in-flight"), module_receiver, LAYOUTS, env=env
    )
    yield started
    for server in started.values():
        server.stop()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_long_request_is_seen_in_flight(servers, module_receiver, layout: str) -> None:  # type: ignore[no-untyped-def]
    server, receiver = servers[layout], module_receiver
    tp, trace_id, _ = new_traceparent()
    try:
        c = client(server)

        def complete(i: int) -> int:
            headers = {"traceparent": tp} if i == 0 else {}
            r = c.completions.create(
                model=server.model, prompt=f"a long answer {i}", max_tokens=2000,
                extra_headers=headers, extra_body={"ignore_eos": True},
            )  # fmt: skip
            return r.usage.completion_tokens

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, range(4))) == [2000] * 4
        (root,) = journeys_in_trace(receiver, trace_id)
        arrived = wire_spans(receiver)
    finally:
        server.stop()
    ours = [s for s in arrived if s.context.trace_id == trace_id]
    snaps = [s for s in ours if s.name == S.SPAN_IN_FLIGHT]
    assert snaps, "no snapshot of a request in flight for seconds"
    # It arrived before the final journey, which was exported when the request ended.
    first_root = next(i for i, s in enumerate(ours) if s.name == S.SPAN_REQUEST)
    assert ours.index(snaps[0]) < first_root
    first = min(snaps, key=lambda s: s.attributes[S.IN_FLIGHT_SNAPSHOT])
    a = first.attributes
    # Level n: taken at least 2 ** (n - 1) thresholds after admission (the drain
    # thread looks once a second, so the first may already be past level 1).
    level = a[S.IN_FLIGHT_SNAPSHOT]
    assert level >= 1 and a[S.IN_FLIGHT_MS] >= 300 * 2 ** (level - 1)
    assert a[S.IN_FLIGHT_STATE] == S.IN_FLIGHT_RUNNING  # four requests fit one batch
    assert 0 <= a[S.DECODE_DONE_TOKENS] < 2000
    assert a[S.REQUEST_ID] == root.attrs[S.REQUEST_ID]
    for s in snaps:
        assert s.parent is not None and s.parent.span_id == root.span.context.span_id
        assert root.start <= s.start_time and s.end_time < root.end
