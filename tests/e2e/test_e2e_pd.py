"""Disaggregated prefill/decode, served for real: two `vllm serve` instances (a
prefill one, a decode one, each on its own CPU) with the plugin's defaults, and
a proxy between them (tests/pd_proxy.py) under OpenTelemetry's own FastAPI and
httpx instrumentations. The KV moves through tests/file_kv_connector.py, which
stands in for NIXL (NIXL needs its library and a GPU): whole blocks via files,
loaded before the forward (sync) or in the worker's background while the
request waits in WAITING_FOR_REMOTE_KVS (async), the prefill side keeping the
blocks until the decode side has read them (``delay_free_blocks``).

Every request through the proxy must be one trace: the proxy's span, under it
the prefill instance's API span and journey, then the decode instance's, in
time order, the decode journey linked to the prefill journey; and the KV really
moved (the decode instance's text equals its own local prefill's).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import urllib.error
from pathlib import Path
from typing import Any

import pytest

from conftest import requires_vllm
from otlp_receiver import ReceivedSpan
from pd_serving import BLOCK, PdServing
from services import http_json, wait_until
from serving import new_traceparent
from vllm_journey_otel import schema as S

pytestmark = [requires_vllm, pytest.mark.e2e]

# Long enough for several KV blocks (the CPU backend's default block is 128
# tokens; the servers below use 32). Each request prefixes it with its own words.
PROMPT = " ".join(f"word{i}" for i in range(150))
# The prefill side's hold on unread blocks: long enough that a loaded machine's
# decode side reads them first (a late read would find them freed: a 500).
LEASE_S = 8.0
# Our span times are converted from the monotonic clock (clock.py); the loads'
# stamps are the worker's wall clock. This machine's wall clock slews against the
# monotonic one in episodes (5,000 ppm measured), which the conversion follows
# only between its readings: 1.1 ms off was seen in two clean-clone runs.
SLACK_NS = 5_000_000


@pytest.fixture(scope="module")
def pd(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, module_receiver: Any):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("pd")
    # Both instances' exporters also write one trace file (the tools' input).
    env = {
        "OTEL_TRACES_EXPORTER": "otlp,otlp_json_file",
        "VLLM_JOURNEY_OTEL_FILE": str(tmp / "pd.jsonl"),
    }
    serving = PdServing.start(model_dir, tmp, module_receiver.grpc_port, LEASE_S, env)
    try:
        yield serving.prefill, serving.decode, serving.proxy_url, module_receiver, serving.kv_dir
    finally:
        serving.stop()


def _trace(receiver: Any, trace_id: int, want: int) -> list[ReceivedSpan]:
    """The spans of one trace once ``want`` of our journeys (vllm.request) and as
    many API-server spans (each process exports its own, in its own time) arrived,
    and the proxy's SERVER span and two httpx CLIENT spans."""
    tid = trace_id.to_bytes(16, "big")

    def found() -> list[ReceivedSpan] | None:
        spans = [s for s in receiver.spans() if s.span.trace_id == tid]
        roots = [s for s in spans if s.name == S.SPAN_REQUEST]
        apis = [s for s in spans if s.name == S.SPAN_API]
        proxy = [s for s in spans if s.resource.get("service.name") == "pd-proxy"
                 and s.span.kind in (s.span.SPAN_KIND_SERVER, s.span.SPAN_KIND_CLIENT)]  # fmt: skip
        return spans if min(len(roots), len(apis)) >= want and len(proxy) >= 3 else None

    return wait_until(found, 60, 0.2, f"trace {trace_id:032x}")  # type: ignore[no-any-return]


def _by_id(spans: list[ReceivedSpan]) -> dict[bytes, ReceivedSpan]:
    return {s.span.span_id: s for s in spans}


def _ancestors(span: ReceivedSpan, by_id: dict[bytes, ReceivedSpan]) -> list[str]:
    names = []
    parent = by_id.get(span.span.parent_span_id)
    while parent is not None:
        names.append(parent.name)
        parent = by_id.get(parent.span.parent_span_id)
    return names


