#!/usr/bin/env bash
# Session 40's first lease (bench/notes/s40.md has the predictions), in two calls of < 10 minutes on one warm
# machine: PART=1 the R16 profiles (1B and 8B, v149's 4 warps against 8), a 1B prefill chunk's profile (R128
# at pos 896), the rows bench on the 1B; PART=2 the serving engine (1 / 8 / 32 clients) and the rows bench on
# the 8B.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-$PART.log 2>&1
if [ "${PART:-1}" = 1 ]; then
    timeout ${T0:-80} python3 -m bench.probes.rows_profile --R 16 --B 16 --tiling ";num_warps=8;gu_rows=32" \
        > $OUT/prof16-1b.log 2>&1
    timeout ${T4:-90} python3 -m bench.probes.rows_profile --preset llama3.1-8b --R 16 --B 16 --tiling ";num_warps=8" \
        > $OUT/prof16-8b.log 2>&1
    timeout ${T5:-70} python3 -m bench.probes.rows_profile --R 128 --prefill --pos 896 --tiling ";num_warps=4" \
        > $OUT/prof128-1b.log 2>&1
    timeout ${T1:-200} python3 -m bench.rows_bench --preset llama3.2-1b --out $OUT > $OUT/rows-1b.log 2>&1
else
    timeout ${T3:-130} python3 -m bench.serve_bench --out $OUT > $OUT/serve-1b.log 2>&1
    timeout ${T2:-300} python3 -m bench.rows_bench --preset llama3.1-8b --prompts ${P8:-128,1024,4096} --out $OUT \
        > $OUT/rows-8b.log 2>&1
fi
for f in $OUT/*.log; do echo "== $f"; grep -v "^row [1-7] \|^  layer 1" $f | cut -c1-300 | tail -n 30; done
