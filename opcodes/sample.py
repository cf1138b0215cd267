"""SAMPLE: the next token drawn from softmax(logits / T), restricted by top-k and top-p, on the device.

    p_i  ~ 2^((l_i - max) * log2(e) / T)        the weights of softmax(logits / T)
    keep = {i : l_i >= t}                        t: the top-k, then the top-p threshold (below)
    u    = Philox(seed, pos)                     one 31-bit uniform per position (tl.randint)
    tok  = the first kept index (in index order) whose running sum of weights exceeds u * sum(kept)
    tok_ptr[0] = tok, toks_ptr[pos] = tok        as ARGMAX writes them (the next call's EMBED reads tok)

It replaces ARGMAX at the end of a whole-model decoder tape when sampling is asked for
(``schedule.decoder_program.lower_decoder(..., sample=True)``), so generation stays one launch
per token with the token never leaving the device. The runtime parameters are a device buffer
the host writes before generating (``STATE`` ``smp``; :meth:`Sample.state_values`), so one
compiled kernel serves every temperature, top-k, top-p and seed. It is one int64 buffer (one
kernel pointer: every pointer of the interpreter kernel is live across its loop):

    smp[0:1024]     T, the table of the integer weights (below)
    smp[1024:1032]  [scale = log2(e) / temperature, gallop = 1 / scale (both fp32 bits), top_k (0: off),
                     seed, top_p_q = round(top_p * 2^24) (2^24: off), temperature, top_p (fp32 bits), 0]

**Exact integer weights.** Every weight is an integer computed from the fp32 logit with
operations that round the same on every IEEE machine (one subtraction, multiplications, a float
-> int conversion), integer arithmetic and one lookup in the 1024-entry table T:

    z = max((l - max) * scale, -48)            (fp32; exact scaling by 2^20 below)
    q = int(z * 2^20) = n * 2^20 + r           n = q >> 20 in [-48, 0], r in [0, 2^20)
    h, o = r >> 10, r & 1023                   T[j] = round(2^40 * 2^(j / 1024))
    w = (T[h] + (((T[h] >> 20) * o * round(ln 2 * 2^20)) >> 20)) >> -n

so ``w`` is 2^(40 + z) to within 3e-7 relative plus one unit (the top token weighs 2^40; a token
below 2^-48 of it weighs 0: with 128k tokens at most 5e-10 of the mass) and every sum of weights is
an exact int64 (at most 2^41 per token: exact up to 2^22 tokens), so nothing depends on the order
of a reduction.
The token is therefore a function of the logits' bits, the seed and the position alone, the same
on a GPU, in the Triton interpreter and in :meth:`Sample.run_torch` (the tape VM), which
implements the same steps in torch, including the blocks the device skips.

**Thresholds** (transformers' semantics: temperature, then ``TopKLogitsWarper``, then
``TopPLogitsWarper`` over the renormalised top-k set). With ``c(x) = #{l >= x}`` and
``s(x) = sum of w over {l >= x}``:

    top-k  t_k = the largest logit v with c(v) >= k          (the k-th largest value; ties kept)
    top-p  t_p = the largest logit v >= t_k with s(v) >= ceil(top_p * s(t_k))

(a token is kept by top-p iff the mass strictly above it is < top_p; ``top_p`` is used to 2^-24;
tokens with equal logits are kept or dropped together, where transformers' sort may split them).
Each threshold is found by a search over logit values that snaps to the data: it evaluates the
top value first, then gallops down (steps of 1, 2, 4, ... units of log2 weight) until the
predicate holds, then bisects; every evaluation returns the smallest logit >= the probe and the
largest one below it, so the search ends on a logit value, exactly, after at most
``SMP_MAX_EVALS`` evaluations.

**Over every SM** (``opcodes/sample_mass.py``). Before SAMPLE, a stage of SAMPLE_MASS instructions
(one per chunk of ``SMP_CHUNK`` logits, ~126 for a 128k vocabulary: one an SM) sums each chunk's
weights for the threshold "none", ``smp_mass[c]``. Where no top-k threshold applies (temperature
alone, or top-p alone) SAMPLE takes ``sum(kept)`` as the sum of those int64s instead of a pass of its
own, and without top-p it also finds the token from them: the first chunk whose running sum exceeds
``r``, then the index inside that chunk alone. Integer sums are exact in any grouping, so the token is
the one the single-SM passes draw (``sample_torch`` is unchanged).

**Candidates** (where a top-k or top-p threshold applies). Each SAMPLE_MASS instruction also keeps
its chunk's ``SMP_CANDS`` (8) largest logits and their weights. SAMPLE first finds the thresholds
over those candidates alone (held in registers; each search a bisection over the ordered fp32
values, at most 33 steps), with the same definitions. The result is the whole-vocabulary one exactly
when every logit >= the final threshold is a candidate, i.e. the threshold lies above every chunk's
smallest candidate (and the candidates hold k logits / the mass top-p needs, the largest logit is
finite, and no chunk holds a NaN or a logit above its block's partials' maximum). Then each chunk's
kept sum is the sum over its candidates >= t, and the token is found as without a threshold: its
chunk from those sums, then that chunk alone. Otherwise (a chunk holding more than 8 of the kept
logits, as top-p over a flat distribution can) SAMPLE runs the whole-vocabulary searches below. It
writes which path it took to the last word of ``smp_mass`` (``PATHS``; ``cand_path_torch`` says the
same in torch); the token is ``sample_torch``'s either way.

**Cost.** One instruction on one SM after the SAMPLE_MASS stage (the other SMs are idle by then). It reads
the LM_HEAD tiles' (max, index) partials once, into a vector of each block's largest logit held in
registers. Without top-k / top-p: the chunk sums and one chunk (before SAMPLE_MASS: one pass to sum
the weights and half a pass on average to find the token, ~180 us for 128k logits on one SM of an
H200). On the candidate path: the candidates (1008 for a 128k vocabulary),
up to two bisections over them and one chunk. On the whole-vocabulary path it reads the fp32 logits
from L2 in blocks of ``SMP_BLOCK``, skipping a block whose largest logit is below the probe, and a
block it reads in a pipelined loop over sub-blocks of ``SMP_MAX_SUB`` logits: top-k one evaluation
per probe, counting only (typically 5-15 probes, each reading only the blocks that hold a logit above
it), then the sum over the kept blocks; top-p probes that also sum weights; then the token found over
the kept blocks. Per element read: ~15 integer operations and one L1-resident table lookup. SAMPLE
shares the kernel with the layers: its registers and code are kept small (sub-blocks of 1024, not
8192-wide tensors; one evaluation call site for both searches; candidates extracted in a loop, not by
a sorting network), since an 8192-wide SAMPLE made the whole sampling kernel spill and slowed every
layer by ~11%, and a sampling kernel of 204 KB of code ran its layers ~5% slower than one of
145-169 KB.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from .base import Cost, Instruction, Layout, Region, Timing, register

#: the log2-weight below which a weight is 0, its fixed-point bits, and the table's index bits
ZMIN, QSCALE, LN2_Q20 = -48.0, 1048576.0, 726817      # 2^20; round(ln 2 * 2^20)
#: a threshold below every finite logit: "no threshold"
NONE = -3.0e38
#: top_p_q when top-p is off
TOP_P_ONE = 1 << 24
#: the most threshold evaluations one search makes (a search of finite logits ends long before)
MAX_EVALS = 160
SMP_ZMIN, SMP_QSCALE, SMP_LN2_Q20 = tl.constexpr(ZMIN), tl.constexpr(QSCALE), tl.constexpr(LN2_Q20)
SMP_NONE, SMP_TOP_P_ONE, SMP_MAX_EVALS = tl.constexpr(NONE), tl.constexpr(TOP_P_ONE), tl.constexpr(MAX_EVALS)
#: the logits a block read reads at once (a pipelined loop over a block): SAMPLE's registers and code
#: grow with it, and SAMPLE shares the kernel with the layers (8192 at once spilled the whole kernel)
SMP_MAX_SUB = tl.constexpr(1024)

#: SAMPLE_MASS's chunks: at least SMP_MIN_CHUNK logits, at most SMP_BLOCK (a chunk lies in one block), and
#: at most SMP_MAX_CHUNKS of them (SAMPLE holds their sums in one vector)
SMP_MIN_CHUNK, SMP_MAX_CHUNKS = 1024, 256
#: the largest logits of its chunk each SAMPLE_MASS instruction keeps for SAMPLE's candidate path
#: (at most the chunk's size: ``n_cands``)
CANDS = 8


def smp_chunk(vocab: int, block: int) -> int:
    """Logits per SAMPLE_MASS instruction for a vocabulary and SAMPLE's block (both powers of two)."""
    return min(block, max(SMP_MIN_CHUNK, triton.next_power_of_2(-(-vocab // SMP_MAX_CHUNKS))))


TABLE_BITS = 10
SMP_TABLE = tl.constexpr(1 << TABLE_BITS)    # where the parameters start in ``smp``
N_PARAMS = 8
MAX_VOCAB = 1 << 22          # int64 sums of weights < 2^41 stay exact up to here


def exp2_table() -> torch.Tensor:
    """T[j] = round(2^40 * 2^(j / 1024)), int64 (the integer weights' table)."""
    return torch.tensor([round(2.0 ** (40 + j / (1 << TABLE_BITS))) for j in range(1 << TABLE_BITS)],
                        dtype=torch.int64)


# ---- the device function -------------------------------------------------------------------------
@triton.jit
def _smp_weights(l, m, scale, exp2_ptr):
    """Integer weights ~ 2^(40 + (l - m) * scale) of fp32 logits ``l`` (see the module docstring)."""
    z = tl.maximum((l - m) * scale, SMP_ZMIN)
    q = (z * SMP_QSCALE).to(tl.int32)
    n = q >> 20
    r = q & 1048575
    t = tl.load(exp2_ptr + (r >> 10))
    lo = (r & 1023).to(tl.int64)
    w = t + (((t >> 20) * (lo * SMP_LN2_Q20)) >> 20)
    return w >> (-n).to(tl.int64)


@triton.jit
def _smp_block_maxima(nparts, amax_ptr, VOCAB: tl.constexpr, LM_ROWS: tl.constexpr, SMP_BLOCK: tl.constexpr):
    """Every block's largest logit, from the LM_HEAD tiles' partials: one load of them all, a
    vector of ``cdiv(VOCAB, SMP_BLOCK)`` (padded to a power of two with -inf), held in registers."""
    NB: tl.constexpr = triton.next_power_of_2((VOCAB + SMP_BLOCK - 1) // SMP_BLOCK)
    PPB: tl.constexpr = SMP_BLOCK // LM_ROWS
    p = tl.arange(0, NB)[:, None] * PPB + tl.arange(0, PPB)[None, :]
    v = tl.load(amax_ptr + 2 * p, mask=p < nparts, other=float("-inf"), cache_modifier=".cg")
    return tl.max(v, axis=1)


@triton.jit
def _smp_pick(bmv, b):
    """Element ``b`` of the block maxima (no memory access)."""
    return tl.max(tl.where(tl.arange(0, bmv.shape[0]) == b, bmv, float("-inf")), axis=0)


@triton.jit
def _smp_eval(x, mass_on, m, scale, bmv, logits_ptr, exp2_ptr, VOCAB: tl.constexpr, SMP_BLOCK: tl.constexpr,
              SMP_SUB: tl.constexpr):
    """Over the logits >= x: their count, (``mass_on``) the sum of their weights and the smallest of
    them; and the largest logit < x. Blocks whose largest logit (``bmv``) is < x are not read; a
    block read is read in pipelined sub-blocks of ``SMP_SUB`` logits."""
    cnt = tl.zeros([SMP_SUB], tl.int32)
    mass = tl.zeros([SMP_SUB], tl.int64)
    amin = tl.full([SMP_SUB], float("inf"), tl.float32)
    bmax = tl.full([SMP_SUB], float("-inf"), tl.float32)
    for b in range(0, (VOCAB + SMP_BLOCK - 1) // SMP_BLOCK):
        bm = _smp_pick(bmv, b)
        if bm >= x:
            for s0 in tl.range(0, SMP_BLOCK, SMP_SUB, num_stages=3):
                idx = b * SMP_BLOCK + s0 + tl.arange(0, SMP_SUB)
                msk = idx < VOCAB
                l = tl.load(logits_ptr + idx, mask=msk, other=float("-inf"), cache_modifier=".cg")
                ge = l >= x
                cnt += ge.to(tl.int32)
                if mass_on:
                    w = _smp_weights(tl.where(msk, l, m), m, scale, exp2_ptr)
                    mass += tl.where(ge, w, 0)
                amin = tl.minimum(amin, tl.where(ge, l, float("inf")))
                bmax = tl.maximum(bmax, tl.where(ge, float("-inf"), l))
        else:
            bmax = tl.maximum(bmax, bm)
    return tl.sum(cnt, axis=0), tl.sum(mass, axis=0), tl.min(amin, axis=0), tl.max(bmax, axis=0)


@triton.jit
def _smp_need(z, top_pq):
    """ceil(z * top_pq / 2^24), exactly (int64): the mass top-p keeps."""
    lp = (z & 16777215) * top_pq
    return (z >> 24) * top_pq + (lp >> 24) + ((lp & 16777215) != 0).to(tl.int64)


@triton.jit
def _smp_thresholds(top_k, top_pq, z0, m, gal0, scale, bmv, logits_ptr, exp2_ptr, VOCAB: tl.constexpr,
                    SMP_BLOCK: tl.constexpr, SMP_SUB: tl.constexpr):
    """(t, z): the threshold (top-k, then top-p; SMP_NONE where neither applies) and the weight sum
    over the logits >= t. ``z0``: the sum over every logit (the SAMPLE_MASS stage's).

    Each search finds the largest logit value v in [lo, ph] whose count (top-k: ``top_k``) or weight
    sum (top-p: the need) over the logits >= v reaches the need: the top value first, then a gallop
    down from it while ``lo`` is SMP_NONE, then bisection; every evaluation snaps to logit values
    (``_smp_eval``), so it ends on one, after at most SMP_MAX_EVALS evaluations. The top-k search,
    the weight sum at its threshold and the top-p search are the phases 0, 1, 2 of one loop with one
    evaluation call site: SAMPLE shares the kernel with the layers, and its code is kept small."""
    t = tl.full([], SMP_NONE, tl.float32)
    z = z0
    topp = top_pq < SMP_TOP_P_ONE
    need = z0 * 0
    lo = tl.full([], SMP_NONE, tl.float32)  # a search's state: a logit where the need is met (its own
                                            # object, not t's: Triton's while loop would not carry t)...
    lo_mass = z0
    ph = m                                  # ... and one >= the answer
    gal = gal0 * 0.0
    it = tl.full([], 0, tl.int32)
    phase = tl.where((top_k > 0) & (top_k < VOCAB), 0, 2)
    init2 = (phase == 2).to(tl.int32)       # the top-p search starts next, from (t, z)
    while phase < 3:
        if init2 == 1:
            need = _smp_need(z, top_pq)
            lo = t
            lo_mass = z
            ph = m
            gal = gal0 * 0.0
            it = it * 0
            phase = tl.where(topp, 2, 3)
            init2 = it * 0
        elif (phase != 1) & ((lo == ph) | (it >= SMP_MAX_EVALS)):      # a search ends (maybe before it evaluates)
            t = lo
            if phase == 0:
                phase = it * 0 + 1
                init2 = (t == SMP_NONE).to(tl.int32)       # "none": z0 is its weight sum
            else:
                z = lo_mass
                phase = it * 0 + 3
        else:
            if phase == 1:
                mid = t                                    # the weight sum at the top-k threshold
            elif it == 0:
                mid = ph                                   # the top value first
            elif lo == SMP_NONE:
                gal = tl.maximum(gal * 2.0, gal0)          # gallop down from the top
                mid = tl.maximum(ph - gal, SMP_NONE)
            else:
                mid = lo + (ph - lo) * 0.5                 # bisect
                if mid <= lo:
                    mid = ph
            cnt, mass, a, b = _smp_eval(mid, phase > 0, m, scale, bmv, logits_ptr, exp2_ptr, VOCAB, SMP_BLOCK,
                                        SMP_SUB)
            if phase == 1:
                z = mass
                init2 = it * 0 + 1
            else:
                if phase == 2:
                    ok = mass >= need
                else:
                    ok = cnt >= top_k
                if ok:
                    lo = a
                    lo_mass = mass
                else:
                    ph = b
                it += 1
    return t, z


@triton.jit
def _smp_chunk_mass(c0, m, scale, logits_ptr, exp2_ptr, VOCAB: tl.constexpr, SMP_CHUNK: tl.constexpr,
                    SMP_SUB: tl.constexpr):
    """The weight sum of the logits >= SMP_NONE in ``[c0, c0 + SMP_CHUNK)`` (``_smp_eval``'s mass for
    the threshold "none", over one chunk)."""
    mass = tl.zeros([SMP_SUB], tl.int64)
    for s0 in tl.range(0, SMP_CHUNK, SMP_SUB, num_stages=3):
        idx = c0 + s0 + tl.arange(0, SMP_SUB)
        msk = idx < VOCAB
        l = tl.load(logits_ptr + idx, mask=msk, other=float("-inf"), cache_modifier=".cg")
        w = _smp_weights(tl.where(msk, l, m), m, scale, exp2_ptr)
        mass += tl.where(l >= SMP_NONE, w, 0)
    return tl.sum(mass, axis=0)


@triton.jit
def _smp_topk(x, K: tl.constexpr):
    """The K largest values of the vector x, descending (-inf where x has fewer), by K
    extractions in a loop: small code, as SAMPLE's must be (module docstring)."""
    idx = tl.arange(0, x.shape[0])
    kk = tl.arange(0, K)
    top = tl.full([K], float("-inf"), tl.float32)
    for j in range(K):
        v = tl.max(x, axis=0)
        i = tl.min(tl.where(x == v, idx, x.shape[0]), axis=0)
        x = tl.where(idx == i, float("-inf"), x)
        top = tl.where(kk == j, v, top)
    return top


@triton.jit
def _smp_chunk_cands(c0, bm, m, scale, logits_ptr, exp2_ptr, VOCAB: tl.constexpr, SMP_CHUNK: tl.constexpr,
                     SMP_SUB: tl.constexpr, SMP_CANDS: tl.constexpr):
    """SAMPLE's candidates from one chunk: its SMP_CANDS largest logits (descending) and their
    weights. All -inf (weights 0) where the chunk's block is skipped (``bm``, its partials'
    maximum, below SMP_NONE); all +inf where the chunk holds a NaN or a logit above ``bm`` (partials
    that disagree with the logits): SAMPLE then takes the whole-vocabulary path."""
    top = tl.full([SMP_CANDS], float("-inf"), tl.float32)
    bad = tl.zeros([SMP_SUB], tl.int32)
    for s0 in range(0, SMP_CHUNK, SMP_SUB):
        idx = c0 + s0 + tl.arange(0, SMP_SUB)
        l = tl.load(logits_ptr + idx, mask=idx < VOCAB, other=float("-inf"), cache_modifier=".cg")
        bad |= ((l != l) | (l > bm)).to(tl.int32)
        if SMP_CHUNK > SMP_SUB:
            top = _smp_topk(tl.reshape(tl.join(top, _smp_topk(l, SMP_CANDS)), [2 * SMP_CANDS]), SMP_CANDS)
        else:
            top = _smp_topk(l, SMP_CANDS)
    top = tl.where(tl.max(bad, axis=0) != 0, float("inf"), tl.where(bm >= SMP_NONE, top, float("-inf")))
    live = top >= SMP_NONE
    w = tl.where(live, _smp_weights(tl.where(live, top, m), m, scale, exp2_ptr), 0)
    return top, w


@triton.jit
def _smp_thresholded(top_k, top_pq, VOCAB: tl.constexpr):
    """Whether a top-k or top-p threshold applies (SAMPLE_MASS then keeps candidates; ``wants_cands``)."""
    return ((top_k > 0) & (top_k < VOCAB)) | (top_pq < SMP_TOP_P_ONE)


@triton.jit
def _smp_chunk_sums(smp_mass_ptr, VOCAB: tl.constexpr, SMP_CHUNK: tl.constexpr):
    """The SAMPLE_MASS stage's sums, one a chunk, as a vector (padded with 0 to a power of two)."""
    NCH: tl.constexpr = (VOCAB + SMP_CHUNK - 1) // SMP_CHUNK
    ci = tl.arange(0, triton.next_power_of_2(NCH))
    return tl.load(smp_mass_ptr + ci, mask=ci < NCH, other=0, cache_modifier=".cg")


@triton.jit
def _smp_load_cands(smp_mass_ptr, VOCAB: tl.constexpr, SMP_CHUNK: tl.constexpr, SMP_CANDS: tl.constexpr):
    """The SAMPLE_MASS stage's candidates ([chunks padded to a power of two, SMP_CANDS]: values
    -inf and weights 0 in the padding) and the largest of the chunks' smallest candidates."""
    NCH: tl.constexpr = (VOCAB + SMP_CHUNK - 1) // SMP_CHUNK
    ci = tl.arange(0, triton.next_power_of_2(NCH))[:, None]
    off = NCH + ci * SMP_CANDS + tl.arange(0, SMP_CANDS)[None, :]
    v = tl.load(smp_mass_ptr + off, mask=ci < NCH, other=-8388608, cache_modifier=".cg")
    w = tl.load(smp_mass_ptr + NCH * SMP_CANDS + off, mask=ci < NCH, other=0, cache_modifier=".cg")
    v = v.to(tl.int32).to(tl.float32, bitcast=True)
    return v, w, tl.max(tl.min(v, axis=1), axis=0)


@triton.jit
def _smp_locate(t, r, run, lo, hi, m, scale, bmv, logits_ptr, exp2_ptr, VOCAB: tl.constexpr,
                SMP_BLOCK: tl.constexpr, SMP_SUB: tl.constexpr):
    """The first index in [lo, hi) (in index order) among the logits >= t where the running sum of
    weights, from ``run``, exceeds r (-1 if none); blocks whose largest logit is < t are not read.
    ``lo`` and ``hi`` are multiples of SMP_SUB (or hi = VOCAB)."""
    tok = tl.full([], -1, tl.int32)
    for b in range(lo // SMP_BLOCK, (hi + SMP_BLOCK - 1) // SMP_BLOCK):
        if tok < 0:
            bm = _smp_pick(bmv, b)
            if bm >= t:
                for s0 in tl.range(tl.maximum(lo, b * SMP_BLOCK), tl.minimum(hi, (b + 1) * SMP_BLOCK), SMP_SUB,
                                   num_stages=3):
                    idx = s0 + tl.arange(0, SMP_SUB)
                    msk = idx < VOCAB
                    l = tl.load(logits_ptr + idx, mask=msk, other=float("-inf"), cache_modifier=".cg")
                    w = tl.where(l >= t, _smp_weights(tl.where(msk, l, m), m, scale, exp2_ptr), 0)
                    c = tl.cumsum(w, axis=0) + run
                    hit = tl.min(tl.where(c > r, idx, VOCAB), axis=0)
                    tok = tl.where((tok < 0) & (hit < VOCAB), hit, tok)
                    run += tl.sum(w, axis=0)
    return tok


@triton.jit
def _smp_ord(x):
    """fp32 -> int32 in the same order (for non-NaN values; -0.0 just below +0.0). Its own inverse
    on the bits: ``_smp_ord(o.to(tl.float32, bitcast=True))`` maps back."""
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 2147483647)


@triton.jit
def _smp_unord(o):
    """The fp32 value of an ordered int32 (``_smp_ord``'s inverse)."""
    return (o ^ ((o >> 31) & 2147483647)).to(tl.float32, bitcast=True)


@triton.jit
def _smp_cand_sum(x, count, cand, wc):
    """Over the candidates >= x: their count (``count``) or the sum of their weights."""
    return tl.sum(tl.where(cand >= x, tl.where(count, 1, wc), 0))


@triton.jit
def _smp_cand_search(x0, x1, need, count, cand, wc):
    """The largest value v in [x0, x1] where ``_smp_cand_sum(v, ...)`` reaches ``need``, by
    bisection over the ordered fp32 values (at most 33 steps); x0 if none does (the caller checks
    x0)."""
    a = _smp_ord(x0).to(tl.int64)
    b = _smp_ord(x1).to(tl.int64)
    while a < b:
        mid = a + (b - a + 1) // 2
        if _smp_cand_sum(_smp_unord(mid.to(tl.int32)), count, cand, wc) >= need:
            a = mid
        else:
            b = mid - 1
    return _smp_unord(a.to(tl.int32))


@triton.jit
def _smp_cand_thresholds(top_k, top_pq, z0, m, cand, wc, kth, VOCAB: tl.constexpr):
    """The candidate path: (ok, t, z, each chunk's weight sum over its logits >= t) from the
    SAMPLE_MASS stage's candidates (``cand``, ``wc``: [chunks, K] values and weights; ``kth``: the
    largest of the chunks' smallest candidates) instead of passes over the vocabulary. The top-k
    and top-p searches are two phases of one loop around one search (small code). ``ok`` says the
    result is the whole-vocabulary searches' (module docstring): m is finite, the candidates hold
    enough count / mass, and every logit >= t is a candidate (t > kth)."""
    ok = (m < float("inf")) & (m > float("-inf"))
    t = tl.full([], SMP_NONE, tl.float32)
    z = z0
    for ph in range(2):
        if ((ph == 0) & (top_k > 0) & (top_k < VOCAB)) | ((ph == 1) & (top_pq < SMP_TOP_P_ONE)):
            need = tl.where(ph == 0, top_k.to(tl.int64), _smp_need(z, top_pq))
            ok = ok & (_smp_cand_sum(t, ph == 0, cand, wc) >= need)
            t = _smp_cand_search(t, m, need, ph == 0, cand, wc)
            z = _smp_cand_sum(t, False, cand, wc)
    ok = ok & (t > kth)
    return ok, t, z, tl.sum(tl.where(cand >= t, wc, 0), axis=1)


@triton.jit
def sample_device(nparts, pos, logits_ptr, amax_ptr, smp_ptr, smp_mass_ptr, tok_ptr, toks_ptr, VOCAB: tl.constexpr,
                  LM_ROWS: tl.constexpr, SMP_BLOCK: tl.constexpr, SMP_CHUNK: tl.constexpr, SMP_CANDS: tl.constexpr):
    SMP_SUB: tl.constexpr = SMP_MAX_SUB if SMP_BLOCK > SMP_MAX_SUB else SMP_BLOCK
    smp_exp2_ptr = smp_ptr                           # the table; the parameters follow it
    scale = tl.load(smp_ptr + SMP_TABLE).to(tl.int32).to(tl.float32, bitcast=True)
    gal0 = tl.load(smp_ptr + SMP_TABLE + 1).to(tl.int32).to(tl.float32, bitcast=True)
    top_k = tl.load(smp_ptr + SMP_TABLE + 2).to(tl.int32)
    seed = tl.load(smp_ptr + SMP_TABLE + 3).to(tl.int32)
    top_pq = tl.load(smp_ptr + SMP_TABLE + 4)
    sums = _smp_chunk_sums(smp_mass_ptr, VOCAB, SMP_CHUNK)     # loaded beside the partials
    # every block's largest logit and the largest of all, from the LM_HEAD tiles' partials
    bmv = _smp_block_maxima(nparts, amax_ptr, VOCAB, LM_ROWS, SMP_BLOCK)
    m = tl.max(bmv, axis=0)
    z0 = tl.sum(sums, axis=0)
    t = tl.full([], SMP_NONE, tl.float32)
    z = z0
    path = tl.full([], 0, tl.int64)
    if _smp_thresholded(top_k, top_pq, VOCAB):
        cand, wc, kth = _smp_load_cands(smp_mass_ptr, VOCAB, SMP_CHUNK, SMP_CANDS)
        ok, tc, zc, csum = _smp_cand_thresholds(top_k, top_pq, z0, m, cand, wc, kth, VOCAB)
        if ok:
            t = tc
            z = zc
            sums = csum
            path = path + 1
        else:
            t, z = _smp_thresholds(top_k, top_pq, z0, m, gal0, scale, bmv, logits_ptr, smp_exp2_ptr, VOCAB,
                                   SMP_BLOCK, SMP_SUB)
            path = path + 2
    bits = tl.randint(seed, pos)                    # Philox-4x32-10 of (seed, pos)
    u = (bits >> 1).to(tl.int64)                    # 31 bits
    r = u * (z >> 31) + ((u * (z & 2147483647)) >> 31)          # floor(u * z / 2^31) < z
    # no threshold or the candidate path: the token's chunk from the chunks' sums, then that chunk alone
    ci = tl.arange(0, sums.shape[0])
    c = tl.min(tl.where(tl.cumsum(sums, axis=0) > r, ci, sums.shape[0]), axis=0)
    whole = path == 2
    lo = tl.where(whole, 0, c * SMP_CHUNK)
    hi = tl.where(whole, VOCAB, tl.minimum((c + 1) * SMP_CHUNK, VOCAB))
    run = tl.where(whole, 0, tl.sum(tl.where(ci < c, sums, 0), axis=0))
    tok = _smp_locate(t, r, run, lo, hi, m, scale, bmv, logits_ptr, smp_exp2_ptr, VOCAB, SMP_BLOCK, SMP_SUB)
    PATH: tl.constexpr = (VOCAB + SMP_CHUNK - 1) // SMP_CHUNK * (1 + 2 * SMP_CANDS)    # mass_words - 1
    tl.store(smp_mass_ptr + PATH, path)
    tok = tl.minimum(tl.maximum(tok, 0), VOCAB - 1)
    tl.store(tok_ptr, tok)
    tl.store(toks_ptr + pos, tok)


# ---- the same in torch (the VM) --------------------------------------------------------------------
_M32 = 0xFFFFFFFF


def philox_randint(seed: int, offset: int, rounds: int = 10) -> int:
    """``tl.randint(seed, offset)`` for one int32 offset: the first word of Philox-4x32-10 with
    counter (offset, 0, 0, 0) and key (seed mod 2^32, seed >> 32), as an unsigned int."""
    c0, c1, c2, c3 = offset & _M32, 0, 0, 0
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(rounds):
        p0, p2 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p2 >> 32) ^ c1 ^ k0, p2 & _M32, (p0 >> 32) ^ c3 ^ k1, p0 & _M32
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return c0


def need_torch(z: int, top_pq: int) -> int:
    """:func:`_smp_need` in Python ints: ceil(z * top_pq / 2^24), the mass top-p keeps."""
    lp = (z & 0xFFFFFF) * top_pq
    return (z >> 24) * top_pq + (lp >> 24) + int((lp & 0xFFFFFF) != 0)


def weights_torch(l: torch.Tensor, m, scale, table: torch.Tensor) -> torch.Tensor:
    """:func:`_smp_weights` in torch (bit for bit): int64 weights of fp32 logits ``l``."""
    m = torch.tensor(np.float32(m))
    scale = torch.tensor(np.float32(scale))
    z = torch.clamp_min((l.float() - m) * scale, ZMIN)
    q = (z * QSCALE).to(torch.int32)
    n = (q >> 20).to(torch.int64)
    r = (q & 1048575).to(torch.int64)
    t = table.to(torch.int64)[r >> 10]
    w = t + (((t >> 20) * ((r & 1023) * LN2_Q20)) >> 20)
    return w >> (-n)


def _f32(bits: int) -> np.float32:
    return np.array([bits], dtype=np.int64).astype(np.int32).view(np.float32)[0]


def _bits(x: float) -> int:
    return int(np.array([x], dtype=np.float32).view(np.int32)[0])


def unpack_params(smp: torch.Tensor) -> dict:
    """The parameters in a ``smp`` buffer: temperature, top_k, top_p, seed, and what the device
    uses (scale, gallop, top_p_q)."""
    p = smp.reshape(-1)[int(SMP_TABLE):].cpu().tolist()
    return {"scale": _f32(p[0]), "gallop": _f32(p[1]), "top_k": int(np.int32(np.int64(p[2]))),
            "seed": int(np.int32(np.int64(p[3]))), "top_p_q": int(p[4]), "temperature": float(_f32(p[5])),
            "top_p": float(_f32(p[6]))}


def block_maxima_torch(amax: torch.Tensor, nparts: int, vocab: int, lm_rows: int, block: int) -> torch.Tensor:
    """Every block's largest logit from the LM_HEAD partials, as ``_smp_block_maxima``."""
    nb, npb = -(-vocab // block), block // lm_rows
    part = torch.full((nb * npb,), float("-inf"))
    part[:nparts] = amax.reshape(-1)[0:2 * nparts:2].float().cpu()
    return part.view(nb, npb).max(dim=1).values


def sample_torch(logits: torch.Tensor, amax: torch.Tensor, nparts: int, lm_rows: int, block: int, smp: torch.Tensor,
                 pos: int) -> int:
    """The device function's token, in torch: ``logits`` (vocab,) fp32, ``amax`` the LM_HEAD
    partials (nparts (max, index) pairs), ``smp`` the parameter buffer (:meth:`Sample.state_values`).
    Blocks are skipped (or not) exactly where the device skips them, so the result is the
    device's for any inputs, consistent partials or not."""
    prm = unpack_params(smp)
    scale, gal0 = prm["scale"], prm["gallop"]
    top_k, seed, top_pq = prm["top_k"], prm["seed"], prm["top_p_q"]
    table = smp.reshape(-1)[:int(SMP_TABLE)].cpu()
    l = logits.reshape(-1).float().cpu()
    vocab = l.numel()
    bmax_blk = block_maxima_torch(amax, nparts, vocab, lm_rows, block)
    blk = torch.arange(vocab) // block
    m = np.float32(bmax_blk.max().item())
    w = weights_torch(l, m, scale, table)
    none = np.float32(NONE)

    def evaluate(x):
        x = np.float32(x)
        read = (bmax_blk >= float(x))[blk]
        ge = read & (l >= float(x))
        cnt, mass = int(ge.sum()), int(w[ge].sum())
        amin = np.float32(l[ge].min().item()) if bool(ge.any()) else np.float32(np.inf)
        below = l[read & ~ge]
        skipped = bmax_blk[bmax_blk < float(x)]
        cands = [np.float32(-np.inf)] + ([np.float32(below.max().item())] if below.numel() else []) + \
            ([np.float32(skipped.max().item())] if skipped.numel() else [])
        return cnt, mass, amin, max(cands)

    def search(lo, lo_mass, ph, need, use_mass):
        gal, it = np.float32(0.0), 0
        while lo != ph and it < MAX_EVALS:
            if it == 0:
                mid = ph
            elif lo == none:
                gal = max(np.float32(gal * np.float32(2.0)), gal0)
                mid = max(np.float32(ph - gal), none)
            else:
                mid = np.float32(lo + np.float32(np.float32(ph - lo) * np.float32(0.5)))
                if mid <= lo:
                    mid = ph
            cnt, mass, a, b = evaluate(mid)
            if (mass if use_mass else cnt) >= need:
                lo, lo_mass = a, mass
            else:
                ph = b
            it += 1
        return lo, lo_mass

    t = none
    if 0 < top_k < vocab:
        t, _ = search(t, 0, m, top_k, False)
    z = evaluate(t)[1]
    if top_pq < TOP_P_ONE:
        t, z = search(t, z, m, need_torch(z, top_pq), True)
    u = philox_randint(seed, pos) >> 1
    r = u * (z >> 31) + ((u * (z & 0x7FFFFFFF)) >> 31)
    keep = (bmax_blk >= float(t))[blk] & (l >= float(t))
    c = torch.cumsum(torch.where(keep, w, torch.zeros_like(w)), dim=0)
    hit = torch.nonzero(c > r)
    tok = int(hit[0, 0]) if len(hit) else -1
    return min(max(tok, 0), vocab - 1)


#: the most logits of a block an evaluation skips or reads as one (Sample.CONSTEXPRS)
SMP_MAX_BLOCK = 8192

# ---- the opcode ----------------------------------------------------------------------------------
@register
@dataclass(frozen=True)
class Sample(Instruction):
    nparts: int      # LM_HEAD partials (= DecoderLayout.n_lm_tiles), as ARGMAX's

    NAME = "sample"
    STAGE = 8
    ARGS = ("pos", "logits_ptr", "amax_ptr", "smp_ptr", "smp_mass_ptr", "tok_ptr", "toks_ptr", "VOCAB", "LM_ROWS",
            "SMP_BLOCK", "SMP_CHUNK", "SMP_CANDS")
    # SMP_BLOCK: logits per block (a power of two, a multiple of LM_ROWS): the granularity at which
    # an evaluation skips logits below its probe (by the block's largest logit); a block read is
    # read SMP_MAX_SUB logits at a time. SMP_CHUNK: logits per
    # SAMPLE_MASS instruction (smp_chunk)
    CONSTEXPRS = {"SMP_BLOCK": lambda lay: max(lay.lm_rows, min(SMP_MAX_BLOCK, triton.next_power_of_2(lay.cfg.vocab)))
                  if Sample.applies(lay) else 16,
                  "SMP_CHUNK": lambda lay: smp_chunk(lay.cfg.vocab, Sample.CONSTEXPRS["SMP_BLOCK"](lay))
                  if Sample.applies(lay) else 16,
                  "SMP_CANDS": lambda lay: min(CANDS, Sample.CONSTEXPRS["SMP_CHUNK"](lay))}
    TIMING = Timing.FIXED
    # only in the kernels of sampling tapes: the greedy and layer kernels stay the ones measured
    IN_EVERY_KERNEL = False
    WHOLE_MODEL = True
    device = sample_device
    # tok / toks: as ARGMAX's; smp: the weights' table and the runtime parameters (state_values),
    # written by the host before generating
    STATE = {"tok": "i32", "toks": "i32", "smp": "i64"}

    @classmethod
    def state_shapes(cls, lay: Layout) -> dict:
        return {"tok": (1,), "toks": (lay.max_seq,), "smp": (int(SMP_TABLE) + N_PARAMS,)}

    @staticmethod
    def state_values(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> dict:
        """``{"smp": the buffer}`` for these parameters (a CPU int64 tensor: the table, then the
        parameters). Errors name the argument: temperature > 0 (finite), top_k >= 0 (0: off),
        0 < top_p <= 1 (1: off), 0 <= seed < 2^31."""
        check_sampling(temperature, top_k, top_p, seed, greedy_ok=False)
        scale = min(max(math.log2(math.e) / float(temperature), 1e-30), 1e30)
        scale32 = float(np.float32(scale))
        gal = max(1.0 / scale32, 1e-30)
        top_pq = min(max(round(float(top_p) * (1 << 24)), 1), 1 << 24)
        prm = [_bits(scale32), _bits(gal), min(int(top_k), 2**31 - 1), int(seed), top_pq, _bits(temperature),
               _bits(top_p), 0]
        return {"smp": torch.cat([exp2_table(), torch.tensor(prm, dtype=torch.int64)])}

    def check_operands(self, lay: Layout) -> list[str]:
        if not self.applies(lay):
            return ["sample needs a DecoderLayout (opcodes.decoder)"]
        if lay.cfg.vocab > MAX_VOCAB:
            return [f"sample: vocab {lay.cfg.vocab} > {MAX_VOCAB} (its int64 sums of weights would overflow)"]
        n = lay.n_lm_tiles
        if self.nparts != n:
            return [f"nparts {self.nparts} is not the number of LM head tiles ({n})"]
        return []

    def reads(self, lay: Layout) -> list[Region]:
        return [Region("logits", 0, lay.cfg.vocab), Region("amax", 0, 2 * self.nparts),
                Region("smp_mass", 0, mass_words(lay) - 1)]

    def writes(self, lay: Layout) -> list[Region]:
        w = mass_words(lay)
        return [Region("smp_mass", w - 1, w)]

    def cost(self, lay: Layout) -> Cost:
        # no top-k / top-p: the chunk sums and one chunk, plus the partials and the table; top-k /
        # top-p add probes and passes over the kept blocks (data-dependent, module docstring)
        ch = chunk_size(lay)
        return Cost(hbm_bytes=0, l2_bytes=4 * ch + 8 * n_chunks(lay) + 8 * self.nparts + (8 << TABLE_BITS),
                    flops=30 * ch)

    def run_torch(self, lay: Layout, st) -> None:
        params = getattr(st, "state", None) or {}
        if "smp" not in params:
            raise ValueError("sample: the VM needs the sampling parameters: run_tape(..., state="
                             "Sample.state_values(temperature, top_k, top_p, seed))")
        args = (st.buf["logits"], st.buf["amax"], self.nparts, lay.lm_rows, Sample.CONSTEXPRS["SMP_BLOCK"](lay))
        st.next_token = sample_torch(*args, params["smp"], st.pos)
        st.buf["smp_mass"][mass_words(lay) - 1] = cand_path_torch(*args, chunk_size(lay), n_cands(lay), params["smp"])


def chunk_size(lay: Layout) -> int:
    """Logits per SAMPLE_MASS instruction (the SMP_CHUNK constexpr) of a sampling decoder of ``lay``."""
    return Sample.CONSTEXPRS["SMP_CHUNK"](lay)


def n_cands(lay: Layout) -> int:
    """The largest logits of its chunk each SAMPLE_MASS instruction keeps (the SMP_CANDS constexpr)."""
    return Sample.CONSTEXPRS["SMP_CANDS"](lay)


def mass_words(lay: Layout) -> int:
    """int64 words of the ``smp_mass`` scratch: each chunk's weight sum, each chunk's candidates
    (fp32 bits), their weights, then the path SAMPLE took (0: no threshold, 1: the candidates,
    2: the whole vocabulary)."""
    return n_chunks(lay) * (1 + 2 * n_cands(lay)) + 1


def n_chunks(lay: Layout) -> int:
    """SAMPLE_MASS instructions (chunks of SMP_CHUNK logits) of a sampling decoder of ``lay``."""
    return -(-lay.cfg.vocab // chunk_size(lay))


def chunk_mass_torch(logits: torch.Tensor, amax: torch.Tensor, nparts: int, lm_rows: int, block: int, chunk: int,
                     smp: torch.Tensor, c0: int) -> int:
    """SAMPLE_MASS's sum in torch: the weights of the logits >= "none" in ``[c0, c0 + chunk)``, 0
    where the chunk's block is skipped (its partials' maximum below "none"), as ``sample_torch``
    weighs them."""
    prm = unpack_params(smp)
    l = logits.reshape(-1).float().cpu()
    bmax_blk = block_maxima_torch(amax, nparts, l.numel(), lm_rows, block)
    if not bool(bmax_blk[c0 // block] >= float(np.float32(NONE))):
        return 0
    m = np.float32(bmax_blk.max().item())
    seg = l[c0:c0 + chunk]
    w = weights_torch(seg, m, prm["scale"], smp.reshape(-1)[:int(SMP_TABLE)].cpu())
    return int(w[seg >= float(np.float32(NONE))].sum())


#: SAMPLE's paths, by the word it writes last in ``smp_mass`` (``mass_words``)
PATHS = ("no threshold", "candidates", "whole vocabulary")


def wants_cands(smp: torch.Tensor, vocab: int) -> bool:
    """Whether SAMPLE_MASS writes candidates for these parameters (a top-k or top-p threshold)."""
    prm = unpack_params(smp)
    return 0 < prm["top_k"] < vocab or prm["top_p_q"] < TOP_P_ONE


def chunk_cands_torch(logits: torch.Tensor, amax: torch.Tensor, nparts: int, lm_rows: int, block: int, chunk: int,
                      k: int, smp: torch.Tensor, c0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SAMPLE_MASS's candidates in torch (``_smp_chunk_cands``): the ``k`` largest logits of
    ``[c0, c0 + chunk)`` (fp32, descending; -inf past the vocabulary) and their int64 weights; all
    -inf (weight 0) where the chunk's block is skipped, all +inf where the chunk holds a NaN or a
    logit above its block's partials' maximum."""
    flat = logits.reshape(-1)
    seg = torch.full((chunk,), float("-inf"))
    part = flat[c0:c0 + chunk].float().cpu()        # the chunk alone (called once per chunk)
    seg[:part.numel()] = part
    bmax_blk = block_maxima_torch(amax, nparts, flat.numel(), lm_rows, block)
    bm = float(bmax_blk[c0 // block])
    top = torch.topk(seg, k).values
    if bool(torch.isnan(seg).any()) or bool((seg > bm).any()):
        top = torch.full((k,), float("inf"))
    elif not bm >= float(np.float32(NONE)):
        top = torch.full((k,), float("-inf"))
    live = top >= float(np.float32(NONE))
    m = np.float32(bmax_blk.max().item())
    prm = unpack_params(smp)
    w = weights_torch(torch.where(live, top, torch.tensor(float(m))), m, prm["scale"], smp.reshape(-1)[:int(SMP_TABLE)].cpu())
    return top, torch.where(live, w, torch.zeros_like(w))


def f32_words(x: torch.Tensor) -> torch.Tensor:
    """fp32 values as the int64 words SAMPLE_MASS stores them in (their bits, sign-extended)."""
    return x.float().contiguous().view(torch.int32).to(torch.int64)


def cand_path_torch(logits: torch.Tensor, amax: torch.Tensor, nparts: int, lm_rows: int, block: int, chunk: int,
                    k: int, smp: torch.Tensor) -> int:
    """The path the device's SAMPLE takes (the last word of ``smp_mass``): 0 without top-k and
    top-p, 1 where the candidates decide (``_smp_cand_thresholds``'s ``ok``), 2 where the
    whole-vocabulary searches run. Either way the token is ``sample_torch``'s."""
    prm = unpack_params(smp)
    top_k, top_pq = prm["top_k"], prm["top_p_q"]
    l = logits.reshape(-1).float().cpu()
    vocab = l.numel()
    if not wants_cands(smp, vocab):
        return 0
    nch = -(-vocab // chunk)
    both = [chunk_cands_torch(logits, amax, nparts, lm_rows, block, chunk, k, smp, c * chunk) for c in range(nch)]
    cand, wc = torch.stack([v for v, _ in both]), torch.stack([w for _, w in both])
    m = np.float32(block_maxima_torch(amax, nparts, vocab, lm_rows, block).max().item())
    ok = bool(np.isfinite(m))
    vals = cand[cand >= float(np.float32(NONE))]

    def mass(x):
        return int(wc[cand >= x].sum())

    t = float(np.float32(NONE))
    z = sum(chunk_mass_torch(logits, amax, nparts, lm_rows, block, chunk, smp, c * chunk) for c in range(nch))
    if 0 < top_k < vocab:
        ok = ok and vals.numel() >= top_k
        if ok:
            t = float(torch.sort(vals, descending=True).values[top_k - 1])
            z = mass(t)
    if ok and top_pq < TOP_P_ONE:
        need = need_torch(z, top_pq)
        ok = mass(t) >= need
        if ok:
            t = max(float(v) for v in torch.unique(vals) if float(v) >= t and mass(float(v)) >= need)
    ok = ok and t > float(cand.min(dim=1).values.max())
    return 1 if ok else 2


def check_sampling(temperature, top_k, top_p, seed, greedy_ok: bool = True) -> None:
    """Raise ValueError / TypeError naming the argument for a bad sampling parameter.
    ``greedy_ok``: temperature 0 (greedy) is allowed."""
    def num(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if not num(temperature):
        raise TypeError(f"temperature: expected a number >= 0, got {type(temperature).__name__} {temperature!r}")
    if not (math.isfinite(temperature) and (temperature > 0 or (greedy_ok and temperature == 0))):
        raise ValueError(f"temperature: expected a finite number {'>= 0' if greedy_ok else '> 0'}, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k: expected an int >= 0 (0: off), got {type(top_k).__name__} {top_k!r}")
    if top_k < 0:
        raise ValueError(f"top_k: expected an int >= 0 (0: off), got {top_k}")
    if not num(top_p):
        raise TypeError(f"top_p: expected a number in (0, 1], got {type(top_p).__name__} {top_p!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p: expected a number in (0, 1] (1: off), got {top_p!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int in [0, 2**31), got {type(seed).__name__} {seed!r}")
    if not 0 <= seed < 2**31:
        raise ValueError(f"seed: expected an int in [0, 2**31), got {seed}")
