"""RESIDUAL folded into the next layer's readers (``Tiling.res_fold``, ``Layout.folds_residual``).

Layers but the last lose their RESIDUAL instructions: the next layer's QKV tiles wait on the down
projection's counter and sum ``x1 + dpart`` themselves, as do its O (or O_REDUCE) tiles for their
rows, in RESIDUAL's order and with its bf16 rounding. So a folded tape must compute bitwise what
the unfolded one computes: in the tape VM (random interleavings), in the real kernel (the Triton
interpreter) for a layer stack, a split O projection and a whole decoder; the verifier proves it
and names a folded reader that does not wait for the partials it sums.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import bits, clone_cache, decode_tokens, decoder_weights, rand_x, require_interpreter
from interp import build_layer, layer_step, teardown
from opcodes import NO_COUNTER, ModelConfig, Tiling
from opcodes.reference import make_kv_cache, make_weights
from schedule import TapeError, compile_model, verify
from schedule.tape import Tape, decode
from schedule.vm import run_tape

require_interpreter()

CFG = ModelConfig.from_name("small-2layer")
THREE = dataclasses.replace(CFG, layers=3, name="small-3layer")
SPLIT_O = dict(o_k=64, red_rows=64)             # O_REDUCE reads the folded stream


def _tiling(cfg, fold, **over):
    return Tiling.for_config(cfg, res_fold=fold, **over)


@pytest.mark.parametrize("cfg,over", [(CFG, {}), (THREE, {}), (THREE, SPLIT_O)])
def test_folded_tape_is_shorter_verified_and_bitwise_in_the_vm(cfg, over):
    w = make_weights(cfg, seed=2)
    x = rand_x(cfg.d, 3)
    outs, lens = [], []
    for fold in (0, 1):
        c = compile_model(cfg, 6, max_seq=64, tiling=_tiling(cfg, fold, **over), pool_us=0)
        names = [d.ins.NAME for d in decode(c.tape)]
        lens.append((len(c.tape), names.count("residual")))
        outs += [run_tape(c.tape, w, make_kv_cache(cfg, 64, 30), x, 30, seed=s) for s in (0, 1, 2)]
    n_rb = -(-cfg.d // _tiling(cfg, 0, **over).red_rows)
    assert lens[1][1] == n_rb and lens[0][1] == cfg.layers * n_rb, lens      # only the last layer keeps it
    assert all(torch.equal(bits(o), bits(outs[0])) for o in outs[1:])


def test_folded_layers_bitwise_in_the_kernel():
    cfg = THREE
    w = make_weights(cfg, seed=4)
    x = rand_x(cfg.d, 5)
    kv0 = make_kv_cache(cfg, 64, 20)
    outs = []
    for fold, over in ((0, {}), (1, {}), (1, SPLIT_O)):
        kv = clone_cache(kv0)
        h = build_layer(w, kv, cfg.to_dict(), 64, tiling=_tiling(cfg, fold, **over))
        outs.append((layer_step(h, x, 20).clone(), [t.clone() for p in kv for t in p]))
        teardown(h)
    for o, k in outs[1:]:
        assert torch.equal(bits(o), bits(outs[0][0]))
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(k, outs[0][1]))


def test_folded_decoder_bitwise_in_the_kernel():
    cfg = dataclasses.replace(CFG, vocab=96, name="small-2layer-v96")
    w = decoder_weights(cfg, seed=6)
    logits = [decode_tokens(w, cfg, _tiling(cfg, fold), tokens=(5, 17))[0] for fold in (0, 1)]
    assert torch.equal(bits(logits[0]), bits(logits[1]))


def test_a_folded_qkv_without_its_wait_is_named():
    c = compile_model(THREE, 4, max_seq=64, tiling=_tiling(THREE, 1), pool_us=0, elide_waits=False)
    tape = c.tape
    k = next(d.slot for d in decode(tape) if d.ins.NAME == "qkv" and d.ins.layer == 1)
    words = tape.words.clone()
    assert tape.counters[int(words[k, 1])] == "dpart[0]"
    words[k, 1], words[k, 2] = NO_COUNTER, 0
    broken = Tape(tape.lay, tape.num_sms, words, tape.offsets, tape.counters, tape.prog_index, {}, tape.pool_counter)
    with pytest.raises(TapeError, match=rf"instruction {k} .*does not wait for"):
        verify(broken)


def test_res_fold_is_0_or_1():
    with pytest.raises(ValueError, match="res_fold"):
        Tiling(res_fold=2)
