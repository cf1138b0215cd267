"""Multi-layer models and whole-model decode (the CPU parts), through the Triton interpreter
and the tape VM.

* ``build_model`` / ``model_step`` (N layers, one launch per step) against ``opcodes.reference.model_ref``;
* the decoder lowering (EMBED -> layers -> LM_HEAD -> ARGMAX): structure, waits, verification on
  several SM counts and policies, operand range checks of the new opcodes, a dropped wait caught;
* the tape VM on decoder tapes against ``opcodes.decoder.decoder_ref`` (schedule-independent bits);
* ``decode_step`` against the reference, ``generate`` against a host-driven greedy loop (same bits,
  one launch per token, the token fed back on the device), deterministic argmax ties;
* input validation of ``build_decoder`` / ``decode_step`` / ``generate``.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import conftest
import interp
import interp.decoder as decoder_mod
import opcodes
from conftest import clone_cache, require_interpreter
from interp import (build_decoder, build_model, decode_step, generate, model_step, teardown)
from interp.runtime import LayerHandle
from opcodes import HEADER, REGISTRY, DecoderLayout, ModelConfig, Tiling
from opcodes.argmax import reduce_partials
from opcodes.decoder import decoder_ref
from opcodes.reference import make_kv_cache, make_weights, model_ref, rel_err, rope_tables
from schedule import TapeError, compile_model, lower, make_layout, verify
from schedule.decoder_program import decoder_lowering, lower_decoder, run_decoder_vm

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

TOL = 1.5e-2          # the layer contract's tolerance (bf16 weights, cache and residual stream)
LOGIT_TOL = 2e-2
MAX_SEQ = 32
# GQA 2, two layers; vocab 200 is not a multiple of the LM head tile (16 below)
CFG = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="tiny-decoder")
# fewer attention splits and wider gate/up tiles: fewer instructions for the interpreter
FAST = dict(attn_splits=2, gu_rows=32)


def decoder_weights(cfg: ModelConfig = CFG, seed: int = 0) -> dict:
    return conftest.decoder_weights(cfg, seed)


def count_launches(monkeypatch):
    """Record (pos, token in the device buffer before the launch) of every kernel launch; a launch
    at the device's position (pos -1) records the position the control block holds."""
    from interp.codegen import CTL_POS
    calls = []
    real = decoder_mod.runtime.launch

    def spy(h, x, pos, out):
        if "tok_ptr" not in h.buffers:         # a rows kernel's launch (prefill): recorded as its row count
            calls.append(("rows", int(h.state["rows"][0])))
            return real(h, x, pos, out)
        calls.append((pos if pos >= 0 else int(h.ctl[CTL_POS]), int(h.buffers["tok_ptr"][0])))
        return real(h, x, pos, out)
    monkeypatch.setattr(decoder_mod.runtime, "launch", spy)
    return calls


# ---- build_model / model_step ------------------------------------------------------------------
def test_build_model_matches_model_ref(monkeypatch):
    cfg = dataclasses.replace(CFG, vocab=0)
    w = make_weights(cfg, seed=3)
    kv = make_kv_cache(cfg, MAX_SEQ, 13, seed=4)
    kv_ref = clone_cache(kv)
    launches = []
    real = interp.runtime.launch
    monkeypatch.setattr(interp.runtime, "launch", lambda *a: (launches.append(a[2]), real(*a)))
    h = build_model(w, kv, cfg.to_dict(), MAX_SEQ, tiling=Tiling.for_config(cfg, **FAST))
    assert isinstance(h, LayerHandle) and h.cfg.layers == 2
    g = torch.Generator().manual_seed(5)
    for pos in range(13, 16):
        x = torch.randn(1, cfg.d, generator=g).to(torch.bfloat16)
        x0 = x.clone()
        before = clone_cache(kv)
        y = model_step(h, x, pos)
        ref = model_ref(w, kv_ref, cfg, x, pos)
        assert y.shape == (1, cfg.d) and y.dtype == torch.bfloat16
        assert rel_err(y, ref) <= TOL, pos
        assert torch.equal(x, x0)
        for l in range(cfg.layers):
            for j in range(2):
                others = torch.ones(MAX_SEQ, dtype=torch.bool)
                others[pos] = False
                assert torch.equal(kv[l][j][:, :, others], before[l][j][:, :, others])
                assert rel_err(kv[l][j][:, :, pos], kv_ref[l][j][:, :, pos]) <= TOL
    assert launches == [13, 14, 15]          # one launch per step for both layers
    teardown(h)
    teardown(h)
    with pytest.raises(ValueError, match="teardown"):
        model_step(h, x, 16)


