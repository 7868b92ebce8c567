"""What we patch in vLLM and which vLLM versions we support, as data.

One table, :data:`TARGETS`: every class and method the plugin wraps, the
parameters each must accept, whether tracing can run without it (and what is
lost then), which targets go together, and the vLLM versions where it was read
and tested. :func:`check` decides from it whether to enable on a given vLLM;
:func:`patchable` which targets to wrap on the classes found. Pure: receives
the version string and the classes; does not import vLLM itself (the engine
side's ``state.py`` does).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from vllm_journey_otel import schema as S

# Versions whose code was read and is tested (tests/ drive all four at scheduler
# level; `vllm serve` end to end on 0.32, the CPU build here).
SUPPORTED_VLLM: Final = SpecifierSet(">=0.30,<0.34")

# The classes we patch, by the name the table uses, and the module each is
# imported from (engine/state.py), the same in 0.30 to 0.33. A release that
# moves one (vLLM's package reorganisation, RFC vllm#54653) is named in the log.
SCHEDULER: Final = "Scheduler"
ASYNC_LLM: Final = "AsyncLLM"
OUTPUT_PROCESSOR: Final = "OutputProcessor"
PROC_MANAGER: Final = "CoreEngineProcManager"
REQUEST_STATUS: Final = "RequestStatus"
# FastAPI's application class (vLLM's HTTP server): where the API-server spans'
# middleware goes in (FastAPI 0.100 and later define build_middleware_stack).
FASTAPI: Final = "FastAPI"
MODULES: Final[dict[str, str]] = {
    SCHEDULER: "vllm.v1.core.sched.scheduler",
    REQUEST_STATUS: "vllm.v1.request",
    ASYNC_LLM: "vllm.v1.engine.async_llm",
    OUTPUT_PROCESSOR: "vllm.v1.engine.output_processor",
    PROC_MANAGER: "vllm.v1.engine.utils",
    FASTAPI: "fastapi.applications",
}


@dataclass(frozen=True)
class Target:
    """One method we wrap."""

    owner: str
    method: str
    # Parameter names it must accept (after self).
    params: tuple[str, ...] = ()
    # Without it tracing stays off.
    required: bool = False
    # Optional: what is lost without it, for the log (said once).
    without: str = ""
    # Targets of one group are wrapped together or not at all.
    group: str = ""
    # vLLM versions where it was read and tested as described.
    versions: SpecifierSet = SUPPORTED_VLLM

    @property
    def name(self) -> str:
        return f"{self.owner}.{self.method}"


TARGETS: Final[tuple[Target, ...]] = (
    Target(SCHEDULER, "__init__", ("vllm_config",), required=True),
    Target(SCHEDULER, "add_request", ("request",), required=True),
    Target(SCHEDULER, "schedule", required=True),
    Target(
        SCHEDULER,
        "_preempt_request",
        ("request",),
        without="preemptions are read from SchedulerOutput.preempted_req_ids after each "
        "schedule() (no progress or cause at the preemption)",
    ),
    Target(
        SCHEDULER, "update_from_output", ("scheduler_output", "model_runner_output"), required=True
    ),
    Target(SCHEDULER, "_free_request", ("request",), required=True),
    Target(SCHEDULER, "shutdown", required=True),
    # Private: read in 0.30, 0.31, 0.32 and 0.33 (vLLM frees an ended request's
    # KV blocks there: at once, or once its KV connector is done with them).
    Target(
        SCHEDULER,
        "_free_blocks",
        ("request",),
        without="disaggregated serving: no vllm.kv_held (a prefill journey ends "
        "without how long its KV blocks were kept for the decode side)",
    ),
    Target(
        SCHEDULER,
        "_handle_stopped_request",
        ("request",),
        without="a streaming-input session is one long journey, its segments not told apart",
    ),
    # The client's trace context without vLLM's own tracing (frontend.py).
    Target(
        ASYNC_LLM,
        "add_request",
        ("trace_headers",),
        group="trace context",
        without="the client's trace context reaches journeys only with --otlp-traces-endpoint",
    ),
    Target(OUTPUT_PROCESSOR, "add_request", ("request",), group="trace context"),
    Target(OUTPUT_PROCESSOR, "__init__", group="trace context"),
    # The API-server spans (api_server.py).
    Target(
        FASTAPI,
        "build_middleware_stack",
        without="no API-server spans: the engine's vllm.request is the request's root",
    ),
    # Private: read in 0.30, 0.31, 0.32 and 0.33 (called once per finished request).
    Target(
        OUTPUT_PROCESSOR,
        "_finish_request",
        ("req_state",),
        without="API-server spans have no vllm.api.output (the engine's last output is not seen)",
    ),
    Target(
        PROC_MANAGER,
        "shutdown",
        ("timeout",),
        without="no shutdown grace: with --shutdown-timeout 0 journeys of requests in "
        "flight at shutdown are lost",
    ),
)


@dataclass(frozen=True)
class Field:
    """A field of vLLM's objects the hooks read, where releases differ."""

    role: str  # what the hooks read it for
    owner: str
    name: str
    versions: SpecifierSet  # the releases that have it for that role


