"""The R-row reference (issue 50): ``layer_ref_rows`` / ``model_ref_rows`` / ``decoder_ref_rows`` and
their fp32 twins, against today's one-position references run on B=1 views of the cache.

Row r is token ``x[r]`` of sequence slot ``slots[r]`` at position ``pos[r]``; every row's K/V is
written first, then row r attends to its slot's keys [0, pos[r]]. So R rows must give what R
sequential one-position calls give (a prefill chunk = token-by-token decode; a batched decode =
each slot's own decode), and the cache must end the same.

Tolerances. One row is the same torch operations on the same shapes as ``layer_ref``: bitwise.
More rows compute the same values in another fp32 summation order: a slot's rows share one masked
attention block summed over its longest row's keys (the masked ones exact zeros), and the CPU's
bf16 GEMM blocks rows by their count (row 63 of 64 rounds differently from the same row alone,
seen on tiny-gqa8). Each such difference flips at most the last bit of a bf16 rounding here and
there, so the bf16 references are compared to within ``BF16_TOL`` = 2^-8 relative (one bf16 ulp,
and half the bf16 reference's own distance from fp32, ~0.4-0.6% on these configs) and the fp32
twins to within ``FP32_TOL`` = 1e-5 (fp32 rounding; measured <= 5e-7). A wrong mask, slot or
position moves the result by ~1e-1 (a mask that lets each row see one key more: 0.08-0.18).
"""
from __future__ import annotations

import pytest
import torch

import opcodes.reference as reference
from conftest import bitwise_equal, caches_equal, check_message, clone_cache, decoder_weights
from opcodes import PRESETS
from opcodes.decoder import decoder_ref, decoder_ref_rows, decoder_ref_rows_fp32, decoder_ref_fp32
from opcodes.reference import (layer_ref, layer_ref_rows, make_kv_cache, make_weights, model_ref, model_ref_fp32,
                               model_ref_rows, model_ref_rows_fp32, rel_err)

BF16_TOL = 2.0 ** -8
FP32_TOL = 1e-5
MAX_SEQ = 48


