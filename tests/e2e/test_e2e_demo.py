"""The README's first command, as a new user runs it: ``bash scripts/demo.sh DIR``.

It sets up ``.venv`` (set up already here: each step of ``scripts/setup.sh``
sees that and goes on, the editable install of this checkout too), builds the
tiny model, runs ``VLLM_JOURNEY_OTEL=1 vllm serve`` with the plugin's
defaults, sends its burst (32 completions against a KV cache small enough to
preempt, two chats, one stream whose client hangs up), then prints where the
traces are, the summary, the timeline and two explanations. Checked against
the trace file it wrote: every request's whole journey (the API server's span
and the engine's under it), the preemptions and the abort it promises; and
that each part of its printout is there and names that file. Never timings
or generated text.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from conftest import requires_vllm
from vllm_journey_otel import schema as S
from vllm_journey_otel.tools.tracefile import read_spans

pytestmark = [requires_vllm, pytest.mark.e2e]
ROOT = Path(__file__).resolve().parents[2]
# examples/serve_demo.py: 32 completions, 2 chats, 1 aborted stream.
REQUESTS = 32 + 2 + 1


def test_the_readme_demo_command_serves_traces_and_explains_them(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    # As a user's shell has it: no collector set (the demo then writes a file).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VLLM_JOURNEY"))}
    # A session of its own: past the timeout its `vllm serve` goes with it.
    demo = subprocess.Popen(
        ["bash", "scripts/demo.sh", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        text, err = demo.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(demo.pid, signal.SIGKILL)
        text, err = demo.communicate()
        pytest.fail(f"the demo ran past 600 s:\n{text[-4000:]}\n{err[-4000:]}")
    tail = f"stdout:\n{text[-4000:]}\nstderr:\n{err[-4000:]}"
    assert demo.returncode == 0, tail
    trace_file = out / "journeys.otlp.jsonl"
    assert f"[demo] traces: {trace_file}" in text, tail

    spans = list(read_spans([trace_file]))
    names = Counter(s.name for s in spans)
    assert names[S.SPAN_REQUEST] == REQUESTS, names
    assert names[S.SPAN_API] == REQUESTS, names  # the defaults: the API server's spans on
    api = {s.span_id: s for s in spans if s.name == S.SPAN_API}
    roots = [s for s in spans if s.name == S.SPAN_REQUEST]
    # Each journey under its own request's span, in that span's trace.
    assert sorted(r.parent_span_id for r in roots) == sorted(api)
    assert all(r.trace_id == api[r.parent_span_id].trace_id for r in roots)
    finish = Counter(s.attributes.get(S.FINISH_STATUS) for s in roots)
    assert finish[S.FINISH_ABORTED] == 1, finish  # the stream whose client hung up
    # ignore_eos: the completions run to max_tokens; a chat may stop early.
    assert set(finish) <= {S.FINISH_LENGTH, S.FINISH_STOPPED, S.FINISH_ABORTED}, finish
    assert finish[S.FINISH_LENGTH] >= 32, finish
    assert finish[S.FINISH_LENGTH] + finish[S.FINISH_STOPPED] == REQUESTS - 1, finish
    assert names[S.SPAN_PREEMPTED] > 0, names  # the small KV cache preempts

    # The printout: the summary of that file, the timeline, both explanations.
    assert f"journeys: {REQUESTS}" in text, tail
    assert f"{S.FINISH_ABORTED}=1" in text, tail
    assert f"journeys.html: {REQUESTS} of {REQUESTS} journeys" in text, tail
    assert (out / "journeys.html").stat().st_size > 0
    assert (out / "journeys.png").stat().st_size > 0  # Chromium is set up for the tests
    slowest = text.index("[demo] why was the slowest request slow?")
    overall = text.index("[demo] where all the request-time went")
    assert slowest < overall
    # The story of the slowest request: the longest API-server span's trace.
    longest = max(
        (s for s in spans if s.name == S.SPAN_API), key=lambda s: s.end_unix_ns - s.start_unix_ns
    )
    assert f"trace {longest.trace_id}" in text[slowest:overall], tail
    assert "waterfall:" in text[slowest:overall], tail
    # Where all the request-time went: every journey, its queueing and its preemptions.
    everything = text[overall:]
    assert f"{REQUESTS} journeys" in everything, tail
    assert f"({REQUESTS} from the API server's {S.SPAN_API}" in everything, tail
    for phase in ("queued", "preempted"):  # each a line with its share and its time
        found = re.search(rf"^\s+{phase}\s+[\d.]+%\s+([\d.]+) ms", everything, re.MULTILINE)
        assert found is not None and float(found.group(1)) > 0, tail
