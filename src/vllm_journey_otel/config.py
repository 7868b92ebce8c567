"""Every environment variable the plugin reads, parsed here and nowhere else.

Our own ``VLLM_JOURNEY_OTEL*`` settings, and the OpenTelemetry SDK's variables
that our code must interpret itself because it does the SDK's part: the sampler
(``OTEL_TRACES_SAMPLER``), batching (``OTEL_BSP_*``), the exporter's choice
(``OTEL_TRACES_EXPORTER``, the OTLP protocol), the span limits, and where OTLP
goes and how (``OTEL_EXPORTER_OTLP_*``, for ``doctor`` and the exporter
process's certificate). The SDK's exporters still read their own settings
(endpoint, headers, TLS, timeout) when they are built. Any process, any thread;
pure functions of the mapping given. A bad value never raises: it logs one
warning naming the variable and the accepted values, and the safe default is
used.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from urllib.parse import urlparse

from vllm_journey_otel.log import logger
from vllm_journey_otel.switch import ENABLE, FALSE_WORDS, TRUE_WORDS

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
# Requests in flight longer than this are exported as snapshots (in_flight.py).
IN_FLIGHT_S = "VLLM_JOURNEY_OTEL_IN_FLIGHT_S"
# The API server's part of each request (engine/api_server.py); on by default.
API_SPANS = "VLLM_JOURNEY_OTEL_API_SPANS"
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
    IN_FLIGHT_S,
    API_SPANS,
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
    # exports about 6,000 finished journeys a second on a free core.
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
    # A request in flight this long (from its admission) is exported as a
    # snapshot of its journey so far, again at twice that age, four times, ...;
    # its final journey still comes when it ends. 0: off.
    in_flight_s: float = 60.0
    # The API server's part of each traced request: a vllm.api.request span from
    # the HTTP request's receipt to its last response byte, with the engine's
    # journey nested inside. Off: the engine's root is the request's server span.
    api_spans: bool = True
    # Our threads in vLLM's processes and the exporter process run at this CPU
    # priority: an observer yields first (vLLM's engine-core loop is one busy
    # thread per engine; every slice taken from it delays a step).
    cpu_priority: str = PRIORITY_IDLE
    # CPUs of the exporter process: CPUS_AUTO, CPUS_ALL, or explicit CPU numbers.
    exporter_cpus: str | tuple[int, ...] = CPUS_AUTO


def _flag(
    env: Mapping[str, str], name: str, off: str = "Journey tracing stays off", default: bool = False
) -> bool:
    raw = env.get(name, "")
    value = raw.strip().lower()
    if default and not value:
        return True
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
        in_flight_s=_number(env, IN_FLIGHT_S, d.in_flight_s, 0, 86_400),
        api_spans=_flag(env, API_SPANS, "API-server spans stay off", default=True),
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


@dataclass(frozen=True)
class FileSettings:
    """The OTLP/JSON file exporter's settings (``OTEL_TRACES_EXPORTER=otlp_json_file``)."""

    path: str = "vllm-journeys.otlp.jsonl"
    max_mb: float = 100.0  # rotate when the file would pass this size
    keep: int = 5  # rotated files kept


def file_settings(env: Mapping[str, str] | None = None) -> FileSettings:
    """FILE_PATH, FILE_MAX_MB, FILE_KEEP. Never raises."""
    env = os.environ if env is None else env
    d = FileSettings()
    return FileSettings(
        path=env.get(FILE_PATH, "").strip() or d.path,
        max_mb=_number(env, FILE_MAX_MB, d.max_mb, 1, 1_000_000),
        keep=int(_number(env, FILE_KEEP, d.keep, 0, 1000)),
    )


# -- the OpenTelemetry SDK's variables we read ----------------------------------
TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"
SDK_DISABLED = "OTEL_SDK_DISABLED"
_PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
# ``otlp`` by protocol, as the SDK's auto-configuration maps it (opentelemetry-sdk 1.45).
_OTLP_BY_PROTOCOL = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}


def sdk_disabled(env: Mapping[str, str] | None = None) -> bool:
    """True when OTEL_SDK_DISABLED asks for no telemetry at all."""
    env = os.environ if env is None else env
    return env.get(SDK_DISABLED, "").strip().lower() == "true"


