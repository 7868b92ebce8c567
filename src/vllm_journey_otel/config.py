"""The plugin's own settings: ``VLLM_JOURNEY_OTEL*`` environment variables.

Everything the OpenTelemetry SDK already reads (endpoint, headers, TLS, protocol,
OTEL_BSP_*, OTEL_TRACES_SAMPLER, OTEL_SERVICE_NAME, OTEL_SDK_DISABLED, ...) is left
to the SDK; this module parses only what is ours. A bad value never raises: it
logs one warning naming the variable and the accepted values, and the safe default
is used.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from vllm_journey_otel.switch import ENABLE, FALSE_WORDS, TRUE_WORDS

# A child of vLLM's logger, so our lines appear with vLLM's format and level.
logger = logging.getLogger("vllm.journey_otel")

QUEUE_SIZE = "VLLM_JOURNEY_OTEL_QUEUE_SIZE"
EXPORT_INTERVAL_MS = "VLLM_JOURNEY_OTEL_EXPORT_INTERVAL_MS"
SHUTDOWN_TIMEOUT_S = "VLLM_JOURNEY_OTEL_SHUTDOWN_TIMEOUT_S"
EXPORT_MODE = "VLLM_JOURNEY_OTEL_EXPORT_MODE"
EXPORTER_PROCESSES = "VLLM_JOURNEY_OTEL_EXPORTER_PROCESSES"
SHUTDOWN_GRACE_MS = "VLLM_JOURNEY_OTEL_SHUTDOWN_GRACE_MS"
# The OTLP/JSON file exporter (OTEL_TRACES_EXPORTER=otlp_json_file).
FILE_PATH = "VLLM_JOURNEY_OTEL_FILE"
FILE_MAX_MB = "VLLM_JOURNEY_OTEL_FILE_MAX_MB"
FILE_KEEP = "VLLM_JOURNEY_OTEL_FILE_KEEP"
# The tail rule (sampling.py).
TAIL = "VLLM_JOURNEY_OTEL_TAIL"
TAIL_SLOW_MS = "VLLM_JOURNEY_OTEL_TAIL_SLOW_MS"
# The engine step view (a vllm.step span per sampled scheduler step).
STEPS = "VLLM_JOURNEY_OTEL_STEPS"
STEPS_RATIO = "VLLM_JOURNEY_OTEL_STEPS_RATIO"
# How our own code competes with vLLM's for the CPU (cpu_yield.py).
CPU_PRIORITY = "VLLM_JOURNEY_OTEL_CPU_PRIORITY"
EXPORTER_CPUS = "VLLM_JOURNEY_OTEL_EXPORTER_CPUS"

ALL_VARIABLES = (
    ENABLE,
    QUEUE_SIZE,
    EXPORT_INTERVAL_MS,
    SHUTDOWN_TIMEOUT_S,
    EXPORT_MODE,
    EXPORTER_PROCESSES,
    SHUTDOWN_GRACE_MS,
    FILE_PATH,
    FILE_MAX_MB,
    FILE_KEEP,
    TAIL,
    TAIL_SLOW_MS,
    STEPS,
    STEPS_RATIO,
    CPU_PRIORITY,
    EXPORTER_CPUS,
)

MODE_PROCESS = "process"
MODE_THREAD = "thread"

# CPU_PRIORITY: the lowest the platform allows (Linux SCHED_IDLE, else nice 19),
# nice 19 only, or the priority inherited from vLLM.
PRIORITY_IDLE = "idle"
PRIORITY_NICE = "nice"
PRIORITY_NORMAL = "normal"
# EXPORTER_CPUS: the CPUs this process may use except those vLLM binds its own
# threads to (its CPU backend), every CPU it may use, or an explicit list.
CPUS_AUTO = "auto"
CPUS_ALL = "all"

_TRUE = TRUE_WORDS
_FALSE = FALSE_WORDS


@dataclass(frozen=True)
class Config:
    """Parsed settings. Immutable; read once per process when the plugin loads."""

    enabled: bool = False
    # Finished journeys waiting to leave the engine thread; beyond it they are
    # dropped and counted, never blocking the engine.
    queue_size: int = 16384
    # How often the drain thread wakes to hand queued journeys on. Journeys still
    # queued when the engine core is killed are lost, so keep it short.
    export_interval_ms: int = 50
    # "process": spans are built and exported by a detached exporter process fed
    # over a pipe (off the engine core's GIL, survives the engine core being
    # killed); "thread": by a thread of the engine core.
    export_mode: str = MODE_PROCESS
    # Exporter processes in "process" mode; each frame goes to the one sent the
    # fewest bytes whose pipe has room. One builds and
    # exports about 3,500 finished journeys a second on a free core.
    exporter_processes: int = 1
    # Deadline for the final flush of thread mode when the engine core shuts
    # down. vLLM's parent sends SIGKILL 0.1 ms (--shutdown-timeout 0) to 5 s (no
    # timeout given) after SIGTERM; the exporter process is not bound by it.
    shutdown_timeout_s: float = 3.0
    # API-server side: when vLLM is about to SIGKILL the engine core right after
    # its SIGTERM (--shutdown-timeout 0, the default), wait up to this long for
    # the engine core to exit by itself first. It aborts its requests on SIGTERM,
    # and those aborted journeys leave it within milliseconds; without the wait
    # the SIGKILL lands ~0.1 ms after the SIGTERM and they are lost. 0: off.
    shutdown_grace_ms: int = 500
    # The engine step view: a vllm.step span for a sampled fraction of the
    # scheduler steps that scheduled something. Off: one boolean check per step.
    steps: bool = False
    steps_ratio: float = 1.0
    # Our threads in vLLM's processes and the exporter process run at this CPU
    # priority: an observer yields first (vLLM's engine-core loop is one busy
    # thread per engine; every slice taken from it delays a step).
    cpu_priority: str = PRIORITY_IDLE
    # CPUs of the exporter process: CPUS_AUTO, CPUS_ALL, or explicit CPU numbers.
    exporter_cpus: str | tuple[int, ...] = CPUS_AUTO


def _flag(env: Mapping[str, str], name: str, off: str = "Journey tracing stays off") -> bool:
    raw = env.get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value not in _FALSE:
        logger.warning(
            "%s=%r is not understood; accepted values: 1/true/yes/on or 0/false/no/off. %s.",
            name,
            raw,
            off,
        )
    return False


def _number(env: Mapping[str, str], name: str, default: float, low: float, high: float) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (low <= value <= high):  # also rejects NaN
        logger.warning(
            "%s=%r is not a number in [%g, %g]; using the default %g.",
            name,
            raw,
            low,
            high,
            default,
        )
        return default
    return value


def _choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        logger.warning(
            "%s=%r is not one of %s; using the default %s.", name, raw, "/".join(choices), default
        )
        return default
    return value


def parse_cpu_list(text: str) -> tuple[int, ...] | None:
    """``"0,2-3"`` -> (0, 2, 3), in Linux's cpulist format; None when malformed."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            return None
        first, last = int(low), int(high) if dash else int(low)
        if last < first or last > 65_535:
            return None
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def _cpus(env: Mapping[str, str], name: str, default: str) -> str | tuple[int, ...]:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in (CPUS_AUTO, CPUS_ALL):
        return value
    cpus = parse_cpu_list(value)
    if cpus is None:
        logger.warning(
            "%s=%r is not %s, %s or a CPU list such as 2,3,8-11; using the default %s.",
            name,
            raw,
            CPUS_AUTO,
            CPUS_ALL,
            default,
        )
        return default
    return cpus


