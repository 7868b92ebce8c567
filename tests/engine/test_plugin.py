"""Activation, version checks and failure isolation, on the real vLLM Scheduler class."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import import_harness, requires_vllm
from vllm_journey_otel.config import Config
from vllm_journey_otel.engine import handoff, hooks, state
from vllm_journey_otel.engine.compat import REQUIRED_METHODS, TARGETS, check, patchable

pytestmark = requires_vllm
harness = import_harness()

HOOKED = (
    "__init__",
    "add_request",
    "schedule",
    "_preempt_request",
    "update_from_output",
    "_free_request",
    "shutdown",
    "_handle_stopped_request",  # optional (streaming input); present in 0.32 and 0.33
)


def _scheduler_methods() -> dict[str, object]:
    from vllm.v1.core.sched.scheduler import Scheduler

    return {name: Scheduler.__dict__.get(name) for name in HOOKED}


def _workload(engine) -> tuple[dict[str, list[int]], dict[str, str], int]:  # type: ignore[no-untyped-def]
    """A fixed workload with chunked prefill, preemption, a stop and an abort."""
    engine.token_for = lambda rid, n: 99 if (rid == "s" and n == 3) else 7
    engine.add("A", prompt_len=14, max_tokens=20)
    engine.step()
    engine.step()
    engine.add("B", prompt_len=32, max_tokens=5)
    engine.add("s", prompt_len=20, max_tokens=30, stop_token_ids=[99])
    engine.add("x", prompt_len=40, max_tokens=30)
    for _ in range(4):
        engine.step()
    engine.abort("x")
    steps = engine.run()
    statuses = {rid: r.status.name for rid, r in engine.requests.items()}
    return engine.outputs, statuses, steps


def _engine():  # type: ignore[no-untyped-def]
    return harness.Engine(
        num_blocks=5, max_num_batched_tokens=64, max_model_len=512, max_num_seqs=8
    )


def test_plugin_off_changes_nothing() -> None:
    """VLLM_JOURNEY_OTEL unset or any false word: register() wraps nothing and
    imports nothing of ours beyond the switch, in a fresh process."""
    code = textwrap.dedent(
        f"""
        import os, sys
        from vllm.v1.core.sched.scheduler import Scheduler
        before = {{n: Scheduler.__dict__.get(n) for n in {HOOKED!r}}}
        from vllm_journey_otel.plugin import register
        loaded = set(sys.modules)  # vLLM 0.30 imports the SDK itself, for its own tracing
        for value in (None, "0", "", "false", " False ", "no", "off", "OFF"):
            if value is None:
                os.environ.pop("VLLM_JOURNEY_OTEL", None)
            else:
                os.environ["VLLM_JOURNEY_OTEL"] = value
            register()
        after = {{n: Scheduler.__dict__.get(n) for n in before}}
        assert before == after, "methods changed"
        new = set(sys.modules) - loaded
        assert not any(m.startswith("opentelemetry") for m in new), "SDK imported while off"
        ours = sorted(m for m in sys.modules if m.startswith("vllm_journey_otel."))
        assert ours == ["vllm_journey_otel.plugin", "vllm_journey_otel.switch"], ours
        print("UNCHANGED")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "VLLM_JOURNEY_OTEL"},
    )
    assert "UNCHANGED" in out.stdout, out.stderr[-3000:]


def test_plugin_on_installs_once_and_uninstalls() -> None:
    before = _scheduler_methods()
    exporter = InMemorySpanExporter()
    try:
        assert hooks.install(Config(enabled=True), exporters=[exporter], batch=False)
        wrapped = _scheduler_methods()
        assert all(wrapped[n] is not before[n] for n in HOOKED)
        # Idempotent: a second install (vLLM loads plugins more than once) wraps nothing again.
        assert hooks.install(Config(enabled=True), exporters=[exporter], batch=False)
        assert _scheduler_methods() == wrapped
        for name in HOOKED:
            assert wrapped[name].__wrapped__ is before[name]  # type: ignore[union-attr]
    finally:
        hooks.uninstall()
    assert _scheduler_methods() == before


def test_register_entry_point_enables_from_env(monkeypatch) -> None:
    from importlib.metadata import entry_points

    eps = [
        ep
        for ep in entry_points(group="vllm.general_plugins")
        if ep.value.startswith("vllm_journey_otel")
    ]
    assert len(eps) == 1
    register = eps[0].load()
    monkeypatch.setenv("VLLM_JOURNEY_OTEL", "1")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    try:
        register()
        register()
        assert hooks.enabled()
        e = harness.Engine()
        assert e.scheduler.__dict__.get(state.TRACKER_ATTR) is not None
    finally:
        hooks.uninstall()


