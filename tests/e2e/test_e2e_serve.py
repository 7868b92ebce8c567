"""End to end: a real `vllm serve` with the plugin, a real OpenAI client, spans
received over real OTLP by an in-test module_receiver (opentelemetry-proto's generated
gRPC service), in both process layouts.

What cannot run here and is covered elsewhere: the GPU defaults (async
scheduling, the V2 model runner) do not run in a CPU `vllm serve`; the
scheduler-level tests drive AsyncScheduler and the V2 resume path instead.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from conftest import requires_vllm
from otlp_receiver import Receiver, WireSpan, wire_spans
from services import VllmServer, metric_value, wait_until
from serving import (
    LAYOUTS,
    assert_parented,
    client,
    journeys_in_trace,
    new_server,
    new_traceparent,
    post_together,
    start_servers,
    start_together,
)
from trees import check_invariants, expected_shape
from vllm_journey_otel import schema as S
from vllm_journey_otel.export.cpu_placement import format_cpus, usable_cpus

pytestmark = [requires_vllm, pytest.mark.e2e]


# Each layout once: the default three processes with the defaults (API-server
# spans on), two processes with the API-server spans off (the engine's root is
# then the SERVER span). tests/e2e/test_e2e_api_server.py serves both layouts
# with them on.
SERVED = [("3proc", True), ("2proc", False)]


@pytest.fixture(scope="module")
def served(model_dir, module_receiver, tmp_path_factory) -> Iterator[dict[str, VllmServer]]:  # type: ignore[no-untyped-def]
    """Both servers of SERVED, started together, by layout."""
    tmp = tmp_path_factory.mktemp("serve")

    def make(layout: str, api_spans: bool) -> VllmServer:
        s = new_server(model_dir, tmp, module_receiver, layout, api_spans=api_spans)
        s.layout = layout  # type: ignore[attr-defined]
        s.api_spans = api_spans  # type: ignore[attr-defined]
        return s

    assert len({layout for layout, _ in SERVED}) == len(SERVED), "one server per layout"
    servers = start_together(
        {layout: functools.partial(make, layout, api_spans) for layout, api_spans in SERVED}
    )
    yield servers
    for s in servers.values():
        s.stop()


# Module-scoped: pytest runs each server's tests together, as for one server.
@pytest.fixture(scope="module", params=SERVED, ids=["3proc-default", "2proc-api-spans-off"])
def server(request, served) -> VllmServer:  # type: ignore[no-untyped-def]
    return served[request.param[0]]  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------
def test_completion(server, module_receiver) -> None:  # type: ignore[no-untyped-def]
    tp, trace_id, span_id = new_traceparent()
    resp = client(server).completions.create(
        model=server.model, prompt="the scheduler runs a request", max_tokens=12,
        extra_headers={"traceparent": tp, "tracestate": "client=e2e"},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    (root,) = journeys_in_trace(module_receiver, trace_id)
    check_invariants(root)
    assert_parented(root, trace_id, span_id)
    assert root.shape() == expected_shape("PD")
    a = root.attrs
    assert a[S.GEN_AI_INPUT_TOKENS] == resp.usage.prompt_tokens
    assert a[S.GEN_AI_OUTPUT_TOKENS] == resp.usage.completion_tokens == 12
    assert a[S.GEN_AI_MAX_TOKENS] == 12
    assert a[S.FINISH_STATUS] == S.FINISH_LENGTH
    assert a[S.GEN_AI_FINISH_REASONS] == (resp.choices[0].finish_reason,)
    for key in (S.QUEUED_MS, S.TTFT_MS, S.PREFILL_MS, S.DECODE_MS):
        assert a[key] >= 0.0
    res = root.span.resource  # type: ignore[attr-defined]
    assert res[S.RES_SERVICE_NAME] == "vllm"
    assert res[S.RES_MODEL] == server.model
    assert res[S.RES_PLUGIN_VERSION]
    # The engine core exports, from its own process, in both layouts.
    assert res[S.RES_PID] != server.pid
    # Epoch clock: within the last minute of wall time.
    assert abs(root.start - time.time_ns()) < 60e9


def test_chat(server, module_receiver) -> None:  # type: ignore[no-untyped-def]
    tp, trace_id, span_id = new_traceparent()
    resp = client(server).chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hello engine"}],
        max_tokens=7, extra_headers={"traceparent": tp}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    (root,) = journeys_in_trace(module_receiver, trace_id)
    check_invariants(root)
    assert_parented(root, trace_id, span_id)
    assert root.attrs[S.GEN_AI_INPUT_TOKENS] == resp.usage.prompt_tokens
    assert root.attrs[S.GEN_AI_OUTPUT_TOKENS] == resp.usage.completion_tokens == 7


def test_streaming(server, module_receiver) -> None:  # type: ignore[no-untyped-def]
    tp, trace_id, _ = new_traceparent()
    stream = client(server).completions.create(
        model=server.model, prompt="stream me", max_tokens=20, stream=True,
        stream_options={"include_usage": True}, extra_headers={"traceparent": tp},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    usage = None
    chunks = 0
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and chunks > 1
    (root,) = journeys_in_trace(module_receiver, trace_id)
    check_invariants(root)
    assert root.attrs[S.GEN_AI_INPUT_TOKENS] == usage.prompt_tokens
    assert root.attrs[S.GEN_AI_OUTPUT_TOKENS] == usage.completion_tokens == 20


def test_n2_two_journeys_in_one_trace(server, module_receiver) -> None:  # type: ignore[no-untyped-def]
    tp, trace_id, span_id = new_traceparent()
    resp = client(server).completions.create(
        model=server.model, prompt="two answers please", max_tokens=5, n=2, seed=7,
        extra_headers={"traceparent": tp}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    roots = journeys_in_trace(module_receiver, trace_id, count=2)
    assert len(roots) == 2
    assert len({r.attrs[S.REQUEST_ID] for r in roots}) == 2
    for root in roots:
        check_invariants(root)
        assert_parented(root, trace_id, span_id)
        assert root.attrs[S.GEN_AI_INPUT_TOKENS] == resp.usage.prompt_tokens
    assert sum(r.attrs[S.GEN_AI_OUTPUT_TOKENS] for r in roots) == resp.usage.completion_tokens == 10


def test_without_traceparent_is_its_own_trace(server, module_receiver) -> None:  # type: ignore[no-untyped-def]
    before = {s.context.trace_id for s in wire_spans(module_receiver)}
    marker = f"untraced-{random.getrandbits(32)}"
    resp = client(server).completions.create(
        model=server.model, prompt="no trace context", max_tokens=3, user=marker,
        extra_body={"ignore_eos": True},
    )  # fmt: skip

    # This request's root (the module's other server shares the receiver): vLLM
    # 0.32's engine request id starts with the response's id (then the prompt's
    # index and a random suffix: cmpl-<id>-0-<8 chars>; this request has n=1).
    def new_roots() -> list[WireSpan]:
        return [
            s for s in wire_spans(module_receiver)
            if s.name == S.SPAN_REQUEST and s.context.trace_id not in before
            and str(s.attributes.get(S.REQUEST_ID, "")).startswith(resp.id)
        ]  # fmt: skip

    (root,) = wait_until(new_roots, 30, 0.2, "a new root")
    assert root.attributes[S.GEN_AI_OUTPUT_TOKENS] == 3
    if not server.api_spans:
        assert root.parent is None
        return
    # The API server's span is the new trace's root; the engine's hangs under it.
    assert root.parent is not None

    def api_root() -> list[WireSpan]:
        return [s for s in wire_spans(module_receiver)
                if s.name == S.SPAN_API and s.context.span_id == root.parent.span_id]  # fmt: skip

    (api,) = wait_until(api_root, 30, 0.2, "the API server's span")
    assert api.parent is None and api.context.trace_id == root.context.trace_id


def test_client_disconnect_mid_stream_aborts(server, module_receiver) -> None:  # type: ignore[no-untyped-def]
    import httpx

    # The tiny model decodes a token in about a millisecond, so the engine can
    # race to max_tokens before the API server has noticed the disconnect (seen
    # once in CI on a loaded machine). That race is vLLM's, not ours: each
    # attempt's journey must be consistent either way, and at least one of
    # five must show the abort.
    max_tokens = 2000  # the longest the server's --max-model-len 2048 allows
    statuses = []
    for _attempt in range(5):
        tp, trace_id, _ = new_traceparent()
        body = {
            "model": server.model, "prompt": "a long answer", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True,
        }  # fmt: skip
        with (
            httpx.Client(timeout=60) as http,
            http.stream(
                "POST", server.url + "/v1/completions", json=body, headers={"traceparent": tp}
            ) as r,
        ):
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got += 1
                if got >= 3:
                    break  # leave the with-block: the connection closes mid-stream
        (root,) = journeys_in_trace(module_receiver, trace_id, timeout=60)
        check_invariants(root)
        assert root.shape() == expected_shape("PD")
        status = root.attrs[S.FINISH_STATUS]
        statuses.append(status)
        if status == S.FINISH_ABORTED:
            assert 3 <= root.attrs[S.GEN_AI_OUTPUT_TOKENS] < max_tokens
            break
        assert status == S.FINISH_LENGTH, status
        assert root.attrs[S.GEN_AI_OUTPUT_TOKENS] == max_tokens
    assert statuses[-1] == S.FINISH_ABORTED, f"no attempt was aborted: {statuses}"


def test_too_long_prompt_is_rejected_without_a_journey(server, module_receiver) -> None:  # type: ignore[no-untyped-def]
    import openai

    tp, trace_id, _ = new_traceparent()
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(
            model=server.model, prompt="engine " * 3000, max_tokens=5,
            extra_headers={"traceparent": tp},
        )  # fmt: skip
    # A request sent after it arrives; the rejected one never reached the scheduler.
    tp2, trace2, _ = new_traceparent()
    client(server).completions.create(
        model=server.model, prompt="after", max_tokens=2, extra_headers={"traceparent": tp2}
    )
    journeys_in_trace(module_receiver, trace2)
    time.sleep(0.5)
    spans = [s for s in wire_spans(module_receiver) if s.context.trace_id == trace_id]
    # No engine journey; with the API server's spans, its span says it was turned away.
    assert [s.name for s in spans] == ([S.SPAN_API, S.SPAN_API_INPUT] if server.api_spans else [])
    for s in spans:
        if s.name == S.SPAN_API:
            assert s.attributes[S.HTTP_STATUS] == 400 and s.attributes[S.ERROR_TYPE] == "400"


# ---------------------------------------------------------------------------
# Where the exporters run
# ---------------------------------------------------------------------------
def _exporters_of(owners: set[int]) -> dict[int, int]:
    """Our exporter processes whose records come from one of ``owners``, and
    that owner (detached: not in the server's process tree; the resource in
    its argv names its owner)."""
    found = {}
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        # cmd[1:3], not anywhere: the short-lived launcher's argv holds the same words.
        if cmd[1:3] == ["-m", "vllm_journey_otel.export.exporter_process"] and len(cmd) > 3:
            owner = json.loads(cmd[3]).get(S.RES_PID)
            if owner in owners:
                found[p.pid] = owner
    return found


def _thread_cpus(pid: int) -> dict[int, frozenset[int]]:
    """Each thread's CPUs (threads that end while read are left out)."""
    cpus = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            cpus[int(tid)] = frozenset(os.sched_getaffinity(int(tid)))
    return cpus


