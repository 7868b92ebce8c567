"""The vLLM side of ``vllm-journey doctor``: what only an import of vLLM can tell.

Process: a short-lived child of the doctor, started as
``python -m vllm_journey_otel.engine.self_check`` with the doctor's interpreter
and environment (the tools never import the engine side, and a vLLM whose import
crashes takes this process down, not the doctor). Main thread only. No clocks.

Two checks, printed as one JSON object on stdout (``{"checks": [...]}``, each
check ``{"name", "verdict", "summary", "fix"}``, verdict ``ok``/``warn``/``FAIL``):

* ``entry-point``: vLLM's own plugin loader
  (``vllm.plugins.load_plugins_by_group("vllm.general_plugins")``, the call of
  ``load_general_plugins`` in every vLLM process) lists ``journey_otel`` and
  resolves it to :func:`vllm_journey_otel.plugin.register`. The loader imports the
  plugins' modules but does not call them: ``register`` is not run here. A
  ``VLLM_PLUGINS`` that leaves ``journey_otel`` out is named.
* ``vllm``: the vLLM version is supported and the classes and methods of
  ``compat.TARGETS`` are there with the parameters the hooks need
  (``compat.check`` and ``compat.patchable`` on the real classes, imported by
  ``state.py`` as ``hooks.install`` imports them).

Everything vLLM prints while it is imported goes to stderr: stdout is the JSON.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from importlib.metadata import entry_points
from typing import Any

from packaging.version import InvalidVersion, Version

from vllm_journey_otel.engine.compat import (
    SUPPORTED_VLLM,
    TARGETS,
    check,
    patchable,
)
from vllm_journey_otel.engine.state import (
    VllmMoved,
    _vllm,
    target_classes,
)

GROUP = "vllm.general_plugins"
PLUGIN_NAME = "journey_otel"
PLUGIN_VALUE = "vllm_journey_otel.plugin:register"
OK, WARN, FAIL = "ok", "warn", "FAIL"

Result = dict[str, str]


def _result(name: str, verdict: str, summary: str, fix: str = "") -> Result:
    return {"name": name, "verdict": verdict, "summary": summary, "fix": fix}


def _last_line(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[-1]


class _Records(logging.Handler):
    """What vLLM's plugin loader logs (a plugin that fails to import)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            text = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                text += f": {_last_line(record.exc_info[1])}"
            self.messages.append(text)


def excluded_by_vllm_plugins() -> Result | None:
    """VLLM_PLUGINS, split on commas as vLLM's envs.py splits it, without journey_otel."""
    raw = os.environ.get("VLLM_PLUGINS")
    if raw is None or PLUGIN_NAME in raw.split(","):
        return None
    names = [n.strip() for n in raw.split(",") if n.strip()]
    why = " (vLLM compares the names exactly: no spaces)" if PLUGIN_NAME in names else ""
    fixed = ",".join(dict.fromkeys([*names, PLUGIN_NAME]))
    return _result(
        "entry-point",
        FAIL,
        f"VLLM_PLUGINS={raw!r} leaves {PLUGIN_NAME} out{why}: vLLM loads only the plugins it names",
        f"VLLM_PLUGINS={fixed}, or unset VLLM_PLUGINS",
    )


def entry_point_check() -> Result:
    """Whether vLLM's plugin loader would call our register() in every process."""
    ours = [ep for ep in entry_points(group=GROUP) if ep.name == PLUGIN_NAME]
    if not ours:
        return _result(
            "entry-point",
            FAIL,
            f"no {PLUGIN_NAME} entry point in {GROUP} for {sys.executable}: the package is "
            "importable but not installed in this environment",
            "pip install vllm-journey-otel into the environment vllm serve runs in",
        )
    excluded = excluded_by_vllm_plugins()
    if excluded is not None:
        return excluded
    dist = getattr(ours[0], "dist", None)
    where = f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"
    try:
        from vllm.plugins import load_plugins_by_group
    except Exception as exc:
        return _result(
            "entry-point", FAIL, f"vLLM's plugin loader cannot be imported: {_last_line(exc)}"
        )
    records = _Records()
    loader_log = logging.getLogger("vllm.plugins")
    loader_log.addHandler(records)
    try:
        loaded = load_plugins_by_group(GROUP)
    finally:
        loader_log.removeHandler(records)
    from vllm_journey_otel import plugin

    func = loaded.get(PLUGIN_NAME)
    if func is None:
        why = "; ".join(records.messages) or "it was not loaded"
        return _result(
            "entry-point",
            FAIL,
            f"vLLM's plugin loader does not load {PLUGIN_NAME} ({where}): {why}",
            "reinstall vllm-journey-otel in this environment",
        )
    if func is not plugin.register:
        return _result(
            "entry-point",
            FAIL,
            f"{PLUGIN_NAME} resolves to {func!r}, not {PLUGIN_VALUE} ({where}): another "
            "install shadows this one",
            "pip uninstall every vllm-journey-otel, then install one",
        )
    allowed = os.environ.get("VLLM_PLUGINS")
    scope = (
        "VLLM_PLUGINS unset: every plugin loads" if allowed is None else f"VLLM_PLUGINS={allowed}"
    )
    return _result(
        "entry-point",
        OK,
        f"vLLM's plugin loader lists {PLUGIN_NAME} -> {PLUGIN_VALUE} ({where}, "
        f"{os.path.dirname(os.path.dirname(plugin.__file__))}); {scope}",
    )


def vllm_check() -> Result:
    """compat.check and compat.patchable on the classes hooks.install would wrap."""
    try:
        version, scheduler_cls, _, _ = _vllm()
    except VllmMoved as exc:
        return _result(
            "vllm",
            FAIL,
            f"this vLLM does not have what the plugin hooks: {exc}",
            f"install a supported vLLM (vllm{SUPPORTED_VLLM})",
        )
    except Exception as exc:
        return _result(
            "vllm",
            FAIL,
            f"vLLM cannot be imported in {sys.executable}: {_last_line(exc)}",
            "run the doctor in the environment vllm serve runs in (or --skip-vllm "
            "to check only the OTLP side)",
        )
    support = check(version, scheduler_cls)
    if not support.ok:
        return _result("vllm", FAIL, support.reason, f"install vllm{SUPPORTED_VLLM}")
    classes = target_classes(scheduler_cls)
    _, left_out = patchable(classes)
    required = sum(t.required for t in TARGETS)
    summary = f"{support.reason}; the {required} required Scheduler methods"
    if not left_out:
        summary += f" and all {len(TARGETS) - required} optional hooks have the parameters we need"
    else:
        lost = "; ".join(f"{t.name}: {t.without}" for t in left_out if t.without)
        names = ", ".join(t.name for t in left_out)
        summary += f" are there; left out ({names}): {lost or 'nothing is lost'}"
    if left_out or not _tested(version):
        return _result("vllm", WARN, summary, f"tested: vllm{SUPPORTED_VLLM}")
    return _result("vllm", OK, summary)


def _tested(version: str) -> bool:
    try:
        return SUPPORTED_VLLM.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def run_checks() -> dict[str, Any]:
    checks = [entry_point_check(), vllm_check()]
    return {"python": sys.executable, "checks": checks}


def main() -> int:
    # vLLM's logging and prints go to stdout: keep stdout for the JSON alone.
    out = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    try:
        report = run_checks()
    except Exception as exc:  # a check of ours broke: still answer in JSON
        broke = _result("vllm", FAIL, f"the self-check failed: {_last_line(exc)}")
        report = {"python": sys.executable, "checks": [broke]}
    sys.stdout.flush()
    out.write(json.dumps(report) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
