"""The main job on a CPU: `vllm serve` with journey tracing, a burst of traffic,
a per-phase summary of what happened to every request, a picture of it, and why
the slowest request was slow.

* builds a tiny random-weight Llama (tests/fixtures/tiny_model.py, cached),
* starts `VLLM_JOURNEY_OTEL=1 vllm serve` on 127.0.0.1 with a KV cache small
  enough that the burst forces preemptions,
* sends 32 concurrent 256-token completions, two chats, and one streaming
  request whose client hangs up early (an abort),
* stops the server (SIGTERM) and prints where the traces are and a summary,
* writes the timeline page (and its PNG when Chromium is installed) and prints
  where the slowest request's time went (`vllm-journey explain --slowest 1`).

With OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) set, spans go to that
collector; otherwise to a local OTLP/JSON file (OTEL_TRACES_EXPORTER=otlp_json_file).

    .venv/bin/python examples/serve_demo.py [OUTPUT_DIR]
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fixtures.tiny_model import build  # noqa: E402
from services import VllmServer, wait_until  # noqa: E402
from vllm_journey_otel.tools.cli import main as cli  # noqa: E402
from vllm_journey_otel.tools.summary import format_text, summarize  # noqa: E402
from vllm_journey_otel.tools.tracefile import read_spans  # noqa: E402

BURST = 32
TOKENS = 256


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "demo-output").resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"[demo] building the tiny model in {ROOT / '.cache/tiny-llama'} (cached)")
    model = build(ROOT / ".cache" / "tiny-llama")

    collector = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    env = {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}
    trace_file = out / "journeys.otlp.jsonl"
    if collector:
        print(f"[demo] exporting to the collector at {collector}")
    else:
        for old in out.glob("journeys.otlp.jsonl*"):
            old.unlink()
        env.update(
            {"OTEL_TRACES_EXPORTER": "otlp_json_file", "VLLM_JOURNEY_OTEL_FILE": str(trace_file)}
        )
        print(f"[demo] no collector set: exporting to {trace_file}")

    print("[demo] starting vllm serve (about 20 s on this CPU)")
    # float32: in bfloat16 (vLLM's choice on a CPU with AVX512-BF16) vLLM 0.32's
    # worker died of SIGILL at the first step of a short prompt on an Intel Xeon
    # with AMX; the tiny model's dtype changes nothing the demo shows.
    server = VllmServer(
        model, out / "vllm-serve.log", env, ["--dtype", "float32"], max_model_len=512,
        kv_cache_bytes="1M",
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        server.wait_ready()
        print(f"[demo] server up in {time.monotonic() - t0:.0f} s at {server.url}; sending traffic")
        import httpx
        import openai

        client = openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300
        )

        def completion(i: int) -> int:
            r = client.completions.create(
                model=server.model, prompt=f"request {i} " * (2 + i % 6), max_tokens=TOKENS,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return r.usage.completion_tokens

        # A client that hangs up after three chunks: its journey ends aborted.
        body = {"model": server.model, "prompt": "go on", "max_tokens": 480, "stream": True,
                "ignore_eos": True}  # fmt: skip
        with (
            httpx.Client(timeout=120) as http,
            http.stream("POST", server.url + "/v1/completions", json=body) as r,
        ):
            for n, _ in enumerate(line for line in r.iter_lines() if line.startswith("data:")):
                if n >= 2:
                    break
        with ThreadPoolExecutor(BURST + 2) as pool:
            burst = pool.map(completion, range(BURST))
            chats = [
                pool.submit(
                    client.chat.completions.create,
                    model=server.model,
                    messages=[{"role": "user", "content": f"hello {i}"}],
                    max_tokens=32,
                )
                for i in range(2)
            ]
            tokens = sum(burst)
            for c in chats:
                c.result()
        print(f"[demo] {BURST} completions ({tokens} tokens), 2 chats, 1 aborted stream done")
    finally:
        server.stop()
    print("[demo] server stopped")
    if collector:
        print(f"[demo] journeys were sent to {collector}; open your tracing UI")
        return 0

    def journeys_written() -> int:
        if not trace_file.exists():
            return 0
        n = sum(1 for s in read_spans([trace_file]) if s.name == "vllm.request")
        return n if n >= BURST + 3 else 0

    wait_until(journeys_written, 30, 0.5, "the exporter to write every journey")
    print(f"\n[demo] traces: {trace_file} (OTLP/JSON lines; replayable into any OTLP backend)")
    print(f"[demo] server log: {out / 'vllm-serve.log'}")
    print(f"[demo] summary (also: .venv/bin/vllm-journey summary {trace_file}):\n")
    print(format_text(summarize(read_spans([trace_file])).to_dict()))
    pictures(trace_file, out)
    return 0


def pictures(trace_file: Path, out: Path) -> None:
    """The timeline page (and PNG), and the explanation of the slowest request."""
    page, png = out / "journeys.html", out / "journeys.png"
    png.unlink(missing_ok=True)
    argv = ["timeline", str(trace_file), "-o", str(page)]
    if shutil.which("chromium") or shutil.which("chromium-browser"):
        argv += ["--png", str(png)]
    print("\n[demo] the timeline (open it in a browser; click a request id for its story):")
    cli(argv)
    if not png.exists():
        print("[demo] no PNG: Chromium is not installed (bash scripts/setup_chromium.sh)")
    print(f"\n[demo] why was the slowest request slow? (.venv/bin/vllm-journey explain "
          f"{trace_file} --slowest 1)\n")  # fmt: skip
    cli(["explain", str(trace_file), "--slowest", "1"])
    print(
        f"\n[demo] where all the request-time went (.venv/bin/vllm-journey explain {trace_file}):\n"
    )
    cli(["explain", str(trace_file)])


if __name__ == "__main__":
    sys.exit(main())
