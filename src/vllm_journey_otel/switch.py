"""The on/off switch, read before anything else of the plugin is imported.

vLLM calls the plugin's entry point in every process it starts; with the switch
off, :func:`vllm_journey_otel.plugin.register` reads one environment variable,
compares it with these words, and returns (this module imports nothing). Any
process, any thread; no timestamps.
"""

from __future__ import annotations

ENABLE = "VLLM_JOURNEY_OTEL"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("", "0", "false", "no", "off")
