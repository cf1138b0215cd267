"""Many rows per step (issue 50): the rows tapes in the VM and the real kernel (the Triton interpreter)
against the oracle ``decoder_ref_rows``, chunked prefill, batch invariance, and the API's errors.

Tolerance. The rows kernel rounds where the one-row kernel does (fp32 sums of bf16 products, q, x1 and the
down partials in fp32, the normed operands, attention output and activation in bf16), not where the
bf16 oracle does (every matmul output in bf16), so it is held to the multi-layer criterion against the
all-fp32 oracle: error <= 1.1x the bf16 oracle's own, as the one-row decoder is. Kernel against VM and
kernel against itself in other chunkings: ``KERNEL_TOL`` (ATTN_R's tensor-core dots take bf16 q and p,
which ``run_torch`` keeps in fp32: ``AttnR.TORCH_RTOL``; measured 4.5e-3 on the logits). A wrong slot, position or mask moves a
row's logits by ~1e-1.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import bitwise_equal, caches_equal, check_message, clone_cache, decoder_weights
from interp import build_decoder, decode_step, prefill, teardown
from opcodes import ModelConfig
from opcodes.base import kernel_classes
from opcodes.decoder import decoder_ref_rows, decoder_ref_rows_fp32
from opcodes.reference import make_kv_cache, rel_err
from opcodes.rows import rows_state, rows_tiling
from schedule.compile import compile_model
from schedule.rows_program import lower_rows, rows_lowering
from schedule.vm import run_tape

CFG = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="tiny-rows")
MAX_SEQ, B, PREFIX = 48, 3, 20
KERNEL_TOL = 1e-2


def _ok(lg, toks, slots, pos, w, kv_before) -> list[float]:
    """Each row's error against the fp32 oracle, asserted <= 1.1x the bf16 oracle's; returns the ratios."""
    ref = decoder_ref_rows(w, clone_cache(kv_before), CFG, toks, slots, pos)
    ref32 = decoder_ref_rows_fp32(w, [tuple(t.float() for t in p) for p in kv_before], CFG, toks, slots, pos)
    ratios = []
    for r in range(len(toks)):
        e, e_ref = rel_err(lg[r], ref32[r]), rel_err(ref[r], ref32[r])
        assert e <= 1.1 * e_ref, f"row {r}: err {e:.3e} > 1.1x the bf16 oracle's {e_ref:.3e}"
        ratios.append(e / e_ref)
    return ratios


# a prefill chunk of slot 0 (positions 20-23), a decode row of slot 1 at 5, two rows of slot 2 at 30-31
ROWS = dict(slots=[0, 0, 0, 0, 1, 2, 2], pos=[20, 21, 22, 23, 5, 30, 31], toks=[3, 7, 11, 150, 0, 199, 42])


def test_rows_tape_in_the_vm_meets_the_criterion():
    w = decoder_weights(CFG, seed=1)
    kv = make_kv_cache(CFG, MAX_SEQ, PREFIX, seed=2, batch=B)
    kv0 = clone_cache(kv)
    tape = compile_model(CFG, 1, max_seq=MAX_SEQ, tiling=rows_tiling(CFG, 16, MAX_SEQ), lowering=rows_lowering(16, B),
                         sequential=True).tape
    st = run_tape(tape, w, kv, torch.zeros(1), 0, seed=3, return_state=True,
                  state={"rows": rows_state(16, ROWS["slots"], ROWS["pos"], ROWS["toks"])})
    lg = st.buf["logits_r"].view(CFG.vocab, 16)[:, :7].T
    _ok(lg, ROWS["toks"], ROWS["slots"], ROWS["pos"], w, kv0)
    ref_kv = clone_cache(kv0)
    decoder_ref_rows(w, ref_kv, CFG, ROWS["toks"], ROWS["slots"], ROWS["pos"])
    for (k, v), (rk, rv), (k0, v0) in zip(kv, ref_kv, kv0):
        for t, r, t0 in ((k, rk, k0), (v, rv, v0)):
            written = torch.zeros(B, MAX_SEQ, dtype=torch.bool)
            written[ROWS["slots"], ROWS["pos"]] = True
            assert bitwise_equal(t.transpose(1, 2)[~written], t0.transpose(1, 2)[~written])   # nothing else moved
            assert rel_err(t.transpose(1, 2)[written], r.transpose(1, 2)[written]) <= 1e-2


def _built(batch=B, prefix=PREFIX, **kw):
    w = decoder_weights(CFG, seed=1)
    kv = make_kv_cache(CFG, MAX_SEQ, prefix, seed=2, batch=batch)
    return build_decoder(w, kv, CFG, MAX_SEQ, batch=batch, **kw), w, kv


def test_kernel_ragged_rows_meet_the_criterion_and_match_the_vm():
    h, w, kv = _built()
    kv0 = clone_cache(kv)
    lg = decode_step(h, torch.tensor(ROWS["toks"]), torch.tensor(ROWS["pos"]), slots=ROWS["slots"])
    assert lg.shape == (7, CFG.vocab) and lg.dtype == torch.float32
    _ok(lg, ROWS["toks"], ROWS["slots"], ROWS["pos"], w, kv0)
    kv_vm = clone_cache(kv0)
    st = run_tape(h.rows[16].tape, w, kv_vm, torch.zeros(1), 0, seed=5, return_state=True,
                  state={"rows": rows_state(16, ROWS["slots"], ROWS["pos"], ROWS["toks"])})
    assert rel_err(lg, st.buf["logits_r"].view(CFG.vocab, 16)[:, :7].T) <= KERNEL_TOL
    for (k, v), (kk, vv) in zip(kv, kv_vm):
        assert rel_err(k, kk) <= KERNEL_TOL and rel_err(v, vv) <= KERNEL_TOL
    teardown(h)


def test_prefill_in_chunks_matches_the_oracle_and_one_launch():
    """A 9-token prompt in chunks of 4 (3 launches) meets the criterion against the oracle over the prompt,
    and equals the prompt in one launch on another slot within the kernel's reordering tolerance."""
    h, w, kv = _built(prefix=0)
    kv0 = clone_cache(kv)
    prompt = [(37 * i + 11) % CFG.vocab for i in range(9)]
    lg = prefill(h, prompt, 0, slot=2, chunk=4)
    assert lg.shape == (1, CFG.vocab)
    n = len(prompt)
    ref32 = decoder_ref_rows_fp32(w, [tuple(t.float() for t in p) for p in kv0], CFG, prompt, [2] * n, list(range(n)))
    ref = decoder_ref_rows(w, clone_cache(kv0), CFG, prompt, [2] * n, list(range(n)))
    assert rel_err(lg, ref32[-1:]) <= 1.1 * rel_err(ref[-1:], ref32[-1:])
    last = prefill(h, prompt, 0, slot=1)                            # one launch, on slot 1
    assert rel_err(last, lg) <= KERNEL_TOL
    for (k, v) in kv:
        assert rel_err(k[1, :, :n], k[2, :, :n]) <= KERNEL_TOL and rel_err(v[1, :, :n], v[2, :, :n]) <= KERNEL_TOL
    assert caches_equal([(k[0:1], v[0:1]) for k, v in kv], [(k[0:1], v[0:1]) for k, v in kv0])    # slot 0 untouched
    # a step that asks for no logits (a chunk before the prompt's last) leaves the LM head's output alone
    from interp.rows import run_rows
    h.rows[16].scratch["logits_r"].fill_(7.0)
    assert run_rows(h, prompt[:3], [0, 1, 2], [0, 0, 0], logits_rows=[]) is None
    assert bool((h.rows[16].scratch["logits_r"] == 7.0).all())
    assert prefill(h, prompt[:5], 0, slot=0, logits=False) is None         # a prompt's part: no LM head either
    assert bool((h.rows[16].scratch["logits_r"] == 7.0).all())
    with pytest.raises(TypeError, match="logits"):
        prefill(h, prompt[:5], 0, slot=0, logits=1)
    teardown(h)


