"""What the plugin's exporters cost in each way of running `vllm serve`: one
engine, `--data-parallel-size 2`, `--api-server-count 2`.

For each layout in turn (one server at a time, the product's defaults, OTLP
gRPC to a receiver in this process): a fresh `vllm serve` of the tiny CPU
model, 32 uncounted requests (every process has exported once), then the exporter processes' CPU
over IDLE_S seconds with nothing to export (the control), then REQUESTS short
requests (half streamed chat, half whole completions, 16 output tokens),
CONCURRENCY at a time. Prints per layout: exporter processes, the journeys and
API-server records that reached the receiver, the exporters' CPU per second
idle and under load, and per request above idle.

    .venv/bin/python benchmarks/layout_cost.py [REQUESTS] [CONCURRENCY]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serve_rounds import cpu_s, roles  # noqa: E402
from serve_short import load  # noqa: E402

from fixtures.tiny_model import build  # noqa: E402
from otlp_receiver import Receiver  # noqa: E402
from services import VllmServer, wait_until  # noqa: E402
from vllm_journey_otel import schema as S  # noqa: E402

IDLE_S = 10.0
WARM = 32
LAYOUTS = {
    "one engine": ([], {}),
    "data-parallel 2": (["--data-parallel-size", "2"], {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
    "2 API servers": (["--api-server-count", "2"], {}),
}


def exporters_of(server: VllmServer) -> list[int]:
    """Every exporter process on the machine (one server runs at a time)."""
    return list(roles(server.pid)["exporters"])


def one_layout(name: str, args: argparse.Namespace, receiver: Receiver, tmp: Path) -> dict:
    extra, env = LAYOUTS[name]
    env = {
        **env,
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{receiver.grpc_port}",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        "OTEL_BSP_SCHEDULE_DELAY": "500",  # the default (tests/services.py shortens it)
    }
    server = VllmServer(args.model, tmp / f"{name}.log", env, extra)
    try:
        server.wait_ready()
        # Warm-up: enough requests that every engine core and API server has
        # exported (an exporter's first export imports and connects), all arrived.
        first = len(receiver.spans())
        load(server, argparse.Namespace(**{**vars(args), "requests": WARM, "concurrency": 8}))

        def warm() -> bool:
            got = receiver.spans()[first:]
            return sum(s.name == S.SPAN_API for s in got) >= WARM

        wait_until(warm, 60, 0.5, "the warm-up's records")
        time.sleep(2.0)
        exporters = exporters_of(server)
        idle0 = sum(cpu_s(p) for p in exporters)
        time.sleep(IDLE_S)
        idle = (sum(cpu_s(p) for p in exporters) - idle0) / IDLE_S
        first = len(receiver.spans())
        before = sum(cpu_s(p) for p in exporters)
        t0 = time.monotonic()
        load(server, args)

        def arrived() -> int:
            got = [s for s in receiver.spans()[first:] if s.name == S.SPAN_REQUEST]
            return len(got) >= args.requests and len(got)

        wait_until(arrived, 60, 0.5, "the journeys")
        wall = time.monotonic() - t0
        cpu = sum(cpu_s(p) for p in exporters) - before
        spans = receiver.spans()[first:]
    finally:
        server.stop()
    return {
        "layout": name,
        "exporter_processes": len(exporters),
        "journeys": sum(s.name == S.SPAN_REQUEST for s in spans),
        "api_records": sum(s.name == S.SPAN_API for s in spans),
        "ranks": sorted(
            {str(s.resource.get(S.RES_DP_RANK)) for s in spans if s.name == S.SPAN_REQUEST}
        ),
        "wall_s": round(wall, 1),
        "requests_per_s": round(args.requests / wall, 1),
        "exporter_idle_cpu_ms_per_s": round(idle * 1e3, 1),
        "exporter_cpu_ms_per_s": round(cpu / wall * 1e3, 1),
        "exporter_cpu_us_per_request_above_idle": round((cpu - idle * wall) / args.requests * 1e6),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("requests", type=int, nargs="?", default=400)
    ap.add_argument("concurrency", type=int, nargs="?", default=16)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    args.model = build(ROOT / ".cache" / "tiny-llama")
    receiver = Receiver()
    receiver.start_grpc()
    tmp = Path(tempfile.mkdtemp(prefix="layout-cost-"))
    try:
        rows = [one_layout(name, args, receiver, tmp) for name in LAYOUTS]
    finally:
        receiver.stop()
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
