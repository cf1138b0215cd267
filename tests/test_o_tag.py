"""``Tiling.o_tag``: the O projection synchronises with the attention merges through call-tagged words.

ATTN_REDUCE writes its head's output also as words ``call << 32 | fp32 bits`` (after an acq_rel fence) and
signals its counter relaxed (``Instruction.SIGNAL_RELAXED``); OPROJ polls the words
(``Instruction.WAIT_INSIDE``, ``opcodes.common.poll_tags``) and reads the vector from them. Through the
Triton interpreter: the same bits as the counter protocol, the words as specified, and words that never
arrive (or come from a later call) are the kernel's MegakernelError, storing nothing; a reset zeroes them.
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
from opcodes.attn_reduce import AttnReduce
from opcodes.base import kernel_pointers
from opcodes.oproj import OProj
from opcodes.reference import make_kv_cache, make_weights
from schedule import compile_model

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CFG = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="tiny-decoder")
LAYER = opcodes.PRESETS["small-2layer"]
MAX_SEQ, PREFILL, SPIN = 32, 5, 2000


def _x():
    return torch.randn(1, LAYER.d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def _handle(tape=None, o_tag=1, **kw):
    wts = make_weights(LAYER, seed=3)
    kv = make_kv_cache(LAYER, MAX_SEQ, PREFILL, seed=4)
    if tape is None:
        tape = compile_model(LAYER, 1, max_seq=MAX_SEQ, tiling=Tiling.for_config(LAYER, o_tag=o_tag),
                             sequential=True).tape
    return build_layer(wts, kv, LAYER.to_dict(), MAX_SEQ, tape=tape, **kw), kv


def _words(h):
    """The call-tagged words after the attn values: (calls [layers, q_dim], fp32 values)."""
    n = LAYER.layers * LAYER.q_dim
    w = h.scratch["attn"][n:].view(torch.int64)
    return (w >> 32).view(LAYER.layers, -1), (w & 0xFFFFFFFF).to(torch.int32).view(torch.float32).view(LAYER.layers, -1)


def test_o_tag_is_a_checked_switch_for_one_o_chunk_on_one_gpu():
    assert Tiling.for_config(CFG, o_tag=1).o_tag == 1
    for bad in (2, -1, True):
        with pytest.raises(ValueError, match="o_tag"):
            Tiling.for_config(CFG, o_tag=bad)
    with pytest.raises(ValueError, match="o_tag"):
        opcodes.Layout(LAYER, Tiling.for_config(LAYER, o_tag=1, o_k=LAYER.hd), MAX_SEQ)
    from opcodes.tp import TPLayout, shard_config
    sc = shard_config(LAYER, 0, 2)
    with pytest.raises(ValueError, match="o_tag"):
        TPLayout(sc, TPLayout.default_tiling(sc, o_tag=1), MAX_SEQ, 0, 2)


def test_decoder_logits_bitwise_with_tagged_attention():
    w = decoder_weights(CFG, 0)
    base = decode_tokens(w, CFG, Tiling.for_config(CFG, attn_splits=4, gu_rows=32), max_seq=MAX_SEQ)
    tagged = decode_tokens(w, CFG, Tiling.for_config(CFG, attn_splits=4, gu_rows=32, o_tag=1), max_seq=MAX_SEQ)
    assert torch.equal(base[0], tagged[0]) and base[1] == tagged[1]


def test_layer_output_cache_and_the_words_of_each_call():
    outs, caches = [], []
    for o_tag in (0, 1):
        h, kv = _handle(o_tag=o_tag)
        outs.append(layer_step(h, _x(), PREFILL).clone())
        caches.append(clone_cache(kv))
        if o_tag:
            n = LAYER.layers * LAYER.q_dim
            for call in (1, 2):
                if call == 2:
                    layer_step(h, _x(), PREFILL)
                calls, vals = _words(h)
                assert (calls == call).all()                 # every word carries the call that wrote it
                assert torch.equal(vals.reshape(-1), h.scratch["attn"][:n])     # and the merge's value
        teardown(h)
    assert bitwise_equal(outs[0], outs[1])
    assert caches_equal(caches[0], caches[1])


def _missing_head_tape():
    """A 1-SM tape whose first ATTN_REDUCE merges head 1 instead of head 0 (twice head 1): head 0's
    words are never written. Returns (tape, the first OPROJ's slot, its counter)."""
    tape = compile_model(LAYER, 1, max_seq=MAX_SEQ, tiling=Tiling.for_config(LAYER, o_tag=1), sequential=True).tape
    k = next(j for j in range(len(tape)) if int(tape.words[j, 0]) == AttnReduce.OPCODE)
    w = tape.words.clone()
    assert int(w[k, opcodes.HEADER + 1]) == 0                   # (layer 0, h 0)
    w[k, opcodes.HEADER + 1] = 1
    o = next(j for j in range(len(tape)) if int(tape.words[j, 0]) == OProj.OPCODE)
    return dataclasses.replace(tape, words=w), o, int(w[o, 1])


def test_words_that_never_arrive_fail_the_o_tile_which_stores_nothing_and_a_reset_zeroes_them():
    broken, slot, counter = _missing_head_tape()
    h, _ = _handle(tape=broken, verify_tape=False, spin_limit=SPIN)
    x1 = h.scratch["x1"].clone()
    with pytest.raises(interp.MegakernelError) as ei:
        layer_step(h, _x(), PREFILL)
    check_message(ei.value, [f"instruction {slot}", OProj.NAME, broken.counters[counter], f"after {SPIN} polls"])
    assert [s[1] for s in ei.value.stuck] == [slot]
    ins = OProj(*[int(v) for v in broken.words[slot, opcodes.HEADER:opcodes.HEADER + 3]])
    lo, hi = ins._rows(h.lay)
    assert bitwise_equal(h.scratch["x1"][lo:hi], x1[lo:hi])     # the failed tile stored nothing
    assert int((_words(h)[0] != 0).sum()) == 0                  # the reset zeroed the words
    teardown(h)


def test_words_of_a_later_call_are_past_the_target():
    """As if another launch had run beside this one: head 0's words (which this tape never writes) carry
    a later call. The O tile refuses them as past its target; the reset zeroes them."""
    broken, slot, counter = _missing_head_tape()
    h, _ = _handle(tape=broken, verify_tape=False, spin_limit=SPIN)
    n = LAYER.layers * LAYER.q_dim
    w = h.scratch["attn"][n:].view(torch.int64)
    w[:LAYER.hd] = 9 << 32                                      # call 9's words of layer 0, head 0
    with pytest.raises(interp.MegakernelError) as ei:
        layer_step(h, _x(), PREFILL)
    check_message(ei.value, [f"instruction {slot}", OProj.NAME, broken.counters[counter], "past"])
    assert int((_words(h)[0] != 0).sum()) == 0
    teardown(h)


def test_only_the_merge_signals_relaxed_and_tensor_parallel_kernels_refuse_it():
    one = opcodes.Layout(LAYER, Tiling.for_config(LAYER, o_tag=1), MAX_SEQ)
    text = kernel_source(kernel_pointers(one), list(opcodes.kernel_constexprs(one)))
    assert text.count("signal_relaxed(cnt_ptr + sig)") == 1
    assert f"if O_TAG and (op == {AttnReduce.OPCODE}):" in text
    from opcodes.tp import TPLayout, shard_config
    sc = shard_config(LAYER, 0, 2)
    lay = TPLayout(sc, TPLayout.default_tiling(sc), MAX_SEQ, 0, 2)
    used = [c for c in opcodes.REGISTRY.values() if c.SIGNALS_PEER]
    text = kernel_source(kernel_pointers(lay, used), list(opcodes.kernel_constexprs(lay, used=used)), used)
    assert "tl.static_assert(O_TAG == 0, \"attn_reduce cannot signal relaxed" in text
    assert "tl.static_assert(O_TAG == 0, \"oproj cannot wait inside" in text
    assert "signal_relaxed" not in text
