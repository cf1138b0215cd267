"""L2_PREFETCH (``Tiling.gu_l2``): each SM that runs an O tile and then a GATE_UP tile asks the L2 for
that tile's first bytes of gate and of up before the O tile's wait (schedule.prefetch).

Where they go in the 1B's tape, what they name, the operand checks, and (through the Triton
interpreter, where the opcode issues nothing) a decoder with them making the logits of one without.
"""
from __future__ import annotations

import collections

import pytest
import torch

from conftest import decoder_weights, require_interpreter
from interp import decode_step
from opcodes import GateUp, L2Prefetch, Layout, ModelConfig, OProj, Tiling
from opcodes.reference import make_kv_cache
from schedule.compile import compile_model
from schedule.verify import TapeError, verify


def _compiled(gu_l2, cfg=None, max_seq=256):
    cfg = cfg or ModelConfig.from_name("llama3.2-1b")
    return compile_model(cfg, 132, max_seq=max_seq, tiling=Tiling.for_config(cfg, max_seq=max_seq, gu_l2=gu_l2))


def test_one_prefetch_before_each_o_tile_that_an_sm_follows_with_gate_up():
    c = _compiled(65536)
    p, lay = c.prog, c.prog.lay
    placed = 0
    for q in c.sched.queues:
        for k, i in enumerate(q):
            ins = p.instrs[i]
            if isinstance(ins, OProj) and k + 1 < len(q) and isinstance(p.instrs[q[k + 1]], GateUp):
                pf, g = p.instrs[q[k - 1]], p.instrs[q[k + 1]]
                assert isinstance(pf, L2Prefetch), f"O tile {ins} has no prefetch before it"
                (ka, oa, _), (kb, ob, _) = g.weight_spans(lay)
                assert (pf.layer, pf.col_a, pf.off_a, pf.col_b, pf.off_b, pf.nbytes) == \
                    (g.layer, Layout.column("gate"), oa, Layout.column("up"), ob, 65536)
                assert (ka, kb) == ("gate", "up") and oa == ob == g.row0 * lay.cfg.d
                placed += 1
            if isinstance(ins, L2Prefetch):      # and nowhere else
                assert isinstance(p.instrs[q[k + 1]], OProj) and isinstance(p.instrs[q[k + 2]], GateUp)
                assert p.waits[i] == () and p.signal[i] < 0
    n = collections.Counter(type(i).__name__ for i in p.instrs)
    assert placed == n["L2Prefetch"] >= 100 * lay.cfg.layers     # the 1B: 128 of its 132 GATE_UP tiles a layer
    assert "l2_prefetch" in {cls.NAME for cls in c.tape.classes()}
    assert "l2_prefetch" not in {cls.NAME for cls in _compiled(0).tape.classes()}


def test_a_span_shorter_than_gu_l2_is_prefetched_whole():
    c = _compiled(1 << 20)      # 1 MB asked; a 1B tile streams 64 rows x 4 KB of each
    pf = [i for i in c.prog.instrs if isinstance(i, L2Prefetch)]
    spans = {(g.layer, g.row0): g.weight_spans(c.prog.lay)[0][2] for g in c.prog.instrs if isinstance(g, GateUp)}
    d = c.prog.lay.cfg.d
    assert pf and {x.nbytes for x in pf} == {s // 1024 * 1024 for s in spans.values()} - {0} != {1 << 20}
    for x in pf:
        assert x.nbytes == spans[(x.layer, x.off_a // d)] // 1024 * 1024


@pytest.mark.parametrize("bad, msg", [
    (dict(col_a=Layout.column("kc")), "col_a"),
    (dict(col_b=Layout.column("in_norm")), "col_b"),
    (dict(nbytes=1000), "nbytes 1000"),
    (dict(off_a=8192 * 2048), "runs past its tensor"),
    (dict(layer=16), "layer 16"),
])
def test_a_bad_prefetch_is_named_by_the_verifier(bad, msg):
    c = _compiled(65536)
    slot = next(k for k, i in enumerate(c.tape.prog_index) if isinstance(c.prog.instrs[i], L2Prefetch))
    good = L2Prefetch.decode(c.tape.words[slot, 6:].tolist())
    fields = dict(zip(L2Prefetch.operand_names(), good.operands()), **bad)
    c.tape.words[slot, 6:6 + len(fields)] = torch.tensor(list(fields.values()), dtype=torch.int32)
    with pytest.raises(TapeError, match=msg):
        verify(c.tape, c.prog)


def test_gu_l2_is_whole_kilobytes():
    with pytest.raises(ValueError, match="gu_l2 must be 0 or a multiple of 1024"):
        Tiling(gu_l2=1000)
    with pytest.raises(ValueError, match="gu_l2 must be a positive int"):
        Tiling(gu_l2=-1024)


CFG = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=120, name="tiny-decoder")


def test_a_decoder_with_prefetches_makes_the_logits_of_one_without(handles):
    require_interpreter()
    w = decoder_weights(CFG, seed=3)
    out = []
    for gu_l2 in (0, 1024):
        kv = make_kv_cache(CFG, 32, 0)
        h = handles.decoder(w, kv, CFG.to_dict(), 32, lm_rows=16, emb_cols=16, pool_us=0,
                            tiling=Tiling.for_config(CFG, max_seq=32, gu_l2=gu_l2))
        assert ("l2_prefetch" in {c.NAME for c in h.tape.classes()}) == bool(gu_l2)
        logits = [decode_step(h, t, pos).clone() for pos, t in enumerate([5, 17, 99, 3])]
        out.append((torch.stack(logits), [x.clone() for pair in kv for x in pair]))
    assert torch.equal(out[0][0], out[1][0])
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))
