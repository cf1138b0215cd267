#!/usr/bin/env bash
# Session 51's lease (bench/notes/s51.md): each PART one call of < 10 minutes; the logs come back as one tarball.
# PART=1 (an H200: issue 50's ratios are the H200's): the decode B sweep with invariance, 1B then 8B, with v186
#         (the decode buckets' fp64 sums); then the one-row 1B decoder at pos 128 (issue 53's 760 us target).
# PART=2 (an H200): TTFT beside transformers, 1B then 8B (README's table; the 8B with v180, both with v176 + v178).
# PART=3 (any card): v185 on the 8B's 1024-row chunk, and with qkv_rows=128 (predictions: s51.md; run 325 killed it
#         and Tiling.n_tile left the code: this PART needs 187b8f5's tree).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-${PART:-1}.log 2>&1
case "${PART:-1}" in
1) timeout 170 python3 -m bench rows --preset llama3.2-1b --skip ttft,accuracy --out $OUT > $OUT/rows-decode-1b.log 2>&1
   timeout 200 python3 -m bench rows --preset llama3.1-8b --skip ttft,accuracy --out $OUT > $OUT/rows-decode-8b.log 2>&1
   timeout 150 python3 -m bench decoder --preset llama3.2-1b --pos 128 --no-compile > $OUT/dec-1b-128.log 2>&1 ;;
2) timeout 250 python3 -m bench.rows_bench --preset llama3.2-1b --skip decode,invariance --out $OUT > $OUT/ttft-1b.log 2>&1
   timeout 300 python3 -m bench.rows_bench --preset llama3.1-8b --skip decode,invariance --out $OUT > $OUT/ttft-8b.log 2>&1 ;;
3) timeout 480 python3 -m bench.probes.rows_profile --R 1024 --prefill --accuracy --preset llama3.1-8b --pos 0 \
       --tiling ";n_tile=128,gu_rows=128,down_rows=128,red_rows=128;n_tile=128,gu_rows=128,down_rows=128,red_rows=128,qkv_rows=128;" \
       > $OUT/p1024-8b-v185.log 2>&1 ;;
esac
for f in $OUT/*.log; do echo "== $f"; grep -v "^  +\|^{\|Warn\|_warn\|  layer" $f | cut -c1-300 | tail -n 16; done
(cd $OUT && tar czf logs-${PART:-1}.tgz *.log && rm -f *.log)
