"""The key at ``pos`` attended by ATTN_REDUCE (``Tiling.key_in_reduce``): no one-key attention split,
the merge scores the K/V tiles' new row itself and waits on them directly. The tape VM computes
bitwise what the default tiling computes (the merge sees the same values in the same order); the
real kernel (Triton interpreter) sums in another order and stays within rounding of both."""
from __future__ import annotations


import pytest
import torch

from conftest import bits, clone_cache, rand_x, require_interpreter
from interp import build_layer, layer_step, teardown
from opcodes import ModelConfig, Tiling
from opcodes.attn_reduce import AttnReduce
from opcodes.reference import make_kv_cache, make_weights, rel_err
from opcodes.tp import TPLayout
from schedule import compile_model
from schedule.program import lower, make_layout
from schedule.tape import decode
from schedule.verify import TapeError
from schedule.vm import run_tape, run_tp

require_interpreter()

CFG = ModelConfig.from_name("small-2layer")        # 2 KV heads, 16 splits


def _n(tape, name) -> int:
    return sum(d.ins.NAME == name for d in decode(tape))


@pytest.mark.parametrize("pos", [0, 1, 37])
def test_no_last_split_and_bitwise_in_the_vm(pos):
    w = make_weights(CFG, seed=3)
    x = rand_x(CFG.d, 4)
    outs, counts = [], []
    for t in (Tiling.for_config(CFG), Tiling.for_config(CFG, key_in_reduce=1)):
        c = compile_model(CFG, 5, max_seq=64, tiling=t, pool_us=0)
        counts.append(_n(c.tape, "attn_partial"))
        for s in (0, 2):
            kv = make_kv_cache(CFG, 64, pos)
            outs.append((run_tape(c.tape, w, kv, x, pos, seed=s), kv))
    assert counts == [CFG.layers * CFG.n_kv * 16, CFG.layers * CFG.n_kv * 15]
    for o, kv in outs[1:]:
        assert torch.equal(bits(o), bits(outs[0][0]))
        assert all(torch.equal(a, b) for p, q in zip(kv, outs[0][1]) for a, b in zip(p, q))


@pytest.mark.parametrize("pos", [0, 21])
def test_kernel_within_rounding_of_the_default(pos):
    w = make_weights(CFG, seed=5)
    x = rand_x(CFG.d, 6)
    kv0 = make_kv_cache(CFG, 64, pos)
    outs = []
    for over in ({}, {"key_in_reduce": 1}):
        kv = clone_cache(kv0)
        h = build_layer(w, kv, CFG.to_dict(), 64, tiling=Tiling.for_config(CFG, **over))
        outs.append((layer_step(h, x, pos).clone(), kv))
        teardown(h)
    kv_ref = clone_cache(kv0)
    t = Tiling.for_config(CFG, key_in_reduce=1)
    ref = run_tape(compile_model(CFG, 5, max_seq=64, tiling=t, pool_us=0).tape, w, kv_ref, x, pos)
    assert rel_err(outs[1][0], outs[0][0]) <= 2e-3
    assert rel_err(outs[1][0], ref) <= 1e-2
    for l in range(CFG.layers):      # the K/V tiles are untouched: their rows are bitwise the default's
        for j in (0, 1):
            assert torch.equal(bits(outs[1][1][l][j]), bits(outs[0][1][l][j]))


def test_tensor_parallel_ranks_bitwise():
    w = make_weights(CFG, seed=7)
    x = rand_x(CFG.d, 8)
    sc = TPLayout.of(CFG, 0, 2).cfg
    outs = []
    for t in (TPLayout.default_tiling(sc), TPLayout.default_tiling(sc, key_in_reduce=1)):
        c = compile_model(CFG, 3, max_seq=64, tiling=t, tp=2, decoder=False)
        kv = make_kv_cache(CFG, 64, 30)
        outs.append(run_tp(c.tapes, w, kv, x, 30, seed=1, calls=2, return_all=True))
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a[0], b[0]) and torch.equal(b[0], b[1])


def test_verifier_names_a_merge_without_the_kv_wait():
    lay = make_layout(CFG, 64, Tiling.for_config(CFG, key_in_reduce=1))
    prog = lower(lay)
    i = next(i for i, ins in enumerate(prog.instrs) if isinstance(ins, AttnReduce))
    kv = [c for c in prog.waits[i] if prog.counters[c].startswith("kv[")]
    assert len(kv) == 1
    prog.waits[i] = tuple(c for c in prog.waits[i] if c not in kv)
    with pytest.raises(TapeError, match="kv_new_k"):
        compile_model(CFG, 4, max_seq=64, tiling=lay.tiling, lowering=lambda _: prog, pool_us=0)


def test_bad_key_in_reduce_is_named():
    with pytest.raises(ValueError, match="key_in_reduce must be 0 or 1"):
        Tiling(key_in_reduce=2)
