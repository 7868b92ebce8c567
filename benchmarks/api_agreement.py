"""The API server's figures against vLLM's own: server-side TTFT and end to end.

One `vllm serve` of the tiny CPU model with the plugin on and vLLM's own tracing
on (`--otlp-traces-endpoint`, the same receiver), a small KV cache (requests
are preempted once the burst outgrows it); REQUESTS concurrent requests, half chat streams, half
whole completions. For each finished request it pairs our `vllm.api.request`
with vLLM's `llm_request` under it and prints quantiles (ms) of:

* ours minus vLLM's, for TTFT (every response) and end to end;
* `vllm.api.read_ms`: receipt to vLLM's arrival stamp, which vLLM's figures start at;
* the TTFT residual (ours - read - vLLM's): ours is vLLM's first-token stamp
  measured from our receipt, so this is the clocks' conversion only;
* a stream's first byte after its first token (`vllm.api.ttfb_ms` -
  `vllm.api.ttft_ms`): from vLLM's output processor seeing the first output
  to the first chunk handed to the HTTP server;
* the end-to-end rest (ours - read - vLLM's): from the moment vLLM's output
  processor saw the last output to the last byte handed to the HTTP server
  (detokenized output through the request's queue, the handler, JSON or SSE,
  the middlewares).

    .venv/bin/python benchmarks/api_agreement.py [REQUESTS] [TOKENS]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fixtures.tiny_model import build  # noqa: E402
from otlp_receiver import Receiver, wire_spans  # noqa: E402
from services import VllmServer, wait_until  # noqa: E402
from trees import api_requests  # noqa: E402
from vllm_journey_otel import schema as S  # noqa: E402


def quantiles(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    pick = lambda q: round(v[min(len(v) - 1, int(q * len(v)))], 3)  # noqa: E731
    return {"n": len(v), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": pick(1.0)}


def main() -> None:
    requests = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 48
    model = build(ROOT / ".cache" / "tiny-llama")
    receiver = Receiver()
    receiver.start_grpc()
    endpoint = f"http://127.0.0.1:{receiver.grpc_port}"
    tmp = Path(tempfile.mkdtemp(prefix="api-agreement-"))
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true",
    }
    server = VllmServer(
        model, tmp / "vllm.log", env, args=["--otlp-traces-endpoint", endpoint],
        max_model_len=512, kv_cache_bytes="1M",
    )  # fmt: skip
    import openai

    try:
        server.wait_ready()
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)

        def one(i: int) -> None:
            if i % 2:
                stream = c.chat.completions.create(
                    model=server.model, messages=[{"role": "user", "content": f"why {i}"}],
                    max_tokens=tokens, stream=True, extra_body={"ignore_eos": True},
                )  # fmt: skip
                # (vLLM may put several tokens in a chunk: the stream's end is the check.)
                reasons = [ch.choices[0].finish_reason for ch in stream if ch.choices]
                assert reasons and reasons[-1] == "length", reasons[-3:]
            else:
                c.completions.create(
                    model=server.model, prompt=f"agree {i}", max_tokens=tokens,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip

        with ThreadPoolExecutor(requests) as pool:
            list(pool.map(one, range(requests)))

        def paired() -> list[tuple[object, object]] | None:
            spans = wire_spans(receiver)
            trees = api_requests(s for s in spans if s.name in S.SPAN_NAMES)  # type: ignore[misc]
            vllm = {s.parent.span_id: s for s in spans if s.name == "llm_request" and s.parent}
            pairs = [(t, vllm[t.span.context.span_id]) for t in trees
                     if t.span.context.span_id in vllm]  # fmt: skip
            return pairs if len(pairs) >= requests else None

        pairs = wait_until(paired, 60, 0.5, "every request's spans")
    finally:
        server.stop()
        receiver.stop()
    out: dict[str, list[float]] = {k: [] for k in (
        "ttft_ours_minus_vllm", "e2e_ours_minus_vllm", "read_ms", "ttft_residual",
        "stream_ttfb_after_ttft", "e2e_rest",
    )}  # fmt: skip
    preempted = 0
    for tree, vllm in pairs:
        a, v = tree.attrs, vllm.attributes  # type: ignore[attr-defined]
        (inp,) = tree.kids(S.SPAN_API_INPUT)  # type: ignore[attr-defined]
        read = float(inp.attrs[S.API_READ_MS])
        e2e = float(a[S.API_E2E_MS]) - float(v["gen_ai.latency.e2e"]) * 1e3
        out["read_ms"].append(read)
        out["e2e_ours_minus_vllm"].append(e2e)
        out["e2e_rest"].append(e2e - read)
        ttft = float(a[S.API_TTFT_MS]) - float(v["gen_ai.latency.time_to_first_token"]) * 1e3
        out["ttft_ours_minus_vllm"].append(ttft)
        out["ttft_residual"].append(ttft - read)
        if a[S.API_STREAM]:
            out["stream_ttfb_after_ttft"].append(float(a[S.API_TTFB_MS]) - float(a[S.API_TTFT_MS]))
        preempted += any(
            int(e.attrs.get(S.NUM_PREEMPTIONS, 0)) > 0
            for e in tree.kids(S.SPAN_REQUEST)  # type: ignore[attr-defined]
        )
    print(json.dumps({
        "requests": len(pairs), "tokens": tokens, "preempted": preempted,
        "when": time.strftime("%Y-%m-%d %H:%M"),
        **{k: quantiles(v) for k, v in out.items()},
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
