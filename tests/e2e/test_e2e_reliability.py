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

import contextlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import pytest

from bad_input import send_bad_input
from conftest import requires_vllm
from fault_proxy import BLACKHOLE, DOWN, FORWARD, FaultProxy
from otlp_receiver import Receiver, running_receiver, wire_spans
from services import VllmServer, metric_value, wait_until
from serving import client, journeys_in_trace, new_server, new_traceparent, start_together
from trees import check_invariants
from vllm_journey_otel import schema as S

pytestmark = [requires_vllm, pytest.mark.e2e]

# Long enough that every request is still decoding when the SIGTERM lands.
MAX_TOKENS = 4000

ROOT = Path(__file__).resolve().parents[2]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _exporter_pids(endpoint: str, not_for: int | None = None) -> list[int]:
    """Our exporter processes sending to ``endpoint`` (detached: not the server's
    children); ``not_for``: leave out the one whose resource is that process's (the
    API server's own exporter, when the API server is ``not_for``)."""
    pids = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        cmd = p.info.get("cmdline") or []
        env = p.info.get("environ") or {}
        # cmd[1:3], not anywhere: the short-lived launcher's argv holds the same words.
        if cmd[1:3] == ["-m", "vllm_journey_otel.export.exporter_process"] and (
            env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == endpoint
        ):
            resource = json.loads(cmd[3]) if len(cmd) > 3 else {}
            if not_for is None or resource.get(S.RES_PID) != not_for:
                pids.append(p.pid)
    return pids


class Served(NamedTuple):
    server: VllmServer
    receiver: Receiver


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory) -> Iterator[dict[str, Any]]:  # type: ignore[no-untyped-def]
    """Every server of this module, started together (a start is mostly one
    process importing vLLM on one CPU: the tests' single starts overlap on two
    CPUs), each exporting to a receiver of its own (the killed-exporter test
    finds its exporters by their endpoint). The backend-faults server exports
    through a proxy that is down from the start; ``reference`` is a plugin-off
    server for that test. Each test stops its own servers; the rest stop here.
    Four servers (eleven vLLM processes) are up at once: about 6 GiB here."""
    with contextlib.ExitStack() as stack:
        rx = {
            name: stack.enter_context(contextlib.contextmanager(running_receiver)())
            for name in ("sigterm", "faults", "killed")
        }
        proxy = FaultProxy(rx["faults"].grpc_port)
        stack.callback(proxy.close)
        proxy.set_mode(DOWN)  # the backend is down from the start
        tmp = {name: tmp_path_factory.mktemp(name) for name in ("sigterm", "faults", "killed")}
        # vLLM's defaults for SIGTERM: --shutdown-timeout 0 (abort in-flight
        # requests at once). One request at a time: at the SIGTERM one is
        # decoding and the others are queued, whatever the speed of this machine.
        makers = {
            "sigterm": lambda: new_server(
                model_dir, tmp["sigterm"], rx["sigterm"], "2proc", max_model_len=4096,
                args=["--max-num-seqs", "1"],
            ),
            "faults": lambda: new_server(
                model_dir, tmp["faults"], rx["faults"], "3proc",
                env={
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{proxy.port}",
                    "OTEL_EXPORTER_OTLP_TIMEOUT": "3",
                    "VLLM_JOURNEY_OTEL_QUEUE_SIZE": "lots",  # a bad value: warned, default used
                },
            ),
            "reference": lambda: VllmServer(
                model_dir, tmp["faults"] / "vllm-off.log", {"VLLM_JOURNEY_OTEL": "0"}
            ),
            "killed": lambda: new_server(model_dir, tmp["killed"], rx["killed"], "3proc"),
        }  # fmt: skip
        servers = start_together(makers)
        try:
            yield {
                "sigterm": Served(servers["sigterm"], rx["sigterm"]),
                "faults": Served(servers["faults"], rx["faults"]),
                "reference": servers["reference"],
                "proxy": proxy,
                "killed": Served(servers["killed"], rx["killed"]),
            }
        finally:
            for server in servers.values():
                server.stop()