def _otlp_protocol(env: Mapping[str, str]) -> str:
    for name in _PROTOCOL_VARIABLES:
        value = env.get(name, "").strip()
        if value:
            return value
    return "grpc"


def exporter_names(env: Mapping[str, str] | None = None) -> list[str]:
    """Entry-point names of the span exporters asked for; ``otlp`` when unset.

    Raises ValueError for an OTLP protocol that is neither ``grpc`` nor
    ``http/protobuf`` (the SDK raises there too).
    """
    env = os.environ if env is None else env
    raw = env.get(TRACES_EXPORTER, "otlp").strip() or "otlp"
    if raw.lower() == "none":
        return []
    names = []
    for part in raw.split(","):
        name = part.strip()
        if name == "otlp":
            protocol = _otlp_protocol(env)
            if protocol not in _OTLP_BY_PROTOCOL:
                raise ValueError(
                    f"Unsupported OTLP protocol {protocol!r}: use grpc or http/protobuf"
                )
            name = _OTLP_BY_PROTOCOL[protocol]
        if name and name not in names:
            names.append(name)
    return names


SAMPLER = "OTEL_TRACES_SAMPLER"
SAMPLER_ARG = "OTEL_TRACES_SAMPLER_ARG"
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)


def head_sampling(env: Mapping[str, str]) -> tuple[bool, float]:
    """OTEL_TRACES_SAMPLER(_ARG): (parent-based, ratio). Never raises."""
    name = env.get(SAMPLER, "parentbased_always_on").strip().lower() or "parentbased_always_on"
    if name not in SAMPLERS:
        logger.warning(
            "%s=%r is not one of %s; using parentbased_always_on.",
            SAMPLER,
            name,
            ", ".join(SAMPLERS),
        )
        name = "parentbased_always_on"
    ratio = 1.0
    if name.endswith("always_off"):
        ratio = 0.0
    elif name.endswith("traceidratio"):
        raw = env.get(SAMPLER_ARG, "1.0")
        try:
            ratio = float(raw)
        except ValueError:
            ratio = float("nan")
        if not 0.0 <= ratio <= 1.0:
            logger.warning("%s=%r is not a ratio in [0, 1]; using 1.0.", SAMPLER_ARG, raw)
            ratio = 1.0
    return name.startswith("parentbased_"), ratio


TAIL_REASONS = ("preempted", "error", "aborted", "in_flight", "slow")
# Unset: all but "slow" (which needs its threshold).
TAIL_DEFAULT = TAIL_REASONS[:4]


def tail_rule(env: Mapping[str, str]) -> tuple[set[str], int | None]:
    """VLLM_JOURNEY_OTEL_TAIL(_SLOW_MS): (reasons, slow threshold in ns). Never raises."""
    raw = env.get(TAIL)
    reasons = set(TAIL_DEFAULT) if raw is None else set()
    if raw is not None and raw.strip().lower() not in ("", "none"):
        for part in raw.split(","):
            p = part.strip().lower()
            if p in TAIL_REASONS:
                reasons.add(p)
            elif p:
                logger.warning("%s: %r is not one of %s; ignored.", TAIL, p, "/".join(TAIL_REASONS))
    slow_ns = None
    slow_raw = env.get(TAIL_SLOW_MS)
    if slow_raw:
        try:
            slow_ms = float(slow_raw)
        except ValueError:
            slow_ms = float("nan")
        if slow_ms > 0:
            slow_ns = int(slow_ms * 1e6)
            reasons.add("slow")
        else:
            logger.warning("%s=%r is not a positive number of ms; ignored.", TAIL_SLOW_MS, slow_raw)
    if "slow" in reasons and slow_ns is None:
        logger.warning("%s lists 'slow' but %s is not set; ignored.", TAIL, TAIL_SLOW_MS)
    return reasons, slow_ns


