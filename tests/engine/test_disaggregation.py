"""Disaggregated prefill/decode on real Schedulers with vLLM's own NixlConnector
(scheduler side: its worker side needs the NIXL library and a GPU, so the test
reports the transfers as that worker side would: tests/harness.py).

The prefill side keeps an ended request's KV blocks for the decode side until
its worker reports them sent: the journey shows that as ``vllm.kv_held`` and
hands its root's ids to the decode side in the returned ``kv_transfer_params``;
the decode side's journey links to it. Served for real, both paths, in
tests/e2e/test_e2e_pd.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import import_harness, requires_vllm
from trees import check_invariants
from vllm_journey_otel import schema as S
from vllm_journey_otel.journey import KV_LINK_KEY

harness = import_harness()
pytestmark = requires_vllm

CLIENT_TRACE = 0x0AF7651916CD43DD8448EB211C80319C
CLIENT_SPAN = 0xB7AD6B7169203331
TRACEPARENT = f"00-{CLIENT_TRACE:032x}-{CLIENT_SPAN:016x}-01"


def _until_ended(e: Any, *rids: str) -> None:
    """Steps until each request's final output came (its blocks may stay held)."""
    for _ in range(100):
        if all(r in e.kv_params or r not in e.scheduler.requests for r in rids):
            e.drain_in_flight()
            return
        e.step()
    raise AssertionError(f"{rids} did not end")


def test_prefill_side_holds_its_journey_until_the_kv_is_sent(tracing, tmp_path) -> None:
    e = harness.Engine(remote_kv="nixl-prefill")
    e.add("p1", prompt_len=40, max_tokens=1, remote_decode=True,
          trace_headers={"traceparent": TRACEPARENT})  # fmt: skip
    e.add("p2", prompt_len=20, max_tokens=1, remote_decode=True)
    e.add("local", prompt_len=20, max_tokens=2)
    _until_ended(e, "p1", "p2", "local")
    # vLLM keeps the blocks (and the request) for the decode side; the journey waits.
    assert {"p1", "p2"} <= set(e.scheduler.requests)
    blocks = {r: len(e.scheduler.kv_cache_manager.get_block_ids(r)[0]) for r in ("p1", "p2")}
    assert set(tracing.journeys()) == {"local"}
    # The params the client gets (and the proxy hands the decode side) name our root.
    ours = e.kv_params["p1"][KV_LINK_KEY]
    assert ours["request_id"] == "p1"
    version, trace_hex, span_hex, flags = ours["traceparent"].split("-")
    assert (version, int(trace_hex, 16), flags) == ("00", CLIENT_TRACE, "01")
    e.kv_sent.add("p1")  # the decode side read p1's blocks
    e.step()
    assert "p1" not in e.scheduler.requests
    journeys = tracing.journeys()
    assert set(journeys) == {"local", "p1"}
    p1 = journeys["p1"]
    check_invariants(p1)
    assert p1.span.context.span_id == int(span_hex, 16)
    assert p1.span.context.trace_id == CLIENT_TRACE
    (held,) = p1.kids(S.SPAN_KV_HELD)
    assert held.start == p1.end < held.end
    assert held.attrs[S.KV_HELD_BLOCKS] == blocks["p1"] == 3  # 40 tokens, blocks of 16
    assert held.attrs[S.KV_HELD_RELEASED] is True
    assert held.attrs[S.KV_HELD_MS] == pytest.approx((held.end - held.start) / 1e6)
    assert p1.attrs[S.KV_HELD_MS] == held.attrs[S.KV_HELD_MS]
    assert not journeys["local"].kids(S.SPAN_KV_HELD)
    assert S.KV_HELD_MS not in journeys["local"].attrs
    # Shutdown with p2's blocks still held: handed on, the hold not released
    # (its length unknown: no kv_held.ms, missing is not zero).
    e.scheduler.shutdown()
    p2 = tracing.journeys()["p2"]
    check_invariants(p2)
    (held2,) = p2.kids(S.SPAN_KV_HELD)
    assert held2.attrs[S.KV_HELD_RELEASED] is False
    assert held2.attrs[S.KV_HELD_BLOCKS] == blocks["p2"]
    assert S.KV_HELD_MS not in held2.attrs and S.KV_HELD_MS not in p2.attrs
    # vllm-journey summary on the trace file: the released hold's figures, and
    # the one still held counted apart (its length unknown).
    from vllm_journey_otel.export.file_exporter import OtlpJsonFileExporter
    from vllm_journey_otel.tools.summary import SUMMARY_ATTRIBUTES, format_text, summarize
    from vllm_journey_otel.tools.tracefile import read_spans

    path = tmp_path / "pd.jsonl"
    OtlpJsonFileExporter(path).export(tracing.spans())
    d = summarize(read_spans([path], attributes_of=SUMMARY_ATTRIBUTES)).to_dict()
    assert d["kv_held"]["ms"]["count"] == 1
    assert d["kv_held"]["ms"]["max"] == round(held.attrs[S.KV_HELD_MS], 3)
    assert d["kv_held"]["unreleased"] == 1
    assert "for the decode side): 1 released, 1 still held at shutdown" in format_text(d)