SKIPPED_REQUESTS: Final = "the waiting requests schedule() skipped"
PAUSE_STATE: Final = "the scheduler's pause state (0: not paused)"
FIELDS: Final[tuple[Field, ...]] = (
    # 0.31 and later: a set of the skipped requests, which stay in ``waiting``.
    Field(SKIPPED_REQUESTS, SCHEDULER, "deferred_waiting", SpecifierSet(">=0.31")),
    # 0.30: the skipped requests leave ``waiting`` for a queue of their own.
    Field(SKIPPED_REQUESTS, SCHEDULER, "skipped_waiting", SpecifierSet(">=0.30,<0.31")),
    # Private in 0.30-0.33 (an IntEnum, UNPAUSED = 0; the public pause_state is
    # a property): read once per step where a property call would cost a frame.
    Field(PAUSE_STATE, SCHEDULER, "_pause_state", SpecifierSet(">=0.30")),
)


def field_name(role: str, version: str, obj: object) -> str | None:
    """The field ``obj`` has for ``role`` on this vLLM: the one whose releases
    include ``version``; for a release the table does not know, the first one
    ``obj`` has (None: none, the role's attributes stay absent)."""
    fields = [f for f in FIELDS if f.role == role]
    try:
        v = Version(version)
        known = [f for f in fields if f.versions.contains(v, prereleases=True)]
    except InvalidVersion:
        known = []
    for f in known or fields:
        if hasattr(obj, f.name):
            return f.name
    return None


# vLLM's request statuses, by name (the same in 0.30 to 0.33; a name a release
# lacks is skipped, a status a release adds ends a journey as aborted, reason
# unknown). Terminal ones -> our finish status and vLLM's finish reason:
FINISHED_STATUSES: Final[dict[str, tuple[str, str]]] = {
    "FINISHED_STOPPED": (S.FINISH_STOPPED, "stop"),
    "FINISHED_LENGTH_CAPPED": (S.FINISH_LENGTH, "length"),
    "FINISHED_ABORTED": (S.FINISH_ABORTED, "abort"),
    "FINISHED_IGNORED": (S.FINISH_IGNORED, "length"),
    "FINISHED_ERROR": (S.FINISH_ERROR, "error"),
    # A stop on a detected repetition loop: "stopped", reason "repetition".
    "FINISHED_REPETITION": (S.FINISH_STOPPED, "repetition"),
}
# ... and those that mean "waiting for something specific" -> the wait's reason.
WAITING_STATUSES: Final[dict[str, str]] = {
    "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR": S.WAIT_GRAMMAR,
    "WAITING_FOR_REMOTE_KVS": S.WAIT_REMOTE_KV,
}


# Scheduler methods we wrap -> parameter names they must accept (after self).
REQUIRED_METHODS: Final = {t.method: t.params for t in TARGETS if t.required}


@dataclass(frozen=True)
class Support:
    """Outcome of :func:`check`. ``reason`` is a sentence for the log."""

    ok: bool
    reason: str
    hook_preempt: bool = True


def signature_ok(cls: type | None, name: str, params: tuple[str, ...]) -> bool:
    """``cls.name`` exists, is callable and accepts ``params``."""
    fn = getattr(cls, name, None) if cls is not None else None
    if fn is None or not callable(fn):
        return False
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    names = list(sig.parameters)
    return all(p in names for p in params)


def check(version: str, scheduler_cls: type) -> Support:
    """Whether to enable on this vLLM: a supported version, or every hook in place."""
    missing = [
        t.method
        for t in TARGETS
        if t.required and not signature_ok(scheduler_cls, t.method, t.params)
    ]
    preempt = next(t for t in TARGETS if t.owner == SCHEDULER and t.method == "_preempt_request")
    hook_preempt = signature_ok(scheduler_cls, preempt.method, preempt.params)
    try:
        in_range = Version(version) in SUPPORTED_VLLM.__class__(
            str(SUPPORTED_VLLM), prereleases=True
        )
    except InvalidVersion:
        in_range = False
    if missing:
        return Support(
            False,
            f"vLLM {version}: Scheduler lacks {', '.join(missing)} with the expected "
            f"signature; journey tracing stays off (supported: vllm{SUPPORTED_VLLM})",
        )
    if in_range:
        return Support(True, f"vLLM {version} is supported", hook_preempt)
    return Support(
        True,
        f"vLLM {version} is outside the tested range vllm{SUPPORTED_VLLM}, but every "
        "hooked Scheduler method is present with the expected parameters; enabling "
        "(not checked on this version: the request statuses and the fields of vLLM's "
        "requests and outputs the hooks read; a mismatch switches tracing off with a warning)",
        hook_preempt,
    )


def patchable(
    classes: Mapping[str, type | None], targets: Sequence[Target] | None = None
) -> tuple[list[Target], list[Target]]:
    """The targets to wrap on ``classes`` (owner name -> class, None when vLLM
    has no such class), and those left out: missing, with another signature, or
    in a group of which one is. ``targets``: :data:`TARGETS`."""
    targets = TARGETS if targets is None else targets
    ok = {t: signature_ok(classes.get(t.owner), t.method, t.params) for t in targets}
    broken_groups = {t.group for t in targets if t.group and not ok[t]}
    wrap = [t for t in targets if ok[t] and t.group not in broken_groups]
    return wrap, [t for t in targets if t not in wrap]