def test_model_aliases_are_documented():
    for f in (interp.build_model, interp.model_step, interp.build_decoder, interp.decode_step, interp.generate,
              interp.load_hf_llama):
        assert f.__doc__ and len(f.__doc__) > 80, f.__name__


# ---- the decoder lowering ------------------------------------------------------------------------
#: every opcode number a tape may hold today: a new opcode is appended after these, never between them
#: (a saved tape keeps its meaning), so this list only grows at its end
PINNED_OPCODES = ["qkv", "attn_partial", "attn_reduce", "oproj", "gate_up", "down", "residual", "o_reduce",
                  "embed", "lm_head", "argmax", "sample", "tp_push", "tp_reduce", "tp_argmax_push", "tp_argmax",
                  "sample_mass"]


def test_new_opcodes_are_appended():
    names = list(REGISTRY)
    assert names[:len(PINNED_OPCODES)] == PINNED_OPCODES
    assert [REGISTRY[n].OPCODE for n in names] == list(range(1, len(names) + 1))


def test_decoder_program_structure():
    lay = DecoderLayout(CFG, Tiling.for_config(CFG), MAX_SEQ, lm_rows=16, emb_cols=16)
    assert (lay.n_lm_tiles, lay.n_emb_tiles) == (13, 4)
    p = lower_decoder(lay)
    bufs = p.buffers()
    assert bufs["x0"] == ((1, CFG.d), "bf16") and bufs["logits"] == ((200,), "fp32") and bufs["amax"] == ((13, 2), "fp32")
    assert isinstance(p.lay, DecoderLayout)
    idx = {n: [i for i, ins in enumerate(p.instrs) if ins.NAME == n] for n in ("embed", "lm_head", "argmax", "qkv",
                                                                             "residual")}
    assert [p.instrs[i].col0 for i in idx["embed"]] == [0, 16, 32, 48]
    assert [p.instrs[i].row0 for i in idx["lm_head"]] == list(range(0, 200, 16))
    assert len(idx["argmax"]) == 1 and p.instrs[idx["argmax"][0]].nparts == 13
    ce = p.signal[idx["embed"][0]]
    assert p.counters[ce] == "embed" and all(p.signal[i] == ce for i in idx["embed"])
    for i in idx["qkv"]:                      # layer 0 waits for the embedding, later layers do not
        assert (ce in p.waits[i]) == (p.instrs[i].layer == 0)
    last = {p.signal[i] for i in idx["residual"] if p.instrs[i].layer == CFG.layers - 1}
    assert len(last) == 1 and -1 not in last
    assert all(p.waits[i] == (next(iter(last)),) for i in idx["lm_head"])
    cl = p.signal[idx["lm_head"][0]]
    assert all(p.signal[i] == cl for i in idx["lm_head"])
    assert p.waits[idx["argmax"][0]] == (cl,) and p.signal[idx["argmax"][0]] == -1
    assert p.targets()[cl] == 13 and p.targets()[ce] == 4
    # the layers inside are exactly the layer lowering
    plain = lower(make_layout(CFG, MAX_SEQ, lay.tiling))
    assert [ins for ins in p.instrs if ins.NAME not in ("embed", "lm_head", "argmax")] == plain.instrs
    assert not any(ins.NAME in ("embed", "lm_head", "argmax") for ins in plain.instrs)


