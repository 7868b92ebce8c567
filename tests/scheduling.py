"""Shared by the scheduler-level test modules: the sync/async parametrization and
the check that a finished engine keeps no journey state."""

from __future__ import annotations

import pytest

SCHEDULERS = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def assert_no_state_left(engine) -> None:  # type: ignore[no-untyped-def]
    from vllm_journey_otel.engine.state import JOURNEY_ATTR, TRACKER_ATTR

    tracker = engine.scheduler.__dict__[TRACKER_ATTR]
    assert tracker.awaiting == {}
    assert engine.scheduler.requests == {}
    for req in engine.requests.values():
        assert getattr(req, JOURNEY_ATTR, None) is None
