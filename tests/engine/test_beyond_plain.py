"""Journeys beyond the plain path, recorded from a real vLLM Scheduler.

Priority preemption (its cause and a link to it), speculative decoding (drafts
per decode span and per request), LoRA (adapter on the cycles, the wait for an
adapter slot). Each drives vLLM's own scheduler (tests/harness.py) configured as
vLLM's tests/v1/core configure it, with fabricated model outputs.
"""

from __future__ import annotations

import itertools

import pytest

from conftest import import_harness, requires_vllm
from scheduling import SCHEDULERS, assert_no_state_left
from trees import check_invariants, expected_shape
from vllm_journey_otel import schema as S
from vllm_journey_otel.engine import handoff, sampling, state, tracker

pytestmark = requires_vllm

harness = import_harness()

SPEC_KEYS = (S.SPEC_DRAFTS_PROPOSED, S.SPEC_DRAFTS_ACCEPTED, S.SPEC_ACCEPTANCE_RATE)


# ---------------------------------------------------------------------------
# Priority scheduling
# ---------------------------------------------------------------------------
def _priority_engine(async_scheduling: bool):  # type: ignore[no-untyped-def]
    """A low-priority request runs; a high-priority one arrives and, when its KV
    blocks run out, the priority policy evicts the low-priority one."""
    e = harness.Engine(
        async_scheduling=async_scheduling,
        policy="priority",
        num_blocks=5,
        max_num_batched_tokens=64,
        max_model_len=512,
        max_num_seqs=8,
    )
    e.add("low", prompt_len=14, max_tokens=20, priority=10)
    e.step()
    e.step()
    e.add("high", prompt_len=32, max_tokens=5, priority=0)
    return e


@SCHEDULERS
def test_priority_preemption_names_and_links_its_cause(tracing, async_scheduling: bool) -> None:
    e = _priority_engine(async_scheduling)
    e.run()
    assert e.requests["low"].num_preemptions >= 1, "precondition: low was evicted"
    assert e.requests["high"].num_preemptions == 0
    journeys = tracing.journeys()
    low, high = journeys["low"], journeys["high"]
    for j in (low, high):
        check_invariants(j)
    assert low.attrs[S.PRIORITY] == 10
    assert S.PRIORITY not in high.attrs  # priority 0 is the default
    preempted = low.kids(S.SPAN_PREEMPTED)
    assert len(preempted) == e.requests["low"].num_preemptions
    high_root = high.span.context
    for p in preempted:
        assert p.attrs[S.PREEMPTED_BY] == "high"
        (link,) = p.span.links
        # The link resolves to the root of high's journey, exported separately.
        assert (link.context.trace_id, link.context.span_id) == (
            high_root.trace_id,
            high_root.span_id,
        )
        assert dict(link.attributes or {}) == {S.REQUEST_ID: "high"}
    # Nothing else carries links.
    for j in (low, high):
        stack = [j]
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.name != S.SPAN_PREEMPTED:
                assert not node.span.links, node.name
    assert_no_state_left(e)


def test_priority_cause_in_the_clients_trace(tracing) -> None:
    """The cause came with a traceparent: its root is in the client's trace, so is the link."""
    e = harness.Engine(
        policy="priority", num_blocks=5, max_num_batched_tokens=64, max_model_len=512
    )
    e.add("low", prompt_len=14, max_tokens=20, priority=10)
    e.step()
    e.step()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    e.add(
        "high",
        prompt_len=32,
        max_tokens=5,
        priority=0,
        trace_headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
    )
    e.run()
    journeys = tracing.journeys()
    high = journeys["high"].span.context
    assert high.trace_id == int(trace_id, 16)
    (link,) = journeys["low"].kids(S.SPAN_PREEMPTED)[0].span.links
    assert (link.context.trace_id, link.context.span_id) == (high.trace_id, high.span_id)


def test_preemption_cause_not_traced(tracing, monkeypatch) -> None:
    """A cause that head sampling dropped: its id is recorded, no link to nowhere."""
    from vllm_journey_otel.engine.sampling import HeadSampler

    # Drop exactly the request named "high" at admission (and keep no tail).
    monkeypatch.setattr(
        sampling.HeadSampler, "decide", lambda self, headers: (headers is None, None)
    )
    assert isinstance(state._STATE.head, HeadSampler)
    e = harness.Engine(
        policy="priority", num_blocks=5, max_num_batched_tokens=64, max_model_len=512
    )
    e.add("low", prompt_len=14, max_tokens=20, priority=10)
    e.step()
    e.step()
    e.add("high", prompt_len=32, max_tokens=5, priority=0, trace_headers={"x": "drop"})
    e.run()
    journeys = tracing.journeys()
    assert set(journeys) == {"low"}
    preempted = journeys["low"].kids(S.SPAN_PREEMPTED)
    assert preempted and all(p.attrs[S.PREEMPTED_BY] == "high" for p in preempted)
    assert all(not p.span.links for p in preempted)


