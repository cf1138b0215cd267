#!/usr/bin/env bash
# Session 48's lease (bench/notes/s48.md; s47c's parts 1-3 unchanged): each PART one call of < 10 minutes; OUT collects every log.
# PART=1: the 1B's 1024-row chunk with v176 (the default since session 47): its logits against the fp32 reference
#         (rows_profile --accuracy) and v178 / v179 on top of it, each with its accuracy line; v176 at 512 rows.
# PART=2: the 8B's 1024-row chunk: its accuracy with v176 + v178 (the default since session 48), v178 off, v179.
# PART=3: TTFT beside transformers on both (README's table; H200 wanted), the 1B then the 8B.
# PART=5 (an H200 only: on an H100 the HBM, not the SM, bounds it): v169 again, the decode attention in key groups.
# PART=6 / PART=7: v181, a 2048-row bucket (chunk=2048): its accuracy and the TTFT of 2048 / 4096 prompts
#         with 1024-row chunks (the default) and 2048-row ones, the 1B / the 8B.
# PART=16: the first lease call: PART=1's 1024-row accuracy line and PART=6 (1B), within one call's 10 minutes.
# PART=8: v182, the decode buckets' GEMM pipelines 6 / 8 stages deep, not 5 (1B and 8B, R16 B16 pos 1024).
# PART=17: a short first call (~7 min, for a nearly spent budget): the 1B's v176 accuracy (+ v178), v181, v182.
# PART=18: the shortest useful call (~3 min): v176's accuracy line alone, then v182 on the 1B.
# PART=9 (issue 53, an H200): v183, the one-row 1B decoder 6 / 7 stages deep, alternated with the default.
# PART=20 (session 49's first H200 call): the 1B B sweep with v182 + invariance, the 8B 1024-row accuracy (PART=2 short), v183.
# PART=21: v184's TMA probe (bench/probes/tma_gemm.py), then PART=20 where the card is an H200 (v169 on the 1B in place of the 8B's accuracy); else PART=2 + v180 (8B).
# PART=22: run 317's R1 != R32 (v182): R32 at stages 8 / 8 / 5 / 5 and R16 at 8 / 5 (determinism, numerics), the
#         rows bench's invariance again; the 8B's o_rows=128 (v180) accuracy line.
# PART=23: bench/probes/bucket_probe.py, where row 0's bits part between the 16- and 32-row buckets (1B, 8B).
# PART=4: v180 (the 8B's 1024-row QKV / O tiles of 128 weight rows) and v175 (decode LM head tiles of 128 rows).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-${PART:-1}.log 2>&1
RP="python3 -m bench.probes.rows_profile --R 1024 --prefill --accuracy"
case "${PART:-1}" in
1) timeout 300 $RP --pos 0 --tiling ";down_res=1;down_rows=128,red_rows=128;down_rows=128,red_rows=128,down_res=1" \
       > $OUT/p1024-llama3.2-1b-0-acc.log 2>&1
   # v176 at the 512-row bucket (prompts of 513-1023 tokens, and long prompts' last chunks)
   timeout 150 python3 -m bench.probes.rows_profile --R 512 --prefill --accuracy --pos 0 --tiling ";down_k=4096" \
       > $OUT/p512-llama3.2-1b-0-acc.log 2>&1 ;;
2) timeout 420 $RP --preset llama3.1-8b --pos 0 \
       --tiling ";down_res=0;down_rows=128,red_rows=128;down_rows=128,red_rows=128,down_res=0" \
       > $OUT/p1024-llama3.1-8b-0-acc.log 2>&1 ;;
3) timeout 250 python3 -m bench.rows_bench --preset llama3.2-1b --skip decode,invariance --out $OUT > $OUT/ttft-1b.log 2>&1
   timeout 300 python3 -m bench.rows_bench --preset llama3.1-8b --skip decode,invariance --out $OUT > $OUT/ttft-8b.log 2>&1 ;;
4) timeout 330 python3 -m bench.probes.rows_profile --R 1024 --prefill --preset llama3.1-8b --pos 0 \
       --tiling ";qkv_rows=128;o_rows=128;qkv_rows=128,o_rows=128" > $OUT/p1024-llama3.1-8b-0-v180.log 2>&1
   timeout 200 python3 -m bench.probes.rows_profile --R 16 --B 16 --pos 1024 --tiling ";;;" --lm-rows ";128;;128" \
       > $OUT/r16-llama3.2-1b-1024-v175.log 2>&1 ;;
5) for P in llama3.2-1b llama3.1-8b; do timeout 270 python3 -m bench.probes.rows_profile --preset $P --R 16 --B 16 \
       --pos 1024 --tiling ";attn_kg=4;attn_kg=2;;attn_kg=4" > $OUT/r16-$P-1024-v169.log 2>&1; done ;;
6) timeout 200 python3 -m bench.probes.rows_profile --R 2048 --prefill --accuracy --pos 0 > $OUT/p2048-llama3.2-1b-0-acc.log 2>&1
   timeout 300 python3 -m bench.rows_bench --preset llama3.2-1b --prompts 2048,4096 --chunks 0,2048 --no-hf \
       --skip decode,invariance,accuracy --out $OUT > $OUT/ttft2048-1b.log 2>&1 ;;
7) timeout 240 python3 -m bench.probes.rows_profile --preset llama3.1-8b --R 2048 --prefill --accuracy --pos 0 \
       > $OUT/p2048-llama3.1-8b-0-acc.log 2>&1
   timeout 330 python3 -m bench.rows_bench --preset llama3.1-8b --prompts 2048,4096 --chunks 0,2048 --no-hf \
       --skip decode,invariance,accuracy --out $OUT > $OUT/ttft2048-8b.log 2>&1 ;;
