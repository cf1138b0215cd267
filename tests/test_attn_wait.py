"""``Tiling.attn_wait``: a prefix ATTN_PARTIAL makes its waits inside its key loop (``Instruction.WAIT_INSIDE``).

The loop's prologue issues the split's K/V blocks (cache rows of earlier calls) before the waits; q is read
after them, in the first iteration. The last split (the key this call writes) and an empty split wait
before their loop. Through the Triton interpreter: the same bits as the kernel's own waits (a decoder's
logits from an empty cache, a layer's output and cache over several key blocks), and a wait not met
inside the device function is the kernel's own MegakernelError, storing nothing.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import interp
import opcodes
from conftest import (bitwise_equal, caches_equal, check_message, clone_cache, decode_tokens, decoder_weights,
                      require_interpreter)
from interp import build_layer, layer_step, teardown
from interp.codegen import kernel_source
from opcodes import ModelConfig, Tiling
from opcodes.attn_partial import AttnPartial
from opcodes.base import kernel_pointers
from opcodes.reference import make_kv_cache, make_weights
from schedule import compile_model

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CFG = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="tiny-decoder")
LAYER = opcodes.PRESETS["small-2layer"]
MAX_SEQ, SPIN = 64, 2000


def test_attn_wait_is_a_checked_switch_off_on_tensor_parallel_ranks():
    assert Tiling.for_config(CFG, attn_wait=1).attn_wait == 1
    for bad in (2, -1, True):
        with pytest.raises(ValueError, match="attn_wait"):
            Tiling.for_config(CFG, attn_wait=bad)
    from opcodes.tp import TPLayout, shard_config
    assert TPLayout.default_tiling(shard_config(LAYER, 0, 2)).attn_wait == 0


def test_decoder_logits_bitwise_with_the_partials_waiting_inside():
    """Positions 0-2 from an empty cache: most prefix splits are empty (they wait before the loop)."""
    w = decoder_weights(CFG, 0)
    base = decode_tokens(w, CFG, Tiling.for_config(CFG, attn_splits=4, gu_rows=32), max_seq=MAX_SEQ)
    inside = decode_tokens(w, CFG, Tiling.for_config(CFG, attn_splits=4, gu_rows=32, attn_wait=1), max_seq=MAX_SEQ)
    assert base[0].shape == (3, CFG.vocab)
    assert torch.equal(base[0], inside[0]) and base[1] == inside[1]


@pytest.mark.parametrize("splits,prefill", [(2, 40), (4, 9), (16, 5)], ids=["3-blocks", "short", "empty-splits"])
def test_layer_output_and_cache_bitwise_with_the_partials_waiting_inside(splits, prefill):
    """16-key blocks: one prefix split over 40 keys streams 3 blocks (the wait in the first iteration
    only); 15 prefix splits over 5 keys leave 10 empty."""
    outs, caches = [], []
    for aw in (0, 1):
        wts = make_weights(LAYER, seed=3)
        kv = make_kv_cache(LAYER, MAX_SEQ, prefill, seed=4)
        til = Tiling.for_config(LAYER, attn_wait=aw, attn_splits=splits, attn_block=16)
        tape = compile_model(LAYER, 1, max_seq=MAX_SEQ, tiling=til, sequential=True).tape
        h = build_layer(wts, kv, LAYER.to_dict(), MAX_SEQ, tape=tape)
        x = torch.randn(1, LAYER.d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        outs.append(layer_step(h, x, prefill).clone())
        caches.append(clone_cache(kv))
        teardown(h)
    assert bitwise_equal(outs[0], outs[1])
    assert caches_equal(caches[0], caches[1])


def _broken_tape(delta: int, split: int):
    """A 2-layer tape (one SM, the partials waiting inside, 4 splits) whose first ATTN_PARTIAL of split
    ``split`` with a wait waits for ``delta`` producers more (or fewer) than exist."""
    til = Tiling.for_config(LAYER, attn_wait=1, attn_splits=4)
    tape = compile_model(LAYER, 1, max_seq=MAX_SEQ, tiling=til, sequential=True).tape
    n = len(AttnPartial.operand_names())
    k = next(j for j in range(len(tape)) if int(tape.words[j, 0]) == AttnPartial.OPCODE and int(tape.words[j, 1]) >= 0
             and AttnPartial(*[int(v) for v in tape.words[j, opcodes.HEADER:opcodes.HEADER + n]]).s == split)
    w = tape.words.clone()
    w[k, 2] += delta
    return dataclasses.replace(tape, words=w), k, int(w[k, 1])


@pytest.mark.parametrize("split", [0, 3], ids=["prefix", "last"])
@pytest.mark.parametrize("delta,names", [(1, [f"after {SPIN} polls"]), (-1, ["past"])], ids=["short", "past"])
def test_a_partials_wait_fails_as_the_kernels_own(delta, names, split):
    prefill = 9
    broken, slot, counter = _broken_tape(delta, split)
    wts = make_weights(LAYER, seed=3)
    kv = make_kv_cache(LAYER, MAX_SEQ, prefill, seed=4)
    h = build_layer(wts, kv, LAYER.to_dict(), MAX_SEQ, tape=broken, verify_tape=False, spin_limit=SPIN)
    po, pml = h.buffers["part_o_ptr"], h.buffers["part_ml_ptr"]
    before = po.clone(), pml.clone()
    x = torch.randn(1, LAYER.d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with pytest.raises(interp.MegakernelError) as ei:
        layer_step(h, x, prefill)
    check_message(ei.value, [f"instruction {slot}", AttnPartial.NAME, broken.counters[counter]] + names)
    assert [s[1] for s in ei.value.stuck] == [slot]
    # the failed split stored nothing: its partials are as before the call
    n = len(AttnPartial.operand_names())
    ins = AttnPartial(*[int(v) for v in broken.words[slot, opcodes.HEADER:opcodes.HEADER + n]])
    for r in ins.writes(h.lay):
        buf = po if r.buf == "part_o" else pml
        assert bitwise_equal(buf.view(-1)[r.lo:r.hi], before[r.buf != "part_o"].view(-1)[r.lo:r.hi]), r
    teardown(h)


def test_tensor_parallel_kernels_refuse_the_partials_waiting_inside():
    from opcodes.tp import TPLayout, shard_config
    sc = shard_config(LAYER, 0, 2)
    lay = TPLayout(sc, TPLayout.default_tiling(sc, attn_wait=1), MAX_SEQ, 0, 2)
    used = [c for c in opcodes.REGISTRY.values() if c.SIGNALS_PEER]
    text = kernel_source(kernel_pointers(lay, used), list(opcodes.kernel_constexprs(lay, used=used)), used)
    assert "tl.static_assert(A_WAIT == 0" in text
