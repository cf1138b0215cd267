#!/usr/bin/env bash
# Session 37's first lease call: v142 (Tiling.l2_first) and the probes of session 36, as NOTES
# "The next lease's first call" lists them; every step bounded in time.
# (run 269 ran this; Tiling.l2_first was removed after it, so its l2_first=1 steps now stop with an unknown-field error)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi.log 2>&1
timeout 150 python3 -m bench decoder --no-compile --pos 128 \
    --variants "default;l2_first=1;default;l2_first=1" --out $OUT/v142 > $OUT/v142.log 2>&1
timeout 60 python3 -m bench.probes.attn_probe --cold --flush > $OUT/coldflush.log 2>&1
timeout 60 python3 -m bench.probes.icache_probe --stream 1024 2048 > $OUT/icstream.log 2>&1
timeout 80 python3 -m bench decoder --no-compile --pos 128 --tiling l2_first=1 --profile \
    --variants default --out $OUT/v142p > $OUT/v142p.log 2>&1
timeout 100 python3 -m bench decoder --no-compile --pos 1024 --max-seq 2048 \
    --variants "default;l2_first=1;default;l2_first=1" --out $OUT/v142k > $OUT/v142k.log 2>&1
timeout 60 python3 -m bench layer --baselines cublas --variants "l2_first=1" --out $OUT/v142l > $OUT/v142l.log 2>&1
timeout 90 python3 -m bench.probes.attn_probe --fresh > $OUT/fresh.log 2>&1
find $OUT \( -name '*.json' -o -name '*.gz' -o -name '*.html' -o -name '*.png' \) -delete
tar czf $OUT/all.tgz -C $OUT --exclude all.tgz . 2>/dev/null
for f in $OUT/*.log; do echo "== $f"; tail -n 14 $f; done
