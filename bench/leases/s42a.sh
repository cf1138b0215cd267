#!/usr/bin/env bash
# The next lease (bench/notes/s41.md: v156's predictions), one call of < 10 minutes, on an H200 if one comes:
# PART=1 prefill attention tiles (Tiling.attn_pairs) on the last 512-row chunk of a 4096-token prompt (pos 3584),
# 1B and 8B, M-128 GEMM tiles on a 512-row chunk at pos 512 (s37's standalone 128x256 tile: ~0.9 of cuBLAS),
# and the 16-row decode step's variants on the H200 (its B=16 ratio is 11.1x, the goal 12x);
# PART=2 the rows bench's TTFT on both shapes with whatever PART=1 made the default.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-${PART:-1}.log 2>&1
if [ "${PART:-1}" = 1 ]; then
    timeout ${T0:-150} python3 -m bench.probes.rows_profile --R 512 --prefill --pos 3584 \
        --tiling ";attn_pairs=64;attn_pairs=128;attn_pairs=128,attn_block=64;attn_stages=3" > $OUT/p512-1b.log 2>&1
    timeout ${T1:-180} python3 -m bench.probes.rows_profile --preset llama3.1-8b --R 512 --prefill --pos 3584 \
        --tiling ";attn_pairs=32;attn_pairs=64;attn_pairs=64,attn_block=64" > $OUT/p512-8b.log 2>&1
    timeout ${T5:-120} python3 -m bench.probes.rows_profile --R 512 --prefill --pos 512 \
        --tiling ";down_rows=128,o_rows=128,red_rows=128;gu_rows=128,stages=3" > $OUT/p512g-1b.log 2>&1
    timeout ${T2:-150} python3 -m bench.probes.rows_profile --R 16 --B 16 --pos 1024 \
        --tiling ";attn_block=64;attn_stages=4;gu_rows=16;stages=3;bk=64;bk=256;gu_rows=64" > $OUT/p16-1b.log 2>&1
else
    timeout ${T3:-200} python3 -m bench.rows_bench --preset llama3.2-1b --skip decode --out $OUT > $OUT/ttft-1b.log 2>&1
    timeout ${T4:-250} python3 -m bench.rows_bench --preset llama3.1-8b --skip decode --out $OUT > $OUT/ttft-8b.log 2>&1
fi
for f in $OUT/*.log; do echo "== $f"; grep -v "^  layer [1-9]\|^row [1-7] " $f | cut -c1-300 | tail -n 30; done