def test_decode_side_links_to_the_prefill_journey(tracing) -> None:
    prefill = harness.Engine(remote_kv="nixl-prefill")
    prefill.add("p1", prompt_len=40, max_tokens=1, remote_decode=True,
                trace_headers={"traceparent": TRACEPARENT})  # fmt: skip
    _until_ended(prefill, "p1")
    params = prefill.kv_params["p1"]
    assert params["do_remote_prefill"] is True and params["remote_request_id"]
    # The proxy sends the decode side the same request with those params.
    decode = harness.Engine(remote_kv="nixl")
    decode.add("d1", prompt_len=40, max_tokens=4, kv_params=params,
               trace_headers={"traceparent": TRACEPARENT})  # fmt: skip
    for _ in range(3):
        decode.step()
    decode.kv_loaded.add("d1")  # the decode side's worker read the blocks
    prefill.kv_sent.add("p1")  # ... and the prefill side's reports them sent
    prefill.step()
    decode.run()
    journeys = tracing.journeys()
    p1, d1 = journeys["p1"], journeys["d1"]
    for j in (p1, d1):
        check_invariants(j)
    assert d1.attrs[S.KV_REMOTE_REQUEST_ID] == params["remote_request_id"]
    assert d1.attrs[S.KV_REMOTE_ENGINE_ID] == params["remote_engine_id"]
    (link,) = d1.span.links
    assert (link.context.trace_id, link.context.span_id) == (
        p1.span.context.trace_id,
        p1.span.context.span_id,
    )
    assert dict(link.attributes or {})[S.KV_REMOTE_REQUEST_ID] == params["remote_request_id"]
    # The decode side waited for the load; the prefill side held its blocks meanwhile.
    (wait,) = d1.kids(S.SPAN_QUEUED)[0].children
    assert wait.attrs[S.WAIT_REASON] == S.WAIT_REMOTE_KV
    (held,) = p1.kids(S.SPAN_KV_HELD)
    # The prefill side's hold outlasted the decode side's load (its end came
    # with the report, after the decode side had begun waiting).
    assert wait.start < held.end


def test_params_from_a_client_are_bounded_and_checked(tracing) -> None:
    """kv_transfer_params are user input: a bad link is no link, long ids are cut.
    (tests/remote_kv_connector.py: NIXL itself refuses such params.)"""
    decode = harness.Engine(remote_kv="test")
    bad = {
        "do_remote_prefill": True,
        "remote_request_id": "r" * 1000,
        "remote_engine_id": 7,
        KV_LINK_KEY: {"traceparent": 42, "request_id": ["x"]},
    }
    decode.add("d", prompt_len=40, max_tokens=2, kv_params=bad)
    for _ in range(3):
        decode.step()
    decode.kv_loaded.add("d")
    decode.run()
    d = tracing.journeys()["d"]
    check_invariants(d)
    assert d.attrs[S.KV_REMOTE_REQUEST_ID] == "r" * 256
    assert S.KV_REMOTE_ENGINE_ID not in d.attrs
    assert not d.span.links


def test_link_to_a_prefill_journey_in_a_trace_of_its_own(tracing) -> None:
    """No client traceparent at the prefill side (a proxy that passes no trace
    context on): its root starts a trace of its own ids, and the link finds it."""
    prefill = harness.Engine(remote_kv="nixl-prefill")
    prefill.add("p", prompt_len=40, max_tokens=1, remote_decode=True)
    _until_ended(prefill, "p")
    decode = harness.Engine(remote_kv="nixl")
    decode.add("d", prompt_len=40, max_tokens=2, kv_params=prefill.kv_params["p"])
    for _ in range(3):
        decode.step()
    decode.kv_loaded.add("d")
    prefill.kv_sent.add("p")
    prefill.step()
    decode.run()
    journeys = tracing.journeys()
    p, d = journeys["p"], journeys["d"]
    assert p.span.parent is None and d.span.parent is None
    assert p.span.context.trace_id != d.span.context.trace_id
    (link,) = d.span.links
    assert (link.context.trace_id, link.context.span_id) == (
        p.span.context.trace_id,
        p.span.context.span_id,
    )


def test_a_hold_it_cannot_see_end_is_not_waited_for(tracing, monkeypatch) -> None:
    """Without the Scheduler._free_blocks hook (a vLLM without it, a subclass
    overriding it) no journey waits for a release it would never see: it is
    exported at its end, without vllm.kv_held, and still hands on its ids. Past
    the bound on held journeys, the same."""
    from vllm_journey_otel.engine import disaggregation
    from vllm_journey_otel.engine.state import TRACKER_ATTR

    e = harness.Engine(remote_kv="nixl-prefill")
    e.scheduler.__dict__[TRACKER_ATTR].kv.sees_release = False
    e.add("unseen", prompt_len=40, max_tokens=1, remote_decode=True)
    _until_ended(e, "unseen")
    e2 = harness.Engine(remote_kv="nixl-prefill")
    monkeypatch.setattr(disaggregation, "_MAX_HELD", 0)
    e2.add("bound", prompt_len=40, max_tokens=1, remote_decode=True)
    _until_ended(e2, "bound")
    assert {"unseen", "bound"} <= set(e.scheduler.requests) | set(e2.scheduler.requests)
    journeys = tracing.journeys()
    for rid, engine in (("unseen", e), ("bound", e2)):
        j = journeys[rid]  # exported although vLLM still holds its blocks
        check_invariants(j)
        assert not j.kids(S.SPAN_KV_HELD) and S.KV_HELD_MS not in j.attrs
        assert engine.kv_params[rid][KV_LINK_KEY]["request_id"] == rid


def test_params_that_are_not_a_dict_leave_tracing_on(tracing) -> None:
    """kv_transfer_params of the offline API are not type-checked by vLLM: a
    value that is not a dict is no remote KV, never a failure of the tracer."""
    from vllm_journey_otel.engine import state

    e = harness.Engine(remote_kv="test")
    e.add("odd", prompt_len=20, max_tokens=3)
    e.step()
    e.requests["odd"].kv_transfer_params = ["not", "a", "dict"]  # type: ignore[assignment]
    e.run()
    assert state._STATE.enabled
    odd = tracing.journeys()["odd"]
    check_invariants(odd)
    assert S.KV_REMOTE_REQUEST_ID not in odd.attrs
