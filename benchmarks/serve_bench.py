"""`vllm serve` output-token throughput: plugin on vs off vs vLLM's own tracing.

The three servers of the tiny CPU model stay up side by side; only one serves
at a time. Each round sends CONCURRENCY requests of TOKENS tokens (ignore_eos)
to each server in turn, in a rotating order, and records output tokens/s as
the client sees it; the ratios are taken within each round (same minute, same
machine state), then their median and spread over the rounds. (Restarting a
server per measurement, as an earlier version did, made blocks of the same
mode differ by a factor of 3 to 6 on this 2-vCPU machine.)

* off: plain `vllm serve`;
* on: `VLLM_JOURNEY_OTEL=1` with the product's defaults, exporting over OTLP
  gRPC to a receiver here;
* vllm-tracing: `--otlp-traces-endpoint` to the same receiver, plugin off.

    .venv/bin/python benchmarks/serve_bench.py [ROUNDS] [CONCURRENCY] [TOKENS]
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


def quantiles(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return {"median": round(statistics.median(v), 4), "p10": round(pick(0.1), 4),
            "p90": round(pick(0.9), 4)}  # fmt: skip


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    concurrency = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    model = build(ROOT / ".cache" / "tiny-llama")
    receiver = Receiver()
    receiver.start_grpc()
    endpoint = f"http://127.0.0.1:{receiver.grpc_port}"
    tmp = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    # The test fixture shortens the export delays; back to each mode's defaults:
    # ours (config.py), and the SDK's for vLLM's tracer.
    from vllm_journey_otel.config import Batching, Config

    ours = {
        "VLLM_JOURNEY_OTEL_EXPORT_INTERVAL_MS": str(Config().export_interval_ms),
        "OTEL_BSP_SCHEDULE_DELAY": str(int(Batching().delay_ms)),
    }
    modes = {
        "off": ({"VLLM_JOURNEY_OTEL": "0"}, []),
        "on": ({**ours, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint}, []),
        "vllm-tracing": (
            {
                "VLLM_JOURNEY_OTEL": "0",
                "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true",
                "OTEL_BSP_SCHEDULE_DELAY": "5000",
            },
            ["--otlp-traces-endpoint", endpoint],
        ),
    }
    import httpx

    servers: dict[str, VllmServer] = {}
    rates: dict[str, list[float]] = {name: [] for name in modes}
    failures: dict[str, list[str]] = {name: [] for name in modes}
    try:
        for name, (env, args) in modes.items():
            servers[name] = VllmServer(model, tmp / f"{name}.log", env, args=args)
            servers[name].wait_ready()

        def round_of(name: str) -> float | None:
            """Output tokens/s of one round; None if a request failed (counted)."""
            s = servers[name]
            body = {"model": s.model, "max_tokens": tokens, "ignore_eos": True}

            # One client per round (its connections are not left idle while the
            # other servers' rounds run: uvicorn drops idle ones after 5 s).
            http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=concurrency))

            def one(i: int) -> int:
                r = http.post(s.url + "/v1/completions", json={**body, "prompt": f"bench {i}"})
                r.raise_for_status()
                return int(r.json()["usage"]["completion_tokens"])

            t0 = time.perf_counter()
            try:
                with ThreadPoolExecutor(concurrency) as pool:
                    out = sum(pool.map(one, range(concurrency)))
            except httpx.HTTPError as exc:
                failures[name].append(repr(exc))
                return None
            finally:
                http.close()
            elapsed = time.perf_counter() - t0
            assert out == concurrency * tokens, out
            return out / elapsed

        for name in modes:
            round_of(name)  # warm-up round, not counted
        for r in range(rounds):
            names = list(modes)
            names = names[r % 3 :] + names[: r % 3]
            got = {name: round_of(name) for name in names}
            if all(v is not None for v in got.values()):
                for name, v in got.items():
                    rates[name].append(v)  # type: ignore[arg-type]
        on_off = [a / b for a, b in zip(rates["on"], rates["off"], strict=True)]
        vt_off = [a / b for a, b in zip(rates["vllm-tracing"], rates["off"], strict=True)]
        on_vt = [a / b for a, b in zip(rates["on"], rates["vllm-tracing"], strict=True)]
        print(json.dumps({
            "rounds": rounds, "concurrency": concurrency, "tokens": tokens,
            "output_tokens_per_s_median": {
                k: round(statistics.median(v), 1) for k, v in rates.items()
            },
            "ratio_on_off": quantiles(on_off),
            "ratio_vllm_tracing_off": quantiles(vt_off),
            "ratio_on_vllm_tracing": quantiles(on_vt),
            "per_round": {k: [round(x, 1) for x in v] for k, v in rates.items()},
            "rounds_left_out_for_a_failed_request": {k: len(v) for k, v in failures.items()},
            "failures": {k: v[:3] for k, v in failures.items() if v},
        }, indent=2))  # fmt: skip
    finally:
        for s in servers.values():
            s.stop()
        receiver.stop()


if __name__ == "__main__":
    main()
