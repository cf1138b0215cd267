#!/usr/bin/env bash
# Session 50's lease (bench/notes/s50.md): each PART one call of < 10 minutes; OUT collects every log.
# `.pre186/` (carried, ignored: `git archive 48063fd`) is the tree before v186, so the fp32-sum decode kernels run
# beside v186's in the same call.
# PART=0 (any card, a short lease): PART=1's first half.
# PART=1 (any card): the toolchain; bucket_probe on the 1B with v186 and without (48063fd); the 1B's 16- / 32-row
#         decode steps at pos 1024, v186 and 48063fd alternated (v186's cost, predicted +-0.5%).
# PART=2 (any card): v185's tile probe (1B, 8B); the 8B's bucket probe with v186.
# Then s49a.sh's PART=5 (v185 in the kernel, where PART=2 says go), PART=2 / PART=3 / PART=4 (an H200).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-${PART:-1}.log 2>&1
pre() { (cd .pre186 && PYTHONPATH=$PWD "$@"); }
# made here, not on the device (no git there): echo /.pre186/ >> .git/info/exclude; mkdir .pre186 &&
# git archive 48063fd | tar -x -C .pre186 && rm -rf .pre186/bench/results .pre186/bench/notes; run with carry [".pre186"]
if [ "${PART:-1}" -le 1 ] && [ ! -f .pre186/bench/probes/bucket_probe.py ]; then
  echo "s50a PART=${PART:-1}: no .pre186/ (the tree before v186) here: make it and carry it (see this script's head)"; exit 2
fi
case "${PART:-1}" in
0) # PART=1's first half for a short lease: the toolchain, then the bucket probe with and without v186
   python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" > $OUT/env.log 2>&1
   nvidia-smi --query-gpu=driver_version --format=csv,noheader >> $OUT/env.log 2>&1
   timeout 130 python3 -m bench.probes.bucket_probe > $OUT/bucket-llama3.2-1b-v186.log 2>&1
   pre timeout 130 python3 -m bench.probes.bucket_probe > $OUT/bucket-llama3.2-1b-48063fd.log 2>&1 ;;
1) { python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
     nvidia-smi --query-gpu=driver_version --format=csv,noheader; echo "TRITON_PTXAS_PATH=${TRITON_PTXAS_PATH:-}"
     python3 -c "from bench.ptx_diff import triton_tool; import subprocess; print(subprocess.run([str(triton_tool('ptxas')), '--version'], capture_output=True, text=True).stdout)"
   } > $OUT/env.log 2>&1
   timeout 150 python3 -m bench.probes.bucket_probe > $OUT/bucket-llama3.2-1b-v186.log 2>&1
   pre timeout 150 python3 -m bench.probes.bucket_probe > $OUT/bucket-llama3.2-1b-48063fd.log 2>&1
   for R in 32 16; do
     timeout 80 python3 -m bench.probes.rows_profile --R $R --B $R --pos 1024 --accuracy --tiling ";" > $OUT/r$R-1b-1024-v186-a.log 2>&1
     pre timeout 60 python3 -m bench.probes.rows_profile --R $R --B $R --pos 1024 --tiling ";" > $OUT/r$R-1b-1024-48063fd-a.log 2>&1
     timeout 30 python3 -m bench.probes.rows_profile --R $R --B $R --pos 1024 --tiling ";" > $OUT/r$R-1b-1024-v186-b.log 2>&1
     pre timeout 30 python3 -m bench.probes.rows_profile --R $R --B $R --pos 1024 --tiling ";" > $OUT/r$R-1b-1024-48063fd-b.log 2>&1
   done ;;
2) for P in llama3.2-1b llama3.1-8b; do timeout 100 python3 -m bench.probes.gemm_tiles --preset $P > $OUT/tiles-$P.log 2>&1; done
   timeout 240 python3 -m bench.probes.bucket_probe --preset llama3.1-8b > $OUT/bucket-llama3.1-8b-v186.log 2>&1 ;;
esac
for f in $OUT/*.log; do echo "== $f"; grep -v "^  +\|^{\|Warn\|_warn\|  layer" $f | cut -c1-260 | tail -n 14; done

# one file back (the device returns at most 8 files a call): every log in logs-PART.tgz
(cd $OUT && tar czf logs-${PART:-1}.tgz *.log && rm -f *.log)
