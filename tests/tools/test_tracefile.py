"""OTLP/JSON file export, reading it back, the summary and the CLI."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import REQUIRE_VLLM, import_harness, journeys_from_vllm
from vllm_journey_otel import schema as S
from vllm_journey_otel.config import MODE_THREAD, Config
from vllm_journey_otel.engine import handoff, hooks
from vllm_journey_otel.export.file_exporter import OtlpJsonFileExporter
from vllm_journey_otel.export.otlp_json import json_to_request, spans_to_json
from vllm_journey_otel.tools.cli import CHROMIUM_FLAGS
from vllm_journey_otel.tools.cli import main as cli_main
from vllm_journey_otel.tools.summary import percentile, summarize
from vllm_journey_otel.tools.tracefile import FileSpan, read_spans

pytestmark = journeys_from_vllm
harness = import_harness()


@pytest.fixture(scope="module")
def traced(tmp_path_factory):  # type: ignore[no-untyped-def]
    """Journeys of a real Scheduler under KV pressure, in memory and in a trace file."""
    path = tmp_path_factory.mktemp("tf") / "j.otlp.jsonl"
    memory = InMemorySpanExporter()
    assert hooks.install(
        Config(enabled=True, export_mode=MODE_THREAD),
        exporters=[memory, OtlpJsonFileExporter(path)],
        batch=False,
    )
    try:
        e = harness.Engine(
            num_blocks=12, max_num_batched_tokens=64, max_model_len=512, max_num_seqs=8
        )
        for i in range(10):
            e.add(f"t{i}", prompt_len=20 + 9 * i, max_tokens=20 + 3 * i)
            e.step()
        e.add("gone", prompt_len=30, max_tokens=100)
        e.step()
        e.abort("gone")
        e.run()
        assert handoff.flush(10)
    finally:
        hooks.uninstall()
    return memory.get_finished_spans(), path


def test_json_line_is_the_otlp_protobuf(traced) -> None:  # type: ignore[no-untyped-def]
    spans, _ = traced
    line = spans_to_json(spans)
    assert "\n" not in line
    doc = json.loads(line)
    first = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert len(first["traceId"]) == 32 and len(first["spanId"]) == 16  # hex, not base64
    int(first["traceId"], 16)
    assert json_to_request(line) == encode_spans(spans)


def test_file_holds_every_span(traced) -> None:  # type: ignore[no-untyped-def]
    spans, path = traced
    back = list(read_spans([path]))
    assert sorted((s.trace_id, s.span_id) for s in back) == sorted(
        (f"{s.context.trace_id:032x}", f"{s.context.span_id:016x}") for s in spans
    )
    by_id = {s.span_id: s for s in back}
    for s in spans:
        f = by_id[f"{s.context.span_id:016x}"]
        assert (f.start_unix_ns, f.end_unix_ns) == (s.start_time, s.end_time)
        assert f.attributes == {
            k: tuple(v) if isinstance(v, tuple) else v for k, v in (s.attributes or {}).items()
        }
        assert f.resource[S.RES_SERVICE_NAME] == "vllm"


def test_summary_matches_spans(traced) -> None:  # type: ignore[no-untyped-def]
    spans, path = traced
    d = summarize(read_spans([path])).to_dict()
    roots = [s for s in spans if s.name == S.SPAN_REQUEST]
    assert d["journeys"] == len(roots) == 11
    assert d["spans"] == len(spans)
    assert d["finish_status"] == {"length": 10, "aborted": 1}
    queued = sorted(r.attributes[S.QUEUED_MS] for r in roots if S.QUEUED_MS in r.attributes)
    assert d["phases_ms"]["queued"]["count"] == len(queued)
    assert d["phases_ms"]["queued"]["p50"] == round(percentile(queued, 50), 3)
    assert d["phases_ms"]["decode"]["max"] == round(
        max(r.attributes[S.DECODE_MS] for r in roots if S.DECODE_MS in r.attributes), 3
    )
    preempted = [s for s in spans if s.name == S.SPAN_PREEMPTED]
    assert preempted, "precondition: the workload preempts"
    assert d["preemption"]["preemptions"] == len(preempted)
    lost = sum((s.end_time - s.start_time) / 1e6 for s in preempted)
    assert d["preemption"]["time_lost_ms_total"] == pytest.approx(lost, abs=0.01)
    assert d["tokens"]["output"] == sum(r.attributes[S.GEN_AI_OUTPUT_TOKENS] for r in roots)
    slowest = max(roots, key=lambda r: r.end_time - r.start_time)
    assert d["slowest"][0]["request_id"] == slowest.attributes[S.REQUEST_ID]


def test_rotation_bounds_disk(tmp_path, traced) -> None:  # type: ignore[no-untyped-def]
    spans, _ = traced
    exporter = OtlpJsonFileExporter(tmp_path / "r.jsonl", max_bytes=4000, keep=2)
    for s in spans:
        exporter.export([s])
    files = sorted(p.name for p in tmp_path.iterdir())
    # r.jsonl.lock: the writers' lock between processes, empty, never rotated.
    assert files == ["r.jsonl", "r.jsonl.1", "r.jsonl.2", "r.jsonl.lock"]
    assert (tmp_path / "r.jsonl.lock").stat().st_size == 0
    assert all((tmp_path / f).stat().st_size <= 4000 for f in files)


def test_cli_summary_text_and_json(traced, capsys) -> None:  # type: ignore[no-untyped-def]
    _, path = traced
    assert cli_main(["summary", str(path)]) == 0
    out = capsys.readouterr().out
    assert "journeys: 11" in out and "preempted requests:" in out
    assert cli_main(["summary", "--json", str(path)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["journeys"] == 11 and d["bad_lines"] == 0


def test_cli_errors(tmp_path, traced, capsys) -> None:  # type: ignore[no-untyped-def]
    _, path = traced
    assert cli_main(["summary", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot open" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert cli_main(["summary", str(empty)]) == 1
    assert "no vllm.request spans" in capsys.readouterr().err
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text(path.read_text() + "{not json\n" + path.read_text().splitlines()[0] + "\n")
    assert cli_main(["summary", "--json", str(corrupt)]) == 0
    captured = capsys.readouterr()
    assert f"{corrupt}:{len(path.read_text().splitlines()) + 1}:" in captured.err
    assert json.loads(captured.out)["bad_lines"] == 1


def test_console_script_installed(traced) -> None:  # type: ignore[no-untyped-def]
    _, path = traced
    exe = Path(sys.executable).parent / "vllm-journey"
    out = subprocess.run(
        [str(exe), "summary", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "journeys: 11" in out.stdout


# ---------------------------------------------------------------------------
# timeline
# ---------------------------------------------------------------------------
CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None and not REQUIRE_VLLM, reason="chromium not installed"
)


def _chromium(*args: str, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None, "chromium is required (scripts/setup_chromium.sh)"
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr",
             "--v=0", *args],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip


@needs_chromium
def test_timeline_renders_one_row_per_request(traced, tmp_path) -> None:  # type: ignore[no-untyped-def]
    spans, path = traced
    html_path = tmp_path / "t.html"
    png = tmp_path / "t.png"
    assert cli_main(["timeline", str(path), "-o", str(html_path), "--png", str(png)]) == 0
    page = html_path.read_text()
    assert "http://" not in page and "https://" not in page  # self-contained
    result = _chromium("--dump-dom", html_path.as_uri())
    dom = result.stdout
    roots = [s for s in spans if s.name == S.SPAN_REQUEST]
    ids = re.findall(r'class="row[^"]*" data-request-id="([^"]+)"', dom)
    assert sorted(ids) == sorted(str(r.attributes[S.REQUEST_ID]) for r in roots)
    preempted_ids = {
        str(r.attributes[S.REQUEST_ID]) for r in roots if r.attributes[S.NUM_PREEMPTIONS]
    }
    marked = set(re.findall(r'data-request-id="([^"]+)" data-preempted="1"', dom))
    assert marked == preempted_ids and marked
    # One red preemption segment per preemption.
    assert dom.count('class="seg preempted"') == sum(
        int(r.attributes[S.NUM_PREEMPTIONS]) for r in roots
    )
    assert 'class="row aborted" data-request-id="gone"' in dom
    errors = [x for x in result.stderr.splitlines() if "CONSOLE" in x or "Uncaught" in x]
    assert not errors, errors
    assert png.stat().st_size > 5000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_without_journeys(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    assert cli_main(["timeline", str(empty), "-o", str(tmp_path / "x.html")]) == 1
    assert not (tmp_path / "x.html").exists()


# ---------------------------------------------------------------------------
# replay
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_replay_gives_back_the_same_spans(traced, protocol, capsys) -> None:  # type: ignore[no-untyped-def]
    from otlp_receiver import running_receiver

    _, path = traced
    for receiver in running_receiver():
        port = receiver.grpc_port if protocol == "grpc" else receiver.http_port
        endpoint = f"http://127.0.0.1:{port}"
        assert cli_main(["replay", str(path), "--endpoint", endpoint, "--protocol", protocol]) == 0
        sent = [json_to_request(line) for line in path.read_text().splitlines() if line]
        assert receiver.requests == sent
    assert "sent" in capsys.readouterr().out


def test_replay_unreachable_endpoint(traced, capsys) -> None:  # type: ignore[no-untyped-def]
    from services import free_port

    _, path = traced
    port = free_port()
    code = cli_main(
        [
            "replay",
            str(path),
            "--endpoint",
            f"http://127.0.0.1:{port}",
            "--protocol",
            "http/protobuf",
        ]
    )
    assert code == 3
    assert "failed" in capsys.readouterr().err


def test_summary_splits_engine_journeys_by_data_parallel_rank() -> None:
    """With journeys from several ranks the summary gives each rank's count and
    durations (the rank on each engine core's resource); with one, nothing."""
    from vllm_journey_otel.tools.summary import format_text

    def root(i: int, rank: int | None, ms: int) -> FileSpan:
        resource = {} if rank is None else {S.RES_DP_RANK: rank}
        return FileSpan(S.SPAN_REQUEST, f"t{i}", f"s{i}", "", 0, ms * 1_000_000,
                        {S.REQUEST_ID: f"r{i}"}, resource)  # fmt: skip

    two = [root(0, 0, 10), root(1, 0, 30), root(2, 1, 50)]
    d = summarize(two).to_dict()
    ranks = d["by_data_parallel_rank"]
    assert {k: v["count"] for k, v in ranks.items()} == {"0": 2, "1": 1}
    assert ranks["1"]["max"] == 50.0 and ranks["0"]["max"] == 30.0
    text = format_text(d)
    assert "by data-parallel rank" in text and "rank 1" in text
    assert summarize([root(0, 0, 10), root(1, 0, 20)]).to_dict()["by_data_parallel_rank"] is None
    assert "data-parallel" not in format_text(summarize([root(0, None, 10)]).to_dict())
