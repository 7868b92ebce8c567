#!/usr/bin/env bash
# Set up .venv (vLLM on the CPU) and run the demo: journeys from vLLM's real
# Scheduler under KV-cache pressure, drawn in the terminal. No GPU, no collector.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VLLM_JOURNEY_OTEL=1 .venv/bin/python examples/scheduler_demo.py
