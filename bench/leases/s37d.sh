#!/usr/bin/env bash
# Session 37's fourth lease call: the tile probe's two open questions from run 271: do 64-row decode tiles close
# the 8B's N 16 gap to the GEMV (7-16% at M 32), and does a 128x256 prefill tile get nearer cuBLAS at N 2048 (0.73-0.78)?
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 120 python3 -m bench.probes.rows_gemm --m 64 --n 1,16,32 > $OUT/rows-m64.log 2>&1
timeout 120 python3 -m bench.probes.rows_gemm --m 64 --bk 256 --n 16 --shapes 8b > $OUT/rows-m64bk256.log 2>&1
timeout 150 python3 -m bench.probes.rows_gemm --m 128 --n-tile 256 --bk 64 --stages 3 --warps 8 --n 512,2048 > $OUT/rows-256.log 2>&1
timeout 150 python3 -m bench.probes.rows_gemm --m 256 --n-tile 128 --bk 64 --stages 3 --warps 8 --n 2048 > $OUT/rows-256m.log 2>&1
for f in $OUT/*.log; do echo "== $f"; grep -v "^|" $f | tail -n 30; done
