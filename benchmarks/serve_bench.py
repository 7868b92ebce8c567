"""`vllm serve` output-token throughput: plugin on vs off vs vLLM's own tracing.

One server at a time (on 2 vCPUs, concurrent servers pin their workers to the
same core and the figures mean nothing): for each block, each mode in turn, in
a rotating order, starts a server of the tiny CPU model, sends one warm-up
request, then CONCURRENCY requests of TOKENS tokens (ignore_eos), and stops it.
Output tokens/s as the client sees it.

* off: plain `vllm serve`;
* on: `VLLM_JOURNEY_OTEL=1`, exporting over OTLP gRPC to a receiver here;
* vllm-tracing: `--otlp-traces-endpoint` to the same receiver, plugin off.

    .venv/bin/python benchmarks/serve_bench.py [BLOCKS] [CONCURRENCY] [TOKENS]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fixtures.tiny_model import build  # noqa: E402
from otlp_receiver import Receiver  # noqa: E402
from services import VllmServer  # noqa: E402


def main() -> None:
    blocks = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    concurrency = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    model = build(ROOT / ".cache" / "tiny-llama")
    receiver = Receiver()
    receiver.start_grpc()
    endpoint = f"http://127.0.0.1:{receiver.grpc_port}"
    tmp = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    modes = {
        "off": ({"VLLM_JOURNEY_OTEL": "0"}, []),
        "on": ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint}, []),
        "vllm-tracing": (
            {"VLLM_JOURNEY_OTEL": "0", "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true"},
            ["--otlp-traces-endpoint", endpoint],
        ),
    }
    import openai

    rates: dict[str, list[float]] = {name: [] for name in modes}
    try:
        for b in range(blocks):
            names = list(modes)
            names = names[b % 3 :] + names[: b % 3]
            for name in names:
                env, args = modes[name]
                s = VllmServer(model, tmp / f"{name}-{b}.log", env, args=args)
                try:
                    s.wait_ready()
                    c = openai.OpenAI(
                        base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=600
                    )

                    def one(i: int, c=c, s=s) -> int:  # type: ignore[no-untyped-def]
                        r = c.completions.create(
                            model=s.model, prompt=f"bench {i}", max_tokens=tokens,
                            extra_body={"ignore_eos": True},
                        )  # fmt: skip
                        return int(r.usage.completion_tokens)

                    one(-1)  # warm-up
                    t0 = time.perf_counter()
                    with ThreadPoolExecutor(concurrency) as pool:
                        out = sum(pool.map(one, range(concurrency)))
                    rates[name].append(out / (time.perf_counter() - t0))
                finally:
                    s.stop()
        med = {name: statistics.median(v) for name, v in rates.items()}
        print(json.dumps({
            "blocks": blocks, "concurrency": concurrency, "tokens": tokens,
            "output_tokens_per_s_median": {k: round(v, 1) for k, v in med.items()},
            "ratio_on_off": round(med["on"] / med["off"], 4),
            "ratio_vllm_tracing_off": round(med["vllm-tracing"] / med["off"], 4),
            "per_block": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        }, indent=2))  # fmt: skip
    finally:
        receiver.stop()


if __name__ == "__main__":
    main()