@SCHEDULERS
@pytest.mark.parametrize(("b_prompt", "cause"), [(40, "A"), (30, None)], ids=["by-A", "by-itself"])
def test_fcfs_preemption_cause(
    tracing, async_scheduling: bool, b_prompt: int, cause: str | None
) -> None:
    """FCFS evicts the newest running request (B) for whichever running request
    needs blocks: A's growth (B's 40-token prompt fills the cache), or B's own
    (30 tokens: B outgrows the cache first; then nothing is named)."""
    e = harness.Engine(
        async_scheduling=async_scheduling,
        num_blocks=5,
        max_num_batched_tokens=64,
        max_model_len=512,
        max_num_seqs=8,
    )
    e.add("A", prompt_len=14, max_tokens=20)
    e.step()
    e.step()
    e.add("B", prompt_len=b_prompt, max_tokens=5)
    e.run()
    journeys = tracing.journeys()
    b = journeys["B"]
    check_invariants(b)
    preempted = b.kids(S.SPAN_PREEMPTED)
    assert len(preempted) == e.requests["B"].num_preemptions == 1
    assert preempted[0].attrs.get(S.PREEMPTED_BY) == cause
    links = [lk.context.span_id for lk in preempted[0].span.links]
    assert links == ([journeys["A"].span.context.span_id] if cause else [])


# ---------------------------------------------------------------------------
# Speculative decoding
# ---------------------------------------------------------------------------
def _spec_engine(**kw):  # type: ignore[no-untyped-def]
    """``spec_metrics="summary"``: vLLM counts drafts per request itself, and the
    plugin reads those counts at transitions instead of counting every step."""
    # The n-gram proposer needs no draft model (with async scheduling, vLLM's
    # GPU n-gram proposer: the AsyncScheduler schedules draft placeholders).
    e = harness.Engine(num_spec_tokens=3, **kw)
    pattern = [3, 1, 0, 2]
    e.accept_for = lambda rid, i, n: pattern[i % len(pattern)]
    return e


@SCHEDULERS
@pytest.mark.parametrize("vllm_metrics", ["none", "summary"])
def test_spec_decode_drafts_on_decode_and_root(
    tracing, async_scheduling: bool, vllm_metrics: str
) -> None:
    e = _spec_engine(async_scheduling=async_scheduling, spec_metrics=vllm_metrics)
    e.add("s", prompt_len=20, max_tokens=30)
    e.run()
    log = e.verify_log["s"]
    proposed = sum(p for p, _ in log)
    accepted = sum(a for _, a in log)
    assert len(log) >= 4 and 0 < accepted < proposed, log
    j = tracing.journeys()["s"]
    check_invariants(j)
    assert j.shape() == expected_shape("PD")
    # Accepted drafts are tokens: fewer steps than tokens.
    assert j.attrs[S.GEN_AI_OUTPUT_TOKENS] == 30 == e.requests["s"].num_output_tokens
    assert j.attrs[S.SPEC_DRAFTS_PROPOSED] == proposed
    assert j.attrs[S.SPEC_DRAFTS_ACCEPTED] == accepted
    assert j.attrs[S.SPEC_ACCEPTANCE_RATE] == pytest.approx(accepted / proposed)
    prefill, decode = j.kids(S.SPAN_SCHEDULED)[0].children
    assert decode.attrs[S.SPEC_DRAFTS_PROPOSED] == proposed
    assert decode.attrs[S.SPEC_DRAFTS_ACCEPTED] == accepted
    assert decode.attrs[S.SPEC_ACCEPTANCE_RATE] == pytest.approx(accepted / proposed)
    for key in SPEC_KEYS:
        assert key not in prefill.attrs
    assert_no_state_left(e)


@SCHEDULERS
@pytest.mark.parametrize("vllm_metrics", ["none", "summary"])
def test_spec_decode_nothing_accepted_and_nothing_proposed(
    tracing, async_scheduling: bool, vllm_metrics: str
) -> None:
    e = _spec_engine(async_scheduling=async_scheduling, spec_metrics=vllm_metrics)
    e.accept_for = lambda rid, i, n: 0
    e.add("rejects", prompt_len=20, max_tokens=5)
    e.add("one", prompt_len=20, max_tokens=1)  # finishes with its first token: no drafts
    e.run()
    journeys = tracing.journeys()
    r = journeys["rejects"]
    check_invariants(r)
    n = sum(p for p, _ in e.verify_log["rejects"])
    assert n > 0
    assert r.attrs[S.SPEC_DRAFTS_PROPOSED] == n
    assert r.attrs[S.SPEC_DRAFTS_ACCEPTED] == 0
    assert r.attrs[S.SPEC_ACCEPTANCE_RATE] == 0.0  # observed: every draft rejected
    one = journeys["one"]
    assert "one" not in e.verify_log
    # Speculative decoding was on and proposed nothing: 0 counted, the rate unobserved.
    assert one.attrs[S.SPEC_DRAFTS_PROPOSED] == 0
    assert one.attrs[S.SPEC_DRAFTS_ACCEPTED] == 0
    assert S.SPEC_ACCEPTANCE_RATE not in one.attrs


