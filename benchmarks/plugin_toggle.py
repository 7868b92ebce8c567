"""The plugin's cost in one busy `vllm serve`, switched on and off every few seconds.

Why: between two fresh servers of the same code this machine's requests/s
differ by ±10 to 40 % (the CPUs' speed, which ``cpu_gauge.py`` follows, and
what differs between two servers: their memory's layout, their hash seeds),
so ``serve_short.py`` needs dozens of rounds to see 2 %. Within one server,
between two moments seconds apart, only the speed differs, and the gauge
follows it.

What: one `vllm serve` of the tiny CPU model started with the plugin on and
its defaults (OTLP gRPC to a receiver here), placed as ``serve_short.py --pin
0:1 --pin-client 0`` places it; ``wrk`` keeps CONCURRENCY short requests in
flight (``benchmarks/wrk/short_requests.lua``: half streamed chat, half
completions, TOKENS tokens, ``ignore_eos``) for the whole run. Server and
``wrk`` share this script's session, so one scheduler autogroup
(``--server-session own``: the server in a session of its own, where a busy
server kept a process of another session, a 10 ms sleeper, off the CPUs for
up to 8 s at a time). The run is cut
into blocks of one window of WINDOW_S per state, the blocks' orders the rows
of a Williams square in turn (within the blocks of a square each state comes
right after each other state once: what a window leaves to the next, such as
the exporters' work on its journeys, falls on every state nearly alike);
``benchmarks/toggle_probe`` switches the API server and the engine core to
the window's state by signal at its start: ``on`` (the defaults),
``api-norecord`` (the API-server spans' middleware and hooks on, their
records not handed to the exporter: what the records, their hand-off and the
API server's exporter cost), ``api-off`` (the API-server spans off),
``exp-stopped`` (the defaults, with every exporter process stopped, SIGSTOP,
for the window and continued at the next one's start: the plugin's cost
inside vLLM's processes without its exporters' CPU), ``unpaced`` (the
defaults, with the exporters' threads not offering their CPU back between two
units of work: what ``cpu_pacing.Pacer`` is worth), ``paced-200us`` (the
same, offering it once per 200 µs of work), ``off`` (tracing off in
both: every wrapper calls vLLM's own method at once) and ``off-2`` (off
again: the A/A control); ``--states`` picks some of them. ``off`` is the
plugin installed and switched off, not vLLM without it: one check per
wrapped call, a drain thread's wake-up a second and two idle exporter
processes stay (``hook_cost.py`` reads the wrappers'
dispatch at about 0.15 µs a call). A window's figures are taken from SETTLE_S
after its start (the requests already in flight finish first) to its end:
requests finished (vLLM's own ``vllm:request_success_total`` at ``/metrics``),
the API server's and the engine core's CPU time, each CPU's gauge, and, as the
check that the switch worked, the journeys' roots at the receiver that started
in the window, per request (the span's start: a journey exported late still
counts in its own window). ``speed_adjusted.py`` fits each state against
``off`` with a level per block, with and without the gauges; the medians of
the ratios within a block are printed beside it.

    .venv/bin/python benchmarks/plugin_toggle.py [--seconds 600] [--window 4]
        [--concurrency 48] [--tokens 8] [--states on,api-off,off,off-2]
        [--env NAME=VALUE ...] [--server-session shared|own]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import speed_adjusted  # noqa: E402
from cpu_gauge import Gauge, _mean_in  # noqa: E402
from serve_rounds import cpu_s, roles  # noqa: E402
from serve_short import load, signal_all, within_round  # noqa: E402

from fixtures.tiny_model import build  # noqa: E402
from otlp_receiver import Receiver  # noqa: E402
from services import VllmServer  # noqa: E402

STATES = (
    "on", "api-norecord", "api-off", "exp-stopped", "unpaced", "paced-200us", "off", "off-2",
)  # fmt: skip
SETTLE_S = 0.4


def williams(states: list[str]) -> list[list[str]]:
    """Block orders in which each state comes right after each other state
    equally often: a Williams square (an odd count of states needs two, the
    second the first's rows reversed)."""
    n = len(states)
    first = [0]
    for k in range(1, n):  # 0, 1, n-1, 2, n-2, ...
        first.append((k + 1) // 2 if k % 2 else n - k // 2)
    rows = [[(i + j) % n for i in first] for j in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [[states[i] for i in row] for row in rows]


def finished(server: VllmServer) -> float:
    """vLLM's count of requests finished successfully (every reason), from /metrics."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in server.metrics().splitlines()
        if line.startswith("vllm:request_success_total")
    )


def counters(server: VllmServer, pids: dict[str, int]) -> tuple[int, float, dict[str, float]]:
    cpu = {role: cpu_s(pids[role]) for role in ("api_server", "engine_core")}
    return time.monotonic_ns(), finished(server), cpu


def windows(server: VllmServer, pids: dict[str, int], args: argparse.Namespace) -> list[dict]:
    """The load's windows: state, block, and the figures of each."""
    rows: list[dict[str, Any]] = []
    orders = williams(args.states)
    end = time.monotonic() + args.seconds
    block, previous = 0, "on"  # the load's first seconds ran with the defaults
    while time.monotonic() + len(args.states) * args.window < end:
        for state in orders[block % len(orders)]:
            switch(args, pids, state)
            start = time.monotonic()
            time.sleep(SETTLE_S)
            t0, n0, cpu0 = counters(server, pids)
            time.sleep(max(0.0, start + args.window - time.monotonic()))
            t1, n1, cpu1 = counters(server, pids)
            done = n1 - n0
            rows.append({
                "mode": state, "round": block, "after": previous, "window": [t0, t1],
                "requests": done,
                "requests_per_s": round(done / ((t1 - t0) / 1e9), 1),
                "cpu_us_per_request": {
                    r: round((cpu1[r] - cpu0[r]) / done * 1e6) for r in cpu0
                },
            })  # fmt: skip
            previous = state
        block += 1
    return rows


def span_starts_mono_ns(receiver: Receiver) -> dict[str, list[int]]:
    """The start of every journey's root at the receiver (``vllm.api.request``:
    the API server's; ``vllm.request``: the engine's), on this process's
    CLOCK_MONOTONIC (the span's epoch ns less the two clocks' offset now), once
    no more have come for 3 s (the exporters flush as the server stops)."""
    from vllm_journey_otel import schema as S

    settled(receiver)
    offset = time.time_ns() - time.monotonic_ns()
    spans = receiver.spans()
    return {
        name: [s.span.start_time_unix_nano - offset for s in spans if s.name == name]
        for name in (S.SPAN_API, S.SPAN_REQUEST)
    }


def settled(receiver: Receiver, quiet_s: float = 3.0, timeout_s: float = 120.0) -> None:
    """Once no span has come to ``receiver`` for ``quiet_s`` (at most ``timeout_s``)."""
    seen, quiet_since, deadline = -1, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() - quiet_since < quiet_s and time.monotonic() < deadline:
        count = len(receiver.spans())
        if count != seen:
            seen, quiet_since = count, time.monotonic()
        time.sleep(0.5)


def switch(args: argparse.Namespace, pids: dict[str, Any], state: str) -> None:
    """The API server and the engine core to ``state`` (``toggle_probe``); the
    exporters stopped in ``exp-stopped`` and continued otherwise."""
    args.state_file.write_text(state)
    for role in ("api_server", "engine_core"):
        os.kill(pids[role], signal.SIGUSR1)
    # The exporters' own work out of the window: stopped at its start,
    # continued at the next one's (their backlog falls on that window).
    signal_all(pids["exporters"], signal.SIGSTOP if state == "exp-stopped" else signal.SIGCONT)
    if any(s == "unpaced" or s.startswith("paced-") for s in args.states):  # their pacing
        signal_all(pids["exporters"], signal.SIGUSR1)


def add_server_session(p: argparse.ArgumentParser) -> None:
    """``--server-session``, which :func:`busy_server` reads."""
    p.add_argument(
        "--server-session",
        choices=("shared", "own"),
        default="shared",
        help="the server in this script's session, with wrk (one scheduler autogroup), or "
        "in a session of its own (an autogroup of its own)",
    )


@contextlib.contextmanager
def busy_server(
    args: argparse.Namespace, receiver: Receiver, seconds: float
) -> Iterator[tuple[VllmServer, dict[str, Any], subprocess.Popen[str]]]:
    """One `vllm serve` of the tiny model, the plugin on with its defaults and
    ``toggle_probe`` loaded (``args.state_file`` set here), placed as
    ``serve_short.py --pin 0:1 --pin-client 0``, and ``wrk`` keeping
    ``args.concurrency`` short requests in flight for ``seconds``; stopped,
    exporters continued, on the way out."""
    from vllm_journey_otel.config import EXPORT_INTERVAL_MS, Batching, Config

    model = build(ROOT / ".cache" / "tiny-llama")
    tmp = Path(tempfile.mkdtemp(prefix="plugin-toggle-"))
    args.state_file = tmp / "state"
    args.state_file.write_text("on")
    env = {
        # The test fixture shortens the export delays; back to the product's defaults.
        EXPORT_INTERVAL_MS: str(Config().export_interval_ms),
        "OTEL_BSP_SCHEDULE_DELAY": str(int(Batching().delay_ms)),
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{receiver.grpc_port}",
        "PYTHONPATH": str(ROOT / "benchmarks" / "toggle_probe"),
        "VJO_TOGGLE_PROBE": str(args.state_file),
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        **dict(item.split("=", 1) for item in args.env),
    }
    command = ["taskset", "-c", "1", str(ROOT / ".venv" / "bin" / "vllm")]
    server = VllmServer(
        model, tmp / "server.log", env, command=command,
        own_session=args.server_session == "own",
    )  # fmt: skip
    wrk: subprocess.Popen[str] | None = None
    pids: dict[str, Any] = {"exporters": []}
    try:
        server.wait_ready()
        one = argparse.Namespace(requests=2, concurrency=2, tokens=args.tokens)
        load(server, one)  # one of each kind through a real client: their lengths checked
        pids = roles(server.pid)
        script = ROOT / "benchmarks" / "wrk" / "short_requests.lua"
        wrk = subprocess.Popen(
            ["taskset", "-c", "0", "wrk", "-t1", f"-c{args.concurrency}",
             f"-d{int(seconds)}s", "--timeout", "60s", "-s", str(script), server.url,
             "--", server.model, str(args.tokens)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        yield server, pids, wrk
    finally:
        signal_all(pids["exporters"], signal.SIGCONT)
        if wrk is not None and wrk.poll() is None:
            wrk.kill()
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=int, default=600)
    p.add_argument("--window", type=float, default=4.0)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument(
        "--states",
        type=lambda text: text.split(","),
        default=list(STATES),
        help="the states switched, comma-separated, among " + ", ".join(STATES),
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="one more variable for the server (e.g. VLLM_JOURNEY_OTEL_EXPORTER_CPUS=0)",
    )
    add_server_session(p)
    args = p.parse_args()
    unknown = set(args.states) - set(STATES)
    if unknown or "off" not in args.states or len(set(args.states)) < 2:
        p.error(f"--states: two or more of {', '.join(STATES)}, `off` among them")
    receiver = Receiver()
    receiver.start_grpc()
    gauge: Gauge | None = None
    try:
        with busy_server(args, receiver, args.seconds + 10) as (server, pids, wrk):
            gauge = Gauge(server.log_path.parent)
            time.sleep(3.0)  # the load's start, not counted
            rows = windows(server, pids, args)
            wrk.send_signal(signal.SIGINT)  # wrk prints its summary on SIGINT
            summary = json.loads(wrk.communicate(timeout=60)[0].strip().splitlines()[-1])
            # As in real use from here on: the plugin on (its shutdown path too),
            # and what the exporters still hold of the last windows (at
            # SCHED_IDLE on a saturated CPU they fall behind) delivered before
            # the server stops: vLLM kills an engine core that lingers.
            switch(args, pids, "on")
            settled(receiver, quiet_s=5.0)
    except BaseException:
        receiver.stop()
        raise
    finally:
        if gauge is not None:
            gauge.stop()
    bad = {k: v for k, v in summary.items() if k.endswith(("errors", "timeouts", "2xx")) and v}
    try:
        starts = span_starts_mono_ns(receiver)
    finally:
        receiver.stop()
    for row in rows:
        t0, t1 = row["window"]
        # The switch worked: spans of the requests received in the window, per request.
        row["spans_per_request"] = {
            name: round(sum(t0 <= s < t1 for s in mine) / row["requests"], 3)
            for name, mine in starts.items()
        }
        means = {f"cpu{c}": _mean_in(path, row["window"], 20) for c, path in gauge.files.items()}
        row["gauge_ns"] = {c: m for c, m in means.items() if m is not None}
    print(json.dumps(report(rows, summary, bad, args.states), indent=2))


def report(
    rows: list[dict[str, Any]], summary: dict[str, Any], bad: dict[str, Any], states: list[str]
) -> dict:
    per_state = {
        s: {
            "windows": len(mine := [r for r in rows if r["mode"] == s]),
            "requests_per_s_median": round(statistics.median(r["requests_per_s"] for r in mine), 1),
            "api_server_cpu_us_per_request_median": round(
                statistics.median(r["cpu_us_per_request"]["api_server"] for r in mine)
            ),
            "engine_core_cpu_us_per_request_median": round(
                statistics.median(r["cpu_us_per_request"]["engine_core"] for r in mine)
            ),
            "spans_per_request (min, max)": {
                name: (min(v := [r["spans_per_request"][name] for r in mine]), max(v))
                for name in mine[0]["spans_per_request"]
            },
        }
        for s in states
    }
    paired = {
        f"{s}/off": {
            "requests_per_s": within_round(rows, s, "off", lambda r: r["requests_per_s"]),
            "api_server_cpu_per_request": within_round(
                rows, s, "off", lambda r: r["cpu_us_per_request"]["api_server"]
            ),
            "engine_core_cpu_per_request": within_round(
                rows, s, "off", lambda r: r["cpu_us_per_request"]["engine_core"]
            ),
        }
        for s in states
        if s != "off"
    }
    return {
        "wrk": summary,
        "wrk_errors": bad,
        "per_state": per_state,
        "ratios within a block (off-2/off is the A/A control)": paired,
        "fit (speed_adjusted.py)": speed_adjusted.ratios(rows),
        "windows": rows,
    }


if __name__ == "__main__":
    main()
