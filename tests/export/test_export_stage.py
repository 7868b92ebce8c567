"""The export stage (export_stage.py): batches, backpressure instead of drops,
deadlines, counts from the exporters' results. The SDK's own OTLP gRPC exporter
and ours (the SDK's, sending our encoder's bytes) against a real receiver, made
slow, down or black-holed by a real TCP proxy."""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from fault_proxy import BLACKHOLE, DOWN, FORWARD, FaultProxy
from otlp_receiver import Receiver
from records import journeys
from services import wait_until
from vllm_journey_otel import config as C
from vllm_journey_otel.export import otlp_exporters
from vllm_journey_otel.export.export_stage import ExportStage
from vllm_journey_otel.export.health import ExportHealth
from vllm_journey_otel.export.otlp_exporters import GrpcSpanExporter, _BytesTraceStub
from vllm_journey_otel.export.span_builder import SpanBuilder
from vllm_journey_otel.export.spans import plan_spans, root_context


def spans(n_journeys: int, start: int = 0) -> list[ReadableSpan]:
    builder = SpanBuilder(Resource({"service.name": "stage"}), SpanLimits())
    out: list[ReadableSpan] = []
    for j in journeys(n_journeys, start):
        out.extend(builder.build(plan_spans(j, 0), *root_context(j)))
    return out


class Batches(SpanExporter):
    """Records the size of each batch it is given (the stage's output)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.at: list[float] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.sizes.append(len(spans))
        self.at.append(time.monotonic())
        return SpanExportResult.SUCCESS


@pytest.fixture
def proxy(receiver: Receiver) -> Iterator[FaultProxy]:
    p = FaultProxy(receiver.grpc_port)
    yield p
    p.close()


def otlp(
    port: int,
    monkeypatch: pytest.MonkeyPatch,
    timeout_s: int = 10,
    cls: type[OTLPSpanExporter] = OTLPSpanExporter,
) -> OTLPSpanExporter:
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", str(timeout_s))
    return cls(endpoint=f"http://127.0.0.1:{port}", insecure=True)


def test_the_fault_proxy_keeps_its_port_while_down(proxy: FaultProxy) -> None:
    # The tests leave the proxy down for minutes while servers start; its port
    # must stay its own (no other bind, no ephemeral port), yet refuse connections.
    def refused_and_held() -> None:
        with pytest.raises(ConnectionRefusedError), socket.socket() as s:
            s.connect(("127.0.0.1", proxy.port))
        with pytest.raises(OSError, match="in use"), socket.socket() as s:
            s.bind(("127.0.0.1", proxy.port))

    refused_and_held()
    proxy.set_mode(FORWARD)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5):
        pass
    proxy.set_mode(DOWN)
    refused_and_held()


def test_batches_leave_full_or_after_their_delay() -> None:
    out = Batches()
    stage = ExportStage([out], ExportHealth(), max_batch=10, delay_s=1.0)
    try:
        t0 = time.monotonic()
        stage.add(spans(5))  # 25 spans: two full batches now, the rest after the delay
        wait_until(lambda: out.sizes == [10, 10, 5], 10, 0.01, "three batches")
        assert out.at[1] - t0 < 1.0 <= out.at[2] - t0
        assert stage.health.spans_exported == 25 and stage.backlog == 0
    finally:
        stage.shutdown(2)


def test_a_waiting_add_makes_the_pending_batch_due_at_once() -> None:
    """A stage whose queue is no larger than its batch (OTEL_BSP_MAX_QUEUE_SIZE at
    or below the batch): an add that finds no room does not wait for the batch's
    delay, the pending spans are exported at once to make room."""
    out = Batches()
    stage = ExportStage([out], ExportHealth(), max_batch=10, delay_s=5.0, max_pending=10)
    try:
        built = spans(2)  # 10 spans
        stage.add(built[:6])
        t0 = time.monotonic()
        stage.add(built[6:] + spans(1, start=5))  # 4 + 5 more: over the 10 pending
        assert time.monotonic() - t0 < 2.5, "waited for the 5 s delay"
        assert out.sizes and out.sizes[0] == 6
    finally:
        stage.shutdown(2)


def test_a_slow_backend_makes_span_building_wait_and_nothing_is_dropped(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver.delay_s = 0.1  # each export answered 100 ms late
    health = ExportHealth()
    stage = ExportStage([otlp(receiver.grpc_port, monkeypatch)], health, 10, 0.05, 20)
    try:
        built = spans(40)  # 200 spans, ten times what the stage holds
        for k in range(0, len(built), 10):
            stage.add(built[k : k + 10])
            assert stage.backlog <= 20 + 10  # pending beside the batch under way
        assert stage.waited_s > 0.5, "building waited for the backend"
        assert stage.flush(30)
    finally:
        stage.shutdown(5)
    assert len(receiver.spans()) == 200
    assert health.spans_exported == 200 and health.spans_failed == 0


def test_flush_and_shutdown_keep_their_deadline_when_the_backend_hangs(
    proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy.set_mode(BLACKHOLE)
    stage = ExportStage([otlp(proxy.port, monkeypatch, timeout_s=30)], ExportHealth(), 10, 0.0)
    stage.add(spans(2))
    t0 = time.monotonic()
    assert not stage.flush(0.3)
    assert not stage.shutdown(0.5)
    assert time.monotonic() - t0 < 3.0, "each kept its deadline although export hangs"


@pytest.mark.parametrize(
    ("cls", "stub_found"),
    [(OTLPSpanExporter, False), (GrpcSpanExporter, True), (GrpcSpanExporter, False)],
    ids=["sdk", "ours", "ours-parsing"],
)
def test_results_are_counted_and_an_outage_reported_once(
    proxy: FaultProxy,
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
    caplog,  # type: ignore[no-untyped-def]
    cls: type[OTLPSpanExporter],
    stub_found: bool,
) -> None:
    """Ours also where the SDK keeps its stub elsewhere (an SDK other than 1.45):
    then our bytes are parsed into the SDK's message and sent by its stub."""
    if not stub_found:
        monkeypatch.setattr(otlp_exporters, "_GRPC_STUB_PARTS", ("_no_such_part",))
    caplog.set_level(logging.WARNING, logger="vllm.journey_otel")
    proxy.set_mode(DOWN)
    health = ExportHealth()
    exporter = otlp(proxy.port, monkeypatch, timeout_s=1, cls=cls)
    client = exporter._client
    stage = ExportStage([exporter], health, 10, 0.0, endpoint="the proxy")
    try:
        stage.add(spans(4))  # 20 spans: two batches, each refused until the timeout
        assert stage.flush(30)
        assert (health.spans_failed, health.spans_exported) == (20, 0)
        proxy.set_mode(FORWARD)
        # gRPC may still be in its reconnect backoff for the first tries.
        added = 20
        for k in range(10):
            stage.add(spans(2, start=10 + 2 * k))
            added += 10
            assert stage.flush(30)
            if health.spans_exported:
                break
        assert health.spans_exported == 10, "the first batch after the outage came through"
        assert health.spans_failed + health.spans_exported == added, "every span counted once"
    finally:
        stage.shutdown(5)
    assert len(receiver.spans()) == 10
    # UNAVAILABLE made the SDK re-create its channel and client (1.45); ours
    # still sends our bytes as they are through the re-created one.
    assert exporter._client is not client
    assert isinstance(exporter._client, _BytesTraceStub) == (cls is GrpcSpanExporter and stub_found)
    text = caplog.text
    assert text.count("exporting spans to the proxy fails") == 1, text
    assert text.count("export to the proxy works again") == 1, text
    assert re.search(r"works again after [0-9.]+ s; \d+ spans were lost meanwhile", text)


