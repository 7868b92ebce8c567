#!/usr/bin/env bash
# Headless Chromium from Debian, for the timeline tests and `vllm-journey timeline --png`.
# Idempotent; needs root (as on these machines and in CI).
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
echo "[setup] installing Debian's chromium (headless rendering of the timeline)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
command -v chromium
