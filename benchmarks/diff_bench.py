"""How fast and in how much memory `vllm-journey diff` compares two big trace files.

Generates two files of N journeys each (default 100,000; about 6 spans each,
15 % preempted; the second with another seed: the same distribution, an A/A
pair) with the real journey model, span plan and builder and the real
OTLP/JSON file exporter (tests/records.py; engine spans only: the generator
writes no API-server spans), then runs `vllm-journey diff A B --json` in a
child process and reports its wall time and peak memory (VmHWM), beside the
same child importing the CLI alone.

    .venv/bin/python benchmarks/diff_bench.py [N]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tracefile_bench import timed

from records import write_trace_file


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    with tempfile.TemporaryDirectory() as d:
        a, b = Path(d) / "a.otlp.jsonl", Path(d) / "b.otlp.jsonl"
        t0 = time.perf_counter()
        write_trace_file(a, n, seed=7)
        write_trace_file(b, n, seed=8)
        size = (a.stat().st_size + b.stat().st_size) / 2**20
        print(f"generated 2 x {n} journeys in {time.perf_counter() - t0:.1f} s: {size:.0f} MiB")
        baseline = timed("import vllm_journey_otel.tools.cli")
        run = timed(
            "import contextlib, io, json\n"
            "from vllm_journey_otel.tools.cli import main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            f"    code = main(['diff', {str(a)!r}, {str(b)!r}, '--json'])\n"
            "d = json.loads(out.getvalue())\n"
            "qs = [q for p in d['phases'] for q in p['quantiles'].values()]\n"
            "beyond = sum(q['beyond_noise'] for q in qs)\n"
            "print('J', d['journeys'], 'code', code, 'beyond_noise', beyond)"
        )
        print(next(line for line in run[2].splitlines() if line.startswith("J")))
        print(
            json.dumps(
                {
                    "journeys_per_file": n,
                    "files_mib": round(size, 1),
                    "diff_s": round(run[0], 2),
                    "diff_peak_rss_mib": round(run[1] / 1024, 1),
                    "import_only_peak_rss_mib": round(baseline[1] / 1024, 1),
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
