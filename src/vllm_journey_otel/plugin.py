"""The ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in every process it starts (API server, engine core,
workers, model-inspection subprocesses) and does not guard the call, so it must
be cheap, idempotent and never raise. With ``VLLM_JOURNEY_OTEL`` unset or false it
returns before importing anything heavy.
"""

from __future__ import annotations

import os

from vllm_journey_otel.switch import ENABLE, FALSE_WORDS


def register() -> None:
    """Install the scheduler hooks when ``VLLM_JOURNEY_OTEL`` is true. Never raises."""
    try:
        if os.environ.get(ENABLE, "").strip().lower() in FALSE_WORDS:
            return
        from vllm_journey_otel import config

        cfg = config.from_env()
        if not cfg.enabled:
            return
        from vllm_journey_otel.engine import hooks

        hooks.install(cfg)
    except Exception:  # pragma: no cover - defensive: vLLM must never see our errors
        import logging

        logging.getLogger("vllm.journey_otel").warning(
            "journey-otel: plugin registration failed; journey tracing stays off",
            exc_info=True,
        )
