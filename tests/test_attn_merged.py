"""``Tiling.attn_splits = 1``: one ATTN_PARTIAL a KV head attends to every key ``[0, pos]`` (the one this
call writes included, after the K/V tiles) and writes the merged attention output itself; the program has
no ATTN_REDUCE and the O tiles wait on the attention instructions directly.

Through the Triton interpreter and the tape VM: a layer stack against ``model_ref`` over a prefilled cache
(the K/V rows at other positions untouched), a decoder's logits against ``decoder_ref`` and its greedy
tokens against the split attention's; the program's shape; the combinations it refuses.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import interp
from conftest import bitwise_equal, check_message, clone_cache, decode_tokens, decoder_weights, require_interpreter
from interp import build_layer, build_model, layer_step, model_step, teardown
from opcodes import HEADER, DecoderLayout, Layout, ModelConfig, Tiling
from opcodes.attn_partial import AttnPartial
from opcodes.decoder import decoder_ref
from opcodes.reference import make_kv_cache, make_weights, model_ref, rel_err
from schedule import compile_model, lower
from schedule.decoder_program import lower_decoder, run_decoder_vm

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CFG = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="tiny-decoder")
MAX_SEQ = 48
MERGED = dict(attn_splits=1, gu_rows=32, attn_block=16)     # blocks of 16 keys: several a call at pos >= 16


def test_program_has_one_attention_instruction_a_kv_head_and_no_merge():
    lay = Layout(dataclasses.replace(CFG, vocab=0), Tiling.for_config(CFG, **MERGED), MAX_SEQ)
    assert lay.attn_merged and lay.attn_instr_splits == 1
    p = lower(lay)
    names = [ins.NAME for ins in p.instrs]
    assert "attn_reduce" not in names
    attn = [i for i, ins in enumerate(p.instrs) if ins.NAME == "attn_partial"]
    assert len(attn) == CFG.layers * CFG.n_kv
    for i in attn:
        ins = p.instrs[i]
        assert ins.s == 0
        waits = {p.counters[c] for c in p.waits[i]}
        assert waits == {f"q[{ins.layer},{ins.g}]", f"kv[{ins.layer},{ins.g}]"}, waits
        assert p.counters[p.signal[i]] == f"attn[{ins.layer}]"
        # it writes the merged output of its group's heads, and nothing else
        regions = ins.writes(lay)
        assert [r.buf for r in regions] == ["attn"]
        assert regions[0].hi - regions[0].lo == CFG.group * CFG.hd
    # the O tiles wait on those instructions' counter
    o = [i for i, ins in enumerate(p.instrs) if ins.NAME == "oproj"]
    assert all({p.counters[c] for c in p.waits[i]} == {f"attn[{p.instrs[i].layer}]"} for i in o)


def test_merged_attention_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="key_in_reduce"):
        Tiling.for_config(CFG, attn_splits=1, key_in_reduce=1)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="attn_splits"):
            Tiling.for_config(CFG, attn_splits=bad)
    # an O K chunk of one head (group 2) would split a KV group's output over two counters
    lay = Layout(dataclasses.replace(CFG, vocab=0), Tiling.for_config(CFG, attn_splits=1, o_k=16), MAX_SEQ)
    with pytest.raises(ValueError, match="o_k"):
        lower(lay)


def test_layer_stack_matches_reference_over_a_prefilled_cache():
    cfg = dataclasses.replace(CFG, vocab=0)
    w = make_weights(cfg, seed=3)
    kv = make_kv_cache(cfg, MAX_SEQ, 37, seed=4)
    kv_ref = clone_cache(kv)
    h = build_model(w, kv, cfg.to_dict(), MAX_SEQ, tiling=Tiling.for_config(cfg, **MERGED))
    g = torch.Generator().manual_seed(5)
    for pos in (37, 38, 47):          # 38-48 keys: three blocks of 16, the last one partial
        x = torch.randn(1, cfg.d, generator=g).to(torch.bfloat16)
        before = clone_cache(kv)
        y = model_step(h, x, pos)
        ref = model_ref(w, kv_ref, cfg, x, pos)
        assert rel_err(y, ref) <= 1.5e-2, pos
        for l in range(cfg.layers):
            for j in range(2):
                others = torch.ones(MAX_SEQ, dtype=torch.bool)
                others[pos] = False
                assert torch.equal(kv[l][j][:, :, others], before[l][j][:, :, others])
                assert rel_err(kv[l][j][:, :, pos], kv_ref[l][j][:, :, pos]) <= 1.5e-2
    teardown(h)


def test_decoder_logits_and_tokens_with_merged_attention(runslow):
    """The merged attention's logits against the reference at every position; with ``--runslow`` also its
    greedy tokens against the split attention's (a second 20-step decode, ~10 s: the split attention's
    decoder runs by default in test_decoder, test_hf and others)."""
    w = decoder_weights(CFG, 0)
    toks = (5, 17, 3, 9, 11, 2, 7, 19, 23, 4, 8, 13, 6, 1, 15, 12, 14, 10, 18, 20)   # 20 positions: 2 blocks
    merged = decode_tokens(w, CFG, Tiling.for_config(CFG, **MERGED), toks, MAX_SEQ)
    kv = make_kv_cache(CFG, MAX_SEQ, 0)
    for p, t in enumerate(toks):
        ref = decoder_ref(w, kv, CFG, t, p)
        assert rel_err(merged[0][p:p + 1], ref) <= 2e-2, p
    if runslow:
        split = decode_tokens(w, CFG, Tiling.for_config(CFG, attn_splits=2, gu_rows=32, attn_block=16), toks, MAX_SEQ)
        assert merged[1] == split[1]


def test_tape_vm_runs_the_merged_attention():
    """The VM (each opcode's torch twin) on a compiled decoder tape, against the eager reference."""
    w = decoder_weights(CFG, 1)
    comp = compile_model(CFG, 8, max_seq=MAX_SEQ, tiling=Tiling.for_config(CFG, **MERGED), lowering=lower_decoder)
    tape = comp.tape
    assert isinstance(tape.lay, DecoderLayout) and "attn_reduce" not in {type(i).NAME for i in comp.prog.instrs}
    kv = make_kv_cache(CFG, MAX_SEQ, 0)
    kv_ref = make_kv_cache(CFG, MAX_SEQ, 0)
    for p, t in enumerate((5, 17, 3, 9, 11, 2, 7, 19, 23, 4, 8, 13, 6, 1, 15, 12, 14, 10)):
        logits, _ = run_decoder_vm(tape, w, kv, t, p)
        assert rel_err(logits, decoder_ref(w, kv_ref, CFG, t, p)) <= 2e-2, p
    assert AttnPartial.CONSTEXPRS["SPLITS"](tape.lay) == 1


@pytest.mark.parametrize("delta,names", [(1, ["after 2000 polls"]), (-1, ["past"])], ids=["short", "past"])
@pytest.mark.parametrize("pos", [0, 21], ids=["no-prefix", "prefix"])
def test_a_wait_inside_the_whole_attention_fails_as_the_kernels_own(delta, names, pos):
    """The instruction makes its waits itself (after its prefix's K/V loads, or first with no prefix): a wait
    that is short of its target or past it is the kernel's MegakernelError naming it, and the instruction
    stores nothing (its heads' attention output as before the call)."""
    cfg = dataclasses.replace(CFG, vocab=0)
    tape = compile_model(cfg, 1, max_seq=MAX_SEQ, tiling=Tiling.for_config(cfg, **MERGED), sequential=True).tape
    k = next(j for j in range(len(tape)) if int(tape.words[j, 0]) == AttnPartial.OPCODE and int(tape.words[j, 1]) >= 0)
    w = tape.words.clone()
    w[k, 2] += delta
    broken = dataclasses.replace(tape, words=w)
    kv = make_kv_cache(cfg, MAX_SEQ, pos, seed=4)
    h = build_layer(make_weights(cfg, seed=3), kv, cfg.to_dict(), MAX_SEQ, tape=broken, verify_tape=False,
                    spin_limit=2000)
    out = h.buffers["attn_ptr"]
    out.fill_(7.0)
    x = torch.randn(1, cfg.d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with pytest.raises(interp.MegakernelError) as ei:
        layer_step(h, x, pos)
    check_message(ei.value, [f"instruction {k}", "attn_partial", broken.counters[int(w[k, 1])]] + names)
    assert [st[1] for st in ei.value.stuck] == [k]
    ins = AttnPartial(*[int(v) for v in broken.words[k, HEADER:HEADER + 3]])
    (region,) = ins.writes(h.lay)
    assert bitwise_equal(out.view(-1)[region.lo:region.hi], torch.full((region.hi - region.lo,), 7.0))
    teardown(h)
