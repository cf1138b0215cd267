"""Tensor-parallel tapes (2 ranks) on the CPU: ``compile_model(..., tp=2)``, the cross-rank verifier
``verify_tp`` and the two-rank tape VM ``run_tp``, against the TP reference and the unsharded one."""
from __future__ import annotations

import pytest
import torch

from opcodes import PRESETS, REGISTRY, Layout, Tiling, TPPush, TPReduce
from opcodes.reference import make_kv_cache, make_weights, model_ref, rel_err
from opcodes.tp import TPLayout, shard_kv_cache, shard_weights, tp_model_ref
from schedule import compile_model, verify_tp
from schedule.tape import Tape
from schedule.verify import TapeError
from schedule.vm import run_tape, run_tp

CFG2 = PRESETS["small-2layer"]            # d=128, ffn=320, n_q=4, n_kv=2, hd=32: 2 q heads, 1 KV head per rank
MAX_SEQ, POS = 64, 19


def _cfg(layers: int):
    import dataclasses
    return CFG2 if layers == 2 else dataclasses.replace(CFG2, layers=1, name="small-1layer")


def _x(seed: int = 3) -> torch.Tensor:
    return torch.randn(1, CFG2.d, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _tp_ref(cfg, w, x, pos, calls=1):
    kv = make_kv_cache(cfg, MAX_SEQ, pos)
    shards = [shard_weights(w, cfg, r, 2) for r in range(2)]
    caches = [shard_kv_cache(kv, cfg, r, 2) for r in range(2)]
    for k in range(calls):
        x = tp_model_ref(shards, caches, cfg, x, pos + k)
    return x


def _ref(cfg, w, x, pos, calls=1):
    kv = make_kv_cache(cfg, MAX_SEQ, pos)
    for k in range(calls):
        x = model_ref(w, kv, cfg, x, pos + k)
    return x, kv


# red_rows 64: two all-reduce row blocks per stage; o_k 32: a split O projection on each rank
TILINGS = {"default": None, "blocks": dict(red_rows=64, down_rows=32, o_rows=32),
           "split-o": dict(o_k=32, red_rows=64, o_rows=32, down_rows=32)}


def _compile(cfg, sms=3, tiling=None, **kw):
    t = Tiling.for_config(TPLayout.of(cfg, 0, 2).cfg, **tiling) if tiling else None
    return compile_model(cfg, sms, max_seq=MAX_SEQ, tiling=t, tp=2, decoder=False, **kw)


def test_tp1_is_unchanged_and_tp2_layouts():
    a = compile_model(CFG2, 3, max_seq=MAX_SEQ, decoder=False)
    b = compile_model(CFG2, 3, max_seq=MAX_SEQ, decoder=False, tp=1)
    assert torch.equal(a.tape.words, b.tape.words) and type(a.tape.lay) is Layout
    assert not (TPPush.IN_EVERY_KERNEL or TPReduce.IN_EVERY_KERNEL) and TPPush.SIGNALS_PEER and TPPush.WRITES_PEER
    assert REGISTRY["tp_reduce"].OPCODE == REGISTRY["tp_push"].OPCODE + 1 > REGISTRY["sample"].OPCODE  # appended
    c = _compile(CFG2)
    assert len(c.tapes) == 2 and "cross-rank" in str(c.report)
    for r, t in enumerate(c.tapes):
        assert isinstance(t.lay, TPLayout) and (t.lay.tp_rank, t.lay.tp_size) == (r, 2)
        assert t.lay.cfg.n_q == 2 and t.lay.full_cfg.to_dict() == CFG2.to_dict()
        back = Tape.from_json(t.to_json())           # the rank's layout round-trips through the tape JSON
        assert back.lay == t.lay and torch.equal(back.words, t.words)
    assert torch.equal(c.tapes[0].words, c.tapes[1].words)      # the same program and schedule
    with pytest.raises(ValueError, match="tp must be"):
        compile_model(CFG2, 3, tp=4, decoder=False)
    with pytest.raises(ValueError, match="vocab"):         # the whole model needs a vocabulary (test_tp_decoder)
        compile_model(CFG2, 3, tp=2, decoder=True)


@pytest.mark.parametrize("layers,tiling,policy", [(1, "default", "cost"), (2, "blocks", "cost"),
                                                   (2, "split-o", "random"), (1, "blocks", "round-robin")])
def test_run_tp_matches_the_references(layers, tiling, policy):
    cfg = _cfg(layers)
    c = _compile(cfg, tiling=TILINGS[tiling], policy=policy)
    w = make_weights(cfg)
    x = _x()
    ref, ref_kv = _ref(cfg, w, x, POS)
    tref = _tp_ref(cfg, w, x, POS)
    # the single-GPU VM on the same model: the K/V rows are computed alike
    kv1 = make_kv_cache(cfg, MAX_SEQ, POS)
    run_tape(compile_model(cfg, 3, max_seq=MAX_SEQ, decoder=False).tape, w, kv1, x, POS, seed=0)
    first = None
    for seed in (0, 1, 2):
        kv = make_kv_cache(cfg, MAX_SEQ, POS)
        outs = run_tp(c.tapes, w, kv, x, POS, seed=seed, return_all=True)[0]
        assert torch.equal(outs[0], outs[1])              # both ranks' residual streams, bitwise
        out = outs[0]
        assert rel_err(out, ref) <= 1.5e-2 * layers
        assert rel_err(out, tref) <= 1.5e-2 * layers
        first = out if first is None else first
        assert torch.equal(out, first)                    # fixed-order reduce: no interleaving changes a bit
        for l in range(cfg.layers):
            for j in range(2):
                assert torch.equal(kv[l][j], kv1[l][j])   # every rank wrote its KV heads' rows at POS
                assert rel_err(kv[l][j][:, :, POS], ref_kv[l][j][:, :, POS]) <= 1.5e-2


def test_run_tp_several_calls_reuse_the_parity_slots():
    """Three calls in a row (input = last output, pos, pos+1, pos+2): a rank may run a call ahead of
    its peer; both receive slots are reused and the result equals three single calls."""
    cfg = _cfg(2)
    c = _compile(cfg, tiling=TILINGS["blocks"], pool_us=0.0)
    w = make_weights(cfg)
    x = _x(5)
    ref, _ = _ref(cfg, w, x, POS, calls=3)
    kv_one = make_kv_cache(cfg, MAX_SEQ, POS)
    step = x
    for k in range(3):                                    # one call at a time
        step = run_tp(c.tapes, w, kv_one, step, POS + k, seed=k)
    for seed in (0, 1, 2, 3):
        kv = make_kv_cache(cfg, MAX_SEQ, POS)
        outs = run_tp(c.tapes, w, kv, x, POS, seed=seed, calls=3, return_all=True)
        assert all(torch.equal(o[0], o[1]) for o in outs)
        assert torch.equal(outs[-1][0], step)
        assert rel_err(outs[-1][0], ref) <= 4e-2
        assert all(torch.equal(a, b) for p, q in zip(kv, kv_one) for a, b in zip(p, q))


def _one_queue(c):
    """Per rank: the rows of its single queue (1 SM, no pool) as decoded instructions."""
    from schedule.tape import decode
    return [decode(t) for t in c.tapes]


def _reorder(tape: Tape, order: list[int]) -> Tape:
    return Tape(tape.lay, tape.num_sms, tape.words[order].clone(), tape.offsets.clone(), list(tape.counters),
                [tape.prog_index[k] for k in order], dict(tape.meta), tape.pool_counter)


def test_verify_tp_names_a_dropped_push():
    c = _compile(_cfg(1), tiling=TILINGS["blocks"], sms=2, pool_us=0.0)
    t0, t1 = c.tapes
    k = next(d.slot for d in _one_queue(c)[0] if d.ins == TPPush(0, 1, 64))
    sm = next(s for s in range(t0.num_sms) if k in t0.sm_range(s))
    offs = t0.offsets.clone()
    offs[sm + 1:] -= 1
    keep = [i for i in range(len(t0)) if i != k]
    broken = Tape(t0.lay, t0.num_sms, t0.words[keep].clone(), offs, list(t0.counters),
                  [t0.prog_index[i] for i in keep], dict(t0.meta), t0.pool_counter)
    with pytest.raises(TapeError) as e:
        verify_tp([broken, t1])
    msg = str(e.value)
    assert "rank 1 instruction" in msg and "tp_reduce" in msg and "recv_d[0,1]" in msg and "sm " in msg
    assert "0 instruction(s)" in msg


def test_verify_tp_names_a_cross_rank_deadlock():
    """Each rank's queue alone is fine (its mirror check passes), but rank 0 reduces block 0 before
    pushing block 1 and rank 1 reduces block 1 before pushing block 0: they wait on each other."""
    from schedule import verify
    c = _compile(_cfg(1), tiling=TILINGS["blocks"], sms=1, pool_us=0.0)
    broken = []
    for r, (t, dec) in enumerate(zip(c.tapes, _one_queue(c))):
        slot = {(type(d.ins).__name__, d.ins.stage, d.ins.row0): d.slot for d in dec
                if isinstance(d.ins, (TPPush, TPReduce)) and d.ins.stage == 0}
        a, b = (0, 64) if r == 0 else (64, 0)
        mine = [slot[("TPPush", 0, a)], slot[("TPReduce", 0, a)], slot[("TPPush", 0, b)], slot[("TPReduce", 0, b)]]
        first = min(mine)
        order = [i for i in range(len(t)) if i not in mine]
        at = order.index(next(i for i in order if i > first)) if any(i > first for i in order) else len(order)
        order[at:at] = mine
        bt = _reorder(t, order)
        verify(bt)                                        # alone, under the mirror assumption: fine
        broken.append(bt)
    with pytest.raises(TapeError, match=r"deadlock: rank \d instruction \d+ \(tp_reduce, sm 0\) waits on rank "
                                        r"\d's counter \d+ \(recv_o\[0,\d\]\).*producer rank \d instruction"):
        verify_tp(broken)
    with pytest.raises(Exception, match="deadlock"):
        run_tp(broken, make_weights(_cfg(1)), make_kv_cache(_cfg(1), MAX_SEQ, POS), _x(), POS, seed=0)


def test_verify_tp_names_a_read_before_the_push_arrived():
    """A reduce that does not wait on the peer's counter reads tp_recv unguarded: a cross-rank race."""
    c = _compile(_cfg(1), sms=2, pool_us=0.0)
    t0, t1 = c.tapes
    words = t0.words.clone()
    k = next(d.slot for d in _one_queue(c)[0] if isinstance(d.ins, TPReduce) and d.ins.stage == 0)
    words[k, 3], words[k, 4] = -1, 0                      # drop its second wait (the peer's recv counter)
    bad = Tape(t0.lay, t0.num_sms, words, t0.offsets.clone(), list(t0.counters), list(t0.prog_index),
               dict(t0.meta), t0.pool_counter)
    with pytest.raises(TapeError, match=r"rank 0 instruction \d+ \(tp_reduce, sm \d\): reads rank 0's tp_recv"
                                        r"\[\d+:\d+\] written by rank 1 instruction \d+ \(tp_push, sm \d\), which it "
                                        r"does not wait for"):
        verify_tp([bad, t1])


def test_tp_device_functions_compile_in_the_interpreter():
    """The device functions run in the Triton interpreter (a tiny wrapper kernel; the whole kernel
    runs them in tests/test_tp_runtime.py): push writes the summed chunks through
    ``peer_recv_ptr`` into slot epoch % 2, reduce adds rank 0 + rank 1 + the residual."""
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter")
    L, D, OC, DC, RR = 2, 64, 2, 3, 32

    g = torch.Generator().manual_seed(0)
    opart, dpart = torch.randn(L * OC * D, generator=g), torch.randn(L * DC * D, generator=g)
    recv = torch.zeros(2 * L * 2 * D)
    k_push[(1,)](1, 1, 32, 3, opart, dpart, recv, L, D, OC, DC, RR)
    mine = dpart.view(L, DC, D)[1, :, 32:64].sum(0)
    assert torch.allclose(recv.view(2, L, 2, D)[1, 1, 1, 32:64], mine)
    assert recv.view(2, L, 2, D)[0].abs().sum() == 0
    x1, xout, out = torch.randn(L * D, generator=g), torch.zeros(L * D, dtype=torch.bfloat16), torch.zeros(D, dtype=torch.bfloat16)
    x = torch.randn(D, generator=g).to(torch.bfloat16)
    k_red[(1,)](1, 1, 32, 3, x, xout, out, x1, opart, dpart, recv, L, D, OC, DC, RR, 1)
    want = (x1.view(L, D)[1, 32:64] + (mine + mine)).to(torch.bfloat16)
    assert torch.allclose(out[32:64].float(), want.float(), rtol=1e-2)


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from opcodes.tp_push import tp_push_device  # noqa: E402
from opcodes.tp_reduce import tp_reduce_device  # noqa: E402


@triton.jit
def k_push(layer, stage, row0, epoch, opart_ptr, dpart_ptr, peer_ptr, L: tl.constexpr, D: tl.constexpr,
           OC: tl.constexpr, DC: tl.constexpr, RR: tl.constexpr):
    tp_push_device(layer, stage, row0, epoch, opart_ptr, dpart_ptr, peer_ptr, L, D, OC, DC, RR)


@triton.jit
def k_red(layer, stage, row0, epoch, x_ptr, xout_ptr, out_ptr, x1_ptr, opart_ptr, dpart_ptr, recv_ptr,
          L: tl.constexpr, D: tl.constexpr, OC: tl.constexpr, DC: tl.constexpr, RR: tl.constexpr,
          RANK: tl.constexpr):
    tp_reduce_device(layer, stage, row0, epoch, x_ptr, xout_ptr, out_ptr, x1_ptr, opart_ptr, dpart_ptr, recv_ptr,
                     L, D, OC, DC, RR, RANK, True)
