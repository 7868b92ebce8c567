"""How fast each CPU runs, sampled beside a benchmark: the speed gauge of serve_short.py.

On this shared virtual machine the same pure-Python work takes from 0.6 to 1.2
times its mean CPU time from one second to the next (the host's other guests;
the guest sees no steal), and a server's requests/s and CPU per request move
with it: most of the spread between two rounds of the same mode is the
machine, not the server. A :class:`Gauge` runs one small process per CPU,
pinned there at the default priority, that every INTERVAL_S times a fixed
piece of pure-Python work (GAUGE_STEPS dict reads and additions, about 30 µs
here: 0.06 % of a CPU, the same in every mode) in its own CPU time
(``time.thread_time_ns()``) and writes ``start_mono_ns cpu_ns`` lines
(CLOCK_MONOTONIC, the benchmark's clock). :meth:`Gauge.mean_ns` is a CPU's
mean over a window: its speed during a round's load, up to a constant
(larger is slower). ``speed_adjusted.py`` uses it.

    .venv/bin/python benchmarks/cpu_gauge.py CPU OUT   # the sampling process itself
    .venv/bin/python benchmarks/cpu_gauge.py --check SECONDS [WINDOW_S]

``--check`` shows what the gauge is worth, on an otherwise idle machine: a
Python workload (JSON encoding and decoding, dicts and lists: a request's kind
of work) runs on CPU 1 for SECONDS with the gauges running, and counts its
units of work per second of its own CPU time in windows of WINDOW_S (8, a
round's load); it prints, per window size, how much that rate spread (the
coefficient of variation, and the slowest and fastest window against the
mean) as measured, and after dividing by the fit to CPU 1's gauge in the same
windows (``rate * gauge ** a``, ``a`` by least squares).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

GAUGE_STEPS = 600
INTERVAL_S = 0.05
_TABLE = {i: i for i in range(64)}


def sample() -> int:
    """The fixed work's CPU time, ns."""
    start = time.thread_time_ns()
    x = 0
    for j in range(GAUGE_STEPS):
        x += _TABLE[j & 63]
    return time.thread_time_ns() - start


def run(cpu: int, out: Path) -> None:
    os.sched_setaffinity(0, {cpu})
    lines: list[str] = []
    flushed = time.monotonic()
    with out.open("a") as f:
        while True:
            time.sleep(INTERVAL_S)
            lines.append(f"{time.monotonic_ns()} {sample()}\n")
            if time.monotonic() - flushed > 0.5:  # a reader sees a window's samples soon
                f.writelines(lines)
                f.flush()
                lines.clear()
                flushed = time.monotonic()


def _mean_in(path: Path, window: list[int], least: int) -> float | None:
    """The mean of a gauge file's samples in ``[start, end)`` mono ns (None:
    under ``least`` of them)."""
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    inside = [int(c) for s, c in rows if window[0] <= int(s) < window[1]]
    return round(statistics.fmean(inside), 1) if len(inside) >= least else None


class Gauge:
    """One sampling process per CPU of this machine, until :meth:`stop`."""

    def __init__(self, folder: Path) -> None:
        self.files = {
            cpu: folder / f"gauge-cpu{cpu}.txt" for cpu in sorted(os.sched_getaffinity(0))
        }
        self.procs = [
            subprocess.Popen([sys.executable, __file__, str(cpu), str(path)])
            for cpu, path in self.files.items()
        ]

    def mean_ns(self, window: list[int]) -> dict[str, float]:
        """Each CPU's mean sample in ``[start, end)`` mono ns (a CPU with fewer
        than 20 samples there is left out). Waits a moment for the last ones."""
        time.sleep(1.0)
        means = {f"cpu{cpu}": _mean_in(path, window, 20) for cpu, path in self.files.items()}
        return {cpu: mean for cpu, mean in means.items() if mean is not None}

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(10)


def _work() -> None:
    for i in range(20):
        text = json.dumps({"model": "m", "prompt": "hello " * i, "max_tokens": 8, "n": [1, 2]})
        body = json.loads(text)
        body["tokens"] = [str(k) for k in range(10)]


def _spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return (
        f"cv {100 * statistics.pstdev(values) / mean:.1f} %, "
        f"slowest {min(values) / mean:.2f}, fastest {max(values) / mean:.2f}"
    )


def check(seconds: float, window_s: float) -> None:
    """``--check``: the module docstring."""
    import math
    import tempfile

    os.sched_setaffinity(0, {1})
    gauge = Gauge(Path(tempfile.mkdtemp(prefix="cpu-gauge-")))
    windows: list[tuple[list[int], float]] = []
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start_ns, cpu0, units = time.monotonic_ns(), time.thread_time_ns(), 0
            while time.monotonic_ns() - start_ns < window_s * 1e9:
                _work()
                units += 1
            rate = units / ((time.thread_time_ns() - cpu0) / 1e9)
            windows.append(([start_ns, time.monotonic_ns()], rate))
        time.sleep(1.0)  # the gauge's last lines written
        speeds = [_mean_in(gauge.files[1], w, 5) for w, _ in windows]
    finally:
        gauge.stop()
    pairs = [(r, g) for (_, r), g in zip(windows, speeds, strict=True) if g]
    x = [math.log(g) for _, g in pairs]
    y = [math.log(r) for r, _ in pairs]
    a = -statistics.linear_regression(x, y).slope
    adjusted = [r * g**a for r, g in pairs]
    print(f"{len(pairs)} windows of {window_s:g} s on CPU 1, gauge exponent {a:.2f}")
    print(f"  work per CPU second, as measured: {_spread([r for r, _ in pairs])}")
    print(f"  divided by the gauge's fit:       {_spread(adjusted)}")


if __name__ == "__main__":
    if sys.argv[1] == "--check":
        check(float(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 8.0)
    else:
        run(int(sys.argv[1]), Path(sys.argv[2]))
