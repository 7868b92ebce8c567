"""Export over real OTLP (gRPC and HTTP/protobuf), configured only by OTEL_* variables."""

from __future__ import annotations

import os
import socket

import pytest

from conftest import import_harness, journeys_from_vllm, requires_vllm
from otlp_receiver import Receiver
from services import wait_until
from vllm_journey_otel import __version__
from vllm_journey_otel import schema as S
from vllm_journey_otel.config import MODE_PROCESS, MODE_THREAD, Config, exporter_names
from vllm_journey_otel.engine import hooks

pytestmark = journeys_from_vllm
harness = import_harness()


@pytest.fixture(autouse=True)
def _clean_otel_env(monkeypatch):  # type: ignore[no-untyped-def]
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")


def _run_and_shutdown() -> None:
    e = harness.Engine(max_num_batched_tokens=64)
    e.add("p1", prompt_len=100, max_tokens=4)
    e.add("p2", prompt_len=10, max_tokens=2)
    e.run()
    # EngineCore.shutdown -> Scheduler.shutdown: the hook flushes with a deadline.
    e.scheduler.shutdown()


def _check_received(receiver: Receiver) -> None:
    # In process mode the detached exporter sends them shortly after.
    spans = wait_until(
        lambda: len(receiver.spans()) >= 10 and receiver.spans(), 20, 0.1, "10 spans"
    )
    roots = [s for s in spans if s.name == S.SPAN_REQUEST]
    assert sorted(r.attrs[S.REQUEST_ID] for r in roots) == ["p1", "p2"]
    # p1: queued, scheduled, prefill, decode under the root; p2 the same.
    assert len(spans) == 10
    by_id = {s.span.span_id: s for s in spans}
    for s in spans:
        if s.name == S.SPAN_REQUEST:
            assert s.span.kind == s.span.SPAN_KIND_SERVER
            assert s.span.parent_span_id == b""
        else:
            parent = by_id[s.span.parent_span_id]
            assert parent.span.trace_id == s.span.trace_id
            assert parent.span.start_time_unix_nano <= s.span.start_time_unix_nano
            assert s.span.end_time_unix_nano <= parent.span.end_time_unix_nano
    res = spans[0].resource
    assert res[S.RES_MODEL] == str(harness.model_dir())
    assert res[S.RES_PLUGIN_VERSION] == __version__
    assert res[S.RES_HOST] == socket.gethostname()
    assert res[S.RES_PID] == os.getpid()
    assert res[S.RES_DP_RANK] == 0
    import vllm

    assert res[S.RES_VLLM_VERSION] == vllm.__version__


# Per release too: the resource it checks is built from each release's config
# (vLLM's version, the data-parallel rank, the model).
@requires_vllm
@pytest.mark.parametrize("mode", [MODE_PROCESS, MODE_THREAD])
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_otlp_protocols(receiver, monkeypatch, protocol: str, mode: str) -> None:  # type: ignore[no-untyped-def]
    if protocol == "grpc":
        endpoint = f"http://127.0.0.1:{receiver.grpc_port}"
    else:
        endpoint = f"http://127.0.0.1:{receiver.http_port}/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
    assert hooks.install(Config(enabled=True, export_mode=mode))
    try:
        _run_and_shutdown()
        _check_received(receiver)
        assert receiver.spans()[0].resource[S.RES_SERVICE_NAME] == S.DEFAULT_SERVICE_NAME
    finally:
        hooks.uninstall()


def test_generic_protocol_and_service_name(receiver, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.http_port}")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llama-prod")
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging,vllm.data_parallel.rank=3"
    )
    assert hooks.install(Config(enabled=True))
    try:
        _run_and_shutdown()
        res = wait_until(receiver.spans, 20, 0.1, "spans")[0].resource
        assert res[S.RES_SERVICE_NAME] == "llama-prod"
        assert res["deployment.environment"] == "staging"
        # What the user set explicitly wins over what we detect.
        assert res[S.RES_DP_RANK] == "3"
    finally:
        hooks.uninstall()


