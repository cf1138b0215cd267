#!/usr/bin/env bash
# Session 52's lease (bench/notes/s52.md): each PART one call of < 10 minutes; logs back as one tarball.
# PART=1: bench/leases/s51b.sh PART=1 (v188 against f724689 on the 8B's 1024-row chunk; needs `.pre188/` carried).
# PART=4 (any card): the first half of PART=3 (~300 s).
# PART=3 (any card): PART=2's and PART=1's 8B chunk in one call (below).
# PART=2 (any card): where the 1B's 1024-token TTFT goes past its chunk (bench.probes.ttft_probe); v191 (down and
#         residual tiles of 128 rows at 1024 rows) on the 8B's chunk at pos 0 between two default runs in one
#         process, accuracy on each (the 1B's: s47.md, +4.1% with down_res); the 8B's TTFT probe.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
case "${PART:-1}" in
1) exec bash bench/leases/s51b.sh ;;
2) nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-2.log 2>&1
   timeout 90 python3 -m bench.probes.ttft_probe > $OUT/ttft-probe-1b.log 2>&1
   V=";down_rows=128,red_rows=128;"
   timeout 260 python3 -m bench.probes.rows_profile --R 1024 --prefill --preset llama3.1-8b --pos 0 \
     --tiling "$V" --accuracy > $OUT/p1024-8b-v191.log 2>&1
   timeout 120 python3 -m bench.probes.ttft_probe --preset llama3.1-8b --batch 4 > $OUT/ttft-probe-8b.log 2>&1
   for f in $OUT/*.log; do echo "== $f"; grep -v "^  +\|^{\|Warn\|_warn\|  layer" $f | cut -c1-300 | tail -n 16; done
   (cd $OUT && tar czf logs-2.tgz *.log && rm -f *.log) ;;
3) # all of it in one call (device time is short): the 1B's TTFT probe; the 8B's chunk, this tree's default (v188)
   # around v191 in one process; f724689's default (before v188); the 8B's TTFT probe
   nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-3.log 2>&1
   pre() { (cd .pre188 && PYTHONPATH=$PWD "$@"); }
   timeout 80 python3 -m bench.probes.ttft_probe > $OUT/ttft-probe-1b.log 2>&1
   P8="--R 1024 --prefill --preset llama3.1-8b --pos 0"
   timeout 230 python3 -m bench.probes.rows_profile $P8 --tiling ";down_rows=128,red_rows=128;" --accuracy \
     > $OUT/p1024-8b-v188-v191.log 2>&1
   [ -f .pre188/schedule/assign.py ] && pre timeout 90 python3 -m bench.probes.rows_profile $P8 \
     > $OUT/p1024-8b-f724689.log 2>&1
   timeout 110 python3 -m bench.probes.ttft_probe --preset llama3.1-8b --batch 4 > $OUT/ttft-probe-8b.log 2>&1
   for f in $OUT/*.log; do echo "== $f"; grep -v "^  +\|^{\|Warn\|_warn\|  layer" $f | cut -c1-300 | tail -n 16; done
   (cd $OUT && tar czf logs-3.tgz *.log && rm -f *.log) ;;
4) # PART=3 cut to what ~300 s of device time holds: the 1B's TTFT probe, then v191 beside this tree's default
   nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-4.log 2>&1
   timeout 70 python3 -m bench.probes.ttft_probe --reps 8 > $OUT/ttft-probe-1b.log 2>&1
   timeout 200 python3 -m bench.probes.rows_profile --R 1024 --prefill --preset llama3.1-8b --pos 0 \
     --tiling ";down_rows=128,red_rows=128" --accuracy > $OUT/p1024-8b-v188-v191.log 2>&1
   for f in $OUT/*.log; do echo "== $f"; grep -v "^  +\|^{\|Warn\|_warn\|  layer" $f | cut -c1-300 | tail -n 16; done ;;
esac
