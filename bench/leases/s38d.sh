#!/usr/bin/env bash
# Session 38's last try (300 s of device time left): rows v1.1 decode and TTFT on the 1B, then the engine.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 90 python3 -m bench.rows_bench --preset llama3.2-1b --reps 5 --skip accuracy,invariance --prompts 128,1024 \
    --no-hf --out $OUT > $OUT/rows-1b.log 2>&1
timeout 70 python3 -m bench.serve_bench --clients 1,8,32 --requests-per-client 1 --out $OUT > $OUT/serve-1b.log 2>&1
for f in $OUT/*.log; do echo "== $f"; tail -n 16 $f; done