def test_otel_sdk_disabled_keeps_plugin_off(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    before = _scheduler_methods()
    assert not hooks.install(Config(enabled=True))
    assert _scheduler_methods() == before


def test_unsupported_version_with_missing_method_stays_off(monkeypatch, caplog) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    class Patched(Scheduler):  # a patched vLLM whose _free_request has another signature
        def _free_request(self, req, delay=False):  # type: ignore[no-untyped-def,override]
            return super()._free_request(req, delay)

    _version, _, status, mod = state._vllm()
    monkeypatch.setattr(hooks, "_vllm", lambda: ("0.99.0", Patched, status, mod))
    with caplog.at_level(logging.WARNING, logger="vllm.journey_otel"):
        assert not hooks.install(Config(enabled=True))
    assert "_free_request" in caplog.text and "stays off" in caplog.text
    assert not hooks.enabled()
    assert (
        "_free_request" in Patched.__dict__
        and Patched.__dict__["_free_request"].__name__ == "_free_request"
    )
    assert not hasattr(Patched.__dict__["_free_request"], "__wrapped__")


def test_unknown_version_with_every_hook_enables(monkeypatch, caplog) -> None:
    _version, cls, status, mod = state._vllm()
    monkeypatch.setattr(hooks, "_vllm", lambda: ("0.40.1", cls, status, mod))
    try:
        with caplog.at_level(logging.INFO, logger="vllm.journey_otel"):
            assert hooks.install(Config(enabled=True), exporters=[InMemorySpanExporter()])
        assert "outside the tested range" in caplog.text
    finally:
        hooks.uninstall()


def _target_classes() -> dict[str, type | None]:
    from vllm_journey_otel.engine import state

    _, scheduler, _, _ = state._vllm()
    return state.target_classes(scheduler)


def test_every_target_of_the_table_is_wrapped_and_restored() -> None:
    """On the vLLM under test every target of compat.TARGETS is there as the
    table says; install wraps each once, uninstall puts each original back."""
    classes = _target_classes()
    wrap, left_out = patchable(classes)
    assert left_out == [] and len(wrap) == len(TARGETS)
    before = {t: classes[t.owner].__dict__.get(t.method) for t in TARGETS}  # type: ignore[union-attr]
    try:
        assert hooks.install(Config(enabled=True), exporters=[InMemorySpanExporter()], batch=False)
        for t in TARGETS:
            now = getattr(classes[t.owner], t.method)
            assert getattr(now, "__wrapped__", None) is not None, t.name
    finally:
        hooks.uninstall()
    assert {t: classes[t.owner].__dict__.get(t.method) for t in TARGETS} == before  # type: ignore[union-attr]


def test_a_target_left_out_takes_its_group_and_says_what_is_lost(caplog) -> None:  # type: ignore[no-untyped-def]
    classes = _target_classes()
    processor = classes["OutputProcessor"]
    assert processor is not None

    class OddProcessor(processor):  # type: ignore[misc,valid-type]
        def add_request(self, req, *args, **kwargs):  # type: ignore[no-untyped-def,override]
            return super().add_request(req, *args, **kwargs)

    wrap, left_out = patchable({**classes, "OutputProcessor": OddProcessor})
    assert sorted(t.name for t in left_out) == [
        "AsyncLLM.add_request",
        "OutputProcessor.__init__",
        "OutputProcessor.add_request",
    ]
    assert all(t.group != "trace context" for t in wrap)
    no_session = {**classes, "Scheduler": type("Old", (), {n: getattr(classes["Scheduler"], n)
                                                           for n in REQUIRED_METHODS})}  # fmt: skip
    wrap, left_out = patchable(no_session)
    assert {t.name for t in left_out} == {
        "Scheduler._preempt_request",
        "Scheduler._handle_stopped_request",
        "Scheduler._free_blocks",
    }
    assert all(t.without for t in left_out), "each optional target says what is lost"


def test_a_moved_module_keeps_tracing_off_and_names_it(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """A release that moves the Scheduler's module (vLLM's package reorganisation)."""
    from vllm_journey_otel.engine import compat

    before = _scheduler_methods()
    moved = "vllm.v1.core.sched.scheduler_moved"
    monkeypatch.setitem(compat.MODULES, compat.SCHEDULER, moved)
    with caplog.at_level(logging.WARNING, logger="vllm.journey_otel"):
        assert not hooks.install(Config(enabled=True))
    assert f"{moved}.Scheduler cannot be imported" in caplog.text
    assert "stays off" in caplog.text and "Traceback" not in caplog.text
    assert _scheduler_methods() == before and not hooks.enabled()


def test_a_moved_frontend_class_leaves_its_group_out_and_says_so(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    from vllm_journey_otel.engine import compat

    monkeypatch.setitem(compat.MODULES, compat.OUTPUT_PROCESSOR, "vllm.v1.engine.gone")
    try:
        with caplog.at_level(logging.INFO, logger="vllm.journey_otel"):
            assert hooks.install(
                Config(enabled=True), exporters=[InMemorySpanExporter()], batch=False
            )
        assert "AsyncLLM.add_request" in caplog.text and "--otlp-traces-endpoint" in caplog.text
        from vllm.v1.engine.async_llm import AsyncLLM

        assert not hasattr(AsyncLLM.add_request, "__wrapped__")
    finally:
        hooks.uninstall()


def test_check_is_data_driven() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    assert check("0.32.0+cpu", Scheduler).ok
    assert check("0.33.0", Scheduler).ok
    assert check("0.33.1.dev4+gabc", Scheduler).ok
    bare = type("Bare", (), {})
    result = check("0.32.0", bare)
    assert not result.ok
    for name in REQUIRED_METHODS:
        assert name in result.reason
    no_preempt = type("NoPreempt", (), {n: getattr(Scheduler, n) for n in REQUIRED_METHODS})
    result = check("0.32.0", no_preempt)
    assert result.ok and not result.hook_preempt


def test_raising_hook_leaves_scheduler_outputs_unchanged(monkeypatch, caplog) -> None:
    reference = _workload(_engine())

    from vllm_journey_otel.engine import request_journey as journey

    calls = {"n": 0}
    orig = journey.RequestJourney.preempted

    def broken(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        raise RuntimeError("bookkeeping bug")

    monkeypatch.setattr(journey.RequestJourney, "preempted", broken)
    exporter = InMemorySpanExporter()
    assert hooks.install(Config(enabled=True), exporters=[exporter], batch=False)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.journey_otel"):
            traced = _workload(_engine())
        assert calls["n"] == 1, "the hook ran once, then tracing switched itself off"
        assert not hooks.enabled()
        warnings = [r for r in caplog.records if "internal error" in r.getMessage()]
        assert len(warnings) == 1
    finally:
        monkeypatch.setattr(journey.RequestJourney, "preempted", orig)
        hooks.uninstall()
    # Same tokens for every request, same finish statuses, same number of steps.
    assert traced == reference


def test_tracing_on_leaves_scheduler_outputs_unchanged() -> None:
    reference = _workload(_engine())
    exporter = InMemorySpanExporter()
    assert hooks.install(Config(enabled=True), exporters=[exporter], batch=False)
    try:
        traced = _workload(_engine())
        assert handoff.flush(10)
    finally:
        hooks.uninstall()
    assert traced == reference
    assert {
        s.attributes["vllm.request.id"]
        for s in exporter.get_finished_spans()
        if s.name == "vllm.request"
    } == {"A", "B", "s", "x"}


def test_vllm_version_under_test() -> None:
    """CI runs the suite once per supported vLLM; make sure it is the one intended."""
    import vllm

    expected = os.environ.get("VJO_EXPECT_VLLM")
    if expected is None:
        pytest.skip("VJO_EXPECT_VLLM not set (CI sets it)")
    assert vllm.__version__.split("+")[0] == expected


def test_fields_that_differ_between_releases_are_chosen_by_version() -> None:
    from vllm_journey_otel.engine.compat import SKIPPED_REQUESTS, field_name

    both = type("Both", (), {"deferred_waiting": set(), "skipped_waiting": []})()
    assert field_name(SKIPPED_REQUESTS, "0.30.0", both) == "skipped_waiting"
    assert field_name(SKIPPED_REQUESTS, "0.31.0", both) == "deferred_waiting"
    assert field_name(SKIPPED_REQUESTS, "0.33.1.dev4+gabc", both) == "deferred_waiting"
    old_only = type("Old", (), {"skipped_waiting": []})()
    assert (
        field_name(SKIPPED_REQUESTS, "0.29.0", old_only) == "skipped_waiting"
    )  # unknown: what exists
    assert field_name(SKIPPED_REQUESTS, "0.31.0", type("Neither", (), {})()) is None
    # The vLLM under test: a real Scheduler has the field its release is listed with.
    e = _engine()
    version = state._vllm()[0]
    name = field_name(SKIPPED_REQUESTS, version, e.scheduler)
    assert name == ("skipped_waiting" if version.startswith("0.30.") else "deferred_waiting")