def from_env(env: Mapping[str, str] | None = None) -> Config:
    """Read the settings from ``env`` (default: ``os.environ``). Never raises."""
    env = os.environ if env is None else env
    if not _flag(env, ENABLE):
        return Config(enabled=False)
    d = Config()
    return Config(
        enabled=True,
        queue_size=int(_number(env, QUEUE_SIZE, d.queue_size, 1, 10_000_000)),
        export_interval_ms=int(_number(env, EXPORT_INTERVAL_MS, d.export_interval_ms, 1, 60_000)),
        shutdown_timeout_s=_number(env, SHUTDOWN_TIMEOUT_S, d.shutdown_timeout_s, 0, 60),
        export_mode=_choice(env, EXPORT_MODE, d.export_mode, (MODE_PROCESS, MODE_THREAD)),
        exporter_processes=int(_number(env, EXPORTER_PROCESSES, d.exporter_processes, 1, 64)),
        shutdown_grace_ms=int(_number(env, SHUTDOWN_GRACE_MS, d.shutdown_grace_ms, 0, 60_000)),
        steps=_flag(env, STEPS, "The step view stays off"),
        steps_ratio=_number(env, STEPS_RATIO, d.steps_ratio, 0, 1),
        cpu_priority=_choice(
            env, CPU_PRIORITY, d.cpu_priority, (PRIORITY_IDLE, PRIORITY_NICE, PRIORITY_NORMAL)
        ),
        exporter_cpus=_cpus(env, EXPORTER_CPUS, CPUS_AUTO),
    )


# The export stage's batches (export_stage.py) read the SDK's batch-processor
# variables: the stage replaces that processor, the variables keep their meaning.
BSP_MAX_EXPORT_BATCH_SIZE = "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"
BSP_SCHEDULE_DELAY = "OTEL_BSP_SCHEDULE_DELAY"
BSP_MAX_QUEUE_SIZE = "OTEL_BSP_MAX_QUEUE_SIZE"


@dataclass(frozen=True)
class Batching:
    """How the export stage batches spans."""

    # Spans per export: ~0.9 MB of OTLP at ~430 bytes a span, well under the
    # 4 MiB a gRPC server (the Collector's default) accepts; one export round
    # trip of 50 ms still carries ~40,000 spans a second.
    max_batch: int = 2048
    # A batch that is not full leaves after this long.
    delay_ms: float = 500.0
    # Spans waiting beside the batch being exported (0: twice the batch); with
    # that many, span building waits and the exporter stops reading its pipe.
    max_pending: int = 0


def batching_from_env(env: Mapping[str, str] | None = None) -> Batching:
    """The SDK's OTEL_BSP_* variables as the export stage uses them. Never raises.

    An empty value is unset (a compose file's ``VAR: ${VAR}`` with VAR unset).
    A queue below the batch makes the batch the queue's size.
    """
    env = os.environ if env is None else env
    d = Batching()
    batch = int(_number(env, BSP_MAX_EXPORT_BATCH_SIZE, d.max_batch, 1, 1_000_000))
    delay = _number(env, BSP_SCHEDULE_DELAY, d.delay_ms, 0, 3_600_000)
    queue = int(_number(env, BSP_MAX_QUEUE_SIZE, 0, 0, 100_000_000))
    pending = queue if queue > 0 else 2 * batch
    return Batching(max_batch=min(batch, pending), delay_ms=delay, max_pending=pending)
