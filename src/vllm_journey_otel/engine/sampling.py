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

from collections.abc import Mapping
from dataclasses import dataclass

from vllm_journey_otel.config import TAIL, TAIL_SLOW_MS, logger
from vllm_journey_otel.journey import RootIds
from vllm_journey_otel.rng import RNG

SAMPLER = "OTEL_TRACES_SAMPLER"
SAMPLER_ARG = "OTEL_TRACES_SAMPLER_ARG"

TAIL_REASONS = ("preempted", "error", "aborted", "slow")
# TraceIdRatioBased (opentelemetry-sdk 1.x) samples when trace_id & LIMIT < bound.
TRACE_ID_LIMIT = (1 << 64) - 1
_SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)


@dataclass(frozen=True)
class HeadSampler:
    """``decide()`` runs on the engine thread at admission: a few comparisons."""

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
        client_trace = 0
        if trace_headers:
            tp = trace_headers.get("traceparent")
            # "00-<32 hex trace id>-<16 hex>-<2 hex flags>"
            if tp is not None and len(tp) == 55 and tp[2] == "-" and tp[52] == "-":
                try:
                    client_trace, flags = int(tp[3:35], 16), int(tp[53:55], 16)
                except ValueError:
                    client_trace = 0  # malformed: the journey is its own root
                if client_trace and self.parent_based:
                    return (flags & 1) == 1, None
        ratio = self.ratio
        if ratio >= 1.0 or ratio <= 0.0:
            return ratio >= 1.0, None
        if client_trace:
            return (client_trace & TRACE_ID_LIMIT) < self.bound, None
        bits = RNG.getrandbits  # not vLLM's seeded global random (rng.py)
        ids = RootIds(bits(64), bits(64) or 1, bits(64) or 1)
        return ids.trace_lo < self.bound, ids

    def sampled(self, trace_headers: Mapping[str, str] | None) -> bool:
        return self.decide(trace_headers)[0]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> HeadSampler:
        name = env.get(SAMPLER, "parentbased_always_on").strip().lower() or "parentbased_always_on"
        if name not in _SAMPLERS:
            logger.warning(
                "%s=%r is not one of %s; using parentbased_always_on.",
                SAMPLER,
                name,
                ", ".join(_SAMPLERS),
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
        return cls(parent_based=name.startswith("parentbased_"), ratio=ratio)


@dataclass(frozen=True)
class TailRule:
    """Which head-dropped journeys are kept anyway (decided at the end, engine thread)."""

    preempted: bool = True
    error: bool = True
    aborted: bool = True
    slow_ns: int | None = None

    @property
    def active(self) -> bool:
        return self.preempted or self.error or self.aborted or self.slow_ns is not None

    def keeps(self, error: bool, aborted: bool, num_preemptions: int, duration_ns: int) -> bool:
        """Whether a journey head sampling dropped is exported anyway."""
        return (
            (self.preempted and num_preemptions > 0)
            or (self.error and error)
            or (self.aborted and aborted)
            or (self.slow_ns is not None and duration_ns >= self.slow_ns)
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TailRule:
        raw = env.get(TAIL)
        reasons = set(TAIL_REASONS[:3]) if raw is None else set()
        if raw is not None and raw.strip().lower() not in ("", "none"):
            for part in raw.split(","):
                p = part.strip().lower()
                if p in TAIL_REASONS:
                    reasons.add(p)
                elif p:
                    logger.warning(
                        "%s: %r is not one of %s; ignored.", TAIL, p, "/".join(TAIL_REASONS)
                    )
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
                logger.warning(
                    "%s=%r is not a positive number of ms; ignored.", TAIL_SLOW_MS, slow_raw
                )
        if "slow" in reasons and slow_ns is None:
            logger.warning("%s lists 'slow' but %s is not set; ignored.", TAIL, TAIL_SLOW_MS)
        return cls(
            preempted="preempted" in reasons,
            error="error" in reasons,
            aborted="aborted" in reasons,
            slow_ns=slow_ns,
        )
