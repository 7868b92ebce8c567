"""The Prometheus config and the dashboard's PromQL against a real Prometheus."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from deploy_kit import (
    PROMETHEUS_FILE,
)


# ---------------------------------------------------------------------------
# Validators that exist as real tools
# ---------------------------------------------------------------------------
def test_promtool_check_config() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    run = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_FILE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
