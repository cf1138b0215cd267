#!/usr/bin/env bash
# The next lease (bench/notes/s44.md, "Next"): each PART one call of < 10 minutes; OUT collects every log.
# PART=1 (1B): v172 (the LM head's tiles block-major) in the prefill timeline against old_a/ (a `git archive c1828a5`,
#         untracked: v0-major), the taller LM tiles (--lm-rows 64 / 128), v173 (col_deps=1) in the timeline and
#         in the last 512-row chunk of a 4096 prompt beside v171 (o_rows=32), alternated.
# PART=2 (8B): the same for the 8B, with v164 (qkv_rows=128) and v168 (down_k=4096) in the chunk profile.
# PART=3: the H200 decode sweep of the committed code (issue 50's B = 1..32 table; s43a PART=1).
# PART=4: the rows bench's TTFT beside transformers, 1B and 8B (after the defaults are settled).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-${PART:-1}.log 2>&1
TL="python3 -m bench.probes.prefill_timeline"
case "${PART:-1}" in
1) timeout 100 $TL --prompts 128,1024,4096 > $OUT/tl-1b-new.log 2>&1
   [ -d old_a ] && (cd old_a && PYTHONPATH=$PWD timeout 90 $TL --prompts 128,1024 > $OUT/tl-1b-old.log 2>&1)
   timeout 100 $TL --prompts 1024,4096 --tiling col_deps=1 > $OUT/tl-1b-coldeps.log 2>&1
   timeout 80 $TL --prompts 128,1024 --lm-rows 64 > $OUT/tl-1b-lm64.log 2>&1
   timeout 150 python3 -m bench.probes.rows_profile --R 512 --prefill --pos 3584 --tiling ";col_deps=1;o_rows=32;;col_deps=1;o_rows=32" > $OUT/p512-1b-v173.log 2>&1
   ;;
2) P="--preset llama3.1-8b"
   timeout 150 $TL $P --prompts 128,1024,4096 > $OUT/tl-8b-new.log 2>&1
   timeout 150 $TL $P --prompts 1024,4096 --tiling col_deps=1 > $OUT/tl-8b-coldeps.log 2>&1
   timeout 250 python3 -m bench.probes.rows_profile $P --R 512 --prefill --pos 3584 --tiling ";col_deps=1;qkv_rows=128;down_k=4096;;col_deps=1;qkv_rows=128;down_k=4096" > $OUT/p512-8b-v173.log 2>&1 ;;
3) PART=1 bash bench/leases/s43a.sh > /dev/null 2>&1 ;;
4) for P in llama3.2-1b llama3.1-8b; do
     timeout 280 python3 -m bench.rows_bench --preset $P --skip decode,invariance --out $OUT > $OUT/ttft-$P.log 2>&1
   done ;;
esac
for f in $OUT/*.log; do echo "== $f"; grep -v "^  layer [1-9]\|^row [1-7] \|^{\|^  +\|Warn\|_warn" $f | cut -c1-220 | tail -n 16
  grep -q megakernel $f && { grep megakernel $f | awk '{print $6}' | tr '\n' ' '; echo; }; done
