"""QKV as spans of RoPE-pair blocks (``Tiling.qkv_span``, opcodes/qkv_span.py): the QKV stage cut into a
given number of instructions, each a contiguous range of one KV group's blocks in one row loop.

A row's dot is summed in another order than the column loop's, so a span tape is not bitwise the tile
tape; it is within fp32 rounding of it, and every span tape computes bitwise the same thing whatever
the instruction count, the schedule or the SM that runs a block (each row's sum is one block's)."""
from __future__ import annotations

import pytest
import torch

from conftest import bits, clone_cache, rand_x, require_interpreter
from interp import build_decoder, build_layer, decode_step, layer_step, teardown
from opcodes import ModelConfig, QKVSpan, Tiling, kernel_constexprs
from opcodes import qkv_span as qs
from opcodes.base import kernel_classes
from opcodes.reference import make_kv_cache, make_weights, model_ref, rel_err
from schedule import compile_model, lower, make_layout
from schedule.decoder_program import lower_decoder
from schedule.tape import decode
from schedule.vm import run_tape

require_interpreter()

CFG = ModelConfig.from_name("small-2layer")       # d 128, hd 32 (16 pairs), n_q 4, n_kv 2: group 2
ROW_BYTES = 2048                                   # 2048 / (2 * 2 * 128) = 4 pairs a block: 4 blocks a head


def _tiling(span: int, **over) -> Tiling:
    return Tiling.for_config(CFG, row_bytes=ROW_BYTES, qkv_span=span, **over)


def test_spans_cover_every_block_of_every_group_once():
    lay = make_layout(CFG, 64, _tiling(5))
    assert qs.span_pairs(lay) == 4 and qs.blocks_per_head(lay) == 4 and qs.blocks_per_group(lay) == 16
    sp = qs.spans(lay)
    assert [len(g) for g in sp] == [3, 2]                      # 5 instructions: the first group one more
    for gs in sp:
        covered = [b for b0, nb in gs for b in range(b0, b0 + nb)]
        assert covered == list(range(16))
        assert max(nb for _, nb in gs) - min(nb for _, nb in gs) <= 1
    # a span's blocks: query heads of its group, then its K head, then its V head, pairs in order
    blocks = QKVSpan(0, 1, 6, 7).blocks(lay)
    assert blocks[0] == (0, 3, 8, 12) and blocks[2] == (1, 1, 0, 4) and blocks[-1] == (2, 1, 0, 4) and len(blocks) == 7


def test_span_program_counters():
    lay = make_layout(CFG, 64, _tiling(7))
    p = lower(lay)
    names = [type(i).NAME for i in p.instrs]
    assert "qkv" not in names and names.count("qkv_span") == 7 * CFG.layers
    assert not any(n.startswith("kv[") for n in p.counters)
    tg = dict(zip(p.counters, p.targets()))
    assert [tg[f"q[0,{g}]"] for g in range(CFG.n_kv)] == [4, 3]
    # every attention partial of a group waits on its group's counter, once
    for ins, ws in zip(p.instrs, p.waits):
        if ins.NAME == "attn_partial":
            assert [p.counters[c] for c in ws] == [f"q[{ins.layer},{ins.g}]"]


