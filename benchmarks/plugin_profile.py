"""Where the plugin's CPU goes in one busy `vllm serve`: shares of sampled stacks.

Why: on this machine a process's CPU time per request moves ±10 % from one
window to the next with the CPUs' speed, which hides a 2 % cost. The share of
a process's own samples that falls in our code does not move with the speed
(a slower CPU slows vLLM's code and ours alike), and its sampling error is
known: with N samples of which k are ours, about sqrt(k)/N.

What: the busy server of ``plugin_toggle.py`` (one `vllm serve` of the tiny
CPU model, the plugin on, ``wrk`` keeping CONCURRENCY short requests in flight,
placed as ``serve_short.py --pin 0:1 --pin-client 0``), switched through
STATES in turn (``toggle_probe``: ``on`` the defaults, ``off`` the plugin
switched off, the control: what the attribution charges us when our code does
next to nothing), SECONDS each, ROUNDS times. In each window ``py-spy`` (``pip
install py-spy``; on any CPU: pinned beside the model worker it slows the whole
server) samples the API server and the
engine core at RATE Hz, and the window's requests (vLLM's own
``vllm:request_success_total``) and every process's CPU are read. A sample is
ours when its innermost frame is ours, or when the deepest frame of ours calls
something other than vLLM and the web stack it serves (OpenTelemetry, the
standard library): a wrapper of ours that calls vLLM's own method is vLLM's
work, not ours. Samples that wait (a thread asleep in a lock or a selector,
which py-spy sometimes reports as running) count for nobody. py-spy samples a
thread while it runs or waits for a CPU: on a saturated CPU a wait is charged
to the line where the kernel preempted the thread (more often a system call
than anything else), so ``off``'s share, where our code does next to
nothing, is the attribution's floor. Per process and
state it prints the samples, our share with its sampling error, our share in
CPU µs per request (the share times the process's CPU per request), and our
lines that took the most samples; per state the exporters' CPU per request
during the window (their own work, measured directly).

    .venv/bin/python benchmarks/plugin_profile.py [--seconds 15] [--rounds 3]
        [--rate 100] [--states on,api-off,off] [--concurrency 48] [--tokens 8]
        [--env NAME=VALUE ...] [--server-session shared|own]

Times: the windows are this process's ``time.monotonic``; py-spy's samples are
counts, not times.
"""

from __future__ import annotations

import argparse
import json
import linecache
import math
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from plugin_toggle import STATES, add_server_session, busy_server, finished, switch  # noqa: E402
from serve_rounds import cpu_s  # noqa: E402

from otlp_receiver import Receiver  # noqa: E402

OURS = "vllm_journey_otel/"
# Callees that make a frame of ours a pass-through to the work it serves.
SERVED = ("vllm/", "starlette/", "fastapi/", "uvicorn/", "pydantic", "prometheus_fastapi")
# Innermost functions of a thread that waits (not running, whatever py-spy says).
WAITS = frozenset(("wait", "select", "poll", "_recv_msg", "sleep"))
# Calls into C that block, on the innermost Python frame's line: py-spy shows
# no frame for them (the drain thread's select on a full pipe is its line in
# pipe_sink.py), so the line's own text says the thread waits there.
BLOCKING_CALLS = ("select.select(", ".wait(", "time.sleep(", ".acquire(timeout")
PROCESSES = ("api_server", "engine_core")


def _blocks(frame: str) -> bool:
    """Whether the frame (``function (path:line)``) stands on a blocking call."""
    where = frame[frame.rfind("(") + 1 :].rstrip(")")
    path, _, line = where.rpartition(":")
    if not line.isdigit() or OURS not in path:
        return False
    text = linecache.getline(str(ROOT / "src" / path[path.find(OURS) :]), int(line))
    return any(call in text for call in BLOCKING_CALLS)


def classify(stack: list[str]) -> tuple[str, str | None]:
    """("wait" | "ours" | "vllm", our deepest frame where it is ours)."""
    if stack[-1].split(" (", 1)[0].rsplit(".", 1)[-1] in WAITS or _blocks(stack[-1]):
        return "wait", None
    mine = [i for i, frame in enumerate(stack) if OURS in frame]
    if not mine:
        return "vllm", None
    deepest = mine[-1]
    if deepest == len(stack) - 1:
        return "ours", stack[deepest]
    callee = stack[deepest + 1]
    where = callee[callee.rfind("(") + 1 :]
    if where.startswith(SERVED):
        return "vllm", None
    return "ours", stack[deepest]


def read_raw(path: Path) -> tuple[Counter[str], Counter[str]]:
    """py-spy's raw output: samples per class, and ours per frame."""
    kinds: Counter[str] = Counter()
    lines: Counter[str] = Counter()
    if not path.exists():
        return kinds, lines
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        kind, frame = classify(stack.split(";"))
        kinds[kind] += int(count)
        if frame is not None:
            lines[frame[frame.find(OURS) :].rstrip(")") if OURS in frame else frame] += int(count)
    return kinds, lines


