"""Jit helpers of the many-rows opcodes (issue 50, bench/notes/rows-design.md sec. 2): the skinny-GEMM
streaming loop of an R-row tile.

A one-row tile is ``y[ROWS] = W[ROWS, K] . x[K]`` (``opcodes.common.gemv_stream``). With R rows the tile is
``Y^T[M, N] = W[M, K] . X^T[K, N]`` with A and B swapped: the weight rows are ``tl.dot``'s M side and the rows
(tokens) are its N side, padded to ``N_TILE >= 16`` (every ``tl.dot`` dim must be >= 16; padded columns are zero,
stay finite and never mix with real ones: the columns of a dot are independent). Activations are
feature-major: ``X^T`` is ``[K, XS]`` (row stride ``XS`` elements), so a K block ``X^T[BK, N_TILE]`` is one
contiguous span when ``XS == N_TILE``: the B operand's natural layout.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import mma, to_bf16
from .rows import DECODE_ROWS_MAX


@triton.jit
def rows_stream(w1_ptr, rows1, w2_ptr, rows2, row_mask, xt_ptr, kbase, n_left, xs,
                K: tl.constexpr, KLEN: tl.constexpr, M: tl.constexpr, N_TILE: tl.constexpr, BK: tl.constexpr,
                STAGES: tl.constexpr, TWO: tl.constexpr, EVEN: tl.constexpr,
                INTERP: tl.constexpr = False, NS: tl.constexpr = 1):
    """The streaming loop of an R-row GEMM tile: rows ``rows1`` ([M]) of the row-major bf16 matrix at
    ``w1_ptr`` (and, with ``TWO``, rows ``rows2`` of ``w2_ptr``), ``K`` columns each, times the
    ``[KLEN, N_TILE]`` block of the feature-major activations at ``xt_ptr`` (element ``(k, n)`` at
    ``xt_ptr + (kbase + k) * xs + n * NS``: the caller offsets ``xt_ptr`` by its first column ``n0``;
    ``NS`` > 1 with ``xs`` 1 reads row-major activations, a token's features contiguous), in
    ``BK``-row blocks pipelined ``STAGES`` deep.

    Per block: ``W[M, BK]`` (read once: evicted first) and ``X^T[BK, N_TILE]`` (``.cg``: shared by the
    tiles of every weight row block, from the L2), ``acc += W . bf16(X^T)``, fp32 accumulation.
    Returns the fp32 ``[M, N_TILE]`` accumulators (the second zero without ``TWO``).
    ``EVEN``: no masks (``KLEN % BK == 0``, every row in range, ``n_left >= N_TILE``); otherwise rows
    outside ``row_mask``, columns ``>= n_left`` and K past ``KLEN`` / ``K`` read as zero.
    NOTE: a bf16 operand goes straight into the dot, so both loads are pipelined through shared memory. An
    RMSNorm'ed operand is built by its producer (``store_normed``): normalizing inside this loop (v1's
    ``NORM``) kept the operand's load in registers, in the loop's critical path: 37.5 us a 1B GATE_UP tile
    against 6.4 us for DOWN's (bench/notes/s39.md, run 275).
    """
    acc1 = tl.zeros([M, N_TILE], dtype=tl.float32)
    acc2 = tl.zeros([M, N_TILE], dtype=tl.float32)
    ncol = tl.arange(0, N_TILE)
    wrow1 = w1_ptr + rows1[:, None].to(tl.int64) * K
    wrow2 = w2_ptr + rows2[:, None].to(tl.int64) * K
    for kk in tl.range(0, KLEN, BK, num_stages=STAGES):
        ks = kbase + kk + tl.arange(0, BK)
        xptrs = xt_ptr + ks[:, None].to(tl.int64) * xs + ncol[None, :] * NS
        if EVEN:
            xt = tl.load(xptrs, cache_modifier=".cg")
            w1 = tl.load(wrow1 + ks[None, :], eviction_policy="evict_first")
            if TWO:
                w2 = tl.load(wrow2 + ks[None, :], eviction_policy="evict_first")
        else:
            km = ((kk + tl.arange(0, BK)) < KLEN) & (ks < K)
            xt = tl.load(xptrs, mask=km[:, None] & (ncol < n_left)[None, :], other=0.0, cache_modifier=".cg")
            wm = row_mask[:, None] & km[None, :]
            w1 = tl.load(wrow1 + ks[None, :], mask=wm, other=0.0, eviction_policy="evict_first")
            if TWO:
                w2 = tl.load(wrow2 + ks[None, :], mask=wm, other=0.0, eviction_policy="evict_first")
        if xt_ptr.dtype.element_ty == tl.bfloat16:
            xb = xt
        else:
            xb = to_bf16(xt.to(tl.float32), INTERP)
        if INTERP:
            acc1 += mma(w1, xb, INTERP)
            if TWO:
                acc2 += mma(w2, xb, INTERP)
        else:
            acc1 = tl.dot(w1, xb, acc1)
            if TWO:
                acc2 = tl.dot(w2, xb, acc2)
    return acc1, acc2


@triton.jit
def store_normed(x, rows, rm, nw_ptr, hn_ptr, ss_ptr, part, n0, D: tl.constexpr, P: tl.constexpr,
                 NT: tl.constexpr, INTERP: tl.constexpr):
    """A producer's share of an RMSNorm'ed GEMM operand (rows-design.md; bench/notes/s39.md v148): for the
    fp32 block ``x`` [T, NT] (features ``rows``, valid where ``rm``; column block ``n0``) of an activation
    that a GEMM reads normed, store ``bf16(x * nw)`` at ``hn_ptr`` (feature-major ``[d]``, blocked by ``NT``
    columns: ``opcodes.rows``) and the block's per-column sum of squares at part ``part`` of ``ss_ptr``
    (``[P]`` parts, blocked likewise). The consumer sums the parts in order (``col_rstd``) and scales its
    dot by ``rsqrt(ss / d + eps)``: its loop streams a bf16 operand, no math before the dot."""
    n = tl.arange(0, NT)
    nw = tl.load(nw_ptr + rows, mask=rm, other=0.0).to(tl.float32)
    tl.store(hn_ptr + n0 * D + rows[:, None] * NT + n[None, :], to_bf16(x * nw[:, None], INTERP), mask=rm[:, None])
    # a decode bucket's sums in fp64 (the VM: rows.feature_sums_r): a square of an fp32 is exact there and the
    # sum rounds ~2^29 times finer than fp32's, so the fp32 result does not depend on the reduction's order,
    # which follows the block's layout, which follows NT (the sm_90 TTGIR reduces [64, 16] over 16 lanes x 4
    # warps, [64, 32] 8 terms a thread first; bench/notes/s49.md v186). Each branch whole, so the fp32 one
    # compiles to the PTX it had before
    if NT <= DECODE_ROWS_MAX:
        xd = tl.where(rm[:, None], x, 0.0).to(tl.float64)
        tl.store(ss_ptr + n0 * P + part * NT + n, tl.sum(xd * xd, axis=0).to(tl.float32))
    else:
        xm = tl.where(rm[:, None], x, 0.0)
        tl.store(ss_ptr + n0 * P + part * NT + n, tl.sum(xm * xm, axis=0))


@triton.jit
def col_rstd(ss_ptr, P, PP: tl.constexpr, D: tl.constexpr, EPS: tl.constexpr, NT: tl.constexpr,
             STRIDE: tl.constexpr = 0):
    """``rsqrt(sum_p ss[p, n] / D + EPS)`` over the ``P`` (<= ``PP``, a power of two) parts ``store_normed``
    wrote at ``ss_ptr`` (one column block: the caller adds the block's offset), [NT] fp32; the parts summed
    in one fixed order. ``STRIDE``: a part's columns (default ``NT``), for ``NT`` columns of a wider block."""
    p = tl.arange(0, PP)
    n = tl.arange(0, NT)
    ps: tl.constexpr = NT if STRIDE == 0 else STRIDE
    ss = tl.load(ss_ptr + p[:, None] * ps + n[None, :], mask=(p < P)[:, None], other=0.0, cache_modifier=".cg")
    if ps <= DECODE_ROWS_MAX:     # order-free, as store_normed's sums
        r = 1.0 / tl.sqrt(tl.sum(ss.to(tl.float64), axis=0).to(tl.float32) / D + EPS)
    else:
        r = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / D + EPS)
    return r
