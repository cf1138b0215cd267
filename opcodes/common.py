"""Jit helpers shared by the opcodes' device functions: the offset table of per-layer tensors,
the layer input, bf16 rounding, the interpreter-safe ``tl.dot`` and the GEMV streaming loop."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from .base import MAX_WAITS, Layout

_MAX_WAITS = tl.constexpr(MAX_WAITS)

# Columns of the per-layer offset table (``Layout.TENSORS``): the kernel reaches layer l's copy
# of a tensor at the layer-0 pointer plus ``wtab[l, column]`` elements.
NTAB = tl.constexpr(len(Layout.TENSORS))
T_N1 = tl.constexpr(Layout.column("in_norm"))
T_N2 = tl.constexpr(Layout.column("post_norm"))
T_WQ = tl.constexpr(Layout.column("q"))
T_WK = tl.constexpr(Layout.column("k"))
T_WV = tl.constexpr(Layout.column("v"))
T_WO = tl.constexpr(Layout.column("o"))
T_WG = tl.constexpr(Layout.column("gate"))
T_WU = tl.constexpr(Layout.column("up"))
T_WD = tl.constexpr(Layout.column("down"))
T_KC = tl.constexpr(Layout.column("kc"))
T_VC = tl.constexpr(Layout.column("vc"))


@triton.jit
def tab_offset(wtab_ptr, layer, idx):
    """Element offset of tensor ``idx`` of ``layer`` from the layer-0 tensor (16-byte aligned)."""
    return tl.multiple_of(tl.load(wtab_ptr + layer * NTAB + idx), 8)


@triton.jit
def layer_input(x_ptr, xout_ptr, layer, D: tl.constexpr):
    """The residual stream entering ``layer``: the caller's x, or the previous layer's output."""
    if layer == 0:
        src = x_ptr
    else:
        src = xout_ptr + (layer - 1) * D
    return src


@triton.jit
def layer_rows(x_ptr, xout_ptr, x1_ptr, dpart_ptr, layer, rows, rm, D: tl.constexpr, DOWN_CHUNKS: tl.constexpr,
               RES_FOLD: tl.constexpr, INTERP: tl.constexpr):
    """Rows ``rows`` of the residual stream entering ``layer``, in fp32: the caller's x, the previous
    layer's RESIDUAL output, or with ``RES_FOLD`` that output computed here as RESIDUAL does it
    (``x1 + dpart[0] + dpart[1] + ...`` in fp32, rounded to bf16)."""
    if RES_FOLD:
        if layer == 0:
            v = tl.load(x_ptr + rows, mask=rm, other=0.0, cache_modifier=".cg").to(tl.float32)
        else:
            y = tl.load(x1_ptr + (layer - 1) * D + rows, mask=rm, other=0.0, cache_modifier=".cg")
            for kc in tl.static_range(DOWN_CHUNKS):
                y += tl.load(dpart_ptr + ((layer - 1) * DOWN_CHUNKS + kc) * D + rows, mask=rm, other=0.0,
                             cache_modifier=".cg")
            v = to_bf16(y, INTERP).to(tl.float32)
    else:
        xin = layer_input(x_ptr, xout_ptr, layer, D)
        v = tl.load(xin + rows, mask=rm, other=0.0, cache_modifier=".cg").to(tl.float32)
    return v


@triton.jit
def to_bf16(x, INTERP: tl.constexpr):
    """fp32 -> bf16, rounding to nearest even.

    NOTE: the Triton 3.6 interpreter truncates fp32 -> bf16 casts (1.0058594 becomes 1.0, not
    1.0078125), which would make the CPU's K/V cache and outputs differ from the GPU's and carry a
    biased error; under the interpreter the rounding is done on the bits first.
    """
    if INTERP:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        x = b.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def mma(a, b, INTERP: tl.constexpr):
    """``tl.dot(a, b)`` with fp32 accumulation of bf16 operands.

    NOTE: the Triton 3.6 interpreter computes bf16 ``tl.dot`` wrongly (it reads the bf16 bits as
    integers: errors of 1e10 on unit inputs), so under the interpreter the operands go up to fp32.
    """
    if INTERP:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@triton.jit
def gemv_stream(w1_ptr, rows1, w2_ptr, rows2, row_mask, x_ptr, nw_ptr, kbase,
                K: tl.constexpr, KLEN: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr,
                STAGES: tl.constexpr, TWO: tl.constexpr, NORM: tl.constexpr, EVEN: tl.constexpr,
                xp_ptr=None, XP: tl.constexpr = 0, INTERP: tl.constexpr = False):
    """The streaming loop of every weight GEMV: rows ``rows1`` of the row-major bf16 matrix at
    ``w1_ptr`` (and, with ``TWO``, rows ``rows2`` of ``w2_ptr``), ``K`` columns each, dotted with
    ``x[kbase : kbase + KLEN]`` (bf16 or fp32) in ``BK``-column blocks, pipelined ``STAGES`` deep.

    With ``NORM`` the vector is ``x * nw`` (the RMSNorm weight at ``nw_ptr``) and the sum of
    ``x^2`` is returned for the caller's ``rsqrt`` (applied after the dot, once per row).
    Returns the fp32 ``[ROWS, BK]`` accumulators (the second is zero without ``TWO``) and the
    ``[BK]`` sum of squares (zero without ``NORM``): the caller reduces them over ``BK``.
    ``EVEN``: ``K``, ``KLEN`` and the rows need no masks (the streaming loads are then plain
    16-byte vectors, evicted first: the weights are read once per call).
    ``XP`` > 0: the vector is ``x + xp[0] + ... + xp[XP-1]`` (fp32 rows ``K`` apart at ``xp_ptr``),
    rounded to bf16: the previous layer's RESIDUAL folded in (``Tiling.res_fold``).
    NOTE: the loop body has no branch other than on constexprs, so the software pipeliner
    pipelines every load.
    """
    acc1 = tl.zeros([ROWS, BK], dtype=tl.float32)
    acc2 = tl.zeros([ROWS, BK], dtype=tl.float32)
    ss = tl.zeros([BK], dtype=tl.float32)
    wrow1 = w1_ptr + rows1[:, None] * K
    wrow2 = w2_ptr + rows2[:, None] * K
    # each iteration streams ROWS (2 x ROWS with TWO) x BK bf16 weights
    for kk in tl.range(0, KLEN, BK, num_stages=STAGES):
        cols = kbase + kk + tl.arange(0, BK)
        if EVEN:
            xv = tl.load(x_ptr + cols, cache_modifier=".cg").to(tl.float32)
            if XP > 0:
                for kc in tl.static_range(XP):
                    xv += tl.load(xp_ptr + kc * K + cols, cache_modifier=".cg")
                xv = to_bf16(xv, INTERP).to(tl.float32)
            if NORM:
                nw = tl.load(nw_ptr + cols).to(tl.float32)
            w1 = tl.load(wrow1 + cols[None, :], eviction_policy="evict_first")
            if TWO:
                w2 = tl.load(wrow2 + cols[None, :], eviction_policy="evict_first")
        else:
            cm = ((kk + tl.arange(0, BK)) < KLEN) & (cols < K)
            m2 = row_mask[:, None] & cm[None, :]
            xv = tl.load(x_ptr + cols, mask=cm, other=0.0, cache_modifier=".cg").to(tl.float32)
            if XP > 0:
                for kc in tl.static_range(XP):
                    xv += tl.load(xp_ptr + kc * K + cols, mask=cm, other=0.0, cache_modifier=".cg")
                xv = to_bf16(xv, INTERP).to(tl.float32)
            if NORM:
                nw = tl.load(nw_ptr + cols, mask=cm, other=0.0).to(tl.float32)
            w1 = tl.load(wrow1 + cols[None, :], mask=m2, other=0.0)
            if TWO:
                w2 = tl.load(wrow2 + cols[None, :], mask=m2, other=0.0)
        if NORM:
            ss += xv * xv
            hv = (xv * nw)[None, :]
        else:
            hv = xv[None, :]
        acc1 += w1.to(tl.float32) * hv
        if TWO:
            acc2 += w2.to(tl.float32) * hv
    return acc1, acc2, ss


@triton.jit
def row_vec(x_ptr, nw_ptr, kbase, KLEN: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr):
    """The vector of a row-streaming GEMV (``Tiling.row_bytes``): ``x[kbase : kbase + KLEN]`` in
    fp32, zero-padded to ``KP`` (a power of two), times the RMSNorm weight at ``nw_ptr`` with
    ``NORM``; and the sum of ``x^2`` (the caller's ``rsqrt``, applied after the dots)."""
    cols = tl.arange(0, KP)
    if KLEN == KP:
        xv = tl.load(x_ptr + kbase + cols, cache_modifier=".cg").to(tl.float32)
    else:
        xv = tl.load(x_ptr + kbase + cols, mask=cols < KLEN, other=0.0, cache_modifier=".cg").to(tl.float32)
    ss = tl.sum(xv * xv, axis=0)
    if NORM:
        if KLEN == KP:
            xv = xv * tl.load(nw_ptr + kbase + cols).to(tl.float32)
        else:
            xv = xv * tl.load(nw_ptr + kbase + cols, mask=cols < KLEN, other=0.0).to(tl.float32)
    return xv, ss


@triton.jit
def norm_row_vec(x_ptr, nw_ptr, K: tl.constexpr, KP: tl.constexpr, EPS: tl.constexpr):
    """:func:`row_vec` of an RMSNorm'ed input (``x[0:K] * nw``, zero-padded to ``KP``) and its
    ``rsqrt(mean(x^2) + EPS)``, applied by the caller after the dots (GATE_UP, LM_HEAD)."""
    hv, ss = row_vec(x_ptr, nw_ptr, 0, K, KP, NORM=True)
    return hv, 1.0 / tl.sqrt(ss / K + EPS)


@triton.jit
def rows_load(w_ptr, rows, row_mask, kbase, K: tl.constexpr, klen, KP: tl.constexpr, EVEN: tl.constexpr):
    """``W[rows, kbase : kbase + klen]`` (bf16, zero-padded to ``KP`` columns): one pipeline stage
    of a row-streaming GEMV (``Tiling.row_bytes``), whole rows read once (evicted first).
    ``EVEN``: every row is in range and ``klen == KP`` (no masks: plain 16-byte vector loads)."""
    cols = tl.arange(0, KP)
    ptrs = w_ptr + rows[:, None] * K + kbase + cols[None, :]
    if EVEN:
        w = tl.load(ptrs, eviction_policy="evict_first")
    else:
        w = tl.load(ptrs, mask=row_mask[:, None] & (cols < klen)[None, :], other=0.0, eviction_policy="evict_first")
    return w


@triton.jit
def rows_dot(w_ptr, rows, row_mask, hv, kbase, K: tl.constexpr, klen, KP: tl.constexpr, EVEN: tl.constexpr):
    """``W[rows, kbase : kbase + klen] . hv`` (:func:`rows_load`; ``hv`` from :func:`row_vec`)."""
    w = rows_load(w_ptr, rows, row_mask, kbase, K, klen, KP, EVEN)
    return tl.sum(w.to(tl.float32) * hv[None, :], axis=1)


@triton.jit
def warp_row_vec(x_ptr, nw_ptr, K: tl.constexpr, EPS: tl.constexpr):
    """:func:`norm_row_vec` for :func:`warp_rows_dot` (``Tiling.warp_rows``): ``x[0:K] * nw`` as a
    ``[K / 256, 256]`` fp32 block (``K`` a multiple of 256) and ``rsqrt(mean(x^2) + EPS)``."""
    offs = tl.arange(0, K // 256)[:, None] * 256 + tl.arange(0, 256)[None, :]
    xv = tl.load(x_ptr + offs, cache_modifier=".cg").to(tl.float32)
    ss = tl.sum(tl.sum(xv * xv, axis=1), axis=0)
    return xv * tl.load(nw_ptr + offs).to(tl.float32), 1.0 / tl.sqrt(ss / K + EPS)


@triton.jit
def warp_rows_dot(w_ptr, rows, row_mask, hv, K: tl.constexpr, EVEN: tl.constexpr):
    """``W[rows] . hv`` (whole rows of ``K`` columns; ``hv`` from :func:`warp_row_vec`) with each row
    inside one warp (``Tiling.warp_rows``): the block is read through ``[rows, K / 256, 256]``
    pointers, which Triton 3.6 lays out with the warps on the rows (the two dims that are not
    contiguous tie and dim 0 takes the warps), so a row sums in its threads, then over its warp's
    lanes: no shared memory and no barrier, where :func:`rows_dot` sums every row across the
    CTA's warps (measured on the H200: 58 GB/s an SM against 34). The vector is replicated in
    every warp (``K / 32`` registers a thread against ``K / (32 * warps)``). ``EVEN``: no masks."""
    r = tl.arange(0, K // 256)[None, :, None] * 256
    c = tl.arange(0, 256)[None, None, :]
    ptrs = w_ptr + rows[:, None, None] * K + r + c
    if EVEN:
        w = tl.load(ptrs, eviction_policy="evict_first")
    else:
        w = tl.load(ptrs, mask=row_mask[:, None, None], other=0.0, eviction_policy="evict_first")
    return tl.sum(tl.sum(w.to(tl.float32) * hv[None, :, :], axis=1), axis=1)


@triton.jit
def store_in_place(ptr, v, mask, INTERP: tl.constexpr):
    """``tl.store(ptr, v, mask)`` of fp32 ``v`` from the threads that hold it, in ``v``'s own layout:
    ``tl.store`` first converts a result of :func:`warp_rows_dot` (each row's value in every lane of
    its warp) to a coalesced layout, through shared memory and a barrier. Threads holding the same
    element store the same value. (The interpreter runs no PTX: there it is ``tl.store``.)"""
    if INTERP:
        tl.store(ptr, v, mask=mask)
    else:
        tl.inline_asm_elementwise(
            "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $3, 0;\n\t@p st.global.f32 [$1], $2;\n\t}\n\tmov.u32 $0, 0;",
            "=r,l,r,r", [ptr.to(tl.int64), v, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def row_loop_vec(x_ptr, nw_ptr, D: tl.constexpr, DP: tl.constexpr, EPS: tl.constexpr, WARP_ROWS: tl.constexpr):
    """The row loop's RMSNorm'ed vector and ``rsqrt``, laid out for its dot: :func:`warp_row_vec`
    with ``WARP_ROWS`` (``Tiling.warp_rows``), else :func:`norm_row_vec`."""
    if WARP_ROWS:
        hv, rstd = warp_row_vec(x_ptr, nw_ptr, D, EPS)
    else:
        hv, rstd = norm_row_vec(x_ptr, nw_ptr, D, DP, EPS)
    return hv, rstd


@triton.jit
def row_loop_dot(w_ptr, rows, row_mask, hv, D: tl.constexpr, DP: tl.constexpr, EVEN: tl.constexpr,
                 WARP_ROWS: tl.constexpr):
    """One stage of the row loop, ``W[rows] . hv`` (``hv`` from :func:`row_loop_vec`): each row inside
    one warp with ``WARP_ROWS`` (:func:`warp_rows_dot`), else across the CTA (:func:`rows_dot`)."""
    if WARP_ROWS:
        v = warp_rows_dot(w_ptr, rows, row_mask, hv, D, EVEN)
    else:
        v = rows_dot(w_ptr, rows, row_mask, hv, 0, D, D, DP, EVEN)
    return v


@triton.jit
def row_loop_store(ptr, v, mask, WARP_ROWS: tl.constexpr, INTERP: tl.constexpr):
    """Store a :func:`row_loop_dot` result: from the warps that hold it with ``WARP_ROWS``
    (:func:`store_in_place`), else ``tl.store``."""
    if WARP_ROWS:
        store_in_place(ptr, v, mask, INTERP)
    else:
        tl.store(ptr, v, mask=mask)


@triton.jit
def poll_counter(ptr, wt, spin_limit):
    """One bounded wait on a counter (gpu scope): acquire reads of ``ptr`` until it reaches ``wt``, at
    most ``1 + spin_limit`` of them; returns the last value read (``wt`` exactly when met; below it when
    it timed out; above it when another launch ran beside this one). The kernel's own waits
    (interp/codegen.py) and :func:`tape_waits` both poll with it."""
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    n = 0
    while (seen < wt) & (n < spin_limit):
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        n += 1
    return seen


@triton.jit
def tape_waits(ins, cnt_ptr, epoch, spin_limit, PROFILE: tl.constexpr):
    """The instruction's waits, made by its device function (``Instruction.WAIT_INSIDE``): header
    words ``1 + 2k`` (counter, -1 for none) and ``2 + 2k`` (producers per call) of each of its
    ``MAX_WAITS`` waits, call ``epoch`` waiting for ``target * epoch``, each a bounded acquire poll
    (:func:`poll_counter`, as the kernel's own). Returns ``(counter, seen)`` of the first wait whose
    counter is not exactly at its target after ``spin_limit`` polls (counter -1: all met), and when
    they were met (``PROFILE``; else 0). (The target is the tape's: the kernel reads it again.)"""
    bad_c = tl.full([], -1, tl.int32)
    bad_s = tl.full([], 0, tl.int32)
    for k in tl.static_range(_MAX_WAITS):
        wc = tl.load(ins + 1 + 2 * k)
        wt = tl.load(ins + 2 + 2 * k) * epoch
        if (wc >= 0) & (bad_c < 0):
            seen = poll_counter(cnt_ptr + wc, wt, spin_limit)
            if seen != wt:
                bad_c = wc
                bad_s = seen
    if PROFILE:
        t = globaltimer()
    else:
        t = tl.full([], 0, tl.int64)
    return bad_c, bad_s, t
