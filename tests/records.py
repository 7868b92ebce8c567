"""Finished journeys built through the real state machine, for sink and pipeline tests."""

from __future__ import annotations

import time

from vllm_journey_otel.engine.request_journey import RequestJourney
from vllm_journey_otel.journey import STATUS_LENGTH, FinishedJourney

MS = 1_000_000


def journeys(n: int, start: int = 0) -> list[FinishedJourney]:
    """``n`` plain journeys ``req-<start>`` ..., 1 ms per phase, engine monotonic clock."""
    out = []
    base = time.monotonic_ns()
    for i in range(start, start + n):
        t = base + i * MS
        j = RequestJourney(f"req-{i}", time.time(), t, i, 100, 8)
        j.scheduled(t + MS, i, 0, 100, 100, 0)
        j.tokens(t + 2 * MS, i, 1)
        out.append(j.finish(t + 3 * MS, i, STATUS_LENGTH, "length", 8, t + 3 * MS))
    return out
