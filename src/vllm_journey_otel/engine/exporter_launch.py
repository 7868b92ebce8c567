"""Starting exporter processes, and starting them again when one dies.

Engine-core process. :func:`launch` runs on the thread that builds the
Scheduler (the first exporters) or on the pipeline's drain thread (a
replacement), never on the engine thread's step path. :class:`Restarts` is the
drain thread's; its times are ``time.monotonic()`` seconds.

The exporter is started through a short-lived launcher so that it is not a
descendant of the engine core: vLLM's ``kill_process_tree`` kills descendants,
and the exporter must outlive the engine core to export what the pipe still
holds. It inherits the engine core's environment, and is told which process
trees hold vLLM's bound threads (:func:`placement_roots`), to keep off their
CPUs (``export/cpu_placement.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing
import os
import subprocess
import sys
from collections import deque

from vllm_journey_otel.config import EXPORTER_CPUS, EXPORTER_PROCESSES, QUEUE_SIZE
from vllm_journey_otel.log import logger
from vllm_journey_otel.wire import Acks

F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux
PIPE_BYTES = 1 << 20


def placement_roots() -> list[int]:
    """The processes whose trees hold vLLM's bound threads.

    This process and its children (the model workers); and, when it was started
    by multiprocessing (vLLM's engine-core process), its parent's tree too,
    where the engine cores of other data-parallel ranks and their workers live.
    """
    roots = [os.getpid()]
    if multiprocessing.parent_process() is not None:
        roots.append(os.getppid())
    return roots


# Starts the exporter in a process group of its own, passing it the fds listed
# in argv[2] (comma-separated), and writes its pid to the fd in argv[1].
#
# A group of its own, in vLLM's session, not a session of its own: a terminal's
# Ctrl-C (sent to the foreground group) stays off it, while it stays in vLLM's
# scheduler autogroup. Where the kernel groups tasks by session
# (/proc/sys/kernel/sched_autogroup_enabled, on by default in many distributions'
# kernels, for tasks outside a CPU cgroup), a new session is a new group that
# competes with vLLM's whole session as an equal: SCHED_IDLE then ranks the
# exporter only among its own threads, and on a busy CPU it takes a share of
# vLLM's time (docs/performance.md, "Free by default"). (preexec_fn, not
# process_group=0: Python 3.10 has no such argument; the launcher has one thread.)
_LAUNCHER = (
    "import os, subprocess, sys\n"
    "keep = [int(f) for f in sys.argv[2].split(',') if f]\n"
    "p = subprocess.Popen(sys.argv[3:], stdin=sys.stdin, preexec_fn=os.setpgrp,"
    " close_fds=True, pass_fds=keep)\n"
    "os.write(int(sys.argv[1]), str(p.pid).encode())\n"
)


def launch(
    argv: list[str], env: dict[str, str], python: str | None, pass_fds: tuple[int, ...] = ()
) -> tuple[int, int | None]:
    """Start one exporter through the launcher (with ``pass_fds`` open in it);
    the write end of its pipe, its pid."""
    read_fd, write_fd = os.pipe()
    pid_r, pid_w = os.pipe()
    try:
        launcher = subprocess.run(
            [
                python or sys.executable,
                "-c",
                _LAUNCHER,
                str(pid_w),
                ",".join(map(str, pass_fds)),
                *argv,
            ],
            stdin=read_fd,
            env=env,
            pass_fds=(pid_w, *pass_fds),
            timeout=30,
            check=False,
        )
        os.close(pid_w)
        pid_w = -1  # closed: never close the number again (another thread may reuse it)
        pid_text = os.read(pid_r, 32)
    except BaseException:
        os.close(write_fd)  # an exporter that did start sees end-of-file and exits
        raise
    finally:
        for fd in (read_fd, pid_r, pid_w):
            if fd >= 0:
                os.close(fd)
    if launcher.returncode != 0:
        os.close(write_fd)
        raise RuntimeError(f"exporter launcher exited with {launcher.returncode}")
    try:  # a bigger pipe: fewer declined offers
        fcntl.fcntl(write_fd, F_SETPIPE_SZ, PIPE_BYTES)
    except OSError as exc:  # /proc/sys/fs/pipe-max-size, or the user's pipe pages spent
        logger.info(
            "journey-otel: the exporter pipe stays at its default size (%s): "
            "a busy engine's hand-offs are declined sooner",
            exc,
        )
    return write_fd, int(pid_text) if pid_text.strip().isdigit() else None


# A lost exporter is replaced after these many seconds, doubling per loss in a
# row up to the last; a replacement that lived RESET_AFTER_S starts the row
# again. At most MAX_PER_WINDOW starts in any WINDOW_S.
FIRST_DELAY_S = 0.5
MAX_DELAY_S = 30.0
RESET_AFTER_S = 60.0
MAX_PER_WINDOW = 4
WINDOW_S = 60.0


class Restarts:
    """When the next replacement may start (drain thread; ``time.monotonic()``)."""

    def __init__(self) -> None:
        self.delay_s = FIRST_DELAY_S
        self.due: float | None = None  # a replacement is wanted from then on
        self.started: deque[float] = deque()  # recent starts, for the window
        self.last_start = -RESET_AFTER_S
        self.count = 0  # replacements started, for the log

    def lost(self, now: float) -> float:
        """An exporter went away at ``now``; returns the delay before its replacement."""
        if now - self.last_start >= RESET_AFTER_S:
            self.delay_s = FIRST_DELAY_S  # the last one lived long: not a crash loop
        if self.due is None:
            self.due = now + self.delay_s
        return self.due - now

    def may_start(self, now: float) -> bool:
        """Whether a replacement may start now (its delay passed, the window has room)."""
        if self.due is None or now < self.due:
            return False
        while self.started and now - self.started[0] >= WINDOW_S:
            self.started.popleft()
        if len(self.started) >= MAX_PER_WINDOW:
            self.due = self.started[0] + WINDOW_S
            return False
        return True

    def did_start(self, now: float, more_wanted: bool) -> None:
        """A start was tried at ``now`` (it may have failed: the next waits longer)."""
        self.started.append(now)
        self.last_start = now
        self.count += 1
        self.delay_s = min(MAX_DELAY_S, self.delay_s * 2)
        self.due = now + self.delay_s if more_wanted else None


def launch_with_acks(
    argv: list[str], env: dict[str, str], python: str | None
) -> tuple[int, int | None, Acks | None]:
    """One exporter (:func:`launch`) with its ``wire.Acks`` counter,
    whose fd it gets as its last argument; the pipe's write end, its pid, the counter."""
    acks = Acks.create()
    if acks is None:
        return (*launch(argv, env, python), None)
    try:
        fd, pid = launch([*argv, str(acks.fd)], env, python, pass_fds=(acks.fd,))
    except BaseException:
        acks.close()
        raise
    return fd, pid, acks


def launch_exporters(
    argv: list[str], env: dict[str, str], python: str | None, processes: int
) -> dict[int, tuple[int | None, Acks | None]]:
    """``processes`` exporters (:func:`launch_with_acks`): each pipe's write end,
    in start order, with its exporter's pid and counter. All or none: a failed
    start closes the pipes of those already started (they see end-of-file)."""
    started: dict[int, tuple[int | None, Acks | None]] = {}
    try:
        for _ in range(processes):
            fd, pid, acks = launch_with_acks(argv, env, python)
            started[fd] = (pid, acks)
    except BaseException:
        for fd, (_, acks) in started.items():
            with contextlib.suppress(OSError):
                os.close(fd)
            if acks is not None:
                acks.close()
        raise
    return started


def behind_advice(exporters: int) -> str:
    """What to change when the pipes stay full: the exporters short of CPU, or
    a slow backend (they build spans only as fast as they export them; their
    log says which). A backend that is down shows in their own queues."""
    return (
        f"the {exporters} exporter process(es) cannot keep up: short of CPU (the "
        f"exporter logs 'short of CPU' where vLLM keeps its CPUs busy: give it one of its "
        f"own, {EXPORTER_CPUS}; one builds and exports ~6,000 journeys/s on a free core, "
        f"more of them help with free cores only: {EXPORTER_PROCESSES}) or a slow backend "
        f"(it logs 'export is slower than the traffic'); or lower the sampling ratio, or "
        f"raise {QUEUE_SIZE} for bursts"
    )