def test_exporters_run_off_the_cpus_vllm_binds(server) -> None:  # type: ignore[no-untyped-def]
    """Every thread of the server's exporters runs off the CPUs that vLLM's
    threads are bound to (its CPU backend binds the model worker's OpenMP
    threads), on every other CPU, and the log says so; where vLLM's threads
    are bound to every CPU, on the CPUs of the owner that started it."""
    root = psutil.Process(server.pid)
    tree = {server.pid, *(child.pid for child in root.children(recursive=True))}
    allowed = frozenset(usable_cpus())  # what the exporters may use (and this process)
    bound: set[int] = set()
    for pid in tree:
        with contextlib.suppress(FileNotFoundError):
            bound.update(*(c for c in _thread_cpus(pid).values() if c != allowed))
    # vLLM's CPU backend binds the threads of a worker process of its own (the
    # three-process layout); a worker in the API server's process binds none.
    assert bool(bound) == (server.layout == "3proc"), bound
    exporters = _exporters_of(tree)
    assert len(exporters) == (2 if server.api_spans else 1), exporters  # engine core, API server
    rest = allowed - bound if bound else allowed

    def expected(exporter: int) -> frozenset[int]:
        return rest or _thread_cpus(exporters[exporter])[exporters[exporter]]

    def placed() -> bool:  # the exporter places itself at start and re-checks after 5 s
        return all(set(_thread_cpus(pid).values()) == {expected(pid)} for pid in exporters)

    wait_until(placed, 40, 0.5, f"every exporter thread off CPUs {sorted(bound)}")
    # Its placement at start ("CPU priority ...; CPUs ..."), then any move ("now on ...").
    said = ("journey-otel exporter: CPU priority", "journey-otel exporter: now on")
    lines = [line for line in server.tail(100_000).splitlines() if any(w in line for w in said)]
    for pid in exporters:
        where = f"CPUs {format_cpus(rest)}, off {format_cpus(bound)} where vLLM's threads are bound"
        if not bound:
            where = f"every CPU it may use, {format_cpus(allowed)} (vLLM binds no thread)"
        elif not rest:
            where = f"its CPUs as inherited, {format_cpus(expected(pid))}: vLLM's threads are bound"
        mine = [line for line in lines if line.startswith(f"(journey-otel exporter pid={pid})")]
        assert mine and where in mine[-1], (where, lines)


