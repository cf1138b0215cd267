#!/usr/bin/env bash
# Session 40's second lease (bench/notes/s40.md: v150 predictions): tile variants of a 1B prefill chunk (R128 and
# R256 at pos 768, one slot's consecutive positions), gu_rows 32 on the 8B's R16 bucket, the serve bench (v150a:
# a step in the smallest decode bucket). ~6 minutes.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi.log 2>&1
V128="num_warps=4;num_warps=8;gu_rows=64,num_warps=4;gu_rows=64;gu_rows=128,num_warps=4;gu_rows=64,down_rows=64,num_warps=4"
V128="$V128;gu_rows=64,down_rows=64,o_rows=64,qkv_rows=64,num_warps=4;gu_rows=128,down_rows=64,o_rows=64,num_warps=4"
timeout ${T0:-150} python3 -m bench.probes.rows_profile --R 128 --prefill --pos 768 --tiling "$V128" > $OUT/prof128.log 2>&1
timeout ${T1:-80} python3 -m bench.probes.rows_profile --R 256 --prefill --pos 768 \
    --tiling ";gu_rows=64,num_warps=4;gu_rows=64,down_rows=64,o_rows=64,num_warps=4" > $OUT/prof256.log 2>&1
timeout ${T2:-60} python3 -m bench.probes.rows_profile --preset llama3.1-8b --R 16 --B 16 --tiling "gu_rows=32" \
    > $OUT/prof16-8b.log 2>&1
timeout ${T3:-130} python3 -m bench.serve_bench --out $OUT > $OUT/serve-1b.log 2>&1
for f in $OUT/*.log; do echo "== $f"; grep -v "^row [1-7] \|^  layer 1" $f | cut -c1-300 | tail -n 30; done
