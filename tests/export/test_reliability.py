"""Reliability on a real Scheduler with the real exporter process: the backend
fails, export falls behind, the engine goes on; every span is accounted for,
the operator gets a few clear lines instead of one per retry, and the tracer's
health reaches the spans that follow.

Real objects: vLLM's Scheduler (fabricated model outputs, as vLLM's own scheduler
tests do), our exporter process started as in production, the SDK's OTLP gRPC
exporter, an OTLP receiver on 127.0.0.1 behind a TCP proxy that black-holes it.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import import_harness, journeys_from_vllm
from fault_proxy import BLACKHOLE, FORWARD, FaultProxy
from otlp_receiver import Receiver
from services import wait_exited, wait_until
from vllm_journey_otel import schema as S
from vllm_journey_otel.engine import handoff
from vllm_journey_otel.losses import Loss

SUMMARY = re.compile(
    r"(\d+) journeys received, (\d+) spans built, (\d+) exported, (\d+) failed to export, "
    r"(\d+) left unexported at exit, (\d+) journeys dropped in the engine core, "
    r"(\d+) malformed client inputs ignored"
)


def _process_mode(monkeypatch: pytest.MonkeyPatch, endpoint_port: int, **env: str) -> None:
    from vllm_journey_otel.config import Config
    from vllm_journey_otel.engine import hooks

    for key, value in {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{endpoint_port}",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        **env,
    }.items():
        monkeypatch.setenv(key, value)
    assert hooks.install(Config(enabled=True, export_mode="process"))


def _run_requests(harness, prefix: str, n: int) -> int:  # type: ignore[no-untyped-def]
    e = harness.Engine(num_blocks=200, max_num_seqs=16)
    for i in range(n):
        e.add(f"{prefix}{i}", prompt_len=40, max_tokens=6)
    return int(e.run())


def _roots(receiver: Receiver, prefix: str) -> list[dict[str, object]]:
    return [
        s.attrs
        for s in receiver.spans()
        if s.name == S.SPAN_REQUEST and str(s.attrs[S.REQUEST_ID]).startswith(prefix)
    ]


@journeys_from_vllm
def test_outage_is_counted_reported_once_and_recovered(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], receiver: Receiver
) -> None:
    harness = import_harness()
    from vllm_journey_otel.engine import hooks

    proxy = FaultProxy(receiver.grpc_port)
    proxy.set_mode(BLACKHOLE)
    # A small export stage and a short export timeout, so the test is quick; the
    # behaviour is the same with the defaults, only later.
    _process_mode(
        monkeypatch,
        proxy.port,
        OTEL_EXPORTER_OTLP_TIMEOUT="1",
        OTEL_BSP_MAX_QUEUE_SIZE="40",
        OTEL_BSP_MAX_EXPORT_BATCH_SIZE="10",
        OTEL_BSP_SCHEDULE_DELAY="50",
    )
    exporter_pid = None
    try:
        # A burst while the backend black-holes every export: about 200 spans
        # against a stage of 40; the rest waits in the pipe.
        steps = _run_requests(harness, "burst", 40)
        assert steps > 0
        pipeline = handoff.pipeline()
        assert pipeline is not None
        exporter_pid = pipeline.sink.pid  # type: ignore[attr-defined]
        assert exporter_pid and psutil.pid_exists(exporter_pid)
        assert handoff.flush(5.0)
        assert pipeline.losses[Loss.QUEUE_FULL] == 0, (
            "the engine side never drops: the pipe took it all"
        )
        time.sleep(2.5)  # let the exporter fail a few batches

        proxy.set_mode(FORWARD)
        _run_requests(harness, "after", 5)
        assert handoff.flush(5.0)
        wait_until(lambda: len(_roots(receiver, "after")) == 5, 30, what="journeys after recovery")
    finally:
        hooks.uninstall()
        if exporter_pid:
            wait_exited([exporter_pid], 30)
        proxy.close()

    err = capfd.readouterr().err
    # One line per event for the operator, not one per retry or per dropped span.
    assert err.count("fails (") == 1, err
    assert err.count("works again") == 1, err
    assert err.count("export is slower than the traffic") == 1, err
    assert "Transient error" not in err, err

    m = SUMMARY.search(err)
    assert m, err
    journeys, built, exported, failed, left, engine_dropped, _ = map(int, m.groups())
    assert journeys == 45 and engine_dropped == 0 and left == 0
    assert failed > 0, "the outage must have cost spans: the batches tried during it"
    assert exported > 0.5 * built, "what waited in the pipe was exported after it"
    assert built == exported + failed, "every span accounted for"
    assert exported == len(receiver.spans())
    print(f"outage: {built} built = {exported} exported + {failed} failed")

    # The journeys after the outage say what the tracer lost before them.
    after = _roots(receiver, "after")
    lost = {int(str(a[S.TRACER_LOST_SPANS])) for a in after}
    assert min(lost) > 0 and max(lost) <= failed
    assert {a[S.TRACER_DROPPED_JOURNEYS] for a in after} == {0}


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    """A throwaway certificate for 127.0.0.1 (and localhost), made here, valid one day."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp / "cert.pem", tmp / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


