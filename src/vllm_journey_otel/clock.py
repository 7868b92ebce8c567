"""Engine monotonic time to epoch time.

vLLM stamps engine events with ``time.monotonic()`` (CLOCK_MONOTONIC); OTLP wants
epoch nanoseconds. We read the wall clock on both sides of one monotonic read
(wall-mono-wall), keep the midpoint as the offset and the half-width as the
uncertainty, take the narrowest of a few tries, and re-anchor periodically so an
NTP slew or step is followed.

Threading: a :class:`ClockAnchor` is used where spans are built (the exporter
process, or the drain thread in thread mode), never on the engine thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple


class Anchor(NamedTuple):
    """``unix_ns = mono_ns + offset_ns``, good to +/- ``uncertainty_ns``."""

    offset_ns: int
    uncertainty_ns: int
    # When it was taken, engine monotonic time.
    taken_mono_ns: int


def measure_anchor(
    tries: int = 5,
    wall_ns: Callable[[], int] = time.time_ns,
    mono_ns: Callable[[], int] = time.monotonic_ns,
) -> Anchor:
    """Take ``tries`` wall-mono-wall readings and keep the narrowest."""
    best: Anchor | None = None
    for _ in range(max(1, tries)):
        w1 = wall_ns()
        m = mono_ns()
        w2 = wall_ns()
        # A wall-clock step backwards between the two reads gives w2 < w1: the
        # reading says nothing useful, so it gets the widest possible width.
        half = (w2 - w1) // 2 if w2 >= w1 else abs(w2 - w1)
        cand = Anchor((w1 + w2) // 2 - m, half, m)
        if best is None or cand.uncertainty_ns < best.uncertainty_ns:
            best = cand
    assert best is not None
    return best


class ClockAnchor:
    """Converts engine monotonic ns to epoch ns, re-anchoring every ``period_s``."""

    def __init__(
        self,
        period_s: float = 30.0,
        wall_ns: Callable[[], int] = time.time_ns,
        mono_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._period_ns = int(period_s * 1e9)
        self._wall_ns = wall_ns
        self._mono_ns = mono_ns
        self._anchor = measure_anchor(wall_ns=wall_ns, mono_ns=mono_ns)

    @property
    def anchor(self) -> Anchor:
        """The anchor in use, refreshed first if older than the period."""
        if self._mono_ns() - self._anchor.taken_mono_ns >= self._period_ns:
            self._anchor = measure_anchor(wall_ns=self._wall_ns, mono_ns=self._mono_ns)
        return self._anchor

    def to_unix_ns(self, mono_ns: int) -> int:
        """Epoch ns of an engine monotonic ns value."""
        return mono_ns + self.anchor.offset_ns
