"""Requests/s of a busy `vllm serve` with short requests: plugin off, off again (A/A), on, on
with the API-server spans off.

What an operator's own benchmark does: many short requests at high concurrency,
so the server's request handling (the API server's event loop), not the model,
is the bottleneck. One server at a time, a fresh one per round, the modes
rotated each round (none always follows the same one). Each round starts the
server, waits for /health and one request of each kind (their lengths checked),
then keeps CONCURRENCY requests of TOKENS output tokens (``ignore_eos``) in
flight on keep-alive connections, half streamed chat completions, half
non-streamed completions: with ``wrk`` (Debian's package: one C thread, so the
client takes little of the server's CPUs; ``benchmarks/wrk/short_requests.lua``)
for SECONDS, or with a Python client (``--client python``: httpx threads,
REQUESTS requests; its own CPU competes with the server's and widens the
spread). A round ends when the server and its exporter processes (detached:
they outlive it) have exited; one uncounted warm-up round comes first. It
records requests/s at the client and the CPU time each process of the server
used per request (API server, engine core, model worker, and, plugin on, every
exporter process: the engine core's and the API server's, together and each
by whose records it takes; and each exporter's CPU from the load's start until
the round's journeys are at the receiver, per journey of its owner: at
SCHED_IDLE on a busy CPU an exporter does part of a round's work after the
load, so its CPU during the load undercounts), and per mode the
median and p10/p90 over rounds; ratios to ``off`` are taken within each round
(the rounds' modes ran minutes apart at most), then their median and spread.
``off-2`` against ``off`` is the A/A control: its spread is the resolution
(each paired median with a 90 % bootstrap interval). Each round also records
each CPU's speed during its load (``cpu_gauge.py``), and the run ends with
every mode fitted against ``off`` with a level per round and those gauges
(``speed_adjusted.py``).

``--gc`` adds, per round, the API server's garbage collections that started
during the load (``benchmarks/gc_probe`` on every server's ``PYTHONPATH``, every
mode alike): per generation how many and their time per request; per mode the
median CPU and clock time per request, a generation-0 collection's CPU time
and the full collections per round.

``--threads`` adds, per round, each process's busiest threads: time on a CPU,
time runnable but waiting for one (schedstat), involuntary switches, and each
exporter process's threads.

Modes (``--modes``, comma-separated): off, off-2, on (the product's defaults,
OTLP gRPC to a receiver here), api-off (``VLLM_JOURNEY_OTEL_API_SPANS=0``),
on-paused (the defaults, with every exporter process stopped, SIGSTOP, for the
load and resumed after it: what the plugin costs inside vLLM's own processes,
without its exporters' CPU; their pipes and the engine's queue hold the
round's journeys, and the drops column says if they did not); with
``--before SRC``, before (the defaults, the package imported from SRC).

    .venv/bin/python benchmarks/serve_short.py [--rounds 9] [--client wrk] [--seconds 8]
        [--requests 384] [--concurrency 48] [--tokens 8] [--modes off,off-2,on,api-off]
        [--threads] [--gc] [--pin 0:1] [--pin-client 0] [--before SRC]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import speed_adjusted  # noqa: E402
from cpu_gauge import Gauge  # noqa: E402
from serve_rounds import (  # noqa: E402
    SLOW_FACTOR,
    cpu_s,
    exporter_owner,
    quantiles,
    roles,
    rotated,
    thread_delta,
    threads,
)

from fixtures.tiny_model import build  # noqa: E402
from otlp_receiver import Receiver  # noqa: E402
from services import VllmServer, wait_until  # noqa: E402

PROCESSES = ("api_server", "engine_core", "worker", "exporters")
# Modes whose exporter processes are stopped for the load (the module docstring).
PAUSED_MODES = ("on-paused",)


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        # An exporter already gone: the round's export figures say so.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def load(server: VllmServer, args: argparse.Namespace) -> float:
    """Send the round's requests; returns the wall seconds to the last response."""
    import httpx

    tokens = {"max_tokens": args.tokens, "ignore_eos": True, "model": server.model}
    http = httpx.Client(timeout=300, limits=httpx.Limits(max_connections=args.concurrency))

    def one(i: int) -> int:
        if i % 2:
            body = {**tokens, "prompt": f"short request {i}"}
            r = http.post(server.url + "/v1/completions", json=body)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])
        body = {**tokens, "messages": [{"role": "user", "content": f"short {i}"}],
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        used = 0
        with http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {") and '"usage":{' in line:
                    used = int(json.loads(line[6:])["usage"]["completion_tokens"])
        return used

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            out = sum(pool.map(one, range(args.requests)))
    finally:
        http.close()
    wall = time.perf_counter() - t0
    assert out == args.requests * args.tokens, (out, args.requests * args.tokens)
    return wall


def load_wrk(server: VllmServer, args: argparse.Namespace) -> tuple[int, float]:
    """wrk (C, one thread: a client that takes little CPU from the server's two)
    for ``args.seconds``; returns the requests completed and the seconds."""
    script = ROOT / "benchmarks" / "wrk" / "short_requests.lua"
    argv = ["wrk", "-t1", f"-c{args.concurrency}", f"-d{args.seconds}s", "--timeout", "60s",
            "-s", str(script), server.url, "--", server.model, str(args.tokens)]  # fmt: skip
    if args.pin_client:
        argv = ["taskset", "-c", args.pin_client, *argv]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    bad = {k: v for k, v in summary.items() if k.endswith(("errors", "timeouts", "2xx")) and v}
    if bad:
        raise RuntimeError(f"wrk: {bad}")
    return int(summary["requests"]), summary["duration_us"] / 1e6


def one_round(mode: str, env: dict[str, str], args: argparse.Namespace, tmp: Path, n: int):
    command: list[str] = []
    if args.pin:  # the server's processes on the rest, the model worker's threads by vLLM
        worker, rest = args.pin
        env = {**env, "VLLM_CPU_OMP_THREADS_BIND": worker}
        command = ["taskset", "-c", rest, str(ROOT / ".venv" / "bin" / "vllm")]
    server = VllmServer(args.model, tmp / f"{mode}-{n}.log", env, command=command)
    exporters: list[int] = []
    row: dict[str, Any] = {}
    first_request = len(args.receiver.requests)
    try:
        server.wait_ready()
        # One of each kind through a real client first: the lengths the load asks for.
        one = argparse.Namespace(**{**vars(args), "requests": 2, "concurrency": 2})
        load(server, one)
        pids = roles(server.pid)
        exporters = pids.pop("exporters", [])
        before = {role: cpu_s(pid) for role, pid in pids.items()}
        before_exp = {p: cpu_s(p) for p in exporters}
        owners = {p: exporter_owner(p, pids) for p in exporters}
        tbefore = {role: threads(pid) for role, pid in pids.items()}
        tbefore_exp = {p: threads(p) for p in exporters}
        stat_before = cpu_times()
        paused = exporters if mode in PAUSED_MODES else []
        signal_all(paused, signal.SIGSTOP)
        window = [time.monotonic_ns(), 0]
        try:
            if args.client == "wrk":
                done, wall = load_wrk(server, args)
            else:
                done, wall = args.requests, load(server, args)
            window[1] = time.monotonic_ns()
            # Read before a paused exporter resumes: the load's figures only.
            cpu = {role: cpu_s(pid) - before[role] for role, pid in pids.items()}
            idle = idle_shares(stat_before, cpu_times())
            by_exporter = {p: cpu_s(p) - before_exp[p] for p in exporters}
        finally:
            signal_all(paused, signal.SIGCONT)
        delivered: dict[str, int] = {}
        if exporters:
            # Until the exporters have delivered the round's journeys: at
            # SCHED_IDLE on a busy CPU they do part of the work after the load.
            got = delivered_when_quiet(args.receiver, first_request, done)
            delivered = {
                f"{owners[p]}'s": round((cpu_s(p) - before_exp[p]) / n * 1e6)
                for p in exporters
                if (n := got[owners[p]])
            }
        if exporters:
            cpu["exporters"] = sum(by_exporter.values())
        row = {
            "mode": mode,
            "requests": done,
            "requests_per_s": round(done / wall, 1),
            "cpu_us_per_request": {k: round(v / done * 1e6) for k, v in cpu.items()},
            "exporter_processes": len(exporters),
            # Each exporter by whose records it takes (the engine core's, the API server's).
            "exporter_cpu_us_per_request": {
                f"{owners[p]}'s": round(v / done * 1e6) for p, v in by_exporter.items()
            },
            "exporter_cpu_us_per_journey_delivered": delivered,
            "cpu_idle_and_steal_share": idle,
        }
        if args.threads:
            tafter = {role: threads(pid) for role, pid in pids.items()}
            row["threads"] = {r: thread_delta(tbefore[r], tafter[r], 4) for r in pids}
            row["exporter_threads"] = {
                f"{owners[p]}'s": thread_delta(tbefore_exp[p], threads(p), 6) for p in exporters
            }
            # Ours: the threads at nice 19 (the drain thread; vLLM runs none there).
            row["our_threads"] = {
                r: [
                    t
                    for t in thread_delta(tbefore[r], tafter[r], 1000)
                    if _nice(pid, t["tid"]) == 19
                ]
                for r, pid in pids.items()
            }
    finally:
        server.stop()
        settle(exporters)
    if getattr(args, "gc_out", None) and row:
        row["api_server_gc"] = gc_in_window(args.gc_out / f"{pids['api_server']}.txt", window, done)
    if row:
        row["gauge_ns"] = args.gauge.mean_ns(window)
    if env.get("VLLM_JOURNEY_OTEL") != "0":
        row["exported"] = exported(args.receiver, first_request)
    return row


def gc_in_window(path: Path, window: list[int], requests: int) -> dict[str, Any]:
    """The API server's collections that started during the load (gc_probe's
    file): per generation, how many and their time per
    request, µs of the API server's CPU (``cpu``) and of the clock (``wall``:
    with the time it was preempted meanwhile)."""
    if not path.exists():
        return {"missing": str(path)}
    seen = [tuple(map(int, line.split())) for line in path.read_text().splitlines()]
    inside = [(w, c, g, n) for s, w, c, g, n in seen if window[0] <= s < window[1]]

    def per_request(ns: int) -> float:
        return round(ns / requests / 1e3, 1)

    out: dict[str, Any] = {
        "cpu_us_per_request": per_request(sum(c for _, c, _, _ in inside)),
        "wall_us_per_request": per_request(sum(w for w, _, _, _ in inside)),
    }
    for g in (0, 1, 2):
        mine = [(w, c, n) for w, c, h, n in inside if h == g]
        out[f"gen{g}"] = {
            "collections": len(mine),
            "cpu_us_per_request": per_request(sum(c for _, c, _ in mine)),
            "cpu_us_per_collection": round(sum(c for _, c, _ in mine) / len(mine) / 1e3, 1)
            if mine
            else None,
            # Cyclic garbage the collections freed, per request (the rest of
            # what a request allocates is freed by reference counting).
            "collected_per_request": round(sum(n for _, _, n in mine) / requests, 2),
        }
    return out


def _gc_quantiles(rows: list[dict[str, Any]], key: Any) -> dict[str, float] | None:
    values = [key(row["api_server_gc"]) for row in rows if "gen2" in row.get("api_server_gc", {})]
    return quantiles(values) if values else None


def delivered_when_quiet(receiver: Receiver, first: int, done: int) -> Counter[str]:
    """Journeys at the receiver by whose exporter sent them ("engine_core",
    "api_server"), once the engine's are at least ``done`` and nothing more has
    come for QUIET_S (the requests in flight when the load stopped, too)."""
    from vllm_journey_otel import schema as S

    owner = {S.SPAN_REQUEST: "engine_core", S.SPAN_API: "api_server"}
    counts: Counter[str] = Counter()
    seen, last_change = first, time.monotonic()

    def quiet() -> bool:
        nonlocal seen, last_change
        with receiver.lock:
            new = receiver.requests[seen:]
        seen += len(new)
        for req in new:
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        if span.name in owner:
                            counts[owner[span.name]] += 1
        now = time.monotonic()
        if new:
            last_change = now
        return counts["engine_core"] >= done and now - last_change >= QUIET_S

    wait_until(quiet, 120, 0.25, "the round's journeys at the receiver")
    return counts


# The exporters read every 0.5 s and batch for 0.5 s (their defaults): nothing
# new for this long means they have delivered what they had.
QUIET_S = 2.0


def exported(receiver: Receiver, first: int) -> dict[str, int]:
    """The round's journeys at the receiver (its exporters have exited: all
    delivered), and the largest drop count their roots reported: a mode that
    kept up by dropping journeys is not free."""
    from vllm_journey_otel import schema as S

    counts: Counter[str] = Counter()
    dropped = 0
    with receiver.lock:
        requests = receiver.requests[first:]
    for req in requests:
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    if span.name in (S.SPAN_REQUEST, S.SPAN_API):
                        counts[span.name] += 1
                        for kv in span.attributes:
                            if kv.key == S.TRACER_DROPPED_JOURNEYS:
                                dropped = max(dropped, kv.value.int_value)
    return {
        "engine_journeys": counts[S.SPAN_REQUEST],
        "api_journeys": counts[S.SPAN_API],
        "dropped_journeys": dropped,
    }


def cpu_times() -> dict[str, list[int]]:
    """Each CPU's counters from /proc/stat (user nice system idle iowait irq softirq steal)."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            out[name] = [int(f) for f in fields[:8]]
    return out


def idle_shares(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, str]:
    """Per CPU, the share of the load's time it was idle and the share stolen
    by the hypervisor: a CPU with idle time is not what limits the server."""
    shares = {}
    for cpu, before in a.items():
        delta = [y - x for x, y in zip(before, b[cpu], strict=True)]
        total = sum(delta) or 1
        shares[cpu] = f"idle {delta[3] / total:.1%}, steal {delta[7] / total:.1%}"
    return shares


def _nice(pid: int, tid: object) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[16])  # field 19: nice


def settle(exporters: list[int]) -> None:
    """Until the round's exporter processes have exited (they are detached and
    outlive the server to export what they hold): the next round's server must
    not share the CPUs with them."""
    import psutil

    wait_until(lambda: not any(psutil.pid_exists(p) for p in exporters), 60, 0.1, "exporters")


def within_round(rows: list[dict[str, Any]], a: str, b: str, key: Any) -> dict[str, float] | None:
    """Quantiles of key(row of a) / key(row of b), paired by round."""
    by_round: dict[int, dict[str, float]] = {}
    for row in rows:
        value = key(row)
        if value:
            by_round.setdefault(row["round"], {})[row["mode"]] = value
    pairs = [r[a] / r[b] for r in by_round.values() if a in r and b in r]
    out = quantiles(pairs)
    if out is not None and len(pairs) >= 5:
        out["median_90ci"] = median_interval(pairs)
    return out


def median_interval(values: list[float], draws: int = 4000) -> tuple[float, float]:
    """A 90 % bootstrap interval of the median (rounds resampled with
    replacement; a fixed seed, so one run's figures read the same twice): how
    far the median of this many rounds could move. A goal is resolved when the
    A/A control's interval is narrower than the margin, and the mode's interval
    is on one side of it."""
    import random

    rng = random.Random(1)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return round(medians[int(0.05 * draws)], 3), round(medians[int(0.95 * draws) - 1], 3)


def _cpu_medians(rows: list[dict[str, Any]]) -> dict[str, int] | None:
    if not rows:
        return None
    return {
        p: round(statistics.median(row["cpu_us_per_request"].get(p, 0) for row in rows))
        for p in PROCESSES
        if any(p in row["cpu_us_per_request"] for row in rows)
    }


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _by_owner(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Quantiles over rounds of each exporter's figure ``key`` (by owner)."""
    owners = sorted({o for row in rows for o in row.get(key, {})})
    return {o: quantiles([v for row in rows if (v := row.get(key, {}).get(o))]) for o in owners}


def report(rows: list[dict[str, Any]], modes: list[str], failed: Counter[str]) -> dict[str, Any]:
    fastest = max(row["requests_per_s"] for row in rows)
    out: dict[str, Any] = {
        "slow_round": f"requests/s < the fastest round's / {SLOW_FACTOR} ({fastest:.0f} / "
        f"{SLOW_FACTOR}): here the load client sharing the API server's and engine core's CPU "
        "(docs/performance.md), whichever mode it runs"
    }
    for mode in modes:
        mine = [row for row in rows if row["mode"] == mode]
        fast = [row for row in mine if row["requests_per_s"] * SLOW_FACTOR >= fastest]
        out[mode] = {
            "rounds": len(mine),
            "failed_rounds": failed[mode],
            "slow_rounds": len(mine) - len(fast),
            "requests_per_s": quantiles([row["requests_per_s"] for row in mine]),
            "cpu_us_per_request_median": _cpu_medians(mine),
            "exporter_cpu_us_per_request_median": {
                owner: _median([row["exporter_cpu_us_per_request"].get(owner, 0) for row in mine])
                for owner in sorted({o for row in mine for o in row["exporter_cpu_us_per_request"]})
            },
            # From the load's start until the round's journeys were delivered.
            "exporter_cpu_us_per_journey_delivered": _by_owner(
                mine, "exporter_cpu_us_per_journey_delivered"
            ),
            "server_cpu_us_per_request_median": _median(
                [sum(row["cpu_us_per_request"].values()) for row in mine]
            ),
            "journeys_exported_per_request": _median(
                [
                    row["exported"]["engine_journeys"] / row["requests"]
                    for row in mine
                    if "exported" in row
                ]
            ),
            "dropped_journeys_max": max(
                (row["exported"]["dropped_journeys"] for row in mine if "exported" in row),
                default=None,
            ),
            # --gc: None without it (or where no round's probe file was found).
            "api_server_gc_cpu_us_per_request": _gc_quantiles(
                mine, lambda g: g["cpu_us_per_request"]
            ),
            "api_server_gc_wall_us_per_request": _gc_quantiles(
                mine, lambda g: g["wall_us_per_request"]
            ),
            "api_server_gen0_cpu_us_per_collection": _gc_quantiles(
                mine, lambda g: g["gen0"]["cpu_us_per_collection"] or 0.0
            ),
            "api_server_full_collections_per_round": _gc_quantiles(
                mine, lambda g: g["gen2"]["collections"]
            ),
            "gauge_ns": {
                cpu: quantiles([row["gauge_ns"][cpu] for row in mine if cpu in row["gauge_ns"]])
                for cpu in sorted({c for row in mine for c in row.get("gauge_ns", {})})
            },
            "requests_per_s_fast_rounds": quantiles([row["requests_per_s"] for row in fast]),
            "cpu_us_per_request_median_fast_rounds": _cpu_medians(fast),
        }
    ratios: dict[str, Any] = {}
    for mode in modes:
        if mode == "off" or "off" not in modes:
            continue
        ratios[f"{mode}/off"] = {
            "requests_per_s": within_round(rows, mode, "off", lambda r: r["requests_per_s"]),
            "server_cpu_per_request (every process)": within_round(
                rows, mode, "off", lambda r: sum(r["cpu_us_per_request"].values())
            ),
            "api_server_cpu_per_request": within_round(
                rows, mode, "off", lambda r: r["cpu_us_per_request"]["api_server"]
            ),
            "engine_core_cpu_per_request": within_round(
                rows, mode, "off", lambda r: r["cpu_us_per_request"].get("engine_core")
            ),
        }
    out["ratios (within each round; off-2/off is the A/A control)"] = ratios
    if any(row.get("gauge_ns") for row in rows):
        out["speed-adjusted ratios to off (speed_adjusted.py)"] = speed_adjusted.ratios(rows)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--requests", type=int, default=384)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument(
        "--client",
        choices=("wrk", "python"),
        default="wrk" if shutil.which("wrk") else "python",
        help="wrk (Debian's wrk: one C thread, for --seconds) or python (httpx threads, "
        "--requests requests; its own CPU use competes with the server's)",
    )
    p.add_argument("--seconds", type=int, default=8, help="wrk: the load's duration")
    p.add_argument("--modes", default="off,off-2,on,api-off")
    p.add_argument("--threads", action="store_true", help="per-thread scheduler figures per round")
    p.add_argument(
        "--gc",
        action="store_true",
        help="the API server's garbage collections during the load (benchmarks/gc_probe on "
        "every server's PYTHONPATH, every mode alike)",
    )
    p.add_argument(
        "--before",
        metavar="SRC",
        help="also run 'before': the defaults with the package from SRC (a checkout's src/ of "
        "the code to compare against, e.g. from `git worktree add /tmp/before HEAD~3`)",
    )
    p.add_argument(
        "--pin",
        metavar="WORKER:REST",
        type=lambda text: tuple(text.split(":", 1)),
        help="place every round alike: the model worker's threads on CPUs WORKER "
        "(VLLM_CPU_OMP_THREADS_BIND), the API server, engine core and exporters on CPUs "
        "REST (taskset), e.g. 0:1; the client: --pin-client",
    )
    p.add_argument(
        "--pin-client",
        metavar="CPUS",
        help="wrk on CPUS (taskset), e.g. 0 (beside the model worker with --pin 0:1): the "
        "client placed alike in every round too (wrk only)",
    )
    args = p.parse_args()
    if args.pin_client and args.client != "wrk":
        p.error("--pin-client places wrk: use it with --client wrk")
    args.model = build(ROOT / ".cache" / "tiny-llama")
    receiver = Receiver()
    receiver.start_grpc()
    args.receiver = receiver
    from vllm_journey_otel.config import API_SPANS, EXPORT_INTERVAL_MS, Batching, Config

    on = {
        # The test fixture shortens the export delays; back to the product's defaults.
        EXPORT_INTERVAL_MS: str(Config().export_interval_ms),
        "OTEL_BSP_SCHEDULE_DELAY": str(int(Batching().delay_ms)),
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{receiver.grpc_port}",
    }
    catalogue = {
        "off": {"VLLM_JOURNEY_OTEL": "0"},
        "off-2": {"VLLM_JOURNEY_OTEL": "0"},
        "on": dict(on),
        "api-off": {**on, API_SPANS: "0"},
        "on-paused": dict(on),
    }
    modes = args.modes.split(",")
    if args.before:  # PYTHONPATH comes before the editable install's path entry
        catalogue["before"] = {**on, "PYTHONPATH": str(Path(args.before).resolve())}
        if "before" not in modes:
            modes.append("before")
    unknown = [m for m in modes if m not in catalogue]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; known: {sorted(catalogue)}")
    tmp = Path(tempfile.mkdtemp(prefix="serve-short-"))
    if args.gc:
        args.gc_out = tmp / "gc"
        args.gc_out.mkdir()
        probe = str(ROOT / "benchmarks" / "gc_probe")
        for env in catalogue.values():
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [probe, env.get("PYTHONPATH")]))
            env["VJO_GC_PROBE_OUT"] = str(args.gc_out)
    failed: Counter[str] = Counter()
    args.gauge = Gauge(tmp)
    try:
        one_round(modes[0], catalogue[modes[0]], args, tmp, -1)  # warm-up, not counted
        rows = rotated(
            modes,
            args.rounds,
            lambda mode, r: one_round(mode, catalogue[mode], args, tmp, r),
            failed,
        )
    finally:
        receiver.stop()
        args.gauge.stop()
    if not rows:
        raise SystemExit(f"every round failed: {dict(failed)} (see the messages above)")
    print(json.dumps({"rounds": args.rounds, "requests": args.requests,
                      "concurrency": args.concurrency, "tokens": args.tokens,
                      **report(rows, modes, failed)}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
