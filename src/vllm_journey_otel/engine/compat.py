"""Which vLLM versions we support, as data, and the check against a Scheduler class.

Pure: receives the version string and the class; does not import vLLM itself.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Final

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# Versions whose scheduler code was read and is tested (tests/ drive both).
SUPPORTED_VLLM: Final = SpecifierSet(">=0.32,<0.34")

# Scheduler methods we wrap -> parameter names they must accept (after self).
REQUIRED_METHODS: Final[dict[str, tuple[str, ...]]] = {
    "__init__": ("vllm_config",),
    "add_request": ("request",),
    "schedule": (),
    "update_from_output": ("scheduler_output", "model_runner_output"),
    "_free_request": ("request",),
    "shutdown": (),
}
# Wrapped when present; without it preemptions are read from the public
# SchedulerOutput.preempted_req_ids after each schedule() instead.
OPTIONAL_METHODS: Final[dict[str, tuple[str, ...]]] = {
    "_preempt_request": ("request",),
}


@dataclass(frozen=True)
class Support:
    """Outcome of :func:`check`. ``reason`` is a sentence for the log."""

    ok: bool
    reason: str
    hook_preempt: bool = True


def _signature_ok(cls: type, name: str, params: tuple[str, ...]) -> bool:
    fn = getattr(cls, name, None)
    if fn is None or not callable(fn):
        return False
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    names = list(sig.parameters)
    return all(p in names for p in params)


def check(version: str, scheduler_cls: type) -> Support:
    """Whether to enable on this vLLM: a supported version, or every hook in place."""
    missing = [
        name
        for name, params in REQUIRED_METHODS.items()
        if not _signature_ok(scheduler_cls, name, params)
    ]
    hook_preempt = all(_signature_ok(scheduler_cls, n, p) for n, p in OPTIONAL_METHODS.items())
    try:
        in_range = Version(version) in SUPPORTED_VLLM.__class__(
            str(SUPPORTED_VLLM), prereleases=True
        )
    except InvalidVersion:
        in_range = False
    if missing:
        return Support(
            False,
            f"vLLM {version}: Scheduler lacks {', '.join(missing)} with the expected "
            f"signature; journey tracing stays off (supported: vllm{SUPPORTED_VLLM})",
        )
    if in_range:
        return Support(True, f"vLLM {version} is supported", hook_preempt)
    return Support(
        True,
        f"vLLM {version} is outside the tested range vllm{SUPPORTED_VLLM}, but every "
        "hooked Scheduler method is present; enabling",
        hook_preempt,
    )
