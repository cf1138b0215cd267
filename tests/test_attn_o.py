"""``Tiling.attn_o``: no O stage. ATTN_O tiles each compute one KV group's merged attention and the group's
part of the O projection for a row tile (a partial of x1, in OPROJ's ``opart``), and GATE_UP sums the layer
input and the groups' partials into x1 itself (the tile at row 0 writing it for the next layer).

Through the Triton interpreter and the tape VM: a decoder's logits and tokens against the merged attention's
O stage and against ``decoder_ref``, with GATE_UP's vector in both layouts (across the CTA, one row a warp);
a layer's output and cache; the program's shape; the combinations it refuses; a wait inside that fails.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import interp
import opcodes
from conftest import bitwise_equal, check_message, decode_tokens, decoder_weights, require_interpreter
from interp import build_layer, layer_step, teardown
from opcodes import HEADER, Layout, ModelConfig, Tiling
from opcodes.attn_o import AttnO
from opcodes.decoder import decoder_ref
from opcodes.gate_up import GateUp
from opcodes.reference import make_kv_cache, make_weights, rel_err
from schedule import compile_model, lower
from schedule.decoder_program import lower_decoder, run_decoder_vm

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CFG = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="tiny-decoder")
# d 256: GATE_UP's vector one row a warp (Tiling.warp_rows), the 1B's layout
WIDE = ModelConfig(layers=2, d=256, ffn=256, n_q=4, n_kv=2, hd=64, theta=10000.0, vocab=160, name="wide-decoder")
MAX_SEQ = 32
TOKS = (5, 17, 3, 9, 11, 2, 7, 19, 23, 4, 8, 13, 6, 1, 15, 12, 14, 10)
MERGED = dict(attn_splits=1, gu_rows=32, attn_block=16)     # several key blocks a call from pos 16


def test_attn_o_is_checked_and_off_by_default():
    for name in ("llama3.2-1b", "llama3.1-8b", "llama70b-layer"):
        assert Tiling.for_config(opcodes.PRESETS[name], max_seq=256).attn_o == 0, name
    for bad, what in ((dict(attn_o=2), "attn_o"), (dict(attn_o=True), "attn_o"), (dict(ao_rows=24), "ao_rows")):
        with pytest.raises(ValueError, match=what):
            Tiling.for_config(CFG, **bad)
    cfg = dataclasses.replace(CFG, vocab=0)
    for over, what in ((dict(attn_splits=2), "attn_splits = 1"), (dict(attn_splits=1, o_k=32), "one O K chunk"),
                       (dict(attn_splits=1, row_bytes=0), "row loop")):
        with pytest.raises(ValueError, match=what):
            lower(Layout(cfg, Tiling.for_config(cfg, attn_o=1, **over), MAX_SEQ))


@pytest.mark.parametrize("ao_rows", [16, 64])
def test_program_has_no_o_stage(ao_rows):
    cfg = dataclasses.replace(CFG, vocab=0)
    lay = Layout(cfg, Tiling.for_config(cfg, attn_o=1, ao_rows=ao_rows, **MERGED), MAX_SEQ)
    p = lower(lay)
    names = [ins.NAME for ins in p.instrs]
    assert {"oproj", "o_reduce", "attn_partial", "attn_reduce"}.isdisjoint(names)
    ao = [i for i, n in enumerate(names) if n == "attn_o"]
    assert len(ao) == cfg.layers * cfg.n_kv * (cfg.d // ao_rows)
    for l in range(cfg.layers):
        cx = p.counters.index(f"x1[{l}]")
        mine = [i for i in ao if p.instrs[i].layer == l]
        assert {p.signal[i] for i in mine} == {cx}
        gu = [i for i, ins in enumerate(p.instrs) if ins.NAME == "gate_up" and ins.layer == l]
        assert all(p.waits[i] == (cx,) for i in gu)
        # one GATE_UP tile a layer writes x1 (the one at row 0); every one reads every group's partial
        assert [i for i in gu if any(r.buf == "x1" for r in p.instrs[i].writes(lay))] == [gu[0]]
        assert p.instrs[gu[0]].row0 == 0
    comp = compile_model(cfg, 4, max_seq=MAX_SEQ, tiling=lay.tiling)          # the verifier passes it
    assert AttnO in comp.prog.classes()


@pytest.mark.parametrize("cfg,ao_rows", [(CFG, 16), (CFG, 64), (WIDE, 128)], ids=["tiny-16", "tiny-64", "wide-128"])
def test_decoder_logits_and_tokens_with_attn_o(cfg, ao_rows):
    """The O projection summed per group then over groups (in GATE_UP) instead of in one row: logits within
    fp32 reordering of the O stage's, and of ``decoder_ref``; the same greedy tokens."""
    w = decoder_weights(cfg, 0)
    base = decode_tokens(w, cfg, Tiling.for_config(cfg, **MERGED), TOKS[:6], MAX_SEQ)
    til = Tiling.for_config(cfg, attn_o=1, ao_rows=ao_rows, **MERGED)
    assert GateUp.CONSTEXPRS["AO_FOLD"](opcodes.DecoderLayout(cfg, til, MAX_SEQ)) == cfg.n_kv
    assert til.warp_rows == int(cfg is WIDE)
    ao = decode_tokens(w, cfg, til, TOKS[:6], MAX_SEQ)
    torch.testing.assert_close(ao[0], base[0], rtol=1e-3, atol=1e-3)
    assert ao[1] == base[1]
    kv = make_kv_cache(cfg, MAX_SEQ, 0)
    for p, t in enumerate(TOKS[:6]):
        assert rel_err(ao[0][p:p + 1], decoder_ref(w, kv, cfg, t, p)) <= 2e-2, p


