#!/usr/bin/env bash
# Session 37's third lease call: issue 50's tile probe (bench/probes/rows_gemm.py; its prediction is at the top of
# its docstring): the default tiles at N 1..2048 on the 1B and 8B GEMMs, then 64-row decode tiles.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi.log 2>&1
timeout 300 python3 -m bench.probes.rows_gemm --out $OUT/d > $OUT/rows.log 2>&1
timeout 150 python3 -m bench.probes.rows_gemm --m 64 --n 1,16,32 > $OUT/rows-m64.log 2>&1
cp $OUT/d/*.json $OUT/ 2>/dev/null; rm -rf $OUT/d
for f in $OUT/*.log; do echo "== $f"; tail -n 40 $f; done
