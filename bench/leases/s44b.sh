#!/usr/bin/env bash
# Session 44's second lease (bench/notes/s44.md, v172): the LM head of a prompt's last chunk. old_a/ is a
# `git archive` of b581833 (LM head tiles v0-major: a column block's tiles on the SMs = block mod n_blocks),
# untracked; this tree deals each block's tiles over every SM; --lm-rows 64 / 128: taller LM tiles.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi.log 2>&1
(cd old_a && PYTHONPATH=$PWD timeout 90 python3 -m bench.probes.prefill_timeline --prompts 128,1024 > $OUT/tl-old.log 2>&1)
cd new_a; export PYTHONPATH=$PWD
timeout 90 python3 -m bench.probes.prefill_timeline --prompts 128,1024 > $OUT/tl-new.log 2>&1
[ -n "$LM" ] && timeout 90 python3 -m bench.probes.prefill_timeline --prompts 128,1024 --lm-rows $LM > $OUT/tl-lm$LM.log 2>&1
for f in $OUT/tl-*.log; do echo "== $f"; grep -v "^  +\|Warn\|_warn" $f | cut -c1-200; grep "megakernel" $f | awk '{print $6}' | tr '\n' ' '; echo; done
