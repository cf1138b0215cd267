"""The whole-model decoder under tensor parallelism (2 ranks) on the CPU: ``compile_model(cfg_with_vocab,
..., tp=2)`` (EMBED, the TP layers, LM_HEAD over the rank's vocabulary slice, TP_ARGMAX_PUSH /
TP_ARGMAX), the cross-rank verifier ``verify_tp`` on those tapes, and the two-rank tape VM
``run_tp_decoder`` against the TP reference ``tp_decoder_ref`` / ``tp_argmax``; the device functions
of the cross-rank argmax in the Triton interpreter (two ranks simulated by two buffers)."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import triton
import triton.language as tl

from conftest import decoder_weights
from opcodes import (PRESETS, REGISTRY, Argmax, DecoderLayout, Embed, LMHead, Tiling, TPArgmax, TPArgmaxPush, TPPush,
                     kernel_constexprs, layout_from_json)
from opcodes.decoder import decoder_ref, greedy_token
from opcodes.reference import make_kv_cache, rel_err
from opcodes.tp import TPDecoderLayout, TPLayout, shard_kv_cache, shard_weights, tp_argmax, tp_decoder_ref
from opcodes.tp_argmax import local_best, pick, tp_argmax_device, tp_argmax_push_device
from schedule import compile_model, verify, verify_tp
from schedule.decoder_program import decoder_lowering, lower_decoder, run_decoder_vm
from schedule.tape import Tape, decode
from schedule.verify import TapeError
from schedule.vm import run_tp, run_tp_decoder

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

MAX_SEQ, POS = 64, 19
LOGIT_TOL = 2e-2        # test_decoder's tolerance of the VM's logits against the bf16 reference


def _cfg(vocab: int = 200):
    # d=128, ffn=320, n_q=4, n_kv=2, hd=32: per rank 2 query heads, 1 KV head, vocab / 2 LM head rows
    return dataclasses.replace(PRESETS["small-2layer"], vocab=vocab, name=f"small-2layer-v{vocab}")


def _compile(cfg, sms=3, lm_rows=0, **kw):
    lowering = decoder_lowering(lm_rows=lm_rows) if lm_rows else None
    return compile_model(cfg, sms, max_seq=MAX_SEQ, tp=2, lowering=lowering, **kw)


def _slices(logits: torch.Tensor) -> list[torch.Tensor]:
    h = logits.shape[-1] // 2
    return [logits[:, :h], logits[:, h:]]


def _ref_steps(cfg, w, token: int, pos: int, calls: int):
    """The TP reference over ``calls`` greedy steps: [(fp32 logits (1, vocab), next token)]."""
    kv = make_kv_cache(cfg, MAX_SEQ, pos)
    shards = [shard_weights(w, cfg, r, 2) for r in range(2)]
    caches = [shard_kv_cache(kv, cfg, r, 2) for r in range(2)]
    out = []
    for k in range(calls):
        lg = tp_decoder_ref(shards, caches, cfg, token, pos + k)
        token = tp_argmax(_slices(lg))
        out.append((lg, token))
    return out


# ---- compile_model(..., tp=2) of a whole model ---------------------------------------------------
def test_tp_decoder_tapes():
    cfg = _cfg(200)
    c = _compile(cfg, sms=2, lm_rows=16)
    assert len(c.tapes) == 2 and "cross-rank" in str(c.report)
    for r, t in enumerate(c.tapes):
        lay = t.lay
        assert isinstance(lay, TPDecoderLayout) and isinstance(lay, TPLayout) and lay.WHOLE_MODEL
        assert (lay.tp_rank, lay.tp_size, lay.lm_vocab, lay.vocab0, lay.lm_rows) == (r, 2, 100, 100 * r, 16)
        assert lay.n_lm_tiles == 7 and lay.cfg.vocab == 200 and lay.full_cfg.to_dict() == cfg.to_dict()
        back = Tape.from_json(t.to_json())          # the layout round-trips through the tape JSON
        assert back.lay == lay and type(back.lay) is TPDecoderLayout and torch.equal(back.words, t.words)
        assert layout_from_json(lay.to_json()) == lay
        bufs = t.buffers()
        assert bufs["logits"] == ((100,), "fp32") and bufs["amax"] == ((7, 2), "fp32")
        assert bufs["tp_am_recv"] == ((2, 2), "fp32") and bufs["x0"] == ((1, 128), "bf16")
        prog = c.ranks[r].prog
        names = [ins.NAME for ins in prog.instrs]
        assert names.count("embed") == 1 and names[-2:] == ["tp_argmax_push", "tp_argmax"]
        assert "argmax" not in names and "residual" not in names
        assert [ins.row0 for ins in prog.instrs if ins.NAME == "lm_head"] == list(range(0, 100, 16))
        cl, crecv = prog.counters.index("logits"), prog.counters.index("recv_am")
        assert prog.waits[-2:] == [(cl,), (cl, crecv)] and prog.signal[-2] == crecv and prog.signal[-1] == -1
        verify(t)                                    # alone, under the mirror assumption
    assert torch.equal(c.tapes[0].words, c.tapes[1].words)     # the same program and schedule
    # the new opcodes: appended, never in a single-GPU kernel, the push writes and signals the peer
    assert [REGISTRY[n].OPCODE - REGISTRY["tp_push"].OPCODE for n in ("tp_reduce", "tp_argmax_push", "tp_argmax")] \
        == [1, 2, 3]
    assert not (TPArgmaxPush.IN_EVERY_KERNEL or TPArgmax.IN_EVERY_KERNEL)
    assert TPArgmaxPush.SIGNALS_PEER and TPArgmaxPush.WRITES_PEER and TPArgmaxPush.PARITY_SLOTS == {"tp_am_recv": 2}
    assert not (TPArgmax.SIGNALS_PEER or TPArgmax.WRITES_PEER)
    # the default: the whole model iff the cfg has a vocabulary; decoder=False: the layers only
    d = compile_model(cfg, 3, max_seq=MAX_SEQ, tp=2)
    assert type(d.tapes[0].lay) is TPDecoderLayout and d.tapes[0].lay.lm_rows == 128
    e = compile_model(cfg, 3, max_seq=MAX_SEQ, tp=2, decoder=False)
    assert type(e.tapes[0].lay) is TPLayout and "lm_head" not in {c.NAME for c in e.tapes[0].classes()}
    with pytest.raises(ValueError, match="vocab"):
        compile_model(_cfg(0), 3, max_seq=MAX_SEQ, tp=2, decoder=True)
    with pytest.raises(NotImplementedError, match="sampling"):
        compile_model(cfg, 3, max_seq=MAX_SEQ, tp=2, lowering=decoder_lowering(sample=True))
    with pytest.raises(ValueError, match="run_tp_decoder"):
        run_tp(c.tapes, decoder_weights(cfg), make_kv_cache(cfg, MAX_SEQ, POS), torch.zeros(1, 128), POS)
    with pytest.raises(ValueError, match="run_tp_decoder"):
        run_decoder_vm(c.tapes[0], decoder_weights(cfg), make_kv_cache(cfg, MAX_SEQ, POS), 3, POS)
    with pytest.raises(ValueError, match="tp_size = 2 must divide"):
        TPDecoderLayout(dataclasses.replace(cfg, vocab=201), c.tapes[0].lay.tiling, MAX_SEQ, tp_rank=0)


def test_single_gpu_lm_head_is_unchanged():
    """On one GPU the LM head covers the whole vocabulary: LM_VOCAB (its device function's VOCAB) is VOCAB."""
    cfg = _cfg(200)
    p = lower_decoder(compile_model(cfg, 3, max_seq=MAX_SEQ, decoder=False).tape.lay)
    assert p.lay.lm_vocab == 200 and [i.NAME for i in p.instrs][-1] == "argmax"
    for used in ((), p.classes()):
        k = kernel_constexprs(p.lay, False, used)
        assert k["LM_VOCAB"] == k["VOCAB"] == 200
    k = kernel_constexprs(compile_model(_cfg(0), 3, max_seq=MAX_SEQ, decoder=False).tape.lay)
    assert k["LM_VOCAB"] == k["VOCAB"] == 1
    assert LMHead.IN_EVERY_KERNEL and Argmax.IN_EVERY_KERNEL and Embed.IN_EVERY_KERNEL


# ---- the two-rank VM against the TP reference ----------------------------------------------------
@pytest.mark.parametrize("vocab,sms,lm_rows,policy", [(200, 2, 16, "cost"), (96, 3, 0, "cost"),
                                                      (200, 3, 16, "random"), (96, 2, 16, "round-robin")])
def test_run_tp_decoder_matches_the_reference(vocab, sms, lm_rows, policy):
    cfg = _cfg(vocab)
    c = _compile(cfg, sms=sms, lm_rows=lm_rows, policy=policy)
    w = decoder_weights(cfg, seed=1)
    tok = 7
    (ref, ref_tok), = _ref_steps(cfg, w, tok, POS, 1)
    ref1 = decoder_ref(w, make_kv_cache(cfg, MAX_SEQ, POS), cfg, tok, POS)        # unsharded
    first = None
    for seed in (0, 1, 2):
        kv = make_kv_cache(cfg, MAX_SEQ, POS)
        slices, token = run_tp_decoder(c.tapes, w, kv, tok, POS, seed=seed)
        assert [s.shape for s in slices] == [(1, vocab // 2)] * 2 and slices[0].dtype == torch.float32
        got = torch.cat(slices, dim=-1)
        assert rel_err(got, ref) <= LOGIT_TOL and rel_err(got, ref1) <= LOGIT_TOL
        assert token == tp_argmax(slices) == greedy_token(got)
        assert token == ref_tok == tp_argmax(_slices(ref))
        if first is None:
            first = (got, token, kv)
        else:                                # fixed-order reductions: no interleaving changes a bit
            assert torch.equal(got, first[0]) and token == first[1]
            assert all(torch.equal(a, b) for p, q in zip(kv, first[2]) for a, b in zip(p, q))


def test_run_tp_decoder_several_calls_reuse_the_parity_slots():
    """Three greedy calls in a row: each rank embeds the token its own TP_ARGMAX wrote; both receive
    buffers alternate their slots, a rank may be a call ahead of its peer, and the result equals
    three single calls and the reference's greedy chain."""
    cfg = _cfg(200)
    c = _compile(cfg, sms=2, lm_rows=16, pool_us=0.0)
    w = decoder_weights(cfg, seed=2)
    ref = _ref_steps(cfg, w, 11, POS, 3)
    kv_one = make_kv_cache(cfg, MAX_SEQ, POS)
    one, tok = [], 11
    for k in range(3):                                    # one call at a time
        slices, tok = run_tp_decoder(c.tapes, w, kv_one, tok, POS + k, seed=k)
        one.append((torch.cat(slices, dim=-1), tok))
    for seed in (0, 1, 2, 3):
        kv = make_kv_cache(cfg, MAX_SEQ, POS)
        res = run_tp_decoder(c.tapes, w, kv, 11, POS, seed=seed, calls=3, return_all=True)
        assert len(res) == 3
        for (slices, token), (lg1, t1), (lgr, tr) in zip(res, one, ref):
            got = torch.cat(slices, dim=-1)
            assert torch.equal(got, lg1) and token == t1 == tr
            assert rel_err(got, lgr) <= LOGIT_TOL
        assert all(torch.equal(a, b) for p, q in zip(kv, kv_one) for a, b in zip(p, q))
    assert len({t for _, t in ref}) > 1                   # the chain does move through the vocabulary


def test_cross_rank_tie_goes_to_rank_0():
    """Both ranks' LM head slices are the same rows: their maxima are bitwise equal, and the token is
    rank 0's (the lowest global index), as tp_argmax and the unsharded greedy token say."""
    cfg = _cfg(96)
    w = decoder_weights(cfg, seed=3)
    w["lm_head"] = torch.cat([w["lm_head"][:48], w["lm_head"][:48]]).contiguous()
    c = _compile(cfg, sms=2, lm_rows=16)
    for seed in (0, 1):
        slices, token = run_tp_decoder(c.tapes, w, make_kv_cache(cfg, MAX_SEQ, POS), 5, POS, seed=seed)
        assert torch.equal(slices[0], slices[1])
        assert token < 48 and token == tp_argmax(slices) == greedy_token(torch.cat(slices, dim=-1))
        assert token == _ref_steps(cfg, w, 5, POS, 1)[0][1]


# ---- the verifier on broken decoder tapes --------------------------------------------------------
def _where(t: Tape, slot: int) -> str:
    return "pool" if slot in t.pool_range() else f"sm {next(s for s in range(t.num_sms) if slot in t.sm_range(s))}"


@pytest.mark.parametrize("policy", ["round-robin", "cost"])
def test_verify_tp_names_tp_argmax_without_its_wait(policy):
    """TP_ARGMAX that does not wait on the counter the peer's push signals reads tp_am_recv unguarded."""
    c = _compile(_cfg(200), sms=2, lm_rows=16, policy=policy)
    t0, t1 = c.tapes
    crecv = t0.counters.index("recv_am")
    k = next(d.slot for d in decode(t0) if isinstance(d.ins, TPArgmax))
    words = t0.words.clone()
    j = next(j for j in range(2) if int(words[k, 1 + 2 * j]) == crecv)
    words[k, 1 + 2 * j], words[k, 2 + 2 * j] = -1, 0       # drop the wait on the peer's counter
    bad = dataclasses.replace(t0, words=words)
    push = next(d.slot for d in decode(t1) if isinstance(d.ins, TPArgmaxPush))
    with pytest.raises(TapeError) as e:
        verify_tp([bad, t1])
    msg = str(e.value)
    want = (f"rank 0 instruction {k} (tp_argmax, {_where(t0, k)}): reads rank 0's tp_am_recv[0:2] written by "
            f"rank 1 instruction {push} (tp_argmax_push, {_where(t1, push)}), which it does not wait for "
            f"(signals rank 0's counter {crecv} (recv_am))")
    assert want in msg, msg
    with pytest.raises(TapeError, match=r"\(tp_argmax, .*\): reads tp_am_recv\[0:2\] written by .*tp_argmax_push"):
        verify(bad)                                        # the rank alone sees it too
    verify_tp(c.tapes)


def test_verify_tp_refuses_a_decoder_rank_with_a_layer_rank():
    cfg = _cfg(200)
    whole = _compile(cfg, sms=2).tapes
    layers = compile_model(cfg, 2, max_seq=MAX_SEQ, tp=2, decoder=False).tapes
    with pytest.raises(TapeError, match="different layouts \\(TPDecoderLayout and TPLayout\\)"):
        verify_tp([whole[0], layers[1]])


def test_verify_tp_names_a_missing_argmax_push():
    c = _compile(_cfg(200), sms=2, lm_rows=16, pool_us=0.0)
    t0, t1 = c.tapes
    k = next(d.slot for d in decode(t1) if isinstance(d.ins, TPArgmaxPush))
    words = t1.words.clone()
    words[k, 5] = -1                                       # rank 1's push signals nothing
    with pytest.raises(TapeError, match=r"rank 0 instruction \d+ \(tp_argmax, sm \d\): waits on rank 0's counter "
                                        r"\d+ \(recv_am\) for 1, but 0 instruction\(s\) signal it"):
        verify_tp([t0, dataclasses.replace(t1, words=words)])
    keep = [i for i in range(len(t1)) if i != k]            # rank 1's push gone: rank 0's slot is never written
    sm = next(s for s in range(t1.num_sms) if k in t1.sm_range(s))
    offs = t1.offsets.clone()
    offs[sm + 1:] -= 1
    gone = Tape(t1.lay, t1.num_sms, t1.words[keep].clone(), offs, list(t1.counters), [t1.prog_index[i] for i in keep],
                dict(t1.meta), t1.pool_counter)
    with pytest.raises(TapeError, match=r"rank 0's tp_am_recv\[0:2\] is never written .*missing push from rank 1"):
        verify_tp([t0, gone])


# ---- the device functions, in the Triton interpreter ---------------------------------------------
@triton.jit
def k_am_push(nparts, epoch, amax_ptr, peer_ptr, LM_VOCAB: tl.constexpr, AM_BLOCK: tl.constexpr, RANK: tl.constexpr):
    tp_argmax_push_device(nparts, epoch, amax_ptr, peer_ptr, LM_VOCAB, AM_BLOCK, RANK)


@triton.jit
def k_am(nparts, epoch, pos, amax_ptr, recv_ptr, tok_ptr, toks_ptr, LM_VOCAB: tl.constexpr, AM_BLOCK: tl.constexpr,
         RANK: tl.constexpr):
    tp_argmax_device(nparts, epoch, pos, amax_ptr, recv_ptr, tok_ptr, toks_ptr, LM_VOCAB, AM_BLOCK, RANK)


class _St:
    """The parts of a VM state the cross-rank argmax reads and writes."""

    def __init__(self, amax, recv, peer_recv, epoch):
        self.buf = {"amax": amax, "tp_am_recv": recv}
        self.peer_buf = {"tp_am_recv": peer_recv}
        self.epoch = epoch
        self.next_token = None


@pytest.mark.parametrize("case", ["rank0", "rank1", "tie"])
def test_tp_argmax_device_functions_in_the_interpreter(case):
    """Rank 0 and rank 1 as two sets of buffers: each push writes the peer's receive slot epoch % 2,
    each pick reads its own; both ranks write the same token, equal to the VM's and to tp_argmax of
    the partials' logits (ties across ranks to rank 0). AM_BLOCK 4 < nparts: several blocks."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter")
    lm_vocab, lm_rows, nparts, epoch, pos = 100, 16, 7, 3, 5
    g = torch.Generator().manual_seed({"rank0": 0, "rank1": 1, "tie": 2}[case])
    logits = [torch.randn(lm_vocab, generator=g) for _ in range(2)]
    if case == "rank0":
        logits[0][37] = 9.0
    elif case == "rank1":
        logits[1][81] = 9.0
    else:
        logits[0][60] = logits[1][12] = 9.0         # the same max on both ranks: rank 0's index 60 wins
    want = tp_argmax([lg.reshape(1, -1) for lg in logits])
    assert want == {"rank0": 37, "rank1": 181, "tie": 60}[case]
    amax = []
    for lg in logits:                               # LM_HEAD's partials: (tile max, its lowest local index)
        a = torch.empty(nparts, 2)
        for t in range(nparts):
            y = lg[t * lm_rows:(t + 1) * lm_rows]
            a[t, 0] = y.max()
            a[t, 1] = float(t * lm_rows + int(torch.argmax(y)))
        amax.append(a.reshape(-1))
    recv = [torch.zeros(4) for _ in range(2)]
    for r in range(2):
        k_am_push[(1,)](nparts, epoch, amax[r], recv[1 - r], lm_vocab, 4, r)
    for r in range(2):                              # slot epoch % 2 = 1 holds the peer's pair; slot 0 untouched
        assert recv[r].view(2, 2)[0].abs().sum() == 0
        assert recv[r].view(2, 2)[1, 1].item() == float(int(torch.argmax(logits[1 - r])) + 100 * (1 - r))
    toks = []
    for r in range(2):
        tok, tlist = torch.full((1,), -1, dtype=torch.int32), torch.full((8,), -1, dtype=torch.int32)
        k_am[(1,)](nparts, epoch, pos, amax[r], recv[r], tok, tlist, lm_vocab, 4, r)
        assert int(tlist[pos]) == int(tok[0])
        toks.append(int(tok[0]))
    assert toks == [want, want]
    # the VM's semantics of both opcodes on the same partials
    slay = [TPDecoderLayout(_cfg(200), _tiling(), MAX_SEQ, lm_rows=lm_rows, tp_rank=r) for r in range(2)]
    assert all(L.n_lm_tiles == nparts for L in slay)
    vrecv = [torch.full((4,), float("nan")) for _ in range(2)]
    sts = [_St(amax[r], vrecv[r], vrecv[1 - r], epoch) for r in range(2)]
    for r in range(2):
        TPArgmaxPush(nparts).run_torch(slay[r], sts[r])
    for r in range(2):
        assert torch.equal(vrecv[r].view(2, 2)[1], recv[r].view(2, 2)[1])
        TPArgmax(nparts).run_torch(slay[r], sts[r])
        assert sts[r].next_token == want
    v0, v1 = local_best(slay[0], amax[0], nparts), local_best(slay[1], amax[1], nparts)
    assert pick(v0, v1) == want and v1[1] >= 100


def _tiling():
    return Tiling.for_config(TPLayout.of(_cfg(200), 0, 2).cfg)


def test_tp_decoder_layout_checks():
    lay = TPDecoderLayout(_cfg(200), _tiling(), MAX_SEQ, tp_rank=1)
    assert lay.extra() == {"lm_rows": 128, "emb_cols": 128, "tp_rank": 1, "tp_size": 2}
    assert TPArgmax(1).check_operands(lay) == [] and "nparts 2" in TPArgmax(2).check_operands(lay)[0]
    plain = TPLayout.of(_cfg(200), 0, 2)
    assert "TPDecoderLayout" in TPArgmaxPush(1).check_operands(plain)[0]
    assert not TPArgmax.applies(plain) and not TPArgmax.applies(DecoderLayout(_cfg(200), _tiling(), MAX_SEQ))
    assert TPPush.applies(lay)
    with pytest.raises(ValueError, match="tp_rank"):
        TPDecoderLayout(_cfg(200), _tiling(), MAX_SEQ, tp_rank=2)
