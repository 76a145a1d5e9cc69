#!/usr/bin/env bash
# Refuse an NVIDIA driver too old for the CUDA lock (requirements/cuda.txt), before anything is installed or run.
# The lock's torch 2.13.0 ships the CUDA libraries named there (nvidia-cuda-runtime 13.0.x): CUDA 13 needs a Linux
# driver >= 580, CUDA 12 >= 525 (NVIDIA's minor-version compatibility). `make setup` and benchmarks/gpu_check.sh run it.
#
#   requirements/check_cuda_driver.sh [LOCK]     # exit 0: new enough, or no NVIDIA driver here; exit 1: too old
set -uo pipefail
LOCK=${1:-$(dirname "$0")/cuda.txt}
cuda=$(sed -n 's/^nvidia-cuda-runtime[-cu0-9]*==\([0-9]*\)\..*/\1/p' "$LOCK" | head -1)
case "$cuda" in
  13) need=580 ;;
  12) need=525 ;;
  *) echo "[driver] no CUDA runtime version found in $LOCK: not checked" >&2; exit 0 ;;
esac
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "[driver] no nvidia-smi: not a CUDA machine, nothing to check"
  exit 0
fi
version=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ')
if [ -z "$version" ]; then
  echo "error: nvidia-smi did not report a driver version (is the driver loaded?); the CUDA lock needs >= $need" >&2
  exit 1
fi
if [ "${version%%.*}" -lt "$need" ]; then
  echo "error: NVIDIA driver $version is too old for the CUDA lock ($LOCK: torch built with CUDA $cuda needs a" \
       "driver >= $need). Update the driver (e.g. apt install nvidia-driver-$need or newer), or install the CPU lock" \
       "(requirements/cpu.txt) on this machine." >&2
  exit 1
fi
echo "[driver] NVIDIA driver $version >= $need: new enough for the CUDA lock (CUDA $cuda)"
