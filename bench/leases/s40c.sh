#!/usr/bin/env bash
# Session 40's third lease (bench/notes/s40.md: v151 predictions): bigger M tiles for the prefill buckets (R128 and
# R256 chunks of the 1B at pos 768), and the serve bench with every bucket built before serving. ~5 minutes.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi.log 2>&1
V="gu_rows=64,num_warps=4;gu_rows=64,num_warps=4,stages=3;gu_rows=64,num_warps=4,red_rows=64,down_rows=64"
V="$V;gu_rows=64,num_warps=4,red_rows=64,down_rows=64,o_rows=64;gu_rows=128,num_warps=4,stages=3"
V="$V;gu_rows=128,num_warps=8,stages=3;gu_rows=64,num_warps=8,red_rows=64,down_rows=64,o_rows=64"
timeout ${T0:-150} python3 -m bench.probes.rows_profile --R 128 --prefill --pos 768 --tiling "$V" > $OUT/prof128.log 2>&1
V="num_warps=4;gu_rows=64,num_warps=4,stages=3;gu_rows=64,num_warps=8,stages=3"
V="$V;gu_rows=64,num_warps=8,stages=3,red_rows=64,down_rows=64,o_rows=64"
timeout ${T1:-100} python3 -m bench.probes.rows_profile --R 256 --prefill --pos 768 --tiling "$V" > $OUT/prof256.log 2>&1
timeout ${T3:-150} python3 -m bench.serve_bench --out $OUT > $OUT/serve-1b.log 2>&1
for f in $OUT/*.log; do echo "== $f"; grep -v "^  layer 1" $f | cut -c1-300 | tail -n 30; done