@pytest.mark.parametrize("policy", ["cost", "round-robin", "random"])
@pytest.mark.parametrize("sms", [1, 3, 8, 132])
def test_decoder_tapes_verify(sms, policy):
    comp = compile_model(CFG, sms, max_seq=MAX_SEQ, policy=policy, seed=sms, sequential=(sms == 1),
                         lowering=decoder_lowering(lm_rows=16, emb_cols=32))
    assert isinstance(comp.tape.lay, DecoderLayout)
    assert comp.report.n_instructions == len(comp.prog)


def test_decoder_layout_errors():
    with pytest.raises(ValueError, match="vocab"):
        DecoderLayout(dataclasses.replace(CFG, vocab=0), Tiling.for_config(CFG), MAX_SEQ)
    with pytest.raises(ValueError, match="lm_rows"):
        DecoderLayout(CFG, Tiling.for_config(CFG), MAX_SEQ, lm_rows=24)
    with pytest.raises(ValueError, match="emb_cols"):
        DecoderLayout(CFG, Tiling.for_config(CFG), MAX_SEQ, emb_cols=-16)


def _decoder_tape(sms=3):
    comp = compile_model(CFG, sms, max_seq=MAX_SEQ, lowering=decoder_lowering(lm_rows=16, emb_cols=16))
    return comp.tape, comp.prog


OPERANDS = [("embed", "col0"), ("lm_head", "row0"), ("argmax", "nparts")]


@pytest.mark.parametrize("opname,field", OPERANDS, ids=[f"{o}.{f}" for o, f in OPERANDS])
@pytest.mark.parametrize("value", [10_000, -1, 3])
def test_decoder_operand_out_of_range(opname, field, value):
    tape, _ = _decoder_tape()
    k = next(i for i in range(len(tape)) if REGISTRY[opname].OPCODE == int(tape.words[i, 0]))
    bad = dataclasses.replace(tape, words=tape.words.clone())
    bad.words[k, HEADER + REGISTRY[opname].operand_names().index(field)] = value
    with pytest.raises(TapeError) as ei:
        verify(bad)
    where = "pool" if k in tape.pool_range() else "sm "
    hits = [m for m in ei.value.problems if f"({opname}, {where}" in m and "operand out of range" in m]
    assert hits and any(f"{field} {value}" in m for m in hits), ei.value.problems[:4]


def test_decoder_opcodes_need_a_decoder_layout():
    lay = make_layout(CFG, MAX_SEQ)         # a plain layer layout
    for ins in (opcodes.Embed(0), opcodes.LMHead(0), opcodes.Argmax(13)):
        assert any("DecoderLayout" in m for m in ins.check_operands(lay))


def test_verifier_catches_lm_head_without_wait():
    tape, prog = _decoder_tape()
    bad = dataclasses.replace(tape, words=tape.words.clone())
    for k in range(len(bad)):
        if int(bad.words[k, 0]) == REGISTRY["lm_head"].OPCODE:
            bad.words[k, 1], bad.words[k, 2] = -1, 0
    with pytest.raises(TapeError, match=r"lm_head.*reads xout\[.*does not wait for"):
        verify(bad, prog)


