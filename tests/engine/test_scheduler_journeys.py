"""Journeys recorded from a real vLLM Scheduler / AsyncScheduler.

Each test drives vLLM's own scheduler (tests/harness.py: real Scheduler, fabricated
model outputs), exports through the real plugin hooks to an in-memory exporter,
and checks the exact tree, the attribute values, the time tiling and that no
per-request state is left behind.
"""

from __future__ import annotations

import random
import time
import zlib

from conftest import import_harness, requires_vllm
from scheduling import SCHEDULERS, assert_no_state_left
from trees import check_invariants, expected_shape
from vllm_journey_otel import config
from vllm_journey_otel import schema as S

pytestmark = requires_vllm

harness = import_harness()


@SCHEDULERS
def test_plain_request(tracing, async_scheduling: bool) -> None:
    e = harness.Engine(async_scheduling=async_scheduling)
    before = time.time_ns()
    req = e.add("r1", prompt_len=40, max_tokens=6)
    e.run()
    after = time.time_ns()
    j = tracing.journeys()["r1"]
    check_invariants(j)
    assert j.shape() == expected_shape("PD")
    root = j.attrs
    assert root[S.GEN_AI_INPUT_TOKENS] == 40
    assert root[S.GEN_AI_OUTPUT_TOKENS] == 6 == req.num_output_tokens
    assert root[S.GEN_AI_MAX_TOKENS] == 6
    assert root[S.FINISH_STATUS] == S.FINISH_LENGTH
    assert root[S.GEN_AI_FINISH_REASONS] == ("length",)
    assert root[S.NUM_PREEMPTIONS] == 0
    assert root[S.GEN_AI_CACHE_READ_TOKENS] == 0
    for key in (S.QUEUED_MS, S.TTFT_MS, S.PREFILL_MS, S.DECODE_MS):
        assert isinstance(root[key], float) and root[key] >= 0.0, key
    assert root[S.TTFT_MS] >= root[S.PREFILL_MS]
    # Epoch clock: the whole journey lies between two wall-clock reads around it.
    assert before - 2_000_000 <= j.start <= j.end <= after + 2_000_000

    cycle = j.kids(S.SPAN_SCHEDULED)[0]
    prefill, decode = cycle.children
    assert prefill.attrs[S.PREFILL_CHUNKS] == 1
    assert prefill.attrs[S.CACHED_TOKENS] == 0
    assert prefill.attrs[S.PREFILL_DONE_TOKENS] == 40
    assert prefill.attrs[S.DECODE_DONE_TOKENS] == 1
    assert prefill.attrs[S.PHASE] == S.PHASE_DECODE
    assert decode.attrs[S.DECODE_DONE_TOKENS] == 6
    assert decode.attrs[S.DECODE_MAX_TOKENS] == 6
    queued = j.kids(S.SPAN_QUEUED)[0]
    assert queued.attrs[S.PHASE] == S.PHASE_PREFILL
    assert queued.attrs[S.PREFILL_DONE_TOKENS] == 0
    assert queued.attrs[S.SCHEDULER_STEP] == 1
    assert cycle.attrs[S.SCHEDULER_STEP] > queued.attrs[S.SCHEDULER_STEP]
    assert_no_state_left(e)


@SCHEDULERS
def test_chunked_prefill(tracing, async_scheduling: bool) -> None:
    e = harness.Engine(async_scheduling=async_scheduling, max_num_batched_tokens=64)
    e.add("long", prompt_len=200, max_tokens=3)
    e.run()
    j = tracing.journeys()["long"]
    check_invariants(j)
    assert j.shape() == expected_shape("PD")
    prefill = j.kids(S.SPAN_SCHEDULED)[0].children[0]
    # 200 prompt tokens in chunks of at most 64: 64 + 64 + 64 + 8.
    assert prefill.attrs[S.PREFILL_CHUNKS] == 4
    assert prefill.attrs[S.PREFILL_DONE_TOKENS] == 200
    assert prefill.attrs[S.PREFILL_TOTAL_TOKENS] == 200