# ---------------------------------------------------------------------------
# SIGTERM with requests in flight
# ---------------------------------------------------------------------------
# The single-engine-process layout only: in the three-process layout the timing of
# what reaches the engine before the SIGTERM varied too much between runs here
# (once only 3 of the 8 requests had reached it); measured there by hand, see
# docs/reliability.md. test_e2e_serve.py's SIGTERM test covers both layouts.
def test_sigterm_with_requests_in_flight_exports_them_aborted(served) -> None:  # type: ignore[no-untyped-def]
    import httpx

    # 8 x 4,000 tokens one after the other (--max-num-seqs 1) take far longer
    # than the test waits: at the SIGTERM one decodes and the others are queued.
    server, receiver = served["sigterm"]
    layout = "2proc"
    tp, trace_id, _ = new_traceparent()
    n = 8

    def request(i: int) -> None:
        body = {
            "model": server.model, "prompt": f"in flight {i}", "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
        }  # fmt: skip
        # Not streamed: the client threads sit idle (no per-token work competing
        # with the in-test receiver for this process's GIL). A short timeout: if
        # the engine core dies without telling the API server, uvicorn waits
        # for the open connections before it exits.
        with contextlib.suppress(httpx.HTTPError):  # the server goes away under it
            httpx.post(
                server.url + "/v1/completions", json=body,
                headers={"traceparent": tp}, timeout=15,
            )  # fmt: skip

    def in_engine() -> bool:
        # One decoding and more queued behind it. Not "all n": on a fast run the
        # first request can finish before the last is admitted, and waiting for
        # all n then ran into the clients' 15 s timeout, which aborted the queued
        # requests before the SIGTERM (nothing left in flight to test).
        try:
            text = server.metrics()
            return (
                metric_value(text, "vllm:num_requests_running") >= 1
                and metric_value(text, "vllm:num_requests_waiting") >= 2
            )
        except (OSError, KeyError):
            return False

    threads = [threading.Thread(target=request, args=(i,), daemon=True) for i in range(n)]
    try:
        for t in threads:
            t.start()
        # vLLM's own gauges: requests running and queued in the engine. They can
        # lag; the assertions below use vLLM's own abort count anyway.
        with contextlib.suppress(TimeoutError):
            wait_until(in_engine, 20, 0.05, "requests in the engine")
        t0 = time.monotonic()
        server.signal(signal.SIGTERM)
        server.proc.wait(timeout=120)
        shutdown_s = time.monotonic() - t0
    finally:
        server.stop()
    for t in threads:
        t.join(20)
    # vLLM's own count of the requests its shutdown aborted.
    log = server.log_path.read_text(errors="replace")
    m = re.search(r"aborting in-flight requests count=(\d+)", log)
    vllm_aborted = int(m.group(1)) if m else 0
    assert vllm_aborted > 0, "precondition: requests still in the engine at SIGTERM"
    roots = journeys_in_trace(receiver, trace_id, count=vllm_aborted, timeout=30)
    time.sleep(1.0)  # and any that finished before the SIGTERM
    roots = journeys_in_trace(receiver, trace_id, count=vllm_aborted, timeout=30)
    # Every request vLLM aborted is exported as aborted; any that finished before
    # the SIGTERM is exported as finished.
    for root in roots:
        check_invariants(root)
        out = int(root.attrs[S.GEN_AI_OUTPUT_TOKENS])
        if root.attrs[S.FINISH_STATUS] == S.FINISH_ABORTED:
            assert 0 <= out < MAX_TOKENS  # 0: aborted while still queued
        else:
            assert root.attrs[S.FINISH_STATUS] == S.FINISH_LENGTH and out == MAX_TOKENS
    aborted = [r for r in roots if r.attrs[S.FINISH_STATUS] == S.FINISH_ABORTED]
    print(f"{layout}: SIGTERM, {n} requests sent, vLLM aborted {vllm_aborted}, "
          f"exported aborted {len(aborted)}, shutdown {shutdown_s:.1f} s")  # fmt: skip
    assert len(aborted) == vllm_aborted


# ---------------------------------------------------------------------------
# Backend faults, outputs unchanged, bad input, nothing leaked
# ---------------------------------------------------------------------------
PROMPTS = [f"reliability check number {i}: " + "word " * (3 * i) for i in range(5)]
SECRET = "zebra-pineapple-7731"  # in a prompt: must never leave the process


