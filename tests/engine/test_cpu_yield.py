"""Our code yields the CPU to vLLM's (cpu_yield.py): priority and CPUs, on real
threads and processes of this machine (Linux, 2 CPUs in CI)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from services import wait_exited, wait_until
from vllm_journey_otel import config as C
from vllm_journey_otel.cpu_yield import lower_priority
from vllm_journey_otel.engine.pipe_sink import PipeSink
from vllm_journey_otel.engine.pipeline import JourneyPipeline
from vllm_journey_otel.export.cpu_placement import (
    bound_cpus,
    choose_cpus,
    format_cpus,
    usable_cpus,
)

ALLOWED = os.sched_getaffinity(0)
needs_two_cpus = pytest.mark.skipif(
    len(ALLOWED) < 2, reason="binding needs two CPUs this process may use"
)


def in_thread(fn):  # type: ignore[no-untyped-def]
    """Run ``fn`` on a new thread; its result and the thread's policy and nice."""
    out: list[object] = []

    def body() -> None:
        result = fn()
        out.extend([result, os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)])
        child: list[int] = []
        t = threading.Thread(target=lambda: child.append(os.sched_getscheduler(0)))
        t.start()
        t.join()
        out.append(child[0])

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out


def test_idle_priority_is_sched_idle_inherited_and_only_for_that_thread() -> None:
    before = os.sched_getscheduler(0)
    applied, policy, _, child_policy = in_thread(lambda: lower_priority(C.PRIORITY_IDLE))
    assert applied == "SCHED_IDLE"
    assert policy == os.SCHED_IDLE and child_policy == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == before  # the calling thread only


def test_nice_priority_is_nice_19() -> None:
    applied, policy, nice, _ = in_thread(lambda: lower_priority(C.PRIORITY_NICE))
    assert applied == "nice 19" and nice == 19 and policy == os.SCHED_OTHER


def test_normal_priority_leaves_the_thread_alone() -> None:
    applied, policy, nice, _ = in_thread(lambda: lower_priority(C.PRIORITY_NORMAL))
    assert applied.startswith("unchanged")
    assert policy == os.sched_getscheduler(0)
    assert nice == os.getpriority(os.PRIO_PROCESS, 0)