# ---- the tape VM on decoder tapes ------------------------------------------------------------------
def test_decoder_vm_matches_reference():
    w = decoder_weights()
    kv0 = make_kv_cache(CFG, MAX_SEQ, 9, seed=2)
    cs = rope_tables(CFG, MAX_SEQ)
    tapes = [(compile_model(CFG, sms, max_seq=MAX_SEQ, policy=pol, seed=seed, lowering=lo).tape, seed)
             for sms, pol, seed, lo in [(1, "cost", None, lower_decoder), (3, "cost", 0, decoder_lowering(16, 16)),
                                        (8, "round-robin", 1, lower_decoder),
                                        (132, "random", 2, decoder_lowering(64, 32))]]
    kvs = [clone_cache(kv0) for _ in tapes]
    kv_ref = clone_cache(kv0)
    tok = 17
    for pos in range(9, 13):
        ref = decoder_ref(w, kv_ref, CFG, tok, pos, cs)
        outs = [run_decoder_vm(t, w, kv, tok, pos, seed=s) for (t, s), kv in zip(tapes, kvs)]
        lg0, nt0 = outs[0]
        assert lg0.shape == (1, CFG.vocab) and lg0.dtype == torch.float32
        assert rel_err(lg0, ref) <= LOGIT_TOL
        assert nt0 == int(torch.argmax(lg0))
        top2 = ref.topk(2).values[0]
        if top2[0] - top2[1] > 0.1:
            assert nt0 == int(torch.argmax(ref))
        for lg, nt in outs[1:]:
            assert nt == nt0
            # tiles of the same rows give the same bits; other LM head tilings the same values
            assert torch.allclose(lg, lg0, rtol=0, atol=1e-5)
        tok = nt0
    for kv in kvs[1:]:
        for a, b in zip(kv, kvs[0]):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_vm_argmax_reduction_ties():
    amax = torch.tensor([1.0, 0.0, 3.0, 40.0, 3.0, 17.0, 2.0, 60.0, 3.0, 5.0])      # pairs (max, index)
    assert reduce_partials(amax, 5, 100) == 5       # 3.0 at indices 40, 17 and 5: the lowest wins
    assert reduce_partials(amax, 3, 100) == 17
    assert reduce_partials(torch.tensor([float("-inf"), 0.0]), 1, 100) == 0


# ---- decode_step and generate on the kernel --------------------------------------------------------
def test_decode_step_and_generate(monkeypatch):
    """Host-driven greedy decode_step loop vs generate on a fresh cache: same tokens, same logits
    (bitwise: the same kernel), one launch per position, and the kernel's token = the argmax."""
    w = decoder_weights()
    til = Tiling.for_config(CFG, **FAST)
    prompt = [5, 17, 150]
    n_new = 3
    cs = rope_tables(CFG, MAX_SEQ)
    # (a) the host drives: decode_step, argmax on the host, feed back
    kv_a = make_kv_cache(CFG, MAX_SEQ, 0)
    kv_ref = clone_cache(kv_a)
    h = build_decoder(w, kv_a, CFG.to_dict(), MAX_SEQ, tiling=til, lm_rows=16, emb_cols=16)
    assert h.lay.n_emb_tiles == 4 and h.lay.n_lm_tiles == 13
    seq, logits_a = list(prompt), []
    for pos in range(len(prompt) + n_new - 1):
        tok = torch.tensor([seq[pos]])
        lg = decode_step(h, tok, pos)
        ref = decoder_ref(w, kv_ref, CFG, seq[pos], pos, cs)
        assert lg.shape == (1, CFG.vocab) and lg.dtype == torch.float32
        assert rel_err(lg, ref) <= LOGIT_TOL, pos
        nxt = int(torch.argmax(lg))
        assert int(h.tok) == nxt and int(h.toks[pos]) == nxt      # ARGMAX agrees with torch on the same logits
        if pos >= len(prompt) - 1:
            seq.append(nxt)
            logits_a.append(lg)
    teardown(h)
    # (b) generate: the host only launches
    kv_b = make_kv_cache(CFG, MAX_SEQ, 0)
    h = build_decoder(w, kv_b, CFG.to_dict(), MAX_SEQ, tiling=til, lm_rows=16, emb_cols=16)
    calls = count_launches(monkeypatch)
    toks, logits_b = generate(h, torch.tensor(prompt), n_new, return_logits=True, prefill=False)
    # one launch per position; each embeds seq[pos]: the prompt's (copied on the device) and then the
    # token the previous launch's ARGMAX left in the buffer
    assert calls == [(pos, seq[pos]) for pos in range(len(prompt) + n_new - 1)]
    assert toks.tolist() == seq[len(prompt):]
    assert torch.equal(logits_b, torch.cat(logits_a))        # (so decode_step returned fresh tensors too)
    for (ka, va), (kb, vb) in zip(kv_a, kv_b):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    # continue where it stopped: the last token is still on the device
    more = generate(h, toks[-1:], 2, start_pos=len(prompt) + n_new - 1)
    assert more.shape == (2,)
    teardown(h)
    # (c) generate with the prompt prefilled (all but its last token in one rows launch): the cache and
    # the logits differ from (a) by the rows tiles' rounding only, the tokens not at all
    kv_c = make_kv_cache(CFG, MAX_SEQ, 0)
    h = build_decoder(w, kv_c, CFG.to_dict(), MAX_SEQ, tiling=til, lm_rows=16, emb_cols=16)
    calls = count_launches(monkeypatch)
    toks_c, logits_c = generate(h, torch.tensor(prompt), n_new, return_logits=True, prefill=True)
    # one rows launch of the prompt but its last token, then one-row launches from the last prompt token on
    assert calls[0] == ("rows", len(prompt) - 1)
    assert [p for p, _ in calls[1:]] == list(range(len(prompt) - 1, len(prompt) + n_new - 1))
    assert toks_c.tolist() == seq[len(prompt):]
    for a, c in zip(logits_a, logits_c):
        assert rel_err(c.reshape(1, -1), a) <= LOGIT_TOL
    for (ka, va), (kc, vc) in zip(kv_a, kv_c):
        assert rel_err(kc, ka) <= LOGIT_TOL and rel_err(vc, va) <= LOGIT_TOL
    teardown(h)