def test_tape_vm_runs_attn_o():
    """The VM (each opcode's torch twin) on a compiled decoder tape, against the eager reference."""
    w = decoder_weights(CFG, 1)
    til = Tiling.for_config(CFG, attn_o=1, ao_rows=32, **MERGED)
    comp = compile_model(CFG, 8, max_seq=MAX_SEQ, tiling=til, lowering=lower_decoder)
    assert "oproj" not in {type(i).NAME for i in comp.prog.instrs}
    kv = make_kv_cache(CFG, MAX_SEQ, 0)
    kv_ref = make_kv_cache(CFG, MAX_SEQ, 0)
    for p, t in enumerate(TOKS):
        logits, _ = run_decoder_vm(comp.tape, w, kv, t, p)
        assert rel_err(logits, decoder_ref(w, kv_ref, CFG, t, p)) <= 2e-2, p


def test_layer_output_and_cache_with_attn_o():
    cfg = dataclasses.replace(CFG, vocab=0)
    outs, caches = [], []
    for ao in (0, 1):
        kv = make_kv_cache(cfg, MAX_SEQ, 21, seed=4)
        til = Tiling.for_config(cfg, attn_o=ao, ao_rows=32, **MERGED)
        h = build_layer(make_weights(cfg, seed=3), kv, cfg.to_dict(), MAX_SEQ, tiling=til)
        x = torch.randn(1, cfg.d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        outs.append(layer_step(h, x, 21).float())
        caches.append([t.clone() for p in kv for t in p])
        teardown(h)
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)
    assert all(bitwise_equal(a, b) for a, b in zip(caches[0], caches[1]))


@pytest.mark.parametrize("delta,names", [(1, ["after 2000 polls"]), (-1, ["past"])], ids=["short", "past"])
def test_a_wait_inside_attn_o_fails_as_the_kernels_own(delta, names):
    """ATTN_O makes its waits itself (after its prefix's K/V loads): a wait short of its target or past it
    is the kernel's MegakernelError naming it, and the tile stores nothing (its partial as before)."""
    cfg = dataclasses.replace(CFG, vocab=0)
    til = Tiling.for_config(cfg, attn_o=1, ao_rows=32, **MERGED)
    tape = compile_model(cfg, 1, max_seq=MAX_SEQ, tiling=til, sequential=True).tape
    k = next(j for j in range(len(tape)) if int(tape.words[j, 0]) == AttnO.OPCODE and int(tape.words[j, 1]) >= 0)
    w = tape.words.clone()
    w[k, 2] += delta
    broken = dataclasses.replace(tape, words=w)
    kv = make_kv_cache(cfg, MAX_SEQ, 21, seed=4)
    h = build_layer(make_weights(cfg, seed=3), kv, cfg.to_dict(), MAX_SEQ, tape=broken, verify_tape=False,
                    spin_limit=2000)
    out = h.buffers["opart_ptr"]
    out.fill_(7.0)
    x = torch.randn(1, cfg.d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with pytest.raises(interp.MegakernelError) as ei:
        layer_step(h, x, 21)
    check_message(ei.value, [f"instruction {k}", "attn_o", broken.counters[int(w[k, 1])]] + names)
    assert [st[1] for st in ei.value.stuck] == [k]
    ins = AttnO(*[int(v) for v in broken.words[k, HEADER:HEADER + 3]])
    (region,) = ins.writes(h.lay)
    assert bitwise_equal(out.view(-1)[region.lo:region.hi], torch.full((region.hi - region.lo,), 7.0))
    teardown(h)
