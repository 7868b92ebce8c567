"""The span schema: span names, attribute keys and their enumerated values.

This module is the contract. Dashboards, collector configs, docs/spans.md and the
tests all read these names from here; nothing else in the package spells an
attribute key as a literal. Renaming anything here is a breaking change for users'
queries and dashboards.

Pure data: no imports of vLLM or of OpenTelemetry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

# ---------------------------------------------------------------------------
# Span names
# ---------------------------------------------------------------------------
SPAN_REQUEST: Final = "vllm.request"
SPAN_QUEUED: Final = "vllm.queued"
SPAN_SCHEDULED: Final = "vllm.scheduled"
SPAN_PREFILL: Final = "vllm.prefill"
SPAN_DECODE: Final = "vllm.decode"
SPAN_PREEMPTED: Final = "vllm.preempted"
# A wait for something specific inside vllm.queued or vllm.preempted.
SPAN_WAIT: Final = "vllm.wait"
# The opt-in step view: one scheduler step, its own trace.
SPAN_STEP: Final = "vllm.step"
# A request still in flight past VLLM_JOURNEY_OTEL_IN_FLIGHT_S: a snapshot of its
# journey so far, a child of the root its final journey will have.
SPAN_IN_FLIGHT: Final = "vllm.in_flight"
# The request's KV blocks kept for its KV connector after the request ended
# (disaggregated serving's prefill side: until the decode instance read them), a
# child of the root that outlives it.
SPAN_KV_HELD: Final = "vllm.kv_held"

# The API server's part of a request (VLLM_JOURNEY_OTEL_API_SPANS): from the HTTP
# request's receipt to its last response byte, the engine's vllm.request inside.
SPAN_API: Final = "vllm.api.request"
# Its input side: receipt to the hand-off to the engine core (reading, parsing,
# rendering, tokenization); its output side: the engine's last output reaching
# the API server to the last response byte.
SPAN_API_INPUT: Final = "vllm.api.input"
SPAN_API_OUTPUT: Final = "vllm.api.output"

SPAN_NAMES: Final = (
    SPAN_API,
    SPAN_API_INPUT,
    SPAN_API_OUTPUT,
    SPAN_REQUEST,
    SPAN_QUEUED,
    SPAN_SCHEDULED,
    SPAN_PREFILL,
    SPAN_DECODE,
    SPAN_PREEMPTED,
    SPAN_WAIT,
    SPAN_STEP,
    SPAN_IN_FLIGHT,
    SPAN_KV_HELD,
)

# Instrumentation scope of every span we emit.
SCOPE_NAME: Final = "vllm_journey_otel"

# ---------------------------------------------------------------------------
# Attributes on every span below the root (snapshot at the span's end)
# ---------------------------------------------------------------------------
PREFILL_DONE_TOKENS: Final = "vllm.journey.prefill_done_tokens"
PREFILL_TOTAL_TOKENS: Final = "vllm.journey.prefill_total_tokens"
DECODE_DONE_TOKENS: Final = "vllm.journey.decode_done_tokens"
DECODE_MAX_TOKENS: Final = "vllm.journey.decode_max_tokens"
PHASE: Final = "vllm.journey.phase"
NUM_PREEMPTIONS: Final = "vllm.journey.num_preemptions"
SCHEDULER_STEP: Final = "vllm.journey.scheduler_step"

# vllm.scheduled only
SCHEDULE_KIND: Final = "vllm.journey.schedule_kind"
CYCLE: Final = "vllm.journey.cycle"

# vllm.prefill only
PREFILL_CHUNKS: Final = "vllm.journey.prefill_chunks"
CACHED_TOKENS: Final = "vllm.journey.cached_tokens"

# vllm.preempted only
KV_CACHE_USAGE: Final = "vllm.journey.kv_cache_usage"
NUM_RUNNING: Final = "vllm.journey.num_running_reqs"
NUM_WAITING: Final = "vllm.journey.num_waiting_reqs"
PREEMPTED_BY: Final = "vllm.journey.preempted_by"

# Streaming-input sessions: vllm.queued and vllm.scheduled (segment), root (count)
SEGMENT: Final = "vllm.journey.segment"
NUM_SEGMENTS: Final = "vllm.journey.num_segments"

# vllm.wait only
WAIT_REASON: Final = "vllm.journey.wait_reason"
# vllm.wait (remote_kv) only, when the KV connector reported the load done
KV_TRANSFER_MS: Final = "vllm.journey.kv_transfer.ms"
KV_TRANSFER_TOKENS: Final = "vllm.journey.kv_transfer.tokens"
KV_TRANSFER_FAILED: Final = "vllm.journey.kv_transfer.failed"
# Disaggregated serving. Root of the decode side's journey (and its link to the
# prefill side's): the request and engine that computed its KV.
KV_REMOTE_REQUEST_ID: Final = "vllm.journey.kv_transfer.remote_request_id"
KV_REMOTE_ENGINE_ID: Final = "vllm.journey.kv_transfer.remote_engine_id"
# Root and vllm.kv_held of the prefill side's journey.
KV_HELD_MS: Final = "vllm.journey.kv_held.ms"
KV_HELD_BLOCKS: Final = "vllm.journey.kv_held.blocks"
KV_HELD_RELEASED: Final = "vllm.journey.kv_held.released"

# vllm.step only (also SCHEDULER_STEP, KV_CACHE_USAGE, NUM_RUNNING, NUM_WAITING)
STEP_BATCH_SIZE: Final = "vllm.step.batch_size"
STEP_PREFILL_TOKENS: Final = "vllm.step.prefill_tokens"
STEP_DECODE_TOKENS: Final = "vllm.step.decode_tokens"
STEP_NUM_PREEMPTIONS: Final = "vllm.step.num_preemptions"
STEP_SCHEDULE_MS: Final = "vllm.step.schedule_ms"

# Speculative decoding (vllm.decode: that span's verify steps; root: the request's)
# vllm.in_flight (a snapshot of a request that has not ended).
IN_FLIGHT_STATE: Final = "vllm.journey.in_flight.state"
IN_FLIGHT_MS: Final = "vllm.journey.in_flight.ms"
IN_FLIGHT_SNAPSHOT: Final = "vllm.journey.in_flight.snapshot"
# On each of its events (one per span of the journey so far).
IN_FLIGHT_EVENT_MS: Final = "vllm.journey.in_flight.span_ms"
IN_FLIGHT_EVENT_OPEN: Final = "vllm.journey.in_flight.open"

SPEC_DRAFTS_PROPOSED: Final = "vllm.journey.spec.drafts_proposed"
SPEC_DRAFTS_ACCEPTED: Final = "vllm.journey.spec.drafts_accepted"
SPEC_ACCEPTANCE_RATE: Final = "vllm.journey.spec.acceptance_rate"

# ---------------------------------------------------------------------------
# Root (vllm.request) attributes
# ---------------------------------------------------------------------------
REQUEST_ID: Final = "vllm.request.id"
GEN_AI_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
GEN_AI_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
GEN_AI_CACHE_READ_TOKENS: Final = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
FINISH_STATUS: Final = "vllm.journey.finish_status"
PRIORITY: Final = "vllm.request.priority"
LORA_NAME: Final = "vllm.request.lora_name"
QUEUED_MS: Final = "vllm.journey.queued_ms"
TTFT_MS: Final = "vllm.journey.ttft_ms"
PREFILL_MS: Final = "vllm.journey.prefill_ms"
DECODE_MS: Final = "vllm.journey.decode_ms"
CLOCK_UNCERTAINTY_US: Final = "vllm.journey.clock_uncertainty_us"
SAMPLED_BY: Final = "vllm.journey.sampled_by"
# The tracer's own health, cumulative per exporting process since it started.
TRACER_DROPPED_JOURNEYS: Final = "vllm.journey.tracer.dropped_journeys"
TRACER_LOST_SPANS: Final = "vllm.journey.tracer.lost_spans"
# NUM_PREEMPTIONS (above) is on the root too.

# ---------------------------------------------------------------------------
# API-server spans (vllm.api.*)
# ---------------------------------------------------------------------------
API_TTFT_MS: Final = "vllm.api.ttft_ms"
API_TTFB_MS: Final = "vllm.api.ttfb_ms"
API_E2E_MS: Final = "vllm.api.e2e_ms"
API_STREAM: Final = "vllm.api.stream"
API_DISCONNECTED: Final = "vllm.api.disconnected"
API_REQUEST_IDS: Final = "vllm.api.request_ids"
API_READ_MS: Final = "vllm.api.read_ms"
API_RENDER_MS: Final = "vllm.api.render_ms"
API_CHUNKS: Final = "vllm.api.chunks"
# OpenTelemetry's HTTP semantic conventions (stable since semconv 1.23).
HTTP_METHOD: Final = "http.request.method"
URL_PATH: Final = "url.path"
HTTP_STATUS: Final = "http.response.status_code"
ERROR_TYPE: Final = "error.type"

# ---------------------------------------------------------------------------
# Resource attributes
# ---------------------------------------------------------------------------
RES_SERVICE_NAME: Final = "service.name"
RES_MODEL: Final = "vllm.model.name"
RES_DP_RANK: Final = "vllm.data_parallel.rank"
# Disaggregated serving: the instance's part (KV_ROLES, from its
# --kv-transfer-config kv_role) and its connector's engine id.
RES_KV_ROLE: Final = "vllm.kv_transfer.role"
RES_KV_ENGINE_ID: Final = "vllm.kv_transfer.engine_id"
RES_VLLM_VERSION: Final = "vllm.version"
RES_PLUGIN_VERSION: Final = "vllm.journey.plugin.version"
RES_HOST: Final = "host.name"
RES_PID: Final = "process.pid"
DEFAULT_SERVICE_NAME: Final = "vllm"

# ---------------------------------------------------------------------------
# Enumerated values
# ---------------------------------------------------------------------------
SCHEDULE_FIRST: Final = "FIRST"
SCHEDULE_RESUME: Final = "RESUME"
# Streaming input: the first cycle of the session's next input segment.
SCHEDULE_NEXT_INPUT: Final = "NEXT_INPUT"

# RES_KV_ROLE's values, by vLLM's kv_role.
KV_ROLES: Final = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}

PHASE_PREFILL: Final = "PREFILL"
PHASE_DECODE: Final = "DECODE"

# Where an in-flight request is (vllm.in_flight); the record holds the index.
IN_FLIGHT_QUEUED: Final = "queued"
IN_FLIGHT_RUNNING: Final = "running"
IN_FLIGHT_PREEMPTED: Final = "preempted"
IN_FLIGHT_STATES: Final = (IN_FLIGHT_QUEUED, IN_FLIGHT_RUNNING, IN_FLIGHT_PREEMPTED)

# Wait reasons (vllm.wait); the journey records their index in this tuple.
WAIT_LORA_SLOT: Final = "lora_slot"
WAIT_GRAMMAR: Final = "structured_output_grammar"
WAIT_REMOTE_KV: Final = "remote_kv"
WAIT_STREAMING_INPUT: Final = "streaming_input"
WAIT_REASONS: Final = (WAIT_LORA_SLOT, WAIT_GRAMMAR, WAIT_REMOTE_KV, WAIT_STREAMING_INPUT)

SAMPLED_HEAD: Final = "head"
SAMPLED_TAIL: Final = "tail"

FINISH_STOPPED: Final = "stopped"
FINISH_LENGTH: Final = "length"
FINISH_ABORTED: Final = "aborted"
FINISH_IGNORED: Final = "ignored"
FINISH_ERROR: Final = "error"
FINISH_STATUSES: Final = (
    FINISH_STOPPED,
    FINISH_LENGTH,
    FINISH_ABORTED,
    FINISH_IGNORED,
    FINISH_ERROR,
)


@dataclass(frozen=True)
class AttributeSpec:
    """One attribute of the schema, as docs/spans.md documents it."""

    key: str
    spans: tuple[str, ...]
    type: str
    meaning: str


_BELOW_ROOT = (SPAN_QUEUED, SPAN_SCHEDULED, SPAN_PREFILL, SPAN_DECODE, SPAN_PREEMPTED)
# Progress attributes: on every span below the root, and on an in-flight snapshot.
_PROGRESS = (*_BELOW_ROOT, SPAN_IN_FLIGHT)

_API = (SPAN_API,)

# Every attribute we emit, with where it appears. docs/spans.md is tested against
# this table (same keys, same spans) so the documentation cannot drift.
ATTRIBUTES: Final[tuple[AttributeSpec, ...]] = (
    AttributeSpec(REQUEST_ID, (SPAN_REQUEST, SPAN_IN_FLIGHT), "string", "vLLM request id"),
    AttributeSpec(GEN_AI_MAX_TOKENS, (SPAN_REQUEST,), "int", "max_tokens asked for"),
    AttributeSpec(GEN_AI_INPUT_TOKENS, (SPAN_REQUEST,), "int", "prompt tokens"),
    AttributeSpec(GEN_AI_OUTPUT_TOKENS, (SPAN_REQUEST,), "int", "generated tokens"),
    AttributeSpec(
        GEN_AI_CACHE_READ_TOKENS,
        (SPAN_REQUEST,),
        "int",
        "prompt tokens served from the prefix cache at first schedule; absent if never scheduled",
    ),
    AttributeSpec(GEN_AI_FINISH_REASONS, (SPAN_REQUEST,), "string[]", "OpenAI finish reason"),
    AttributeSpec(FINISH_STATUS, (SPAN_REQUEST,), "string", "stopped|length|aborted|ignored|error"),
    AttributeSpec(PRIORITY, (SPAN_REQUEST,), "int", "scheduling priority, when not 0"),
    AttributeSpec(
        LORA_NAME, (SPAN_REQUEST, SPAN_SCHEDULED), "string", "LoRA adapter name, when set"
    ),
    AttributeSpec(QUEUED_MS, (SPAN_REQUEST,), "double", "admission to first schedule"),
    AttributeSpec(TTFT_MS, (SPAN_REQUEST,), "double", "arrival to first token"),
    AttributeSpec(PREFILL_MS, (SPAN_REQUEST,), "double", "first schedule to first token"),
    AttributeSpec(DECODE_MS, (SPAN_REQUEST,), "double", "first token to last token"),
    AttributeSpec(
        CLOCK_UNCERTAINTY_US, (SPAN_REQUEST,), "double", "half-width of the clock anchor"
    ),
    AttributeSpec(
        SAMPLED_BY,
        (SPAN_REQUEST, SPAN_API),
        "string",
        "head (sampled at admission) or tail (kept by the tail rule)",
    ),
    AttributeSpec(
        TRACER_DROPPED_JOURNEYS,
        (SPAN_REQUEST, SPAN_API),
        "int",
        "journeys this engine core dropped before this one (full queue, exporter gone); cumulative",
    ),
    AttributeSpec(
        TRACER_LOST_SPANS,
        (SPAN_REQUEST, SPAN_API),
        "int",
        "spans the exporter could not deliver before this one (export failed, full "
        "queue); cumulative",
    ),
    AttributeSpec(
        NUM_PREEMPTIONS,
        (SPAN_REQUEST, *_PROGRESS),
        "int",
        "preemptions so far",
    ),
    AttributeSpec(
        PREFILL_DONE_TOKENS, _PROGRESS, "int", "prompt tokens computed (high-water mark)"
    ),
    AttributeSpec(PREFILL_TOTAL_TOKENS, _PROGRESS, "int", "prompt tokens"),
    AttributeSpec(DECODE_DONE_TOKENS, _PROGRESS, "int", "tokens generated so far"),
    AttributeSpec(DECODE_MAX_TOKENS, _PROGRESS, "int", "max_tokens"),
    AttributeSpec(PHASE, _PROGRESS, "string", "PREFILL|DECODE"),
    AttributeSpec(
        SCHEDULER_STEP, (*_PROGRESS, SPAN_STEP), "int", "plugin's scheduler step counter"
    ),
    AttributeSpec(SCHEDULE_KIND, (SPAN_SCHEDULED,), "string", "FIRST|RESUME|NEXT_INPUT"),
    AttributeSpec(CYCLE, (SPAN_SCHEDULED,), "int", "0, 1, ... per running cycle"),
    AttributeSpec(PREFILL_CHUNKS, (SPAN_PREFILL,), "int", "scheduler steps carrying prefill"),
    AttributeSpec(CACHED_TOKENS, (SPAN_PREFILL,), "int", "tokens already computed at cycle start"),
    AttributeSpec(
        KV_CACHE_USAGE,
        (SPAN_QUEUED, SPAN_PREEMPTED, SPAN_STEP),
        "double",
        "KV-cache usage 0..1 at the moment",
    ),
    AttributeSpec(
        NUM_RUNNING,
        (SPAN_QUEUED, SPAN_PREEMPTED, SPAN_STEP),
        "int",
        "running queue length at the moment",
    ),
    AttributeSpec(
        NUM_WAITING,
        (SPAN_QUEUED, SPAN_PREEMPTED, SPAN_STEP),
        "int",
        "waiting queue length at the moment",
    ),
    AttributeSpec(
        PREEMPTED_BY, (SPAN_PREEMPTED,), "string", "request whose KV allocation forced it"
    ),
    AttributeSpec(WAIT_REASON, (SPAN_WAIT, SPAN_IN_FLIGHT), "string", "what the request waits for"),
    AttributeSpec(IN_FLIGHT_STATE, (SPAN_IN_FLIGHT,), "string", "queued|running|preempted"),
    AttributeSpec(IN_FLIGHT_MS, (SPAN_IN_FLIGHT,), "double", "in flight so far (root start on)"),
    AttributeSpec(IN_FLIGHT_SNAPSHOT, (SPAN_IN_FLIGHT,), "int", "1, 2, ... per request"),
    AttributeSpec(
        IN_FLIGHT_EVENT_MS, (SPAN_IN_FLIGHT,), "double", "event: the span's duration so far"
    ),
    AttributeSpec(
        IN_FLIGHT_EVENT_OPEN, (SPAN_IN_FLIGHT,), "boolean", "event: the span is still open"
    ),
    AttributeSpec(
        KV_TRANSFER_MS,
        (SPAN_WAIT,),
        "double",
        "remote_kv: load started to the connector reporting it done; absent if not reported",
    ),
    AttributeSpec(
        KV_TRANSFER_TOKENS, (SPAN_WAIT,), "int", "remote_kv: prompt tokens the load was for"
    ),
    AttributeSpec(
        KV_TRANSFER_FAILED,
        (SPAN_WAIT,),
        "boolean",
        "remote_kv: the connector reported the load failed",
    ),
    AttributeSpec(
        KV_REMOTE_REQUEST_ID,
        (SPAN_REQUEST,),
        "string",
        "decode side: the request its kv_transfer_params name as its KV's source",
    ),
    AttributeSpec(
        KV_REMOTE_ENGINE_ID,
        (SPAN_REQUEST,),
        "string",
        "decode side: the prefill instance's engine id (its connector's)",
    ),
    AttributeSpec(
        KV_HELD_MS,
        (SPAN_REQUEST, SPAN_KV_HELD),
        "double",
        "the request's end to vLLM freeing the KV blocks its connector kept; absent if never",
    ),
    AttributeSpec(
        KV_HELD_BLOCKS, (SPAN_REQUEST, SPAN_KV_HELD), "int", "KV blocks kept for the connector"
    ),
    AttributeSpec(
        KV_HELD_RELEASED,
        (SPAN_KV_HELD,),
        "boolean",
        "false: still held when the engine shut down",
    ),
    AttributeSpec(
        SEGMENT, (SPAN_QUEUED, SPAN_SCHEDULED), "int", "streaming input: the input segment"
    ),
    AttributeSpec(NUM_SEGMENTS, (SPAN_REQUEST,), "int", "streaming input: input segments"),
    AttributeSpec(
        API_TTFT_MS,
        _API,
        "double",
        "receipt to the engine's first token reaching the API server: the read "
        "before vLLM's arrival stamp plus vLLM's own TTFT (n>1: the earliest); "
        "absent without vLLM's request stats",
    ),
    AttributeSpec(
        API_TTFB_MS,
        _API,
        "double",
        "receipt to the first response bytes after the hand-off to the engine "
        "(a stream's first chunk; a whole response's body)",
    ),
    AttributeSpec(API_E2E_MS, _API, "double", "receipt to the last response byte"),
    AttributeSpec(API_STREAM, _API, "boolean", "the response was a stream (text/event-stream)"),
    AttributeSpec(
        API_DISCONNECTED, _API, "boolean", "the client went away before the last response byte"
    ),
    AttributeSpec(API_REQUEST_IDS, _API, "string[]", "the engine requests it made (n>1: each)"),
    AttributeSpec(HTTP_METHOD, _API, "string", "HTTP method"),
    AttributeSpec(URL_PATH, _API, "string", "request path"),
    AttributeSpec(HTTP_STATUS, _API, "int", "response status; absent if none was sent"),
    AttributeSpec(
        ERROR_TYPE, _API, "string", "failed: the status code, or the exception's class name"
    ),
    AttributeSpec(
        API_READ_MS,
        (SPAN_API_INPUT,),
        "double",
        "receipt to vLLM's arrival stamp (request read, parsed, validated)",
    ),
    AttributeSpec(
        API_RENDER_MS,
        (SPAN_API_INPUT,),
        "double",
        "vLLM's arrival stamp to the hand-off (chat template, tokenization, input processing)",
    ),
    AttributeSpec(API_CHUNKS, (SPAN_API_OUTPUT,), "int", "response body chunks sent in all"),
    AttributeSpec(STEP_BATCH_SIZE, (SPAN_STEP,), "int", "requests scheduled in the step"),
    AttributeSpec(STEP_PREFILL_TOKENS, (SPAN_STEP,), "int", "scheduled prompt/recompute tokens"),
    AttributeSpec(STEP_DECODE_TOKENS, (SPAN_STEP,), "int", "scheduled decode tokens"),
    AttributeSpec(STEP_NUM_PREEMPTIONS, (SPAN_STEP,), "int", "preemptions in the step"),
    AttributeSpec(STEP_SCHEDULE_MS, (SPAN_STEP,), "double", "time in schedule()"),
    AttributeSpec(
        SPEC_DRAFTS_PROPOSED, (SPAN_REQUEST, SPAN_DECODE), "int", "draft tokens proposed"
    ),
    AttributeSpec(
        SPEC_DRAFTS_ACCEPTED, (SPAN_REQUEST, SPAN_DECODE), "int", "draft tokens accepted"
    ),
    AttributeSpec(
        SPEC_ACCEPTANCE_RATE, (SPAN_REQUEST, SPAN_DECODE), "double", "accepted / proposed"
    ),
)

RESOURCE_ATTRIBUTES: Final = (
    RES_SERVICE_NAME,
    RES_MODEL,
    RES_DP_RANK,
    RES_KV_ROLE,
    RES_KV_ENGINE_ID,
    RES_VLLM_VERSION,
    RES_PLUGIN_VERSION,
    RES_HOST,
    RES_PID,
)


def attributes_of(span_name: str) -> frozenset[str]:
    """Keys the schema allows on spans named ``span_name``."""
    return frozenset(a.key for a in ATTRIBUTES if span_name in a.spans)