@SCHEDULERS
@pytest.mark.parametrize("vllm_metrics", ["none", "summary"])
def test_spec_decode_across_preemptions(tracing, async_scheduling: bool, vllm_metrics: str) -> None:
    """Each cycle's decode span counts its own verify steps; they sum to the root's."""
    e = _spec_engine(
        async_scheduling=async_scheduling,
        spec_metrics=vllm_metrics,
        num_blocks=8,
        max_num_batched_tokens=64,
        max_model_len=512,
        max_num_seqs=8,
    )
    for i in range(4):
        e.add(f"r{i}", prompt_len=20 + 7 * i, max_tokens=40)
    e.run()
    assert sum(r.num_preemptions for r in e.requests.values()) > 0, "precondition: preemptions"
    journeys = tracing.journeys()
    for rid, req in e.requests.items():
        j = journeys[rid]
        check_invariants(j)
        log = e.verify_log.get(rid, [])
        assert j.attrs[S.SPEC_DRAFTS_PROPOSED] == sum(p for p, _ in log)
        assert j.attrs[S.SPEC_DRAFTS_ACCEPTED] == sum(a for _, a in log)
        decodes = [p for c in j.kids(S.SPAN_SCHEDULED) for p in c.kids(S.SPAN_DECODE)]
        # A step in flight when its request was preempted (async) counts on the
        # root only: its cycle had ended.
        stale = e.stale_verify.get(rid, [])
        assert sum(d.attrs[S.SPEC_DRAFTS_PROPOSED] for d in decodes) == sum(
            p for p, _ in log
        ) - sum(p for p, _ in stale)
        assert sum(d.attrs[S.SPEC_DRAFTS_ACCEPTED] for d in decodes) == sum(
            a for _, a in log
        ) - sum(a for _, a in stale)
        assert j.attrs[S.GEN_AI_OUTPUT_TOKENS] == req.num_output_tokens == 40
    if async_scheduling:
        assert e.stale_verify, "precondition: a verify step in flight at a preemption"
    assert_no_state_left(e)


@SCHEDULERS
def test_no_spec_attributes_without_spec_decoding(tracing, async_scheduling: bool) -> None:
    """Missing is not zero: without a drafter there are no draft counts at all."""
    e = harness.Engine(async_scheduling=async_scheduling)
    e.add("plain", prompt_len=20, max_tokens=5)
    e.run()
    j = tracing.journeys()["plain"]
    decode = j.kids(S.SPAN_SCHEDULED)[0].children[1]
    for key in SPEC_KEYS:
        assert key not in j.attrs and key not in decode.attrs


# ---------------------------------------------------------------------------
# LoRA
# ---------------------------------------------------------------------------
@SCHEDULERS
def test_lora_name_on_cycles_and_wait_for_adapter_slot(tracing, async_scheduling: bool) -> None:
    from vllm.lora.request import LoRARequest

    sql = LoRARequest("sql", 1, "/nonexistent/sql")
    chat = LoRARequest("chat", 2, "/nonexistent/chat")
    e = harness.Engine(async_scheduling=async_scheduling, max_loras=1)
    e.add("a", prompt_len=20, max_tokens=6, lora=sql)
    e.add("a2", prompt_len=20, max_tokens=3, lora=sql)  # same adapter: no wait
    e.add("b", prompt_len=20, max_tokens=4, lora=chat)  # the one slot is taken
    e.add("plain", prompt_len=20, max_tokens=4)
    e.run()
    journeys = tracing.journeys()
    for j in journeys.values():
        check_invariants(j)
    names = {"a": "sql", "a2": "sql", "b": "chat"}
    for rid, name in names.items():
        j = journeys[rid]
        assert j.attrs[S.LORA_NAME] == name
        assert [c.attrs[S.LORA_NAME] for c in j.kids(S.SPAN_SCHEDULED)] == [name]
    plain = journeys["plain"]
    assert S.LORA_NAME not in plain.attrs
    assert S.LORA_NAME not in plain.kids(S.SPAN_SCHEDULED)[0].attrs
    for rid in ("a", "a2", "plain"):
        assert not journeys[rid].kids(S.SPAN_QUEUED)[0].children, rid
    b = journeys["b"]
    (queued,) = b.kids(S.SPAN_QUEUED)
    (wait,) = queued.children
    assert wait.name == S.SPAN_WAIT
    assert wait.attrs == {S.WAIT_REASON: S.WAIT_LORA_SLOT}
    # It waited from its first step in the queue, while sql ran, to its schedule
    # (in steps, not in time: a stall before the first step is plain queueing).
    assert wait.start < journeys["a"].kids(S.SPAN_SCHEDULED)[0].end
    assert wait.end == queued.end
    assert wait.end > journeys["a"].kids(S.SPAN_SCHEDULED)[0].start
    assert_no_state_left(e)


# ---------------------------------------------------------------------------
# Engine step view
# ---------------------------------------------------------------------------
@pytest.fixture
def step_tracing(tracing):  # type: ignore[no-untyped-def]
    """The plugin with the step view on (VLLM_JOURNEY_OTEL_STEPS=1)."""
    from vllm_journey_otel.config import Config
    from vllm_journey_otel.engine import hooks

    hooks.uninstall()
    assert hooks.install(
        Config(enabled=True, steps=True), exporters=[tracing.exporter], batch=False
    )
    return tracing


def _steps(tracing):  # type: ignore[no-untyped-def]
    spans = [s for s in tracing.spans() if s.name == S.SPAN_STEP]
    return sorted(spans, key=lambda s: s.attributes[S.SCHEDULER_STEP])


def _record_batches(e):  # type: ignore[no-untyped-def]
    """The harness's schedule(), remembering what each non-empty step scheduled."""
    batches: list[dict[str, int]] = []
    preempted: list[int] = []
    schedule = e.schedule

    def spy():  # type: ignore[no-untyped-def]
        so = schedule()
        if so.num_scheduled_tokens:
            batches.append(dict(so.num_scheduled_tokens))
            preempted.append(len(so.preempted_req_ids))
        return so

    e.schedule = spy
    return batches, preempted


