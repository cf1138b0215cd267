#!/usr/bin/env bash
# Session 37's second lease call: the restructured tree (issue 52: interp.common, opcodes.tiling, one
# verifier, megatape.measure, python -m bench) on the GPU: the GPU tests, `megatape run`'s GPU path, the
# 1B decoder through the lab's new command line, and issue 50's baseline (transformers' prefill).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi.log 2>&1
timeout 330 python3 -m pytest -q -m gpu tests -p no:cacheprovider > $OUT/gputests.log 2>&1
timeout 200 python3 -m megatape.cli run > $OUT/run.log 2>&1
timeout 120 python3 -m bench decoder --no-compile --pos 128 --variants "default;default" --out $OUT/dec > $OUT/dec.log 2>&1
timeout 150 python3 -m bench.ttft_baseline --out $OUT > $OUT/ttft.log 2>&1
find $OUT -mindepth 2 -delete 2>/dev/null; find $OUT -mindepth 1 -type d -delete 2>/dev/null
for f in $OUT/*.log; do echo "== $f"; tail -n 16 $f; done
