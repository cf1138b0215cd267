#!/usr/bin/env bash
# Session 43's second lease (bench/notes/s43.md): each PART one call of < 10 minutes.
# PART=1: v167 (issue 53 (2)): the 1B one-row decoder at pos 128, the default against gate/up tiles in 4 / 2 down K chunks
# (chunk order), v170 (QKV tiles as runs of 13 RoPE pairs: 128 tiles, not 96) and both, alternated twice in one
# process; then v166's TTFT (1024-row chunks) on the 1B, transformers beside;
# PART=2: v164 (the 8B's QKV tiles of 128 rows in the prefill buckets) against the default, alternated; v168:
#         the prefill buckets' down projection in K chunks of 4096 / 7168 (8B: 896 tiles of 64 x 256 x 2048 at
#         ~3.3 TFLOP/s an SM against gate/up's ~4.8, 7 fp32 partials a row) and 4096 on the 1B.
# PART=3: v169 (the decode buckets' attention in key groups, warps on the groups: Tiling.attn_kg) in the 16-row
#         step at B=16, pos 1024, alternated with the default, 1B and 8B (on an H200 first: there the decode
#         attention streams ~25 GB/s an SM, 2.4 of the 4.3 TB/s; on an H100 it is near the HBM's rate).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi.log 2>&1
if [ "${PART:-1}" = 1 ]; then
V='default;down_k=2048,gu_tiles=512;down_k=4096,gu_tiles=256;qkv_pairs=13;down_k=2048,gu_tiles=512,qkv_pairs=13'
timeout ${T0:-300} python3 -m bench decoder --preset llama3.2-1b --pos 128 --no-compile --variants "$V;$V" --out $OUT > $OUT/dec-1b-v167.log 2>&1
timeout ${T1:-200} python3 -m bench.rows_bench --preset llama3.2-1b --skip decode,accuracy,invariance --out $OUT > $OUT/ttft-1b.log 2>&1
elif [ "$PART" = 3 ]; then
timeout ${T4:-120} python3 -m bench.probes.rows_profile --R 16 --B 16 --pos 1024 --tiling ";attn_kg=4;attn_kg=2;;attn_kg=4;attn_kg=2" > $OUT/r16-1b-v169.log 2>&1
timeout ${T5:-180} python3 -m bench.probes.rows_profile --preset llama3.1-8b --R 16 --B 16 --pos 1024 --tiling ";attn_kg=2;attn_kg=4;;attn_kg=2;attn_kg=4" > $OUT/r16-8b-v169.log 2>&1
timeout ${T6:-120} python3 -m bench.probes.rows_profile --R 16 --B 1 --pos 1024 --tiling ";attn_kg=4;;attn_kg=4" > $OUT/r16-1b-b1-v169.log 2>&1
else
# v164 again (run 300: -1.0% on the 8B's last 512-row chunk of a 4096 prompt; 1040 bytes of stack with v165), alternated
timeout ${T2:-200} python3 -m bench.probes.rows_profile --preset llama3.1-8b --R 512 --prefill --pos 3584 --tiling ";qkv_rows=128;down_k=4096;down_k=7168;;qkv_rows=128;down_k=4096;down_k=7168" > $OUT/p512-8b-v164-v168.log 2>&1
timeout ${T3:-120} python3 -m bench.probes.rows_profile --R 512 --prefill --pos 3584 --tiling ";down_k=4096;down_k=8192;;down_k=4096" > $OUT/p512-1b-v168.log 2>&1
fi
for f in $OUT/*.log; do echo "== $f"; grep -v "^{" $f | cut -c1-250 | tail -n 24; done