@SCHEDULERS
def test_prefix_cache_hit(tracing, async_scheduling: bool) -> None:
    e = harness.Engine(async_scheduling=async_scheduling)
    prompt = list(range(10, 10 + 70))
    e.add("first", prompt=prompt, max_tokens=2)
    e.run()
    e.add("second", prompt=prompt, max_tokens=2)
    e.run()
    journeys = tracing.journeys()
    first, hit = journeys["first"], journeys["second"]
    for j in (first, hit):
        check_invariants(j)
    assert first.attrs[S.GEN_AI_CACHE_READ_TOKENS] == 0
    # 70 tokens in blocks of 16: the 4 full blocks (64 tokens) are served from
    # cache, and vLLM's own accounting says the same.
    assert e.prefill_stats["second"].num_cached_tokens == 64
    assert hit.attrs[S.GEN_AI_CACHE_READ_TOKENS] == 64
    prefill = hit.kids(S.SPAN_SCHEDULED)[0].children[0]
    assert prefill.attrs[S.CACHED_TOKENS] == 64
    assert prefill.attrs[S.PREFILL_CHUNKS] == 1


def _preemption_engine(async_scheduling: bool, v2: bool = False):  # type: ignore[no-untyped-def]
    """Two requests on 4 usable KV blocks: B's growth cannot fit beside A's."""
    e = harness.Engine(
        async_scheduling=async_scheduling,
        v2_runner_layout=v2,
        num_blocks=5,
        max_num_batched_tokens=64,
        max_model_len=512,
        max_num_seqs=8,
    )
    e.add("A", prompt_len=14, max_tokens=20)
    e.step()
    e.step()
    e.add("B", prompt_len=32, max_tokens=5)
    return e


@SCHEDULERS
def test_preemption_and_resume(tracing, async_scheduling: bool) -> None:
    e = _preemption_engine(async_scheduling)
    e.run()
    b = e.requests["B"]
    assert b.num_preemptions >= 1, "precondition: the KV cache is small enough to preempt B"
    journeys = tracing.journeys()
    j = journeys["B"]
    check_invariants(j)
    assert j.attrs[S.NUM_PREEMPTIONS] == b.num_preemptions
    assert len(j.kids(S.SPAN_PREEMPTED)) == b.num_preemptions
    cycles = j.kids(S.SPAN_SCHEDULED)
    assert len(cycles) == b.num_preemptions + 1
    assert [c.attrs[S.SCHEDULE_KIND] for c in cycles] == [S.SCHEDULE_FIRST] + [
        S.SCHEDULE_RESUME
    ] * b.num_preemptions
    for p in j.kids(S.SPAN_PREEMPTED):
        assert 0.0 < p.attrs[S.KV_CACHE_USAGE] <= 1.0
        assert p.attrs[S.NUM_RUNNING] >= 1  # A kept running
        assert p.attrs[S.NUM_WAITING] >= 0
        assert p.attrs[S.PHASE] == S.PHASE_PREFILL  # must recompute after resume
    # The last cycle ran to completion: prefill (recompute) then decode.
    assert [c.name for c in cycles[-1].children] == [S.SPAN_PREFILL, S.SPAN_DECODE]
    # The prefill high-water mark survives the preemption (vLLM resets its own).
    first_preempt = j.kids(S.SPAN_PREEMPTED)[0]
    assert first_preempt.attrs[S.PREFILL_DONE_TOKENS] == 32
    assert j.attrs[S.GEN_AI_OUTPUT_TOKENS] == b.num_output_tokens == 5
    assert journeys["A"].attrs[S.NUM_PREEMPTIONS] == e.requests["A"].num_preemptions
    assert_no_state_left(e)


