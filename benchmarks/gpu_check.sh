#!/usr/bin/env bash
# The prepared GPU check (issue 26): proves the CUDA paths on a lent GPU machine and writes OUTDIR/report.{json,md}
# and OUTDIR/logs.txt. Without CUDA (or with --dry-run) only the steps that need no CUDA run; the rest is skipped.
#
#   benchmarks/gpu_check.sh OUTDIR [--dry-run] [--tests auto|on|off] [--budget 480] [more: gpu_check.py --help]
#
# Wheels: if ./.whl holds wheels (benchmarks/gpu_wheels.sh .whl, carried with the device tool's `carry: [".whl"]`),
# they are installed first into /tmp/vpo_site (no index, no deps) and put on PYTHONPATH; $GPU_WHEELS names another
# folder. Python: $PYTHON, else python3 (on the lent machine the one that holds CUDA torch).
set -uo pipefail
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: benchmarks/gpu_check.sh OUTDIR [--dry-run] [gpu_check.py options]" >&2
  exit 2
fi
OUTDIR=$1; shift
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-$REPO/.whl}
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)  # absolute: the script runs from the repository root
PYVER=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if compgen -G "$WHEELS/*.whl" >/dev/null && [ "$PYVER" != "3.12" ]; then
  echo "[gpu_check] not installing the wheels in $WHEELS: they are for the lent machine's Python 3.12, this is $PYVER"
elif compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE=${VPO_SITE:-/tmp/vpo_site}
  echo "[gpu_check] installing $(ls "$WHEELS"/*.whl | wc -l) carried wheels from $WHEELS into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl || { echo "[gpu_check] wheel install failed" >&2; exit 3; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# the tiny model is built once under here (no download: config + the tokenizer committed under assets/)
export VPO_CACHE_DIR=${VPO_CACHE_DIR:-/tmp/vpo_gpu_check/cache}
cd "$REPO" && exec "$PY" benchmarks/gpu_check.py "$OUTDIR" "$@"
