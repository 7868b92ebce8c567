"""The plugin's process-wide state on the engine side, and the imports of vLLM.

Any vLLM process (API server, engine core). The attribute names we put on vLLM's
objects, the one ``_STATE`` of this process, ``_fail`` (our own error: tracing
off for the process, vLLM untouched) and the functions that import vLLM's
classes: the only place of the engine side where vLLM is imported. No
timestamps.
"""

from __future__ import annotations

import importlib
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.trace.export import SpanExporter

from vllm_journey_otel.config import Config
from vllm_journey_otel.engine.compat import (
    ASYNC_LLM,
    FASTAPI,
    MODULES,
    OUTPUT_PROCESSOR,
    PROC_MANAGER,
    REQUEST_STATUS,
    SCHEDULER,
    Support,
)
from vllm_journey_otel.engine.pipeline import JourneyPipeline
from vllm_journey_otel.engine.sampling import HeadSampler, TailRule
from vllm_journey_otel.log import logger

if TYPE_CHECKING:  # the tracker imports this module
    from vllm_journey_otel.engine.tracker import SchedulerTracker

# Attribute names we set on vLLM objects.
TRACKER_ATTR = "_vjo_tracker"
JOURNEY_ATTR = "_vjo_journey"


class VllmMoved(ImportError):
    """A class we need is not where compat.MODULES says (the message names it)."""


def _class(name: str) -> type:
    """A class of the target table from the module compat.MODULES names."""
    module = MODULES[name]
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise VllmMoved(f"{module}.{name} cannot be imported ({exc})") from exc
    if not isinstance(cls, type):
        raise VllmMoved(f"{module}.{name} is not a class")
    return cls


def _vllm() -> tuple[str, type, type, Any]:
    """Import what we need from vLLM (here and only here); VllmMoved names what
    is missing."""
    import vllm

    version = str(getattr(vllm, "__version__", "0"))
    return version, _class(SCHEDULER), _class(REQUEST_STATUS), vllm


def _optional_class(name: str) -> type | None:
    try:
        return _class(name)
    except VllmMoved:
        return None


def _engine_proc_manager() -> type | None:
    """CoreEngineProcManager (API-server side: starts and stops engine cores)."""
    return _optional_class(PROC_MANAGER)


def _frontend_classes() -> tuple[type | None, type | None]:
    """AsyncLLM and OutputProcessor (API-server side), or None where missing."""
    return _optional_class(ASYNC_LLM), _optional_class(OUTPUT_PROCESSOR)


def target_classes(scheduler_cls: type) -> dict[str, type | None]:
    """Every class compat.TARGETS names, by its name there (None where missing)."""
    async_llm, output_processor = _frontend_classes()
    return {
        SCHEDULER: scheduler_cls,
        ASYNC_LLM: async_llm,
        OUTPUT_PROCESSOR: output_processor,
        PROC_MANAGER: _engine_proc_manager(),
        FASTAPI: _optional_class(FASTAPI),
    }


class _State:
    """Process-wide plugin state (one per process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.enabled = False
        self.installed = False
        self.config = Config()
        self.support: Support | None = None
        self.vllm_version = ""
        # (class, name) -> (original, whether the class defined it or inherited it)
        self.originals: dict[tuple[type, str], tuple[Callable[..., Any], bool]] = {}
        self.status_map: dict[Any, tuple[int, str]] = {}
        self.status_waits: dict[Any, int] = {}
        self.streaming_status: Any = None
        self.pipeline: JourneyPipeline | None = None
        self.pipeline_pid = 0
        # Tests inject an exporter; otherwise the OTEL_* variables decide.
        self.exporters: Sequence[SpanExporter] | None = None
        self.batch = True
        self.failed = False
        # Every live tracker, so a failure can drop their state at once.
        self.trackers: weakref.WeakSet[SchedulerTracker] = weakref.WeakSet()
        self.head = HeadSampler()
        self.tail = TailRule()


_STATE = _State()


def _fail(where: str) -> None:
    """Our own bookkeeping broke: warn once, switch tracing off, let vLLM go on."""
    if not _STATE.failed:
        _STATE.failed = True
        logger.warning(
            "journey-otel: internal error in the %s hook; journey tracing is now off "
            "for this process (vLLM is unaffected)",
            where,
            exc_info=True,
        )
    _STATE.enabled = False
    for tracker in list(_STATE.trackers):
        tracker.drop_state()
