"""Engine monotonic time to epoch time.

vLLM stamps engine events with ``time.monotonic()`` (CLOCK_MONOTONIC); OTLP wants
epoch nanoseconds. We read the wall clock on both sides of one monotonic read
(wall-mono-wall), keep the midpoint as the offset and the half-width as the
uncertainty, and take the narrowest of a few tries: an anchor.

The wall clock moves against the monotonic one while NTP slews it (500 ppm is
ntpd's limit, chrony slews faster; a virtual machine's clock was seen here
moving 5,000 ppm, 25 ms every 5 s). A stamp is therefore converted with the
offset the wall clock had *when the stamp was taken*: anchors are taken at most
every ``period_s`` (0.1 s) as conversions ask for them and kept (the last
``HISTORY``), and a stamp between two anchors gets the offset interpolated
between them (exact for a steady slew; a step between two anchors is spread
over the time between them), a stamp after the newest the newest's (off by the
slew over at most ``period_s``: 0.5 ms at 5,000 ppm).

Threading: a :class:`ClockAnchor` is used by one thread at a time, where spans
are built (the exporter process's main thread, or the drain thread under its
lock in thread mode), never on the engine thread.
"""

from __future__ import annotations

import time
from bisect import bisect_right
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


# Anchors kept: with ten a second while busy, the last ~7 minutes (a journey
# older than that gets the oldest, off by the slew since it).
HISTORY = 4096


class ClockAnchor:
    """Converts engine monotonic ns to epoch ns with the offset of the stamp's time."""

    def __init__(
        self,
        period_s: float = 0.1,
        wall_ns: Callable[[], int] = time.time_ns,
        mono_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._period_ns = int(period_s * 1e9)
        self._wall_ns = wall_ns
        self._mono_ns = mono_ns
        first = measure_anchor(wall_ns=wall_ns, mono_ns=mono_ns)
        self._anchors = [first]
        self._taken = [first.taken_mono_ns]  # ascending: the bisect keys

    @property
    def anchor(self) -> Anchor:
        """The newest anchor, taken first if the newest is older than the period."""
        newest = self._anchors[-1]
        if self._mono_ns() - newest.taken_mono_ns >= self._period_ns:
            newest = measure_anchor(wall_ns=self._wall_ns, mono_ns=self._mono_ns)
            if newest.taken_mono_ns > self._taken[-1]:
                self._anchors.append(newest)
                self._taken.append(newest.taken_mono_ns)
                if len(self._taken) > HISTORY:
                    del self._anchors[0], self._taken[0]
        return newest

    def at(self, mono_ns: int) -> Anchor:
        """The anchor for a stamp taken at ``mono_ns``: interpolated between the
        anchors around it (its uncertainty the wider of theirs), else the
        nearest. Refreshes the newest first, so a stamp from just before the
        call lies between two anchors."""
        newest = self.anchor
        i = bisect_right(self._taken, mono_ns)
        if i >= len(self._taken):
            return newest
        if i == 0:
            return self._anchors[0]
        a, b = self._anchors[i - 1], self._anchors[i]
        span = b.taken_mono_ns - a.taken_mono_ns
        offset = a.offset_ns + (b.offset_ns - a.offset_ns) * (mono_ns - a.taken_mono_ns) // span
        return Anchor(offset, max(a.uncertainty_ns, b.uncertainty_ns), mono_ns)

    def to_unix_ns(self, mono_ns: int) -> int:
        """Epoch ns of an engine monotonic ns value."""
        return mono_ns + self.at(mono_ns).offset_ns
