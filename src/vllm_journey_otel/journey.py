"""The journey records both processes speak: frozen msgspec events and structs.

Pure: imports neither vLLM nor OpenTelemetry. The engine side's
:class:`~vllm_journey_otel.engine.request_journey.RequestJourney` (the state
machine, on the engine-core thread) produces them; a finished request becomes a
:class:`FinishedJourney`, a sampled engine step a :class:`StepRecord`, and both
travel to the exporter process in ``wire.Frame`` s, where ``export/spans.py``
turns them into spans.

Clocks: ``*_mono_ns`` values are ``time.monotonic_ns()`` of the engine-core
process (CLOCK_MONOTONIC, the same clock as vLLM's ``time.monotonic()`` event
stamps); ``arrival_time_s`` is vLLM's ``Request.arrival_time``, *wall clock*
seconds taken by the API server, never subtracted from a monotonic value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import msgspec

from vllm_journey_otel import schema as S

# Finish statuses, as indices into schema.FINISH_STATUSES, derived from it (kept
# as ints on the engine thread; export/spans.py maps them back to the strings).
STATUS_STOPPED: Final = S.FINISH_STATUSES.index(S.FINISH_STOPPED)
STATUS_LENGTH: Final = S.FINISH_STATUSES.index(S.FINISH_LENGTH)
STATUS_ABORTED: Final = S.FINISH_STATUSES.index(S.FINISH_ABORTED)
STATUS_IGNORED: Final = S.FINISH_STATUSES.index(S.FINISH_IGNORED)
STATUS_ERROR: Final = S.FINISH_STATUSES.index(S.FINISH_ERROR)


class Snapshot(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Progress of a request at one transition (the end of some span).

    ``t_mono_ns`` is engine monotonic time. ``prefill_done_tokens`` is a high-water
    mark of prompt tokens computed (or scheduled for computation): it survives
    preemption, which resets vLLM's own ``num_computed_tokens``.
    """

    t_mono_ns: int
    step: int
    prefill_done_tokens: int
    decode_done_tokens: int
    num_preemptions: int
    # True once the current running cycle produced a token.
    decoding: bool


class Scheduled(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=1):
    """A running cycle starts (first schedule or resume after preemption)."""

    at: Snapshot
    resume: bool
    # Tokens already computed when the cycle started: the prefix-cache hit
    # (local and external) for a first schedule or a recompute.
    cached_tokens: int


