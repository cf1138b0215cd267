"""``Tiling.qkv_pairs``: the one-row kernel's QKV tiles as runs of RoPE pairs within one KV group, across its heads
(the 1B at 13 pairs: 128 tiles for the 132 SMs, not 96 of 16; bench/notes/s43.md v170).

The runs cover each section's pairs of a group once, in order; a run that leaves its KV group (whose counter it
signals) or is longer than qkv_pairs is named, by the operand check and by the verifier; each pair's rows are
summed by the same code, so the decoder's logits are bitwise those of the default tiles (Triton interpreter).
"""
from __future__ import annotations

import pytest
import torch

import opcodes
from conftest import decode_tokens, decoder_weights, require_interpreter
from opcodes import ModelConfig, Tiling
from opcodes.qkv import QKV
from schedule import compile_model
from schedule.program import lower, make_layout
from schedule.tape import decode
from schedule.verify import TapeError

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

# hd 16: 8 pairs a head; 2 query heads a KV group: 16 q pairs a group
CFG = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="tiny-decoder")


def test_runs_cover_each_groups_pairs_once():
    one_b = opcodes.PRESETS["llama3.2-1b"]
    lay = make_layout(one_b, 256, Tiling.for_config(one_b, qkv_pairs=13))
    h2 = one_b.hd // 2
    n = 0
    for sec, heads in ((0, one_b.group), (1, 1), (2, 1)):
        for g in range(one_b.n_kv):
            sp = QKV.pair_spans(lay, sec, g)
            pairs = [h * h2 + j + i for h, j, k in sp for i in range(k)]
            first = g * heads * h2
            assert pairs == list(range(first, first + heads * h2)) and max(k for _, _, k in sp) <= 13
            n += len(sp)
    assert n == 128
    tiny = make_layout(CFG, 16, Tiling.for_config(CFG, qkv_pairs=3))
    assert QKV.pair_spans(tiny, 0, 1) == [(2, 0, 3), (2, 3, 3), (2, 6, 3), (3, 1, 3), (3, 4, 2), (3, 6, 2)]
    assert QKV.pair_spans(tiny, 2, 1) == [(1, 0, 3), (1, 3, 3), (1, 6, 2)]


def test_bad_runs_are_named():
    lay = make_layout(CFG, 16, Tiling.for_config(CFG, qkv_pairs=3))
    assert QKV(0, 0, 0, 6, 3).check_operands(lay) == []                  # pairs 6 .. 8: into head 1, group 0
    assert "leave KV group 0" in " ".join(QKV(0, 0, 1, 6, 3).check_operands(lay))     # 14 .. 16: into group 1
    assert "leave KV group 0" in " ".join(QKV(0, 1, 0, 6, 3).check_operands(lay))     # k: one head a group
    assert "n 4 not in (0, qkv_pairs = 3]" in " ".join(QKV(0, 0, 0, 0, 4).check_operands(lay))
    plain = make_layout(CFG, 16, Tiling.for_config(CFG))
    assert "needs Tiling.qkv_pairs" in " ".join(QKV(0, 0, 0, 0, 3).check_operands(plain))
    t = Tiling.for_config(CFG, qkv_pairs=3)
    prog = lower(make_layout(CFG, 16, t))
    i = next(i for i, ins in enumerate(prog.instrs) if isinstance(ins, QKV) and ins.sec == 0 and ins.head == 1
             and ins.j == 6)
    prog.instrs[i] = QKV(0, 0, 1, 6, 3)                                  # pairs 14 .. 16: q of group 1's head 2
    with pytest.raises(TapeError, match="leave KV group"):
        compile_model(CFG, 4, max_seq=16, tiling=t, lowering=lambda _: prog, pool_us=0)
    with pytest.raises(ValueError, match="qkv_pairs"):
        Tiling(qkv_pairs=-1)


def test_decoder_logits_bitwise_with_runs_of_pairs():
    w = decoder_weights(CFG, 0)
    base = decode_tokens(w, CFG, Tiling.for_config(CFG), (5, 17), max_seq=16)
    runs = decode_tokens(w, CFG, Tiling.for_config(CFG, qkv_pairs=3), (5, 17), max_seq=16)
    assert base[0].shape == (2, CFG.vocab) and torch.isfinite(base[0]).all()
    assert torch.equal(base[0], runs[0]) and base[1] == runs[1]


def test_the_vm_runs_the_runs_against_the_eager_reference():
    """The tape VM (each opcode's torch twin) on a decoder tape of runs of pairs, against the eager reference: each
    run writes its pairs' q / K / V where the reference puts them, across heads."""
    from opcodes.decoder import decoder_ref
    from opcodes.reference import make_kv_cache, rel_err
    from schedule.decoder_program import run_decoder_vm
    w = decoder_weights(CFG, 1)
    tape = compile_model(CFG, 4, max_seq=16, tiling=Tiling.for_config(CFG, qkv_pairs=3), pool_us=0,
                         decoder=True).tape
    assert {d.ins.n for d in decode(tape) if isinstance(d.ins, QKV)} == {2, 3}
    kv, kv_ref = make_kv_cache(CFG, 16, 0), make_kv_cache(CFG, 16, 0)
    for p, t in enumerate((5, 17, 3, 9, 11, 2)):
        logits, _ = run_decoder_vm(tape, w, kv, t, p)
        assert rel_err(logits, decoder_ref(w, kv_ref, CFG, t, p)) <= 2e-2, p