def _check_one_trace(spans: list[ReceivedSpan], trace_id: int, client_span: int) -> dict[str, Any]:
    """The proxy's span under the client's; both instances' API spans and journeys
    under it, in time order; the decode journey linked to the prefill journey."""
    by_id = _by_id(spans)
    (server,) = [s for s in spans if s.resource.get("service.name") == "pd-proxy"
                 and s.span.kind == s.span.SPAN_KIND_SERVER]  # fmt: skip
    assert server.span.parent_span_id == client_span.to_bytes(8, "big")
    roots = {s.resource[S.RES_KV_ROLE]: s for s in spans if s.name == S.SPAN_REQUEST}
    assert set(roots) == {"prefill", "decode"}, [s.resource for s in spans]
    apis = {s.resource[S.RES_KV_ROLE]: s for s in spans if s.name == S.SPAN_API}
    for role in ("prefill", "decode"):
        chain = _ancestors(roots[role], by_id)
        assert chain[0] == S.SPAN_API and server.name in chain, (role, chain)
        assert apis[role].resource[S.RES_KV_ROLE] == role
    p, d = roots["prefill"], roots["decode"]
    # Time order: the prefill instance's journey, then the decode instance's, their
    # API spans started inside the proxy's span. (Not their ends: an API span ends at the
    # last byte handed to its HTTP server, stamped when that call returns, which on
    # a busy API server can be after the proxy has passed the response on and
    # ended its own span: seen 5.7 ms later for a stream here.)
    assert p.span.start_time_unix_nano < d.span.start_time_unix_nano
    assert p.span.end_time_unix_nano <= d.span.end_time_unix_nano
    for a in apis.values():
        assert server.span.start_time_unix_nano <= a.span.start_time_unix_nano + SLACK_NS
    # The link, with the connector's ids of the prefill side.
    (link,) = d.span.links
    assert (link.trace_id, link.span_id) == (p.span.trace_id, p.span.span_id)
    assert d.attrs[S.KV_REMOTE_REQUEST_ID] == p.attrs[S.REQUEST_ID]
    assert d.attrs[S.KV_REMOTE_ENGINE_ID] == p.resource[S.RES_KV_ENGINE_ID]
    # The prefill side held its blocks until the decode side had read them.
    (held,) = [
        s for s in spans if s.name == S.SPAN_KV_HELD and s.span.parent_span_id == p.span.span_id
    ]
    assert held.attrs[S.KV_HELD_RELEASED] is True
    assert held.span.start_time_unix_nano == p.span.end_time_unix_nano
    blocks = -(-int(p.attrs[S.GEN_AI_INPUT_TOKENS]) // BLOCK)
    assert held.attrs[S.KV_HELD_BLOCKS] == blocks
    assert held.attrs[S.KV_HELD_MS] < LEASE_S * 1000  # released by the read, not the lease
    return {"prefill": p, "decode": d, "held": held, "spans": spans, "by_id": by_id}


def _wait_span(spans: list[ReceivedSpan], root: ReceivedSpan) -> ReceivedSpan | None:
    by_id = _by_id(spans)
    waits = [s for s in spans if s.name == S.SPAN_WAIT
             and by_id[s.span.parent_span_id].span.parent_span_id == root.span.span_id]  # fmt: skip
    assert len(waits) <= 1
    return waits[0] if waits else None


def _completion(
    base: str, model: str, load: str, traceparent: str, prompt: str, kind: tuple[bool, bool],
    salt: str | None = None,
) -> str:  # fmt: skip
    """A request through ``base``; the generated text. ``salt``: vLLM's
    ``cache_salt``, a prefix cache of its own (no hit on the blocks moved before)."""
    stream, chat = kind
    c = client_for(base, {"traceparent": traceparent, "x-pd-load": load})
    body: dict[str, Any] = {"ignore_eos": True, **({"cache_salt": salt} if salt else {})}
    common: dict[str, Any] = {"model": model, "max_tokens": 8, "temperature": 0.0,
                              "extra_body": body}  # fmt: skip
    if chat:
        r = c.chat.completions.create(messages=[{"role": "user", "content": prompt}],
                                      stream=stream, **common)  # fmt: skip
        if stream:
            return "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices)
        return r.choices[0].message.content or ""
    r = c.completions.create(prompt=prompt, stream=stream, **common)
    if stream:
        return "".join(ch.choices[0].text for ch in r if ch.choices)
    return r.choices[0].text


@pytest.mark.parametrize("load", ["sync", "async"])
def test_each_request_through_the_proxy_is_one_trace(pd, load: str) -> None:  # type: ignore[no-untyped-def]
    _, decode, url, receiver, kv_dir = pd
    kinds = [(False, False), (True, False), (True, True)]  # (stream, chat)
    for kind in kinds:
        traceparent, trace_id, client_span = new_traceparent()
        prompt = f"{load} {kind} {PROMPT}"  # nothing of it in a prefix cache yet
        text = _completion(url, decode.model, load, traceparent, prompt, kind)
        # The KV really moved: the decode instance's own prefill gives the same text.
        local = _completion(decode.url, decode.model, load, new_traceparent()[0], prompt, kind,
                            salt="local")  # fmt: skip
        assert text == local and text, kind
        found = _check_one_trace(_trace(receiver, trace_id, 2), trace_id, client_span)
        d, held = found["decode"], found["held"]
        tokens = int(d.attrs[S.GEN_AI_INPUT_TOKENS])
        loaded = _load_times(kv_dir, d.attrs[S.REQUEST_ID])
        wait = _wait_span(found["spans"], d)
        if load == "async":
            # WAITING_FOR_REMOTE_KVS in a served request: the wait covers the
            # worker's load (its own wall-clock stamps), the prefill side's hold
            # covers it too (released by the decode side's acknowledgement).
            assert wait is not None and wait.attrs[S.WAIT_REASON] == S.WAIT_REMOTE_KV
            assert wait.attrs[S.KV_TRANSFER_TOKENS] == tokens - 1
            assert wait.attrs[S.KV_TRANSFER_FAILED] is False
            assert wait.span.start_time_unix_nano <= loaded[0]
            assert loaded[1] <= wait.span.end_time_unix_nano
        else:
            # Loaded before the forward pass: an external prefix hit, no wait.
            assert wait is None
        # Every prompt token but the last came from the prefill instance.
        assert d.attrs[S.GEN_AI_CACHE_READ_TOKENS] == tokens - 1
        assert held.span.start_time_unix_nano <= loaded[0]
        assert loaded[1] <= held.span.end_time_unix_nano


def client_for(base: str, headers: dict[str, str]):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120,
                         default_headers=headers)  # fmt: skip


