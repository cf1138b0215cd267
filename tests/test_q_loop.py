"""ATTN_PARTIAL's Q rows read inside its key loop (``Tiling.q_loop``): the same values in the same
order as reading them first, so a layer stack and a decoder compute bitwise what the default does
(the real kernel, under the Triton interpreter), at positions with one and with several key blocks."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import bits, clone_cache, decode_tokens, decoder_weights, rand_x, require_interpreter
from interp import build_layer, layer_step, teardown
from opcodes import ModelConfig, Tiling
from opcodes.reference import make_kv_cache, make_weights

require_interpreter()

CFG = ModelConfig.from_name("small-2layer")


@pytest.mark.parametrize("pos", [0, 40])
def test_layers_bitwise_the_default(pos):
    w = make_weights(CFG, seed=8)
    x = rand_x(CFG.d, 9)
    kv0 = make_kv_cache(CFG, 64, pos)
    outs = []
    for q_loop in (0, 1):
        kv = clone_cache(kv0)
        # 16-key blocks: a 40-key prefix is 3 splits of 3 blocks' loop trips at most
        h = build_layer(w, kv, CFG.to_dict(), 64, tiling=Tiling.for_config(CFG, q_loop=q_loop, attn_block=16,
                                                                              attn_splits=2))
        outs.append((layer_step(h, x, pos).clone(), kv))
        teardown(h)
    assert torch.equal(bits(outs[1][0]), bits(outs[0][0]))
    assert all(torch.equal(bits(a), bits(b)) for p, q in zip(outs[1][1], outs[0][1]) for a, b in zip(p, q))


def test_decoder_bitwise_the_default():
    cfg = dataclasses.replace(CFG, vocab=96, name="small-2layer-v96")
    w = decoder_weights(cfg, seed=10)
    logits = [decode_tokens(w, cfg, Tiling.for_config(cfg, q_loop=q))[0] for q in (0, 1)]
    assert torch.equal(bits(logits[0]), bits(logits[1]))


def test_q_loop_is_0_or_1():
    with pytest.raises(ValueError, match="q_loop must be 0 or 1"):
        Tiling(q_loop=2)