def _a_150_token_prompt(batch: int):
    """Prefill a 150-token prompt on slot 0 of a fresh ``batch``-slot model (one 256-row launch) and check its
    last logits against the oracle over the prompt; (handle, cache, prompt, logits)."""
    w = decoder_weights(CFG, seed=1)
    kv = make_kv_cache(CFG, 160, 0, seed=2, batch=batch)
    kv0 = clone_cache(kv)
    h = build_decoder(w, kv, CFG, 160, batch=batch)
    prompt = [(53 * i + 5) % CFG.vocab for i in range(150)]
    n = len(prompt)
    lg = prefill(h, prompt, 0, slot=0)
    assert list(h.rows) == [256]
    ref32 = decoder_ref_rows_fp32(w, [tuple(t.float() for t in p) for p in kv0], CFG, prompt, [0] * n, list(range(n)))
    ref = decoder_ref_rows(w, clone_cache(kv0), CFG, prompt, [0] * n, list(range(n)))
    assert rel_err(lg, ref32[-1:]) <= 1.1 * rel_err(ref[-1:], ref32[-1:])
    return h, kv, prompt, lg


def test_a_prompt_past_128_tokens_in_one_256_row_launch():
    """150 prompt tokens: one launch of the 256-row bucket (its own tiling: 8 warps, M 64 tiles, 4 stages)
    meets the criterion against the oracle over the prompt and writes the cache the 128 + 22 chunks write."""
    h, kv, prompt, lg = _a_150_token_prompt(batch=2)
    n = len(prompt)
    chunked = prefill(h, prompt, 0, slot=1, chunk=128)
    assert sorted(h.rows) == [32, 128, 256]
    assert rel_err(chunked, lg) <= KERNEL_TOL
    for k, v in kv:
        assert rel_err(k[1, :, :n], k[0, :, :n]) <= KERNEL_TOL and rel_err(v[1, :, :n], v[0, :, :n]) <= KERNEL_TOL
        assert not k[:, :, n:].any() and not v[:, :, n:].any()          # nothing past the prompt
    teardown(h)


def _prompt_meets_the_oracle(cfg, ms: int, prompt: list, **kw):
    """Prefill ``prompt`` on slot 0 of a fresh model (``kw``: prefill's options); its last logits meet the criterion
    against the oracle over the prompt, its K/V is the oracle's within the kernel tolerance and nothing is written
    past it. Returns the handle."""
    w = decoder_weights(cfg, seed=1)
    kv = make_kv_cache(cfg, ms, 0, seed=2)
    kv0 = clone_cache(kv)
    h = build_decoder(w, kv, cfg, ms)
    n = len(prompt)
    lg = prefill(h, prompt, 0, **kw)
    ref32 = decoder_ref_rows_fp32(w, [tuple(t.float() for t in p) for p in kv0], cfg, prompt, [0] * n, list(range(n)))
    kv_ref = clone_cache(kv0)
    ref = decoder_ref_rows(w, kv_ref, cfg, prompt, [0] * n, list(range(n)))
    assert rel_err(lg, ref32[-1:]) <= 1.1 * rel_err(ref[-1:], ref32[-1:])
    for (k, v), (kr, vr) in zip(kv, kv_ref):
        assert rel_err(k[:, :, :n], kr[:, :, :n]) <= KERNEL_TOL and rel_err(v[:, :, :n], vr[:, :, :n]) <= KERNEL_TOL
        assert not k[:, :, n:].any() and not v[:, :, n:].any()
    return h


