#!/usr/bin/env bash
# Session 47's second lease (bench/notes/s47.md): the 1024-row bucket's down projection in 2 K chunks (v176, now the
# default) checked end to end: the 1B's TTFT beside transformers with the accuracy of a 1024-token prompt's logits
# against the fp32 reference; v178 on top of it; the 8B's 1024-token prompt and its accuracy. One call (< 8 min).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi.log 2>&1
timeout 150 python3 -m bench.rows_bench --preset llama3.2-1b --prompts 1024,4096 --skip decode,invariance --out $OUT \
    > $OUT/ttft-llama3.2-1b.log 2>&1
timeout 130 python3 -m bench.rows_bench --preset llama3.1-8b --prompts 1024 --no-hf --skip decode,invariance,accuracy \
    --out $OUT > $OUT/ttft-llama3.1-8b.log 2>&1
timeout 70 python3 -m bench.probes.rows_profile --R 1024 --prefill --pos 0 --tiling ";down_res=1" \
    > $OUT/p1024-llama3.2-1b-0-v178.log 2>&1
for f in $OUT/*.log; do echo "== $f"; grep -v "^  +\|^{\|Warn\|_warn" $f | cut -c1-220 | tail -n 14; done
