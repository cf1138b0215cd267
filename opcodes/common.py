"""Kernel parameters shared by every opcode's device function, and small jit helpers.

The interpreter kernel's signature is generated from these lists (``interp/codegen.py``); an
opcode names the parameters it needs in its ``ARGS``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Per-layer table of int64 element offsets, relative to the layer-0 tensor passed to the kernel,
# one row per layer: the kernel reaches layer l's weights and KV cache without a repack.
TAB_NAMES = ("in_norm", "post_norm", "q", "k", "v", "o", "gate", "up", "down", "kc", "vc")
NTAB = tl.constexpr(len(TAB_NAMES))
T_N1 = tl.constexpr(0)
T_N2 = tl.constexpr(1)
T_WQ = tl.constexpr(2)
T_WK = tl.constexpr(3)
T_WV = tl.constexpr(4)
T_WO = tl.constexpr(5)
T_WG = tl.constexpr(6)
T_WU = tl.constexpr(7)
T_WD = tl.constexpr(8)
T_KC = tl.constexpr(9)
T_VC = tl.constexpr(10)
assert TAB_NAMES.index("vc") == T_VC.value and TAB_NAMES.index("in_norm") == T_N1.value

#: pointers the device functions take, with their element types. ``x_ptr`` and ``out_ptr`` change
#: every call and are kernel parameters; the others are fixed at build time and reach the kernel
#: through one table of addresses (fewer launch arguments: each pointer argument costs the launcher
#: a driver call, ~1-2 us).
KERNEL_PTR_TYPES = {
    "x_ptr": "bf16", "out_ptr": "bf16", "xout_ptr": "bf16", "wtab_ptr": "i64",
    "n1_ptr": "bf16", "n2_ptr": "bf16", "wq_ptr": "bf16", "wk_ptr": "bf16", "wv_ptr": "bf16", "wo_ptr": "bf16",
    "wg_ptr": "bf16", "wu_ptr": "bf16", "wd_ptr": "bf16", "kc_ptr": "bf16", "vc_ptr": "bf16",
    "cos_ptr": "fp32", "sin_ptr": "fp32",
    "q_ptr": "fp32", "part_o_ptr": "fp32", "part_ml_ptr": "fp32", "attn_ptr": "fp32", "x1_ptr": "fp32",
    "act_ptr": "fp32", "dpart_ptr": "fp32", "opart_ptr": "fp32",
    # whole-model decoder (opcodes/embed.py, lm_head.py, argmax.py; scratch in opcodes/decoder.py).
    # x0_ptr is the decoder's x0 scratch row, which reaches EMBED and layer 0 as the per-call x_ptr
    "tok_ptr": "i32", "toks_ptr": "i32", "embed_ptr": "bf16", "fnorm_ptr": "bf16", "lmh_ptr": "bf16",
    "x0_ptr": "bf16", "logits_ptr": "fp32", "amax_ptr": "fp32",
}
KERNEL_PTRS = tuple(KERNEL_PTR_TYPES)
PER_CALL_PTRS = ("x_ptr", "out_ptr")
#: the build-time pointers, in the order of the address table
TABLE_PTRS = tuple(p for p in KERNEL_PTRS if p not in PER_CALL_PTRS)
#: compile-time parameters (model shape and tiling), in kernel-signature order
KERNEL_CONSTEXPRS = (
    "NL", "D", "FFN", "NQ", "NKV", "HD", "G", "GP", "MAXS", "EPS", "QSCALE",
    "QKV_ROWS", "O_ROWS", "O_K", "NOC", "GU_ROWS", "DOWN_ROWS", "DOWN_K", "NKC", "RED_ROWS",
    "NS", "NSP", "ATTN_BLOCK", "ATTN_STAGES", "BK", "STAGES", "INTERP",
    "VOCAB", "LM_ROWS", "EMB_COLS", "AM_BLOCK",
)
#: scalar runtime parameters every device function may take
KERNEL_SCALARS = ("pos",)


def constexpr_values(lay, interp: bool = False) -> dict:
    """The values of :data:`KERNEL_CONSTEXPRS` for a :class:`~opcodes.base.Layout`; ``interp``:
    running under the Triton interpreter (see :func:`mma`)."""
    import math
    c, t = lay.cfg, lay.tiling
    return dict(
        NL=c.layers, D=c.d, FFN=c.ffn, NQ=c.n_q, NKV=c.n_kv, HD=c.hd, G=c.group,
        GP=max(16, triton.next_power_of_2(c.group)), MAXS=lay.max_seq, EPS=float(c.eps),
        QSCALE=float(1.4426950408889634 / math.sqrt(c.hd)),
        QKV_ROWS=t.qkv_rows, O_ROWS=t.o_rows, O_K=lay.o_k, NOC=lay.n_o_k, GU_ROWS=t.gu_rows, DOWN_ROWS=t.down_rows,
        DOWN_K=t.down_k, NKC=lay.n_down_k, RED_ROWS=t.red_rows, NS=t.attn_splits,
        NSP=triton.next_power_of_2(t.attn_splits), ATTN_BLOCK=t.attn_block, ATTN_STAGES=t.attn_stages, BK=t.bk, STAGES=t.stages,
        INTERP=interp,
        # whole-model decoder (opcodes.decoder.DecoderLayout); placeholders for layer-only layouts
        VOCAB=max(1, c.vocab), LM_ROWS=getattr(lay, "lm_rows", 16), EMB_COLS=getattr(lay, "emb_cols", 16),
        AM_BLOCK=getattr(lay, "am_block", 16),
    )


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
                STAGES: tl.constexpr, TWO: tl.constexpr, NORM: tl.constexpr, EVEN: tl.constexpr):
    """The streaming loop of every weight GEMV: rows ``rows1`` of the row-major bf16 matrix at
    ``w1_ptr`` (and, with ``TWO``, rows ``rows2`` of ``w2_ptr``), ``K`` columns each, dotted with
    ``x[kbase : kbase + KLEN]`` (bf16 or fp32) in ``BK``-column blocks, pipelined ``STAGES`` deep.

    With ``NORM`` the vector is ``x * nw`` (the RMSNorm weight at ``nw_ptr``) and the sum of
    ``x^2`` is returned for the caller's ``rsqrt`` (applied after the dot, once per row).
    Returns the fp32 ``[ROWS, BK]`` accumulators (the second is zero without ``TWO``) and the
    ``[BK]`` sum of squares (zero without ``NORM``): the caller reduces them over ``BK``.
    ``EVEN``: ``K``, ``KLEN`` and the rows need no masks (the streaming loads are then plain
    16-byte vectors, evicted first: the weights are read once per call).
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
            if NORM:
                nw = tl.load(nw_ptr + cols).to(tl.float32)
            w1 = tl.load(wrow1 + cols[None, :], eviction_policy="evict_first")
            if TWO:
                w2 = tl.load(wrow2 + cols[None, :], eviction_policy="evict_first")
        else:
            cm = ((kk + tl.arange(0, BK)) < KLEN) & (cols < K)
            m2 = row_mask[:, None] & cm[None, :]
            xv = tl.load(x_ptr + cols, mask=cm, other=0.0, cache_modifier=".cg").to(tl.float32)
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
