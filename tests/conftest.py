"""Shared fixtures. Tests that need vLLM import it through tests/harness.py."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otlp_receiver import Receiver, running_receiver

pytest_plugins = ["no_skips"]


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


# CI sets VJO_REQUIRE_VLLM=1: there a missing vLLM is a failure, never a skip.
REQUIRE_VLLM = os.environ.get("VJO_REQUIRE_VLLM") == "1"

_NEEDS_VLLM = "vLLM is not installed"
requires_vllm = pytest.mark.skipif(
    not REQUIRE_VLLM and not vllm_available(),
    reason=_NEEDS_VLLM,
)


# A test whose subject is downstream of the engine (the exporter, the tools, the
# deploy kit) and that needs vLLM only to make real journeys with a real
# Scheduler: it needs vLLM, but vLLM's release does not change what it tests
# (the journey records it gets are ours; tests/engine checks them on every
# release), so it runs once, on 0.32, and is not marked ``vllm``.
_NEEDS_VLLM_JOURNEYS = "vLLM is not installed (this test's journeys come from a real Scheduler)"
journeys_from_vllm = pytest.mark.skipif(
    not REQUIRE_VLLM and not vllm_available(),
    reason=_NEEDS_VLLM_JOURNEYS,
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that needs vLLM (``requires_vllm``, on it or its module) is marked
    ``vllm``: scripts/test.sh runs those again against each vLLM release's
    sources, and everything else (``journeys_from_vllm`` too) once."""
    for item in items:
        if any(m.kwargs.get("reason") == _NEEDS_VLLM for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.vllm)


def import_harness():  # type: ignore[no-untyped-def]
    """tests/harness.py (imports vLLM); skips without vLLM unless it is required."""
    if REQUIRE_VLLM:
        import harness

        return harness
    return pytest.importorskip("harness")


class Tracing:
    """The plugin installed in this process with an in-memory exporter."""

    def __init__(self, exporter: InMemorySpanExporter) -> None:
        self.exporter = exporter

    def spans(self):  # type: ignore[no-untyped-def]
        from vllm_journey_otel.engine import handoff

        assert handoff.flush(10.0)
        return self.exporter.get_finished_spans()

    def journeys(self):  # type: ignore[no-untyped-def]
        import trees

        return trees.journeys(self.spans())


@pytest.fixture
def tracing() -> Iterator[Tracing]:
    from vllm_journey_otel.config import Config
    from vllm_journey_otel.engine import hooks

    exporter = InMemorySpanExporter()
    assert hooks.install(Config(enabled=True), exporters=[exporter], batch=False)
    try:
        yield Tracing(exporter)
    finally:
        hooks.uninstall()


# -- the fixtures every module shares (defined here only) ----------------------
@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The tiny random-weight Llama, built offline once."""
    from fixtures.tiny_model import build

    return build(Path(__file__).resolve().parent.parent / ".cache" / "tiny-llama")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """An OTLP receiver on 127.0.0.1 (gRPC and HTTP), one per test."""
    yield from running_receiver()


@pytest.fixture(scope="module")
def module_receiver() -> Iterator[Receiver]:
    """The same, shared by a module's tests (with its module-scoped servers)."""
    yield from running_receiver()
