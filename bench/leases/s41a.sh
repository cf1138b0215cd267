#!/usr/bin/env bash
# The next lease (bench/notes/s40.md: v152 and v153 predictions), two calls of < 10 minutes on one warm machine:
# PART=1 the 256-row prefill chunk profiled on the 1B and the 8B (its tiling is the 1B's best of run 280, the 8B
# never ran it) with a few variants, the 512-row chunk (two column blocks of 256), and the rows bench on the
# 1B (TTFT now in 512-row chunks); PART=2 the serve
# bench (v153: greedy tokens on the device) and the rows bench on the 8B.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-${PART:-1}.log 2>&1
if [ "${PART:-1}" = 1 ]; then
    V=";o_rows=16;qkv_rows=64;stages=4"
    timeout ${T0:-90} python3 -m bench.probes.rows_profile --R 256 --prefill --pos 768 --tiling "$V" > $OUT/prof256-1b.log 2>&1
    timeout ${T4:-120} python3 -m bench.probes.rows_profile --preset llama3.1-8b --R 256 --prefill --pos 768 \
        --tiling "$V" > $OUT/prof256-8b.log 2>&1
    timeout ${T5:-90} python3 -m bench.probes.rows_profile --R 512 --prefill --pos 512 --tiling ";num_warps=4" \
        > $OUT/prof512-1b.log 2>&1
    timeout ${T1:-200} python3 -m bench.rows_bench --preset llama3.2-1b --out $OUT > $OUT/rows-1b.log 2>&1
else
    timeout ${T3:-150} python3 -m bench.serve_bench --out $OUT > $OUT/serve-1b.log 2>&1
    timeout ${T2:-300} python3 -m bench.rows_bench --preset llama3.1-8b --out $OUT > $OUT/rows-8b.log 2>&1
fi
for f in $OUT/*.log; do echo "== $f"; grep -v "^  layer 1\|^row [1-7] " $f | cut -c1-300 | tail -n 30; done