@journeys_from_vllm
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_tls_and_auth_headers_through_the_standard_variables(  # type: ignore[no-untyped-def]
    monkeypatch, tmp_path, protocol: str
) -> None:
    """OTEL_EXPORTER_OTLP_CERTIFICATE and _HEADERS reach the exporter process and work."""
    harness = import_harness()
    from vllm_journey_otel.engine import hooks

    cert, key = _self_signed(tmp_path)
    # Set in many images; requests lets it override the SDK's certificate.
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")
    receiver = Receiver()
    if protocol == "grpc":
        port = receiver.start_grpc(tls=(cert.read_bytes(), key.read_bytes()))
        endpoint = f"https://127.0.0.1:{port}"
    else:
        port = receiver.start_http(tls=(cert, key))
        endpoint = f"https://127.0.0.1:{port}/v1/traces"
    try:
        _process_mode(
            monkeypatch,
            port,
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=endpoint,
            OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=protocol,
            OTEL_EXPORTER_OTLP_CERTIFICATE=str(cert),
            OTEL_EXPORTER_OTLP_HEADERS="authorization=Bearer%20s3cret,x-tenant=team-a",
        )
        try:
            _run_requests(harness, "tls", 3)
            assert handoff.flush(5.0)
            wait_until(lambda: len(_roots(receiver, "tls")) == 3, 30, what="journeys over TLS")
        finally:
            hooks.uninstall()
    finally:
        receiver.stop()
    assert receiver.headers, "the exporter reached the TLS receiver"
    for headers in receiver.headers:
        assert headers.get("authorization") == "Bearer s3cret"
        assert headers.get("x-tenant") == "team-a"


# 20,000 journeys written by our SCHED_IDLE exporter before its exit deadline: with
# another test run busy on both CPUs it got too little of them (299 journeys short).
@pytest.mark.alone
def test_exporter_stalled_engine_side_drops_counted_and_carried(  # type: ignore[no-untyped-def]
    monkeypatch, tmp_path, caplog
) -> None:
    """The exporter process stops reading (SIGSTOP): the pipe fills, the bounded
    hand-off queue fills, journeys are dropped and counted without blocking the
    engine thread; once the exporter runs again, the next journeys carry the count.

    Pure pipeline with our real exporter process writing a trace file; the
    journeys are built by the journey model (no Scheduler needed for this path).
    """
    import logging
    import os
    import signal

    from vllm_journey_otel.engine.pipe_sink import PipeSink
    from vllm_journey_otel.engine.pipeline import JourneyPipeline
    from vllm_journey_otel.engine.request_journey import RequestJourney
    from vllm_journey_otel.journey import STATUS_LENGTH
    from vllm_journey_otel.tools.tracefile import read_spans

    out = tmp_path / "journeys.otlp.jsonl"
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp_json_file")
    monkeypatch.setenv("VLLM_JOURNEY_OTEL_FILE", str(out))
    # Room for the whole pipe backlog in the exporter's span queue, and time to
    # write it at exit on a loaded machine: this test is about the engine side
    # (the exporter side is the outage test above).
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "200000")
    monkeypatch.setenv("VLLM_JOURNEY_OTEL_SHUTDOWN_TIMEOUT_S", "60")

    def journey(rid: str) -> Any:
        t = time.monotonic_ns()
        j = RequestJourney(rid, time.time(), t, 0, 100, 8)
        j.scheduled(t + 1000, 1, 0, 100, 100, 0)
        j.tokens(t + 2000, 1, 1)
        return j.finish(t + 3000, 2, STATUS_LENGTH, "length", 8, t + 3000)

    sink = PipeSink.start({"service.name": "stall-test"})
    assert sink.pid
    pipeline = JourneyPipeline(sink, max_queue=64, start_thread=False)
    os.kill(sink.pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.journey_otel"):
            # The engine thread's calls: submit, then publish at the end of a step.
            now = time.monotonic_ns()
            for i in range(20_000):
                pipeline.submit(journey(f"stall-{i}"))
                now += 20_000_000
                pipeline.publish_due(now)
            pipeline._report_drops()
        assert pipeline.losses[Loss.QUEUE_FULL] > 0, (
            "the 1 MiB pipe and 64-slot queue must overflow"
        )
        assert pipeline.queued <= 64
        drops = [r.getMessage() for r in caplog.records if "dropped so far" in r.getMessage()]
        assert drops, "a full queue is reported"
        # The advice names the levers for an exporter that cannot keep up.
        assert "VLLM_JOURNEY_OTEL_EXPORTER_PROCESSES" in drops[0], drops[0]
        assert "VLLM_JOURNEY_OTEL_EXPORTER_CPUS" in drops[0], drops[0]
    finally:
        os.kill(sink.pid, signal.SIGCONT)
    pipeline.flush(10.0)  # now the queue (and the pending bytes) can go
    for i in range(3):
        pipeline.submit(journey(f"later-{i}"))
    pipeline.shutdown(10.0)
    wait_exited([sink.pid], 90)
    roots = {
        s.attributes[S.REQUEST_ID]: s.attributes
        for s in read_spans([out])
        if s.name == S.SPAN_REQUEST
    }
    dropped = pipeline.losses[Loss.QUEUE_FULL]
    assert len([r for r in roots if str(r).startswith("stall-")]) == 20_000 - dropped
    for i in range(3):
        assert roots[f"later-{i}"][S.TRACER_DROPPED_JOURNEYS] == dropped
