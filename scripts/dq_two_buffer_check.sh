#!/bin/bash
# One device call for the sm90 backward's two dQ buffers (NOTES 2026-12-07, thirty-first session):
# the benchmark's default and deterministic backward (and, where .carry/main/_C.abi3.so holds an
# earlier build, the same for it first), the GPU suite, memcheck and racecheck (block-sparse).
# Parts (default all; together they exceed one 600 s call): bench suite sanitize.
PARTS="${*:-bench suite sanitize}"
has() { [[ " $PARTS " == *" $1 "* ]]; }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
B="--dtypes bf16 --hdims 64,128 --seqlens 1024,4096,16384 --impls ours,ours_det"
cp flash_attn/_C.abi3.so /tmp/this.so
has bench && for build in main this; do
  [ $build = main ] && { [ -f .carry/main/_C.abi3.so ] || continue; cp .carry/main/_C.abi3.so flash_attn/_C.abi3.so; }
  timeout 100 python3 benchmarks/benchmark_attention.py $B --out $OUT/bench_$build.json \
    --plot $OUT/bench_$build.png > $OUT/bench_$build.log 2>&1; echo "bench $build rc $?"
  tail -22 $OUT/bench_$build.log
  cp /tmp/this.so flash_attn/_C.abi3.so
done
if has suite; then
timeout 230 python3 -m pytest -q -m gpu tests -p no:cacheprovider \
  --deselect tests/test_cuda_archs.py::test_build_for_an_older_arch_runs_its_ptx_or_refuses > $OUT/gpu_suite.txt 2>&1
echo "gpu suite rc $?"; tail -4 $OUT/gpu_suite.txt
fi
has sanitize || exit 0
source scripts/sanitizer.sh
for which in dense blocksparse; do
  timeout 55 $SANITIZER --tool memcheck --error-exitcode 9 python3 scripts/sanitize_kernels.py $which \
    > $OUT/memcheck_$which.log 2>&1
  echo "memcheck $which rc=$? $(grep -E 'ERROR SUMMARY' $OUT/memcheck_$which.log | tail -1)"
done
timeout 150 $SANITIZER --tool racecheck python3 scripts/sanitize_kernels.py blocksparse > $OUT/racecheck.log 2>&1
echo "racecheck blocksparse rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' $OUT/racecheck.log | tail -1)"
