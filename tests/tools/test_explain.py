"""``vllm-journey explain``: every figure against the spans it comes from.

Journeys of vLLM's real Scheduler (tests/harness.py) with a priority
preemption (its cause named), a LoRA-slot wait and KV pressure, written to a
trace file by the plugin's own file exporter and kept in memory: the
explanation read from the file is checked against the in-memory spans.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import import_harness, journeys_from_vllm
from trees import journeys
from vllm_journey_otel import schema as S
from vllm_journey_otel.config import MODE_THREAD, Config
from vllm_journey_otel.engine import handoff, hooks
from vllm_journey_otel.export.file_exporter import OtlpJsonFileExporter
from vllm_journey_otel.tools import explain as X
from vllm_journey_otel.tools import journey_files as J
from vllm_journey_otel.tools.cli import main as cli_main
from vllm_journey_otel.tools.explain_text import NOT_OBSERVED, format_journey
from vllm_journey_otel.tools.tracefile import FileSpan, read_spans

pytestmark = journeys_from_vllm
harness = import_harness()


def _workload() -> None:
    from vllm.lora.request import LoRARequest

    e = harness.Engine(
        policy="priority", num_blocks=5, max_num_batched_tokens=64, max_model_len=512
    )
    e.add("low", prompt_len=14, max_tokens=20, priority=10)
    e.step()
    e.step()
    e.add("high", prompt_len=32, max_tokens=5, priority=0)  # preempts low
    e.run()
    assert e.requests["low"].num_preemptions >= 1, "precondition: low was preempted"
    sql = LoRARequest("sql", 1, "/nonexistent/sql")
    chat = LoRARequest("chat", 2, "/nonexistent/chat")
    e = harness.Engine(max_loras=1)
    e.add("sql", prompt_len=20, max_tokens=6, lora=sql)
    e.add("chat", prompt_len=20, max_tokens=4, lora=chat)  # waits for the one slot
    e.run()
    e = harness.Engine(num_blocks=12, max_num_batched_tokens=64, max_model_len=512, max_num_seqs=8)
    for i in range(8):
        e.add(f"t{i}", prompt_len=20 + 9 * i, max_tokens=20 + 3 * i)
        e.step()
    e.run()


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    path = tmp_path_factory.mktemp("explain") / "j.otlp.jsonl"
    memory = InMemorySpanExporter()
    assert hooks.install(
        Config(enabled=True, export_mode=MODE_THREAD),
        exporters=[memory, OtlpJsonFileExporter(path)],
        batch=False,
    )
    try:
        _workload()
        assert handoff.flush(10)
    finally:
        hooks.uninstall()
    return journeys(memory.get_finished_spans()), path


def _read(path: Path) -> J.Reader:
    return lambda attributes_of: read_spans([path], attributes_of=attributes_of)


def _ms(span: Any) -> float:
    return (span.end - span.start) / 1e6


def _one(path: Path, rid: str) -> X.Explanation:
    (e,), total = J.explanations(_read(path), J.Selection(request_ids=frozenset({rid})))
    assert total == 12
    return e


def test_each_journeys_causes_are_its_spans(traced: tuple[Any, Path]) -> None:
    tree, path = traced
    assert len(tree) == 12
    for rid, j in tree.items():
        e = _one(path, rid)
        causes = e.by_cause()
        assert e.e2e_ms == pytest.approx(_ms(j))
        # The causes tile the root: nothing is left out, nothing counted twice.
        assert sum(causes.values()) == pytest.approx(e.e2e_ms, abs=1e-6)
        queued = j.kids(S.SPAN_QUEUED)
        waits = [w for q in queued for w in q.children]
        assert causes.get(X.QUEUED, 0.0) == pytest.approx(
            sum(map(_ms, queued)) - sum(map(_ms, waits))
        )
        cycles = j.kids(S.SPAN_SCHEDULED)
        first = [p for c in cycles if c.attrs[S.SCHEDULE_KIND] == S.SCHEDULE_FIRST
                 for p in c.children if p.name == S.SPAN_PREFILL]  # fmt: skip
        again = [p for c in cycles if c.attrs[S.SCHEDULE_KIND] == S.SCHEDULE_RESUME
                 for p in c.children if p.name == S.SPAN_PREFILL]  # fmt: skip
        decode = [d for c in cycles for d in c.children if d.name == S.SPAN_DECODE]
        assert causes.get(X.PREFILL, 0.0) == pytest.approx(sum(map(_ms, first)))
        assert causes.get(X.RECOMPUTE, 0.0) == pytest.approx(sum(map(_ms, again)))
        assert causes.get(X.DECODE, 0.0) == pytest.approx(sum(map(_ms, decode)))
        assert causes.get(X.PREEMPTED, 0.0) == pytest.approx(
            sum(map(_ms, j.kids(S.SPAN_PREEMPTED)))
        )
        first_queued = queued[0].attrs
        assert e.admission == (
            first_queued[S.KV_CACHE_USAGE], first_queued[S.NUM_RUNNING],
            first_queued[S.NUM_WAITING],
        )  # fmt: skip
        assert e.output_tokens == j.attrs[S.GEN_AI_OUTPUT_TOKENS]
        tokens = sum(
            d.attrs[S.DECODE_DONE_TOKENS] - p.attrs[S.DECODE_DONE_TOKENS]
            for c in cycles
            for p, d in [c.children]
            if len(c.children) == 2
        )
        assert e.decode_tokens == (tokens if decode else None)


def test_a_preemption_names_its_cause_and_its_cost(traced: tuple[Any, Path]) -> None:
    tree, path = traced
    e = _one(path, "low")
    spans = tree["low"].kids(S.SPAN_PREEMPTED)
    assert len(e.preemptions) == len(spans) >= 1
    for p, span in zip(e.preemptions, spans, strict=True):
        assert p.by == span.attrs[S.PREEMPTED_BY] == "high"
        assert p.kv_cache_usage == span.attrs[S.KV_CACHE_USAGE]
        assert p.num_running == span.attrs[S.NUM_RUNNING]
        assert p.preempted_ms == pytest.approx(_ms(span))
        assert p.recompute_ms is not None and p.recompute_ms > 0
    text = format_journey(e)
    assert "preemption 1 at +" in text and "by high" in text


def test_a_wait_is_its_own_cause(traced: tuple[Any, Path]) -> None:
    tree, path = traced
    e = _one(path, "chat")
    (wait,) = tree["chat"].kids(S.SPAN_QUEUED)[0].children
    assert e.by_cause()[X.WAIT + S.WAIT_LORA_SLOT] == pytest.approx(_ms(wait))
    assert "waiting for lora_slot" in format_journey(e)


def test_the_whole_file_adds_up_to_every_journeys_causes(traced: tuple[Any, Path]) -> None:
    """Two ways to the same figures: the streaming tally of the file and the sum of
    the journeys explained one by one."""
    tree, path = traced
    share = J.file_share(_read(path), top=2)
    assert share.journeys == len(tree)
    assert share.total_ms == pytest.approx(sum(_ms(j) for j in tree.values()))
    each = {rid: _one(path, rid).by_cause() for rid in tree}
    causes = {c for by in each.values() for c in by}
    assert set(share.by_cause_ms) == causes
    for cause in causes:
        assert share.by_cause_ms[cause] == pytest.approx(
            sum(by.get(cause, 0.0) for by in each.values()), abs=1e-6
        )
        ranked = sorted(each, key=lambda r: -each[r].get(cause, 0.0))[:2]
        expect = [each[r][cause] for r in ranked if cause in each[r]]
        # The largest, by value (two journeys can tie on a cause: either may be named).
        assert [ms for _, ms in share.top[cause]] == pytest.approx(expect, abs=1e-6)
        for rid, ms in share.top[cause]:
            assert each[rid][cause] == pytest.approx(ms, abs=1e-6)
    assert sum(share.by_cause_ms.values()) == pytest.approx(share.total_ms, abs=1e-6)


def test_cli_explain(traced: tuple[Any, Path], capsys: pytest.CaptureFixture[str]) -> None:
    tree, path = traced
    assert cli_main(["explain", str(path), "--request", "low"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("low ") and "waterfall:" in out and "Most of its time:" in out
    assert cli_main(["explain", str(path), "--slowest", "3", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    slowest = sorted(tree, key=lambda r: -_ms(tree[r]))[:3]
    assert [g["request_id"] for g in got] == slowest
    assert cli_main(["explain", str(path), "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert whole["journeys"] == 12 and whole["causes"][0]["share"] > 0
    assert cli_main(["explain", str(path)]) == 0
    assert "where it went" in capsys.readouterr().out
    assert cli_main(["explain", str(path), str(path), "--json"]) == 0  # named twice: read once
    assert json.loads(capsys.readouterr().out) == whole
    for bad in (["--top", "0"], ["--slowest", "-1"]):
        with pytest.raises(SystemExit) as exit_:
            cli_main(["explain", str(path), *bad])
        assert exit_.value.code == 2
    assert "must be 1 or more" in capsys.readouterr().err
    assert cli_main(["explain", str(path), "--request", "nobody"]) == 1
    assert cli_main(["explain", str(path.parent / "missing.jsonl")]) == 2


def test_what_was_not_observed_is_said_so() -> None:
    """A journey whose spans lack the engine's counters (an older plugin, a
    preemption outside schedule()): the figures are None, the text says so."""
    root = FileSpan(S.SPAN_REQUEST, "t", "r", "", 0, 10_000_000,
                    {S.REQUEST_ID: "old", S.FINISH_STATUS: S.FINISH_LENGTH}, {})  # fmt: skip
    queued = FileSpan(S.SPAN_QUEUED, "t", "q", "r", 1_000_000, 6_000_000, {}, {})
    pre = FileSpan(S.SPAN_PREEMPTED, "t", "p", "r", 6_000_000, 10_000_000, {}, {})
    e = X.explain(root, [queued, pre])
    assert e.admission == (None, None, None)
    (p,) = e.preemptions
    assert (p.by, p.kv_cache_usage, p.num_running, p.recompute_ms) == (None, None, None, None)
    assert e.input_tokens is None and e.decode_tokens is None
    text = format_journey(e)
    assert "Most of its time: queued" in text
    assert f"what the engine looked like then: {NOT_OBSERVED}" in text
    assert f"by {NOT_OBSERVED}" in text and "never resumed" in text
    assert e.by_cause() == {X.BEFORE: 1.0, X.QUEUED: 5.0, X.PREEMPTED: 4.0}
