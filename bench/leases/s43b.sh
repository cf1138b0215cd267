#!/usr/bin/env bash
# Session 43's second lease (bench/notes/s43.md): one call of < 10 minutes.
# v167 (issue 53 (2)): the 1B one-row decoder at pos 128, the default against gate/up tiles in 4 / 2 down K chunks
# (chunk order), alternated twice in one process; then v166's TTFT (1024-row chunks) on the 1B, transformers beside;
# then v164 (the 8B's QKV tiles of 128 rows in the prefill buckets) against the default, alternated.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi.log 2>&1
V='default;down_k=2048,gu_tiles=512;down_k=4096,gu_tiles=256'
timeout ${T0:-200} python3 -m bench decoder --preset llama3.2-1b --pos 128 --no-compile --variants "$V;$V" --out $OUT > $OUT/dec-1b-v167.log 2>&1
timeout ${T1:-220} python3 -m bench.rows_bench --preset llama3.2-1b --skip decode,accuracy,invariance --out $OUT > $OUT/ttft-1b.log 2>&1
# v164 again (run 300: -1.0% on the 8B's last 512-row chunk of a 4096 prompt; 1040 bytes of stack with v165), alternated
timeout ${T2:-150} python3 -m bench.probes.rows_profile --preset llama3.1-8b --R 512 --prefill --pos 3584 --tiling ";qkv_rows=128;;qkv_rows=128" > $OUT/p512-8b-v164.log 2>&1
for f in $OUT/*.log; do echo "== $f"; grep -v "^{" $f | cut -c1-250 | tail -n 24; done
