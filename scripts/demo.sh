#!/usr/bin/env bash
# Set up .venv (vLLM on the CPU) and run the demo: a real `vllm serve` with the
# plugin, a burst of traffic, and a summary of every journey. No GPU, no collector.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python examples/serve_demo.py "$@"
