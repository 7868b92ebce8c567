"""Which journeys are exported: head sampling at admission, a tail rule at the end.

Head: decided once per request when it is admitted, on the engine thread, from
the standard ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` values
(``always_on``, ``always_off``, ``traceidratio``, ``parentbased_always_on`` (the
default), ``parentbased_always_off``, ``parentbased_traceidratio``). A parent's
sampled flag is read from the request's W3C ``traceparent`` (its last two hex
digits). A ratio is decided on the trace id, by the rule of the SDK's
``TraceIdRatioBased`` (its low 64 bits below ratio x 2^64), so every journey of
one trace (``n>1`` siblings, vLLM's own ``llm_request`` span) gets the same
decision: the client's trace id, or, for a journey that starts its own trace,
the trace id drawn here and kept for its root. The span builder then uses an
always-on sampler: the decision was made here, once.

Tail: because the whole journey is known when it ends, a journey head sampling
dropped is still exported when it was preempted, errored, aborted, or slower
than a threshold (``VLLM_JOURNEY_OTEL_TAIL``, ``VLLM_JOURNEY_OTEL_TAIL_SLOW_MS``).
Such a journey becomes a new root linked to the client's span (the client's
trace was not sampled, so its spans are not there to hang under).

Pure: no vLLM, no OpenTelemetry SDK.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from vllm_journey_otel.config import head_sampling, tail_rule
from vllm_journey_otel.journey import RootIds, api_server_traceparent
from vllm_journey_otel.rng import RNG

# TraceIdRatioBased (opentelemetry-sdk 1.x) samples when trace_id & LIMIT < bound.
TRACE_ID_LIMIT = (1 << 64) - 1
# A W3C traceparent as the SDK's TraceContextTextMapPropagator reads it
# (opentelemetry-api 1.45): the exporter reads the client's context with that
# propagator, so a header is a parent here exactly when it is one there.
_TRACEPARENT = re.compile(
    "^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$"
)
_TRACEPARENT_MAX = 512


def client_trace(traceparent: str | None) -> tuple[int, int] | None:
    """(trace id, flags) of a valid ``traceparent``, or None where the
    propagator would find no parent."""
    if not traceparent or len(traceparent) > _TRACEPARENT_MAX:
        return None
    m = _TRACEPARENT.search(traceparent)
    if m is None:
        return None
    version, trace_hex, span_hex, flags = m.group(1, 2, 3, 4)
    if trace_hex == "0" * 32 or span_hex == "0" * 16 or version == "ff":
        return None
    if version == "00" and m.group(5):
        return None
    return int(trace_hex, 16), int(flags, 16)


@dataclass(frozen=True)
class HeadSampler:
    """A few comparisons: ``decide()`` on the engine thread at admission,
    ``decide_client()`` also on the API server's event loop (its middleware)."""

    parent_based: bool = True
    ratio: float = 1.0

    @property
    def bound(self) -> int:
        """TraceIdRatioBased's bound: trace ids whose low 64 bits are below it are sampled."""
        return round(self.ratio * (TRACE_ID_LIMIT + 1))

    def decide(self, trace_headers: Mapping[str, str] | None) -> tuple[bool, RootIds | None]:
        """Whether the journey is sampled, and, when a ratio decided it for a
        journey that starts its own trace, the root's ids (its trace id is the
        one decided on: the root must use it)."""
        if trace_headers and self.parent_based:
            ours = api_server_traceparent(trace_headers)
            if ours is not None:  # its flags: 01 (sampled) or 00
                return ours[-1] == "1", None
        client = client_trace(trace_headers.get("traceparent")) if trace_headers else None
        return self.decide_client(client)

    def decide_client(self, client: tuple[int, int] | None) -> tuple[bool, RootIds | None]:
        """:meth:`decide` for a parent parsed already: ``client_trace``'s (trace
        id, flags), or None where there is none (the API server's middleware
        parses its client's ``traceparent`` once)."""
        if client is not None and self.parent_based:
            return (client[1] & 1) == 1, None
        ratio = self.ratio
        if ratio >= 1.0 or ratio <= 0.0:
            return ratio >= 1.0, None
        if client is not None:
            return (client[0] & TRACE_ID_LIMIT) < self.bound, None
        bits = RNG.getrandbits  # not vLLM's seeded global random (rng.py)
        ids = RootIds(bits(64), bits(64) or 1, bits(64) or 1)
        return ids.trace_lo < self.bound, ids

    def sampled(self, trace_headers: Mapping[str, str] | None) -> bool:
        return self.decide(trace_headers)[0]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> HeadSampler:
        parent_based, ratio = head_sampling(env)
        return cls(parent_based=parent_based, ratio=ratio)


@dataclass(frozen=True)
class TailRule:
    """Which head-dropped journeys are kept anyway (decided at the end, engine thread)."""

    preempted: bool = True
    error: bool = True
    aborted: bool = True
    slow_ns: int | None = None
    # In flight past VLLM_JOURNEY_OTEL_IN_FLIGHT_S: snapshotted like a head-sampled
    # request (in_flight.py) and kept at its end, the stuck request being the one
    # an operator most wants to see.
    in_flight: bool = True

    @property
    def active(self) -> bool:
        return (
            self.preempted or self.error or self.aborted or self.in_flight
            or self.slow_ns is not None
        )  # fmt: skip

    def keeps(
        self,
        error: bool,
        aborted: bool,
        num_preemptions: int,
        duration_ns: int,
        seen_in_flight: bool = False,
    ) -> bool:
        """Whether a journey head sampling dropped is exported anyway."""
        return (
            (self.preempted and num_preemptions > 0)
            or (self.error and error)
            or (self.aborted and aborted)
            or (self.in_flight and seen_in_flight)
            or (self.slow_ns is not None and duration_ns >= self.slow_ns)
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TailRule:
        reasons, slow_ns = tail_rule(env)
        return cls(
            preempted="preempted" in reasons,
            error="error" in reasons,
            aborted="aborted" in reasons,
            slow_ns=slow_ns,
            in_flight="in_flight" in reasons,
        )