# ---------------------------------------------------------------------------
# Preemption, then a graceful SIGTERM: a tiny KV cache, 32 concurrent
# 256-token requests, and a 30 s batch delay (without the shutdown flush their
# spans would still be queued at the end)
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def preempting(model_dir, module_receiver, tmp_path_factory) -> Iterator[dict[str, VllmServer]]:  # type: ignore[no-untyped-def]
    """Both layouts with a tiny KV cache and a long batch delay, started
    together (each test stops its own)."""
    servers = start_servers(
        model_dir, tmp_path_factory.mktemp("preempting"), module_receiver, LAYOUTS,
        max_model_len=512, kv_cache_bytes="1M", env={"OTEL_BSP_SCHEDULE_DELAY": "30000"},
    )  # fmt: skip
    yield servers
    for server in servers.values():
        server.stop()


LONG_TOKENS = 480  # within --max-model-len 512


class _InFlight(threading.Thread):
    """A streamed request for the test to SIGTERM the server under (vLLM aborts
    it, or it ends before the abort reaches it). :meth:`begin` returns once its
    first chunk came (it is decoding then); :meth:`how` says how it ended."""

    def __init__(self, server: VllmServer, tp: str) -> None:
        super().__init__(daemon=True)
        self.server, self.tp = server, tp
        self.chunks = 0
        self.error: BaseException | None = None
        self.started = threading.Event()  # its first chunk came, or it ended before one

    def run(self) -> None:
        # A short client timeout: vLLM's API server waits for open connections
        # before it exits, and this request's engine core is gone.
        try:
            for _ in client(self.server).with_options(timeout=4.0).completions.create(
                model=self.server.model, prompt="in flight at shutdown", max_tokens=LONG_TOKENS,
                stream=True, extra_headers={"traceparent": self.tp},
                extra_body={"ignore_eos": True},
            ):  # fmt: skip
                self.chunks += 1
                self.started.set()
        except Exception as exc:  # the SIGTERM, as intended (before a chunk: begin() fails)
            self.error = exc
        finally:
            self.started.set()

    def begin(self) -> _InFlight:
        self.start()
        assert self.started.wait(30), "the long request's first chunk"
        assert self.chunks, f"the long request failed before its first chunk: {self.how()}"
        return self

    def how(self) -> str:
        return (
            f"{self.chunks} chunks, then {self.error!r}" if self.error else f"{self.chunks} chunks"
        )


