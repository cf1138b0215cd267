"""GEMV weights read by the TMA engine (``Tiling.tma``: 1 GATE_UP, 2 DOWN; opcodes.common.gemv_stream_tma).

The engine replaces the loads, not the arithmetic: with blocks as wide as the loop's (``Tiling.bk``
<= the TMA block) a layer stack and a whole decoder compute bitwise what the pointer loop
computes, in the real kernel (the Triton interpreter), including the tile past the last row (the
engine zero-fills it) and a split K range of DOWN.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import bits, clone_cache, decode_tokens, decoder_weights, rand_x, require_interpreter
from interp import build_layer, layer_step, teardown
from opcodes import Layout, ModelConfig, Tiling
from opcodes.reference import make_kv_cache, make_weights

require_interpreter()

CFG = ModelConfig.from_name("small-2layer")          # ffn 320: the last 64-row gate/up tile is partial
OVER = dict(bk=64, down_rows=64, down_k=64)          # DOWN in 5 K chunks; TMA blocks as wide as the loop's


def _tiling(cfg, tma):
    return Tiling.for_config(cfg, tma=tma, **OVER)


def test_tma_applies_where_the_shapes_allow():
    lay = Layout(CFG, _tiling(CFG, 3), 64)
    assert lay.tma_bk(1, CFG.d, CFG.d, lay.tiling.gu_rows) == 64
    assert lay.tma_bk(2, lay.tiling.down_k, CFG.ffn, lay.tiling.down_rows) == 64
    assert Layout(CFG, _tiling(CFG, 1), 64).tma_bk(2, 64, CFG.ffn, 64) == 0          # bit off
    assert lay.tma_bk(2, 96, CFG.ffn, 64) == 0              # 96 columns: no whole 64-column blocks
    with pytest.raises(ValueError, match="tma"):
        Tiling(tma=4)


@pytest.mark.parametrize("tma", [1, 2, 3])
def test_tma_layers_bitwise_in_the_kernel(tma):
    cfg = dataclasses.replace(CFG, layers=3, name="small-3layer")
    w = make_weights(cfg, seed=4)
    x = rand_x(cfg.d, 5)
    kv0 = make_kv_cache(cfg, 64, 20)
    outs = []
    for t in (0, tma):
        kv = clone_cache(kv0)
        h = build_layer(w, kv, cfg.to_dict(), 64, tiling=_tiling(cfg, t))
        outs.append((layer_step(h, x, 20).clone(), [t.clone() for p in kv for t in p]))
        teardown(h)
    assert torch.equal(bits(outs[1][0]), bits(outs[0][0]))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(outs[1][1], outs[0][1]))


def test_tma_decoder_bitwise_in_the_kernel():
    cfg = dataclasses.replace(CFG, vocab=96, name="small-2layer-v96")
    w = decoder_weights(cfg, seed=6)
    (l0, t0), (l1, t1) = (decode_tokens(w, cfg, _tiling(cfg, t)) for t in (0, 3))
    assert torch.equal(bits(l0), bits(l1)) and t0 == t1
