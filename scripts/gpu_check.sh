#!/usr/bin/env bash
# One device call: GPU tests, compute-sanitizer on small runs, and the benchmark; results in $OUT.
# Usage (on the GPU machine, library built or carried): bash scripts/gpu_check.sh [pytest -k expr] [bench args]
set -uo pipefail
OUT="${OUT:-/tmp/gpu_check}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
source scripts/sanitizer.sh
python3 -m pytest tests/test_attention_gpu.py tests/test_block_sparse.py -q -rs --maxfail=15 --tb=line ${1:+-k "$1"} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
for tool in memcheck racecheck; do
  $SANITIZER --tool $tool --error-exitcode 9 python3 scripts/sanitize_kernels.py > "$OUT/sanitize_$tool.log" 2>&1
  echo "$tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)"
done
# Spoiled and edge-size arguments (tests/test_argument_fuzz.py) under memcheck, each allocation
# its own (the caching allocator's pools would hide an overrun into a neighbour).
PYTORCH_NO_CUDA_MEMORY_CACHING=1 $SANITIZER --tool memcheck --error-exitcode 9 \
  python3 -m pytest tests/test_argument_fuzz.py -q -k cuda > "$OUT/sanitize_fuzz.log" 2>&1
echo "memcheck on the argument fuzz: rc=$? $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/sanitize_fuzz.log" | tail -2 | tr '\n' ' ')"
[ -n "${2:-}" ] && python3 benchmarks/benchmark_attention.py $2 --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -40
exit 0
