"""K/V tiles of their own size (``Tiling.kv_rows``): the QKV stage's K and V tiles cover ``kv_rows``
rows instead of ``qkv_rows``. A row's dot product does not depend on how many rows share its tile,
so the tapes compute bitwise what the default tiling computes: in the tape VM, in the real kernel
(the Triton interpreter) and for two tensor-parallel ranks."""
from __future__ import annotations

import pytest
import torch

from conftest import bits, clone_cache, rand_x, require_interpreter
from interp import build_layer, layer_step, teardown
from opcodes import ModelConfig, Tiling
from opcodes.base import Layout
from opcodes.reference import make_kv_cache, make_weights
from opcodes.tp import TPLayout
from schedule import compile_model
from schedule.tape import decode
from schedule.vm import run_tape, run_tp

require_interpreter()

CFG = ModelConfig.from_name("small-2layer")        # hd 32: qkv_rows 32


def _kv_tiles(tape) -> int:
    return sum(d.ins.NAME == "qkv" and d.ins.sec > 0 for d in decode(tape))


@pytest.mark.parametrize("kv_rows", [8, 16])
def test_kv_tiles_are_smaller_and_bitwise_in_the_vm(kv_rows):
    w = make_weights(CFG, seed=2)
    x = rand_x(CFG.d, 3)
    outs, counts = [], []
    for t in (Tiling.for_config(CFG), Tiling.for_config(CFG, kv_rows=kv_rows)):
        c = compile_model(CFG, 5, max_seq=64, tiling=t, pool_us=0)
        counts.append(_kv_tiles(c.tape))
        for s in (0, 1):
            kv = make_kv_cache(CFG, 64, 30)
            outs.append((run_tape(c.tape, w, kv, x, 30, seed=s), kv))
    assert counts == [CFG.layers * CFG.n_kv * 2, CFG.layers * CFG.n_kv * 2 * (32 // kv_rows)]
    for o, kv in outs[1:]:
        assert torch.equal(bits(o), bits(outs[0][0]))
        assert all(torch.equal(a, b) for p, q in zip(kv, outs[0][1]) for a, b in zip(p, q))


def test_kv_tiles_bitwise_in_the_kernel():
    w = make_weights(CFG, seed=4)
    x = rand_x(CFG.d, 5)
    kv0 = make_kv_cache(CFG, 64, 20)
    outs = []
    for over in ({}, {"kv_rows": 8}):
        kv = clone_cache(kv0)
        h = build_layer(w, kv, CFG.to_dict(), 64, tiling=Tiling.for_config(CFG, **over))
        outs.append((layer_step(h, x, 20).clone(), [t.clone() for p in kv for t in p]))
        teardown(h)
    assert torch.equal(bits(outs[1][0]), bits(outs[0][0]))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(outs[1][1], outs[0][1]))


def test_kv_tiles_in_tensor_parallel_tapes():
    w = make_weights(CFG, seed=5)
    x = rand_x(CFG.d, 6)
    sc = TPLayout.of(CFG, 0, 2).cfg
    outs = []
    for t in (Tiling.for_config(sc), Tiling.for_config(sc, kv_rows=8)):
        c = compile_model(CFG, 3, max_seq=64, tiling=t, tp=2, decoder=False)
        kv = make_kv_cache(CFG, 64, 30)
        outs.append((run_tp(c.tapes, w, kv, x, 30, seed=1, calls=2, return_all=True), kv))
    for (a, b) in zip(outs[0][0], outs[1][0]):
        assert torch.equal(a[0], b[0]) and torch.equal(b[0], b[1])
    assert all(torch.equal(a, b) for p, q in zip(outs[0][1], outs[1][1]) for a, b in zip(p, q))


def test_bad_kv_rows_are_named():
    with pytest.raises(ValueError, match="kv_rows must be a power of two"):
        Tiling(kv_rows=12)
    with pytest.raises(ValueError, match="kv_rows must be 0"):
        Tiling(kv_rows=1)
    with pytest.raises(ValueError, match="kv_rows = 64 must divide hd = 32"):
        Layout(CFG, Tiling.for_config(CFG, kv_rows=64), 64)