@SCHEDULERS
def test_step_view_links_each_batch(step_tracing, async_scheduling: bool) -> None:
    e = harness.Engine(
        async_scheduling=async_scheduling,
        num_blocks=8,
        max_num_batched_tokens=64,
        max_model_len=512,
        max_num_seqs=8,
    )
    batches, preempted = _record_batches(e)
    for i in range(4):
        e.add(f"r{i}", prompt_len=20 + 7 * i, max_tokens=12)
    e.run()
    assert sum(r.num_preemptions for r in e.requests.values()) > 0, "precondition: preemptions"
    steps = _steps(step_tracing)
    journeys = step_tracing.journeys()
    root_of = {rid: j.span.context for rid, j in journeys.items()}
    assert len(steps) == len(batches)
    for span, batch, n_pre in zip(steps, batches, preempted, strict=True):
        a = span.attributes
        assert span.parent is None  # its own trace
        assert a[S.STEP_BATCH_SIZE] == len(batch)
        assert a[S.STEP_PREFILL_TOKENS] + a[S.STEP_DECODE_TOKENS] == sum(batch.values())
        assert a[S.STEP_NUM_PREEMPTIONS] == n_pre
        assert 0.0 < a[S.KV_CACHE_USAGE] <= 1.0
        assert a[S.NUM_RUNNING] >= 1 and a[S.NUM_WAITING] >= 0
        assert 0.0 <= a[S.STEP_SCHEDULE_MS] <= (span.end_time - span.start_time) / 1e6
        linked = {(lk.context.trace_id, lk.context.span_id) for lk in span.links}
        expected = {(root_of[rid].trace_id, root_of[rid].span_id) for rid in batch}
        assert linked == expected
        assert sorted(lk.attributes[S.REQUEST_ID] for lk in span.links) == sorted(batch)
    assert sum(s.attributes[S.STEP_NUM_PREEMPTIONS] for s in steps) == sum(
        r.num_preemptions for r in e.requests.values()
    )
    # The same counter as the journeys' vllm.journey.scheduler_step: one per schedule().
    numbers = [s.attributes[S.SCHEDULER_STEP] for s in steps]
    assert len(set(numbers)) == len(numbers) and numbers[0] == 1
    assert_no_state_left(e)
    from vllm_journey_otel.engine.state import TRACKER_ATTR

    assert e.scheduler.__dict__[TRACKER_ATTR].steps_open == {}


@SCHEDULERS
def test_step_view_splits_prefill_and_decode(step_tracing, async_scheduling: bool) -> None:
    e = harness.Engine(async_scheduling=async_scheduling)
    e.add("r", prompt_len=40, max_tokens=6)
    e.run()
    steps = _steps(step_tracing)
    split = [
        (s.attributes[S.STEP_PREFILL_TOKENS], s.attributes[S.STEP_DECODE_TOKENS]) for s in steps
    ]
    # The prompt in one step, then one token per step (async: vLLM may schedule
    # one step beyond the last token, which is decode too).
    assert split[0] == (40, 0)
    assert all(p == 0 and d == 1 for p, d in split[1:]) and len(split[1:]) >= 5, split


def test_step_view_off_by_default(tracing) -> None:
    from vllm_journey_otel.engine.state import TRACKER_ATTR

    e = harness.Engine()
    e.add("r", prompt_len=40, max_tokens=6)
    e.run()
    assert e.scheduler.__dict__[TRACKER_ATTR].steps_ratio == 0.0
    assert not [s for s in tracing.spans() if s.name == S.SPAN_STEP]


def test_step_view_sampled_by_ratio(tracing) -> None:
    import random

    from vllm_journey_otel.config import Config
    from vllm_journey_otel.engine import hooks

    hooks.uninstall()
    cfg = Config(enabled=True, steps=True, steps_ratio=0.25)
    assert hooks.install(cfg, exporters=[tracing.exporter], batch=False)
    random.seed(7)
    e = harness.Engine()
    batches, _ = _record_batches(e)
    e.add("r", prompt_len=40, max_tokens=200)
    e.run()
    n = len(_steps(tracing))
    assert len(batches) == 200
    assert 25 <= n <= 75, n  # about a quarter of 200 steps (seeded)


# ---------------------------------------------------------------------------
# Waits inside the queue: structured-output grammar
# ---------------------------------------------------------------------------
@SCHEDULERS
def test_wait_for_structured_output_grammar(tracing, async_scheduling: bool) -> None:
    e = harness.Engine(async_scheduling=async_scheduling)
    schema = '{"type": "object"}'
    e.add("json", prompt_len=20, max_tokens=4, json_schema=schema)
    e.add("broken", prompt_len=20, max_tokens=4, json_schema=schema)
    e.add("plain", prompt_len=20, max_tokens=4)
    for _ in range(3):
        e.step()
    assert e.requests["json"].num_output_tokens == 0, "precondition: blocked on its grammar"
    e.compile_grammar("json")
    e.compile_grammar("broken", error=True)
    e.run()
    journeys = tracing.journeys()
    for j in journeys.values():
        check_invariants(j)
    assert not journeys["plain"].kids(S.SPAN_QUEUED)[0].children
    for rid in ("json", "broken"):
        (queued,) = journeys[rid].kids(S.SPAN_QUEUED)
        (wait,) = queued.children
        assert wait.attrs == {S.WAIT_REASON: S.WAIT_GRAMMAR}
        # From admission to the step that found the grammar compiled (or failed).
        assert (wait.start, wait.end) == (queued.start, queued.end)
        assert wait.end > journeys["plain"].kids(S.SPAN_QUEUED)[0].end
    assert journeys["json"].shape()[1][1:] == expected_shape("PD")[1][1:]
    # A grammar that failed to compile: vLLM ends the request with an error.
    broken = journeys["broken"]
    assert broken.attrs[S.FINISH_STATUS] == S.FINISH_ERROR
    assert [k.name for k in broken.children] == [S.SPAN_QUEUED]
    assert_no_state_left(e)
    from vllm_journey_otel.engine.state import TRACKER_ATTR

    assert e.scheduler.__dict__[TRACKER_ATTR].blocked == {}


