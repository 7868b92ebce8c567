"""``vllm-journey diff``: its statistics against independent computations, its
rules, and its figures against the spans of a file.

The statistics are checked against what they claim (an interval's coverage over
many draws of a known distribution; the rank test against the exact
permutation distribution), not against a restatement of their formulas. The
file-level tests use journeys of vLLM's real Scheduler (tests/harness.py) with
the API-server spans absent, as an older file or ``VLLM_JOURNEY_OTEL_API_SPANS=0``
writes them; the served runs with the defaults are tests/e2e/test_e2e_tools.py.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest

from conftest import import_harness, journeys_from_vllm
from vllm_journey_otel import schema as S
from vllm_journey_otel.config import MODE_THREAD, Config
from vllm_journey_otel.engine import handoff, hooks
from vllm_journey_otel.export.file_exporter import OtlpJsonFileExporter
from vllm_journey_otel.tools import diff as D
from vllm_journey_otel.tools import explain as X
from vllm_journey_otel.tools import journey_files as J
from vllm_journey_otel.tools.cli import main as cli_main
from vllm_journey_otel.tools.tracefile import read_spans


def test_the_quantile_interval_covers_the_true_quantile_95_percent_of_the_time() -> None:
    rng = random.Random(7)
    for q in (0.5, 0.9, 0.99):
        true = -math.log(1 - q)  # the exponential distribution's q-quantile
        covered = 0
        for _ in range(400):
            sample = sorted(rng.expovariate(1.0) for _ in range(800))
            lo, hi = D.quantile_interval(sample, q)
            covered += lo <= true <= hi
        assert 0.91 <= covered / 400 <= 0.995, (q, covered)


def _exact_p(a: list[float], b: list[float]) -> float:
    """Two-sided p of the rank-sum statistic over every split of the pooled values."""
    pooled = a + b
    n = len(pooled)
    ranks = {v: (sum(x < v for x in pooled) + 1 + sum(x <= v for x in pooled)) / 2 for v in pooled}
    mean = len(b) * (n + 1) / 2
    seen = abs(sum(ranks[v] for v in b) - mean)
    splits = list(itertools.combinations(range(n), len(b)))
    extreme = sum(abs(sum(ranks[pooled[i]] for i in s) - mean) >= seen - 1e-9 for s in splits)
    return extreme / len(splits)


@pytest.mark.parametrize(
    "a,b",
    [
        ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [4.5, 5.5, 6.5, 7.5, 8.5, 9.5]),
        ([1.0, 2.0, 2.0, 3.0, 3.0, 3.0], [2.0, 3.0, 3.0, 4.0, 4.0, 5.0]),  # ties
        ([0.0, 0.0, 0.0, 0.0, 1.0, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.5]),  # mostly zeros
    ],
)
def test_the_rank_test_agrees_with_the_exact_permutation_test(a, b) -> None:  # type: ignore[no-untyped-def]
    # The normal approximation at 6 + 6 values is within a few hundredths of exact.
    assert D.mann_whitney_p(a, b) == pytest.approx(_exact_p(a, b), abs=0.05)


def test_two_draws_of_one_distribution_are_rarely_beyond_the_noise_and_a_shift_is_seen() -> None:
    rng = random.Random(3)
    flagged = 0
    for _ in range(100):
        a = sorted(rng.lognormvariate(3, 0.5) for _ in range(500))
        b = sorted(rng.lognormvariate(3, 0.5) for _ in range(500))
        flagged += D.compare_values("queued", a, b).at(50).beyond_noise  # type: ignore[union-attr]
    assert flagged <= 5  # both intervals must miss: rarer than 5 %
    a = sorted(rng.lognormvariate(3, 0.5) for _ in range(500))
    b = sorted(1.3 * rng.lognormvariate(3, 0.5) for _ in range(500))
    d = D.compare_values("queued", a, b)
    assert d.at(50).beyond_noise and d.shift_p < 1e-6  # type: ignore[union-attr]


def test_rules_parse_and_say_what_is_wrong() -> None:
    r = D.parse_rule("queued.p99 > +20%")
    assert (r.phase, r.q, r.op, r.value, r.relative) == ("queued", 99, ">", 20.0, True)
    r = D.parse_rule("wait:remote_kv.p50>=5.5ms")
    assert (r.phase, r.q, r.op, r.value, r.relative) == ("wait:remote_kv", 50, ">=", 5.5, False)
    for bad, words in (
        ("queued.p99 > 20", "expected PHASE.pQ OP CHANGE"),
        ("queued.p95 > 20%", "use one of p50, p90, p99"),
        ("queueing.p99 > 20%", "unknown phase 'queueing'"),
    ):
        with pytest.raises(ValueError, match=words):
            D.parse_rule(bad)


def _diff(base: list[float], new: list[float]) -> D.Diff:
    return D.Diff(None, None, [D.compare_values("queued", sorted(base), sorted(new))], {})  # type: ignore[arg-type]


def test_a_rule_fires_on_a_change_that_meets_it_beyond_the_noise_only() -> None:
    rng = random.Random(5)
    base = [rng.uniform(10, 20) for _ in range(400)]
    worse = [1.5 * v for v in base]
    assert D.parse_rule("queued.p50 > +20%").check(_diff(base, worse)) is not None
    assert D.parse_rule("queued.p50 > +60%").check(_diff(base, worse)) is None
    assert D.parse_rule("queued.p50 > +5ms").check(_diff(base, worse)) is not None
    assert D.parse_rule("queued.p50 < -5ms").check(_diff(worse, base)) is not None
    # 5 values each bound no p50: the rule cannot be told from noise, and fails so.
    why = D.parse_rule("queued.p50 > +20%").check(_diff(base[:5], worse[:5]))
    assert why is not None and "too few to tell" in why
    assert not D.compare_values("queued", sorted(base[:5]), sorted(worse[:5])).at(50).beyond_noise  # type: ignore[union-attr]
    why = D.parse_rule("decode.p50 > +20%").check(_diff(base, worse))
    assert why is not None and "not observed in both files" in why


# ---------------------------------------------------------------------------
# On a file of the real Scheduler's journeys, without the API server's spans
# ---------------------------------------------------------------------------
harness = import_harness()


@pytest.fixture(scope="module")
def engine_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("diff") / "j.otlp.jsonl"
    assert hooks.install(
        Config(enabled=True, export_mode=MODE_THREAD), exporters=[OtlpJsonFileExporter(path)],
        batch=False,
    )  # fmt: skip
    try:
        e = harness.Engine(num_blocks=12, max_num_batched_tokens=64, max_model_len=512,
                           max_num_seqs=8)  # fmt: skip
        for i in range(12):
            e.add(f"t{i}", prompt_len=20 + 9 * i, max_tokens=20 + 3 * i)
            e.step()
        e.run()
        from vllm.lora.request import LoRARequest

        e = harness.Engine(max_loras=2)
        for i in range(4):  # two adapters: two groups
            lora = LoRARequest(f"ad{i % 2}", 1 + i % 2, f"/nonexistent/ad{i % 2}")
            e.add(f"l{i}", prompt_len=20, max_tokens=4 + i, lora=lora)
        e.run()
        assert handoff.flush(10)
    finally:
        hooks.uninstall()
    return path


@journeys_from_vllm
def test_phases_are_the_explained_causes_and_missing_is_not_zero(engine_only: Path) -> None:
    def read(attributes_of: frozenset[str] | None):  # type: ignore[no-untyped-def]
        return read_spans([engine_only], attributes_of=attributes_of)

    sample = D.from_reader(read)
    explained, total = J.explanations(read, J.Selection(slowest=1000))
    assert sample.count == total == 16
    for cause in (X.QUEUED, X.PREFILL, X.DECODE, X.PREEMPTED):
        expect = sorted(e.by_cause().get(cause, 0.0) for e in explained)
        assert sample.sorted_values(cause) == pytest.approx(expect, abs=1e-6)
    assert sample.sorted_values(D.E2E) == pytest.approx(sorted(e.e2e_ms for e in explained))
    # No API server's spans in the file: its sides are not observed, not 0.
    for cause in (*X.API_BEFORE, *X.API_AFTER):
        assert sample.sorted_values(cause) == []
    roots = [s for s in read(None) if s.name == S.SPAN_REQUEST]
    ttft = sorted(r.attributes[S.TTFT_MS] for r in roots)
    assert sample.sorted_values(D.TTFT) == pytest.approx(ttft)


@journeys_from_vllm
def test_a_file_against_itself(engine_only: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = str(engine_only)
    assert cli_main(["diff", f, f, "--json", "--fail-if", "e2e.p50 > +0%"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["failed"] == [] and d["journeys"] == [16, 16]
    for p in d["phases"]:
        for q in p["quantiles"].values():
            assert q["change"] == 0 and not q["beyond_noise"]
    # Per LoRA adapter (none, ad0, ad1): end to end and TTFT, each group's own journeys.
    lora = d["groups"]["lora"]
    assert set(lora) == {"", "ad0", "ad1"}
    assert [p["count"] for p in lora["ad0"]] == [[2, 2], [2, 2]]
    assert [p["phase"] for p in lora["ad1"]] == [D.E2E, D.TTFT]
    assert "model" not in d["groups"]  # one model: the whole is the group
    # 16 journeys cannot bound a p99: a gate on it fails rather than pass blind.
    assert cli_main(["diff", f, f, "--fail-if", "e2e.p99 > +0%"]) == 1
    assert "too few to tell a change of p99 from noise" in capsys.readouterr().err
    assert cli_main(["diff", f, f, "--fail-if", "queued.p99 >> 1"]) == 2
    assert "expected PHASE.pQ OP CHANGE" in capsys.readouterr().err
    assert cli_main(["diff", f, str(engine_only.parent / "missing.jsonl")]) == 2
    assert cli_main(["diff", f, f, "--html", str(engine_only.parent / "no" / "d.html")]) == 2
    assert "d.html: cannot write" in capsys.readouterr().err
    empty = engine_only.parent / "empty.jsonl"
    empty.write_text("")
    assert cli_main(["diff", f, str(empty)]) == 1
    assert "no vllm.request spans found" in capsys.readouterr().err
