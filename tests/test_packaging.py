"""The package as a user installs it: a wheel built from this checkout, installed
into a fresh virtual environment next to vLLM.

The fresh venv sees the test venv's site-packages (vLLM 0.32 and the plugin's
dependencies) through a ``.pth`` line, which adds the directory without running
its ``.pth`` files: the editable install of this checkout stays out of it, so
what imports is the wheel. Then vLLM's own plugin loader finds the plugin, the
OpenTelemetry SDK's exporter entry point loads, and the ``vllm-journey`` script
runs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import requires_vllm

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("wheel")
    # From a copy of what the wheel is made of: the build writes build/ and
    # *.egg-info next to its sources, and a stale build/ would ship in the wheel.
    src = tmp_path_factory.mktemp("checkout")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "src", src / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__")
    )
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (path,) = out.glob("vllm_journey_otel-*.whl")
    return path, build.stdout + build.stderr


def test_the_wheel_builds_without_warnings_and_has_release_metadata(
    wheel: tuple[Path, str],
) -> None:
    path, log = wheel
    # setuptools warns (BuildBackendWarning, SetuptoolsDeprecationWarning) about a
    # TOML-table license, license classifiers and other outdated metadata.
    warned = re.compile(r"DeprecationWarning|BuildBackendWarning|license.*deprecated", re.I)
    warnings = [line for line in log.splitlines() if warned.search(line)]
    assert warnings == [], "\n".join(warnings)
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "License-Expression: Apache-2.0" in meta
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "Classifier: Typing :: Typed" in meta and "Project-URL: Issues" in meta
    assert "vllm_journey_otel/py.typed" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "deploy/")) for n in names)
    assert "journey_otel = vllm_journey_otel.plugin:register" in entry_points
    assert "otlp_json_file = vllm_journey_otel.export.file_exporter" in entry_points


FRESH_CHECK = """
import importlib.metadata as m, json, sys
import vllm.plugins
from opentelemetry.util._importlib_metadata import entry_points
import vllm_journey_otel
dist = m.distribution("vllm-journey-otel")
plugins = vllm.plugins.load_plugins_by_group("vllm.general_plugins")
(exporter,) = entry_points(group="opentelemetry_traces_exporter", name="otlp_json_file")
print(json.dumps({
    "module": vllm_journey_otel.__file__,
    "dist": str(dist.locate_file("")),
    "plugins": sorted(plugins),
    "exporter": exporter.load().__name__,
}))
"""


@requires_vllm
def test_the_wheel_installs_next_to_vllm_and_both_entry_points_load(
    wheel: tuple[Path, str], tmp_path: Path
) -> None:
    import json

    path, _ = wheel
    fresh = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True)
    python = fresh / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    (site / "vllm-host.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         str(path)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr
    run = subprocess.run(
        [python, "-c", FRESH_CHECK], capture_output=True, text=True, check=False, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["module"].startswith(str(site)), "the wheel's copy is the one imported"
    assert got["dist"].startswith(str(site))
    assert "journey_otel" in got["plugins"], "vLLM's plugin loader finds the plugin"
    assert got["exporter"] == "OtlpJsonFileExporter"
    # Every dependency the wheel declares is satisfied where it was installed.
    deps = subprocess.run(
        [python, "-c", "import importlib.metadata as m; from packaging.requirements import "
         "Requirement as R; bad=[r for r in m.requires('vllm-journey-otel') if not "
         "R(r).marker and not R(r).specifier.contains(m.version(R(r).name), prereleases=True)]; "
         "print(bad); raise SystemExit(1 if bad else 0)"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert deps.returncode == 0, deps.stdout + deps.stderr
    script = subprocess.run(
        [fresh / "bin" / "vllm-journey", "--help"], capture_output=True, text=True, check=False
    )
    assert script.returncode == 0 and "summary" in script.stdout, script.stderr
