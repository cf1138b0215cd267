#!/usr/bin/env bash
# Session 38's last lease (480 s of device time left): rows v1.1 on the 1B and the serving engine only.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi.log 2>&1
timeout 130 python3 -m bench.rows_bench --preset llama3.2-1b --reps 5 --out $OUT > $OUT/rows-1b.log 2>&1
timeout 80 python3 -m bench.serve_bench --out $OUT > $OUT/serve-1b.log 2>&1
for f in $OUT/*.log; do echo "== $f"; grep -v "^row [1-7] " $f | tail -n 24; done
