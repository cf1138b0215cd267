#!/usr/bin/env bash
# The next lease (bench/notes/s42.md, "Next"), on an H200 if one comes; each PART one call of < 10 minutes.
# PART=1: the decode buckets as committed (v158 reverted there) in the rows bench's B sweep on both shapes: the
#         H200 numbers issue 50 asks for (runs 286-287 measured the same decode code; run 292 was v158's);
#         then a 1024-row chunk against the 512-row one, per token, at the end of a 4096-token prompt.
# PART=2: issue 53 (3), the Gluon ring probe with the decoder's tiles (--plan decoder: gate/up ragged on all
#         132 SMs), the attention's gap, and the loader alone without polls or vector (ws_loader), against
#         the chain plan of runs 122-125 / 186; go if ws <= 38 us a layer, kill if it beats per_tile by < 3 us.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-${PART:-1}.log 2>&1
if [ "${PART:-1}" = 1 ]; then
    timeout ${T0:-120} python3 -m bench.rows_bench --preset llama3.2-1b --skip ttft,accuracy,invariance --out $OUT > $OUT/dec-1b.log 2>&1
    timeout ${T1:-150} python3 -m bench.rows_bench --preset llama3.1-8b --skip ttft,accuracy,invariance --out $OUT > $OUT/dec-8b.log 2>&1
    timeout ${T2:-90} python3 -m bench.probes.rows_profile --R 512 --prefill --pos 3584 > $OUT/p512-1b.log 2>&1
    timeout ${T3:-120} python3 -m bench.probes.rows_profile --R 1024 --prefill --pos 3072 > $OUT/p1024-1b.log 2>&1
else
    timeout ${T4:-250} python3 -m bench.probes.gluon_chain_probe 5 --plan decoder --gap-us 6 --halves > $OUT/ring-decoder.log 2>&1
    timeout ${T5:-200} python3 -m bench.probes.gluon_chain_probe 5 --gap-us 6 --halves > $OUT/ring-chain.log 2>&1
fi
for f in $OUT/*.log; do echo "== $f"; grep -v "^  layer [1-9]\|^row [1-7] \|^{" $f | cut -c1-250 | tail -n 24; done
