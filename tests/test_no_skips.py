"""tests/no_skips.py: with VJO_NO_SKIPS=1 a skipped test fails the run (a real
pytest run of a file with a skip, a pass and an expected failure)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CASES = """
import pytest

def test_runs():
    pass

def test_skipped():
    pytest.skip("the tool is not installed")

@pytest.mark.xfail(reason="known")
def test_expected_failure():
    assert False
"""


def _run(tmp_path: Path, no_skips: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {**os.environ, "VJO_NO_SKIPS": no_skips, "PYTHONPATH": str(Path(__file__).parent)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no_skips",
         "--rootdir", str(tmp_path), str(tmp_path / "test_cases.py")],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=False,
    )  # fmt: skip


def test_a_skip_fails_the_run_where_every_check_must_run(tmp_path: Path) -> None:
    run = _run(tmp_path, "1")
    assert run.returncode == 1, run.stdout
    assert "1 failed, 1 passed, 1 xfailed" in run.stdout, run.stdout
    assert "the tool is not installed" in run.stdout


def test_elsewhere_a_skip_is_a_skip(tmp_path: Path) -> None:
    run = _run(tmp_path, "0")
    assert run.returncode == 0, run.stdout
    assert "1 passed, 1 skipped, 1 xfailed" in run.stdout, run.stdout
