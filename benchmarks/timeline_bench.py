"""How the timeline page copes with many journeys, in headless Chromium.

For each size (default 1,000 and 10,000 journeys, the latter twice: an A/A
control of the resolution), writes a trace file with the real journey model and
file exporter (tests/records.py), builds the page with `vllm-journey timeline`
(timed, in a child process), and opens it in headless Chromium with ``#bench``:
the page scrolls through every row once and notes the time each window took to
draw, the time until its script finished, and how many rows its DOM held.

    .venv/bin/python benchmarks/timeline_bench.py [N ...]
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from records import write_trace_file  # noqa: E402
from vllm_journey_otel.tools.cli import CHROMIUM_FLAGS  # noqa: E402


def chromium_figures(page: Path) -> dict[str, float]:
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("needs Chromium: bash scripts/setup_chromium.sh")
    with tempfile.TemporaryDirectory() as profile:
        t0 = time.perf_counter()
        run = subprocess.run(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size=1400,900",
             "--virtual-time-budget=60000", "--dump-dom", page.as_uri() + "#bench"],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        wall = time.perf_counter() - t0
    body = re.search(r"<body([^>]*)>", run.stdout)
    attrs = dict(re.findall(r'data-([a-z0-9-]+)="([^"]*)"', body.group(1))) if body else {}
    if attrs.get("ready") != "1":
        raise SystemExit(f"the page did not finish its script: {run.stderr[-2000:]}")
    return {
        "chromium_wall_s": round(wall, 2),
        "script_done_ms": float(attrs["ready-ms"]),
        "rows_in_dom": float(attrs["rows-in-dom"]),
        "scroll_windows": float(attrs["scroll-frames"]),
        "scroll_draw_p50_ms": float(attrs["scroll-p50-ms"]),
        "scroll_draw_max_ms": float(attrs["scroll-max-ms"]),
    }


def measure(n: int, tmp: Path) -> dict[str, object]:
    trace = tmp / f"j{n}.jsonl"
    if not trace.exists():
        write_trace_file(trace, n)
    page = tmp / f"j{n}.html"
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "vllm_journey_otel.tools.cli", "timeline", str(trace), "-o",
         str(page), "--limit", str(n)],
        check=True, capture_output=True,
    )  # fmt: skip
    build_s = time.perf_counter() - t0
    return {
        "journeys": n,
        "trace_file_mb": round(trace.stat().st_size / 1e6, 1),
        "page_mb": round(page.stat().st_size / 1e6, 1),
        "build_s": round(build_s, 2),
        **chromium_figures(page),
    }


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [1_000, 10_000, 10_000]
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            print(json.dumps(measure(n, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