def spy_on(pid: int, out: Path, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    """py-spy sampling ``pid`` for the window (any CPU: pinned beside the model
    worker it would slow the whole server)."""
    spy = shutil.which("py-spy") or str(ROOT / ".venv" / "bin" / "py-spy")
    argv = [spy, "record", "-p", str(pid), "-d", str(args.seconds), "-r", str(args.rate),
            "-f", "raw", "-o", str(out), "--nonblocking"]  # fmt: skip
    with open(out.with_suffix(".err"), "wb") as err:  # why a window has no samples
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)


def window(
    server: Any, pids: dict[str, Any], args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    """One window: py-spy on both processes, requests and CPU counted."""
    files = {role: out.with_name(f"{out.name}-{role}.txt") for role in PROCESSES}
    everyone = [pids[r] for r in PROCESSES] + pids["exporters"]
    t0, n0, cpu0 = time.monotonic(), finished(server), {p: cpu_s(p) for p in everyone}
    spies = [spy_on(pids[role], files[role], args) for role in PROCESSES]
    for s in spies:
        s.wait(timeout=args.seconds + 60)
    t1, n1, cpu1 = time.monotonic(), finished(server), {p: cpu_s(p) for p in everyone}
    done = max(n1 - n0, 1.0)
    row: dict[str, Any] = {"requests": done, "seconds": t1 - t0}
    for role in PROCESSES:
        kinds, lines = read_raw(files[role])
        if not kinds:  # py-spy refused (ptrace not allowed?) or the process is gone
            why = files[role].with_suffix(".err")
            tail = why.read_text(errors="replace")[-400:] if why.exists() else ""
            raise SystemExit(f"py-spy took no samples of the {role}: {tail.strip()}")
        row[role] = {
            "cpu_us_per_request": (cpu1[pids[role]] - cpu0[pids[role]]) / done * 1e6,
            "samples": kinds,
            "lines": lines,
        }
    row["exporters_cpu_us_per_request"] = (
        sum(cpu1[p] - cpu0[p] for p in pids["exporters"]) / done * 1e6
    )
    return row


def summarize(rows: list[dict[str, Any]], states: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for state in states:
        mine = [r for r in rows if r["state"] == state]
        per: dict[str, Any] = {"windows": len(mine)}
        for role in PROCESSES:
            kinds: Counter[str] = sum((r[role]["samples"] for r in mine), Counter())
            lines: Counter[str] = sum((r[role]["lines"] for r in mine), Counter())
            running = kinds["ours"] + kinds["vllm"]
            share = kinds["ours"] / running if running else math.nan
            cpu = sum(r[role]["cpu_us_per_request"] for r in mine) / len(mine)
            per[role] = {
                "samples_running": running,
                "samples_waiting": kinds["wait"],
                "our_share_pct": round(100 * share, 2),
                "sampling_error_pct": round(100 * math.sqrt(kinds["ours"]) / running, 2)
                if running
                else None,
                "cpu_us_per_request": round(cpu),
                "ours_us_per_request": round(share * cpu, 1),
                "our_busiest_lines": dict(lines.most_common(8)),
            }
        per["exporters_cpu_us_per_request"] = round(
            sum(r["exporters_cpu_us_per_request"] for r in mine) / len(mine)
        )
        per["requests_per_s"] = round(
            sum(r["requests"] for r in mine) / sum(r["seconds"] for r in mine), 1
        )
        out[state] = per
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3)
    # Faster sampling slows the server it samples (py-spy takes a CPU of its own).
    p.add_argument("--rate", type=int, default=100)
    p.add_argument("--states", type=lambda t: t.split(","), default=["on", "api-off", "off"])
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="one more variable for the server (e.g. VLLM_JOURNEY_OTEL_CPU_PRIORITY=nice)",
    )
    add_server_session(p)
    args = p.parse_args()
    if not args.states or set(args.states) - set(STATES):
        p.error(f"--states: among {', '.join(STATES)}")
    if shutil.which("py-spy") is None and not (ROOT / ".venv" / "bin" / "py-spy").exists():
        p.error("py-spy is not installed: .venv/bin/pip install py-spy")
    receiver = Receiver()
    receiver.start_grpc()
    tmp = Path(tempfile.mkdtemp(prefix="plugin-profile-"))
    rows: list[dict[str, Any]] = []
    total = len(args.states) * args.rounds * (args.seconds + 8) + 30
    try:
        with busy_server(args, receiver, total) as (server, pids, _wrk):
            time.sleep(3.0)  # the load's start, not counted
            for k in range(args.rounds):
                for state in args.states[k % 2 :] + args.states[: k % 2]:
                    switch(args, pids, state)
                    time.sleep(1.0)  # the requests in flight at the switch finish first
                    row = window(server, pids, args, tmp / f"{state}-{k}")
                    rows.append({"state": state, "round": k, **row})
    finally:
        receiver.stop()
    print(json.dumps(summarize(rows, args.states), indent=2))


if __name__ == "__main__":
    main()
