"""vLLM request journeys as OpenTelemetry traces.

``VLLM_JOURNEY_OTEL=1 vllm serve MODEL`` loads :func:`vllm_journey_otel.plugin.register`
through the ``vllm.general_plugins`` entry point. See docs/spans.md for the schema.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
