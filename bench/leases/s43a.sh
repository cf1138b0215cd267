#!/usr/bin/env bash
# The next lease (bench/notes/s43.md), on an H200 if one comes; each PART one call of < 10 minutes.
# PART=1: the decode buckets as committed (v158 reverted there) in the rows bench's B sweep on both shapes: the
#         H200 numbers issue 50 asks for (runs 286-287 measured the same decode code; run 292 was v158's).
# PART=2: issue 53 (3), the Gluon ring probe with the decoder's tiles (--plan decoder: gate/up ragged on all
#         132 SMs), the attention's gap, and the loader alone without polls or vector (ws_loader), against
#         the chain plan of runs 122-125 / 186; go if ws <= 38 us a layer, kill if it beats per_tile by < 3 us;
#         then the 1B one-row decoder profiled at pos 128 (its records bound issue 53 (2)'s gain).
# PART=3: v163 (a prefill attention tile's blocks under its rows unmasked) against the tree before it (old_h/:
#         `git archive` of the commit before, untracked), the last 512-row chunk of a 4096 prompt, 1B and 8B;
#         and a 1024-row chunk against the 512-row one, per token (1B).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-${PART:-1}.log 2>&1
if [ "${PART:-1}" = 1 ]; then
    timeout ${T0:-150} python3 -m bench.rows_bench --preset llama3.2-1b --skip ttft,accuracy,invariance --out $OUT > $OUT/dec-1b.log 2>&1
    timeout ${T1:-200} python3 -m bench.rows_bench --preset llama3.1-8b --skip ttft,accuracy,invariance --out $OUT > $OUT/dec-8b.log 2>&1
elif [ "${PART:-1}" = 2 ]; then
    timeout ${T4:-250} python3 -m bench.probes.gluon_chain_probe 5 --plan decoder --gap-us 6 --halves > $OUT/ring-decoder.log 2>&1
    timeout ${T5:-200} python3 -m bench.probes.gluon_chain_probe 5 --gap-us 6 --halves > $OUT/ring-chain.log 2>&1
    # issue 53 (2)'s bound: every instruction's record of the 1B one-row decoder at pos 128 (records-*.json.gz)
    timeout ${T6:-120} python3 -m bench decoder --preset llama3.2-1b --pos 128 --profile --out $OUT > $OUT/prof-1b.log 2>&1
else
    (cd old_h && PYTHONPATH=$PWD timeout ${T7:-100} python3 -m bench.probes.rows_profile --R 512 --prefill --pos 3584) > $OUT/p512-1b-old.log 2>&1
    timeout ${T8:-100} python3 -m bench.probes.rows_profile --R 512 --prefill --pos 3584 > $OUT/p512-1b-new.log 2>&1
    timeout ${T9:-120} python3 -m bench.probes.rows_profile --R 1024 --prefill --pos 3072 > $OUT/p1024-1b-new.log 2>&1
    (cd old_h && PYTHONPATH=$PWD timeout ${T10:-100} python3 -m bench.probes.rows_profile --preset llama3.1-8b --R 512 --prefill --pos 3584) > $OUT/p512-8b-old.log 2>&1
    timeout ${T11:-100} python3 -m bench.probes.rows_profile --preset llama3.1-8b --R 512 --prefill --pos 3584 > $OUT/p512-8b-new.log 2>&1
fi
for f in $OUT/*.log; do echo "== $f"; grep -v "^  layer [1-9]\|^row [1-7] \|^{" $f | cut -c1-250 | tail -n 24; done
