#!/usr/bin/env bash
# Session 44's lease (bench/notes/s44.md): each PART one call of < 10 minutes; OUT collects every log.
# PART=1 (an H200 first): v169 (s43b PART=3: the decode buckets' attention in key groups, B=16 pos 1024), then
#         where a prompt's prefill time goes (bench.probes.prefill_timeline: the GPU kernels of one prefill
#         call against the events around it; run 302 had 8.92 ms for 1024 tokens where the last 512-row chunk
#         of a 4096 prompt profiled at 3.83 ms) and the first and last 512-row chunks' kernels alone (rows_profile --pos 0 / 3584), with the
#         rows' tokens all 7 (every probe until now) and distinct.
# PART=2: the H200 decode sweep of the committed code (s43a PART=1).
# PART=3: v167 / v170 against the default, v166's TTFT (s43b PART=1).
# PART=4: v164 again, v168 (s43b PART=2's), v171 (the 1B's R512 O projection in tiles of 32 rows: 128, not 64).
# PART=5: v169 on the 8B (B=16) and the 1B at B=1 (if PART=1's 1B says it is worth it).
# (v169, v167 and v170 left the code after runs 304-305: PART=1's first line and PART=3 / 5 need c1828a5's tree.)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
case "${PART:-1}" in
1) timeout 120 python3 -m bench.probes.rows_profile --R 16 --B 16 --pos 1024 --tiling ";attn_kg=4;attn_kg=2;;attn_kg=4;attn_kg=2" > $OUT/r16-1b-v169.log 2>&1
   timeout 150 python3 -m bench.probes.prefill_timeline --prompts 1024,4096 > $OUT/timeline-1b.log 2>&1
   for t in same distinct; do for p in 0 3584; do
     timeout 60 python3 -m bench.probes.rows_profile --R 512 --prefill --pos $p --tokens $t > $OUT/p512-1b-pos$p-$t.log 2>&1
   done; done ;;
5) timeout 180 python3 -m bench.probes.rows_profile --preset llama3.1-8b --R 16 --B 16 --pos 1024 --tiling ";attn_kg=2;attn_kg=4;;attn_kg=2;attn_kg=4" > $OUT/r16-8b-v169.log 2>&1
   timeout 90 python3 -m bench.probes.rows_profile --R 16 --B 1 --pos 1024 --tiling ";attn_kg=4;;attn_kg=4" > $OUT/r16-1b-b1-v169.log 2>&1 ;;
2) PART=1 bash bench/leases/s43a.sh > /dev/null 2>&1 ;;
3) PART=1 bash bench/leases/s43b.sh > /dev/null 2>&1 ;;
4) timeout 200 python3 -m bench.probes.rows_profile --preset llama3.1-8b --R 512 --prefill --pos 3584 --tiling ";qkv_rows=128;down_k=4096;down_k=7168;;qkv_rows=128;down_k=4096;down_k=7168" > $OUT/p512-8b-v164-v168.log 2>&1
   timeout 150 python3 -m bench.probes.rows_profile --R 512 --prefill --pos 3584 --tiling ";down_k=4096;o_rows=32;down_k=8192;;down_k=4096;o_rows=32" > $OUT/p512-1b-v168-v171.log 2>&1 ;;
esac
for f in $OUT/*.log; do echo "== $f"; grep -v "^  layer [1-9]\|^row [1-7] \|^{\|^  +" $f | cut -c1-250 | tail -n 20; done
