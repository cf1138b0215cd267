#!/usr/bin/env bash
# The next lease after session 52 (bench/notes/s52.md "Next"): each PART one call of < 10 minutes.
# PART=1 (any card): the TTFT probe on both models (the numpy host path, e4aac2a: predicted the 1B's host 0.79 ->
#         0.5-0.65 ms); v192's question: the 1B's last chunk (LM head one group) at 128 / 256 vocabulary rows a tile,
#         alternated in one process; the 8B's TTFT with v188 + v191 beside transformers (predicted 1024 tokens
#         33.05 -> 31.0-31.8 ms against ~32.1; 4096 137.0 -> 129-132 against ~125.2).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
case "${PART:-1}" in
1) nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-1.log 2>&1
   timeout 70 python3 -m bench.probes.ttft_probe > $OUT/ttft-probe-1b.log 2>&1
   timeout 100 python3 -m bench.probes.rows_profile --R 1024 --prefill --last-logits --preset llama3.2-1b --pos 0 \
     --tiling ";;" --lm-rows ";256;" > $OUT/p1024-1b-lm.log 2>&1
   timeout 110 python3 -m bench.probes.ttft_probe --preset llama3.1-8b --batch 4 > $OUT/ttft-probe-8b.log 2>&1
   timeout 230 python3 -m bench.rows_bench --preset llama3.1-8b --skip decode,invariance,accuracy --out $OUT > $OUT/ttft-8b.log 2>&1
   for f in $OUT/*.log; do echo "== $f"; grep -v "^  +\|^{\|Warn\|_warn\|  layer" $f | cut -c1-300 | tail -n 14; done ;;
esac
