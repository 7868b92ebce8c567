"""What a user of one `vllm serve` sees: wall time and tokens/s, plugin off vs on.

One server at a time, a fresh one per round, the modes alternating (rotated each
round, so none always follows the same one). Each round starts the server, waits
for /health and one short warm-up request, then sends CONCURRENCY completions of
TOKENS tokens (ignore_eos) at once and times them to the last response. Per
mode it prints wall time and output tokens/s (median, p10, p90), how many
rounds fell into the slow mode (wall over SLOW_FACTOR x the fastest round of
the whole run), and the CPU seconds each process used during the load: API
server, engine core, model worker and (plugin on) the exporter processes together
(the engine core's and the API server's).

It reports the exporter's scheduling policy, nice value and allowed CPUs. With
``--threads`` it also prints, per round, each process's busiest threads (time on
a CPU, time runnable but waiting for one, involuntary switches) and samples,
every few ms during the load, on which CPU each thread runs: for the engine
core's busiest thread, the share of its running samples on a CPU where a thread
of the model worker was running at the same moment. The sampler is a thread of
the benchmark taking CPU itself: compare modes within one run only.

Modes (``--modes``, comma-separated):

* off: plain `vllm serve` (``off-2``: the same again, the A/A control);
* on: `VLLM_JOURNEY_OTEL=1` with the product's defaults, OTLP gRPC to a receiver here;
* on-unyielding: as on, but the exporter keeps normal CPU priority and every
  CPU (``VLLM_JOURNEY_OTEL_CPU_PRIORITY=normal``, ``VLLM_JOURNEY_OTEL_EXPORTER_CPUS=all``);
* thread: as on, with ``VLLM_JOURNEY_OTEL_EXPORT_MODE=thread``.

    .venv/bin/python benchmarks/serve_rounds.py [--rounds 9] [--modes off,on,on-unyielding]
        [--concurrency 32] [--tokens 256]

(`serve_bench.py` keeps three servers up side by side and compares throughput
within a round; that one shows steady-state cost on a warm machine, not what a
freshly started server does.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fixtures.tiny_model import build  # noqa: E402
from otlp_receiver import Receiver  # noqa: E402
from services import VllmServer, http_json  # noqa: E402

SLOW_FACTOR = 2.5
TICK_S = 0.004
CLK_TCK = os.sysconf("SC_CLK_TCK")


def quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return {"median": round(statistics.median(v), 3), "p10": round(pick(0.1), 3),
            "p90": round(pick(0.9), 3)}  # fmt: skip


def _stat(path: str) -> list[str] | None:
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    # comm may hold spaces: fields after the closing parenthesis
    return text[text.rindex(")") + 2 :].split()


def cpu_s(pid: int) -> float:
    f = _stat(f"/proc/{pid}/stat")
    return 0.0 if f is None else (int(f[11]) + int(f[12])) / CLK_TCK


def _ppid_comm() -> dict[int, tuple[int, str, str]]:
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            comm = Path(f"/proc/{entry}/comm").read_text().strip()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        f = _stat(f"/proc/{entry}/stat")
        if f is not None:
            out[int(entry)] = (int(f[1]), comm, cmd)
    return out


def roles(server_pid: int) -> dict[str, Any]:
    """API server, engine core and worker pids of the one server running, and
    under "exporters" the pids of its exporter processes (the engine core's and
    each API server's)."""
    procs = _ppid_comm()
    found: dict[str, Any] = {"api_server": server_pid, "exporters": []}
    kids = [p for p, (pp, _, _) in procs.items() if pp == server_pid]
    for p in kids:
        if "EngineCore" in procs[p][1] or "EngineCore" in procs[p][2]:
            found["engine_core"] = p
    core = found.get("engine_core")
    for p, (pp, comm, cmd) in procs.items():
        if core is not None and pp == core and "exporter" not in cmd and "Worker" in comm + cmd:
            found["worker"] = p
        if "vllm_journey_otel.export.exporter_process" in cmd:
            found["exporters"].append(p)
    # This server's only (its API server's or engine core's): a signal meant for
    # them must not reach another run's exporters on the host.
    found["exporters"] = [p for p in found["exporters"] if exporter_owner(p, found) != "unknown"]
    return found


def exporter_owner(exporter: int, pids: dict[str, Any]) -> str:
    """Whose records an exporter process takes: the role of the process whose
    pid its resource names (the first argument it is started with)."""
    try:
        argv = Path(f"/proc/{exporter}/cmdline").read_bytes().split(b"\0")
        owner = json.loads(argv[argv.index(b"vllm_journey_otel.export.exporter_process") + 1])
    except (OSError, ValueError, IndexError):
        return "unknown"
    for role, pid in pids.items():
        if pid == owner.get("process.pid"):
            return role
    return "unknown"


class Placement(threading.Thread):
    """Samples the CPU each running thread of the server's processes is on."""

    def __init__(self, pids: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.stop = threading.Event()
        self.samples = 0
        self.running: Counter[tuple[str, int]] = Counter()  # (role, tid) -> R samples
        self.shared: Counter[tuple[str, int]] = Counter()  # ... on a CPU a worker thread ran on
        self.hist: dict[tuple[str, int], Counter[int]] = {}  # (role, tid) -> CPU -> R samples

    def _tasks(self, pid: int) -> list[tuple[int, str, int]]:
        rows = []
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return rows
        for tid in tids:
            f = _stat(f"/proc/{pid}/task/{tid}/stat")
            if f is not None:
                rows.append((int(tid), f[0], int(f[36])))
        return rows

    def run(self) -> None:
        while not self.stop.wait(TICK_S):
            snap = {role: self._tasks(pid) for role, pid in self.pids.items()}
            worker_cpus = {cpu for _, st, cpu in snap.get("worker", []) if st == "R"}
            self.samples += 1
            for role, rows in snap.items():
                for tid, st, cpu in rows:
                    if st == "R":
                        self.running[(role, tid)] += 1
                        self.hist.setdefault((role, tid), Counter())[cpu] += 1
                        if role != "worker" and cpu in worker_cpus:
                            self.shared[(role, tid)] += 1

    def engine_on_worker_cpu(self) -> float | None:
        """Share of the engine core's busiest thread's running samples on a
        CPU a worker thread was running on."""
        mine = [(n, key) for key, n in self.running.items() if key[0] == "engine_core"]
        if not mine:
            return None
        n, key = max(mine)
        return round(self.shared[key] / n, 3) if n else None


def threads(pid: int) -> dict[int, tuple[str, int, int, int]]:
    """Per thread: comm, ns on a CPU, ns runnable but waiting for one, involuntary switches."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            run_ns, wait_ns, _ = (int(x) for x in Path(base + "/schedstat").read_text().split())
            comm = Path(base + "/comm").read_text().strip()
            status = Path(base + "/status").read_text()
        except (OSError, ValueError):
            continue
        m = re.search(r"nonvoluntary_ctxt_switches:\s+(\d+)", status)
        out[int(tid)] = (comm, run_ns, wait_ns, int(m.group(1)) if m else 0)
    return out


def thread_delta(before: dict, after: dict, top: int = 3) -> list[dict[str, object]]:
    rows = []
    for tid, (comm, run, wait, inv) in after.items():
        b = before.get(tid, (comm, 0, 0, 0))
        rows.append({"tid": tid, "comm": comm, "run_ms": round((run - b[1]) / 1e6, 1),
                     "runqueue_wait_ms": round((wait - b[2]) / 1e6, 1),
                     "involuntary_switches": inv - b[3]})  # fmt: skip
    rows.sort(key=lambda r: -r["run_ms"])  # type: ignore[operator]
    return rows[:top]


def scheduling(pid: int) -> dict[str, object]:
    """Policy, nice and allowed CPUs of a process (its main thread)."""
    names = {0: "normal", 3: "batch", 5: "idle"}
    try:
        policy = os.sched_getscheduler(pid)
        return {
            "policy": names.get(policy, str(policy)),
            "nice": os.getpriority(os.PRIO_PROCESS, pid),
            "cpus": sorted(os.sched_getaffinity(pid)),
        }
    except OSError as exc:
        return {"error": str(exc)}


def one_round(mode: str, env: dict[str, str], args: argparse.Namespace, tmp: Path, n: int):
    import httpx

    # float32: in bfloat16 (the CPU platform's choice where the CPU has
    # AVX512-BF16) vLLM 0.32's worker died at the first step of the 4-token
    # warm-up prompt on a 2-vCPU Intel Xeon guest with AMX, in every mode
    # (plugin off too); tests/pd_serving.py does the same for the same reason.
    server = VllmServer(args.model, tmp / f"{mode}-{n}.log", env, args=["--dtype", "float32"])
    try:
        server.wait_ready()
        body = {"model": server.model, "max_tokens": args.tokens, "ignore_eos": True}
        http_json(server.url + "/v1/completions", {**body, "prompt": "warm", "max_tokens": 4})
        pids = roles(server.pid)
        exporters = pids.pop("exporters")
        before = {role: cpu_s(pid) for role, pid in pids.items()}
        before_exp = sum(cpu_s(pid) for pid in exporters)
        tbefore = {role: threads(pid) for role, pid in pids.items()}
        placement = Placement(pids)
        http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=args.concurrency))

        def one(i: int) -> int:
            r = http.post(server.url + "/v1/completions", json={**body, "prompt": f"bench {i}"})
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        if args.threads:
            placement.start()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            out = sum(pool.map(one, range(args.concurrency)))
        wall = time.perf_counter() - t0
        tafter = {role: threads(pid) for role, pid in pids.items()}
        placement.stop.set()
        if args.threads:
            placement.join()
        http.close()
        assert out == args.concurrency * args.tokens, out
        row = {
            "mode": mode,
            "wall_s": round(wall, 3),
            "tokens_per_s": round(out / wall, 1),
            "cpu_s": {role: round(cpu_s(pid) - before[role], 2) for role, pid in pids.items()},
        }
        if exporters:  # every exporter process together: the engine core's and the API server's
            row["cpu_s"]["exporters"] = round(sum(cpu_s(pid) for pid in exporters) - before_exp, 2)
            row["exporter_processes"] = len(exporters)
        if args.threads:
            row["engine_on_worker_cpu"] = placement.engine_on_worker_cpu()
            row["threads"] = {r: thread_delta(tbefore[r], tafter[r]) for r in pids}
            row["cpu_hist"] = {f"{k[0]}:{k[1]}": v for k, v in placement.hist.items()}
        if exporters:
            row["exporter"] = scheduling(exporters[0])
        return row
    finally:
        server.stop()


def rotated(modes: list[str], rounds: int, run: Any, failed: Counter[str]) -> list[dict[str, Any]]:
    """``run(mode, round)`` for each mode in each round, the order rotated each
    round (none always follows the same one); each row is printed as it comes.
    A failed round is counted in ``failed`` and said, never averaged."""
    rows = []
    for r in range(rounds):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            try:
                row = run(mode, r)
            except Exception as exc:
                failed[mode] += 1
                print(f"round {r} {mode}: failed: {exc!r}", file=sys.stderr, flush=True)
                continue
            row["round"] = r
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--modes", default="off,on,on-unyielding")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--threads", action="store_true", help="per-thread scheduler figures per round")
    args = p.parse_args()
    args.model = build(ROOT / ".cache" / "tiny-llama")
    receiver = Receiver()
    receiver.start_grpc()
    from vllm_journey_otel.config import Batching, Config

    on = {
        # The test fixture shortens the export delays; back to the product's defaults.
        "VLLM_JOURNEY_OTEL_EXPORT_INTERVAL_MS": str(Config().export_interval_ms),
        "OTEL_BSP_SCHEDULE_DELAY": str(int(Batching().delay_ms)),
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{receiver.grpc_port}",
    }
    catalogue = {
        "off": {"VLLM_JOURNEY_OTEL": "0"},
        "off-2": {"VLLM_JOURNEY_OTEL": "0"},  # off again: the A/A control
        "on": on,
        "on-unyielding": {
            **on,
            "VLLM_JOURNEY_OTEL_CPU_PRIORITY": "normal",
            "VLLM_JOURNEY_OTEL_EXPORTER_CPUS": "all",
        },
        "thread": {**on, "VLLM_JOURNEY_OTEL_EXPORT_MODE": "thread"},
    }
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in catalogue]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; known: {sorted(catalogue)}")
    tmp = Path(tempfile.mkdtemp(prefix="serve-rounds-"))
    failed: Counter[str] = Counter()
    try:
        rows = rotated(
            modes,
            args.rounds,
            lambda mode, r: one_round(mode, catalogue[mode], args, tmp, r),
            failed,
        )
    finally:
        receiver.stop()
    if not rows:
        raise SystemExit(f"every round failed: {dict(failed)} (see the messages above)")
    fastest = min(row["wall_s"] for row in rows)
    report: dict[str, object] = {
        "rounds": args.rounds, "concurrency": args.concurrency, "tokens": args.tokens,
        "slow_mode": f"wall > {SLOW_FACTOR} x the fastest round ({fastest:.2f} s)",
    }  # fmt: skip
    for mode in modes:
        mine = [row for row in rows if row["mode"] == mode]
        share = [row.get("engine_on_worker_cpu") for row in mine]
        report[mode] = {
            "rounds": len(mine),
            "failed_rounds": failed[mode],
            "wall_s": quantiles([row["wall_s"] for row in mine]),
            "tokens_per_s": quantiles([row["tokens_per_s"] for row in mine]),
            "slow_rounds": sum(row["wall_s"] > SLOW_FACTOR * fastest for row in mine),
            "cpu_s_median": {
                role: round(statistics.median(row["cpu_s"].get(role, 0.0) for row in mine), 2)
                for role in ("api_server", "engine_core", "worker", "exporters")
                if any(role in row["cpu_s"] for row in mine)
            },
            "engine_on_worker_cpu": quantiles([s for s in share if s is not None]),
            "exporter": mine[-1].get("exporter") if mine else None,
        }
    from serve_short import within_round  # (serve_short imports this module)

    base = report.get("off")
    if isinstance(base, dict) and base["wall_s"]:
        for mode in modes:
            entry = report[mode]
            if mode != "off" and isinstance(entry, dict) and entry["wall_s"]:
                entry["median_wall_vs_off"] = round(
                    entry["wall_s"]["median"] / base["wall_s"]["median"], 3
                )
                # Paired within a round (with its bootstrap interval from 5 rounds).
                entry["wall_vs_off_within_a_round"] = within_round(
                    rows, mode, "off", lambda row: row["wall_s"]
                )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