# ---------------------------------------------------------------------------
# Waits inside the queue: remote KV (KV connector, disaggregated prefill)
# ---------------------------------------------------------------------------
@SCHEDULERS
@pytest.mark.parametrize("connector", ["nixl", "test"])
def test_wait_for_remote_kv(tracing, async_scheduling: bool, connector: str) -> None:
    """Disaggregated prefill on the decode side. ``nixl``: vLLM's own NixlConnector
    (scheduler side; no NIXL library here, so the test reports the transfers done
    as its worker side would). ``test``: tests/remote_kv_connector.py, which loads
    39 of 40 prompt tokens."""
    e = harness.Engine(async_scheduling=async_scheduling, remote_kv=connector)
    e.add("decode-side", prompt_len=40, max_tokens=4, remote_prefill=True)
    e.add("gone", prompt_len=40, max_tokens=4, remote_prefill=True)
    e.add("lost", prompt_len=40, max_tokens=4, remote_prefill=True)
    e.add("local", prompt_len=20, max_tokens=4)
    for _ in range(3):
        e.step()
    assert e.requests["decode-side"].num_output_tokens == 0, "precondition: still loading"
    # What vLLM itself counts as loaded by the connector (its PrefillStats).
    external = e.requests["decode-side"].prefill_stats.num_external_cached_tokens
    assert external == (40 if connector == "nixl" else 39)
    e.abort("gone")  # vLLM keeps its blocks until its transfer is done too
    e.kv_failed.add("lost")  # the worker reports this load failed
    e.kv_loaded.update(("decode-side", "gone", "lost"))  # the transfers are done
    e.run()
    journeys = tracing.journeys()
    for j in journeys.values():
        check_invariants(j)
    assert not journeys["local"].kids(S.SPAN_QUEUED)[0].children
    d = journeys["decode-side"]
    (queued,) = d.kids(S.SPAN_QUEUED)
    (wait,) = queued.children
    attrs = dict(wait.attrs)
    transfer_ms = attrs.pop(S.KV_TRANSFER_MS)
    assert attrs == {
        S.WAIT_REASON: S.WAIT_REMOTE_KV,
        S.KV_TRANSFER_TOKENS: external,
        S.KV_TRANSFER_FAILED: False,
    }
    # From the schedule() that started the load to the one that found it done and
    # scheduled the last prompt token; the transfer ended inside it, at the
    # update_from_output that reported it.
    assert queued.start < wait.start < wait.end == queued.end
    assert 0 < transfer_ms * 1e6 < wait.end - wait.start
    # vLLM recomputes the last prompt token either way (to sample the next one).
    assert d.attrs[S.GEN_AI_CACHE_READ_TOKENS] == 39
    prefill = d.kids(S.SPAN_SCHEDULED)[0].children[0]
    assert prefill.attrs[S.CACHED_TOKENS] == 39
    # Aborted during the transfer: the wait lasts to the end; the transfer's end
    # came after the journey's and is not on the wait (missing, not zero). vLLM
    # kept the blocks the load was writing until it finished: vllm.kv_held.
    gone = journeys["gone"]
    assert gone.attrs[S.FINISH_STATUS] == S.FINISH_ABORTED
    (gq,) = gone.kids(S.SPAN_QUEUED)
    (gw,) = gq.children
    assert gw.attrs == {S.WAIT_REASON: S.WAIT_REMOTE_KV}
    assert gw.end == gq.end == gone.end
    (gh,) = gone.kids(S.SPAN_KV_HELD)
    assert gh.attrs[S.KV_HELD_RELEASED] is True and gh.start == gone.end < gh.end
    # A failed load: vLLM's default policy ("fail") ends the request with an error.
    lost = journeys["lost"]
    assert lost.attrs[S.FINISH_STATUS] == S.FINISH_ERROR
    (lq,) = lost.kids(S.SPAN_QUEUED)
    (lw,) = lq.children
    assert lw.attrs[S.KV_TRANSFER_FAILED] is True
    assert lw.attrs[S.KV_TRANSFER_TOKENS] == external
    assert lw.end == lq.end == lost.end
    assert_no_state_left(e)
    from vllm_journey_otel.engine.state import TRACKER_ATTR

    assert e.scheduler.__dict__[TRACKER_ATTR].blocked == {}


