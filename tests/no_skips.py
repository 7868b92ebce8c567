"""A pytest plugin: with VJO_NO_SKIPS=1 (scripts/test.sh sets it) a skipped test
fails, naming why it would have been skipped. A check that does not run is not
a pass: where the suite runs for the record, every test runs or fails."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

NO_SKIPS = "VJO_NO_SKIPS"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get(NO_SKIPS) == "1" and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped, and {NO_SKIPS}=1 says every test must run: {reason}"
