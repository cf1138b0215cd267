#!/usr/bin/env bash
# Session 39's short lease (~4 minutes left of the session's device time): v148's R16 profile and the 1B's
# rows bench (decode B = 1..32, accuracy, TTFT 128 / 1024), nothing else.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout ${T0:-60} python3 -m bench.probes.rows_profile --R 16 --B 16 > $OUT/prof16.log 2>&1
timeout ${T1:-150} python3 -m bench.rows_bench --preset llama3.2-1b --skip invariance --prompts 128,1024 --out $OUT \
    > $OUT/rows-1b.log 2>&1
for f in $OUT/*.log; do echo "== $f"; grep -v "^row [1-7] \|^  layer 1\|^{" $f | cut -c1-300 | tail -n 30; done
