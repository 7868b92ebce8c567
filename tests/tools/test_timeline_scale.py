"""The timeline page with 10,000 journeys, in headless Chromium.

A trace file of 10,000 journeys (the real journey model, span plan, builder and
file exporter: tests/records.py) becomes one page holding every row; Chromium
loads it without a script error, keeps only the rows in view in the DOM, scrolls
to a row named in the address (``#request=ID``) and opens that row's
explanation, whose figures are the explain tool's. Timings are the benchmark's
(benchmarks/timeline_bench.py), not asserted here.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import REQUIRE_VLLM
from records import write_trace_file
from vllm_journey_otel.tools import explain as X
from vllm_journey_otel.tools import journey_files as J
from vllm_journey_otel.tools.cli import CHROMIUM_FLAGS
from vllm_journey_otel.tools.cli import main as cli_main
from vllm_journey_otel.tools.tracefile import read_spans

N = 10_000
# As tests/tools/test_tracefile.py: required where the suite is required to run whole.
pytestmark = pytest.mark.skipif(
    shutil.which("chromium") is None and not REQUIRE_VLLM, reason="chromium not installed"
)


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("scale")
    trace = tmp / "big.jsonl"
    write_trace_file(trace, N)
    html = tmp / "big.html"
    assert cli_main(["timeline", str(trace), "-o", str(html)]) == 0
    return trace, html


def _dom(url: str) -> tuple[str, str]:
    chromium = shutil.which("chromium")
    assert chromium, "chromium is required (scripts/setup_chromium.sh)"
    with tempfile.TemporaryDirectory() as profile:
        run = subprocess.run(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr",
             "--v=0", "--window-size=1400,900", "--virtual-time-budget=10000", "--dump-dom", url],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
    return run.stdout, run.stderr


def test_every_journey_is_in_the_page(page: tuple[Path, Path]) -> None:
    _, html = page
    text = html.read_text()
    data = json.loads(re.search(r"const DATA = (\[.*?\]);\n", text, re.S).group(1))  # type: ignore[union-attr]
    assert len(data) == N and len({d["id"] for d in data}) == N
    assert all(d["x"] and d["x"]["c"] for d in data), "every row has its explanation"


def test_chromium_draws_the_rows_in_view_and_jumps_to_a_request(page: tuple[Path, Path]) -> None:
    trace, html = page
    dom, log = _dom(html.as_uri() + "#request=req-5000")
    errors = [x for x in log.splitlines() if "Uncaught" in x or ("CONSOLE" in x and "Error" in x)]
    assert not errors, errors
    assert 'data-ready="1"' in dom
    ids = re.findall(r'class="row[^"]*" data-request-id="([^"]+)"', dom)
    assert 0 < len(ids) <= 200, "only the rows in view are in the DOM"
    assert "req-5000" in ids
    assert re.search(r'class="row[^"]*picked[^"]*" data-request-id="req-5000"', dom)
    # The explanation panel: the explain tool's figures for that request.
    panel = re.search(r'<div id="explain"[^>]*>(.*?)</div>', dom, re.S).group(1)  # type: ignore[union-attr]
    (e,), _ = J.explanations(
        lambda a: read_spans([trace], attributes_of=a),
        J.Selection(request_ids=frozenset({"req-5000"})),
    )
    assert panel.startswith("req-5000")
    for cause, ms in e.by_cause().items():
        assert f"{X.label(cause):<28}{ms:10.1f} ms" in panel
    assert f"vllm-journey explain {trace} --request req-5000" in panel
