"""``Tiling.wait_in``: opcodes that make their waits inside their pipelined loop (``Instruction.WAIT_INSIDE``).

The loop's prologue issues the tile's first weight blocks before the waits; the input vector is read
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
from opcodes.gate_up import GateUp
from opcodes.oproj import OProj
from opcodes.reference import make_kv_cache, make_weights
from schedule import compile_model

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

# d <= 2048: GATE_UP streams whole rows (the row loop), so it can wait inside its loop
CFG = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="tiny-decoder")
LAYER = opcodes.PRESETS["small-2layer"]
MAX_SEQ, PREFILL, SPIN = 32, 5, 2000


def test_gate_up_waits_inside_only_where_asked():
    til = Tiling.for_config(CFG)
    lay = opcodes.DecoderLayout(CFG, dataclasses.replace(til, wait_in=1), MAX_SEQ)
    assert GateUp.CONSTEXPRS["GU_WAIT"](lay) == 1
    assert GateUp.CONSTEXPRS["GU_WAIT"](opcodes.DecoderLayout(CFG, til, MAX_SEQ)) == 0
    # the column loop (no row_bytes) has no in-loop wait: the flag is off whatever wait_in says
    col = dataclasses.replace(til, wait_in=1, row_bytes=0)
    assert GateUp.CONSTEXPRS["GU_WAIT"](opcodes.DecoderLayout(CFG, col, MAX_SEQ)) == 0
    with pytest.raises(ValueError, match="wait_in"):
        Tiling.for_config(CFG, wait_in=-1)
    with pytest.raises(ValueError, match=r"wait_in = 9: bits 8 belong to no opcode .*gate_up 1, oproj 2, down 4"):
        opcodes.DecoderLayout(CFG, dataclasses.replace(til, wait_in=9), MAX_SEQ)


@pytest.mark.parametrize("mask", [1, 2, 3, 4, 7])
def test_decoder_logits_bitwise_with_waits_inside(mask):
    """GATE_UP's row loop sums as before; O's and DOWN's row loops sum a row in one reduction where
    the column loop sums BK-wide blocks: the same order here (q_dim 64 and ffn 160 within one block),
    so bitwise in all three."""
    w = decoder_weights(CFG, 0)
    base = decode_tokens(w, CFG, Tiling.for_config(CFG, attn_splits=2, gu_rows=32), max_seq=MAX_SEQ)
    inside = decode_tokens(w, CFG, Tiling.for_config(CFG, attn_splits=2, gu_rows=32, wait_in=mask), max_seq=MAX_SEQ)
    assert base[0].shape == (3, CFG.vocab)
    assert torch.equal(base[0], inside[0]) and base[1] == inside[1]


def test_o_waits_inside_only_where_it_can():
    """O's waiting row loop needs one K chunk with no partials; it streams ROW_BYTES a stage where the
    layout's other loops are column loops (row_bytes 0: the 8B shape)."""
    til = Tiling.for_config(CFG, wait_in=2)
    assert OProj.CONSTEXPRS["O_WAIT"](opcodes.DecoderLayout(CFG, til, MAX_SEQ)) == 1
    col = opcodes.DecoderLayout(CFG, dataclasses.replace(til, row_bytes=0), MAX_SEQ)
    assert OProj.CONSTEXPRS["O_WAIT"](col) == 1 and OProj.CONSTEXPRS["O_RB"](col) == til.o_rows
    eight = opcodes.DecoderLayout(opcodes.PRESETS["llama3.1-8b"], Tiling.for_config(opcodes.PRESETS["llama3.1-8b"],
                                                                                    wait_in=2), 64)
    assert OProj.CONSTEXPRS["O_RB"](eight) == 4             # 4 rows of 4096 = 32 KB a stage
    split = dataclasses.replace(til, o_k=CFG.hd * 2)
    assert OProj.CONSTEXPRS["O_WAIT"](opcodes.DecoderLayout(CFG, split, MAX_SEQ)) == 0


def test_column_loop_decoder_with_o_waiting_inside_is_bitwise():
    """The 8B's form (every other GEMV a column loop, row_bytes 0) with O's waiting row loop."""
    w = decoder_weights(CFG, 0)
    over = dict(attn_splits=2, gu_rows=32, row_bytes=0, res_fold=0)
    base = decode_tokens(w, CFG, Tiling.for_config(CFG, **over), max_seq=MAX_SEQ)
    inside = decode_tokens(w, CFG, Tiling.for_config(CFG, wait_in=2, **over), max_seq=MAX_SEQ)
    assert torch.equal(base[0], inside[0]) and base[1] == inside[1]


