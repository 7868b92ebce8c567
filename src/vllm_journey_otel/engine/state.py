"""The plugin's process-wide state on the engine side, and the imports of vLLM.

Any vLLM process (API server, engine core). The attribute names we put on vLLM's
objects, the one ``_STATE`` of this process, ``_fail`` (our own error: tracing
off for the process, vLLM untouched) and the functions that import vLLM's
classes: the only place of the engine side where vLLM is imported. No
timestamps.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.trace.export import SpanExporter

from vllm_journey_otel.config import Config
from vllm_journey_otel.engine.compat import Support
from vllm_journey_otel.engine.pipeline import JourneyPipeline
from vllm_journey_otel.engine.sampling import HeadSampler, TailRule
from vllm_journey_otel.log import logger

if TYPE_CHECKING:  # the tracker imports this module
    from vllm_journey_otel.engine.tracker import SchedulerTracker

# Attribute names we set on vLLM objects.
TRACKER_ATTR = "_vjo_tracker"
JOURNEY_ATTR = "_vjo_journey"


def _vllm() -> tuple[str, type, type, Any]:
    """Import what we need from vLLM (here and only here)."""
    import vllm
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    version = str(getattr(vllm, "__version__", "0"))
    return version, Scheduler, RequestStatus, vllm


def _engine_proc_manager() -> type | None:
    """CoreEngineProcManager (API-server side: starts and stops engine cores)."""
    try:
        from vllm.v1.engine.utils import CoreEngineProcManager
    except Exception:
        return None
    return CoreEngineProcManager if isinstance(CoreEngineProcManager, type) else None


def _frontend_classes() -> tuple[type | None, type | None]:
    """AsyncLLM and OutputProcessor (API-server side), or None where missing."""
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.output_processor import OutputProcessor
    except Exception:
        return None, None
    return AsyncLLM, OutputProcessor


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
        tracker.awaiting.clear()
        tracker.steps_open.clear()
        tracker.blocked.clear()