# -- where OTLP goes, as the SDK's exporters resolve it (opentelemetry-exporter-otlp 1.45:
# the signal's variable first, then the generic one) -----------------------------------
OTLP = "OTEL_EXPORTER_OTLP_"
OTLP_TRACES_ENDPOINT, OTLP_ENDPOINT = f"{OTLP}TRACES_ENDPOINT", f"{OTLP}ENDPOINT"
OTLP_TRACES_TIMEOUT = f"{OTLP}TRACES_TIMEOUT"
_ENDPOINT_VARIABLES = (OTLP_TRACES_ENDPOINT, OTLP_ENDPOINT)
CERTIFICATE_VARIABLES = (f"{OTLP}TRACES_CERTIFICATE", f"{OTLP}CERTIFICATE")
# ``requests``' CA bundles, which override the certificate the HTTP exporter's
# session was given (export/exporter_process.py drops them where one is named).
CA_BUNDLE_VARIABLES = ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
# The SDK's span limits: ours apply unless the user set these (export/exporters.py).
LENGTH_LIMIT_VARIABLES = (
    "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
    "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
)
LINK_COUNT_LIMIT = "OTEL_SPAN_LINK_COUNT_LIMIT"
# gRPC's C core logs by this variable (doctor quiets it: its own report says more).
GRPC_VERBOSITY = "GRPC_VERBOSITY"


def first_set(env: Mapping[str, str], *names: str) -> tuple[str, str]:
    """(variable, value) of the first of ``names`` set non-empty, else ("", "")."""
    for name in names:
        if env.get(name, "").strip():
            return name, env[name].strip()
    return "", ""


def user_span_limits(env: Mapping[str, str] | None = None) -> tuple[bool, bool]:
    """Whether the user set an attribute length limit, and a link count limit."""
    env = os.environ if env is None else env
    return bool(first_set(env, *LENGTH_LIMIT_VARIABLES)[0]), bool(
        first_set(env, LINK_COUNT_LIMIT)[0]
    )


@dataclass(frozen=True)
class OtlpTarget:
    """Where an OTLP exporter sends, resolved from the OTEL_* variables as the SDK does."""

    protocol: str
    url: str  # as given (gRPC: the SDK keeps only host:port)
    source: str  # the variable it came from
    tls: bool
    ca: str  # CA file; "" for the system's
    host: str
    port: int
    timeout: str  # as configured, seconds
    hostport: str = ""
    headers: bool = False  # OTEL_EXPORTER_OTLP_(TRACES_)HEADERS set


def otlp_target(exporter: str, env: Mapping[str, str]) -> OtlpTarget:
    """For ``otlp_proto_grpc`` or ``otlp_proto_http``."""
    var, raw = first_set(env, OTLP_TRACES_ENDPOINT, OTLP_ENDPOINT)
    if exporter == "otlp_proto_grpc":
        url = raw or "http://localhost:4317"
        parsed = urlparse(url)
        insecure_var, insecure = first_set(env, f"{OTLP}TRACES_INSECURE", f"{OTLP}INSECURE")
        plain = insecure.lower() == "true" if insecure_var else parsed.scheme == "http"
        tls, where = parsed.scheme == "https" or not plain, urlparse(f"//{parsed.netloc or url}")
    else:
        base = f"{(raw or 'http://localhost:4318').rstrip('/')}/v1/traces"
        url = raw if var == OTLP_TRACES_ENDPOINT else base
        var = f"{OTLP_ENDPOINT} + /v1/traces" if var == OTLP_ENDPOINT else var
        where = urlparse(url)
        tls = where.scheme == "https"
    port = 0
    with suppress(ValueError):  # not a number: the exporter's own error says so
        port = where.port or (443 if tls else 80)
    ca = first_set(env, *CERTIFICATE_VARIABLES)[1] if tls else ""
    timeout = first_set(env, OTLP_TRACES_TIMEOUT, f"{OTLP}TIMEOUT")[1] or "10"
    protocol = "grpc" if exporter == "otlp_proto_grpc" else "http/protobuf"
    host = where.hostname or ""
    headers = bool(first_set(env, f"{OTLP}TRACES_HEADERS", f"{OTLP}HEADERS")[0])
    source = var or "default"
    return OtlpTarget(
        protocol, url, source, tls, ca, host, port, timeout, f"{host}:{port}", headers
    )


def endpoint_name(exporter_names: list[str], env: Mapping[str, str] | None = None) -> str:
    """What the first exporter sends to, for log messages: the OTLP endpoint
    variable when it is an OTLP exporter, else its name."""
    env = os.environ if env is None else env
    if not exporter_names:
        return ""
    first = exporter_names[0]
    if first.startswith("otlp_proto"):
        for name in _ENDPOINT_VARIABLES:
            if env.get(name, "").strip():
                return env[name].strip()
        return "the default OTLP endpoint"
    return first
