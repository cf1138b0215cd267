"""``Tiling.attn_whole``: below that position ATTN_REDUCE is the whole attention of its head (every key
``[0, pos]``, the partials' key loop) and the partials store nothing; at or above it the splits and
their merge run as without it. The tape is the same at every position.

Through the tape VM (fp32) and the real kernel under the Triton interpreter: the whole-sequence
attention is the split one up to the order of its sums; at ``pos >= attn_whole`` the kernel is
bitwise the default's; below it no partial is stored (their scratch keeps what was there); the
verifier names a merge that reads the key at ``pos`` without waiting (even transitively) for it.
"""
from __future__ import annotations

import pytest
import torch

from conftest import bits, caches_equal, clone_cache, decode_tokens, decoder_weights, rand_x, require_interpreter
from interp import build_layer, layer_step, teardown
from opcodes import ModelConfig, Tiling
from opcodes.attn_partial import AttnPartial
from opcodes.attn_reduce import AttnReduce
from opcodes.reference import make_kv_cache, make_weights, rel_err
from schedule import compile_model
from schedule.program import lower, make_layout
from schedule.verify import TapeError
from schedule.vm import run_tape

require_interpreter()

CFG = ModelConfig.from_name("small-2layer")        # 2 KV heads, 16 splits
DEC = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="tiny-decoder")


def _same_cache_rows(a, b, pos):
    """Layer 0's K/V rows are written before any attention: bitwise; a later layer's new row comes from
    the layer below's output, within its rounding; the rows before pos untouched."""
    for l in range(CFG.layers):
        for j in (0, 1):
            if l == 0:
                assert torch.equal(bits(a[l][j]), bits(b[l][j]))
            else:
                assert torch.equal(bits(a[l][j][:, :, :pos]), bits(b[l][j][:, :, :pos]))
                assert rel_err(b[l][j][:, :, pos], a[l][j][:, :, pos]) <= 1e-2


def test_attn_whole_is_checked():
    assert Tiling().attn_whole == 0
    assert Tiling(attn_whole=256).attn_whole == 256
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="attn_whole"):
            Tiling(attn_whole=bad)


def test_same_tape_and_merges_read_the_new_key():
    """The instructions and counters do not change; the merges declare the key at pos (q, new K/V)."""
    a = compile_model(CFG, 5, max_seq=64, tiling=Tiling.for_config(CFG), pool_us=0)
    b = compile_model(CFG, 5, max_seq=64, tiling=Tiling.for_config(CFG, attn_whole=32), pool_us=0)
    assert torch.equal(a.tape.words, b.tape.words) and a.tape.counters == b.tape.counters
    lay = make_layout(CFG, 64, Tiling.for_config(CFG, attn_whole=32))
    names = {r.buf for r in AttnReduce(1, 3).reads(lay)}
    assert {"q", "kv_new_k", "kv_new_v", "part_o", "part_ml"} <= names


@pytest.mark.parametrize("pos", [0, 1, 37])
def test_vm_whole_within_fp32_reordering_of_the_splits(pos):
    w = make_weights(CFG, seed=3)
    x = rand_x(CFG.d, 4)
    outs = []
    for t in (Tiling.for_config(CFG), Tiling.for_config(CFG, attn_whole=64)):
        kv = make_kv_cache(CFG, 64, pos)
        c = compile_model(CFG, 5, max_seq=64, tiling=t, pool_us=0)
        outs.append((run_tape(c.tape, w, kv, x, pos, seed=1), kv))
    assert rel_err(outs[1][0], outs[0][0]) <= 1e-5
    _same_cache_rows(outs[0][1], outs[1][1], pos)


@pytest.mark.parametrize("pos", [0, 21])
def test_kernel_whole_below_the_threshold(pos):
    """Below attn_whole: within the bf16 dots' rounding of the split kernel and of the VM; the cache
    bitwise the default's; no partial stored."""
    w = make_weights(CFG, seed=5)
    x = rand_x(CFG.d, 6)
    kv0 = make_kv_cache(CFG, 64, pos)
    outs = []
    for over in ({}, {"attn_whole": 32}):
        kv = clone_cache(kv0)
        h = build_layer(w, kv, CFG.to_dict(), 64, tiling=Tiling.for_config(CFG, **over))
        for name in ("part_o", "part_ml"):
            h.scratch[name].fill_(float("nan"))
        outs.append((layer_step(h, x, pos).clone(), kv))
        stored = [bool(torch.isfinite(h.scratch[n]).any()) for n in ("part_o", "part_ml")]
        assert stored == ([False, False] if over else [True, True]), over
        teardown(h)
    ref = run_tape(compile_model(CFG, 5, max_seq=64, tiling=Tiling.for_config(CFG, attn_whole=32), pool_us=0).tape,
                   w, clone_cache(kv0), x, pos)
    assert torch.isfinite(outs[1][0]).all()
    assert rel_err(outs[1][0], outs[0][0]) <= 4e-3        # the output is bf16: one ulp is 3.9e-3
    assert rel_err(outs[1][0], ref) <= 1e-2
    _same_cache_rows(outs[0][1], outs[1][1], pos)


def test_kernel_splits_at_and_above_the_threshold_bitwise():
    w = make_weights(CFG, seed=7)
    x = rand_x(CFG.d, 8)
    for pos in (20, 33):
        outs = []
        for over in ({}, {"attn_whole": 20}):
            kv = make_kv_cache(CFG, 64, pos)
            h = build_layer(w, kv, CFG.to_dict(), 64, tiling=Tiling.for_config(CFG, **over))
            outs.append((layer_step(h, x, pos).clone(), kv))
            teardown(h)
        assert torch.equal(bits(outs[0][0]), bits(outs[1][0])), pos
        assert caches_equal(outs[0][1], outs[1][1])


def test_decoder_across_the_threshold_and_with_key_in_reduce():
    """A decoder whose steps cross attn_whole (positions 0, 1, 2 with attn_whole=2), with and without
    the key at pos in the merge: the logits within the dots' rounding of the split decoder, the same
    greedy tokens. (Pos 2 splits, but over cache rows the whole attention's steps wrote.)"""
    w = decoder_weights(DEC, 0)
    for kir in (0, 1):
        over = dict(attn_splits=4, gu_rows=32, key_in_reduce=kir)
        base = decode_tokens(w, DEC, Tiling.for_config(DEC, **over), max_seq=16)
        whole = decode_tokens(w, DEC, Tiling.for_config(DEC, attn_whole=2, **over), max_seq=16)
        torch.testing.assert_close(whole[0], base[0], rtol=2e-2, atol=2e-2)
        assert whole[1] == base[1]


def test_verifier_names_a_whole_merge_that_does_not_wait_for_the_new_key():
    """The merges' only path to the K/V tiles is the last split's wait: take the last split's K/V wait
    away and the merge's read of the key at pos is uncovered, and named."""
    lay = make_layout(CFG, 64, Tiling.for_config(CFG, attn_whole=32))
    prog = lower(lay)
    last = [i for i, ins in enumerate(prog.instrs)
            if isinstance(ins, AttnPartial) and ins.s == lay.tiling.attn_splits - 1]
    for i in last:
        prog.waits[i] = tuple(c for c in prog.waits[i] if not prog.counters[c].startswith("kv["))
    with pytest.raises(TapeError, match="kv_new_k"):
        compile_model(CFG, 4, max_seq=64, tiling=lay.tiling, lowering=lambda _: prog, pool_us=0)