# ---------------------------------------------------------------------------
# vllm-journey summary: time in each waiting reason, acceptance rate
# ---------------------------------------------------------------------------
def test_summary_waits_and_acceptance(tracing, tmp_path) -> None:
    from vllm.lora.request import LoRARequest

    from vllm_journey_otel.export.file_exporter import OtlpJsonFileExporter
    from vllm_journey_otel.tools.summary import SUMMARY_ATTRIBUTES, format_text, summarize
    from vllm_journey_otel.tools.tracefile import read_spans

    e = _spec_engine(max_loras=1)
    e.add("a", prompt_len=20, max_tokens=12, lora=LoRARequest("sql", 1, "/x/sql"))
    e.add("b", prompt_len=20, max_tokens=12, lora=LoRARequest("chat", 2, "/x/chat"))
    e.add("g", prompt_len=20, max_tokens=3, json_schema='{"type": "object"}')
    e.step()
    e.compile_grammar("g")
    e.run()
    spans = tracing.spans()
    path = tmp_path / "j.jsonl"
    OtlpJsonFileExporter(path).export(spans)
    d = summarize(read_spans([path], attributes_of=SUMMARY_ATTRIBUTES)).to_dict()
    waits = [s for s in spans if s.name == S.SPAN_WAIT]
    by_reason = {
        r: sorted(
            (s.end_time - s.start_time) / 1e6 for s in waits if s.attributes[S.WAIT_REASON] == r
        )
        for r in (S.WAIT_LORA_SLOT, S.WAIT_GRAMMAR)
    }
    assert set(d["waits_ms"]) == {S.WAIT_LORA_SLOT, S.WAIT_GRAMMAR}
    for reason, values in by_reason.items():
        assert d["waits_ms"][reason]["count"] == len(values) == 1
        assert d["waits_ms"][reason]["max"] == round(values[-1], 3)
    spec = d["speculative_decoding"]
    logs = [x for log in e.verify_log.values() for x in log]
    assert spec["requests"] == 3
    assert spec["drafts_proposed"] == sum(p for p, _ in logs)
    assert spec["drafts_accepted"] == sum(a for _, a in logs)
    roots = [s for s in spans if s.name == S.SPAN_REQUEST]
    rates = sorted(r.attributes[S.SPEC_ACCEPTANCE_RATE] for r in roots)
    assert spec["acceptance_rate_per_request"]["count"] == len(rates) == 3
    assert spec["acceptance_rate_per_request"]["max"] == round(rates[-1], 3)
    text = format_text(d)
    assert "wait:lora_slot" in text and "wait:structured_output_grammar" in text
    assert "speculative decoding: 3 requests" in text


def test_summary_remote_kv_transfers(tracing, tmp_path) -> None:
    """vllm-journey summary: the transfer time of remote KV loads (vLLM's NIXL
    connector, scheduler side) and how many failed, as the spans say."""
    from vllm_journey_otel.export.file_exporter import OtlpJsonFileExporter
    from vllm_journey_otel.tools.summary import SUMMARY_ATTRIBUTES, format_text, summarize
    from vllm_journey_otel.tools.tracefile import read_spans

    e = harness.Engine(remote_kv="nixl")
    for rid in ("a", "b", "c"):
        e.add(rid, prompt_len=40, max_tokens=4, remote_prefill=True)
    e.add("local", prompt_len=20, max_tokens=4)
    e.step()
    e.kv_loaded.add("a")
    e.step()
    e.kv_failed.add("c")
    e.kv_loaded.update(("b", "c"))
    e.run()
    spans = tracing.spans()
    path = tmp_path / "j.jsonl"
    OtlpJsonFileExporter(path).export(spans)
    d = summarize(read_spans([path], attributes_of=SUMMARY_ATTRIBUTES)).to_dict()
    transfers = sorted(
        s.attributes[S.KV_TRANSFER_MS] for s in spans if S.KV_TRANSFER_MS in (s.attributes or {})
    )
    assert len(transfers) == 3
    assert d["kv_transfer"]["ms"]["count"] == 3
    assert d["kv_transfer"]["ms"]["max"] == round(transfers[-1], 3)
    assert d["kv_transfer"]["failed"] == 1
    assert d["waits_ms"][S.WAIT_REMOTE_KV]["count"] == 3
    assert "remote KV loads: 3 reported done, 1 of them failed" in format_text(d)


def test_summary_without_waits_or_spec(tracing, tmp_path) -> None:
    from vllm_journey_otel.export.file_exporter import OtlpJsonFileExporter
    from vllm_journey_otel.tools.summary import format_text, summarize
    from vllm_journey_otel.tools.tracefile import read_spans

    e = harness.Engine()
    e.add("r", prompt_len=20, max_tokens=3)
    e.run()
    path = tmp_path / "j.jsonl"
    OtlpJsonFileExporter(path).export(tracing.spans())
    d = summarize(read_spans([path])).to_dict()
    assert d["waits_ms"] == {} and d["speculative_decoding"] is None
    text = format_text(d)
    assert "wait:" not in text and "speculative" not in text


# ---------------------------------------------------------------------------
# Streaming-input sessions (resumable requests)
# ---------------------------------------------------------------------------
def _run_until(e, done, limit: int = 50) -> None:  # type: ignore[no-untyped-def]
    for _ in range(limit):
        if done():
            return
        e.step()
    raise AssertionError("condition not reached")