def test_preempted_while_first_token_in_flight(tracing) -> None:
    """Async: schedule(N+1) preempts B before update(N) delivers B's first token."""
    e = _preemption_engine(async_scheduling=True)
    from vllm_journey_otel.engine import request_journey as journey

    seen = []
    orig = journey.RequestJourney.tokens

    def spy(self, t, step, out):  # type: ignore[no-untyped-def]
        if self.state == journey.PREEMPTED and self.first_token_mono_ns is None and out > 0:
            seen.append(self.request_id)
        return orig(self, t, step, out)

    journey.RequestJourney.tokens = spy  # type: ignore[method-assign]
    try:
        e.run()
    finally:
        journey.RequestJourney.tokens = orig  # type: ignore[method-assign]
    assert seen == ["B"], "precondition: B's first token arrived while B was preempted"
    j = tracing.journeys()["B"]
    check_invariants(j)
    first_cycle = j.kids(S.SPAN_SCHEDULED)[0]
    # The cycle was cut before its token arrived: prefill only, no decode span.
    assert [c.name for c in first_cycle.children] == [S.SPAN_PREFILL]
    assert first_cycle.children[0].attrs[S.PHASE] == S.PHASE_PREFILL
    # That in-flight token is still the request's first token: TTFT is observed,
    # and lies within the first preemption (after the cut, before the resume).
    preempt = j.kids(S.SPAN_PREEMPTED)[0]
    ttft_end = j.start + j.attrs[S.TTFT_MS] * 1e6
    assert preempt.start - 1e3 <= ttft_end <= preempt.end + 1e3
    # The resumed cycle counts its first token after the recompute.
    last = j.kids(S.SPAN_SCHEDULED)[-1]
    assert [c.name for c in last.children] == [S.SPAN_PREFILL, S.SPAN_DECODE]
    assert j.attrs[S.GEN_AI_OUTPUT_TOKENS] == 5
    assert_no_state_left(e)


@SCHEDULERS
def test_preempted_several_times(tracing, async_scheduling: bool) -> None:
    e = harness.Engine(
        async_scheduling=async_scheduling,
        num_blocks=8,
        max_num_batched_tokens=64,
        max_model_len=512,
        max_num_seqs=8,
    )
    for i in range(4):
        e.add(f"r{i}", prompt_len=20 + 7 * i, max_tokens=40)
    e.run()
    journeys = tracing.journeys()
    counts = {rid: r.num_preemptions for rid, r in e.requests.items()}
    assert max(counts.values()) >= 2, f"precondition: some request preempted twice {counts}"
    for rid, req in e.requests.items():
        j = journeys[rid]
        check_invariants(j)
        assert j.attrs[S.NUM_PREEMPTIONS] == req.num_preemptions
        assert len(j.kids(S.SPAN_SCHEDULED)) == req.num_preemptions + 1
        assert j.attrs[S.GEN_AI_OUTPUT_TOKENS] == 40
        # num_preemptions on each span is the count so far, non-decreasing.
        seq = [k.attrs[S.NUM_PREEMPTIONS] for k in j.children]
        assert seq == sorted(seq)
    assert_no_state_left(e)


@SCHEDULERS
def test_abort_while_queued(tracing, async_scheduling: bool) -> None:
    e = harness.Engine(async_scheduling=async_scheduling, max_num_seqs=1, max_num_batched_tokens=64)
    e.add("running", prompt_len=10, max_tokens=20)
    e.add("waiting", prompt_len=10, max_tokens=20)
    e.step()
    e.step()
    e.abort("waiting")
    e.run()
    j = tracing.journeys()["waiting"]
    check_invariants(j)
    assert j.shape() == (S.SPAN_REQUEST, ((S.SPAN_QUEUED,),))
    assert j.attrs[S.FINISH_STATUS] == S.FINISH_ABORTED
    assert j.attrs[S.GEN_AI_FINISH_REASONS] == ("abort",)
    assert j.attrs[S.GEN_AI_OUTPUT_TOKENS] == 0
    # Missing is not zero: nothing after admission was observed.
    for key in (S.QUEUED_MS, S.TTFT_MS, S.PREFILL_MS, S.DECODE_MS, S.GEN_AI_CACHE_READ_TOKENS):
        assert key not in j.attrs, key
    assert_no_state_left(e)


