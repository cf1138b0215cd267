#!/usr/bin/env bash
# The next lease (bench/notes/s43.md), on an H200 if one comes; each PART one call of < 10 minutes.
# PART=1: the decode buckets as committed (v158 reverted there) in the rows bench's B sweep on both shapes: the
#         H200 numbers issue 50 asks for (runs 286-287 measured the same decode code; run 292 was v158's);
#         the 16-row step profiled at pos 128 and 2048 (its attention's fixed and per-key cost).
# PART=2: issue 53 (3), the Gluon ring probe with the decoder's tiles (--plan decoder: gate/up ragged on all
#         132 SMs), the attention's gap, and the loader alone without polls or vector (ws_loader), against
#         the chain plan of runs 122-125 / 186; go if ws <= 38 us a layer, kill if it beats per_tile by < 3 us;
#         then the 1B one-row decoder profiled at pos 128 (its records bound issue 53 (2)'s gain).
# PART=3 / 4 (1B / 8B): the last 512-row chunk of a 4096 prompt in three trees side by side: old_a/ (1ee7ed9,
#         before v163), old_b/ (ad0e0e8: v163, a prefill attention tile's blocks under its rows unmasked) and
#         this tree (v165: QKV's two RoPE halves one dot of M 64, wgmma); old_a / old_b are `git archive`s,
#         untracked. PART=3 also: a 1024-row chunk against the 512-row one, per token (1B); PART=4 also: the
#         8B's QKV tiles of 128 rows (v164: M 128).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi-${PART:-1}.log 2>&1
if [ "${PART:-1}" = 1 ]; then
    timeout ${T0:-150} python3 -m bench.rows_bench --preset llama3.2-1b --skip ttft,accuracy,invariance --out $OUT > $OUT/dec-1b.log 2>&1
    timeout ${T1:-200} python3 -m bench.rows_bench --preset llama3.1-8b --skip ttft,accuracy,invariance --out $OUT > $OUT/dec-8b.log 2>&1
    # the 16-row step's attention at two positions: its fixed cost a (row, KV head) and its cost a key
    for p in 128 2048; do timeout 60 python3 -m bench.probes.rows_profile --R 16 --B 16 --pos $p > $OUT/r16-pos$p.log 2>&1; done
elif [ "${PART:-1}" = 2 ]; then
    timeout ${T4:-250} python3 -m bench.probes.gluon_chain_probe 5 --plan decoder --gap-us 6 --halves > $OUT/ring-decoder.log 2>&1
    timeout ${T5:-200} python3 -m bench.probes.gluon_chain_probe 5 --gap-us 6 --halves > $OUT/ring-chain.log 2>&1
    # issue 53 (2)'s bound: every instruction's record of the 1B one-row decoder at pos 128 (records-*.json.gz)
    timeout ${T6:-120} python3 -m bench decoder --preset llama3.2-1b --pos 128 --profile --out $OUT > $OUT/prof-1b.log 2>&1
else
    P=llama3.2-1b; [ "$PART" = 4 ] && P=llama3.1-8b
    for t in old_a old_b; do
        (cd $t && PYTHONPATH=$PWD timeout ${T7:-110} python3 -m bench.probes.rows_profile --preset $P --R 512 --prefill --pos 3584) > $OUT/p512-$P-$t.log 2>&1
    done
    if [ "$PART" = 3 ]; then
        timeout ${T8:-100} python3 -m bench.probes.rows_profile --preset $P --R 512 --prefill --pos 3584 > $OUT/p512-$P-new.log 2>&1
        timeout ${T9:-130} python3 -m bench.probes.rows_profile --R 1024 --prefill --pos 3072 > $OUT/p1024-1b-new.log 2>&1
    else
        timeout ${T11:-150} python3 -m bench.probes.rows_profile --preset $P --R 512 --prefill --pos 3584 --tiling ";qkv_rows=128" > $OUT/p512-$P-new.log 2>&1
    fi
fi
for f in $OUT/*.log; do echo "== $f"; grep -v "^  layer [1-9]\|^row [1-7] \|^{" $f | cut -c1-250 | tail -n 24; done