def test_exporter_selection_follows_sdk_names() -> None:
    assert exporter_names({}) == ["otlp_proto_grpc"]
    assert exporter_names({"OTEL_TRACES_EXPORTER": "none"}) == []
    assert exporter_names({"OTEL_TRACES_EXPORTER": "console"}) == ["console"]
    http = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    assert exporter_names(http) == ["otlp_proto_http"]
    assert exporter_names({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == ["otlp_proto_http"]
    both = {"OTEL_TRACES_EXPORTER": "otlp, console,otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    assert exporter_names(both) == ["otlp_proto_grpc", "console"]
    with pytest.raises(ValueError, match="Unsupported OTLP protocol 'thrift'"):
        exporter_names({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "thrift"})


def test_exporters_come_from_the_sdks_entry_point_group(caplog, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Every name is what an installed package registers (the SDK's own classes
    here; its OTLP ones as our subclasses, with our encoding on the installed
    SDK's internals); a name nobody registers is named in a warning, and
    nothing is exported."""
    import logging

    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    from vllm_journey_otel.export.exporters import build_exporters
    from vllm_journey_otel.export.file_exporter import OtlpJsonFileExporter
    from vllm_journey_otel.export.otlp_exporters import GrpcSpanExporter, HttpSpanExporter
    from vllm_journey_otel.export.span_sink import SpanSink

    got = build_exporters({"OTEL_TRACES_EXPORTER": "otlp,console"})
    assert [type(e) for e in got] == [GrpcSpanExporter, ConsoleSpanExporter]
    assert isinstance(got[0], OTLPSpanExporter) and got[0]._fast
    (http,) = build_exporters({"OTEL_TRACES_EXPORTER": "otlp_proto_http"})
    assert isinstance(http, HttpSpanExporter) and http._fast
    monkeypatch.setenv("VLLM_JOURNEY_OTEL_FILE", str(tmp_path / "j.jsonl"))
    got = build_exporters({"OTEL_TRACES_EXPORTER": "otlp_json_file"})
    assert [type(e) for e in got] == [OtlpJsonFileExporter]
    with pytest.raises(ValueError, match="'zipkin_json'"):
        build_exporters({"OTEL_TRACES_EXPORTER": "zipkin_json"})
    # Spans are encoded straight from their plans only where every exporter takes them.
    for names, encoded in (("otlp", True), ("otlp_proto_http", True), ("otlp,console", False)):
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", names)
        sink = SpanSink.from_env({}, threaded=False)
        assert (sink.encoder is not None) is encoded, names
        sink.shutdown(1.0)
    caplog.set_level(logging.WARNING, logger="vllm.journey_otel")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin_json")
    sink = SpanSink.from_env({})
    assert sink.stage.exporters == []
    assert "no installed package provides the span exporter 'zipkin_json'" in caplog.text


def test_console_exporter() -> None:
    """OTEL_TRACES_EXPORTER=console prints the spans (in a child process: stdout is real)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "from vllm_journey_otel.engine import hooks\n"
        "from vllm_journey_otel.config import MODE_PROCESS, MODE_THREAD, Config\n"
        "assert hooks.install(Config(enabled=True))\n"
        "import harness\n"
        "e = harness.Engine(); e.add('c1'); e.add('c2'); e.run(); e.scheduler.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_TRACES_EXPORTER"] = "console"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count('"name": "vllm.request"') == 2


def test_links_survive_the_exporter_process(receiver, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Process mode: step records travel with journeys through the pipe, and the
    links (a step's batch, a priority preemption's cause) reach the roots that the
    exporter process built with the ids chosen in the engine."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    monkeypatch.setenv(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{receiver.grpc_port}"
    )
    assert hooks.install(Config(enabled=True, export_mode=MODE_PROCESS, steps=True))
    try:
        e = harness.Engine(
            policy="priority", num_blocks=5, max_num_batched_tokens=64, max_model_len=512
        )
        e.add("low", prompt_len=14, max_tokens=20, priority=10)
        e.step()
        e.step()
        e.add("high", prompt_len=32, max_tokens=5, priority=0)
        steps = e.run() + 2
        e.scheduler.shutdown()
        spans = wait_until(
            lambda: (
                sum(s.name == S.SPAN_STEP for s in receiver.spans()) >= steps - 1
                and receiver.spans()
            ),
            20,
            0.1,
            "step spans",
        )
    finally:
        hooks.uninstall()
    roots = {s.attrs[S.REQUEST_ID]: s.span for s in spans if s.name == S.SPAN_REQUEST}
    assert set(roots) == {"low", "high"}
    root_ids = {(r.trace_id, r.span_id) for r in roots.values()}
    step_spans = [s for s in spans if s.name == S.SPAN_STEP]
    linked = {(lk.trace_id, lk.span_id) for s in step_spans for lk in s.span.links}
    assert linked == root_ids
    (preempted,) = [s for s in spans if s.name == S.SPAN_PREEMPTED]
    assert preempted.attrs[S.PREEMPTED_BY] == "high"
    (link,) = preempted.span.links
    assert (link.trace_id, link.span_id) == (roots["high"].trace_id, roots["high"].span_id)
