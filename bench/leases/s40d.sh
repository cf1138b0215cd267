#!/usr/bin/env bash
# Session 40's last lease (bench/notes/s40.md: v151 prediction): the rows benches of the 1B and the 8B with the
# new prefill tiling, and the 8B's prefill chunk against its old tiling. ~5 minutes.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi.log 2>&1
timeout ${T1:-150} python3 -m bench.rows_bench --preset llama3.2-1b --out $OUT > $OUT/rows-1b.log 2>&1
timeout ${T2:-200} python3 -m bench.rows_bench --preset llama3.1-8b --out $OUT > $OUT/rows-8b.log 2>&1
timeout ${T0:-60} python3 -m bench.probes.rows_profile --preset llama3.1-8b --R 128 --prefill --pos 768 \
    --tiling "gu_rows=16,num_warps=8,red_rows=32,down_rows=32" > $OUT/prof128-8b.log 2>&1
for f in $OUT/*.log; do echo "== $f"; grep -v "^  layer 1\|^row [1-7] " $f | cut -c1-300 | tail -n 25; done
