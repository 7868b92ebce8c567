"""How fast `vllm-journey summary`, `timeline` and `explain` read a big trace file.

Generates N journeys (default 100,000; about 6 spans each, 15 % preempted) with
the real journey model and span builder, writes them with the real OTLP/JSON file
exporter, then times the summary, the timeline (10,000 slowest drawn, with their
explanations) and the whole-file explain in child
processes and reports their peak memory (ru_maxrss).

    .venv/bin/python benchmarks/tracefile_bench.py [N]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from records import write_trace_file

generate = write_trace_file


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
        explain = timed(
            "from vllm_journey_otel.tools.journey_files import file_share\n"
            "from vllm_journey_otel.tools.tracefile import read_spans\n"
            f"share = file_share(lambda a: read_spans([{str(path)!r}], attributes_of=a))\n"
            "print('J', share.journeys)"
        )
        result = {
            "journeys": n,
            "file_mib": round(path.stat().st_size / 2**20, 1),
            "summary_s": round(summary[0], 2),
            "summary_peak_rss_mib": round(summary[1] / 1024, 1),
            "timeline_s": round(timeline[0], 2),
            "timeline_peak_rss_mib": round(timeline[1] / 1024, 1),
            "explain_whole_file_s": round(explain[0], 2),
            "explain_whole_file_peak_rss_mib": round(explain[1] / 1024, 1),
            "import_only_peak_rss_mib": round(baseline[1] / 1024, 1),
        }
        print(next(line for line in summary[2].splitlines() if line.startswith("J")))
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