@SCHEDULERS
def test_streaming_input_session(tracing, async_scheduling: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Three input segments in one journey: the client is late with the second
    (a streaming_input wait), sends the third while the second still runs (no
    wait), then closes the session while it waits for a fourth."""
    # vLLM's own count of a segment's output tokens when it stops (0.30 counts
    # the token that ends a segment whose next input is queued in the next one).
    at_stops: list[int] = []
    hooked = harness.Scheduler._handle_stopped_request

    def counted(self, request, *args, **kwargs):  # type: ignore[no-untyped-def]
        at_stops.append(request.num_output_tokens)
        return hooked(self, request, *args, **kwargs)

    monkeypatch.setattr(harness.Scheduler, "_handle_stopped_request", counted)
    e = harness.Engine(async_scheduling=async_scheduling)
    waiting = harness.RequestStatus.WAITING_FOR_STREAMING_REQ
    s = e.add("s", prompt_len=20, max_tokens=3, resumable=True)
    _run_until(e, lambda: s.status == waiting)
    for _ in range(3):
        e.step()  # the client takes its time
    e.send_input("s", prompt_len=8, max_tokens=4)
    _run_until(e, lambda: s.num_output_tokens >= 2)
    e.send_input("s", prompt_len=5, max_tokens=2)  # queued while the segment runs
    _run_until(e, lambda: s.status == waiting and s.num_prompt_tokens > 30)
    e.step()
    e.end_session("s")
    e.run()
    j = tracing.journeys()["s"]
    check_invariants(j)
    Q, C = S.SPAN_QUEUED, S.SPAN_SCHEDULED
    assert [k.name for k in j.children] == [Q, C, Q, C, Q, C, Q]
    queued = j.kids(Q)
    cycles = j.kids(C)
    assert [q.attrs[S.SEGMENT] for q in queued] == [0, 1, 2, 3]
    assert [c.attrs[S.SEGMENT] for c in cycles] == [0, 1, 2]
    assert [c.attrs[S.SCHEDULE_KIND] for c in cycles] == [S.SCHEDULE_FIRST] + [
        S.SCHEDULE_NEXT_INPUT
    ] * 2
    # Waits for the client's input: after segment 0 (late), none after segment 1
    # (the input was there), and at the end (closed while waiting).
    reasons = [[w.attrs[S.WAIT_REASON] for w in q.children] for q in queued]
    assert reasons == [[], [S.WAIT_STREAMING_INPUT], [], [S.WAIT_STREAMING_INPUT]]
    late = queued[1].children[0]
    assert late.start == queued[1].start and late.end < queued[1].end
    # Each segment's prefill covers its own new input: 20, then +8, then +5.
    prefills = [c.children[0] for c in cycles]
    assert [p.attrs[S.PREFILL_DONE_TOKENS] for p in prefills] == [20, 28, 33]
    assert [c.children[0].attrs[S.CACHED_TOKENS] > 0 for c in cycles] == [False, True, True]
    # Nothing double counted: input is what the client sent, output what it got.
    assert j.attrs[S.NUM_SEGMENTS] == 3  # the trailing wait got no input
    assert j.attrs[S.GEN_AI_INPUT_TOKENS] == 20 + 8 + 5
    assert j.attrs[S.GEN_AI_OUTPUT_TOKENS] == len(e.outputs["s"]) == 3 + 4 + 2
    decodes = [c.children[1] for c in cycles]
    # The session's output so far at each segment's end, as vLLM counts it
    # (3, 7, 9 from 0.31 on).
    assert [d.attrs[S.DECODE_DONE_TOKENS] for d in decodes] == list(itertools.accumulate(at_stops))
    assert sum(at_stops) == 3 + 4 + 2
    assert j.attrs[S.FINISH_STATUS] == S.FINISH_ABORTED  # how vLLM ends a closed session
    assert_no_state_left(e)


def test_streaming_input_session_ends_with_its_last_segment(tracing) -> None:
    """The end of the session is queued while the last segment runs: it finishes
    with that segment's stop, no trailing queued span."""
    e = harness.Engine()
    s = e.add("s", prompt_len=20, max_tokens=3, resumable=True)
    e.step()
    e.end_session("s")
    e.run()
    j = tracing.journeys()["s"]
    check_invariants(j)
    assert j.shape() == expected_shape("PD")
    assert j.attrs[S.FINISH_STATUS] == S.FINISH_LENGTH
    assert j.attrs[S.NUM_SEGMENTS] == 1
    assert j.attrs[S.GEN_AI_OUTPUT_TOKENS] == s.num_output_tokens == 3
    assert j.kids(S.SPAN_QUEUED)[0].attrs[S.SEGMENT] == 0


def test_plain_requests_have_no_segments(tracing) -> None:
    e = harness.Engine()
    e.add("r", prompt_len=20, max_tokens=3)
    e.run()
    j = tracing.journeys()["r"]
    assert S.NUM_SEGMENTS not in j.attrs
    assert all(S.SEGMENT not in k.attrs for k in j.children)


# ---------------------------------------------------------------------------
# Every feature at once: vLLM's outputs unchanged, and a failing new hook
# switches tracing off without touching them
# ---------------------------------------------------------------------------
def _everything_engine():  # type: ignore[no-untyped-def]
    return harness.Engine(
        policy="priority",
        num_spec_tokens=2,
        max_loras=1,
        remote_kv=True,
        num_blocks=9,
        max_num_batched_tokens=64,
        max_model_len=512,
        max_num_seqs=8,
    )


def _everything(e):  # type: ignore[no-untyped-def]
    """Priority preemption, drafts, LoRA slots, a grammar, remote KV, a session."""
    from vllm.lora.request import LoRARequest

    e.accept_for = lambda rid, i, n: i % (n + 1)
    e.add("low", prompt_len=14, max_tokens=20, priority=5)
    e.add("lora1", prompt_len=10, max_tokens=6, lora=LoRARequest("a", 1, "/x/a"))
    e.add("lora2", prompt_len=10, max_tokens=6, lora=LoRARequest("b", 2, "/x/b"))
    e.add("g", prompt_len=10, max_tokens=4, json_schema='{"type": "object"}')
    e.add("kv", prompt_len=20, max_tokens=4, remote_prefill=True)
    e.add("sess", prompt_len=10, max_tokens=3, resumable=True)
    e.step()
    e.step()
    e.add("high", prompt_len=32, max_tokens=6, priority=0)
    for _ in range(3):
        e.step()
    e.compile_grammar("g")
    e.kv_loaded.add("kv")
    for _ in range(6):
        e.step()
    e.send_input("sess", 6, 3)
    for _ in range(6):
        e.step()
    e.end_session("sess")
    steps = e.run()
    return (
        e.outputs,
        {rid: r.status.name for rid, r in e.requests.items()},
        {rid: r.num_preemptions for rid, r in e.requests.items()},
        steps,
        e.verify_log,
    )


def _install(exporter, steps: bool = True) -> None:  # type: ignore[no-untyped-def]
    from vllm_journey_otel.config import Config
    from vllm_journey_otel.engine import hooks

    assert hooks.install(Config(enabled=True, steps=steps), exporters=[exporter], batch=False)


def test_everything_on_leaves_outputs_unchanged() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import trees
    from vllm_journey_otel.engine import hooks

    reference = _everything(_everything_engine())
    assert reference[2]["low"] >= 1, "precondition: a priority preemption"
    exporter = InMemorySpanExporter()
    _install(exporter)
    try:
        traced = _everything(_everything_engine())
        assert handoff.flush(10)
    finally:
        hooks.uninstall()
    assert traced == reference
    spans = exporter.get_finished_spans()
    journeys = trees.journeys(spans)
    assert set(journeys) == {"low", "lora1", "lora2", "g", "kv", "sess", "high"}
    for j in journeys.values():
        check_invariants(j)
    waits = {w.attributes[S.WAIT_REASON] for w in spans if w.name == S.SPAN_WAIT}
    assert waits == set(S.WAIT_REASONS)
    assert any(s.name == S.SPAN_STEP for s in spans)
    assert journeys["low"].kids(S.SPAN_PREEMPTED)[0].attrs[S.PREEMPTED_BY] == "high"


@pytest.mark.parametrize(
    "method",
    [
        "spec_verified",
        "_step_begin",
        "_deferred_waits",
        "_blocked_waits",
        "after_segment",
        "before_preempt",
        "kv_transfers",
    ],
)
def test_failing_new_hook_leaves_outputs_unchanged(method: str, monkeypatch, caplog) -> None:
    import logging

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from vllm_journey_otel.engine import hooks

    reference = _everything(_everything_engine())
    calls = {"n": 0}

    def broken(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        raise RuntimeError("bookkeeping bug")

    monkeypatch.setattr(tracker.SchedulerTracker, method, broken)
    _install(InMemorySpanExporter())
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.journey_otel"):
            engine = _everything_engine()
            traced = _everything(engine)
        assert calls["n"] == 1, "the hook ran once, then tracing switched itself off"
        assert not hooks.enabled()
        # What the tracker held is dropped with it (state._fail, by the tracker's own method).
        held = engine.scheduler.__dict__[state.TRACKER_ATTR]
        assert held in state._STATE.trackers
        assert not (held.awaiting or held.blocked or held.steps_open)
        assert len([r for r in caplog.records if "internal error" in r.getMessage()]) == 1
    finally:
        hooks.uninstall()
    assert traced == reference


@pytest.mark.parametrize(("vllm_metrics", "per_step"), [("none", True), ("summary", False)])
def test_spec_decode_per_step_work_only_without_vllm_metrics(
    tracing, monkeypatch, vllm_metrics: str, per_step: bool
) -> None:
    """With vLLM's per-request spec-decode metrics on, the plugin does nothing per
    step and reads vLLM's counts at transitions; both give the same attributes."""

    calls = {"n": 0}
    orig = tracker.SchedulerTracker.spec_verified

    def spy(self, *args):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return orig(self, *args)

    monkeypatch.setattr(tracker.SchedulerTracker, "spec_verified", spy)
    e = _spec_engine(spec_metrics=vllm_metrics)
    e.add("s", prompt_len=20, max_tokens=30)
    e.run()
    assert (calls["n"] > 0) is per_step
    j = tracing.journeys()["s"]
    log = e.verify_log["s"]
    assert j.attrs[S.SPEC_DRAFTS_PROPOSED] == sum(p for p, _ in log)
    assert j.attrs[S.SPEC_DRAFTS_ACCEPTED] == sum(a for _, a in log)


def test_timeline_draws_waits(tracing, tmp_path) -> None:
    from vllm.lora.request import LoRARequest

    from vllm_journey_otel.export.file_exporter import OtlpJsonFileExporter
    from vllm_journey_otel.tools.timeline import collect, render
    from vllm_journey_otel.tools.tracefile import read_spans

    e = harness.Engine(max_loras=1)
    e.add("a", prompt_len=20, max_tokens=6, lora=LoRARequest("sql", 1, "/x/sql"))
    e.add("b", prompt_len=20, max_tokens=4, lora=LoRARequest("chat", 2, "/x/chat"))
    e.run()
    path = tmp_path / "j.jsonl"
    OtlpJsonFileExporter(path).export(tracing.spans())
    rows, total = collect(lambda attrs: read_spans([path], attributes_of=attrs))
    assert total == 2
    by_id = {r.attrs[S.REQUEST_ID]: r for r in rows}
    waits = [seg for seg in by_id["b"].segments if seg[0] == "wait"]
    assert len(waits) == 1 and waits[0][3] == {S.WAIT_REASON: S.WAIT_LORA_SLOT}
    assert not [seg for seg in by_id["a"].segments if seg[0] == "wait"]
    assert '"wait"' in render(rows, total)