def test_an_exporter_that_raises_counts_as_failed() -> None:
    class Broken(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            raise RuntimeError("disk on fire")

    health = ExportHealth()
    stage = ExportStage([Broken()], health, threaded=False)
    stage.add(spans(1))
    assert health.spans_failed == 5 and health.last_reason == "RuntimeError: disk on fire"


def test_a_stop_request_ends_the_wait_for_the_backend(
    proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy.set_mode(BLACKHOLE)
    stage = ExportStage([otlp(proxy.port, monkeypatch, timeout_s=30)], ExportHealth(), 5, 0.0, 5)
    stop = threading.Event()
    done = threading.Event()

    def build() -> None:
        for _ in range(5):  # far more than the stage holds while export hangs
            stage.add(spans(2), stop.is_set)
        done.set()

    worker = threading.Thread(target=build, daemon=True)
    worker.start()
    wait_until(lambda: stage.waited_s > 0 or stage.backlog >= 10, 10, 0.01, "a full stage")
    assert not done.wait(0.5), "building waits while the backend hangs"
    stop.set()
    assert done.wait(5), "the stop request ends the wait"
    stage.shutdown(0.5)


def test_batching_reads_the_sdks_batch_variables(caplog) -> None:  # type: ignore[no-untyped-def]
    assert C.batching_from_env({}) == C.Batching(2048, 500.0, 4096)
    assert C.batching_from_env({C.BSP_MAX_EXPORT_BATCH_SIZE: "100"}) == C.Batching(100, 500.0, 200)
    # A queue below the batch: the batch is the queue.
    small = C.batching_from_env({C.BSP_MAX_QUEUE_SIZE: "1000"})
    assert (small.max_batch, small.max_pending) == (1000, 1000)
    assert C.batching_from_env({C.BSP_SCHEDULE_DELAY: "50"}).delay_ms == 50.0
    # Empty values are unset (a compose file's VAR: ${VAR}); bad ones warn.
    assert C.batching_from_env({C.BSP_MAX_QUEUE_SIZE: " ", C.BSP_SCHEDULE_DELAY: ""}) == (
        C.batching_from_env({})
    )
    caplog.set_level(logging.WARNING, logger="vllm.journey_otel")
    assert C.batching_from_env({C.BSP_MAX_EXPORT_BATCH_SIZE: "²"}).max_batch == 2048
    assert "OTEL_BSP_MAX_EXPORT_BATCH_SIZE='²' is not a number" in caplog.text