def _load_times(kv_dir: Path, decode_request_id: object) -> tuple[int, int]:
    """The decode worker's own stamps of its load (wall clock, epoch ns), which
    tests/file_kv_connector.py writes beside the KV files, each moved SLACK_NS inwards for
    the two processes' clock readings (our spans' epoch times come from each
    process's monotonic clock and its anchor)."""
    path = kv_dir / f"load.{decode_request_id}.json"
    stamps = wait_until(lambda: path.exists() and json.loads(path.read_text()), 10, 0.1, str(path))
    return stamps["start_unix_ns"] + SLACK_NS, stamps["end_unix_ns"] - SLACK_NS


def _root(receiver: Any, trace_id: int) -> ReceivedSpan:
    tid = trace_id.to_bytes(16, "big")

    def found() -> ReceivedSpan | None:
        roots = [s for s in receiver.spans() if s.span.trace_id == tid and s.name == S.SPAN_REQUEST]
        return roots[0] if roots else None

    return wait_until(found, 60, 0.2, f"the journey of trace {trace_id:032x}")  # type: ignore[no-any-return]


def _post(base: str, model: str, params: dict[str, Any], traceparent: str) -> int:
    body = {"model": model, "prompt": f"{traceparent} {PROMPT}", "max_tokens": 2,
            "kv_transfer_params": params}  # fmt: skip
    try:
        http_json(base + "/v1/completions", body, headers={"traceparent": traceparent})
    except urllib.error.HTTPError as e:
        return e.code
    return 200


