#!/usr/bin/env bash
# Session 49's lease for the next session (bench/notes/s49.md "Next"): each PART one call of < 10 minutes; OUT collects
# every log. PART=1 first on any card; PART=2 / PART=3 want an H200 (issue 50's table and ratios are the H200's).
# PART=1: bench/probes/bucket_probe.py (where row 0's bits part between the 16- and 32-row buckets, 1B then 8B),
#         bench/probes/gemm_tiles.py (v185: DOWN tiles of 128 x 128 / 128 x 256 against 64 x 256, both models), and
#         v186's decode steps (fp64 feature sums) beside run 318's.
# PART=2: the decode B sweep with invariance, 1B and 8B (v182 on an H200: B=16 >= 12x?), then v169 on the 1B.
# PART=3: TTFT beside transformers, 1B then 8B (README's table; the 8B with v180).
# PART=5 (any card): v185 in the kernel: the 1B's then the 8B's 1024-row chunk with 128-column tiles (Tiling.n_tile),
#         128-row gate/up and down tiles, accuracy lines (run it where PART=1's tile probe says go).
# PART=4: issue 53 on an H200: the one-row 1B decoder at pos 128 (the 760 us target), default alone, 3 repeats.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-${PART:-1}.log 2>&1
case "${PART:-1}" in
1) { python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
     nvidia-smi --query-gpu=driver_version --format=csv,noheader; echo "TRITON_PTXAS_PATH=${TRITON_PTXAS_PATH:-}"
     python3 -c "from bench.ptx_diff import triton_tool; import subprocess; print(subprocess.run([str(triton_tool('ptxas')), '--version'], capture_output=True, text=True).stdout)"
   } > $OUT/env.log 2>&1     # runs 317-318's R1 != R32 with kernels unchanged since runs that had it: did the toolchain move?
   for P in llama3.2-1b llama3.1-8b; do timeout 150 python3 -m bench.probes.bucket_probe --preset $P > $OUT/bucket-$P.log 2>&1; done
   for P in llama3.2-1b llama3.1-8b; do timeout 90 python3 -m bench.probes.gemm_tiles --preset $P > $OUT/tiles-$P.log 2>&1; done
   # v186's cost: the 1B's 16- / 32-row steps at pos 1024 (run 318, H100, fp32 sums: 1436.2 / 1801.3 us)
   for R in 16 32; do timeout 70 python3 -m bench.probes.rows_profile --R $R --B $R --pos 1024 --tiling ";" \
       > $OUT/r$R-llama3.2-1b-1024-v186.log 2>&1; done ;;
2) timeout 200 python3 -m bench rows --preset llama3.2-1b --skip ttft,accuracy --out $OUT > $OUT/rows-decode-1b.log 2>&1
   timeout 240 python3 -m bench rows --preset llama3.1-8b --skip ttft,accuracy --out $OUT > $OUT/rows-decode-8b.log 2>&1
   timeout 140 python3 -m bench.probes.rows_profile --R 16 --B 16 --pos 1024 --tiling ";attn_kg=4;;attn_kg=4" \
       > $OUT/r16-llama3.2-1b-1024-v169.log 2>&1 ;;
3) timeout 250 python3 -m bench.rows_bench --preset llama3.2-1b --skip decode,invariance --out $OUT > $OUT/ttft-1b.log 2>&1
   timeout 300 python3 -m bench.rows_bench --preset llama3.1-8b --skip decode,invariance --out $OUT > $OUT/ttft-8b.log 2>&1 ;;
4) timeout 300 python3 -m bench decoder --preset llama3.2-1b --pos 128 --no-compile --variants "default;default;default" \
       > $OUT/dec-1b-128.log 2>&1 ;;
5) timeout 200 python3 -m bench.probes.rows_profile --R 1024 --prefill --accuracy --pos 0 \
       --tiling ";n_tile=128,gu_rows=128,down_rows=128,red_rows=128;n_tile=128,down_rows=128,red_rows=128;" \
       > $OUT/p1024-llama3.2-1b-0-v185.log 2>&1
   timeout 380 python3 -m bench.probes.rows_profile --R 1024 --prefill --accuracy --preset llama3.1-8b --pos 0 \
       --tiling ";n_tile=128,gu_rows=128,down_rows=128,red_rows=128;" > $OUT/p1024-llama3.1-8b-0-v185.log 2>&1 ;;
esac
for f in $OUT/*.log; do echo "== $f"; grep -v "^  +\|^{\|Warn\|_warn\|  layer" $f | cut -c1-260 | tail -n 14; done
