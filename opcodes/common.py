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
    "NS", "NSP", "ATTN_BLOCK", "ATTN_STAGES", "BK", "STAGES", "INTERP", "FOLD",
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
        INTERP=interp, FOLD=bool(t.fold),
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
def prefetch_l2(ptrs, mask):
    """Ask L2 to fetch the 128-byte lines at ``ptrs`` (fire and forget; GPU only).

    Used while an instruction spins on a counter: the bytes it will stream next move from HBM to
    L2 during time that would otherwise be idle, and the tile then runs from L2.
    """
    tl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        constraints="=r,l,r", args=[ptrs.to(tl.int64), mask.to(tl.int32)], dtype=tl.int32,
        is_pure=False, pack=1)


@triton.jit
def prefetch_rows(w_ptr, rows, row_mask, K: tl.constexpr, k0, KLEN, BK: tl.constexpr):
    """Prefetch columns ``[k0, k0 + BK)`` (clipped to ``KLEN``) of ``rows`` of a row-major bf16
    matrix with ``K`` columns, one request per 32-byte sector."""
    LINES: tl.constexpr = BK // 16
    cols = k0 + tl.arange(0, LINES) * 16
    m = row_mask[:, None] & (cols < k0 + KLEN)[None, :] & (cols < K)[None, :]
    prefetch_l2(w_ptr + rows[:, None] * K + cols[None, :], m)


@triton.jit
def residual_partial_sum(layer, rows, rm, x1_ptr, dpart_ptr, D: tl.constexpr, NKC: tl.constexpr,
                         NLOAD: tl.constexpr):
    """``x1 + dpart[0] + ... + dpart[NLOAD - 1]`` over ``rows``, in that order (fp32)."""
    y = tl.load(x1_ptr + layer * D + rows, mask=rm, other=0.0, cache_modifier=".cg")
    for kc in range(NLOAD):
        y += tl.load(dpart_ptr + (layer * NKC + kc) * D + rows, mask=rm, other=0.0, cache_modifier=".cg")
    return y


@triton.jit
def store_layer_output(layer, rows, rm, y, out_ptr, xout_ptr, NL: tl.constexpr, D: tl.constexpr,
                       INTERP: tl.constexpr):
    """The layer's output rows in bf16: the caller's tensor for the last layer, else ``xout``."""
    if layer == NL - 1:
        dst = out_ptr
    else:
        dst = xout_ptr + layer * D
    tl.store(dst + rows, to_bf16(y, INTERP), mask=rm)


def residual_torch(lay, st, layer: int, lo: int, hi: int) -> None:
    """RESIDUAL's semantics on rows ``[lo, hi)`` (also DOWN's with ``Tiling.fold``)."""
    c = lay.cfg
    y = st.buf["x1"].view(c.layers, c.d)[layer, lo:hi].clone()
    dp = st.buf["dpart"].view(c.layers, lay.n_down_k, c.d)
    for kc in range(lay.n_down_k):
        y += dp[layer, kc, lo:hi]
    st.buf["xout"].view(c.layers, c.d)[layer, lo:hi] = y.to(torch.bfloat16)
