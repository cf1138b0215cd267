"""The QKV and O loops' own pipeline depth (``Tiling.qkv_stages``, ``Tiling.o_stages``; 0: ``stages``).

The depth changes when blocks are loaded, never what is summed: a layer stack and a decoder compute
bitwise what the shared depth computes (the real kernel under the Triton interpreter), the kernel
receives each opcode's own depth as its constexpr, and a bad depth is named."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import bits, clone_cache, decode_tokens, decoder_weights, rand_x, require_interpreter
from interp import build_layer, layer_step, teardown
from opcodes import ModelConfig, Tiling, kernel_constexprs
from opcodes.reference import make_kv_cache, make_weights
from schedule.program import make_layout

require_interpreter()

CFG = ModelConfig.from_name("small-2layer")
DEEP = dict(qkv_stages=7, o_stages=2)


def test_each_opcode_gets_its_own_depth():
    cx = kernel_constexprs(make_layout(CFG, 64, Tiling.for_config(CFG, stages=4, **DEEP)))
    assert (cx["STAGES"], cx["QKV_STAGES"], cx["O_STAGES"]) == (4, 7, 2)
    cx = kernel_constexprs(make_layout(CFG, 64, Tiling.for_config(CFG, stages=4)))
    assert (cx["QKV_STAGES"], cx["O_STAGES"]) == (4, 4)


def test_layers_bitwise_the_shared_depth():
    w = make_weights(CFG, seed=11)
    x = rand_x(CFG.d, 12)
    kv0 = make_kv_cache(CFG, 64, 17)
    outs = []
    for over in ({}, DEEP):
        kv = clone_cache(kv0)
        h = build_layer(w, kv, CFG.to_dict(), 64, tiling=Tiling.for_config(CFG, **over))
        outs.append((layer_step(h, x, 17).clone(), kv))
        teardown(h)
    assert torch.equal(bits(outs[1][0]), bits(outs[0][0]))
    assert all(torch.equal(bits(a), bits(b)) for p, q in zip(outs[1][1], outs[0][1]) for a, b in zip(p, q))


def test_decoder_bitwise_the_shared_depth():
    cfg = dataclasses.replace(CFG, vocab=96, name="small-2layer-v96")
    w = decoder_weights(cfg, seed=13)
    logits = [decode_tokens(w, cfg, Tiling.for_config(cfg, **over))[0] for over in ({}, DEEP)]
    assert torch.equal(bits(logits[0]), bits(logits[1]))


@pytest.mark.parametrize("name", ["qkv_stages", "o_stages"])
def test_a_bad_depth_is_named(name):
    with pytest.raises(ValueError, match=f"Tiling.{name} must be a positive int, got -1"):
        Tiling(**{name: -1})
