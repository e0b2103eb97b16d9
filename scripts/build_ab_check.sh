#!/bin/bash
# A/B of a build against main's (xz-compressed in .carry/pack/base.so.xz): GPU tests, then
# scripts/short_row_costs.py in alternating rounds, then racecheck before/after on small cases
# (scripts/racecheck_case.py). Logs go to one tar in $OUT, re-packed after every step so that a call
# cut off at its limit still returns them (a call returns at most 8 files). Racecheck cases are
# skipped once AB_BUDGET_S seconds (default 500) have gone.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
LOGS=/tmp/ab_logs; mkdir -p $LOGS; START=$(date +%s)
pack() { tar czf $OUT/logs.tgz -C $LOGS .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
source scripts/sanitizer.sh
summ() { python3 - "$1" <<'PY'
import re,sys,collections
c=collections.Counter(); cur=None
for line in open(sys.argv[1]):
    m=re.search(r'(Race reported between|and) (\w+) access at void flash::hopper::(flash_\w+?_kernel)<.*\+0x([0-9a-f]+)',line)
    if not m: continue
    if m.group(1).startswith('Race'): cur=(m.group(3)[6:9],m.group(2)); continue
    n=re.search(r'\[(\d+) hazards\]',line)
    c[f"{cur[0]} {cur[1][0]}{m.group(2)[0]}"]+=int(n.group(1)) if n else 1
print(dict(sorted(c.items())), "| total", sum(c.values()))
PY
}
T0=$(date +%s); timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py tests/test_block_sparse.py tests/test_deterministic_gpu.py tests/test_kvcache.py tests/test_varlen.py -x --tb=short > $LOGS/pytest.log 2>&1
echo "pytest rc=$? $(tail -1 $LOGS/pytest.log) ($(( $(date +%s) - T0 )) s)"; pack
mkdir -p /tmp/A && cp -r flash_attn benchmarks scripts /tmp/A/ && xz -dc .carry/pack/base.so.xz > /tmp/A/flash_attn/_C.abi3.so
for b in A this A this; do
  [ $b = A ] && PP=/tmp/A || PP=$PWD
  echo "== $b"; PYTHONPATH=$PP timeout 90 python3 scripts/short_row_costs.py 2>&1 | grep -v Warn | tee -a $LOGS/ab_$b.txt; pack
done
for w in "base sparse 0 1 64" "this sparse 0 1 64" "base dense 1 0 128" "this dense 1 0 128" "this dense 0 1 128" "this sparse 1 0 64" "this dense 0 0 64" "this sparse 1 1 128" "base kvcache 1 0 128" "this kvcache 1 0 128" "this kvcache 0 0 64"; do
  [ $(( $(date +%s) - START )) -gt ${AB_BUDGET_S:-500} ] && { echo "$w skipped (time)"; continue; }
  set -- $w; f=$LOGS/race_$(echo $w | tr ' ' _).log
  [ $1 = base ] && PP=/tmp/A || PP=$PWD
  T0=$(date +%s); PYTHONPATH=$PP timeout 80 $SANITIZER --tool racecheck --print-limit 5000 python3 scripts/racecheck_case.py $2 $3 $4 $5 > $f 2>&1
  echo "$w rc=$? $(( $(date +%s) - T0 ))s $(grep -E 'RACECHECK SUMMARY' $f | tail -1) :: $(summ $f)"; pack
done
