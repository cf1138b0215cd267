#!/usr/bin/env bash
# Session 42's last call (bench/notes/s42.md): the decode buckets as committed (K blocks 128, v158) in the rows
# bench's B sweep on both shapes, then the 1B's last 512-row chunk of a 4096-token prompt with wider waves for
# its short stages (O in 128 tiles, down / residual tiles of 32 rows: 128 residual instructions, not 64).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi.log 2>&1
timeout ${T0:-120} python3 -m bench.rows_bench --preset llama3.2-1b --skip ttft,accuracy,invariance --out $OUT > $OUT/dec-1b.log 2>&1
timeout ${T1:-150} python3 -m bench.rows_bench --preset llama3.1-8b --skip ttft,accuracy,invariance --out $OUT > $OUT/dec-8b.log 2>&1
timeout ${T2:-110} python3 -m bench.probes.rows_profile --R 512 --prefill --pos 3584 \
    --tiling ";o_rows=32;down_rows=32,red_rows=32;o_rows=32,down_rows=32,red_rows=32" > $OUT/p512d-1b.log 2>&1
for f in $OUT/*.log; do echo "== $f"; grep -v "^{\|^  layer [1-9]\|^row [1-7] " $f | cut -c1-250 | tail -n 16; done
