"""O tiles that stream whole rows and wait inside their loop (``Tiling.o_prefetch``).

With ``o_prefetch`` the O projection's device function makes its waits itself, in the first
iteration of its pipelined row loop (``OProj.waits_inside``), so the weights of the prologue load
while the SM waits for the attention merge. The values are the column loop's up to the order of
fp32 sums: the real kernel (the Triton interpreter) against the tape VM and against the default
build, for a layer stack, a split O projection and a whole decoder; a wait that fails inside the
loop is the usual MegakernelError and stores nothing.
"""
from __future__ import annotations

import dataclasses

import pytest

import interp
import opcodes
from conftest import clone_cache, decode_tokens, decoder_weights, rand_x, require_interpreter
from interp import build_layer, layer_step, teardown
from opcodes import ModelConfig, Tiling
from opcodes.reference import make_kv_cache, make_weights, model_ref, rel_err
from schedule import compile_model
from schedule.vm import run_tape

require_interpreter()

CFG = dataclasses.replace(ModelConfig.from_name("small-2layer"), layers=3, name="small-3layer")
SPLIT_O = dict(o_k=64, red_rows=64)             # O partials and O_REDUCE
TOL = 1.5e-2


def _tiling(cfg, pre, **over):
    return Tiling.for_config(cfg, o_prefetch=pre, **over)


def test_o_prefetch_is_checked():
    cfg = CFG
    assert Tiling.for_config(cfg).o_prefetch == 0
    with pytest.raises(ValueError, match="o_prefetch must be 0 or 1"):
        Tiling.for_config(cfg, o_prefetch=2)
    with pytest.raises(ValueError, match="o_prefetch needs Tiling.row_bytes"):
        Tiling.for_config(cfg, o_prefetch=1, row_bytes=0)
    lay = opcodes.Layout(cfg, _tiling(cfg, 1), 64)
    assert opcodes.OProj.waits_inside(lay) and "oproj" in opcodes.waiting_inside(lay)
    assert not opcodes.OProj.waits_inside(opcodes.Layout(cfg, _tiling(cfg, 0), 64))


@pytest.mark.parametrize("over", [{}, SPLIT_O], ids=["whole-o", "split-o"])
def test_layers_match_the_vm_and_the_column_loop(over):
    cfg = CFG
    w = make_weights(cfg, seed=4)
    kv0 = make_kv_cache(cfg, 64, 20)
    outs = {}
    for pre in (0, 1):
        kv = clone_cache(kv0)
        h = build_layer(w, kv, cfg.to_dict(), 64, tiling=_tiling(cfg, pre, **over))
        ys = [layer_step(h, rand_x(cfg.d, 5 + s), 20 + s).clone() for s in range(2)]
        outs[pre] = (ys, kv)
        if pre:
            assert opcodes.OProj.waits_inside(h.lay)
            vm_kv = clone_cache(kv0)
            for s in range(2):
                ref = run_tape(h.tape, w, vm_kv, rand_x(cfg.d, 5 + s), 20 + s, seed=s)
                assert rel_err(ys[s], ref) <= 1e-2, s      # bf16 outputs: a rounding flip is 4e-3
        teardown(h)
    ref_kv = clone_cache(kv0)
    for s in range(2):
        ref = model_ref(w, ref_kv, cfg, rand_x(cfg.d, 5 + s), 20 + s)
        for pre in (0, 1):
            assert rel_err(outs[pre][0][s], ref) <= TOL, (pre, s)
        assert rel_err(outs[1][0][s], outs[0][0][s]) <= 1e-2, s


def test_decoder_tokens_and_logits_match_the_column_loop():
    cfg = dataclasses.replace(ModelConfig.from_name("small-2layer"), vocab=96, name="small-2layer-v96")
    w = decoder_weights(cfg, seed=6)
    got = [decode_tokens(w, cfg, _tiling(cfg, pre)) for pre in (0, 1)]
    assert rel_err(got[1][0], got[0][0]) <= 1e-2
    assert got[1][1] == got[0][1]


@pytest.mark.parametrize("past", [False, True], ids=["short", "past"])
def test_a_failed_wait_inside_the_loop_is_reported_and_stores_nothing(past):
    cfg = CFG
    tape = compile_model(cfg, 1, max_seq=64, tiling=_tiling(cfg, 1), sequential=True).tape
    k = next(j for j in range(len(tape)) if int(tape.words[j, 0]) == opcodes.OProj.OPCODE
             and int(tape.words[j, 1]) >= 0)
    words = tape.words.clone()
    words[k, 2] += -1 if past else 1        # a producer fewer (the counter overshoots) or one more
    broken = dataclasses.replace(tape, words=words)
    w = make_weights(cfg, seed=4)
    h = build_layer(w, make_kv_cache(cfg, 64, 20), cfg.to_dict(), 64, tape=broken, verify_tape=False,
                    spin_limit=2000)
    h.scratch["x1"].fill_(7.0)
    with pytest.raises(interp.MegakernelError) as ei:
        layer_step(h, rand_x(cfg.d, 5), 20)
    msg = str(ei.value)
    assert f"instruction {k}" in msg and "oproj" in msg and tape.counters[int(words[k, 1])] in msg, msg
    assert ("past its target" if past else "after 2000 polls") in msg, msg
    ins = opcodes.BY_OPCODE[int(words[k, 0])].decode(words[k, opcodes.HEADER:].tolist())
    rows = h.scratch["x1"].view(cfg.layers, cfg.d)[ins.layer, ins.row0:ins.row0 + h.lay.tiling.o_rows]
    assert bool((rows == 7.0).all()), "an O tile whose wait failed stored its rows"
    teardown(h)