@SCHEDULERS
def test_abort_while_running(tracing, async_scheduling: bool) -> None:
    e = harness.Engine(async_scheduling=async_scheduling, max_num_batched_tokens=64)
    req = e.add("decoding", prompt_len=10, max_tokens=50)
    e.add("prefilling", prompt_len=300, max_tokens=50)
    for _ in range(3):
        e.step()
    e.abort("decoding", "prefilling")
    e.run()
    journeys = tracing.journeys()
    d = journeys["decoding"]
    check_invariants(d)
    assert d.shape() == expected_shape("PD")
    assert d.attrs[S.FINISH_STATUS] == S.FINISH_ABORTED
    assert d.attrs[S.GEN_AI_OUTPUT_TOKENS] == req.num_output_tokens > 0
    assert (
        d.kids(S.SPAN_SCHEDULED)[0].children[1].attrs[S.DECODE_DONE_TOKENS] == req.num_output_tokens
    )
    assert S.TTFT_MS in d.attrs and S.PREFILL_MS in d.attrs
    p = journeys["prefilling"]
    check_invariants(p)
    # Aborted before its first token: a cycle with only a prefill span.
    assert p.shape() == expected_shape("P")
    prefill = p.kids(S.SPAN_SCHEDULED)[0].children[0]
    assert 0 < prefill.attrs[S.PREFILL_DONE_TOKENS] < 300
    assert prefill.attrs[S.PHASE] == S.PHASE_PREFILL
    for key in (S.TTFT_MS, S.PREFILL_MS, S.DECODE_MS):
        assert key not in p.attrs, key
    assert S.QUEUED_MS in p.attrs
    assert_no_state_left(e)


@SCHEDULERS
def test_stop_token(tracing, async_scheduling: bool) -> None:
    e = harness.Engine(async_scheduling=async_scheduling)
    stop = 99
    e.token_for = lambda rid, n: stop if n == 2 else harness.TOKEN
    e.add("s", prompt_len=12, max_tokens=50, stop_token_ids=[stop])
    e.run()
    j = tracing.journeys()["s"]
    check_invariants(j)
    assert j.attrs[S.FINISH_STATUS] == S.FINISH_STOPPED
    assert j.attrs[S.GEN_AI_FINISH_REASONS] == ("stop",)
    assert j.attrs[S.GEN_AI_OUTPUT_TOKENS] == 3
    assert j.shape() == expected_shape("PD")


@SCHEDULERS
def test_single_token_request(tracing, async_scheduling: bool) -> None:
    """max_tokens=1: the first token is also the last; decode is an empty span."""
    e = harness.Engine(async_scheduling=async_scheduling)
    e.add("one", prompt_len=12, max_tokens=1)
    e.run()
    j = tracing.journeys()["one"]
    check_invariants(j)
    assert j.shape() == expected_shape("PD")
    assert j.attrs[S.DECODE_MS] == 0.0
    decode = j.kids(S.SPAN_SCHEDULED)[0].children[1]
    assert decode.start == decode.end


@SCHEDULERS
def test_shutdown_abort_exports_everything(tracing, async_scheduling: bool) -> None:
    e = harness.Engine(async_scheduling=async_scheduling, max_num_seqs=2, max_num_batched_tokens=64)
    e.add("done", prompt_len=8, max_tokens=2)
    e.run()
    for i in range(4):
        e.add(f"inflight{i}", prompt_len=20, max_tokens=100)
    for _ in range(3):
        e.step()
    # What EngineCore does on SIGTERM: abort all, then Scheduler.shutdown(), whose
    # hook flushes. Read the exporter directly: no extra flush from the test.
    e.shutdown_abort()
    spans = tracing.exporter.get_finished_spans()
    import trees

    journeys = trees.journeys(spans)
    assert set(journeys) == {"done", "inflight0", "inflight1", "inflight2", "inflight3"}
    assert journeys["done"].attrs[S.FINISH_STATUS] == S.FINISH_LENGTH
    for i in range(4):
        j = journeys[f"inflight{i}"]
        check_invariants(j)
        assert j.attrs[S.FINISH_STATUS] == S.FINISH_ABORTED
    # Two were running, two still queued when the engine stopped.
    queued_only = [
        rid for rid, j in journeys.items() if j.shape() == (S.SPAN_REQUEST, ((S.SPAN_QUEUED,),))
    ]
    assert sorted(queued_only) == ["inflight2", "inflight3"]


def test_v2_runner_resume_path(tracing) -> None:
    """V2 model runner: resumed requests come back inside scheduled_new_reqs."""
    e = _preemption_engine(async_scheduling=False, v2=True)
    assert e.scheduler.use_v2_model_runner
    resumed_in_new = []
    while e.scheduler.requests:
        so = e.schedule()
        assert not so.scheduled_cached_reqs.resumed_req_ids
        resumed_in_new += [
            n.req_id for n in so.scheduled_new_reqs if e.requests[n.req_id].num_preemptions > 0
        ]
        e.update()
    assert resumed_in_new, "precondition: a resume went through scheduled_new_reqs"
    j = tracing.journeys()["B"]
    check_invariants(j)
    kinds = [c.attrs[S.SCHEDULE_KIND] for c in j.kids(S.SPAN_SCHEDULED)]
    assert kinds[0] == S.SCHEDULE_FIRST and kinds[1:] and set(kinds[1:]) == {S.SCHEDULE_RESUME}
    assert_no_state_left(e)


