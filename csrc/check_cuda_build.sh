#!/usr/bin/env bash
# Proves the CUDA build compiles and links without a GPU: nvcc on csrc/ops/cuda/*.cu alone (no torch headers), then
# setup.py's CUDAExtension against a CUDA build of torch, imported from a scratch copy of the package.
#
# Usage: csrc/check_cuda_build.sh PYTHON        (or FASTPAR_CUDA_PYTHON=PYTHON csrc/check_cuda_build.sh)
#   PYTHON: a venv python with a CUDA build of torch, setuptools and ninja.
#   CUDA_HOME: toolkit folder whose include/ holds cuda_runtime_api.h (default /usr/local/cuda-13.0).
#   TORCH_CUDA_ARCH_LIST: target GPUs (default 9.0; every extra arch adds compile time).
set -euo pipefail

PYTHON=${1:-${FASTPAR_CUDA_PYTHON:-}}
if [[ -z "$PYTHON" ]]; then
  echo "usage: $0 PYTHON  (a python whose torch is a CUDA build)" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
NVCC="$CUDA_HOME/bin/nvcc"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

first_arch=${TORCH_CUDA_ARCH_LIST%%[;, ]*}
sm="sm_${first_arch//./}"
sm="${sm%+PTX}"
echo "== nvcc standalone ($sm)"
for cu in "$ROOT"/csrc/ops/cuda/*.cu; do
  "$NVCC" -std=c++17 -O3 --fmad=false -arch="$sm" -c "$cu" -o "$WORK/$(basename "$cu").o"
done

echo "== CUDAExtension with $("$PYTHON" -c 'import torch; print(torch.__version__)')"
start=$SECONDS
(cd "$ROOT" && FASTPAR_CUDA=1 "$PYTHON" setup.py build_ext --build-lib "$WORK/lib" --build-temp "$WORK/temp")
echo "built in $((SECONDS - start)) s"

echo "== import"
mkdir -p "$WORK/pkg"
cp -r "$ROOT/fastpar" "$WORK/pkg/"
rm -f "$WORK"/pkg/fastpar/_C*.so
cp "$WORK"/lib/fastpar/_C*.so "$WORK/pkg/fastpar/"
cd "$WORK/pkg"
FASTPAR_EXT=compiled "$PYTHON" - <<'PY'
import fastpar

status = fastpar.ext_status()
print(status)
assert status["backend"] == "compiled" and status["cuda"], "CUDA extension did not load"
from fastpar import _C

assert _C.has_cuda() and callable(_C.pack) and callable(_C.unpack) and callable(_C.norm_and_finite)
print("CUDA build OK")
PY