def _engine_roots(receiver: Receiver, trace_id: int) -> int:
    return sum(
        1
        for s in wire_spans(receiver)
        if s.name == S.SPAN_REQUEST and s.context.trace_id == trace_id
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forced_preemption_then_sigterm_loses_nothing(  # type: ignore[no-untyped-def]
    preempting, module_receiver, layout: str
) -> None:
    """Every preemption vLLM counts is a span; every journey finished before a
    SIGTERM arrives (the shutdown flushes them), the one in flight as aborted."""
    server = preempting[layout]
    tp, trace_id, span_id = new_traceparent()
    try:
        # Sent as one burst (by one thread), so that they need the KV cache at once.
        bodies = [
            {"model": server.model, "prompt": f"request {i} " * 8, "max_tokens": 256,
             "ignore_eos": True}
            for i in range(32)
        ]  # fmt: skip
        results = post_together(server, bodies, {"traceparent": tp})
        preempted_total = metric_value(server.metrics(), "vllm:num_preemptions_total")
        before = _engine_roots(module_receiver, trace_id)
        # The SIGTERM right after the long request's first chunk: it has 479 to go.
        long_request = _InFlight(server, tp).begin()
        assert long_request.is_alive(), (
            f"precondition: in flight at the SIGTERM ({long_request.how()})"
        )
        server.signal(signal.SIGTERM)
        server.proc.wait(timeout=60)
        long_request.join(10)
    finally:
        server.stop()
    # The batch delay runs from the oldest span waiting: none had left by then.
    assert before == 0, f"precondition: journeys still queued at the SIGTERM ({before} left)"
    # Well inside the 30 s batch delay: only the shutdown's flush can have sent them.
    roots = journeys_in_trace(module_receiver, trace_id, count=33, timeout=20)
    assert sum(r["usage"]["completion_tokens"] for r in results) == 32 * 256
    short = [r for r in roots if r.attrs[S.GEN_AI_MAX_TOKENS] == 256]
    assert len(short) == 32
    spans_preempted = sum(len(r.kids(S.SPAN_PREEMPTED)) for r in short)
    assert preempted_total > 0, "precondition: the KV cache forced preemptions"
    assert spans_preempted == preempted_total
    assert sum(r.attrs[S.NUM_PREEMPTIONS] for r in short) == preempted_total
    for root in short:
        assert root.attrs[S.GEN_AI_OUTPUT_TOKENS] == 256
        assert root.attrs[S.FINISH_STATUS] == S.FINISH_LENGTH
        for p in root.kids(S.SPAN_PREEMPTED):
            assert 0.0 < p.attrs[S.KV_CACHE_USAGE] <= 1.0
        for c_ in root.kids(S.SPAN_SCHEDULED)[1:]:
            assert c_.attrs[S.SCHEDULE_KIND] == S.SCHEDULE_RESUME
    # The long request was aborted by the shutdown (the plugin's shutdown grace
    # lets the engine core abort it before vLLM's SIGKILL), unless it ended
    # before the abort reached the engine core.
    long = [r for r in roots if r.attrs[S.GEN_AI_MAX_TOKENS] == LONG_TOKENS]
    assert len(long) == 1 and len(roots) == 33
    assert {r.attrs[S.FINISH_STATUS] for r in long} <= {S.FINISH_ABORTED, S.FINISH_LENGTH}
    for root in roots:
        check_invariants(root)
        assert_parented(root, trace_id, span_id)
    print(f"{layout}: {preempted_total:.0f} preemptions; {before} of 32 journeys exported "
          f"before the SIGTERM, all 32 after; the one in flight: "
          f"{long[0].attrs[S.FINISH_STATUS]}")  # fmt: skip