def test_argmax_ties_go_to_the_lowest_index():
    """Logits that tie exactly (identical LM head rows, in one tile and across tiles)."""
    w = decoder_weights(seed=1)
    kv = make_kv_cache(CFG, MAX_SEQ, 0)
    h = build_decoder(w, kv, CFG.to_dict(), MAX_SEQ, tiling=Tiling.for_config(CFG, **FAST), lm_rows=16)
    # the direction the final hidden state points in for token 9 at position 0
    lg = decode_step(h, torch.tensor([9]), 0)
    v = (h.hidden.float()[0] * w["final_norm"].float())
    v = (v / v.norm()).to(torch.bfloat16)
    lm = w["lm_head"]
    for winners, want in [((150, 38, 37), 37), ((199, 120), 120), ((41, 40), 40), (tuple(range(200)), 0)]:
        lm.copy_((0.25 * v.float()).to(torch.bfloat16).expand_as(lm))
        for r in winners:
            lm[r] = v
        lg = decode_step(h, torch.tensor([9]), 0)
        m = lg.max()
        assert (lg[0] == m).nonzero().flatten().tolist() == sorted(winners)     # an exact tie
        assert int(h.tok) == want == int(torch.argmax(lg))
    teardown(h)


# ---- input validation ------------------------------------------------------------------------------
def _built(**kw):
    w = decoder_weights()
    kv = make_kv_cache(CFG, 16, 0)
    return build_decoder(w, kv, CFG.to_dict(), 16, **kw), w, kv


@pytest.mark.parametrize("case,edit,exc,words", [
    ("no-vocab", lambda w, kv, c: (w, kv, {k: v for k, v in c.items() if k != "vocab"}), ValueError, ["vocab"]),
    ("no-lm-head", lambda w, kv, c: ({k: v for k, v in w.items() if k != "lm_head"}, kv, c), ValueError,
     ["weights", "lm_head"]),
    ("embed-shape", lambda w, kv, c: ({**w, "embed": w["embed"][:100]}, kv, c), ValueError,
     ["weights['embed']", "(200, 64)"]),
    ("final-norm-dtype", lambda w, kv, c: ({**w, "final_norm": w["final_norm"].float()}, kv, c), TypeError,
     ["weights['final_norm']", "bfloat16"]),
    ("lm-head-strided", lambda w, kv, c: ({**w, "lm_head": torch.zeros(64, 200, dtype=torch.bfloat16).T}, kv, c),
     ValueError, ["weights['lm_head']", "contiguous"]),
    ("kv-aliases-final-norm", lambda w, kv, c: ({**w, "final_norm": kv[1][0].view(-1)[:64]}, kv, c),
     ValueError, ["kv_cache[1][0]", "weights['final_norm']"]),
    ("layers", lambda w, kv, c: ({**w, "layers": w["layers"][:1]}, kv, c), ValueError, ["weights['layers']"]),
])
def test_build_decoder_errors(case, edit, exc, words):
    w, kv, c = edit(decoder_weights(), make_kv_cache(CFG, 16, 0), CFG.to_dict())
    with pytest.raises(exc) as ei:
        build_decoder(w, kv, c, 16)
    for s in words:
        assert s in str(ei.value), (case, str(ei.value))