def test_a_head_of_64_dims_projects_both_rope_halves_in_one_dot():
    """hd 64 in a 256-row bucket: a QKV tile's two RoPE halves of 32 rows each are one dot of M 64 (a wgmma on
    sm_90, not two mma.sync; bench/notes/s43.md v165), its accumulator split into the halves: a 140-token prompt's
    last logits meet the criterion against the oracle and its K/V cache matches the oracle's."""
    from opcodes.decoder import DecoderLayout
    from opcodes.rows_qkv import QKVR
    cfg = ModelConfig(layers=1, d=128, ffn=128, n_q=2, n_kv=1, hd=64, theta=10000.0, vocab=64, name="hd64-rows")
    til = rows_tiling(cfg, 256, 160)
    lay = DecoderLayout(cfg, til, 160)
    assert QKVR.CONSTEXPRS["QKV_M"](lay) == QKVR.CONSTEXPRS["QKV_ROWS"](lay) // 2 == 32
    h = _prompt_meets_the_oracle(cfg, 160, [(29 * i + 3) % cfg.vocab for i in range(140)])
    assert list(h.rows) == [256]
    teardown(h)


def test_prefill_attention_tiles_of_more_pairs_meet_the_criterion(monkeypatch):
    """``Tiling.attn_pairs`` sets a prefill attention tile's (row, head) pairs: at 256 (128 rows of this model's
    groups of 2, against 32 by default) a 150-token prompt in the 256-row bucket is two tiles, one whole
    and one of 22 live rows, and still meets the criterion against the oracle."""
    import interp.rows
    monkeypatch.setattr(interp.rows, "rows_tiling", lambda cfg, r, ms: rows_tiling(cfg, r, ms, attn_pairs=256))
    h, _, _, _ = _a_150_token_prompt(batch=1)
    assert h.rows[256].lay.attn_rt == 128 and h.rows[256].lay.tiling.attn_pairs == 256
    teardown(h)
    with pytest.raises(ValueError, match="attn_pairs must be a power of two"):
        rows_tiling(CFG, 256, 160, attn_pairs=48)


def test_a_prompts_last_logits_alone_in_one_group_of_16_columns():
    """A step that wants one row's logits (a prompt's last) computes the LM head over that row's group of 16
    columns only (``rows_state(group=)``): in the kernel and the VM those 16 columns are written and no other,
    and the row's logits equal those of the same step asking for every row's."""
    from interp.rows import run_rows
    w = decoder_weights(CFG, seed=1)
    kv = make_kv_cache(CFG, 64, 0, seed=2, batch=2)
    kv0 = clone_cache(kv)
    toks = [(29 * i + 3) % CFG.vocab for i in range(40)]
    pos = list(range(40))
    h = build_decoder(w, kv, CFG, 64, batch=2)
    every = run_rows(h, toks, pos, [0] * 40)                      # the 64-row bucket, every row's logits
    scratch = h.rows[64].scratch["logits_r"].view(CFG.vocab, 64)
    scratch.fill_(7.0)
    last = run_rows(h, toks, pos, [1] * 40, logits_rows=[39])     # the same prompt on slot 1, row 39's alone
    assert sorted(h.rows) == [64] and last.shape == (1, CFG.vocab)
    written = (scratch != 7.0).all(dim=0)
    assert written[32:48].all() and not written[:32].any() and not written[48:].any()
    assert rel_err(last[0], every[39]) <= KERNEL_TOL
    teardown(h)
    tape = compile_model(CFG, 1, max_seq=64, tiling=rows_tiling(CFG, 64, 64), lowering=rows_lowering(64, 2),
                         sequential=True).tape
    vm, none = (run_tape(tape, w, clone_cache(kv0), torch.zeros(1), 0, seed=3, return_state=True,
                         state={"rows": rows_state(64, [0] * 40, pos, toks, **kw)}).buf["logits_r"].view(CFG.vocab, 64)
                for kw in (dict(group=2), dict(logits=False)))          # (the VM's scratch starts as seeded junk)
    assert bitwise_equal(vm[:, :32], none[:, :32]) and bitwise_equal(vm[:, 48:], none[:, 48:])
    assert rel_err(vm[:, 39], last[0]) <= KERNEL_TOL
    with pytest.raises(ValueError, match="group 4 not in"):
        rows_state(64, [0], [0], [1], group=4)


def test_a_512_row_step_in_two_column_blocks_in_the_vm_and_the_kernel():
    """The 512-row bucket's tiles are two column blocks of 256 (``n0``): a step of 300 rows (a prefill chunk of
    slot 0 at 0..279 across both blocks, decode rows of slots 1 and 2 in the second) meets the criterion in the
    VM and in the interpreter kernel, each row's logits where the host reads them."""
    from interp.rows import run_rows
    from schedule.tape import decode
    ms = 288
    w = decoder_weights(CFG, seed=1)
    kv = make_kv_cache(CFG, ms, 0, seed=2, batch=3)
    for k, v in kv:                       # slots 1 and 2 hold 30 / 40 positions
        k[1:, :, :40].normal_(0, 1, generator=torch.Generator().manual_seed(3))
        v[1:, :, :40].normal_(0, 1, generator=torch.Generator().manual_seed(4))
    kv0 = clone_cache(kv)
    slots = [0] * 280 + [1] * 10 + [2] * 10
    pos = list(range(280)) + list(range(30, 40)) + list(range(40, 50))
    toks = [(31 * i + 7) % CFG.vocab for i in range(300)]
    lay_tape = compile_model(CFG, 1, max_seq=ms, tiling=rows_tiling(CFG, 512, ms), lowering=rows_lowering(512, 3),
                             sequential=True).tape
    assert lay_tape.lay.n_blocks == 2 and {getattr(d.ins, "n0", 0) for d in decode(lay_tape)} == {0, 256}
    st = run_tape(lay_tape, w, clone_cache(kv0), torch.zeros(1), 0, seed=3, return_state=True,
                  state={"rows": rows_state(512, slots, pos, toks)})
    vm = st.buf["logits_r"].view(2, CFG.vocab, 256).permute(1, 0, 2).reshape(CFG.vocab, 512)[:, :300].T
    check = list(range(270, 300))        # the chunk's last rows (block 1) and the decode rows
    ref32 = decoder_ref_rows_fp32(w, [tuple(t.float() for t in p) for p in kv0], CFG, toks, slots, pos)
    ref = decoder_ref_rows(w, clone_cache(kv0), CFG, toks, slots, pos)
    for r in check + [0, 255, 256]:
        assert rel_err(vm[r], ref32[r]) <= 1.1 * rel_err(ref[r], ref32[r]), r
    h = build_decoder(w, kv, CFG, ms, batch=3)
    lg = run_rows(h, toks, pos, slots, logits_rows=check)
    assert sorted(h.rows) == [512] and lg.shape == (len(check), CFG.vocab)
    for i, r in enumerate(check):
        assert rel_err(lg[i], ref32[r]) <= 1.1 * rel_err(ref[r], ref32[r]), r
        assert rel_err(lg[i], vm[r]) <= KERNEL_TOL
    teardown(h)


