#!/usr/bin/env bash
# Session 47's lease (bench/notes/s47.md): s46a.sh's parts (session 46 got no machine), PART=4 with v178.
# Each PART one call of < 10 minutes; OUT collects every log.
# PART=1 (8B): v174 (the prefill buckets' LM head tiles of 128 rows, the default) against 32 rows (--lm-rows 32),
#         a prompt of 128 and of 1024 tokens in the kernel timeline; the 1B's default beside it (v174's 1B check);
#         the 1B's 1024-row chunk profiled twice (rows_profile's output check: bitwise equal, pos 0).
# PART=2: TTFT beside transformers with v174, 1B and 8B (README's table; runs 307-308 ran 32-row tiles).
#         Then v175: the decode buckets' LM head tiles of 128 rows, 1B R16 B16 alternated (s45.md's prediction).
# PART=3: the decode sweep on an H100 if the card is one (issue 50's B=16 ratio there: 12.0x in runs 283-284).
# PART=4: where a 1024-row chunk's time goes (no one has profiled the 1024-row bucket since it became the
#         prefill default): the 1B and the 8B at pos 0 per stage; v178 (down_res: no RESIDUAL_R), v176 (fewer down
#         K chunks) and v179 (down tiles of 128 rows) timed beside the default.
# PART=5: both at pos 3072 (a 4096-token prompt's last chunk), per stage.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-${PART:-1}.log 2>&1
TL="python3 -m bench.probes.prefill_timeline"
case "${PART:-1}" in
1) P="--preset llama3.1-8b"
   timeout 150 $TL $P --prompts 128,1024 > $OUT/tl-8b-lm128.log 2>&1
   timeout 150 $TL $P --prompts 128,1024 --lm-rows 32 > $OUT/tl-8b-lm32.log 2>&1
   timeout 80 $TL --prompts 128,1024 > $OUT/tl-1b-lm128.log 2>&1
   # the default twice: the profile's output check must say "bitwise equal" (a run-to-run race would not)
   timeout 100 python3 -m bench.probes.rows_profile --R 1024 --prefill --pos 0 --tiling ";" > $OUT/p1024-1b-twice.log 2>&1 ;;
2) for P in llama3.2-1b llama3.1-8b; do
     timeout 250 python3 -m bench.rows_bench --preset $P --skip decode,invariance --out $OUT > $OUT/ttft-$P.log 2>&1
   done
   timeout 120 python3 -m bench.probes.rows_profile --R 16 --B 16 --pos 1024 --tiling ";;;" --lm-rows ";128;;128" \
       > $OUT/p16-1b-v175.log 2>&1 ;;
3) for P in llama3.2-1b llama3.1-8b; do
     timeout 200 python3 -m bench.rows_bench --preset $P --skip ttft,accuracy,invariance --out $OUT > $OUT/dec-$P.log 2>&1
   done ;;
4) # pos 0 also times v178 (s47.md), v176 (s46.md: the down projection in fewer K chunks) and v179 (s47.md: down
   # tiles of 128 rows, the residual blocks with them)
   timeout 270 python3 -m bench.probes.rows_profile --R 1024 --prefill --pos 0 \
       --tiling ";down_res=1;down_k=4096;down_rows=128,red_rows=128;down_rows=128,red_rows=128,down_res=1" \
       > $OUT/p1024-llama3.2-1b-0.log 2>&1
   timeout 270 python3 -m bench.probes.rows_profile --preset llama3.1-8b --R 1024 --prefill --pos 0 \
       --tiling ";down_res=1;down_k=7168;down_rows=128,red_rows=128,down_res=1" > $OUT/p1024-llama3.1-8b-0.log 2>&1 ;;
5) timeout 150 python3 -m bench.probes.rows_profile --R 1024 --prefill --pos 3072 > $OUT/p1024-llama3.2-1b-3072.log 2>&1
   timeout 240 python3 -m bench.probes.rows_profile --preset llama3.1-8b --R 1024 --prefill --pos 3072 \
       > $OUT/p1024-llama3.1-8b-3072.log 2>&1 ;;
esac
for f in $OUT/*.log; do echo "== $f"; grep -v "^  +\|^{\|Warn\|_warn" $f | cut -c1-220 | tail -n 12
  grep -q megakernel $f && { grep megakernel $f | awk '{print $6}' | tr '\n' ' '; echo; }; done