def _token_ids(server: VllmServer, headers: dict[str, str] | None = None) -> list[list[int]]:
    """A fixed greedy workload, one request at a time (batch-invariant outputs)."""
    c = client(server)
    out = []
    for p in PROMPTS:
        r = c.completions.create(
            model=server.model, prompt=p, max_tokens=12, temperature=0.0, seed=0,
            extra_headers=headers or {},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        choice = r.choices[0]
        ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids")
        assert ids and len(ids) == 12
        out.append(list(ids))
    return out


def _listening(pids: list[int]) -> list[tuple[str, int]]:
    found = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            conns = proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        found += [(proc.name(), c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def _tree(server: VllmServer) -> list[int]:
    root = psutil.Process(server.pid)
    return [root.pid, *(p.pid for p in root.children(recursive=True))]


def _our_deadlines(server: VllmServer) -> int:
    """Our exporters' lines that report an export that ran out of time (vLLM's
    own tracer logs to the same file, without our prefix)."""
    return sum(
        1
        for line in server.log_path.read_text(errors="replace").splitlines()
        if line.startswith("(journey-otel exporter") and "fails (" in line
        and "DEADLINE_EXCEEDED" in line
    )  # fmt: skip


def _fault_phases(
    server: VllmServer, receiver: Receiver, proxy: FaultProxy
) -> dict[str, list[list[int]]]:
    """The workload in each phase of the backend's troubles, in order; each
    phase's token ids. The proxy is down when this starts."""
    outputs: dict[str, list[list[int]]] = {}
    phase_traces: dict[str, int] = {}

    def phase(name: str) -> None:
        tp, trace_id, _ = new_traceparent()
        phase_traces[name] = trace_id
        outputs[name] = _token_ids(server, {"traceparent": tp})
        assert server.alive(), f"vllm serve died in phase {name}"

    def arrived(name: str, timeout: float = 30) -> None:
        journeys_in_trace(receiver, phase_traces[name], count=len(PROMPTS), timeout=timeout)

    phase("down")
    proxy.set_mode(FORWARD)
    phase("recovered")
    arrived("recovered")

    # Slow: answers after 0.5 s, well inside the 3 s timeout (the exporters
    # run at SCHED_IDLE: on a loaded machine an answer can reach them late).
    receiver.delay_s = 0.5
    phase("slow")
    arrived("slow")
    receiver.delay_s = 0.0

    port = receiver.grpc_port
    receiver.stop_grpc()  # the backend restarts
    phase("restarting")
    time.sleep(4)  # past the exporter's 3 s timeout: those exports fail
    receiver.start_grpc(port)
    phase("restarted")
    arrived("restarted")

    before = _our_deadlines(server)
    proxy.set_mode(BLACKHOLE)  # connections hang, nothing ever answers
    phase("blackhole")
    # Until an export into the hole has run out of time (3 s), however late it started.
    wait_until(
        lambda: _our_deadlines(server) > before, 60, 0.2, "an export into the hole to time out"
    )
    proxy.set_mode(FORWARD)
    phase("after")
    arrived("after")
    return outputs


def test_backend_faults_never_reach_serving(served) -> None:  # type: ignore[no-untyped-def]
    # The plugin-off server's outputs to match and ports to compare.
    reference, proxy = served["reference"], served["proxy"]
    server, receiver = served["faults"]
    try:
        expected = {"tokens": _token_ids(reference), "listening": _listening(_tree(reference))}
    finally:
        reference.stop()
    try:
        outputs = _fault_phases(server, receiver, proxy)
        # Bad input, on the recovered backend.
        bad = send_bad_input(server, receiver)
        # Nothing of ours listens: the exporter has no listening socket, and the
        # server's processes listen on as many ports as without the plugin.
        exporters = _exporter_pids(f"http://127.0.0.1:{proxy.port}")
        assert exporters, "the exporter process is running"
        assert _listening(exporters) == []
        assert len(_listening(_tree(server))) == len(expected["listening"])
        secret_root = _secret_request(server, receiver)
    finally:
        server.stop()

    for name, got in outputs.items():
        assert got == expected["tokens"], f"outputs changed in phase {name}"

    log = server.log_path.read_text(errors="replace")
    ours = [line for line in log.splitlines() if "journey-otel" in line]
    fails = [line for line in ours if "fails (" in line]
    # One warning per outage that cost spans, and one line when it is over. The
    # restart may cost nothing: the SDK's retries can span the restart.
    assert any("UNAVAILABLE" in line for line in fails), "\n".join(ours)  # down
    assert any("DEADLINE_EXCEEDED" in line for line in fails), "\n".join(ours)  # black hole
    # Per exporter process: the engine core's and the API server's each report.
    pids = {
        m.group(1)
        for line in fails
        if (m := re.match(r"\(journey-otel exporter pid=(\d+)\)", line))
    }
    assert pids, "\n".join(ours)
    for pid in pids:
        mine = [line for line in ours if line.startswith(f"(journey-otel exporter pid={pid})")]
        fails_here = [line for line in mine if "fails (" in line]
        assert len(fails_here) <= 3, "\n".join(ours)
        assert len([line for line in mine if "works again" in line]) == len(fails_here)
    # Not one line per retry, per dropped span, or per malformed client header,
    # from our exporter process (vLLM's own startup spans, exported to the same
    # endpoint by vLLM's tracer, log their retries without our prefix).
    exporter_lines = "\n".join(
        line for line in log.splitlines() if line.startswith("(journey-otel exporter")
    )
    for noise in ("Transient error", "Queue full", "w3c", "key/value pairs", "exceeds max"):
        assert noise not in exporter_lines, noise
    assert any("VLLM_JOURNEY_OTEL_QUEUE_SIZE='lots'" in line for line in log.splitlines())
    # No exception while serving. (At shutdown vLLM 0.32 sometimes logs an
    # EngineDeadError from its output handler when the engine core exits before
    # the kill: a race of its own shutdown, seen with and without the grace.)
    serving = log.split("[shutdown] API server: shutdown triggered", 1)[0]
    assert "Traceback" not in serving, "no exception while serving"
    assert "vllm_journey_otel" not in "".join(
        line for line in log.splitlines() if "Traceback" in line or 'File "' in line
    ), "no traceback through our code, ever"
    # Nothing of the prompt or the output in any span or in our log lines.
    for span in wire_spans(receiver):
        for value in span.attributes.values():
            assert SECRET not in str(value)
            assert not (isinstance(value, tuple) and value and isinstance(value[0], int))
    assert not [line for line in ours if SECRET in line]
    assert secret_root is not None
    print(f"faults: 4 kinds, 0 engine crashes, outputs identical in {len(outputs)} phases; "
          f"{bad} malformed inputs, 0 exceptions")  # fmt: skip


def _secret_request(server: VllmServer, receiver: Receiver) -> Any:
    tp, trace_id, _ = new_traceparent()
    client(server).completions.create(
        model=server.model, prompt=f"my password is {SECRET}", max_tokens=8,
        extra_headers={"traceparent": tp}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    (root,) = journeys_in_trace(receiver, trace_id)
    return root


# ---------------------------------------------------------------------------
# The exporter process killed while serving (as an OOM killer would)
# ---------------------------------------------------------------------------
def test_a_killed_exporter_is_replaced_while_serving(served) -> None:  # type: ignore[no-untyped-def]
    """Requests keep coming while the exporter is SIGKILLed; serving goes on, the
    engine core starts a new exporter, and the journeys of requests sent after
    it started arrive whole, their roots counting what was dropped meanwhile.
    The engine core's exporter (the API server, the main process in this
    layout, has one of its own)."""
    server, receiver = served["killed"]
    api_server = server.pid
    endpoint = f"http://127.0.0.1:{receiver.grpc_port}"
    stop = threading.Event()
    answered: list[int] = []
    errors: list[BaseException] = []

    def traffic() -> None:  # sequential, until stopped (bounded in time, not in count)
        c = client(server)
        deadline = time.monotonic() + 600
        i = 0
        while not stop.is_set() and time.monotonic() < deadline:
            i += 1
            try:
                r = c.completions.create(
                    model=server.model, prompt=f"during {i}", max_tokens=8,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                answered.append(r.usage.completion_tokens)
            except BaseException as exc:  # serving must go on: any failure fails the test
                errors.append(exc)
                return

    try:
        (old,) = wait_until(
            lambda: _exporter_pids(endpoint, not_for=api_server), 60, 0.2, "the exporter"
        )
        background = threading.Thread(target=traffic, daemon=True)
        background.start()
        wait_until(lambda: len(answered) >= 5, 120, 0.05, "traffic before the kill")
        os.kill(old, signal.SIGKILL)
        at_kill = len(answered)
        # Gone, or a zombie where nothing reaps detached processes (pid 1 of some containers).
        wait_until(lambda: _gone(old), 30, 0.05, "the killed exporter to die")
        new = wait_until(
            lambda: [p for p in _exporter_pids(endpoint, not_for=api_server) if p != old],
            60,
            0.1,
            "a new exporter",
        )
        try:
            wait_until(
                lambda: errors or len(answered) >= at_kill + 5, 120, 0.05, "traffic after it"
            )
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; answered {len(answered)}\n{server.tail(200)}") from exc
        assert not errors, f"{errors[0]!r}\n{server.tail(200)}"
        c = client(server)
        after = []
        for i in range(4):
            tp, trace_id, _ = new_traceparent()
            r = c.completions.create(
                model=server.model, prompt=f"after {i}", max_tokens=8,
                extra_headers={"traceparent": tp}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert r.usage.completion_tokens == 8
            after.append(trace_id)
        stop.set()
        background.join(120)
        roots = [journeys_in_trace(receiver, trace_id)[0] for trace_id in after]
    finally:
        stop.set()
        server.stop()
    assert not errors, errors[:1]
    assert answered and all(n == 8 for n in answered)
    for root in roots:
        check_invariants(root)
        assert root.attrs[S.FINISH_STATUS] == S.FINISH_LENGTH
    log = server.log_path.read_text(errors="replace")
    held = re.search(
        rf"exporter process {old} is gone \(0 left\); (\d+) journeys it had been sent were "
        r"lost with it \(counted in the next journeys' dropped_journeys\); a new one starts in",
        log,
    )
    assert held, server.tail()
    m = re.search(rf"exporter process {new[0]} started in place of a lost one; (\d+) journeys", log)
    assert m, server.tail()
    # What the dead exporter held and what was dropped while none ran are
    # counted on the roots exported after it.
    lost = int(held.group(1)) + int(m.group(1))
    assert all(int(r.attrs[S.TRACER_DROPPED_JOURNEYS]) >= lost for r in roots)  # type: ignore[call-overload]
