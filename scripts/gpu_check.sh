#!/usr/bin/env bash
# The GPU check: run once on a machine with an NVIDIA GPU (about 10 minutes) to prove what CPU-only CI cannot.
#
#   bash scripts/gpu_check.sh              # on the GPU machine, from the repo root, with a CUDA build of torch
#   bash scripts/gpu_check.sh --dry-run    # anywhere: checks every step's command and flags without a GPU
#
# Steps: build the CUDA extension in place; the CUDA tests (they assert which kernel served each op);
# pack/unpack against a device-to-device copy (`bench pack --device cuda`); `bench ddp` on NCCL (world size 1,
# and 2 processes when there are two GPUs); the CuPy/NVRTC tier's launch; NVML `fastpar topo`; DALI's GPU
# decoding when DALI is installed. Every step's output lands in bench/results/gpu-<host>-<date>/ with a
# summary.md (step, status, seconds); a failed step is recorded and the others still run; the exit status
# is the number of failed steps.
#
# Environment: PYTHON (default python3), CUDA_HOME (default: the toolkit folder above nvcc whose include/ holds
# cuda_runtime_api.h), FASTPAR_GPU_CHECK_OUT (the results folder).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PY=${PYTHON:-python3}
STAMP=$(date +%Y-%m-%d)
OUT=${FASTPAR_GPU_CHECK_OUT:-bench/results/gpu-$(hostname -s)-$STAMP}
[ "$DRY" = 1 ] && OUT=$(mktemp -d)
mkdir -p "$OUT"
SUMMARY="$OUT/summary.md"
printf '# GPU check %s on %s\n\n| step | status | seconds |\n|---|---|---|\n' "$STAMP" "$(hostname -s)" >"$SUMMARY"
FAILED=0

# step NAME COMMAND...: runs (or, in a dry run, shows) one step; its output goes to $OUT/NAME.log
step() {
  local name=$1
  shift
  echo "== $name: $*"
  if [ "$DRY" = 1 ]; then
    printf '| %s | dry run | - |\n' "$name" >>"$SUMMARY"
    return 0
  fi
  local start=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then
    printf '| %s | ok | %s |\n' "$name" "$((SECONDS - start))" >>"$SUMMARY"
  else
    printf '| %s | FAILED (%s.log) | %s |\n' "$name" "$name" "$((SECONDS - start))" >>"$SUMMARY"
    FAILED=$((FAILED + 1))
    tail -20 "$OUT/$name.log"
  fi
}

# need FLAG COMMAND...: in a dry run, the flag must appear in the command's --help (the step would use it)
need() {
  local flag=$1
  shift
  if ! "$@" --help 2>&1 | grep -q -- "$flag"; then
    echo "dry run: '$*' has no $flag: update scripts/gpu_check.sh" >&2
    FAILED=$((FAILED + 1))
  fi
}

if [ "$DRY" = 1 ]; then
  echo "dry run: checking commands, flags and test selection (no GPU needed)"
  need --device "$PY" -m fastpar bench pack
  need --backend "$PY" -m fastpar bench ddp
  need --nproc "$PY" -m fastpar bench ddp
  need --json "$PY" -m fastpar topo
  need --json "$PY" -m fastpar bench data
  collected=$("$PY" -m pytest -q --collect-only -m cuda --full tests 2>/dev/null | grep -c '::')
  echo "dry run: $collected CUDA tests collected"
  [ "$collected" -gt 0 ] || { echo "dry run: no test is marked cuda" >&2; FAILED=$((FAILED + 1)); }
else
  if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  fi
  [ -f "${CUDA_HOME:-/nonexistent}/include/cuda_runtime_api.h" ] || echo "warning: CUDA_HOME=${CUDA_HOME:-} has no include/cuda_runtime_api.h" >&2
  export CUDA_HOME
  nvidia-smi -L | tee "$OUT/gpus.txt"
  "$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))' | tee -a "$OUT/gpus.txt"
fi
GPUS=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU')

step build env FASTPAR_CUDA=1 "$PY" setup.py build_ext --inplace
step info env FASTPAR_EXT=compiled "$PY" -m fastpar info --json
step cuda-tests env FASTPAR_EXPECT_EXT=compiled "$PY" -m pytest -q -rfE --tb=short -m cuda --full tests
step pack "$PY" -m fastpar bench pack --device cuda --json "$OUT/pack.json"
step ddp-nccl-1 "$PY" -m fastpar bench ddp --backend nccl --nproc 1 --json "$OUT/ddp-nccl-1.json"
if [ "$GPUS" -ge 2 ] || [ "$DRY" = 1 ]; then
  step ddp-nccl-2 "$PY" -m fastpar bench ddp --backend nccl --nproc 2 --json "$OUT/ddp-nccl-2.json"
fi
step cupy-tier env FASTPAR_EXT=cupy "$PY" -c '
import torch, fastpar
from fastpar import ops
x = [torch.randn(1000, device="cuda") for _ in range(8)]
flat = torch.empty(8000, device="cuda")
ops.pack(x, flat)
assert torch.equal(flat, torch.cat(x)), "CuPy tier pack differs from torch.cat"
served = ops.last_implementation(torch.device("cuda", 0))
print(fastpar.ext_status(), "served by", served)
assert served == "cupy", f"expected the CuPy tier, got {served}"
'
step topo-nvml "$PY" -m fastpar topo --json
if "$PY" -c 'import nvidia.dali' 2>/dev/null || [ "$DRY" = 1 ]; then
  step dali-gpu "$PY" -m fastpar bench data --json "$OUT/data.json"
fi

echo "summary: $SUMMARY"
cat "$SUMMARY"
[ "$DRY" = 1 ] && rm -rf "$OUT"
exit "$FAILED"
