#!/usr/bin/env bash
# Nsight Compute on one fwd+bwd of ours and of SDPA's FlashAttention-2 (bf16, d=128, s=4096):
# speed of light, warp stalls, instruction mix; per-instruction stall samples of our backward.
# Usage (device): bash scripts/ncu_kernels.sh [head dim]; results in $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/ncu}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
D="${1:-128}"
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section SchedulerStats"
ncu --clock-control none $SECTIONS -k 'regex:flash_fwd_sm90|flash_fwd_kernel|flash_bwd_sm90_ws|flash_bwd_sm90_split|flash_bwd_dkdv_kernel|flash_bwd_dq_dk_dv' \
  --launch-skip 0 --launch-count 4 python3 scripts/profile_one_step.py "$D" > "$OUT/ncu_details.txt" 2>&1
echo "details rc=$?"
ncu --clock-control none --section SourceCounters --section WarpStateStats -k 'regex:flash_bwd_sm90_ws|flash_bwd_sm90_split|flash_bwd_dkdv_kernel' --launch-count 1 \
  --import-source no -o "$OUT/bwd" python3 scripts/profile_one_step.py "$D" ours > "$OUT/ncu_src.log" 2>&1
ncu --import "$OUT/bwd.ncu-rep" --page source --csv --print-source sass > "$OUT/bwd_source.csv" 2>>"$OUT/ncu_src.log"
echo "source rc=$? $(wc -l < "$OUT/bwd_source.csv") lines"
rm -f "$OUT/bwd.ncu-rep"