def test_without_sched_idle_falls_back_to_nice_and_says_so(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # A platform without SCHED_IDLE cannot exist here: the constant is removed.
    monkeypatch.delattr(os, "SCHED_IDLE")
    applied, policy, nice, _ = in_thread(lambda: lower_priority(C.PRIORITY_IDLE))
    assert applied == "SCHED_IDLE does not exist on this platform; nice 19"
    assert nice == 19 and policy == os.SCHED_OTHER


def _nice_19(tid: int) -> bool:
    stat = open(f"/proc/{os.getpid()}/task/{tid}/stat").read()  # noqa: SIM115
    return (
        os.sched_getscheduler(tid) == os.SCHED_OTHER
        and int(stat.rsplit(")", 1)[1].split()[16]) == 19
    )


def test_threads_sharing_the_engines_gil_get_nice_19_not_sched_idle() -> None:
    applied, policy, nice, _ = in_thread(lambda: lower_priority(C.PRIORITY_IDLE, shares_gil=True))
    assert applied.endswith("nice 19") and "GIL" in applied
    assert policy == os.SCHED_OTHER and nice == 19


def test_drain_thread_runs_at_nice_19() -> None:
    pipeline = JourneyPipeline(PipeSink([]), interval_s=0.01)
    try:
        thread = pipeline._thread
        assert thread is not None and thread.native_id is not None
        tid = thread.native_id
        wait_until(lambda: _nice_19(tid), 10, 0.01, "nice 19")
        assert os.getpriority(os.PRIO_PROCESS, 0) != 19  # the engine thread keeps its own
    finally:
        pipeline.shutdown(1)


@pytest.mark.parametrize(
    ("setting", "bound", "cpus", "why"),
    [
        (C.CPUS_AUTO, {0}, {1, 2, 3}, "CPUs 1-3, off 0 where vLLM's threads are bound"),
        (C.CPUS_AUTO, set(), {0, 1, 2, 3}, "every CPU it may use, 0-3 (vLLM binds no thread)"),
        (C.CPUS_AUTO, {0, 1, 2, 3}, None, "its CPUs as inherited, 2: vLLM's threads are bound to"),
        (C.CPUS_ALL, {0}, None, "its CPUs as inherited, 2 (VLLM_JOURNEY_OTEL_EXPORTER_CPUS=all)"),
        ((2, 3, 9), {0}, {2, 3}, "CPUs 2-3 (VLLM_JOURNEY_OTEL_EXPORTER_CPUS)"),
        ((8, 9), {0}, {0, 1, 2, 3}, "none of VLLM_JOURNEY_OTEL_EXPORTER_CPUS=8-9 is allowed"),
    ],
)
def test_choose_cpus(setting, bound, cpus, why) -> None:  # type: ignore[no-untyped-def]
    got, text = choose_cpus(setting, {0, 1, 2, 3}, bound, {2})
    assert got == cpus
    assert why in text


def test_cpu_lists_parse_and_format_as_linux_writes_them() -> None:
    assert C.parse_cpu_list("0,2-3, 8-11") == (0, 2, 3, 8, 9, 10, 11)
    for bad in ("", "a", "3-1", "1-", "-2", "1,,2"):
        assert C.parse_cpu_list(bad) is None, bad
    assert format_cpus([5, 0, 1, 2, 9, 10]) == "0-2,5,9-10"
    assert format_cpus([]) == ""


@pytest.mark.parametrize("raw", ["idle", "NICE", "normal"])
def test_cpu_priority_setting(raw: str) -> None:
    assert C.from_env({C.ENABLE: "1", C.CPU_PRIORITY: raw}).cpu_priority == raw.lower()


def test_bad_cpu_settings_warn_and_use_the_defaults(caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING, logger="vllm.journey_otel")
    cfg = C.from_env({C.ENABLE: "1", C.CPU_PRIORITY: "realtime", C.EXPORTER_CPUS: "0-"})
    assert cfg.cpu_priority == C.PRIORITY_IDLE and cfg.exporter_cpus == C.CPUS_AUTO
    text = caplog.text
    assert "VLLM_JOURNEY_OTEL_CPU_PRIORITY='realtime' is not one of idle/nice/normal" in text
    assert "VLLM_JOURNEY_OTEL_EXPORTER_CPUS='0-' is not auto, all or a CPU list" in text
    ok = C.from_env({C.ENABLE: "1", C.EXPORTER_CPUS: "1,0"})
    assert ok.exporter_cpus == (0, 1)


BOUND_CHILD = """
import os, sys, threading, time
cpus = [int(cpu) for cpu in sys.argv[1].split(",")]
if sys.argv[2] == "process":
    os.sched_setaffinity(0, set(cpus))
else:  # one thread bound to each, as OpenMP binds its threads
    for cpu in cpus:
        threading.Thread(
            target=lambda c=cpu: (os.sched_setaffinity(0, {c}), time.sleep(600)), daemon=True
        ).start()
print("bound", flush=True)
time.sleep(600)
"""


@pytest.fixture
def bound_child() -> Iterator[subprocess.Popen[str]]:
    """A child of this process with a thread bound to the last CPU, as vLLM's
    CPU worker binds its threads; the test process tree's root is this process."""
    cpu = max(ALLOWED)
    child = subprocess.Popen(
        [sys.executable, "-c", BOUND_CHILD, str(cpu), "thread"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "bound"
        yield child
    finally:
        child.kill()
        child.wait()


@needs_two_cpus
def test_bound_cpus_found_in_the_process_tree(bound_child) -> None:  # type: ignore[no-untyped-def]
    assert bound_cpus([os.getpid()], ALLOWED) == {max(ALLOWED)}
    assert bound_cpus([bound_child.pid], ALLOWED) == {max(ALLOWED)}
    # A process that binds nothing, and a tree that is gone, give nothing.
    free = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert bound_cpus([free.pid], ALLOWED) == set()
    finally:
        free.kill()
        free.wait()
    assert bound_cpus([free.pid], ALLOWED) == set()


def _exporter_placement(pid: int) -> set[tuple[int, frozenset[int]]]:
    """Each live thread's policy and CPUs; a thread that ends between the
    listing and its reading (a short-lived thread of a library) is left out."""
    placement = set()
    for t in psutil.Process(pid).threads():
        try:
            placement.add((os.sched_getscheduler(t.id), frozenset(os.sched_getaffinity(t.id))))
        except ProcessLookupError:
            continue
    return placement


def _exporter_defaults(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The plugin's defaults for a real exporter, exporting nowhere."""
    for key in list(os.environ):
        if key.startswith(("OTEL_", "VLLM_JOURNEY_OTEL_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")


@needs_two_cpus
def test_exporter_process_idles_off_the_bound_cpus(bound_child, monkeypatch, capfd) -> None:  # type: ignore[no-untyped-def]
    _exporter_defaults(monkeypatch)
    sink = PipeSink.start({"service.name": "yield"})
    try:
        assert sink.pid is not None
        rest = frozenset(ALLOWED - {max(ALLOWED)})
        # Every thread of the exporter (its SDK's too): SCHED_IDLE, off the bound CPU.
        wanted = {(os.SCHED_IDLE, rest)}

        def placed() -> bool:  # its threads started (the re-checks') and all placed
            threads = len(psutil.Process(sink.pid).threads())
            return threads >= 2 and _exporter_placement(sink.pid) == wanted

        wait_until(placed, 30, 0.05, "placement")
    finally:
        sink.shutdown(5)
        wait_exited([sink.pid], 30)
    line = f"CPU priority SCHED_IDLE; CPUs {format_cpus(rest)}, off {max(ALLOWED)} where"
    assert line in capfd.readouterr().err


@needs_two_cpus
def test_exporter_of_a_pinned_vllm_leaves_its_cpu(monkeypatch, capfd) -> None:  # type: ignore[no-untyped-def]
    """vLLM started under ``taskset -c N``: each of its threads, and each process
    it starts (the exporter too), inherits that one CPU. The exporter still
    finds the CPUs its cpuset gives it, whichever cgroup version the host has,
    and leaves vLLM's (here the test process's main thread stands for vLLM,
    pinned while the exporter starts and places itself)."""
    _exporter_defaults(monkeypatch)
    pinned = max(ALLOWED)
    rest = frozenset(usable_cpus() - {pinned})  # the whole cpuset but that CPU
    os.sched_setaffinity(0, {pinned})
    sink = None
    try:
        sink = PipeSink.start({"service.name": "pinned"})
        assert sink.pid is not None
        pid = sink.pid
        wanted = {(os.SCHED_IDLE, rest)}
        wait_until(lambda: _exporter_placement(pid) == wanted, 30, 0.05, "placement")
    finally:
        os.sched_setaffinity(0, ALLOWED)
        if sink is not None:
            sink.shutdown(5)
            if sink.pid is not None:
                wait_exited([sink.pid], 30)
    line = f"CPUs {format_cpus(rest)}, off {pinned} where vLLM's threads are bound"
    assert line in capfd.readouterr().err


@needs_two_cpus
def test_exporter_keeps_its_owners_cpus_where_vllm_binds_every_cpu(monkeypatch, capfd) -> None:  # type: ignore[no-untyped-def]
    """vLLM under ``taskset`` with its worker's threads bound to every other
    CPU (``vllm serve`` pinned to one CPU, its CPU worker to the rest): no CPU
    is free of vLLM's threads, and the exporter stays on the CPU it inherited,
    its owner's, off the CPUs where the worker's threads busy-wait."""
    _exporter_defaults(monkeypatch)
    owner_cpu = min(ALLOWED)
    others = ",".join(str(cpu) for cpu in sorted(usable_cpus() - {owner_cpu}))
    child = subprocess.Popen(
        [sys.executable, "-c", BOUND_CHILD, others, "thread"], stdout=subprocess.PIPE, text=True
    )
    sink = None
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "bound"
        os.sched_setaffinity(0, {owner_cpu})
        sink = PipeSink.start({"service.name": "bound-everywhere"})
        assert sink.pid is not None
        pid = sink.pid
        wanted = {(os.SCHED_IDLE, frozenset({owner_cpu}))}
        wait_until(lambda: _exporter_placement(pid) == wanted, 30, 0.05, "placement")
    finally:
        os.sched_setaffinity(0, ALLOWED)
        child.kill()
        child.wait()
        if sink is not None:
            sink.shutdown(5)
            if sink.pid is not None:
                wait_exited([sink.pid], 30)
    line = f"its CPUs as inherited, {owner_cpu}: vLLM's threads are bound to every CPU it may use"
    assert line in capfd.readouterr().err


@needs_two_cpus
def test_usable_cpus_are_the_cpusets_not_the_inherited_affinity() -> None:
    """Asked from a thread pinned to one CPU: every CPU the process may be
    given, and the thread's own affinity put back."""
    out: list[object] = []

    def body() -> None:
        os.sched_setaffinity(0, {max(ALLOWED)})
        out.extend([usable_cpus(), os.sched_getaffinity(0)])

    t = threading.Thread(target=body)
    t.start()
    t.join()
    usable, restored = out
    assert isinstance(usable, set) and usable >= ALLOWED  # this process's own, at least
    assert restored == {max(ALLOWED)}


@needs_two_cpus
def test_exporter_placement_off_switches(bound_child, monkeypatch, capfd) -> None:  # type: ignore[no-untyped-def]
    _exporter_defaults(monkeypatch)
    monkeypatch.setenv(C.ENABLE, "1")
    monkeypatch.setenv(C.CPU_PRIORITY, C.PRIORITY_NORMAL)
    monkeypatch.setenv(C.EXPORTER_CPUS, C.CPUS_ALL)
    sink = PipeSink.start({"service.name": "no-yield"})
    try:
        assert sink.pid is not None
        err: list[str] = []
        wait_until(lambda: err.append(capfd.readouterr().err) or "CPU priority" in "".join(err),
                   30, 0.05, "the placement log line")  # fmt: skip
        assert "CPU priority unchanged (VLLM_JOURNEY_OTEL_CPU_PRIORITY=normal)" in "".join(err)
        assert _exporter_placement(sink.pid) == {(os.SCHED_OTHER, frozenset(ALLOWED))}
    finally:
        sink.shutdown(5)
        wait_exited([sink.pid], 30)


def _autogroup(pid: int) -> str | None:
    """The task's scheduler autogroup (``/autogroup-N``), or None where it has
    none: a kernel without autogroup (no file), or a task whose group is not an
    autogroup, such as one in a CPU cgroup of a container (an empty file)."""
    try:
        fields = Path(f"/proc/{pid}/autogroup").read_text().split()
    except OSError:
        return None
    return fields[0] if fields else None


def test_exporter_stays_in_vllms_session_and_autogroup_in_a_group_of_its_own(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """SCHED_IDLE ranks a thread only within its scheduler group; where the
    kernel groups by session (autogroup), an exporter in a session of its own
    would share a busy CPU with vLLM's whole session as an equal
    (benchmarks/autogroup_share.py). Its own process group keeps a terminal's
    Ctrl-C off it."""
    _exporter_defaults(monkeypatch)
    sink = PipeSink.start({"service.name": "session"})
    try:
        pid = sink.pid
        assert pid is not None
        assert os.getsid(pid) == os.getsid(0)
        assert os.getpgid(pid) == pid != os.getpgid(0)
        assert _autogroup(pid) == _autogroup(os.getpid())
    finally:
        sink.shutdown(5)
        wait_exited([sink.pid], 30)


def test_export_stage_thread_in_the_engine_runs_at_nice_19() -> None:
    """In thread mode the export stage's thread is ours inside vLLM's engine core."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from vllm_journey_otel.export.export_stage import ExportStage
    from vllm_journey_otel.export.health import ExportHealth

    stage = ExportStage([InMemorySpanExporter()], ExportHealth(), shares_gil=True)
    try:
        thread = stage._thread
        assert thread is not None and thread.native_id is not None
        tid = thread.native_id
        wait_until(lambda: _nice_19(tid), 10, 0.01, "nice 19")
    finally:
        stage.shutdown(1)
