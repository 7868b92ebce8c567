"""Monotonic-to-epoch conversion."""

from __future__ import annotations

import time

from vllm_journey_otel.clock import ClockAnchor, measure_anchor


def test_anchor_keeps_the_narrowest_reading() -> None:
    walls = iter([100, 190, 1000, 1010, 5000, 5100])
    monos = iter([50, 960, 4990])
    a = measure_anchor(tries=3, wall_ns=lambda: next(walls), mono_ns=lambda: next(monos))
    # Second reading: wall 1000..1010 around mono 960 -> midpoint 1005, half-width 5.
    assert a.uncertainty_ns == 5
    assert a.offset_ns == 1005 - 960


def test_wall_step_backwards_is_not_trusted() -> None:
    walls = iter([1000, 400])
    a = measure_anchor(tries=1, wall_ns=lambda: next(walls), mono_ns=lambda: 10)
    assert a.uncertainty_ns == 600


def test_real_clock_conversion_matches_time_time() -> None:
    clock = ClockAnchor()
    mono = time.monotonic_ns()
    wall = time.time_ns()
    assert abs(clock.to_unix_ns(mono) - wall) < 5_000_000  # within 5 ms
    assert clock.anchor.uncertainty_ns < 5_000_000


def test_reanchors_after_the_period_and_each_stamp_keeps_its_own_time() -> None:
    now = {"mono": 0, "wall": 1_000_000}

    def mono() -> int:
        return now["mono"]

    def wall() -> int:
        return now["wall"] + now["mono"]

    clock = ClockAnchor(period_s=1.0, wall_ns=wall, mono_ns=mono)
    assert clock.to_unix_ns(0) == 1_000_000
    now["wall"] = 2_000_000  # NTP stepped the wall clock forward by 1 ms
    now["mono"] = 500_000_000
    assert clock.anchor.offset_ns == 1_000_000  # still the old anchor
    now["mono"] = 1_000_000_000
    assert clock.to_unix_ns(1_000_000_000) == 1_002_000_000  # re-anchored
    # A stamp from before is converted with the offset of its own time, not the
    # newest: at the first anchor the old offset, between them interpolated.
    assert clock.to_unix_ns(0) == 1_000_000
    assert clock.to_unix_ns(500_000_000) == 501_500_000


def test_a_slewing_wall_clock_is_followed_stamp_by_stamp() -> None:
    """The wall clock runs 5,000 ppm fast against the monotonic one (as a virtual
    machine's did here): a stamp converted 2.5 s after it was taken gets its own
    wall time, not one 12.5 ms later as the newest anchor would give."""
    now = {"mono": 10**9}

    def wall() -> int:
        return 1_700_000_000 * 10**9 + now["mono"] * 1005 // 1000

    clock = ClockAnchor(period_s=1.0, wall_ns=wall, mono_ns=lambda: now["mono"])
    for _ in range(3):  # busy: an anchor each second
        now["mono"] += 10**9
        clock.to_unix_ns(now["mono"])
    stamp = now["mono"] - 2_500_000_000  # taken 2.5 s before the last anchor
    truth = 1_700_000_000 * 10**9 + stamp * 1005 // 1000
    assert abs(clock.to_unix_ns(stamp) - truth) <= 1
    assert abs(stamp + clock.anchor.offset_ns - truth) > 10_000_000  # what one anchor gave


def test_the_anchor_history_is_bounded() -> None:
    from vllm_journey_otel.clock import HISTORY

    now = {"mono": 0}

    def wall() -> int:  # 1,000 ppm fast: each anchor's offset is its own
        return now["mono"] * 1001 // 1000

    clock = ClockAnchor(period_s=1.0, wall_ns=wall, mono_ns=lambda: now["mono"])
    for _ in range(HISTORY + 50):
        now["mono"] += 10**9
        clock.to_unix_ns(now["mono"])
    assert len(clock._anchors) == len(clock._taken) == HISTORY
    # Older than the history: the oldest anchor kept (taken at 51 s), not the first.
    oldest = clock._anchors[0]
    assert oldest.taken_mono_ns == 51 * 10**9
    assert clock.to_unix_ns(0) == oldest.offset_ns == 51 * 10**6
