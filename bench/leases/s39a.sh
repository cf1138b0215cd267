#!/usr/bin/env bash
# Session 39's first lease: v148 (normed operands built by their producers; bench/notes/s39.md has the
# prediction): the R16 step's profile and tiling variants, the rows bench on the 1B, the serving engine
# (issue 51: 1 / 8 / 32 clients), the rows bench on the 8B. ~9 minutes.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi.log 2>&1
timeout ${T0:-80} python3 -m bench.probes.rows_profile --R 16 --B 16 \
    --tiling "${VARIANTS:-;gu_rows=32;num_warps=4}" > $OUT/prof16.log 2>&1
timeout ${T1:-170} python3 -m bench.rows_bench --preset llama3.2-1b --out $OUT > $OUT/rows-1b.log 2>&1
timeout ${T3:-110} python3 -m bench.serve_bench --out $OUT > $OUT/serve-1b.log 2>&1
timeout ${T2:-140} python3 -m bench.rows_bench --preset llama3.1-8b --prompts ${P8:-128,1024} --out $OUT > $OUT/rows-8b.log 2>&1
for f in $OUT/*.log; do echo "== $f"; grep -v "^row [1-7] \|^  layer 1" $f | cut -c1-400 | tail -n 40; done
