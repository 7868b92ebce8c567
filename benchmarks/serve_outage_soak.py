"""Minutes of `vllm serve` with the trace backend black-holed: memory stays flat.

Starts the tiny CPU model with the plugin on, its OTLP endpoint a TCP proxy that
accepts and never answers (tests/fault_proxy.py), keeps CONCURRENCY clients busy
for SECONDS, and samples the RSS of the engine core and of our exporter process
every 15 s. Prints the samples, requests served, and the exporter's own
accounting at exit (journeys received, spans failed or dropped).

    .venv/bin/python benchmarks/serve_outage_soak.py [SECONDS] [CONCURRENCY] [MODE]

MODE: ``blackhole`` (default) or ``down`` (connection refused).
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import psutil  # noqa: E402

from fault_proxy import BLACKHOLE, DOWN, FaultProxy  # noqa: E402
from fixtures.tiny_model import build  # noqa: E402
from services import VllmServer  # noqa: E402


def rss_mib(pid: int) -> float:
    try:
        return round(psutil.Process(pid).memory_info().rss / 2**20, 1)
    except psutil.Error:
        return float("nan")


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 180
    concurrency = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    mode = sys.argv[3] if len(sys.argv) > 3 else "blackhole"
    import openai

    proxy = FaultProxy(upstream_port=9)
    proxy.set_mode(BLACKHOLE if mode == "blackhole" else DOWN)
    out = ROOT / "demo-output"
    out.mkdir(exist_ok=True)
    server = VllmServer(
        build(ROOT / ".cache" / "tiny-llama"),
        out / "serve_outage_soak.log",
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{proxy.port}",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "10",
        },
    )
    served = 0
    stop = threading.Event()
    lock = threading.Lock()
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

        def worker(i: int) -> None:
            nonlocal served
            n = 0
            while not stop.is_set():
                client.completions.create(
                    model=server.model, prompt=f"soak {i} {n}", max_tokens=32,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                n += 1
                with lock:
                    served += 1

        threads = [
            threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)
        ]
        for t in threads:
            t.start()
        root = psutil.Process(server.pid)
        engine = [
            p
            for p in root.children(recursive=True)
            if "EngineCore" in " ".join(p.cmdline()) or p.name().startswith("VLLM::EngineCore")
        ]
        exporter = [
            p
            for p in psutil.process_iter(["cmdline", "environ"])
            if "vllm_journey_otel.export.exporter_process" in (p.info.get("cmdline") or [])
            and (p.info.get("environ") or {}).get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            == f"http://127.0.0.1:{proxy.port}"
        ]
        samples = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            time.sleep(15)
            samples.append(
                {
                    "t_s": round(time.monotonic() - t0),
                    "requests": served,
                    "engine_core_mib": [rss_mib(p.pid) for p in engine],
                    "exporter_mib": [rss_mib(p.pid) for p in exporter],
                }
            )
            print(json.dumps(samples[-1]), flush=True)
        stop.set()
        for t in threads:
            t.join(60)
    finally:
        server.stop()
        proxy.close()
    time.sleep(15)  # the exporter gives its final export up to 10 s, then reports
    log = server.log_path.read_text(errors="replace")
    summary = re.findall(r"journey-otel exporter: (\d+ journeys received.*)", log)
    warnings = len(re.findall(r"journey-otel: exporting spans to .* fails", log))
    print(json.dumps({"mode": mode, "seconds": seconds, "requests": served,
                      "outage_warnings": warnings, "exporter_summary": summary}))  # fmt: skip


if __name__ == "__main__":
    main()