@SCHEDULERS
def test_many_requests_mixed(tracing, async_scheduling: bool) -> None:
    rng = random.Random(1234)
    e = harness.Engine(
        async_scheduling=async_scheduling,
        num_blocks=40,
        max_num_batched_tokens=128,
        max_model_len=1024,
        max_num_seqs=16,
    )
    stop = 99
    e.token_for = lambda rid, n: stop if (zlib.crc32(rid.encode()) + n) % 37 == 0 else harness.TOKEN
    aborted: set[str] = set()
    n = 0
    for step in range(400):
        if n < 60 and rng.random() < 0.5:
            e.add(
                f"m{n}",
                prompt_len=rng.randint(1, 200),
                max_tokens=rng.randint(1, 40),
                stop_token_ids=[stop],
                priority=0,
            )
            n += 1
        if step % 25 == 10 and e.scheduler.requests:
            victim = rng.choice(sorted(e.scheduler.requests))
            e.abort(victim)
            aborted.add(victim)
        e.step()
    e.run()
    journeys = tracing.journeys()
    assert set(journeys) == set(e.requests)
    statuses = {str(j.attrs[S.FINISH_STATUS]) for j in journeys.values()}
    assert {S.FINISH_ABORTED, S.FINISH_LENGTH} <= statuses
    assert sum(r.num_preemptions for r in e.requests.values()) > 0, "precondition: preemptions"
    for rid, req in e.requests.items():
        j = journeys[rid]
        check_invariants(j)
        assert j.attrs[S.GEN_AI_OUTPUT_TOKENS] == req.num_output_tokens
        assert j.attrs[S.GEN_AI_INPUT_TOKENS] == req.num_prompt_tokens
        assert j.attrs[S.NUM_PREEMPTIONS] == req.num_preemptions
        if rid in aborted:
            assert j.attrs[S.FINISH_STATUS] == S.FINISH_ABORTED
    # Each journey is its own trace.
    assert len({j.span.context.trace_id for j in journeys.values()}) == len(journeys)
    assert_no_state_left(e)


def test_trace_context_joined(tracing) -> None:
    e = harness.Engine()
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    parent_id = "b7ad6b7169203331"
    e.add(
        "child",
        trace_headers={
            "traceparent": f"00-{trace_id}-{parent_id}-01",
            "tracestate": "vendor=abc",
        },
    )
    e.add("orphan", trace_headers={"traceparent": "00-zzzz-not-a-header"})
    e.add("plain", priority=3)
    e.run()
    journeys = tracing.journeys()
    child = journeys["child"].span
    assert child.context.trace_id == int(trace_id, 16)
    assert child.parent is not None and child.parent.span_id == int(parent_id, 16)
    assert child.parent.is_remote
    assert child.context.trace_state.get("vendor") == "abc"
    for name in ("orphan", "plain"):
        span = journeys[name].span
        assert span.parent is None
        assert span.context.trace_id != int(trace_id, 16)
    assert journeys["plain"].attrs[S.PRIORITY] == 3
    assert S.PRIORITY not in journeys["child"].attrs  # 0 is the default: not recorded
    # Every span of the journey is in the client's trace.
    assert {n.span.context.trace_id for n in journeys["child"].children} == {int(trace_id, 16)}


def test_root_starts_at_arrival(tracing) -> None:
    """The root spans arrival (API server wall clock) to end; queued starts at admission."""
    e = harness.Engine()
    arrival = time.time() - 0.25  # the API server took 250 ms to hand it over
    e.add("late", arrival_time=arrival)
    e.run()
    j = tracing.journeys()["late"]
    check_invariants(j)
    assert abs(j.start - int(arrival * 1e9)) < 1_000
    queued = j.kids(S.SPAN_QUEUED)[0]
    assert queued.start - j.start >= 240_000_000
    assert j.attrs[S.TTFT_MS] >= 250.0
    assert j.attrs[S.QUEUED_MS] < 250.0
    assert j.attrs[S.CLOCK_UNCERTAINTY_US] >= 0.0


