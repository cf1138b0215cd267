#!/usr/bin/env bash
# Session 53's leases (bench/notes/s53.md): each PART one call of < 10 minutes, any card.
# PART=1: v193 (the LM head's group path pipelined) on the 1B's last chunk; the attention tile's shape at pos 3072
#         on both models (variants beside the default, one process each).
# PART=2: TTFT of both models beside transformers (v193 in), the 1B's TTFT probe.
# PART=4 (~200 s): v193 on the 1B's last chunk, the 1B's TTFT.
# PART=3 (what fits ~350 s): v193 on the 1B's last chunk, the 1B's TTFT, two attention shapes on the 1B at pos 3072.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-${PART:-1}.log 2>&1
case "${PART:-1}" in
1) timeout 80 python3 -m bench.probes.rows_profile --R 1024 --prefill --last-logits --preset llama3.2-1b --pos 0 \
     > $OUT/lm-1b.log 2>&1
   timeout 180 python3 -m bench.probes.rows_profile --R 1024 --prefill --preset llama3.2-1b --pos 3072 \
     --tiling ";attn_block=64;attn_stages=4;attn_pairs=256,attn_block=64" > $OUT/attn-1b.log 2>&1
   timeout 260 python3 -m bench.probes.rows_profile --R 1024 --prefill --preset llama3.1-8b --pos 3072 \
     --tiling ";attn_block=64;attn_stages=2;attn_pairs=64" > $OUT/attn-8b.log 2>&1 ;;
2) timeout 60 python3 -m bench.probes.ttft_probe > $OUT/ttft-probe-1b.log 2>&1
   timeout 130 python3 -m bench.rows_bench --skip decode,invariance,accuracy --out $OUT > $OUT/ttft-1b.log 2>&1
   timeout 240 python3 -m bench.rows_bench --preset llama3.1-8b --skip decode,invariance,accuracy --out $OUT \
     > $OUT/ttft-8b.log 2>&1 ;;
3) timeout 70 python3 -m bench.probes.rows_profile --R 1024 --prefill --last-logits --preset llama3.2-1b --pos 0 \
     > $OUT/lm-1b.log 2>&1
   timeout 120 python3 -m bench.rows_bench --skip decode,invariance,accuracy --out $OUT > $OUT/ttft-1b.log 2>&1
   timeout 150 python3 -m bench.probes.rows_profile --R 1024 --prefill --preset llama3.2-1b --pos 3072 \
     --tiling ";attn_block=64;attn_pairs=256,attn_block=64" > $OUT/attn-1b.log 2>&1 ;;
4) timeout 70 python3 -m bench.probes.rows_profile --R 1024 --prefill --last-logits --preset llama3.2-1b --pos 0 \
     > $OUT/lm-1b.log 2>&1
   timeout 120 python3 -m bench.rows_bench --skip decode,invariance,accuracy --out $OUT > $OUT/ttft-1b.log 2>&1 ;;
esac
for f in $OUT/*.log; do echo "== $f"; grep -v "^  +\|^{\|Warn\|_warn\|  layer\|aten::\|^---\|cuda\|Activity" $f \
  | grep "plain\|attn_r\|lm_head\|Error\|Resources\|bitwise\|differ\|TTFT\|prefill\|chunk\|H100\|H200\|name" | cut -c1-250; done