def test_build_decoder_rejects_its_own_options():
    w = decoder_weights()
    with pytest.raises(TypeError, match="lowering"):
        build_decoder(w, make_kv_cache(CFG, 16, 0), CFG.to_dict(), 16, lowering=lower)


def test_tied_embeddings_are_accepted():
    w = decoder_weights()
    w["lm_head"] = w["embed"]
    h = build_decoder(w, make_kv_cache(CFG, 16, 0), CFG.to_dict(), 16)
    assert h.layer.buffers["lmh_ptr"] is h.layer.buffers["embed_ptr"]
    teardown(h)


def test_step_argument_errors():
    h, w, kv = _built()
    kv0 = clone_cache(kv)
    bad = [
        (lambda: decode_step(h, torch.tensor([1.0]), 0), TypeError, "tokens"),
        (lambda: decode_step(h, torch.tensor([1, 2]), 0), ValueError, "tokens"),
        (lambda: decode_step(h, torch.tensor([200]), 0), ValueError, "vocab=200"),
        (lambda: decode_step(h, torch.tensor([-1]), 0), ValueError, "vocab=200"),
        (lambda: decode_step(h, torch.tensor([1]), 16), ValueError, "pos"),
        (lambda: decode_step(h, torch.tensor([1]), 1.0), TypeError, "pos"),
        (lambda: decode_step(h, "1", 0), TypeError, "tokens"),
        (lambda: generate(h, [1, 2, 3], 15), ValueError, "max_seq_len"),      # positions 0 .. 16
        (lambda: generate(h, [1, 2, 3], 14, start_pos=1), ValueError, "max_seq_len"),
        (lambda: generate(h, [], 2), ValueError, "prompt_tokens"),
        (lambda: generate(h, torch.tensor([[1, 2]]), 2), ValueError, "prompt_tokens"),
        (lambda: generate(h, [1, 300], 2), ValueError, "vocab"),
        (lambda: generate(h, [1], -1), ValueError, "n_new"),
        (lambda: generate(h, [1.5], 1), TypeError, "prompt_tokens"),
        (lambda: generate(h, [1], 1, start_pos=16), ValueError, "start_pos"),
    ]
    for f, exc, word in bad:
        with pytest.raises(exc, match=word):
            f()
    for (k, v), (k0, v0) in zip(kv, kv0):        # nothing ran
        assert torch.equal(k, k0) and torch.equal(v, v0)
    teardown(h)
    teardown(h)
    with pytest.raises(ValueError, match="teardown"):
        decode_step(h, torch.tensor([1]), 0)
    with pytest.raises(ValueError, match="teardown"):
        generate(h, [1], 1)


def test_decoder_tape_json_round_trip():
    """A whole-model tape written to JSON comes back with its decoder layout and verifies."""
    from opcodes.decoder import DecoderLayout
    from schedule import Tape, compile_model, verify
    from schedule.decoder_program import decoder_lowering
    cfg = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, vocab=256, name="rt")
    comp = compile_model(cfg, 3, max_seq=64, lowering=decoder_lowering(lm_rows=16, emb_cols=32))
    back = Tape.from_json(comp.tape.to_json())
    assert isinstance(back.lay, DecoderLayout) and back.lay == comp.tape.lay
    assert back.lay.lm_rows == 16 and back.lay.emb_cols == 32
    assert torch.equal(back.words, comp.tape.words) and torch.equal(back.offsets, comp.tape.offsets)
    verify(back, comp.prog)
