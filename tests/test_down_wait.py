"""``Tiling.down_wait``: DOWN makes its waits inside its pipelined loop (``Instruction.WAIT_INSIDE``).

The loop's prologue issues the tile's first weight blocks before the waits; the act chunk is read
after them. Through the Triton interpreter: the same bits as the kernel's own waits (a decoder's logits,
a layer's output and cache), and a wait that is not met inside the device function is the same
MegakernelError as one the kernel makes (short of its target, and past it), storing nothing.
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
from opcodes.base import kernel_pointers
from opcodes.down import Down
from opcodes.reference import make_kv_cache, make_weights
from schedule import compile_model

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CFG = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="tiny-decoder")
LAYER = opcodes.PRESETS["small-2layer"]
TOKENS = (5, 17)          # the decoders' steps: DOWN's loop is the same at every position (interpreter time)
MAX_SEQ, PREFILL, SPIN = 32, 5, 2000


def test_down_waits_inside_by_default_only_at_small_d():
    assert Tiling.for_config(CFG).down_wait == 1
    assert Tiling.for_config(opcodes.PRESETS["llama3.2-1b"]).down_wait == 1
    for big in ("llama3.1-8b", "llama70b-layer"):
        assert Tiling.for_config(opcodes.PRESETS[big]).down_wait == 0, big
    for bad in (2, -1, True):
        with pytest.raises(ValueError, match="down_wait"):
            Tiling.for_config(CFG, down_wait=bad)


def test_decoder_logits_bitwise_with_down_waiting_inside():
    """DOWN's waiting row loop sums a row of its K chunk in one reduction where the column loop sums
    BK-wide blocks: the same order here (ffn 160 within one block), so bitwise."""
    w = decoder_weights(CFG, 0)
    base = decode_tokens(w, CFG, Tiling.for_config(CFG, attn_splits=2, gu_rows=32, down_wait=0), TOKENS, MAX_SEQ)
    inside = decode_tokens(w, CFG, Tiling.for_config(CFG, attn_splits=2, gu_rows=32), TOKENS, MAX_SEQ)
    assert base[0].shape == (len(TOKENS), CFG.vocab)
    assert torch.equal(base[0], inside[0]) and base[1] == inside[1]


def test_down_waits_inside_where_asked_in_row_blocks_of_its_k_chunk():
    lay = opcodes.DecoderLayout(CFG, Tiling.for_config(CFG), MAX_SEQ)
    assert Down.CONSTEXPRS["D_WAIT"](lay) == 1 and Down.CONSTEXPRS["DKP"](lay) == 256      # ffn 160, padded
    assert Down.CONSTEXPRS["D_WAIT"](opcodes.DecoderLayout(CFG, Tiling.for_config(CFG, down_wait=0), MAX_SEQ)) == 0
    one_b = opcodes.PRESETS["llama3.2-1b"]
    big = opcodes.DecoderLayout(one_b, Tiling.for_config(one_b), 64)
    # the 1B: 16 rows of its one 8192-wide K chunk a tile, 2 rows (32 KB) a stage
    assert (Down.CONSTEXPRS["D_RB"](big), Down.CONSTEXPRS["DKP"](big), big.tiling.down_rows) == (2, 8192, 16)


def test_down_waiting_inside_with_k_chunks_is_close_to_the_column_loop():
    """Two K chunks (ffn 160 as 128 + 32, the last padded and masked): the waiting row loop sums each
    chunk in one reduction, the column loop in BK-wide blocks; logits within fp32 reordering."""
    w = decoder_weights(CFG, 0)
    over = dict(attn_splits=2, gu_rows=32, down_k=128, bk=32)
    base = decode_tokens(w, CFG, Tiling.for_config(CFG, down_wait=0, **over), TOKENS, MAX_SEQ)
    inside = decode_tokens(w, CFG, Tiling.for_config(CFG, **over), TOKENS, MAX_SEQ)
    torch.testing.assert_close(inside[0], base[0], rtol=1e-3, atol=1e-3)
    assert base[1] == inside[1]


def _broken_tape(cls, delta: int):
    """A 2-layer tape (one SM, DOWN waiting inside) whose first waiting ``cls`` instruction waits for
    ``delta`` producers more (or fewer) than exist. Returns (tape, slot, counter)."""
    assert Tiling.for_config(LAYER).down_wait == 1
    tape = compile_model(LAYER, 1, max_seq=MAX_SEQ, tiling=Tiling.for_config(LAYER), sequential=True).tape
    k = next(j for j in range(len(tape)) if int(tape.words[j, 0]) == cls.OPCODE and int(tape.words[j, 1]) >= 0)
    w = tape.words.clone()
    w[k, 2] += delta
    return dataclasses.replace(tape, words=w), k, int(w[k, 1])


@pytest.mark.parametrize("delta,names", [(1, [f"after {SPIN} polls"]), (-1, ["past"])], ids=["short", "past"])
def test_a_wait_inside_fails_as_the_kernels_own(delta, names):
    cls = Down                          # the opcode that waits inside its loop
    broken, slot, counter = _broken_tape(cls, delta)
    wts = make_weights(LAYER, seed=3)
    kv = make_kv_cache(LAYER, MAX_SEQ, PREFILL, seed=4)
    h = build_layer(wts, kv, LAYER.to_dict(), MAX_SEQ, tape=broken, verify_tape=False, spin_limit=SPIN)
    out = h.buffers["dpart_ptr"]
    before = out.clone()
    x = torch.randn(1, LAYER.d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with pytest.raises(interp.MegakernelError) as ei:
        layer_step(h, x, PREFILL)
    check_message(ei.value, [f"instruction {slot}", cls.NAME, broken.counters[counter]] + names)
    assert [s[1] for s in ei.value.stuck] == [slot]
    # the failed tile stored nothing: its rows are as before the call
    ins = cls(*[int(v) for v in broken.words[slot, opcodes.HEADER:opcodes.HEADER + len(cls.operand_names())]])
    lo, hi = ins._rows(h.lay)
    row = (ins.layer * h.lay.n_down_k + ins.kc) * LAYER.d     # its K chunk's partial ([layers, chunks, d])
    assert bitwise_equal(out.view(-1)[row + lo:row + hi], before.view(-1)[row + lo:row + hi])
    teardown(h)


def test_layer_output_and_cache_bitwise_with_waits_inside():
    outs, caches = [], []
    for wi in (0, 1):
        wts = make_weights(LAYER, seed=3)
        kv = make_kv_cache(LAYER, MAX_SEQ, PREFILL, seed=4)
        tape = compile_model(LAYER, 1, max_seq=MAX_SEQ, tiling=Tiling.for_config(LAYER, down_wait=wi), sequential=True).tape
        h = build_layer(wts, kv, LAYER.to_dict(), MAX_SEQ, tape=tape)
        x = torch.randn(1, LAYER.d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        outs.append(layer_step(h, x, PREFILL).clone())
        caches.append(clone_cache(kv))
        teardown(h)
    assert bitwise_equal(outs[0], outs[1])
    assert caches_equal(caches[0], caches[1])


def test_tensor_parallel_kernels_refuse_waits_inside():
    """A tensor-parallel kernel makes every wait itself (peer counters, time bounds): its source asserts
    at compile time that no opcode waits inside; a single-GPU kernel has no such assert."""
    from opcodes.tp import TPLayout, shard_config
    sc = shard_config(LAYER, 0, 2)
    assert Tiling.for_config(sc).down_wait == 1 and TPLayout.default_tiling(sc).down_wait == 0
    lay = TPLayout(sc, TPLayout.default_tiling(sc, down_wait=1), MAX_SEQ, 0, 2)
    used = [c for c in opcodes.REGISTRY.values() if c.SIGNALS_PEER]
    text = kernel_source(kernel_pointers(lay, used), list(opcodes.kernel_constexprs(lay, used=used)), used)
    assert "tl.static_assert(D_WAIT == 0" in text
    one = opcodes.Layout(LAYER, Tiling.for_config(LAYER), MAX_SEQ)
    assert "static_assert" not in kernel_source(kernel_pointers(one), list(opcodes.kernel_constexprs(one)))
