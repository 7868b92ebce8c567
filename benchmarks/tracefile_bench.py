"""How fast `vllm-journey summary` and `timeline` read a big trace file.

Generates N journeys (default 100,000; about 6 spans each, 15 % preempted) with
the real journey model and span builder, writes them with the real OTLP/JSON file
exporter, then times the summary and the timeline's collection in child
processes and reports their peak memory (ru_maxrss).

    .venv/bin/python benchmarks/tracefile_bench.py [N]
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_journey_otel.engine.request_journey import RequestJourney
from vllm_journey_otel.export.export_stage import ExportStage
from vllm_journey_otel.export.exporters import make_resource, span_limits
from vllm_journey_otel.export.file_exporter import OtlpJsonFileExporter
from vllm_journey_otel.export.health import ExportHealth
from vllm_journey_otel.export.span_builder import SpanBuilder
from vllm_journey_otel.export.spans import plan_spans
from vllm_journey_otel.journey import STATUS_ABORTED, STATUS_LENGTH

MS = 1_000_000


def generate(path: Path, n: int) -> None:
    rng = random.Random(7)
    exporter = OtlpJsonFileExporter(path, max_bytes=1 << 40)
    stage = ExportStage([exporter], ExportHealth(), max_batch=2048)
    builder = SpanBuilder(make_resource({}), span_limits())
    offset = time.time_ns() - time.monotonic_ns()
    t = 0
    for i in range(n):
        t += rng.randint(1, 5) * MS
        j = RequestJourney(f"req-{i}", (t + offset) / 1e9, t, i, 100, 64)
        now = t + rng.randint(0, 50) * MS
        j.scheduled(now, i, 0, 100, 100, 0)
        now += rng.randint(5, 30) * MS
        j.tokens(now, i, 1)
        out = 1
        if rng.random() < 0.15:
            now += 20 * MS
            j.preempted(now, i, 100, 10, 0.98, 30, 5)
            now += rng.randint(10, 200) * MS
            j.scheduled(now, i, 0, 110, 110, 10)
            now += 10 * MS
            j.tokens(now, i, 11)
            out = 11
        now += rng.randint(50, 500) * MS
        status = STATUS_ABORTED if rng.random() < 0.02 else STATUS_LENGTH
        fj = j.finish(now, i, status, "length", out + 50, now)
        assert fj is not None
        stage.add(builder.build(plan_spans(fj, offset), None))
    assert stage.shutdown(600), "the generator could not write every span"


def timed(code: str) -> tuple[float, int, str]:
    wrapper = (
        "import time, sys\n"
        "t0 = time.perf_counter()\n" + code + "\n"
        "print('TIME', time.perf_counter() - t0)\n"
        "hwm = [x for x in open('/proc/self/status') if x.startswith('VmHWM')][0]\n"
        "print('RSS', hwm.split()[1])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", wrapper], capture_output=True, text=True, check=True
    )
    lines = dict(
        line.split(" ", 1) for line in out.stdout.splitlines() if line[:4] in ("TIME", "RSS ")
    )
    return float(lines["TIME"]), int(lines["RSS"]), out.stdout


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "big.otlp.jsonl"
        t0 = time.perf_counter()
        generate(path, n)
        print(
            f"generated {n} journeys in {time.perf_counter() - t0:.1f} s: "
            f"{path.stat().st_size / 2**20:.0f} MiB"
        )
        baseline = timed("import vllm_journey_otel.tools.cli")
        summary = timed(
            "from vllm_journey_otel.tools.summary import SUMMARY_ATTRIBUTES, summarize\n"
            "from vllm_journey_otel.tools.tracefile import read_spans\n"
            f"spans = read_spans([{str(path)!r}], attributes_of=SUMMARY_ATTRIBUTES)\n"
            "d = summarize(spans).to_dict()\n"
            "print('J', d['journeys'], d['spans'])"
        )
        timeline = timed(
            "from vllm_journey_otel.tools.timeline import collect, render\n"
            "from vllm_journey_otel.tools.tracefile import read_spans\n"
            f"rows, total = collect(lambda a: read_spans([{str(path)!r}], attributes_of=a))\n"
            "html = render(rows, total)\n"
            "print('J', total, len(html))"
        )
        result = {
            "journeys": n,
            "file_mib": round(path.stat().st_size / 2**20, 1),
            "summary_s": round(summary[0], 2),
            "summary_peak_rss_mib": round(summary[1] / 1024, 1),
            "timeline_s": round(timeline[0], 2),
            "timeline_peak_rss_mib": round(timeline[1] / 1024, 1),
            "import_only_peak_rss_mib": round(baseline[1] / 1024, 1),
        }
        print(next(line for line in summary[2].splitlines() if line.startswith("J")))
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
