"""ATTN_REDUCE folded into the last attention partial of each KV group (``Tiling.attn_fold``).

With ``attn_fold`` the lowering emits no ATTN_REDUCE: each ATTN_PARTIAL_FOLD counts itself on its
group's arrival counter after storing its partial, and the one that arrives last merges every split
of the group with ATTN_REDUCE's own code, in a fixed order, and signals the O projection's counter
(target: the number of groups). So a folded tape must compute bitwise what the unfolded one
computes, whichever partial is last: in the tape VM over random interleavings of multi-SM (and
pooled) schedules, in the real kernel (the Triton interpreter) for a layer stack, a split O
projection and a whole decoder; the verifier proves it and names broken folded tapes.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import bits, clone_cache, decode_tokens, decoder_weights, rand_x, require_interpreter
from interp import build_layer, layer_step, teardown
from interp.codegen import kernel_source
from opcodes import NO_COUNTER, AttnPartialFold, Layout, ModelConfig, Tiling, kernel_constexprs, kernel_pointers
from opcodes.reference import make_kv_cache, make_weights
from schedule import TapeError, compile_model, verify
from schedule.decoder_program import run_decoder_vm
from schedule.program import lower
from schedule.tape import Tape, decode
from schedule.vm import run_tape

require_interpreter()

CFG = ModelConfig.from_name("small-2layer")
THREE = dataclasses.replace(CFG, layers=3, name="small-3layer")
GQA = ModelConfig.from_name("small-gqa4")
SPLIT_O = dict(o_k=64, red_rows=64)             # O partials: a K chunk holds one KV group (2 x 32 columns)


def _tiling(cfg, fold, **over):
    return Tiling.for_config(cfg, attn_fold=fold, **over)


def _names(tape):
    return [d.ins.NAME for d in decode(tape)]


@pytest.mark.parametrize("cfg,over", [(CFG, {}), (THREE, {}), (THREE, SPLIT_O), (THREE, dict(res_fold=0)),
                                      (GQA, {})], ids=["2layer", "3layer", "split-o", "no-res-fold", "gqa4"])
def test_folded_tape_is_shorter_verified_and_bitwise_in_the_vm(cfg, over):
    w = make_weights(cfg, seed=2)
    x = rand_x(cfg.d, 3)
    outs, lens = [], []
    for fold in (0, 1):
        for sms, policy in ((6, "cost"), (5, "random")):
            c = compile_model(cfg, sms, max_seq=64, tiling=_tiling(cfg, fold, **over), policy=policy, seed=fold + 7)
            verify(c.tape, c.prog)
            names = _names(c.tape)
            lens.append((fold, len(c.tape), names.count("attn_reduce"), names.count("attn_partial_fold")))
            outs += [run_tape(c.tape, w, make_kv_cache(cfg, 64, 30), x, 30, seed=s) for s in (0, 1, 2, 3, None)]
    n_red = cfg.layers * cfg.n_q
    n_part = cfg.layers * cfg.n_kv * _tiling(cfg, 0, **over).attn_splits
    for fold, n, red, part in lens:
        assert (red, part) == ((0, n_part) if fold else (n_red, 0)), lens
        assert n == lens[0][1] - (n_red if fold else 0), lens
    assert all(torch.equal(bits(o), bits(outs[0])) for o in outs[1:])


@pytest.mark.parametrize("pool_us", [0.0, 1e9], ids=["queue", "pool"])
def test_sequential_and_pooled_folded_tapes(pool_us):
    w = make_weights(THREE, seed=3)
    x = rand_x(THREE.d, 4)
    outs = []
    for fold in (0, 1):
        for sms in (1, 4):
            c = compile_model(THREE, sms, max_seq=64, tiling=_tiling(THREE, fold), sequential=sms == 1,
                              pool_us=pool_us)
            verify(c.tape, c.prog, sequential=sms == 1)
            if pool_us:
                assert "attn_partial_fold" in [_names(c.tape)[k] for k in c.tape.pool_range()] or not fold
            outs += [run_tape(c.tape, w, make_kv_cache(THREE, 64, 9), x, 9, seed=s) for s in (0, 5)]
    assert all(torch.equal(bits(o), bits(outs[0])) for o in outs[1:])


def test_the_o_counter_counts_groups():
    lay = Layout(THREE, _tiling(THREE, 1), 64)
    p = lower(lay)
    t = p.targets()
    ca = p.counters.index("attn[1]")
    assert t[ca] == THREE.n_kv                     # one merge per KV group, not one signal per head
    assert len(p.producers()[ca]) == THREE.n_kv * lay.tiling.attn_splits   # any of them may be last
    part = p.counters.index("part[1,0]")
    assert t[part] == 0 and not p.consumers()[part]                  # arrivals only: nothing waits on it
    assert {ins.arrive for ins in p.instrs if isinstance(ins, AttnPartialFold) and ins.layer == 1 and ins.g == 0} \
        == {part}


def test_folded_decoder_tape_bitwise_in_the_vm():
    cfg = dataclasses.replace(CFG, vocab=96, name="small-2layer-v96")
    w = decoder_weights(cfg, seed=6)
    outs = []
    for fold in (0, 1):
        c = compile_model(cfg, 7, max_seq=16, tiling=_tiling(cfg, fold), decoder=True)
        verify(c.tape, c.prog)
        for s in (0, 1, 2):
            lg, tok = run_decoder_vm(c.tape, w, make_kv_cache(cfg, 16, 4), torch.tensor([5]), 4, seed=s)
            outs.append((lg, tok))
    assert all(torch.equal(bits(o[0]), bits(outs[0][0])) and o[1] == outs[0][1] for o in outs[1:])


def test_folded_layers_bitwise_in_the_kernel():
    cfg = THREE
    w = make_weights(cfg, seed=4)
    kv0 = make_kv_cache(cfg, 64, 20)
    outs = []
    for fold, over in ((0, {}), (1, {}), (1, SPLIT_O)):
        kv = clone_cache(kv0)
        h = build_layer(w, kv, cfg.to_dict(), 64, tiling=_tiling(cfg, fold, **over))
        assert ("attn_partial_fold" in _names(h.tape)) == bool(fold)
        ys = [layer_step(h, rand_x(cfg.d, 5 + s), 20 + s).clone() for s in range(2)]   # two calls: epochs 1, 2
        outs.append((ys, [t.clone() for p in kv for t in p]))
        teardown(h)
    for ys, k in outs[1:]:
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(ys, outs[0][0]))
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(k, outs[0][1]))


@pytest.mark.parametrize("n_q,n_kv", [(8, 1), (6, 2), (4, 4)], ids=["group8", "group3", "group1"])
def test_group_sizes_bitwise_in_the_kernel(n_q, n_kv):
    # the merge takes the group's heads four at a time (all loads, then the stores): 8 = 4 + 4, 3, 1
    cfg = dataclasses.replace(CFG, layers=1, n_q=n_q, n_kv=n_kv, name=f"small-q{n_q}-kv{n_kv}")
    w = make_weights(cfg, seed=5)
    x = rand_x(cfg.d, 6)
    kv0 = make_kv_cache(cfg, 32, 11)
    outs = []
    for fold in (0, 1):
        kv = clone_cache(kv0)
        h = build_layer(w, kv, cfg.to_dict(), 32, tiling=_tiling(cfg, fold))
        outs.append(layer_step(h, x, 11).clone())
        teardown(h)
        c = compile_model(cfg, 3, max_seq=32, tiling=_tiling(cfg, fold))
        verify(c.tape, c.prog)
        outs.append(run_tape(c.tape, w, make_kv_cache(cfg, 32, 11), x, 11, seed=fold))
    assert torch.equal(bits(outs[0]), bits(outs[2])) and torch.equal(bits(outs[1]), bits(outs[3]))


def test_folded_decoder_bitwise_in_the_kernel():
    cfg = dataclasses.replace(CFG, vocab=96, name="small-2layer-v96")
    w = decoder_weights(cfg, seed=6)
    logits = [decode_tokens(w, cfg, _tiling(cfg, fold))[0] for fold in (0, 1)]
    assert torch.equal(bits(logits[0]), bits(logits[1]))


def _folded(elide=False):
    c = compile_model(THREE, 4, max_seq=64, tiling=_tiling(THREE, 1), pool_us=0, elide_waits=elide)
    return c.tape, decode(c.tape)


def _with(tape, words):
    return Tape(tape.lay, tape.num_sms, words, tape.offsets, tape.counters, tape.prog_index, {}, tape.pool_counter)


def test_an_o_tile_that_does_not_wait_is_named():
    tape, dec = _folded()
    k = next(d.slot for d in dec if d.ins.NAME == "oproj" and d.ins.layer == 1)
    words = tape.words.clone()
    assert tape.counters[int(words[k, 1])] == "attn[1]"
    words[k, 1], words[k, 2] = NO_COUNTER, 0
    with pytest.raises(TapeError, match=rf"instruction {k} .*reads attn\[.*written by the merge of counter "
                                        rf"\d+ \(part\[1,\d\]\).*which it does not wait for"):
        verify(_with(tape, words))


def test_broken_arrivals_are_named():
    tape, dec = _folded()
    parts = [d for d in dec if d.ins.NAME == "attn_partial_fold" and d.ins.layer == 1]
    # an O tile waiting for one merge too many (the counter counts groups, not partials)
    words = tape.words.clone()
    k = next(d.slot for d in dec if d.ins.NAME == "oproj" and d.ins.layer == 1)
    words[k, 2] += 1
    with pytest.raises(TapeError, match=rf"instruction {k} .*waits on counter \d+ \(attn\[1\]\) for "
                                        rf"{THREE.n_kv + 1}, but it has {THREE.n_kv} producer"):
        verify(_with(tape, words))
    # a partial of group 0 arriving on group 1's counter: group 1 would merge before group 0's partial
    # (and group 0 never completes)
    p0 = next(d for d in parts if d.ins.g == 0)
    p1 = next(d for d in parts if d.ins.g == 1)
    words = tape.words.clone()
    words[p0.slot, 6 + 3] = p1.ins.arrive
    with pytest.raises(TapeError, match=rf"arrives on counter {p1.ins.arrive} \(part\[1,1\]\) with .*differ in "
                                        rf"opcode, merge") as e:
        verify(_with(tape, words))
    assert any(f"instruction {p0.slot} " in m for m in e.value.problems)
    # a partial whose merge would signal another counter than its group's
    words = tape.words.clone()
    words[p0.slot, 5] = tape.counters.index("x1[1]")
    with pytest.raises(TapeError, match=rf"instruction {p0.slot} .*differ in opcode, merge or signalled counter"):
        verify(_with(tape, words))


def test_the_default_kernel_has_no_folded_branch():
    lay = Layout(THREE, _tiling(THREE, 0), 64)
    src = kernel_source(kernel_pointers(lay), kernel_constexprs(lay))
    assert "attn_partial_fold" not in src and "(op != " not in src.split("sig = tl.load(ins + 5)")[1].split("\n")[1]
    lay1 = Layout(THREE, _tiling(THREE, 1), 64)
    src1 = kernel_source(kernel_pointers(lay1, [AttnPartialFold]), kernel_constexprs(lay1, used=[AttnPartialFold]),
                         used=[AttnPartialFold])
    assert f"(op != {AttnPartialFold.OPCODE})" in src1      # it signals itself, only when last


def test_attn_fold_is_checked():
    assert Tiling.for_config(CFG).attn_fold == 0
    with pytest.raises(ValueError, match="attn_fold must be 0 or 1"):
        Tiling(attn_fold=2)
    with pytest.raises(ValueError, match="K chunk must hold whole KV groups"):
        compile_model(CFG, 4, max_seq=64, tiling=_tiling(CFG, 1, o_k=32, red_rows=64))