16) timeout 220 $RP --pos 0 --tiling ";down_res=1;down_rows=128,red_rows=128;down_rows=128,red_rows=128,down_res=1" \
       > $OUT/p1024-llama3.2-1b-0-acc.log 2>&1
   timeout 110 python3 -m bench.probes.rows_profile --R 2048 --prefill --accuracy --pos 0 > $OUT/p2048-llama3.2-1b-0-acc.log 2>&1
   timeout 240 python3 -m bench.rows_bench --preset llama3.2-1b --prompts 2048,4096 --chunks 0,2048 --no-hf \
       --skip decode,invariance,accuracy --out $OUT > $OUT/ttft2048-1b.log 2>&1 ;;
8) timeout 200 python3 -m bench.probes.rows_profile --R 16 --B 16 --pos 1024 --tiling ";stages=8;stages=6;;stages=8" \
       > $OUT/r16-llama3.2-1b-1024-v182.log 2>&1
   timeout 280 python3 -m bench.probes.rows_profile --preset llama3.1-8b --R 16 --B 16 --pos 1024 \
       --tiling ";stages=8;stages=6;;stages=8" > $OUT/r16-llama3.1-8b-1024-v182.log 2>&1 ;;
17) timeout 130 $RP --pos 0 --tiling ";down_res=1" > $OUT/p1024-llama3.2-1b-0-acc.log 2>&1
   timeout 90 python3 -m bench.probes.rows_profile --R 16 --B 16 --pos 1024 --tiling ";stages=8;;stages=8" \
       > $OUT/r16-llama3.2-1b-1024-v182.log 2>&1
   timeout 80 python3 -m bench.probes.rows_profile --R 2048 --prefill --accuracy --pos 0 > $OUT/p2048-llama3.2-1b-0-acc.log 2>&1
   timeout 150 python3 -m bench.rows_bench --preset llama3.2-1b --prompts 2048,4096 --chunks 0,2048 --no-hf \
       --skip decode,invariance,accuracy --out $OUT > $OUT/ttft2048-1b.log 2>&1 ;;
9) timeout 400 python3 -m bench decoder --preset llama3.2-1b --pos 128 --no-compile \
       --variants "default;stages=6;stages=7;default;stages=6;stages=7" > $OUT/dec-1b-128-v183.log 2>&1 ;;
18) timeout 100 $RP --pos 0 > $OUT/p1024-llama3.2-1b-0-acc.log 2>&1
   timeout 90 python3 -m bench.probes.rows_profile --R 16 --B 16 --pos 1024 --tiling ";stages=8;;stages=8" \
       > $OUT/r16-llama3.2-1b-1024-v182.log 2>&1 ;;
20) timeout 190 python3 -m bench rows --preset llama3.2-1b --B 1,16,32 --skip ttft,accuracy --out $OUT > $OUT/rows-decode-1b.log 2>&1
   timeout 200 $RP --preset llama3.1-8b --pos 0 --tiling ";down_res=0" > $OUT/p1024-llama3.1-8b-0-acc.log 2>&1
   timeout 170 python3 -m bench decoder --preset llama3.2-1b --pos 128 --no-compile \
       --variants "default;stages=7;default;stages=7" > $OUT/dec-1b-128-v183.log 2>&1 ;;
21) for P in llama3.2-1b llama3.1-8b; do timeout 60 python3 -m bench.probes.tma_gemm --preset $P > $OUT/tma-$P.log 2>&1; done
   if grep -q H200 $OUT/smi-21.log; then
     timeout 190 python3 -m bench rows --preset llama3.2-1b --B 1,16,32 --skip ttft,accuracy --out $OUT > $OUT/rows-decode-1b.log 2>&1
     timeout 200 python3 -m bench.probes.rows_profile --R 16 --B 16 --pos 1024 --tiling ";attn_kg=4;;attn_kg=4" \
         > $OUT/r16-llama3.2-1b-1024-v169.log 2>&1
     timeout 110 python3 -m bench decoder --preset llama3.2-1b --pos 128 --no-compile \
         --variants "default;stages=7;default;stages=7" > $OUT/dec-1b-128-v183.log 2>&1
   else
     timeout 200 $RP --preset llama3.1-8b --pos 0 --tiling ";down_res=0" > $OUT/p1024-llama3.1-8b-0-acc.log 2>&1
     timeout 250 python3 -m bench.probes.rows_profile --R 1024 --prefill --preset llama3.1-8b --pos 0 \
         --tiling ";qkv_rows=128;o_rows=128;" > $OUT/p1024-llama3.1-8b-0-v180.log 2>&1
   fi ;;
22) timeout 130 python3 -m bench.probes.rows_profile --R 32 --B 32 --pos 1024 --tiling ";stages=8;stages=5;stages=5" \
       > $OUT/r32-llama3.2-1b-1024-inv.log 2>&1
   timeout 90 python3 -m bench.probes.rows_profile --R 16 --B 16 --pos 1024 --tiling ";stages=5" > $OUT/r16-llama3.2-1b-1024-inv.log 2>&1
   timeout 110 python3 -m bench rows --preset llama3.2-1b --B 1 --skip ttft,accuracy --out $OUT > $OUT/rows-inv-1b.log 2>&1
   timeout 220 $RP --preset llama3.1-8b --pos 0 --tiling ";o_rows=128" > $OUT/p1024-llama3.1-8b-0-v180acc.log 2>&1 ;;
23) for P in llama3.2-1b llama3.1-8b; do timeout 150 python3 -m bench.probes.bucket_probe --preset $P > $OUT/bucket-$P.log 2>&1; done ;;
esac
for f in $OUT/*.log; do echo "== $f"; grep -v "^  +\|^{\|Warn\|_warn" $f | cut -c1-260 | tail -n 14; done
