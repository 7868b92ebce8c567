"""End to end through a real collector into a real backend.

`vllm serve` (plugin on) -> rotel collector (OTLP gRPC in, then OTLP/HTTP in) ->
Arize Phoenix (its own venv, 127.0.0.1 only) -> read back through Phoenix's REST
API. Phoenix routes spans to projects by the resource attribute
`openinference.project.name`, which we set through OTEL_RESOURCE_ATTRIBUTES.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from conftest import requires_vllm
from services import BACKEND_VENV, ROTEL, Phoenix, Rotel, VllmServer, wait_until
from trees import Node, check_invariants, expected_shape, journeys
from vllm_journey_otel import schema as S

pytestmark = [
    requires_vllm,
    pytest.mark.e2e,
    pytest.mark.skipif(
        ROTEL is None or not (BACKEND_VENV / "bin" / "python").exists(),
        reason="Phoenix/rotel venv missing (bash scripts/setup_backends.sh)",
    ),
]

ROOT = Path(__file__).resolve().parents[2]


class _Ctx:
    def __init__(self, trace_id: int, span_id: int) -> None:
        self.trace_id = trace_id
        self.span_id = span_id


class _Kind:
    name = "UNSPECIFIED"  # Phoenix keeps its own span kinds, not OTel's


def _ns(iso: str) -> int:
    dt = datetime.fromisoformat(iso)
    return int(dt.timestamp()) * 1_000_000_000 + dt.microsecond * 1000


class PhoenixSpan:
    """A span read back from Phoenix, with the attributes tests/trees.py reads."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.name = d["name"]
        # Phoenix adds attributes it derives (llm.token_count.*, llm.finish_reason,
        # ...); compare only what we sent.
        self.attributes = {
            k: tuple(v) if isinstance(v, list) else v
            for k, v in d["attributes"].items()
            if k.startswith(("vllm.", "gen_ai."))
        }
        self.start_time = _ns(d["start_time"])
        self.end_time = _ns(d["end_time"])
        trace_id = int(d["context"]["trace_id"], 16)
        self.context = _Ctx(trace_id, int(d["context"]["span_id"], 16))
        self.parent = _Ctx(trace_id, int(d["parent_id"], 16)) if d.get("parent_id") else None
        self.kind = _Kind()


# Each protocol through the collector, from a server of its own layout.
SERVED = {"grpc": "3proc", "http/protobuf": "2proc"}


def _server(model_dir: Path, tmp: Path, rotel: Rotel, protocol: str) -> tuple[VllmServer, str]:
    """A server exporting over ``protocol`` to rotel, into a Phoenix project of
    its own (started, not yet ready), and the project's name."""
    project = f"vjo-{protocol.split('/')[0]}-{random.getrandbits(24):06x}"
    endpoint = (
        f"http://127.0.0.1:{rotel.grpc_port}"
        if protocol == "grpc"
        else f"http://127.0.0.1:{rotel.http_port}/v1/traces"
    )
    layout = SERVED[protocol]
    server = VllmServer(
        model_dir,
        tmp / f"vllm-{layout}.log",
        {
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol,
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
            "OTEL_RESOURCE_ATTRIBUTES": f"openinference.project.name={project}",
        },
        multiprocessing=layout == "3proc",
    )
    return server, project


@pytest.fixture(scope="module")
def backend(  # type: ignore[no-untyped-def]
    model_dir, tmp_path_factory
) -> Iterator[tuple[Phoenix, dict[str, tuple[VllmServer, str]]]]:
    """Phoenix behind rotel, and a server per protocol exporting to rotel, all
    started together (a start is mostly one process importing on one CPU; rotel
    needs no backend to start). Each test stops its own server."""
    tmp = tmp_path_factory.mktemp("backend")
    started: list[Any] = []
    try:
        phoenix = Phoenix(tmp / "phoenix", tmp / "phoenix.log")
        started.append(phoenix)
        rotel = Rotel(f"http://127.0.0.1:{phoenix.grpc_port}", tmp / "rotel.log", tmp / "rotel.pid")
        started.append(rotel)
        servers = {}
        for protocol in SERVED:
            servers[protocol] = _server(model_dir, tmp, rotel, protocol)
            started.append(servers[protocol][0])
        phoenix.wait_ready()
        rotel.wait_ready()
        for server, _ in servers.values():
            server.wait_ready()
        yield phoenix, servers
    finally:
        for process in reversed(started):  # the servers, then rotel, then Phoenix
            process.stop()


@pytest.mark.parametrize("protocol", list(SERVED))
def test_through_rotel_into_phoenix(backend, protocol) -> None:  # type: ignore[no-untyped-def]
    import openai

    phoenix, servers = backend
    server, project = servers[protocol]
    trace_id = random.getrandbits(128) | 1
    span_id = random.getrandbits(64) | 1
    try:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        usages = []
        for i in range(3):
            r = c.completions.create(
                model=server.model, prompt=f"into phoenix {i}", max_tokens=6 + i,
                extra_headers={"traceparent": f"00-{trace_id:032x}-{span_id:016x}-01"},
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            usages.append(r.usage)
        chat = c.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    finally:
        server.stop()

    def received() -> dict[str, Node]:
        spans = [PhoenixSpan(d) for d in phoenix.spans(project)]
        found = journeys(s for s in spans if s.name in S.SPAN_NAMES)  # type: ignore[misc]
        # The API server's spans come from its own exporter: wait for them too.
        return found if len(found) == 4 and all(r.api for r in found.values()) else {}

    roots = wait_until(received, 60, 0.5, f"4 journeys in Phoenix project {project}")
    traced = sorted(
        (r for r in roots.values() if r.span.context.trace_id == trace_id),
        key=lambda r: r.start,
    )
    assert len(traced) == 3
    for root, usage in zip(traced, usages, strict=True):
        check_invariants(root, check_kind=False)
        assert root.shape() == expected_shape("PD")
        # Under the API server's span (on by default), itself under the client's.
        assert root.api is not None and root.api.span.parent is not None
        assert root.api.span.parent.span_id == span_id
        assert root.span.parent is not None
        assert root.span.parent.span_id == root.api.span.context.span_id
        assert root.attrs[S.GEN_AI_INPUT_TOKENS] == usage.prompt_tokens
        assert root.attrs[S.GEN_AI_OUTPUT_TOKENS] == usage.completion_tokens
    (untraced,) = [r for r in roots.values() if r.span.context.trace_id != trace_id]
    check_invariants(untraced, check_kind=False)
    # Its own trace: the API server's span is its root.
    assert untraced.api is not None and untraced.api.span.parent is None
    assert untraced.attrs[S.GEN_AI_OUTPUT_TOKENS] == chat.usage.completion_tokens
