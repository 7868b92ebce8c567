"""The plugin's logger: a child of vLLM's, so our lines appear with vLLM's format
and level (in the exporter process, which has no vLLM, with its own format).

Any process, any thread. No timestamps of ours.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.journey_otel")