def test_preemptions_without_the_private_hook(tracing, monkeypatch) -> None:
    """A vLLM without Scheduler._preempt_request: preemptions come from SchedulerOutput."""
    import dataclasses

    from vllm_journey_otel.engine import compat, hooks

    hooks.uninstall()
    # The table as a vLLM whose _preempt_request has another signature makes it.
    odd = tuple(
        dataclasses.replace(t, params=("no_such_parameter",))
        if t.method == "_preempt_request"
        else t
        for t in compat.TARGETS
    )
    monkeypatch.setattr(compat, "TARGETS", odd)
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler._preempt_request
    assert hooks.install(config.Config(enabled=True), exporters=[tracing.exporter], batch=False)
    assert Scheduler._preempt_request is original  # not wrapped
    e = _preemption_engine(async_scheduling=False)
    e.run()
    b = e.requests["B"]
    assert b.num_preemptions >= 1
    j = tracing.journeys()["B"]
    check_invariants(j)
    assert len(j.kids(S.SPAN_PREEMPTED)) == b.num_preemptions
    # What only the private hook can read is absent, not made up.
    assert S.KV_CACHE_USAGE not in j.kids(S.SPAN_PREEMPTED)[0].attrs


@SCHEDULERS
def test_admission_records_the_schedulers_counters(tracing, async_scheduling: bool) -> None:
    """The first vllm.queued carries what the engine looked like at admission: vLLM's
    own KV-cache usage and request counts (its waiting count includes the queues it
    keeps beside ``waiting``: a request waiting for its grammar is counted too)."""
    e = harness.Engine(async_scheduling=async_scheduling)
    s = e.scheduler

    def counts() -> tuple[float, int, int]:
        return (s.get_kv_cache_usage(), *s.get_request_counts())

    e.add("first", prompt_len=24, max_tokens=30)
    seen = {"first": counts()}
    e.step()
    e.step()
    e.add("grammar", prompt_len=16, max_tokens=4, json_schema='{"type": "object"}')
    e.add("third", prompt_len=16, max_tokens=4)
    seen["third"] = counts()
    assert seen["third"][1] == 1 and seen["third"][0] > 0, "precondition: first is running"
    for _ in range(5):
        e.step()
    # Between two steps, admissions around an abort that frees KV blocks: each
    # records the usage of its own moment (the tracker keeps vLLM's figure for
    # a burst of admissions, not across a freed request).
    e.add("victim", prompt_len=16, max_tokens=30)
    e.step()
    e.add("before abort", prompt_len=8, max_tokens=2)
    seen["before abort"] = counts()
    e.abort("victim")
    e.add("after abort", prompt_len=8, max_tokens=2)
    seen["after abort"] = counts()
    assert seen["after abort"][0] < seen["before abort"][0], "precondition: blocks freed"
    # A pause resets the prefix cache and preempts every running request
    # between steps (vLLM's reset_prefix_cache(reset_running_requests=True)).
    assert s.running, "precondition: requests to preempt"
    s.reset_prefix_cache(reset_running_requests=True)
    e.add("after reset", prompt_len=8, max_tokens=2)
    seen["after reset"] = counts()
    assert seen["after reset"][0] < seen["after abort"][0], "precondition: blocks freed"
    e.compile_grammar("grammar")
    e.run()
    journeys = tracing.journeys()
    for rid, (usage, running, waiting) in seen.items():
        queued = journeys[rid].kids(S.SPAN_QUEUED)[0]
        assert queued.attrs[S.KV_CACHE_USAGE] == usage
        assert queued.attrs[S.NUM_RUNNING] == running
        assert queued.attrs[S.NUM_WAITING] == waiting
    # third, the grammar request ahead of it, and nothing else: on every release.
    assert journeys["third"].kids(S.SPAN_QUEUED)[0].attrs[S.NUM_WAITING] == 2
    assert journeys["first"].kids(S.SPAN_QUEUED)[0].attrs[S.NUM_RUNNING] == 0
