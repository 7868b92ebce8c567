"""Reliability end to end, on a real `vllm serve` (tiny CPU model), a real OpenAI
client and real OTLP over real sockets.

* SIGTERM with requests in flight: each is exported, as aborted.
* Backend faults (down from the start, slow, black-holed, restarted): serving
  goes on, outputs are token-identical to a plugin-off server, one clear warning
  per fault, journeys flow again once the backend is back.
* Bad input (traceparent/tracestate, request ids, huge max_tokens) and what must
  never leave the process (prompt and generated text, token ids), and nothing
  of ours listens on a port.

The faults are made by a TCP proxy (tests/fault_proxy.py) between the exporter
and an in-test OTLP receiver; nothing is mocked.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import requires_vllm
from fault_proxy import BLACKHOLE, DOWN, FORWARD, FaultProxy
from otlp_receiver import Receiver, wire_spans
from services import VllmServer, wait_until
from test_e2e_serve import LAYOUTS, client, journeys_in_trace, new_traceparent, start_server
from trees import check_invariants
from vllm_journey_otel import schema as S

pytestmark = [requires_vllm, pytest.mark.e2e]

MAX_TOKENS = 2000

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from fixtures.tiny_model import build

    return build(ROOT / ".cache" / "tiny-llama")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.start_grpc()
    yield r
    r.stop()


def _exporter_pids(server: VllmServer) -> list[int]:
    """Our exporter processes started for this server (detached, so not its children)."""
    pids = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            cmd = p.info["cmdline"] or []
            env = p.info["environ"] or {}
        except (psutil.Error, KeyError):
            continue
        if "vllm_journey_otel.exporter_process" in cmd and env.get("VJO_TEST_SERVER") == str(
            server.port
        ):
            pids.append(p.pid)
    return pids


# ---------------------------------------------------------------------------
# SIGTERM with requests in flight
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sigterm_with_requests_in_flight_exports_them_aborted(  # type: ignore[no-untyped-def]
    model_dir, receiver, tmp_path, layout: str
) -> None:
    import httpx

    # vLLM's defaults: --shutdown-timeout 0 (abort in-flight requests at once).
    server = start_server(model_dir, tmp_path, receiver, layout)
    tp, trace_id, _ = new_traceparent()
    n = 8
    started = threading.Barrier(n + 1, timeout=60)
    tokens: list[int] = [0] * n

    def stream(i: int) -> None:
        body = {
            "model": server.model, "prompt": f"in flight {i}", "max_tokens": MAX_TOKENS,
            "stream": True, "ignore_eos": True,
        }  # fmt: skip
        try:
            with (
                httpx.Client(timeout=60) as http,
                http.stream(
                    "POST", server.url + "/v1/completions", json=body,
                    headers={"traceparent": tp},
                ) as r,
            ):  # fmt: skip
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        tokens[i] += 1
                        if tokens[i] == 1:
                            started.wait()
        except (httpx.HTTPError, threading.BrokenBarrierError):
            pass  # the server went away under the stream: expected

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(n)]
    try:
        for t in threads:
            t.start()
        started.wait()  # every request is decoding
        t0 = time.monotonic()
        server.signal(signal.SIGTERM)
        server.proc.wait(timeout=60)
        shutdown_s = time.monotonic() - t0
    finally:
        server.stop()
    for t in threads:
        t.join(10)
    roots = journeys_in_trace(receiver, trace_id, count=n, timeout=30)
    assert len(roots) == n, "every request in flight at SIGTERM is exported"
    # vLLM decides what happens to them: the engine core aborts them (the
    # single-process-engine layout), or the API server lets the open streams
    # finish before it stops the engine (seen with the three-process layout).
    for root in roots:
        check_invariants(root)
        out = int(root.attrs[S.GEN_AI_OUTPUT_TOKENS])
        if root.attrs[S.FINISH_STATUS] == S.FINISH_ABORTED:
            assert 1 <= out < MAX_TOKENS
        else:
            assert root.attrs[S.FINISH_STATUS] == S.FINISH_LENGTH and out == MAX_TOKENS
    aborted = [r for r in roots if r.attrs[S.FINISH_STATUS] == S.FINISH_ABORTED]
    # vLLM's own count of the requests its shutdown aborted.
    log = server.log_path.read_text(errors="replace")
    m = re.search(r"aborting in-flight requests count=(\d+)", log)
    vllm_aborted = int(m.group(1)) if m else 0
    print(f"{layout}: SIGTERM, {n} streams open, vLLM aborted {vllm_aborted}, "
          f"exported aborted {len(aborted)}, shutdown {shutdown_s:.1f} s")  # fmt: skip
    assert vllm_aborted > 0, "precondition: requests still running at SIGTERM"
    assert len(aborted) == vllm_aborted
    assert shutdown_s < 45, shutdown_s
