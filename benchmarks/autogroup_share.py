"""How much of a busy CPU a SCHED_IDLE exporter takes, by the session it runs in.

On one CPU (``taskset``), a busy program at vLLM's priority (nice 0, the
"server": this benchmark's own session) and a busy program at SCHED_IDLE (the
"exporter", the policy our exporter process runs at) run side by side for
SECONDS; the CPU time each got is read from /proc. The exporter is started two
ways, in turn, ROUNDS times:

* ``launcher``: by the product's own launcher (``engine/exporter_launch.launch``,
  as the engine core and the API server start their exporters);
* ``new-session``: in a session of its own (``setsid``).

Where the kernel groups tasks by session (``/proc/sys/kernel/sched_autogroup_enabled``
is 1, and the processes are outside any CPU cgroup), a new session is a new
scheduler group, and groups share a CPU as equals whatever their tasks' policy:
SCHED_IDLE then only ranks the exporter among its own threads. In the server's
session it ranks it against the server.

    .venv/bin/python benchmarks/autogroup_share.py [--rounds 3] [--seconds 3] [--cpu 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from vllm_journey_otel.engine.exporter_launch import launch

SPIN = "while True: pass"
# The "exporter": SCHED_IDLE as export/cpu_placement.py makes the real one, then busy.
IDLE_SPIN = "import os\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n" + SPIN


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def autogroup(pid: int) -> str:
    """``/autogroup-N``, or "-" where the task has none (no file: a kernel
    without autogroup; an empty one: a task in a CPU cgroup)."""
    try:
        fields = Path(f"/proc/{pid}/autogroup").read_text().split()
    except OSError:
        return "-"
    return fields[0] if fields else "-"


def start_exporter(how: str, cpu: int) -> tuple[int, int | None]:
    """The exporter's pid, and the fd that keeps the launcher's pipe open (or None)."""
    argv = ["taskset", "-c", str(cpu), sys.executable, "-c", IDLE_SPIN]
    if how == "launcher":
        fd, pid = launch(argv, dict(os.environ), None)
        assert pid is not None, "the launcher gave no pid"
        return pid, fd
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
    return proc.pid, None


def one(how: str, seconds: float, cpu: int) -> dict[str, object]:
    server = subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c", SPIN])
    pid, fd = start_exporter(how, cpu)
    try:
        time.sleep(0.5)  # both started and busy
        s0, e0, t0 = cpu_s(server.pid), cpu_s(pid), time.monotonic()
        time.sleep(seconds)
        s1, e1, t1 = cpu_s(server.pid), cpu_s(pid), time.monotonic()
        row = {
            "exporter_started_by": how,
            "exporter_in_servers_session": os.getsid(pid) == os.getsid(server.pid),
            "autogroups": f"server {autogroup(server.pid)}, exporter {autogroup(pid)}",
            "server_cpu_share": round((s1 - s0) / (t1 - t0), 3),
            "exporter_cpu_share": round((e1 - e0) / (t1 - t0), 3),
        }
    finally:
        for p in (server.pid, pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, 9)
        server.wait()
        if fd is not None:
            os.close(fd)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--cpu", type=int, default=max(os.sched_getaffinity(0)))
    args = p.parse_args()
    try:
        enabled = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
    except OSError:
        enabled = "absent (kernel without autogroup)"
    rows = [
        one(how, args.seconds, args.cpu)
        for _ in range(args.rounds)
        for how in ("launcher", "new-session")
    ]
    print(json.dumps({"sched_autogroup_enabled": enabled, "cpu": args.cpu, "rounds": rows},
                     indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
