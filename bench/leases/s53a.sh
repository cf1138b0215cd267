#!/usr/bin/env bash
# Session 53's leases (bench/notes/s53.md "Next"): each PART one call of < 10 minutes, any card.
# `.pre193/` (carried, ignored: `git archive 6ff7fd7`, the tree before v193's pipelined LM head group path) runs
# beside this tree in PART=1. Make it here (no git on the device): echo /.pre193/ >> .git/info/exclude;
# mkdir .pre193 && git archive 6ff7fd7 | tar -x -C .pre193 && rm -rf .pre193/bench/results .pre193/bench/notes;
# run with carry [".pre193"].
# PART=1: v193 against 6ff7fd7 on a prompt's last 1024-row chunk (its LM head's one group), alternated: the 1B in
#         4 processes, the 8B in 2 (predicted 1B 5795.6 -> 5450-5600 us, 8B 29547 -> 29250-29450).
# PART=2: TTFT of both models beside transformers (v193 in), the 1B's TTFT probe.
# PART=3: the attention tile's shape at pos 3072 on both models (variants beside the default, one process each).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-${PART:-1}.log 2>&1
pre() { (cd .pre193 && PYTHONPATH=$PWD "$@"); }
L1="--R 1024 --prefill --last-logits --preset llama3.2-1b --pos 0"
L8="--R 1024 --prefill --last-logits --preset llama3.1-8b --pos 0"
case "${PART:-1}" in
1) if [ ! -f .pre193/opcodes/rows_lm_head.py ]; then
     echo "s53a PART=1: no .pre193/ here: make it and carry it (see this script's head)"; exit 2
   fi
   timeout 70 python3 -m bench.probes.rows_profile $L1 > $OUT/lm-1b-v193-a.log 2>&1
   pre timeout 70 python3 -m bench.probes.rows_profile $L1 > $OUT/lm-1b-pre-a.log 2>&1
   timeout 60 python3 -m bench.probes.rows_profile $L1 > $OUT/lm-1b-v193-b.log 2>&1
   pre timeout 60 python3 -m bench.probes.rows_profile $L1 > $OUT/lm-1b-pre-b.log 2>&1
   timeout 100 python3 -m bench.probes.rows_profile $L8 > $OUT/lm-8b-v193.log 2>&1
   pre timeout 100 python3 -m bench.probes.rows_profile $L8 > $OUT/lm-8b-pre.log 2>&1 ;;
2) timeout 60 python3 -m bench.probes.ttft_probe > $OUT/ttft-probe-1b.log 2>&1
   timeout 130 python3 -m bench.rows_bench --skip decode,invariance,accuracy --out $OUT > $OUT/ttft-1b.log 2>&1
   timeout 240 python3 -m bench.rows_bench --preset llama3.1-8b --skip decode,invariance,accuracy --out $OUT \
     > $OUT/ttft-8b.log 2>&1 ;;
3) timeout 210 python3 -m bench.probes.rows_profile --R 1024 --prefill --preset llama3.2-1b --pos 3072 \
     --tiling ";attn_block=64;attn_stages=4;attn_pairs=256,attn_block=64;attn_pairs=64" > $OUT/attn-1b.log 2>&1
   timeout 260 python3 -m bench.probes.rows_profile --R 1024 --prefill --preset llama3.1-8b --pos 3072 \
     --tiling ";attn_block=64;attn_stages=2;attn_pairs=64" > $OUT/attn-8b.log 2>&1 ;;
esac
for f in $OUT/*.log; do echo "== $f"; grep -v "^  +\|^{\|Warn\|_warn\|  layer\|aten::\|^---\|cuda\|Activity" $f \
  | grep "plain\|attn_r\|lm_head\|Error\|Resources\|bitwise\|differ\|TTFT\|prefill\|chunk\|H100\|H200\|name" | cut -c1-250; done