def test_the_hand_offs_that_go_wrong_end_with_a_status(pd) -> None:  # type: ignore[no-untyped-def]
    """The prefill side's lease runs out (no decode side came); the decode side's
    load fails (vLLM's default kv_load_failure_policy "fail"), on both paths; a
    request the decode side gets without remote KV prefills locally."""
    prefill, decode, _, receiver, _ = pd
    spans: dict[str, Any] = {}
    # Prefill only: nobody reads the blocks; the connector's lease frees them.
    tp, lease_trace, _ = new_traceparent()
    assert _post(prefill.url, prefill.model, {"do_remote_decode": True}, tp) == 200
    # Decode side, the remote blocks named but gone (never written): a failed load.
    missing = {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_request_id": "gone",
               "remote_block_ids": list(range(8)), "remote_host": "", "remote_port": 0}  # fmt: skip
    for load in ("sync", "async"):
        tp, spans[load], _ = new_traceparent()
        assert _post(decode.url, decode.model, {**missing, "load": load}, tp) == 500
    # Decode side without remote KV (no blocks to load): a local prefill.
    tp, local_trace, _ = new_traceparent()
    none = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r"}
    assert _post(decode.url, decode.model, none, tp) == 200

    held_root = _root(receiver, lease_trace)  # exported when the lease ran out
    (held,) = [s for s in receiver.spans() if s.name == S.SPAN_KV_HELD
               and s.span.parent_span_id == held_root.span.span_id]  # fmt: skip
    assert held.attrs[S.KV_HELD_RELEASED] is True
    assert held.attrs[S.KV_HELD_MS] >= LEASE_S * 1000
    for load in ("sync", "async"):
        failed = _root(receiver, spans[load])
        assert failed.attrs[S.FINISH_STATUS] == S.FINISH_ERROR, load
        assert failed.attrs[S.KV_REMOTE_REQUEST_ID] == "gone"
        assert not failed.span.links  # the params named no traced prefill journey
        wait = _wait_span(receiver.spans(), failed)
        if load == "async":
            assert wait is not None and wait.attrs[S.KV_TRANSFER_FAILED] is True
        else:
            assert wait is None
    local = _root(receiver, local_trace)
    assert local.attrs[S.FINISH_STATUS] == S.FINISH_LENGTH
    assert local.attrs[S.KV_REMOTE_REQUEST_ID] == "r"
    assert _wait_span(receiver.spans(), local) is None


def test_the_tools_tell_the_two_instances_apart(pd, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """explain says where each journey ran and its KV hand-off; summary counts the
    holds and loads; Perfetto draws each instance as its own process."""
    from vllm_journey_otel.tools.cli import CHROMIUM_FLAGS
    from vllm_journey_otel.tools.cli import main as cli_main
    from vllm_journey_otel.tools.tracefile import read_spans

    _, decode, url, receiver, kv_dir = pd
    traceparent, trace_id, _ = new_traceparent()
    _completion(url, decode.model, "async", traceparent, f"tools {PROMPT}", (False, False))
    roots = {s.resource[S.RES_KV_ROLE]: s for s in _trace(receiver, trace_id, 2)
             if s.name == S.SPAN_REQUEST}  # fmt: skip
    rid = {role: str(r.attrs[S.REQUEST_ID]) for role, r in roots.items()}
    path = kv_dir.parent / "pd.jsonl"

    def in_file() -> bool:
        names = {(s.name, s.attributes.get(S.REQUEST_ID)) for s in read_spans([path])}
        return {(S.SPAN_REQUEST, rid["prefill"]), (S.SPAN_REQUEST, rid["decode"])} <= names

    wait_until(in_file, 30, 0.2, "both journeys in the trace file")
    assert cli_main(["explain", str(path), "--request", rid["decode"]]) == 0
    out = capsys.readouterr().out
    assert "decode instance" in out, out
    engine = roots["prefill"].resource[S.RES_KV_ENGINE_ID]
    assert f"the source of its prompt's KV: request {rid['prefill']} of engine {engine}" in out
    assert cli_main(["explain", str(path), "--request", rid["prefill"]]) == 0
    out = capsys.readouterr().out
    assert "prefill instance" in out and "stayed held for the decode instance" in out, out
    assert cli_main(["summary", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kv_held"]["ms"]["count"] >= 1 and d["kv_transfer"]["ms"]["count"] >= 1
    out_path = kv_dir.parent / "pd-perfetto.json"
    assert cli_main(["perfetto", str(path), "-o", str(out_path)]) == 0
    capsys.readouterr()
    events = json.loads(out_path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert any(n.endswith(" prefill") for n in names), names
    assert any(n.endswith(" decode") for n in names), names
    # The timeline page: the clicked decode request explained with where it ran.
    html = kv_dir.parent / "pd.html"
    assert cli_main(["timeline", str(path), "-o", str(html)]) == 0
    capsys.readouterr()
    chromium = shutil.which("chromium")
    assert chromium, "chromium is required (scripts/setup_chromium.sh)"
    with tempfile.TemporaryDirectory() as profile:
        run = subprocess.run(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size=1400,900",
             "--virtual-time-budget=10000", "--dump-dom",
             f"{html.as_uri()}#request={rid['decode']}"],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
    panel = re.search(r'<div id="explain"[^>]*>(.*?)</div>', run.stdout, re.S)
    assert panel is not None, run.stderr[-2000:]
    assert "decode instance" in panel.group(1) and "source of its prompt" in panel.group(1)
