#!/usr/bin/env bash
# Session 51's second lease (bench/notes/s51.md v188): each PART one call of < 10 minutes; logs back as one tarball.
# `.pre188/` (carried, ignored: `git archive f724689`, the tree before v188's backfilled list scheduling) runs beside
# this tree in the same call. Make it here (no git on the device): echo /.pre188/ >> .git/info/exclude;
# mkdir .pre188 && git archive f724689 | tar -x -C .pre188 && rm -rf .pre188/bench/results .pre188/bench/notes;
# run with carry [".pre188"].
# PART=1 (any card): the 8B's 1024-row chunk at pos 0, v188 and f724689 alternated (2 processes each, accuracy on the
#         first of each; outputs must be bitwise equal: a schedule moves no sum); then the 8B's TTFT with v188.
# PART=2 (any card): the 1B's 1024-row chunk, v188 and f724689 (its tape should be identical: the plain plan kept).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-${PART:-1}.log 2>&1
pre() { (cd .pre188 && PYTHONPATH=$PWD "$@"); }
if [ ! -f .pre188/schedule/assign.py ]; then
  echo "s51b PART=${PART:-1}: no .pre188/ (the tree before v188) here: make it and carry it (see this script's head)"; exit 2
fi
P8="--R 1024 --prefill --preset llama3.1-8b --pos 0 --tiling ;"
# this tree at f724689's tiling of that bucket (before v191, session 52), so that only the schedule differs
T8="down_rows=64,red_rows=64;down_rows=64,red_rows=64"
case "${PART:-1}" in
1) timeout 110 python3 -m bench.probes.rows_profile $P8 --tiling "$T8" --accuracy > $OUT/p1024-8b-v188-a.log 2>&1
   pre timeout 110 python3 -m bench.probes.rows_profile $P8 > $OUT/p1024-8b-f724689-a.log 2>&1
   timeout 80 python3 -m bench.probes.rows_profile $P8 --tiling "$T8" > $OUT/p1024-8b-v188-b.log 2>&1
   pre timeout 80 python3 -m bench.probes.rows_profile $P8 > $OUT/p1024-8b-f724689-b.log 2>&1
   timeout 200 python3 -m bench.rows_bench --preset llama3.1-8b --skip decode,invariance,accuracy --out $OUT > $OUT/ttft-8b.log 2>&1 ;;
2) P1="--R 1024 --prefill --preset llama3.2-1b --pos 0 --tiling ;"
   timeout 60 python3 -m bench.probes.rows_profile $P1 > $OUT/p1024-1b-v188.log 2>&1
   pre timeout 60 python3 -m bench.probes.rows_profile $P1 > $OUT/p1024-1b-f724689.log 2>&1 ;;
esac
for f in $OUT/*.log; do echo "== $f"; grep -v "^  +\|^{\|Warn\|_warn\|  layer" $f | cut -c1-300 | tail -n 16; done
(cd $OUT && tar czf logs-${PART:-1}.tgz *.log && rm -f *.log)
