"""API-server requests/s with many short requests: plugin off, API-server spans off, on.

Four servers of the tiny CPU model stay up side by side; only one serves at a
time. Each round sends REQUESTS completions of one token (CONCURRENCY at a time,
keep-alive connections) to each server in turn, in a rotating order, and
records requests/s as the client sees it, and the CPU time the API-server
process (every thread of it: the event loop, vLLM's and our threads) used per
request; ratios are taken within each round, then their median and spread
over the rounds. On a 2-vCPU machine requests/s swing with where the engine's
threads land (rounds fall into speed groups whichever mode runs); the API
server's CPU per request is what our per-request work adds to, and is
steadier. With one output token a request is mostly API-server work (parse,
render, tokenize, hand-off, detokenize, respond), so this is where the
API-server spans' cost on the event loop shows.

* off: plain `vllm serve`;
* off-2: the same again, the A/A control (its ratio to off is the resolution);
* api-off: the plugin on, API-server spans off (VLLM_JOURNEY_OTEL_API_SPANS=0);
* on: the plugin on with its defaults (API-server spans on), OTLP gRPC to a
  receiver here.

    .venv/bin/python benchmarks/api_server_bench.py [ROUNDS] [REQUESTS] [CONCURRENCY] [MODES]

(MODES: a comma-separated subset, e.g. off,off-2,on; the ratios printed are
those whose two modes ran.)
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
    requests = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    concurrency = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    model = build(ROOT / ".cache" / "tiny-llama")
    receiver = Receiver()
    receiver.start_grpc()
    endpoint = f"http://127.0.0.1:{receiver.grpc_port}"
    tmp = Path(tempfile.mkdtemp(prefix="api-bench-"))
    from vllm_journey_otel.config import API_SPANS, Batching, Config

    on = {
        "VLLM_JOURNEY_OTEL_EXPORT_INTERVAL_MS": str(Config().export_interval_ms),
        "OTEL_BSP_SCHEDULE_DELAY": str(int(Batching().delay_ms)),
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
    }
    modes = {
        "off": {"VLLM_JOURNEY_OTEL": "0"},
        "off-2": {"VLLM_JOURNEY_OTEL": "0"},
        "api-off": {**on, API_SPANS: "0"},
        "on": on,
    }
    if len(sys.argv) > 4:
        modes = {k: v for k, v in modes.items() if k in sys.argv[4].split(",")}
    import httpx

    servers: dict[str, VllmServer] = {}
    rates: dict[str, list[float]] = {name: [] for name in modes}
    cpu_us: dict[str, list[float]] = {name: [] for name in modes}
    import psutil
    try:
        for name, env in modes.items():
            servers[name] = VllmServer(model, tmp / f"{name}.log", env)
            servers[name].wait_ready()

        def round_of(name: str) -> float:
            s = servers[name]
            api = psutil.Process(s.pid)
            cpu0 = api.cpu_times()
            body = {"model": s.model, "max_tokens": 1, "ignore_eos": True}
            http = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=concurrency))

            def one(i: int) -> int:
                r = http.post(s.url + "/v1/completions", json={**body, "prompt": f"short {i}"})
                r.raise_for_status()
                return int(r.json()["usage"]["completion_tokens"])

            t0 = time.perf_counter()
            try:
                with ThreadPoolExecutor(concurrency) as pool:
                    out = sum(pool.map(one, range(requests)))
            finally:
                http.close()
            elapsed = time.perf_counter() - t0
            cpu1 = api.cpu_times()
            assert out == requests, out
            used = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
            cpu_us[name].append(used / requests * 1e6)
            return requests / elapsed

        for name in modes:
            round_of(name)  # warm-up round, not counted
            cpu_us[name].clear()
        for r in range(rounds):
            names = list(modes)
            names = names[r % len(names) :] + names[: r % len(names)]
            for name in names:
                rates[name].append(round_of(name))

        def ratio(a: str, b: str, of: dict[str, list[float]] = rates) -> dict[str, float] | None:
            if a not in modes or b not in modes:
                return None
            return quantiles([x / y for x, y in zip(of[a], of[b], strict=True)])

        print(json.dumps({
            "rounds": rounds, "requests": requests, "concurrency": concurrency,
            "requests_per_s_median": {k: round(statistics.median(v), 1) for k, v in rates.items()},
            "ratio_on_off": ratio("on", "off"),
            "ratio_on_api_off": ratio("on", "api-off"),
            "ratio_api_off_off": ratio("api-off", "off"),
            "ratio_off2_off (A/A)": ratio("off-2", "off"),
            "api_server_cpu_us_per_request_median": {
                k: round(statistics.median(v), 1) for k, v in cpu_us.items()
            },
            "cpu_ratio_on_off": ratio("on", "off", cpu_us),
            "cpu_ratio_on_api_off": ratio("on", "api-off", cpu_us),
            "cpu_ratio_off2_off (A/A)": ratio("off-2", "off", cpu_us),
            "per_round": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        }, indent=2))  # fmt: skip
    finally:
        for s in servers.values():
            s.stop()
        receiver.stop()


if __name__ == "__main__":
    main()