@pytest.mark.parametrize("span", [2, 5, 32])
def test_span_tapes_match_the_tile_tape_in_the_vm(span):
    w = make_weights(CFG, seed=3)
    x = rand_x(CFG.d, 4)
    kv0 = make_kv_cache(CFG, 64, 21)
    kv_tile, kv_span, kv_span2 = clone_cache(kv0), clone_cache(kv0), clone_cache(kv0)
    t_tile = compile_model(CFG, 5, max_seq=64, tiling=Tiling.for_config(CFG, row_bytes=ROW_BYTES), pool_us=0).tape
    t_span = compile_model(CFG, 5, max_seq=64, tiling=_tiling(span), pool_us=0).tape
    t_rand = compile_model(CFG, 3, max_seq=64, tiling=_tiling(span), policy="random", seed=1).tape
    ref = model_ref(w, clone_cache(kv0), CFG, x, 21)
    a = run_tape(t_tile, w, kv_tile, x, 21, seed=0)
    b = run_tape(t_span, w, kv_span, x, 21, seed=1)
    c = run_tape(t_rand, w, kv_span2, x, 21, seed=2)
    assert rel_err(b, a) < 1e-2 and rel_err(b, ref) < 1.5e-2
    assert torch.equal(bits(b), bits(c))                       # schedule-invariant, bitwise
    for (k0, v0), (k1, v1) in zip(kv_span, kv_span2):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_span_kernel_matches_the_vm_and_is_bitwise_across_span_counts():
    # the real kernel (Triton interpreter), two calls: within fp32 rounding of the VM (torch sums in its
    # own order), and bitwise the same for any instruction count (each row's sum is one block's)
    w = make_weights(CFG, seed=6)
    kv0 = make_kv_cache(CFG, 64, 30)
    kvs = [clone_cache(kv0) for _ in range(3)]
    hs = [build_layer(w, kv, CFG.to_dict(), 64, tiling=_tiling(n)) for n, kv in zip((6, 3), kvs)]
    assert all("qkv_span" in {d.ins.NAME for d in decode(h.tape)} for h in hs)
    for pos, seed in ((30, 7), (31, 8)):
        x = rand_x(CFG.d, seed)
        got = [layer_step(h, x, pos).clone() for h in hs]
        want = run_tape(hs[0].tape, w, kvs[2], x, pos, seed=0)
        assert torch.equal(bits(got[0]), bits(got[1]))
        assert rel_err(got[0].float(), want.float()) < 1e-2
        for (k0, v0), (k1, v1), (k2, v2) in zip(*kvs):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
            assert rel_err(k0[:, :, pos].float(), k2[:, :, pos].float()) < 1e-2
            assert rel_err(v0[:, :, pos].float(), v2[:, :, pos].float()) < 1e-2
    for h in hs:
        teardown(h)


def test_span_decoder_kernel_matches_the_tile_decoder():
    cfg = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="tiny-decoder")
    from tests.test_decoder import decoder_weights
    w = decoder_weights(cfg)
    kv0 = make_kv_cache(cfg, 32, 5, seed=2)
    tiling = Tiling.for_config(cfg, row_bytes=256, qkv_span=5)     # 256 / (4 * 64) = 1 pair a block
    h = build_decoder(w, clone_cache(kv0), cfg, 32, tiling=tiling)
    h_tile = build_decoder(w, clone_cache(kv0), cfg, 32, tiling=Tiling.for_config(cfg, row_bytes=256))
    tok = 11
    for pos in range(5, 8):
        lg = decode_step(h, tok, pos)
        lg_t = decode_step(h_tile, tok, pos)
        assert rel_err(lg, lg_t) < 1e-2
        top2 = lg_t.topk(2).values[0]
        if top2[0] - top2[1] > 0.1:
            assert int(torch.argmax(lg)) == int(torch.argmax(lg_t))
        tok = int(torch.argmax(lg_t))
    teardown(h)
    teardown(h_tile)


def test_span_opcode_is_only_in_the_kernels_that_use_it():
    assert QKVSpan not in kernel_classes()
    assert QKVSpan in kernel_classes({QKVSpan})
    lay = make_layout(CFG, 64, _tiling(4))
    assert kernel_constexprs(lay, used={QKVSpan})["SPAN_PAIRS"] == 4


def test_bad_spans_are_named():
    with pytest.raises(ValueError, match=r"qkv_span = 1 must be 0 \(QKV tiles\) or in \[2, 32\]"):
        lower(make_layout(CFG, 64, _tiling(1)))
    with pytest.raises(ValueError, match="qkv_span = 33"):
        lower(make_layout(CFG, 64, _tiling(33)))
    with pytest.raises(ValueError, match="qkv_span must be a positive int"):
        Tiling(qkv_span=-1)
    lay = make_layout(CFG, 64, _tiling(4))
    assert QKVSpan(0, 0, 15, 2).check_operands(lay) == ["nb 2 not in [1, 1] (blocks 15.. of 16)"]
    assert QKVSpan(2, 2, 16, 1).check_operands(lay) == ["layer 2 not in [0, 2)", "g 2 not in [0, 2)",
                                                         "b0 16 not in [0, 16)", "nb 1 not in [1, 0] (blocks 16.. of 16)"]
