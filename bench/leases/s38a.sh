#!/usr/bin/env bash
# Session 38's lease: issue 50's rows v1 (bench/notes/s38.md has the predictions). One preset a step,
# every step bounded in time; logs and JSON under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi.log 2>&1
timeout ${T1:-280} python3 -m bench.rows_bench --preset llama3.2-1b --out $OUT > $OUT/rows-1b.log 2>&1
timeout ${T2:-280} python3 -m bench.rows_bench --preset llama3.1-8b --prompts ${P8:-128,1024} --out $OUT > $OUT/rows-8b.log 2>&1
for f in $OUT/*.log; do echo "== $f"; tail -n 40 $f; done