def test_down_waits_inside_where_asked_in_row_blocks_of_its_k_chunk():
    til = Tiling.for_config(CFG, wait_in=4)
    lay = opcodes.DecoderLayout(CFG, til, MAX_SEQ)
    assert Down.CONSTEXPRS["D_WAIT"](lay) == 1 and Down.CONSTEXPRS["DKP"](lay) == 256      # ffn 160, padded
    assert Down.CONSTEXPRS["D_WAIT"](opcodes.DecoderLayout(CFG, Tiling.for_config(CFG), MAX_SEQ)) == 0
    one_b = opcodes.PRESETS["llama3.2-1b"]
    big = opcodes.DecoderLayout(one_b, Tiling.for_config(one_b, wait_in=4), 64)
    # the 1B: 16 rows of its one 8192-wide K chunk a tile, 2 rows (32 KB) a stage
    assert (Down.CONSTEXPRS["D_RB"](big), Down.CONSTEXPRS["DKP"](big), big.tiling.down_rows) == (2, 8192, 16)


def test_down_waiting_inside_with_k_chunks_is_close_to_the_column_loop():
    """Two K chunks (ffn 160 as 128 + 32, the last padded and masked): the waiting row loop sums each
    chunk in one reduction, the column loop in BK-wide blocks; logits within fp32 reordering."""
    w = decoder_weights(CFG, 0)
    over = dict(attn_splits=2, gu_rows=32, down_k=128, bk=32)
    base = decode_tokens(w, CFG, Tiling.for_config(CFG, **over), max_seq=MAX_SEQ)
    inside = decode_tokens(w, CFG, Tiling.for_config(CFG, wait_in=4, **over), max_seq=MAX_SEQ)
    torch.testing.assert_close(inside[0], base[0], rtol=1e-3, atol=1e-3)
    assert base[1] == inside[1]


def _broken_tape(cls, delta: int):
    """A 2-layer tape (one SM) with every opcode waiting inside whose first waiting ``cls``
    instruction waits for ``delta`` producers more (or fewer) than exist. Returns (tape, slot, counter)."""
    tape = compile_model(LAYER, 1, max_seq=MAX_SEQ, tiling=Tiling.for_config(LAYER, wait_in=7), sequential=True).tape
    k = next(j for j in range(len(tape)) if int(tape.words[j, 0]) == cls.OPCODE and int(tape.words[j, 1]) >= 0)
    w = tape.words.clone()
    w[k, 2] += delta
    return dataclasses.replace(tape, words=w), k, int(w[k, 1])


@pytest.mark.parametrize("cls,buf,width", [(GateUp, "act_ptr", LAYER.ffn), (OProj, "x1_ptr", LAYER.d),
                                           (Down, "dpart_ptr", None)], ids=["gate_up", "oproj", "down"])
@pytest.mark.parametrize("delta,names", [(1, [f"after {SPIN} polls"]), (-1, ["past"])], ids=["short", "past"])
def test_a_wait_inside_fails_as_the_kernels_own(cls, buf, width, delta, names):
    broken, slot, counter = _broken_tape(cls, delta)
    wts = make_weights(LAYER, seed=3)
    kv = make_kv_cache(LAYER, MAX_SEQ, PREFILL, seed=4)
    h = build_layer(wts, kv, LAYER.to_dict(), MAX_SEQ, tape=broken, verify_tape=False, spin_limit=SPIN)
    out = h.buffers[buf]
    before = out.clone()
    x = torch.randn(1, LAYER.d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with pytest.raises(interp.MegakernelError) as ei:
        layer_step(h, x, PREFILL)
    check_message(ei.value, [f"instruction {slot}", cls.NAME, broken.counters[counter]] + names)
    assert [s[1] for s in ei.value.stuck] == [slot]
    # the failed tile stored nothing: its rows are as before the call
    ins = cls(*[int(v) for v in broken.words[slot, opcodes.HEADER:opcodes.HEADER + len(cls.operand_names())]])
    lo, hi = ins._rows(h.lay)
    # a down tile's rows of its K chunk's partial ([layers, chunks, d])
    row = ins.layer * width if width else (ins.layer * h.lay.n_down_k + ins.kc) * LAYER.d
    assert bitwise_equal(out.view(-1)[row + lo:row + hi], before.view(-1)[row + lo:row + hi])
    teardown(h)


def test_layer_output_and_cache_bitwise_with_waits_inside():
    outs, caches = [], []
    for wi in (0, 7):
        wts = make_weights(LAYER, seed=3)
        kv = make_kv_cache(LAYER, MAX_SEQ, PREFILL, seed=4)
        tape = compile_model(LAYER, 1, max_seq=MAX_SEQ, tiling=Tiling.for_config(LAYER, wait_in=wi), sequential=True).tape
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
    lay = TPLayout(sc, TPLayout.default_tiling(sc), MAX_SEQ, 0, 2)
    used = [c for c in opcodes.REGISTRY.values() if c.SIGNALS_PEER]
    text = kernel_source(kernel_pointers(lay, used), list(opcodes.kernel_constexprs(lay, used=used)), used)
    assert all(f"tl.static_assert({c} == 0" in text for c in ("GU_WAIT", "O_WAIT", "D_WAIT"))
    one = opcodes.Layout(LAYER, Tiling.for_config(LAYER), MAX_SEQ)
    assert "static_assert" not in kernel_source(kernel_pointers(one), list(opcodes.kernel_constexprs(one)))