def test_decode_attention_in_key_groups_meets_the_criterion(monkeypatch):
    """``Tiling.attn_kg`` = 4 in the decode buckets (bench/notes/s43.md v169): each block's 128 keys as 4 groups of
    32 with their own running softmax, merged after the loop. Ragged rows at positions 5 .. 31 leave groups 1-3
    of every block empty (their running max stays -inf: no NaN), rows at 40 .. 47 fill group 1 in part; each row
    meets the criterion and is within the kernel tolerance of the one-group kernel."""
    import interp.rows
    h0, w, kv = _built()
    kv0 = clone_cache(kv)
    slots, pos, toks = ROWS["slots"] + [1, 2], ROWS["pos"] + [40, 47], ROWS["toks"] + [9, 77]
    base = decode_step(h0, torch.tensor(toks), torch.tensor(pos), slots=slots)
    teardown(h0)
    monkeypatch.setattr(interp.rows, "rows_tiling", lambda cfg, r, ms: rows_tiling(cfg, r, ms, attn_kg=4))
    w2 = decoder_weights(CFG, seed=1)
    kv2 = clone_cache(kv0)
    h = build_decoder(w2, kv2, CFG, MAX_SEQ, batch=B)
    lg = decode_step(h, torch.tensor(toks), torch.tensor(pos), slots=slots)
    assert h.rows[16].tape.lay.tiling.attn_kg == 4 and torch.isfinite(lg).all()
    _ok(lg, toks, slots, pos, w, kv0)
    assert rel_err(lg, base) <= KERNEL_TOL
    with pytest.raises(ValueError, match="attn_kg"):
        rows_tiling(CFG, 16, MAX_SEQ, attn_kg=16)          # 8 keys a group: tl.dot needs 16
    teardown(h)


def test_prefill_chunks_take_the_largest_bucket_while_it_fills():
    from interp.rows import prefill_chunks
    assert prefill_chunks(4096) == [(0, 1024), (1024, 1024), (2048, 1024), (3072, 1024)]
    assert prefill_chunks(1700) == [(0, 1024), (1024, 512), (1536, 164)]     # the rest: 512 + 164, not 1024
    assert prefill_chunks(600) == [(0, 512), (512, 88)]
    assert prefill_chunks(9) == [(0, 9)]
    assert prefill_chunks(9, chunk=4) == [(0, 4), (4, 4), (8, 1)]
    assert prefill_chunks(2000, chunk=1024) == [(0, 1024), (1024, 976)]
    assert prefill_chunks(3000) == [(0, 1024), (1024, 1024), (2048, 512), (2560, 440)]


def test_a_buffer_past_int32_offsets_is_refused_before_anything_is_built():
    """The kernels index every buffer with int32 offsets: a 70B-shaped model of 80 layers at 1024 rows a step would
    need a gate/up output of 80 x 28672 x 1024 elements (2.3e9); the layout's buffers are refused with the buffer,
    its size and what to change named, before any allocation."""
    from opcodes.base import MAX_BUFFER_ELEMENTS, scratch_buffers
    from opcodes.decoder import DecoderLayout
    big = ModelConfig(layers=80, d=8192, ffn=28672, n_q=64, n_kv=8, hd=128, vocab=128256)
    prog = lower_rows(DecoderLayout(big, rows_tiling(big, 1024, 1152), 1152), rows=1024, batch=1)
    with pytest.raises(ValueError) as e:
        scratch_buffers(prog.lay, prog.classes())
    check_message(e.value, ["scratch buffer", "int32", str(MAX_BUFFER_ELEMENTS), "1024 rows", "smaller bucket"])
    small = ModelConfig(layers=2, d=8192, ffn=28672, n_q=64, n_kv=8, hd=128, vocab=128256)
    prog = lower_rows(DecoderLayout(small, rows_tiling(small, 1024, 1152), 1152), rows=1024, batch=1)
    assert scratch_buffers(prog.lay, prog.classes())                       # 2 layers of it fit


def test_a_1024_row_launch_runs_four_column_blocks():
    """A 520-token prompt in one launch of the 1024-row bucket (``chunk=1024``: its GEMM tiles on 4 column blocks of
    256, the last with no live row): the last logits meet the criterion against the oracle and the cache matches
    the oracle's, nothing written past the prompt."""
    from schedule.tape import decode
    h = _prompt_meets_the_oracle(CFG, 528, [(41 * i + 13) % CFG.vocab for i in range(520)], chunk=1024)
    assert sorted(h.rows) == [1024]
    assert {getattr(d.ins, "n0", 0) for d in decode(h.rows[1024].tape)} == {0, 256, 512, 768}
    teardown(h)


