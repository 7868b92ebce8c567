#!/usr/bin/env bash
# Unpack the Python sources of vLLM 0.33.0 (the GPU release) into .cache/vllm-0.33.0.
# With PYTHONPATH=.cache/vllm-0.33.0 and VLLM_TARGET_DEVICE=cpu its scheduler runs
# on the CPU (the compiled extensions are never needed by the scheduler), so the
# tests drive 0.33's real Scheduler too. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.cache/vllm-0.33.0
if [ -f "$DEST/vllm/v1/core/sched/scheduler.py" ]; then
  exit 0
fi
mkdir -p .cache/wheels
if ! ls .cache/wheels/vllm-0.33.0-*.whl >/dev/null 2>&1; then
  echo "[fetch] downloading the vllm 0.33.0 wheel (about 340 MB)"
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: vllm==0.33.0 -d .cache/wheels
fi
rm -rf "$DEST.tmp" && mkdir -p "$DEST.tmp"
.venv/bin/python - "$DEST.tmp" .cache/wheels/vllm-0.33.0-*.whl <<'PY'
import sys, zipfile
dest, wheel = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist()
             if n.startswith("vllm/") and not n.endswith(".so") and "/third_party/" not in n]
    z.extractall(dest, names)
print(f"[fetch] unpacked {len(names)} files of {wheel}")
PY
mv "$DEST.tmp" "$DEST"
rm -f .cache/wheels/vllm-0.33.0-*.whl
