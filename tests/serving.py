"""A real `vllm serve` for the end-to-end tests, and reading its journeys back.

Helpers shared by the test modules under tests/e2e/ (they import this, never
each other).
"""

from __future__ import annotations

import functools
import http.client
import json
import random
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from otlp_receiver import Receiver, wire_spans
from services import VllmServer, wait_until
from trees import Node, journeys
from vllm_journey_otel import schema as S

# VLLM_ENABLE_V1_MULTIPROCESSING=0: API server + engine core (worker inside it);
# default: API server + engine core + worker.
LAYOUTS = ["2proc", "3proc"]
K = TypeVar("K")


def new_server(  # type: ignore[no-untyped-def]
    model_dir: Path, tmp: Path, receiver: Receiver, layout: str, api_spans: bool = True, **kw
) -> VllmServer:
    """:func:`start_server`'s server, started and not yet ready (see :func:`ready`)."""
    env = {
        **({} if api_spans else {"VLLM_JOURNEY_OTEL_API_SPANS": "0"}),
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{receiver.grpc_port}",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        **kw.pop("env", {}),
    }
    return VllmServer(
        model_dir, tmp / f"vllm-{layout}.log", env, multiprocessing=layout == "3proc", **kw
    )


def start_server(  # type: ignore[no-untyped-def]
    model_dir: Path, tmp: Path, receiver: Receiver, layout: str, api_spans: bool = True, **kw
) -> VllmServer:
    """A served tiny model exporting to ``receiver``, with the product's defaults
    unless a test is about another setting. ``api_spans`` False: the API server's
    vllm.api.* spans off (``VLLM_JOURNEY_OTEL_API_SPANS=0``), the engine's root
    is then the SERVER span; True leaves the variable unset (the default: on)."""
    return start_servers(model_dir, tmp, receiver, [layout], api_spans, **kw)[layout]


def start_servers(  # type: ignore[no-untyped-def]
    model_dir: Path,
    tmp: Path,
    receiver: Receiver,
    layouts: list[str],
    api_spans: bool = True,
    **kw,
) -> dict[str, VllmServer]:
    """One server per layout, as :func:`start_server` makes it, started
    together (:func:`start_together`). The caller stops them."""
    return start_together(
        {
            layout: functools.partial(new_server, model_dir, tmp, receiver, layout, api_spans, **kw)
            for layout in layouts
        }
    )


def start_together(makers: dict[K, Callable[[], VllmServer]]) -> dict[K, VllmServer]:
    """Each maker's server (:func:`new_server` or a VllmServer), started one
    after the other and then waited for together: a start is mostly one process
    importing vLLM on one CPU, so two starts overlap on this machine's two. A
    failed start or wait stops every server already started; otherwise the
    caller stops them."""
    servers: dict[K, VllmServer] = {}
    try:
        for key, make in makers.items():
            servers[key] = make()
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    ready(*servers.values())
    return servers


def ready(*servers: VllmServer) -> None:
    """Wait until every server answers /health; on a failure stop them all."""
    try:
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise


def client(server: VllmServer):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def new_traceparent() -> tuple[str, int, int]:
    trace_id = random.getrandbits(128) | 1
    span_id = random.getrandbits(64) | 1
    return f"00-{trace_id:032x}-{span_id:016x}-01", trace_id, span_id


def journeys_in_trace(
    receiver: Receiver, trace_id: int, count: int = 1, timeout: float = 30.0
) -> list[Node]:
    def found() -> list[Node]:
        ours = [
            s
            for s in wire_spans(receiver)
            if s.name in S.SPAN_NAMES and s.context.trace_id == trace_id
        ]
        roots = list(journeys(ours).values())  # type: ignore[arg-type]
        # An INTERNAL engine root hangs under the API server's span, exported by
        # the API server's own exporter process: wait for that too.
        whole = all(r.api is not None or r.span.kind.name == "SERVER" for r in roots)
        return roots if len(roots) >= count and whole else []

    return wait_until(found, timeout, 0.2, f"{count} journey(s) in trace {trace_id:032x}")  # type: ignore[no-any-return]


def assert_parented(root: Node, trace_id: int, span_id: int) -> None:
    """The journey is in the client's trace, under the client's span (through
    the API server's vllm.api.request when the API-server spans are on)."""
    parent = root.span.parent
    assert root.span.context.trace_id == trace_id
    if root.api is not None:
        assert parent is not None and parent.span_id == root.api.span.context.span_id
        assert root.api.span.context.trace_id == trace_id
        parent = root.api.span.parent
    assert parent is not None and parent.span_id == span_id


def _post(
    server: VllmServer, path: str, body: bytes, headers: Mapping[str, str]
) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json", **headers})
    except BaseException:
        conn.close()
        raise
    return conn


def post_together(
    server: VllmServer,
    bodies: Sequence[Mapping[str, Any]],
    headers: Mapping[str, str] | None = None,
    path: str = "/v1/completions",
) -> list[dict[str, Any]]:
    """Each body POSTed as JSON, all of them sent back to back by one thread,
    then the answers read (a pool of threads), in order.

    A burst sent from a thread per request need not arrive as one: a client's
    threads can sit off the CPU beside a busy server for seconds, and a burst
    spread over seconds hardly queues or preempts. A request whose connection
    the server dropped before answering (http.client's RemoteDisconnected: the
    API server never saw it) is sent once more; any other failure raises: a
    retry that doubled a request would double its journey."""
    sent = [json.dumps(body).encode() for body in bodies]
    extra = dict(headers or {})
    conns: list[http.client.HTTPConnection] = []

    def answer(i: int) -> dict[str, Any]:
        try:
            r = conns[i].getresponse()
        except http.client.RemoteDisconnected:
            conns[i].close()
            conns[i] = _post(server, path, sent[i], extra)
            r = conns[i].getresponse()
        text = r.read()
        assert r.status == 200, (r.status, text[:500])
        return dict(json.loads(text))

    try:
        conns.extend(_post(server, path, body, extra) for body in sent)
        with ThreadPoolExecutor(max(1, len(sent))) as pool:
            return list(pool.map(answer, range(len(sent))))
    finally:
        for conn in conns:
            conn.close()
