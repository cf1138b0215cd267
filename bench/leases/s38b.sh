#!/usr/bin/env bash
# Session 38's second lease: rows v1.1 (no spills, attention row tiles; bench/notes/s38.md has the
# predictions), where a rows step's time goes, and the serving engine under 1 / 8 / 32 clients.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi.log 2>&1
timeout 90 python3 -m bench.probes.rows_profile --R 16 --B 16 > $OUT/prof16.log 2>&1
timeout ${T1:-200} python3 -m bench.rows_bench --preset llama3.2-1b --out $OUT > $OUT/rows-1b.log 2>&1
timeout ${T3:-120} python3 -m bench.serve_bench --out $OUT > $OUT/serve-1b.log 2>&1
timeout ${T2:-170} python3 -m bench.rows_bench --preset llama3.1-8b --prompts ${P8:-128,1024} --out $OUT > $OUT/rows-8b.log 2>&1
for f in $OUT/*.log; do echo "== $f"; grep -v "^row [1-7] " $f | tail -n 32; done
