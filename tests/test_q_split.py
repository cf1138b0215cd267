"""Ragged Q tiles (``Tiling.q_split``): a query head in ``q_split`` tiles of ``cdiv(hd/2, q_split)``
dims of each RoPE half (the last tile fewer), rows padded to a power of two and masked. A row's dot
product does not depend on how many rows share its tile, so the tapes compute bitwise what the
default tiling computes: in the tape VM and in the real kernel (the Triton interpreter)."""
from __future__ import annotations

import pytest
import torch

from conftest import bits, clone_cache, rand_x, require_interpreter
from interp import build_layer, layer_step, teardown
from opcodes import ModelConfig, Tiling
from opcodes.base import Layout
from opcodes.reference import make_kv_cache, make_weights
from schedule import compile_model
from schedule.tape import decode
from schedule.vm import run_tape

require_interpreter()

CFG = ModelConfig.from_name("small-2layer")        # hd 32: 16 RoPE pairs a head


@pytest.mark.parametrize("q_split", [3, 6])
def test_ragged_q_tiles_bitwise_in_the_vm(q_split):
    w = make_weights(CFG, seed=2)
    x = rand_x(CFG.d, 3)
    outs, counts = [], []
    for t in (Tiling.for_config(CFG), Tiling.for_config(CFG, q_split=q_split)):
        c = compile_model(CFG, 5, max_seq=64, tiling=t, pool_us=0)
        counts.append(sum(d.ins.NAME == "qkv" and d.ins.sec == 0 for d in decode(c.tape)))
        for s in (0, 1):
            kv = make_kv_cache(CFG, 64, 30)
            outs.append((run_tape(c.tape, w, kv, x, 30, seed=s), kv))
    assert counts == [CFG.layers * CFG.n_q, CFG.layers * CFG.n_q * q_split]
    for o, kv in outs[1:]:
        assert torch.equal(bits(o), bits(outs[0][0]))
        assert all(torch.equal(a, b) for p, q in zip(kv, outs[0][1]) for a, b in zip(p, q))


def test_ragged_q_tiles_cover_each_pair_once():
    lay = Layout(CFG, Tiling.for_config(CFG, q_split=3), 64)
    assert lay.q_half == 6 and lay.n_tiles_per_head(0) == 3
    from opcodes.qkv import QKV
    spans = [QKV(0, 0, 1, j)._dims(lay) for j in range(3)]
    assert spans == [(0, 6), (6, 12), (12, 16)]
    assert [QKV(0, 0, 1, j).cost(lay).hbm_bytes for j in range(3)] == [2 * 12 * CFG.d] * 2 + [2 * 8 * CFG.d]


def test_ragged_q_tiles_bitwise_in_the_kernel():
    w = make_weights(CFG, seed=4)
    x = rand_x(CFG.d, 5)
    kv0 = make_kv_cache(CFG, 64, 20)
    outs = []
    for over in ({}, {"q_split": 3}, {"q_split": 3, "kv_rows": 8}):
        kv = clone_cache(kv0)
        h = build_layer(w, kv, CFG.to_dict(), 64, tiling=Tiling.for_config(CFG, **over))
        outs.append((layer_step(h, x, 20).clone(), [t.clone() for p in kv for t in p]))
        teardown(h)
    for o, kv in outs[1:]:
        assert torch.equal(bits(o), bits(outs[0][0]))
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(kv, outs[0][1]))


def test_bad_q_split_is_named():
    with pytest.raises(ValueError, match="q_split = 9"):
        Layout(CFG, Tiling.for_config(CFG, q_split=9), 64)     # 16 pairs: cdiv(16, 9) = 2, 8 tiles fill them
    with pytest.raises(ValueError, match="q_split must be"):
        Tiling(q_split=-1)
