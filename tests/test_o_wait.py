"""``Tiling.o_wait``: O makes its waits inside its pipelined row loop (``Instruction.WAIT_INSIDE``).

The loop's prologue issues the tile's first rows of Wo before the waits; the attention vector and the
residual rows are read after them. Through the Triton interpreter: the same results as the column loop's
(a decoder's logits and tokens, a layer's output and cache), and a wait that is not met inside the device
function is the same MegakernelError as one the kernel makes (short of its target, and past it), storing
nothing.
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
from opcodes import ModelConfig, Tiling
from opcodes.oproj import OProj
from opcodes.reference import make_kv_cache, make_weights
from schedule import compile_model

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CFG = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="tiny-decoder")
LAYER = opcodes.PRESETS["small-2layer"]
MAX_SEQ, PREFILL, SPIN = 32, 5, 2000


def test_o_wait_is_checked_and_off_by_default():
    for name in ("llama3.2-1b", "llama3.1-8b", "llama70b-layer"):
        assert Tiling.for_config(opcodes.PRESETS[name]).o_wait == 0, name
    assert Tiling.for_config(CFG, o_wait=1).o_wait == 1
    for bad in (2, -1, True):
        with pytest.raises(ValueError, match="o_wait"):
            Tiling.for_config(CFG, o_wait=bad)


def test_o_waits_inside_only_with_one_k_chunk_in_row_blocks():
    one_b = opcodes.PRESETS["llama3.2-1b"]
    lay = opcodes.DecoderLayout(one_b, Tiling.for_config(one_b, o_wait=1), 64)
    # the 1B: 16 rows of Wo (2048 columns) a tile, 8 rows (32 KB) a stage: the whole tile in the prologue
    assert (OProj.CONSTEXPRS["O_WAIT"](lay), OProj.CONSTEXPRS["O_RB"](lay), OProj.CONSTEXPRS["QDP"](lay)) == (1, 8, 2048)
    assert OProj.CONSTEXPRS["O_WAIT"](opcodes.DecoderLayout(one_b, Tiling.for_config(one_b), 64)) == 0
    # O in K chunks writes partials for O_REDUCE: the column loop, whatever o_wait says
    split = opcodes.DecoderLayout(CFG, Tiling.for_config(CFG, o_wait=1, o_k=32), MAX_SEQ)
    assert split.n_o_k == 2 and OProj.CONSTEXPRS["O_WAIT"](split) == 0


@pytest.mark.parametrize("attn_splits", [1, 2])
def test_decoder_logits_and_tokens_with_o_waiting_inside(attn_splits):
    """The waiting row loop sums a row of Wo in one reduction where the column loop sums BK-wide blocks:
    with q_dim 64 in one block the same order, so bitwise."""
    w = decoder_weights(CFG, 0)
    over = dict(attn_splits=attn_splits, gu_rows=32)
    base = decode_tokens(w, CFG, Tiling.for_config(CFG, **over), max_seq=MAX_SEQ)
    inside = decode_tokens(w, CFG, Tiling.for_config(CFG, o_wait=1, **over), max_seq=MAX_SEQ)
    assert base[0].shape == (3, CFG.vocab)
    assert torch.equal(base[0], inside[0]) and base[1] == inside[1]


def test_o_waiting_inside_with_padded_rows_is_close_to_the_column_loop():
    """q_dim 96 (6 heads of 16) padded to 128 in the row loop, and o_rows 32 over d 64 in blocks of 4 rows
    (row_bytes 1024): masks on columns and several blocks a tile; logits within fp32 reordering."""
    cfg = dataclasses.replace(CFG, n_q=6, n_kv=2)
    w = decoder_weights(cfg, 1)
    over = dict(attn_splits=2, gu_rows=32, bk=32, row_bytes=1024, o_rows=32)
    base = decode_tokens(w, cfg, Tiling.for_config(cfg, **over), max_seq=MAX_SEQ)
    til = Tiling.for_config(cfg, o_wait=1, **over)
    lay = opcodes.DecoderLayout(cfg, til, MAX_SEQ)
    assert (OProj.CONSTEXPRS["O_WAIT"](lay), OProj.CONSTEXPRS["O_RB"](lay), OProj.CONSTEXPRS["QDP"](lay)) == (1, 4, 128)
    inside = decode_tokens(w, cfg, til, max_seq=MAX_SEQ)
    torch.testing.assert_close(inside[0], base[0], rtol=1e-3, atol=1e-3)
    assert base[1] == inside[1]


def _broken_tape(delta: int):
    """A 2-layer tape (one SM, O waiting inside) whose first waiting O instruction waits for ``delta``
    producers more (or fewer) than exist. Returns (tape, slot, counter)."""
    til = Tiling.for_config(LAYER, o_wait=1)
    tape = compile_model(LAYER, 1, max_seq=MAX_SEQ, tiling=til, sequential=True).tape
    k = next(j for j in range(len(tape)) if int(tape.words[j, 0]) == OProj.OPCODE and int(tape.words[j, 1]) >= 0)
    w = tape.words.clone()
    w[k, 2] += delta
    return dataclasses.replace(tape, words=w), k, int(w[k, 1])


@pytest.mark.parametrize("delta,names", [(1, [f"after {SPIN} polls"]), (-1, ["past"])], ids=["short", "past"])
def test_a_wait_inside_o_fails_as_the_kernels_own(delta, names):
    broken, slot, counter = _broken_tape(delta)
    wts = make_weights(LAYER, seed=3)
    kv = make_kv_cache(LAYER, MAX_SEQ, PREFILL, seed=4)
    h = build_layer(wts, kv, LAYER.to_dict(), MAX_SEQ, tape=broken, verify_tape=False, spin_limit=SPIN)
    out = h.buffers["x1_ptr"]
    before = out.clone()
    x = torch.randn(1, LAYER.d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with pytest.raises(interp.MegakernelError) as ei:
        layer_step(h, x, PREFILL)
    check_message(ei.value, [f"instruction {slot}", OProj.NAME, broken.counters[counter]] + names)
    assert [s[1] for s in ei.value.stuck] == [slot]
    # the failed tile stored nothing: its x1 rows are as before the call
    ins = OProj(*[int(v) for v in broken.words[slot, opcodes.HEADER:opcodes.HEADER + len(OProj.operand_names())]])
    lo, hi = ins._rows(h.lay)
    row = ins.layer * LAYER.d
    assert bitwise_equal(out.view(-1)[row + lo:row + hi], before.view(-1)[row + lo:row + hi])
    teardown(h)


def test_layer_output_and_cache_bitwise_with_o_waiting_inside():
    """q_dim 128 in one BK block: the row loop's one reduction a row is the column loop's order."""
    outs, caches = [], []
    for wi in (0, 1):
        wts = make_weights(LAYER, seed=3)
        kv = make_kv_cache(LAYER, MAX_SEQ, PREFILL, seed=4)
        til = Tiling.for_config(LAYER, o_wait=wi)
        tape = compile_model(LAYER, 1, max_seq=MAX_SEQ, tiling=til, sequential=True).tape
        h = build_layer(wts, kv, LAYER.to_dict(), MAX_SEQ, tape=tape)
        assert OProj.CONSTEXPRS["O_WAIT"](h.lay) == wi
        x = torch.randn(1, LAYER.d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        outs.append(layer_step(h, x, PREFILL).clone())
        caches.append(clone_cache(kv))
        teardown(h)
    assert bitwise_equal(outs[0], outs[1])
    assert caches_equal(caches[0], caches[1])