def test_each_column_blocks_lm_head_tiles_reach_every_sm():
    """A prompt's last chunk computes one column block's logits (one group of 16 columns): that block's LM head
    tiles are dealt over every SM, not to the SMs = block mod n_blocks (the v0-major listing of session 43 left
    a 1B prompt's last 1024-row chunk 2.6 ms of LM head on 34 SMs: bench/notes/s44.md, run 304)."""
    import dataclasses

    from schedule.tape import decode
    from opcodes.rows import RowsLayout
    sms, cfg = 8, dataclasses.replace(CFG, vocab=8192)      # 64 LM head tiles a block (a pool takes a few)
    tape = compile_model(cfg, sms, max_seq=1032, tiling=rows_tiling(cfg, 1024, 1032), lowering=rows_lowering(1024, 2),
                         decoder=True).tape
    # tiles of 128 vocabulary rows from 128 rows up (run 311), 32 below (the 64-row bucket's shared memory)
    assert tape.lay.lm_rows == 128 and [RowsLayout.of(tape.lay, rows=r).lm_rows for r in (16, 32, 64, 128)] == \
        [32, 32, 32, 128]
    # a probe's variant sets them (rows_lowering's lm_rows): the tape's layout, hence its kernel, has them
    lay16 = compile_model(cfg, sms, max_seq=1032, tiling=rows_tiling(cfg, 16, 1032),
                          lowering=rows_lowering(16, 2, lm_rows=128), decoder=True).tape.lay
    assert lay16.lm_rows == 128 and lay16.rows == 16
    by_block: dict = {}
    for d in decode(tape):
        if d.ins.NAME == "lm_head_r":
            by_block.setdefault(d.ins.n0, []).append(d.sm)
    assert sorted(by_block) == [0, 256, 512, 768]
    for n0, on in by_block.items():
        counts = [on.count(s) for s in range(sms)]   # the rest (SM -1): a pool any SM takes from
        assert max(counts) <= -(-len(on) // sms), (n0, counts)


def test_read_logits_takes_the_rows_asked_for_from_the_blocked_scratch():
    """``read_logits`` (one row, rows 0 .. R-1 within one block or across blocks, any list) against indexing the
    blocked [blocks, vocab, NT] scratch row by row; each result a fresh contiguous tensor."""
    from interp.rows import read_logits
    lg = torch.randn(4, 37, 16, generator=torch.Generator().manual_seed(0))
    for R, sel in ((50, [49]), (50, [0]), (9, list(range(9))), (50, list(range(50))), (64, list(range(64))),
                   (50, [3, 17, 40, 41]), (50, [40, 3])):
        got = read_logits(lg, sel)
        want = torch.stack([lg[n // 16, :, n % 16] for n in sel])
        assert got.shape == (len(sel), 37) and got.is_contiguous() and torch.equal(got, want), (R, sel)
        assert got.untyped_storage().data_ptr() != lg.untyped_storage().data_ptr()


def test_a_rows_logits_do_not_depend_on_the_other_rows():
    """Row 0 alone, and beside other slots' rows at other positions: its logits and K/V bitwise the same
    (one bucket: the columns of a dot are independent, attention is per row)."""
    h, w, kv = _built()
    kv0 = clone_cache(kv)
    alone = decode_step(h, [9], [25], slots=[0])
    kv_alone = clone_cache(kv)
    for pair, pair0 in zip(kv, kv0):
        for t, t0 in zip(pair, pair0):
            t.copy_(t0)
    mixed = decode_step(h, [9, 4, 100, 17], [25, 3, 40, 26], slots=[0, 1, 2, 1])
    assert bitwise_equal(mixed[0], alone[0])
    for (k, v), (ka, va) in zip(kv, kv_alone):
        assert bitwise_equal(k[0, :, 25], ka[0, :, 25]) and bitwise_equal(v[0, :, 25], va[0, :, 25])
    teardown(h)


def test_bad_rows_inputs_fail_before_the_cache_is_touched():
    h, w, kv = _built()
    kv0 = clone_cache(kv)
    bad = [
        (lambda: decode_step(h, [1, 2], [3, MAX_SEQ]), ValueError, ["pos[1]", "past max_seq_len"]),
        (lambda: decode_step(h, [1, 2], [3, -1]), ValueError, ["pos[1]"]),
        (lambda: decode_step(h, [1, 2], [3]), ValueError, ["pos", "2 positions"]),
        (lambda: decode_step(h, [1, 2, 3, 4], [1, 2, 3, 4]), ValueError, ["tokens", "batch = 3"]),
        (lambda: decode_step(h, [1, 2], [3, 4], slots=[0, 3]), ValueError, ["slots[1]", "batch=3"]),
        (lambda: decode_step(h, [1, 2], [3, 3], slots=[1, 1]), ValueError, ["slot 1 position 3"]),
        (lambda: decode_step(h, [1, 200], [3, 4]), ValueError, ["tokens[1]", "vocab=200"]),
        (lambda: decode_step(h, [1.0, 2.0], [3, 4]), TypeError, ["tokens"]),
        (lambda: decode_step(h, torch.tensor([[1, 2]]), [3, 4]), ValueError, ["tokens", "1-D"]),
        (lambda: decode_step(h, list(range(1025)), list(range(1025)), slots=[0] * 1025), ValueError, ["at most 1024"]),
        (lambda: prefill(h, [1, 2, 3], MAX_SEQ - 2), ValueError, ["past max_seq_len"]),
        (lambda: prefill(h, [], 0), ValueError, ["tokens"]),
        (lambda: prefill(h, [1, 2], 0, slot=3), ValueError, ["slot", "batch=3"]),
        (lambda: prefill(h, [1, 2], 0, chunk=0), ValueError, ["chunk"]),
        (lambda: prefill(h, [1, 999], 0), ValueError, ["tokens[1]", "vocab"]),
        (lambda: prefill(h, [1, 2, -1], 0), ValueError, ["tokens[2]", "-1"]),         # numpy's check names the first
        (lambda: prefill(h, [1, 2 ** 70, 5], 0), ValueError, ["tokens[1]", str(2 ** 70)]),   # past int64
        (lambda: prefill(h, [1, True], 0), TypeError, ["tokens"]),
        (lambda: prefill(h, torch.tensor([3, 4, 250]), 0), ValueError, ["tokens[2]", "250"]),
    ]
    for f, exc, words in bad:
        with pytest.raises(exc) as e:
            f()
        check_message(e.value, words)
    assert caches_equal(kv, kv0)
    assert not h.rows                     # nothing was even built
    teardown(h)


def test_one_position_calls_beside_rows_calls_and_other_slots():
    """On a batched decoder a (1,) tensor pos is a rows call, as a list is (a step whose rows drop to one keeps
    its kernel and bits); ``pos=None`` (the device's held position, slot 0) is refused, the cache untouched,
    where a rows call wrote slot 0 since the last one-position step or the held position is another slot's
    (``generate(..., slot=s)``); a rows call on a torn-down or foreign handle names the handle."""
    from interp import generate
    from interp.rows import decode_rows
    h, w, kv = _built()
    a = decode_step(h, torch.tensor([9]), torch.tensor([25]))
    b = decode_step(h, [9], [25])
    assert a.shape == (1, CFG.vocab) and bitwise_equal(a, b)
    with pytest.raises(TypeError) as e:              # an int token beside it: the error says why it is a rows call
        decode_step(h, 9, torch.tensor([25]))
    check_message(e.value, ["tokens", "(1,) pos tensor", "int pos"])
    kv0 = clone_cache(kv)
    with pytest.raises(ValueError) as e:          # the rows calls above wrote slot 0
        decode_step(h, 9, None)
    check_message(e.value, ["pos", "many-rows call"])
    assert caches_equal(kv, kv0)
    decode_step(h, 9, 26)                         # an explicit one-position step on slot 0: None goes on at 27
    k27 = kv[0][0][0, :, 27].clone()
    decode_step(h, 11, None)
    assert not bitwise_equal(kv[0][0][0, :, 27], k27)
    generate(h, [5, 9], 1, slot=2, prefill=False)     # the held position is slot 2's now
    kv0 = clone_cache(kv)
    with pytest.raises(ValueError) as e:
        decode_step(h, 9, None)
    check_message(e.value, ["pos", "slot 2", "slots=[2]"])
    assert caches_equal(kv, kv0)
    from interp import runtime                        # a position set by the caller is slot 0's: None goes on there
    for tok, before in ((7, lambda: None), (8, lambda: prefill(h, [3, 4], 30))):
        before()
        runtime.set_position(h, 33)
        k33 = kv[0][0][0, :, 33].clone()
        decode_step(h, tok, None)
        assert not bitwise_equal(kv[0][0][0, :, 33], k33) and h.next_pos == 34
    teardown(h)
    for call in (lambda: prefill(h, [1, 2]), lambda: decode_step(h, [1], [2]), lambda: decode_rows(h, [1], [2])):
        with pytest.raises(ValueError) as e:
            call()
        check_message(e.value, ["handle", "teardown"])
    for call in (lambda: prefill("h", [1, 2]), lambda: decode_rows(None, [1], [2])):
        with pytest.raises(TypeError) as e:
            call()
        check_message(e.value, ["handle", "DecoderHandle"])


def test_build_decoder_batch_errors():
    w = decoder_weights(CFG, seed=1)
    kv = make_kv_cache(CFG, MAX_SEQ, 0, batch=2)
    for batch, exc, words in [(0, ValueError, ["batch", ">= 1"]), (2.0, TypeError, ["batch"]), (True, TypeError, ["batch"]),
                              (3, ValueError, ["kv_cache[0][0]", "batch 3"])]:
        with pytest.raises(exc) as e:
            build_decoder(w, kv, CFG, MAX_SEQ, batch=batch)
        check_message(e.value, words)
    with pytest.raises(ValueError) as e:
        build_decoder(w, kv, CFG, MAX_SEQ)                    # batch 1 but a cache of 2 slots
    check_message(e.value, ["kv_cache[0][0]", "batch 1"])


def test_one_row_and_rows_kernels_hold_their_own_opcodes():
    """The one-row kernels are built as before (no rows opcode in them: their source is unchanged); a
    rows kernel holds its rows opcodes only."""
    one = compile_model(CFG, 1, max_seq=MAX_SEQ, sequential=True, decoder=True).tape
    k1 = kernel_classes(one.classes())
    assert not any(c.ROWS_OPCODE for c in k1)
    rows = compile_model(CFG, 1, max_seq=MAX_SEQ, tiling=rows_tiling(CFG, 16, MAX_SEQ), lowering=rows_lowering(16, 2),
                         sequential=True).tape
    kr = kernel_classes(rows.classes())
    assert kr and all(c.ROWS_OPCODE for c in kr) and set(kr) == set(rows.classes())


def test_serve_kernel_backend_matches_the_ref_backend():
    """``megatape serve``'s kernel backend (the rows kernel) against its ref backend (the bf16 oracle) on the
    same prefill and decode rows: within the criterion's scale (the two round differently)."""
    from megatape.serve import KernelBackend, RefBackend
    w = decoder_weights(CFG, seed=1)
    lines = []
    kb = KernelBackend(w, CFG, 20, MAX_SEQ, device="cpu", log=lines.append)
    assert [ln.split(" built in ")[0] for ln in lines] == [f"the {b}-row kernel" for b in (16, 32, 64, 128)]
    rb = RefBackend(w, CFG, 20, MAX_SEQ, device="cpu")
    try:
        assert rel_err(kb.prefill([5, 9, 17, 3], slot=1, start_pos=0), rb.prefill([5, 9, 17, 3], slot=1, start_pos=0)) <= 3e-2
        assert rel_err(kb.prefill([44, 2], slot=0, start_pos=0), rb.prefill([44, 2], slot=0, start_pos=0)) <= 3e-2
        lk, lr = kb.decode([7, 8], [0, 1], [2, 4]), rb.decode([7, 8], [0, 1], [2, 4])
        assert lk.shape == lr.shape == (2, CFG.vocab) and rel_err(lk, lr) <= 3e-2
        assert list(kb.h.rows) == [16, 32, 64, 128]     # every bucket up to 128 rows (the prefill chunk) built up front
        # 2 rows run in bucket 16, 20 in bucket 32: the two rows' logits bitwise the same
        # (a bucket's ``rows`` state holds the row count of its last launch)
        assert [int(kb.h.rows[b].state["rows"][0]) for b in (16, 32)] == [2, 0]
        l20 = kb.decode([7, 8] + [3] * 18, list(range(20)), [2, 4] + [1] * 18)
        assert [int(kb.h.rows[b].state["rows"][0]) for b in (16, 32)] == [2, 20]
        assert bitwise_equal(l20[:2], lk)
    finally:
        kb.close()
    with pytest.raises(ValueError) as e:
        KernelBackend(w, CFG, 1025, MAX_SEQ, device="cpu")
    check_message(e.value, ["max_batch", "1024"])


@pytest.mark.parametrize("preset", ["llama3.2-1b", "llama3.1-8b", None])
def test_decode_buckets_differ_only_in_rows(preset):
    """The decode buckets' kernels differ in ``ROWS`` (the dots' N) only: the same tiling, warps, sums-of-squares
    parts and one attention instruction a row, so a row's results are the same in either (the server runs a
    step in the smallest that holds its rows); the instructions but ATTN_R's (one a row) are the same."""
    from opcodes import PRESETS
    from opcodes.decoder import DecoderLayout
    from opcodes.rows import DECODE_BUCKETS, RowsLayout
    cfg = PRESETS[preset] if preset else CFG
    lays = [RowsLayout.of(DecoderLayout(cfg, rows_tiling(cfg, R, 1152), 1152), rows=R, batch=32) for R in DECODE_BUCKETS]
    base = {k: v for k, v in lays[0].constexprs().items() if k not in ("ROWS", "NT")}     # NT = ROWS there
    for lay in lays[1:]:
        assert {k: v for k, v in lay.constexprs().items() if k not in ("ROWS", "NT")} == base
        assert lay.tiling == lays[0].tiling and lay.attn_rt == lays[0].attn_rt == 1
    if preset is None:
        progs = [rows_lowering(R, 4)(lay) for R, lay in zip(DECODE_BUCKETS, lays)]
        ins = [sorted(repr(i) for i in p.instrs if i.NAME != "attn_r") for p in progs]
        assert all(x == ins[0] for x in ins[1:])


def test_a_prefill_bucket_tiles_one_slots_rows_and_runs_mixed_tiles_row_by_row():
    """40 rows in the 64-row bucket (attention tiles of 32 rows): tile 0 is 32 rows of a prefill chunk of
    slot 0 (one K/V pass for all, masked causally), tile 1 the chunk's last 2 rows and 6 decode rows of
    slots 1 and 2 (row by row). Kernel = VM (whose attention is per row) within KERNEL_TOL, and the step
    meets the criterion as a whole (single rows of this tiny model scatter around it: 0.4-1.3x)."""
    h, w, kv = _built(prefix=10)
    kv0 = clone_cache(kv)
    slots = [0] * 34 + [1, 2, 2, 1, 1, 1]
    pos = list(range(10, 44)) + [3, 45, 46, 20, 21, 22]
    toks = [(13 * i + 1) % CFG.vocab for i in range(40)]
    lg = decode_step(h, toks, pos, slots=slots)
    assert h.rows[64].lay.attn_rt == 32
    st = run_tape(h.rows[64].tape, w, clone_cache(kv0), torch.zeros(1), 0, seed=1, return_state=True,
                  state={"rows": rows_state(64, slots, pos, toks)})
    assert rel_err(lg, st.buf["logits_r"].view(CFG.vocab, 64)[:, :40].T) <= KERNEL_TOL
    ref = decoder_ref_rows(w, clone_cache(kv0), CFG, toks, slots, pos)
    ref32 = decoder_ref_rows_fp32(w, [tuple(t.float() for t in p) for p in kv0], CFG, toks, slots, pos)
    assert rel_err(lg, ref32) <= 1.1 * rel_err(ref, ref32)
    teardown(h)


def test_generate_on_a_slot_of_a_batch_cache_equals_batch_one():
    """``generate(..., slot=2)`` on a 3-slot handle runs today's one-row kernel pointed at slot 2: the
    tokens, and slot 2's cache, bitwise those of a batch-1 handle over the same weights; slots 0 and 1
    untouched; then slot 0 again (the pointers go back)."""
    from interp import generate
    h, w, kv = _built(prefix=0)
    kv0 = clone_cache(kv)
    kv1 = make_kv_cache(CFG, MAX_SEQ, 0, seed=2, batch=1)
    h1 = build_decoder(w, kv1, CFG, MAX_SEQ)
    prompt = [5, 9]
    a = generate(h, prompt, 2, slot=2, prefill=False)
    b = generate(h1, prompt, 2, prefill=False)
    assert a.tolist() == b.tolist()
    assert caches_equal([(k[2:3], v[2:3]) for k, v in kv], kv1)
    assert caches_equal([(k[:2], v[:2]) for k, v in kv], [(k[:2], v[:2]) for k, v in kv0])
    c = generate(h, prompt, 2, slot=0, prefill=False)
    assert c.tolist() == b.tolist() and caches_equal([(k[0:1], v[0:1]) for k, v in kv], kv1)
    for bad, exc in ((3, ValueError), (-1, ValueError), (1.0, TypeError)):    # checked before anything runs
        with pytest.raises(exc) as e:
            generate(h, prompt, 2, slot=bad)
        check_message(e.value, ["slot"])
    teardown(h)
    teardown(h1)



def _kernel_logits(tape, w, kv, meta) -> torch.Tensor:
    """One launch of a 16-row ``tape`` in the interpreter kernel over ``kv`` (written in place) with the rows
    state ``meta``: the first 7 rows' logits (``ROWS``')."""
    from interp import runtime
    h = runtime.build_validated(w, kv, CFG, torch.device("cpu"), MAX_SEQ, tape=tape)
    try:
        h.state["rows"].copy_(meta)
        x = torch.zeros(1, CFG.d, dtype=torch.bfloat16)
        runtime.launch(h, x, 0, x)
        return h.scratch["logits_r"].view(CFG.vocab, 16)[:, :7].T.clone()
    finally:
        runtime.teardown(h)


def test_normed_operands_summed_over_many_parts_in_the_vm_and_the_kernel():
    """v148: the sums of squares behind each RMSNorm come in parts, one a producer tile (EMBED_R: 4 here,
    RESIDUAL_R: 2, OPROJ_R: 4), summed by the consumers in order; layer 0's QKV takes EMBED_R's count, the
    others' and the LM head RESIDUAL_R's. A part left out or counted twice moves the logits by far more than
    the criterion allows."""
    import dataclasses

    from opcodes.rows import RowsLayout
    from schedule.rows_program import lower_rows
    til = dataclasses.replace(rows_tiling(CFG, 16, MAX_SEQ), red_rows=32)
    base = RowsLayout(CFG, til, MAX_SEQ, lm_rows=32, emb_cols=16, rows=16, batch=B)
    assert base.ss_parts == (4, 2, 4)

    def lowering(lay):
        return lower_rows(dataclasses.replace(base, tiling=lay.tiling), rows=16, batch=B)

    w = decoder_weights(CFG, seed=1)
    kv = make_kv_cache(CFG, MAX_SEQ, PREFIX, seed=2, batch=B)
    kv0 = clone_cache(kv)
    meta = rows_state(16, ROWS["slots"], ROWS["pos"], ROWS["toks"])
    tape = compile_model(CFG, 1, max_seq=MAX_SEQ, tiling=til, lowering=lowering, sequential=True).tape
    assert tape.lay.ss_parts == (4, 2, 4)
    st = run_tape(tape, w, clone_cache(kv0), torch.zeros(1), 0, seed=3, return_state=True, state={"rows": meta})
    lg_vm = st.buf["logits_r"].view(CFG.vocab, 16)[:, :7].T
    _ok(lg_vm, ROWS["toks"], ROWS["slots"], ROWS["pos"], w, kv0)
    lg = _kernel_logits(tape, w, kv, meta)
    _ok(lg, ROWS["toks"], ROWS["slots"], ROWS["pos"], w, kv0)
    assert rel_err(lg, lg_vm) <= KERNEL_TOL


@pytest.mark.parametrize("down_k", [96, 64])
def test_down_res_ends_the_layer_in_the_last_chunks_down_tiles_bitwise_as_residual(down_k):
    """``Tiling.down_res`` (v178; K chunks 96 + 64 or 64 + 64 + 32, the last masked): the last chunk's down
    tiles add x1, the other chunks' partials and their own dot in RESIDUAL_R's order and end the layer (no
    RESIDUAL_R). The logits and the cache are bitwise those of DOWN_R + RESIDUAL_R at the same tiling, in the
    VM and in the kernel, and meet the criterion. A wrong epilogue (part, norm, layer, a partial left out) or
    wait breaks the bits."""
    from opcodes import DownR, DownResR, ResidualR
    w = decoder_weights(CFG, seed=1)
    kv0 = make_kv_cache(CFG, MAX_SEQ, PREFIX, seed=2, batch=B)
    meta = rows_state(16, ROWS["slots"], ROWS["pos"], ROWS["toks"])
    out = {}
    for res in (1, 0):
        til = rows_tiling(CFG, 16, MAX_SEQ, down_k=down_k, down_rows=32, red_rows=32, down_res=res)
        tape = compile_model(CFG, 1, max_seq=MAX_SEQ, tiling=til, lowering=rows_lowering(16, B), sequential=True).tape
        names = {c.NAME for c in tape.classes()}
        assert (DownResR.NAME in names) == bool(res) and (ResidualR.NAME in names) != bool(res)
        assert DownR.NAME in names
        st = run_tape(tape, w, clone_cache(kv0), torch.zeros(1), 0, seed=3, return_state=True, state={"rows": meta})
        kv = clone_cache(kv0)
        lg = _kernel_logits(tape, w, kv, meta)
        out[res] = (st.buf["logits_r"].view(CFG.vocab, 16)[:, :7].T.clone(), lg, kv)
    (vm_f, k_f, kv_f), (vm_u, k_u, kv_u) = out[1], out[0]
    assert bitwise_equal(vm_f, vm_u) and bitwise_equal(k_f, k_u) and caches_equal(kv_f, kv_u)
    _ok(k_f, ROWS["toks"], ROWS["slots"], ROWS["pos"], w, kv0)
    assert rel_err(k_f, vm_f) <= KERNEL_TOL


def test_down_res_is_a_rows_programs_and_needs_a_residual_block_of_rows():
    from opcodes import Layout, Tiling
    with pytest.raises(ValueError, match="down_res"):
        compile_model(CFG, 1, max_seq=MAX_SEQ, tiling=Tiling.for_config(CFG, down_res=1), sequential=True)
    for over in (dict(down_rows=16, red_rows=32), dict(down_rows=32, red_rows=32, down_k=CFG.ffn)):
        with pytest.raises(ValueError, match="down_rows = red_rows .* and 2 or more down K chunks"):
            compile_model(CFG, 1, max_seq=MAX_SEQ, lowering=rows_lowering(16, B), sequential=True,
                          tiling=rows_tiling(CFG, 16, MAX_SEQ, down_res=1, **over))
    with pytest.raises(ValueError, match="down_res"):
        Tiling(down_res=2)


def test_the_1024_row_bucket_streams_the_down_projection_in_two_k_chunks():
    """Run 312 (H100): a 1024-row chunk with the down projection in 2 K chunks, not 2048-column ones (1B 4, 8B 7):
    -6.2% on the 1B, -5.5% on the 8B. The smaller buckets keep 2048; a small ffn stays one chunk."""
    from opcodes import PRESETS
    for name, want in (("llama3.2-1b", 4096), ("llama3.1-8b", 7168)):
        cfg = PRESETS[name]
        assert [rows_tiling(cfg, R, 4224).down_k for R in (16, 32, 128, 256, 512, 1024)] == [2048] * 5 + [want], name
        assert -(-cfg.ffn // rows_tiling(cfg, 1024, 4224).down_k) == 2
    assert rows_tiling(CFG, 1024, MAX_SEQ).down_k == CFG.ffn
