"""Real processes the end-to-end tests start and stop: `vllm serve`, Phoenix, rotel.

Everything binds 127.0.0.1 and is stopped by its PID (process group) when the
test module ends. Logs go to files under the pytest tmp dir so a failure can show
the tail.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BACKEND_VENV = ROOT / ".venv-phoenix"
ROTEL = next(iter(BACKEND_VENV.glob("lib/python*/site-packages/rotel/rotel-agent")), None)


_HANDED_OUT: set[int] = set()
# Not the shared `random`: tests (and vLLM in-process) seed it, and two
# processes seeded alike would try the same ports in the same order.
_PORT_ORDER = random.SystemRandom()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port free now, for a server that binds it later (a `vllm serve`
    binds its port a minute after it starts). Taken below the kernel's
    ephemeral range, so that no connection's source port and no one's
    ``bind(port 0)`` (vLLM picks its ZMQ ports that way) can take it in the
    meantime, and never the same one twice in this process."""
    low, _ = _ephemeral_range()
    first = 15000 if low > 20000 else 1024
    candidates = list(range(first, low))
    _PORT_ORDER.shuffle(candidates)
    for port in candidates:
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # no room below the range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_exited(pids: Sequence[int | None], timeout: float) -> list[int]:
    """Waits until each process has exited; returns those still alive after
    ``timeout``. A process already gone counts as exited: an exporter outlives
    its parent and is reaped by pid 1, perhaps before this looks."""
    import psutil

    procs = []
    for pid in pids:
        if pid is None:
            continue
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in alive]


def http_json(
    url: str, payload: Any = None, timeout: float = 60.0, headers: Mapping[str, str] | None = None
) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_until(predicate, timeout: float, interval: float = 0.2, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def _group(own_session: bool) -> dict[str, Any]:
    """Popen's arguments for a process group of the child's own, in a session
    of its own or the caller's (``process_group`` is Python 3.11's; 3.10's
    ``os.setpgrp`` before exec does the same)."""
    if own_session:
        return {"start_new_session": True}
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}


class Process:
    """A child process in a process group of its own, stopped by signalling the
    group. It stays in the caller's session, so in the caller's scheduler
    autogroup: a busy `vllm serve` in a session of its own (an autogroup of its
    own) kept processes of the caller's session off both CPUs of this machine
    for up to 8 s at a time (a 10 ms sleeper woke that late), so a test's burst
    reached the server spread over seconds. ``own_session`` starts it in a
    session of its own instead (``plugin_toggle.py --server-session own``).
    Its input is /dev/null: in a background group of a terminal's session, a
    read of the terminal would stop it."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log: Path,
        own_session: bool = False,
    ) -> None:
        self.name = name
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            **_group(own_session),
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the process, wait, then SIGKILL its whole group."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode


class VllmServer(Process):
    """`vllm serve` of the tiny model on 127.0.0.1, with the plugin on."""

    def __init__(
        self,
        model: Path,
        log: Path,
        env: Mapping[str, str],
        args: Sequence[str] = (),
        multiprocessing: bool = True,
        max_model_len: int = 2048,
        kv_cache_bytes: str = "256M",
        command: Sequence[str] = (),
        own_session: bool = False,
    ) -> None:
        self.port = free_port()
        self.model = str(model)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VLLM_"))}
        full_env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "VLLM_JOURNEY_OTEL": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0",
                "PYTHONUNBUFFERED": "1",
                "VLLM_JOURNEY_OTEL_EXPORT_INTERVAL_MS": "50",
                "OTEL_BSP_SCHEDULE_DELAY": "200",
                # uvicorn closes an idle kept-alive connection after 5 s by
                # default; a client that reuses it at that moment gets "server
                # disconnected" for a request the server never saw (the tests'
                # clients do not retry: a retry would double a journey).
                "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "3600",
            }
        )
        full_env.update(env)
        argv = [
            *(command or [str(VENV / "bin" / "vllm")]), "serve", self.model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--enforce-eager", "--max-model-len", str(max_model_len),
            "--kv-cache-memory-bytes", kv_cache_bytes, "--seed", "0",
            *args,
        ]  # fmt: skip
        super().__init__("vllm serve", argv, full_env, log, own_session)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 240.0) -> None:
        def healthy() -> bool:
            if not self.alive():
                raise RuntimeError(f"vllm serve exited early:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    return r.status == 200
            except (urllib.error.URLError, OSError):
                return False

        wait_until(healthy, timeout, 0.5, "vllm serve /health")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return str(r.read().decode())


def metric_value(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (all label sets)."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise KeyError(name)
    return total


class Phoenix(Process):
    """Arize Phoenix in its own venv, HTTP and OTLP gRPC on 127.0.0.1 only."""

    def __init__(self, workdir: Path, log: Path) -> None:
        self.http_port = free_port()
        self.grpc_port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(workdir),
            "PHOENIX_HOST": "127.0.0.1",
            "PHOENIX_PORT": str(self.http_port),
            "PHOENIX_GRPC_PORT": str(self.grpc_port),
            "PHOENIX_WORKING_DIR": str(workdir),
            "PHOENIX_TELEMETRY_ENABLED": "false",
        }
        argv = [
            str(BACKEND_VENV / "bin" / "python"),
            str(ROOT / "tests" / "phoenix_launcher.py"),
            "serve",
        ]
        super().__init__("phoenix", argv, env, log)

    def wait_ready(self, timeout: float = 300.0) -> None:
        def healthy() -> bool:
            if not self.alive():
                raise RuntimeError(f"phoenix exited early:\n{self.tail()}")
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.http_port}/healthz", timeout=2
                ) as r:
                    return r.status == 200
            except (urllib.error.URLError, OSError):
                return False

        wait_until(healthy, timeout, 0.5, "phoenix /healthz")

    def spans(self, project: str) -> list[dict[str, Any]]:
        """Every span of a project, read back through Phoenix's REST API."""
        out: list[dict[str, Any]] = []
        cursor = None
        while True:
            url = f"http://127.0.0.1:{self.http_port}/v1/projects/{project}/spans?limit=1000"
            if cursor:
                url += f"&cursor={cursor}"
            try:
                page = http_json(url)
            except urllib.error.HTTPError as e:
                if e.code == 404:  # the project appears with its first span
                    return []
                raise
            out.extend(page["data"])
            cursor = page.get("next_cursor")
            if not cursor:
                return out


class Rotel(Process):
    """The rotel collector: OTLP gRPC and HTTP in, OTLP gRPC out."""

    def __init__(self, upstream_grpc: str, log: Path, pid_file: Path) -> None:
        assert ROTEL is not None, "rotel is not installed (scripts/setup_backends.sh)"
        self.grpc_port = free_port()
        self.http_port = free_port()
        argv = [
            str(ROTEL), "start",
            "--otlp-grpc-endpoint", f"127.0.0.1:{self.grpc_port}",
            "--otlp-http-endpoint", f"127.0.0.1:{self.http_port}",
            "--exporter", "otlp",
            "--otlp-exporter-endpoint", upstream_grpc,
            "--otlp-exporter-protocol", "grpc",
            "--pid-file", str(pid_file),
        ]  # fmt: skip
        super().__init__("rotel", argv, {"PATH": os.environ.get("PATH", "")}, log)

    def wait_ready(self, timeout: float = 30.0) -> None:
        def listening() -> bool:
            if not self.alive():
                raise RuntimeError(f"rotel exited early:\n{self.tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.http_port), timeout=1):
                    return True
            except OSError:
                return False

        wait_until(listening, timeout, 0.2, "rotel port")
