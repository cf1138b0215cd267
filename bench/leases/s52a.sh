#!/usr/bin/env bash
# Session 52's lease (bench/notes/s52.md): each PART one call of < 10 minutes; logs back as one tarball.
# PART=1: bench/leases/s51b.sh PART=1 (v188 against f724689 on the 8B's 1024-row chunk; needs `.pre188/` carried).
# PART=2 (any card): where the 1B's 1024-token TTFT goes past its chunk (bench.probes.ttft_probe); the 8B's 1024-row chunk at pos 0 with QKV tiles of 128 rows (one whole head) between two
#         default runs in one process, accuracy on each; then the 1B's 1024-row chunk, v188 and f724689.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
case "${PART:-1}" in
1) exec bash bench/leases/s51b.sh ;;
2) nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-2.log 2>&1
   timeout 90 python3 -m bench.probes.ttft_probe > $OUT/ttft-probe-1b.log 2>&1
   timeout 250 python3 -m bench.probes.rows_profile --R 1024 --prefill --preset llama3.1-8b --pos 0 \
     --tiling ";qkv_rows=128;" --accuracy > $OUT/p1024-8b-qkv128.log 2>&1
   pre() { (cd .pre188 && PYTHONPATH=$PWD "$@"); }
   P1="--R 1024 --prefill --preset llama3.2-1b --pos 0 --tiling ;"
   timeout 60 python3 -m bench.probes.rows_profile $P1 > $OUT/p1024-1b-v188.log 2>&1
   [ -f .pre188/schedule/assign.py ] && pre timeout 60 python3 -m bench.probes.rows_profile $P1 > $OUT/p1024-1b-f724689.log 2>&1
   for f in $OUT/*.log; do echo "== $f"; grep -v "^  +\|^{\|Warn\|_warn\|  layer" $f | cut -c1-300 | tail -n 16; done
   (cd $OUT && tar czf logs-2.tgz *.log && rm -f *.log) ;;
esac