def _x(cfg, R, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(R, cfg.d, generator=g).to(torch.bfloat16)


def _fp32(kv):
    return [tuple(t.float() for t in pair) for pair in kv]


def _view(kv, s):
    """Slot s of every layer's cache as a B=1 view (writes through it land in ``kv``)."""
    return [tuple(t[s:s + 1] for t in pair) for pair in kv]


def _sequential(weights, kv, cfg, x, slots, pos, fp32=False):
    """The rows one at a time, in row order, each ``model_ref`` (or its fp32 twin) on its slot's B=1 view."""
    f = model_ref_fp32 if fp32 else model_ref
    return torch.cat([f(weights, _view(kv, s), cfg, x[r:r + 1], p) for r, (s, p) in enumerate(zip(slots, pos))])


def _untouched_outside(kv_after, kv_before, slots, pos):
    """Every cache entry no row writes is bitwise what it was."""
    keep = torch.ones(kv_before[0][0].shape[0], kv_before[0][0].shape[2], dtype=torch.bool)
    keep[slots, pos] = False
    return all(bitwise_equal(a.transpose(1, 2)[keep], b.transpose(1, 2)[keep])
               for pa, pb in zip(kv_after, kv_before) for a, b in zip(pa, pb))


def _written_close(kv_a, kv_b, slots, pos, tol):
    """The entries the rows write agree to within ``tol`` (relative, per layer and k / v)."""
    s, p = torch.tensor(slots), torch.tensor(pos)
    return max(rel_err(a[s, :, p], b[s, :, p]) for pa, pb in zip(kv_a, kv_b) for a, b in zip(pa, pb)) <= tol


def _check_rows_against_sequential(cfg, B, prefill, slots, pos, seed=0):
    """model_ref_rows and its fp32 twin against the sequential references: outputs and caches."""
    w = make_weights(cfg, seed=seed)
    kv0 = make_kv_cache(cfg, MAX_SEQ, prefill, seed=seed + 1, batch=B)
    x = _x(cfg, len(slots), seed + 2)
    kv_rows, kv_seq = clone_cache(kv0), clone_cache(kv0)
    out = model_ref_rows(w, kv_rows, cfg, x, slots, pos)
    seq = _sequential(w, kv_seq, cfg, x, slots, pos)
    kv32_rows, kv32_seq = _fp32(kv0), _fp32(kv0)
    out32 = model_ref_rows_fp32(w, kv32_rows, cfg, x, torch.tensor(slots), torch.tensor(pos))
    seq32 = _sequential(w, kv32_seq, cfg, x, slots, pos, fp32=True)
    assert out.shape == (len(slots), cfg.d) and out.dtype == torch.bfloat16
    assert out32.dtype == torch.float32
    assert rel_err(out32, seq32) <= FP32_TOL, rel_err(out32, seq32)
    assert rel_err(out, seq) <= BF16_TOL, rel_err(out, seq)
    for r in range(len(slots)):                     # each row on its own, not only the whole
        assert rel_err(out[r], seq[r]) <= 2 * BF16_TOL, (r, rel_err(out[r], seq[r]))
    assert _written_close(kv32_rows, kv32_seq, slots, pos, FP32_TOL)
    assert _written_close(kv_rows, kv_seq, slots, pos, BF16_TOL)
    assert _untouched_outside(kv_rows, kv0, slots, pos)
    assert _untouched_outside(kv32_rows, _fp32(kv0), slots, pos)
    return out, seq


@pytest.mark.parametrize("name", ["tiny", "tiny-gqa8", "tiny-mha", "small-2layer"])
def test_one_row_is_layer_ref_on_the_slot_view_bitwise(name):
    """One row: layer_ref on the slot's B=1 view, the same bits, and the same cache bits (the other
    slots untouched)."""
    cfg = PRESETS[name]
    lw = make_weights(cfg, seed=3)["layers"][0]
    kv0 = make_kv_cache(cfg, MAX_SEQ, 20, seed=4, batch=3)[0]
    x = _x(cfg, 1, 5)
    for s, p in [(0, 0), (2, 20), (1, MAX_SEQ - 1)]:
        kv_rows, kv_seq = clone_cache([kv0])[0], clone_cache([kv0])[0]
        out = layer_ref_rows(lw, kv_rows, cfg, x, [s], [p])
        ref = layer_ref(lw, _view([kv_seq], s)[0], cfg, x, p)
        assert bitwise_equal(out, ref), (s, p)
        assert caches_equal([kv_rows], [kv_seq]), (s, p)
        assert not caches_equal([kv_rows], [kv0])           # it did write


@pytest.mark.parametrize("name", ["tiny", "tiny-gqa8", "small-2layer"])
def test_batched_decode_is_each_slots_own_decode(name):
    """One row a slot, the slots at different positions and in no particular order."""
    slots, pos = [2, 0, 3, 1], [7, 0, 30, 12]
    _check_rows_against_sequential(PRESETS[name], 4, 31, slots, pos)


@pytest.mark.parametrize("name,start,n", [("tiny", 0, 16), ("tiny-mha", 5, 24), ("small-2layer", 11, 20)])
def test_prefill_chunk_is_token_by_token_decode(name, start, n):
    """A chunk of n consecutive positions of one slot after a prefix of ``start`` positions (a causal
    block): the rows' outputs and K/V are what n decode steps give."""
    cfg = PRESETS[name]
    _check_rows_against_sequential(cfg, 2, start, [1] * n, list(range(start, start + n)))


@pytest.mark.parametrize("attn_rows", [reference.ATTN_ROWS, 3])
def test_ragged_batch_of_chunks_and_decodes(monkeypatch, attn_rows):
    """Two prefill chunks (slots 0 and 3, different starts) and decodes of slots 1 and 2 at other
    positions, the rows interleaved; with ATTN_ROWS 3 a slot's rows span several attention blocks."""
    monkeypatch.setattr(reference, "ATTN_ROWS", attn_rows)
    rows = [(0, 4), (1, 17), (0, 5), (3, 0), (0, 6), (2, 40), (3, 1), (0, 7), (3, 2), (0, 8), (0, 9), (3, 3)]
    slots, pos = [s for s, _ in rows], [p for _, p in rows]
    _check_rows_against_sequential(PRESETS["small-2layer"], 4, 4, slots, pos, seed=7)


def test_a_mask_that_sees_one_key_too_many_fails_the_tolerance(monkeypatch):
    """The tolerance can fail: rows that also see the key after their position (the chunk's next
    token) are ~1e-1 away from token-by-token decode, far outside BF16_TOL."""
    cfg = PRESETS["tiny"]
    w = make_weights(cfg, seed=0)
    kv0 = make_kv_cache(cfg, MAX_SEQ, 0, seed=1, batch=1)
    x = _x(cfg, 12, 2)
    seq = _sequential(w, clone_cache(kv0), cfg, x, [0] * 12, list(range(12)))
    orig = torch.Tensor.masked_fill

    def one_more(t, mask, value):
        m = mask.clone()
        first = mask.float().argmax(-1)                 # each row's first masked key
        has = mask.any(-1)
        m[has, first[has]] = False
        return orig(t, m, value)
    monkeypatch.setattr(torch.Tensor, "masked_fill", one_more)
    out = model_ref_rows(w, clone_cache(kv0), cfg, x, [0] * 12, list(range(12)))
    assert rel_err(out, seq) > 10 * BF16_TOL


def test_decoder_rows_logits_are_the_sequential_decoders():
    """decoder_ref_rows: a prefill chunk's last row and a decode of another slot give the logits of
    token-by-token decoder_ref (and the fp32 twins alike); the greedy token of each is the same."""
    cfg = PRESETS["small-2layer"].__class__(**{**PRESETS["small-2layer"].to_dict(), "vocab": 96})
    w = decoder_weights(cfg, seed=1)
    kv0 = make_kv_cache(cfg, MAX_SEQ, 0, seed=2, batch=2)
    kv0[0][0][1, :, :9] = 0.5                            # slot 1 holds a prefix of 9 (any values)
    chunk = [5, 17, 3, 88, 41, 0]
    tokens = chunk + [12]
    slots, pos = [0] * 6 + [1], list(range(6)) + [9]
    kv_rows, kv_seq = clone_cache(kv0), clone_cache(kv0)
    logits = decoder_ref_rows(w, kv_rows, cfg, torch.tensor(tokens), slots, pos)
    seq = torch.cat([decoder_ref(w, _view(kv_seq, s), cfg, t, p) for t, s, p in zip(tokens, slots, pos)])
    kv32_rows, kv32_seq = _fp32(kv0), _fp32(kv0)
    l32 = decoder_ref_rows_fp32(w, kv32_rows, cfg, tokens, slots, pos)
    s32 = torch.cat([decoder_ref_fp32(w, _view(kv32_seq, s), cfg, t, p) for t, s, p in zip(tokens, slots, pos)])
    assert logits.shape == (7, cfg.vocab) and logits.dtype == torch.float32
    assert rel_err(logits, seq) <= BF16_TOL and rel_err(l32, s32) <= FP32_TOL
    assert torch.equal(logits.argmax(-1), seq.argmax(-1))
    assert _untouched_outside(kv_rows, kv0, slots, pos)


# ---- bad inputs: a clear error naming the argument, and no cache touched ------------------------
def _bad_cases(cfg):
    d, B, S = cfg.d, 3, MAX_SEQ
    x3 = _x(cfg, 3, 0)
    ok = dict(x=x3, slots=[0, 1, 2], pos=[1, 2, 3])
    return [
        ("x wrong d", dict(ok, x=_x(cfg, 3, 0)[:, :d - 1]), ValueError, ["x", f"d = {d}", f"(3, {d - 1})"]),
        ("x 1-D", dict(ok, x=x3[0]), ValueError, ["x", "(R, d"]),
        ("x ints", dict(ok, x=torch.zeros(3, d, dtype=torch.int32)), TypeError, ["x", "floating"]),
        ("slots short", dict(ok, slots=[0, 1]), ValueError, ["slots", "2 entries", "R = 3"]),
        ("pos 2-D", dict(ok, pos=torch.zeros(3, 1, dtype=torch.long)), ValueError, ["pos", "1-D"]),
        ("slots float", dict(ok, slots=torch.tensor([0.0, 1.0, 2.0])), TypeError, ["slots", "integers"]),
        ("pos bool", dict(ok, pos=[True, 2, 3]), TypeError, ["pos", "ints"]),
        ("slot past B", dict(ok, slots=[0, 3, 2]), ValueError, ["slots[1] = 3", f"B = {B}"]),
        ("slot negative", dict(ok, slots=[0, 1, -1]), ValueError, ["slots[2] = -1"]),
        ("pos past max_seq", dict(ok, pos=[1, S, 3]), ValueError, [f"pos[1] = {S}", "past max_seq", f"[0, {S})"]),
        ("pos negative", dict(ok, pos=[-2, 2, 3]), ValueError, ["pos[0] = -2", "negative"]),
        ("same slot and pos", dict(ok, slots=[1, 0, 1], pos=[5, 5, 5]), ValueError,
         ["rows 0 and 2", "slot 1 position 5"]),
        ("cos_sin short", dict(ok, cos_sin=reference.rope_tables(cfg, 3)), ValueError, ["cos_sin", "[0, 4)"]),
    ]


@pytest.mark.parametrize("case", range(13))
def test_bad_rows_raise_and_leave_the_cache_untouched(case):
    cfg = PRESETS["small-2layer"]
    label, kw, exc, names = _bad_cases(cfg)[case]
    w = make_weights(cfg, seed=0)
    kv0 = make_kv_cache(cfg, MAX_SEQ, 8, seed=1, batch=3)
    kv = clone_cache(kv0)
    with pytest.raises(exc) as e:
        model_ref_rows(w, kv, cfg, **kw)
    check_message(e.value, names)
    assert caches_equal(kv, kv0), label
    kv32 = _fp32(kv0)
    with pytest.raises(exc) as e:                   # the fp32 twin checks alike
        model_ref_rows_fp32(w, kv32, cfg, **{**kw, "x": kw["x"].float() if kw["x"].is_floating_point() else kw["x"]})
    check_message(e.value, names)
    assert caches_equal(kv32, _fp32(kv0)), label
    kv = clone_cache(kv0)
    with pytest.raises(exc) as e:                   # and one layer
        layer_ref_rows(w["layers"][0], kv[0], cfg, **kw)
    check_message(e.value, names)
    assert caches_equal(kv, kv0), label


def test_bad_cache_and_weights_raise_before_any_layer_writes():
    """A cache of the wrong shape, one layer short, or a bad weight in the LAST layer: the error
    names it and the first layer's cache is untouched (everything is checked before layer 0 runs)."""
    cfg = PRESETS["small-2layer"]
    w = make_weights(cfg, seed=0)
    kv0 = make_kv_cache(cfg, MAX_SEQ, 8, seed=1, batch=2)
    x, slots, pos = _x(cfg, 2, 0), [0, 1], [8, 8]

    kv = clone_cache(kv0)
    kv[1] = (kv[1][0], kv[1][1][:, :, :MAX_SEQ - 1])
    with pytest.raises(ValueError) as e:
        model_ref_rows(w, kv, cfg, x, slots, pos)
    check_message(e.value, ["kv_cache[1][1]", f"{MAX_SEQ - 1}"])
    assert caches_equal(kv[:1], kv0[:1])

    kv = clone_cache(kv0)
    kv[0] = (kv[0][0].reshape(2, cfg.n_kv * 2, MAX_SEQ, cfg.hd // 2), kv[0][1])
    with pytest.raises(ValueError) as e:
        model_ref_rows(w, kv, cfg, x, slots, pos)
    check_message(e.value, ["kv_cache[0][0]", f"n_kv = {cfg.n_kv}", f"hd = {cfg.hd}"])

    kv = clone_cache(kv0)
    with pytest.raises(ValueError) as e:
        model_ref_rows(w, kv[:1], cfg, x, slots, pos)
    check_message(e.value, ["kv_cache", "1 layers", "weights['layers'] has 2"])
    assert caches_equal(kv, kv0)

    bad = {**w, "layers": [w["layers"][0], {**w["layers"][1], "down": w["layers"][1]["down"][:, :-1]}]}
    with pytest.raises(ValueError) as e:
        model_ref_rows(bad, kv, cfg, x, slots, pos)
    check_message(e.value, ["weights['layers'][1]['down']", f"({cfg.d}, {cfg.ffn})"])
    assert caches_equal(kv, kv0)

    with pytest.raises(ValueError) as e:
        decoder_ref_rows({**decoder_weights(cfg.__class__(**{**cfg.to_dict(), "vocab": 32})), "layers": w["layers"]},
                         kv, cfg, [3, 32], slots, pos)
    check_message(e.value, ["tokens[1] = 32", "[0, 32)"])
    assert caches_equal(kv, kv0)
