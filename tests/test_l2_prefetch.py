"""L2_PREFETCH (``Tiling.wo_l2`` / ``gu_l2``): the SMs with neither a QKV tile nor the attention of a layer
ask the L2 for the layer's Wo (and GATE_UP's first bytes) as its QKV stage starts (schedule.prefetch).

Where they go in the 1B's tape, what they name and wait on, the operand checks, and (through the Triton
interpreter, where the opcode issues nothing) a decoder with them making the logits of one without.
"""
from __future__ import annotations

import pytest
import torch

from conftest import bits, rand_x
from opcodes import AttnPartial, GateUp, L2Prefetch, Layout, ModelConfig, QKV, Tiling
from opcodes.reference import make_kv_cache, make_weights
from schedule.compile import compile_model
from schedule.tape import decode
from schedule.verify import TapeError, verify
from schedule.vm import run_tape

ONEB = ModelConfig.from_name("llama3.2-1b")


def _compiled(cfg=ONEB, max_seq=256, **kw):
    return compile_model(cfg, 132, max_seq=max_seq, tiling=Tiling.for_config(cfg, max_seq=max_seq, **kw))


def _covered(pf, col, numel):
    """Bytes of a layer tensor the prefetches ``pf`` name, as a set of 1 KB blocks."""
    got = set()
    for x in pf:
        for c, off in ((x.col_a, x.off_a), (x.col_b, x.off_b)):
            if c == col:
                got.update(range(2 * off // 1024, (2 * off + x.nbytes) // 1024))
    return got


def test_the_idle_sms_of_each_layer_prefetch_its_whole_wo_as_qkv_starts():
    c = _compiled(wo_l2=1)
    p, lay = c.prog, c.prog.lay
    d = lay.cfg.d
    for l in range(lay.cfg.layers):
        busy = {sm for sm, q in enumerate(c.sched.queues) for i in q
                if isinstance(p.instrs[i], (QKV, AttnPartial)) and p.instrs[i].layer == l}
        qkv_waits = {p.waits[i] for i, ins in enumerate(p.instrs) if isinstance(ins, QKV) and ins.layer == l}
        assert len(qkv_waits) == 1
        pf = []
        for sm, q in enumerate(c.sched.queues):
            mine = [k for k, i in enumerate(q) if isinstance(p.instrs[i], L2Prefetch) and p.instrs[i].layer == l]
            if not mine:
                continue
            assert sm not in busy, f"layer {l}: SM {sm} runs QKV or the attention and prefetches"
            # just before the SM's first instruction of the layer, waiting as QKV waits, signalling nothing
            nxt = p.instrs[q[mine[-1] + 1]]
            assert getattr(nxt, "layer", None) == l and not isinstance(nxt, L2Prefetch)
            assert all(getattr(p.instrs[i], "layer", None) != l for i in q[:mine[0]])
            for k in mine:
                assert p.waits[q[k]] in qkv_waits and p.signal[q[k]] < 0
                pf.append(p.instrs[q[k]])
        assert len({id(x) for x in pf}) == len(pf) and 20 <= len(pf) <= 132 - len(busy)
        assert _covered(pf, Layout.column("o"), d * d) == set(range(2 * d * d // 1024)), f"layer {l}: Wo not covered"
    assert "l2_prefetch" in {cls.NAME for cls in c.tape.classes()}
    assert "l2_prefetch" not in {cls.NAME for cls in _compiled().tape.classes()}


def test_gu_l2_adds_the_first_bytes_of_every_gate_up_tile():
    c = _compiled(gu_l2=65536)
    p, lay = c.prog, c.prog.lay
    pf = [x for x in p.instrs if isinstance(x, L2Prefetch) and x.layer == 3]
    assert pf and all(x.col_a == Layout.column("gate") and x.col_b == Layout.column("up") for x in pf)
    tiles = [g for g in p.instrs if isinstance(g, GateUp) and g.layer == 3]
    want = {(g.row0 * lay.cfg.d, min(65536, 2 * g.rows * lay.cfg.d) // 1024 * 1024) for g in tiles}
    assert {(x.off_a, x.nbytes) for x in pf} == want and all(x.off_a == x.off_b for x in pf)
    assert len(pf) == len(tiles) == 132


@pytest.mark.parametrize("bad, msg", [
    (dict(col_a=Layout.column("kc")), "col_a"),
    (dict(col_b=Layout.column("in_norm")), "col_b"),
    (dict(nbytes=1000), "nbytes 1000"),
    (dict(off_a=2048 * 2048), "runs past its tensor"),
    (dict(layer=16), "layer 16"),
])
def test_a_bad_prefetch_is_named_by_the_verifier(bad, msg):
    c = _compiled(wo_l2=1)
    slot = next(k for k, i in enumerate(c.tape.prog_index) if isinstance(c.prog.instrs[i], L2Prefetch))
    good = L2Prefetch.decode(c.tape.words[slot, 6:].tolist())
    fields = dict(zip(L2Prefetch.operand_names(), good.operands()), **bad)
    c.tape.words[slot, 6:6 + len(fields)] = torch.tensor(list(fields.values()), dtype=torch.int32)
    with pytest.raises(TapeError, match=msg):
        verify(c.tape, c.prog)


def test_the_options_are_checked():
    with pytest.raises(ValueError, match="gu_l2 must be 0 or a multiple of 1024"):
        Tiling(gu_l2=1000)
    with pytest.raises(ValueError, match="gu_l2 must be a positive int"):
        Tiling(gu_l2=-1024)
    with pytest.raises(ValueError, match="wo_l2 must be 0 or 1"):
        Tiling(wo_l2=2)


def test_a_tape_with_prefetches_computes_what_one_without_does():
    # the VM (any interleaving of the SMs) runs the opcode's torch form: nothing; on the GPU it issues
    # copies into the L2 only. Same output and cache rows, bitwise, with and without
    cfg = ModelConfig.from_name("small-2layer")
    w = make_weights(cfg, seed=2)
    x = rand_x(cfg.d, 3)
    outs, kvs = [], []
    for kw in ({}, {"wo_l2": 1, "gu_l2": 1024}):
        c = compile_model(cfg, 64, max_seq=64, tiling=Tiling.for_config(cfg, **kw), pool_us=0)
        names = [d.ins.NAME for d in decode(c.tape)]
        assert (names.count("l2_prefetch") > 0) == bool(kw), names.count("l2_prefetch")
        for s in (0, 1, 2):
            kv = make_kv_cache(cfg, 64, 30)
            outs.append(run_tape(c.tape, w, kv, x, 30, seed=s))
            kvs.append([t.clone() for pair in kv for t in pair])
    assert all(torch.equal(bits(o), bits(outs[0])) for o in outs[1:])
    assert all(torch.equal(a, b) for k in kvs[1:] for a, b in zip(k, kvs[0]))