class RootIds(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Ids chosen in advance for a journey's root span, so other spans can link to it.

    The 128-bit trace id is two 64-bit halves (msgpack has no larger ints); it is
    used only when the root starts a new trace (no valid client context).
    """

    trace_hi: int
    trace_lo: int
    span_id: int


class LinkTarget(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Another journey's root, as a link target: its ids and its client's headers.

    The link's trace id is the client's when ``trace_headers`` carry a valid
    ``traceparent`` (the root is then in the client's trace), else ``ids``'.
    """

    request_id: str
    ids: RootIds
    trace_headers: dict[str, str] | None


class FirstToken(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=2):
    """The first token of the current cycle arrived: prefill ends, decode starts."""

    at: Snapshot
    # Scheduler steps of this cycle that carried prefill tokens.
    prefill_chunks: int
    # Speculative decoding: the request's draft totals so far (0 without it).
    drafts_proposed: int = 0
    drafts_accepted: int = 0


class Preempted(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=3):
    """The cycle ended by preemption. ``kv_cache_usage`` is 0..1 at that moment.

    The last three are None when not observed (a vLLM without the private
    ``_preempt_request`` hook): missing is not zero.
    """

    at: Snapshot
    prefill_chunks: int
    kv_cache_usage: float | None
    num_running: int | None
    num_waiting: int | None
    # Speculative decoding: the request's draft totals at the preemption.
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    # The running request whose KV-block allocation forced this preemption, when
    # it was another request (None: not observed, or the victim itself).
    cause_id: str | None = None
    # Its journey's root, when that request is traced (head-sampled).
    cause_link: LinkTarget | None = None


class WaitBegan(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=4):
    """Inside the queue (queued or preempted), the request started waiting for
    something specific (``reason``: index into schema.WAIT_REASONS). The wait ends
    with the next :class:`WaitEnded`, or when the queued/preempted span ends."""

    t_mono_ns: int
    step: int
    reason: int


class WaitEnded(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=5):
    """The open wait ended (its cause went away) while the request stayed queued."""

    t_mono_ns: int
    step: int


class SegmentEnded(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=6):
    """Streaming input: the session's current input segment stopped and the
    request went back to the queue for the next one (the running cycle ends)."""

    at: Snapshot
    prefill_chunks: int
    drafts_proposed: int = 0
    drafts_accepted: int = 0


class KvLoaded(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=7):
    """KV connector: the asynchronous load of the open ``remote_kv`` wait was
    reported done by the worker side (``KVConnectorOutput.finished_recving``),
    seen in ``update_from_output`` (engine monotonic clock). The request stays in
    the wait until the next ``schedule()`` picks it up."""

    t_mono_ns: int
    step: int
    # Prompt tokens the connector loaded (vLLM's PrefillStats.num_external_cached_tokens);
    # -1: not observed.
    tokens: int
    # 1: the connector reported the load failed (vLLM recomputes what was lost,
    # or ends the request with an error); 0: reported done; -1: not known.
    failed: int


Event = Scheduled | FirstToken | Preempted | WaitBegan | WaitEnded | SegmentEnded | KvLoaded


class KvRemote(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Disaggregated serving, the decode side: the request came with KV computed
    by another instance (its ``kv_transfer_params`` name a remote request or
    engine). None fields: not named there."""

    request_id: str | None
    engine_id: str | None
    # The prefill journey's root, when that instance traced it (its ids came in
    # the params under KV_LINK_KEY).
    link: LinkTarget | None


class KvHeld(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Disaggregated serving, the prefill side: the request ended with its KV
    blocks kept for a remote decode instance (the connector's
    ``request_finished`` asked vLLM to delay freeing them), from the journey's
    end to ``end_mono_ns`` (engine monotonic clock)."""

    # The request's KV blocks then (all KV-cache groups); -1: not observed.
    blocks: int
    end_mono_ns: int
    # True: the worker side reported them sent (``finished_sending``: the decode
    # side read them, or the connector's lease on them ran out). False: still
    # held when the engine shut down (end_mono_ns is then).
    released: bool


# The key of the prefill journey's root in the ``kv_transfer_params`` its instance
# returns (the proxy hands those to the decode instance unchanged): a dict of
# "traceparent" (the root's trace and span ids), "request_id" and "engine_id".
KV_LINK_KEY: Final = "vllm_journey_prefill"


class FinishedJourney(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=10):
    """Everything needed to build a request's spans, recorded on the engine thread.

    Cheap to build (references and ints) and cheap to encode with msgspec, so it
    can be handed to another thread or process.
    """

    request_id: str
    # Wall clock (epoch seconds), from the API server.
    arrival_time_s: float
    admitted: Snapshot
    events: list[Event]
    end: Snapshot
    # Prefill chunks of the cycle that was running at the end (0 if none).
    end_prefill_chunks: int
    status: int
    # vLLM's FinishReason string ("stop", "length", "abort", ...).
    finish_reason: str | None
    prompt_tokens: int
    output_tokens: int
    max_tokens: int | None
    first_token_mono_ns: int | None
    last_token_mono_ns: int | None
    priority: int = 0
    lora_name: str | None = None
    trace_headers: dict[str, str] | None = None
    # False: head sampling dropped it and the tail rule kept it.
    head_sampled: bool = True
    # Ids of the root span, chosen in advance when another span links to it.
    root_ids: RootIds | None = None
    # A streaming-input session (vLLM's resumable request): token counts are the
    # session's, over all its input segments.
    session: bool = False
    # Speculative decoding was configured: the draft totals below are observed.
    spec_decode: bool = False
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    # The scheduler's own counters right after admission (this request counted
    # among the waiting): KV-cache usage 0..1, running and waiting queue lengths.
    # None: not observed.
    admitted_kv_cache_usage: float | None = None
    admitted_num_running: int | None = None
    admitted_num_waiting: int | None = None
    # Disaggregated serving: the decode side's remote KV, the prefill side's hold.
    kv_remote: KvRemote | None = None
    kv_held: KvHeld | None = None


class StepRecord(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=11):
    """One sampled scheduler step (the opt-in step view), recorded on the engine thread.

    From the start of ``schedule()`` to the end of the ``update_from_output()``
    that processed its output (with async scheduling, after the next schedule).
    """

    step: int
    start_mono_ns: int
    scheduled_mono_ns: int
    end_mono_ns: int
    batch_size: int
    prefill_tokens: int
    decode_tokens: int
    # Preemptions since the previous step's schedule (vLLM's preempted_req_ids).
    num_preemptions: int
    kv_cache_usage: float
    num_running: int
    num_waiting: int
    # Roots of the traced (head-sampled) journeys in the batch.
    links: list[LinkTarget]


class InFlight(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=12):
    """A request still in flight past the threshold (VLLM_JOURNEY_OTEL_IN_FLIGHT_S):
    its journey so far, recorded on the pipeline's drain thread. ``journey.end``
    is the moment of the snapshot; its status and finish reason mean nothing
    (the request has not ended). ``journey.root_ids`` are the ids the final
    root will have, so the snapshot nests under it once it arrives."""

    journey: FinishedJourney
    # 1 for the first snapshot of this request, 2 for the next, ...
    seq: int
    # Where the request is now: schema.IN_FLIGHT_STATES, and the open wait's
    # reason (index into schema.WAIT_REASONS; -1: none).
    state: int
    wait_reason: int


# The key the API server adds to the trace headers it hands to the engine core
# when the engine's journey is a child of its vllm.api.request span: the
# engine's root is then an INTERNAL span (the request's one SERVER span is the
# API server's, or the HTTP instrumentation's above it).
API_PARENT_KEY: Final = "vllm-journey-api-parent"
# The length of the traceparent the API server writes for them: version 00, its
# trace id, its span's id, flags 01 or 00 (55 characters, W3C).
API_TRACEPARENT_LEN: Final = 55
_API_FLAGS: Final = frozenset(("-00", "-01"))


def api_server_traceparent(headers: Mapping[str, str]) -> str | None:
    """The traceparent of trace headers exactly as the API server hands them to
    the engine core (its traceparent and its mark, nothing else), or None.

    In the default configuration every request carries these, and the engine
    thread reads them at each admission. The mark is an internal key: vLLM
    passes on only ``traceparent`` and ``tracestate`` from HTTP, so only the API
    server (or a program calling vLLM's engine client directly that sets the
    mark) can send it, and whoever sets it vouches for the ids. What the
    sampling decision reads is checked: version 00 and flags 00 or 01, as the
    API server writes them; anything else, or a tracestate beside them, takes
    the full W3C parse. (Headers of this form are within the size bounds
    already, so the engine thread keeps them as they are; any other headers
    are bounded at admission, ``trace_headers.bounded_trace_headers``.)"""
    if len(headers) == 2 and headers.get(API_PARENT_KEY) == "1":
        tp = headers.get("traceparent")
        if (
            type(tp) is str
            and len(tp) == API_TRACEPARENT_LEN
            and tp.startswith("00-")
            and tp[-3:] in _API_FLAGS
        ):
            return tp
    return None


class ApiJourney(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=13):
    """The API server's part of one HTTP request, recorded on the API server's
    event loop. ``*_mono_ns`` are ``time.monotonic_ns()`` of the API-server
    process (CLOCK_MONOTONIC, the engine core's clock on the same host);
    ``arrival_time_s`` is vLLM's wall-clock arrival stamp (epoch seconds, 0:
    none was seen). None: the moment did not happen or was not observed."""

    # Ids of the vllm.api.request span, chosen at receipt and handed to the
    # engine core as its journeys' parent.
    ids: RootIds
    # The parent's W3C headers (the client's, or the HTTP instrumentation's
    # span current at receipt); None: the span starts its own trace.
    parent_headers: dict[str, str] | None
    # False: another instrumentation's HTTP server span is the parent (ours is
    # INTERNAL then: one SERVER span per request).
    server_kind: bool
    head_sampled: bool
    method: str
    path: str
    stream: bool
    disconnected: bool
    # 0: no response status was sent.
    status_code: int
    # The exception's class name when the application raised.
    exception: str | None
    request_ids: list[str]
    receipt_mono_ns: int
    end_mono_ns: int
    arrival_time_s: float
    handoff_mono_ns: int | None
    first_body_mono_ns: int | None
    last_output_mono_ns: int | None
    chunks: int
    # The last response byte was handed on (end_mono_ns is it); False: the
    # request ended otherwise (a client gone, an error) and end_mono_ns is
    # when the app returned.
    responded: bool = True
    # When the engine's first token reached this API server, epoch ns of its
    # wall clock: vLLM's own stamp (its request stats' arrival_time plus
    # first_token_latency), the earliest of the request's engine requests.
    # None: no token came, or vLLM keeps no request stats (--disable-log-stats).
    first_token_unix_ns: int | None = None


# What the engine hands on to be exported.
Record = FinishedJourney | StepRecord | InFlight | ApiJourney
