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


def test_reanchors_after_the_period() -> None:
    now = {"mono": 0, "wall": 1_000_000}

    def mono() -> int:
        return now["mono"]

    def wall() -> int:
        return now["wall"] + now["mono"]

    clock = ClockAnchor(period_s=1.0, wall_ns=wall, mono_ns=mono)
    assert clock.to_unix_ns(0) == 1_000_000
    now["wall"] = 2_000_000  # NTP stepped the wall clock forward by 1 ms
    now["mono"] = 500_000_000
    assert clock.to_unix_ns(0) == 1_000_000  # still the old anchor
    now["mono"] = 1_000_000_000
    assert clock.to_unix_ns(0) == 2_000_000  # re-anchored
