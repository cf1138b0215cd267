"""QKV_SPAN: a contiguous range of one KV group's RoPE-pair blocks of the fused Q/K/V projection,
streamed in one row loop: what QKV computes, cut so that a layer's QKV stage runs on every SM.

A KV group's rows are its ``group`` query heads, then its K head and its V head; each head's
``hd/2`` RoPE pairs are cut into blocks of :func:`span_pairs` pairs (``2 * span_pairs`` whole rows of
d columns: the row loop's ``Tiling.row_bytes`` a pipeline stage). Blocks are numbered in that
order within the group, and an instruction streams blocks ``[b0, b0 + nb)``, which may cross from
one head (or section) into the next. Per block, as QKV per tile:

    y[r]  = W[r, :] . (x * in_norm) * rsqrt(mean(x^2) + eps)     r: the block's pair rows
    q/k   = rope(y, pos);   q -> q scratch (fp32);  k, v -> kv_cache[layer][:, head, pos] (bf16)

``Tiling.qkv_span`` instructions per layer (:func:`spans`): the groups share them as evenly as
they can, and each group's blocks are shared as evenly as they can among its instructions, so a
one-wave QKV stage covers every SM instead of one tile per ``qkv_rows``-row tile (the 1B: 96 tiles
of 128 KB on 132 SMs). Every instruction of group ``g`` signals the group's counter ``q[l,g]``, which
all of its attention partials wait on (there is no ``kv[l,g]``: a group's K and V rows are in its
spans). bench/probes/steal_probe.py measured the loop form (``static``, bench/NOTES.md v90).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import ROW_BYTES, Cost, Instruction, Layout, Region, in_range, next_pow2, register
from .common import T_KC, T_N1, T_WQ, layer_input, rows_dot, tab_offset, to_bf16

# the loop indexes the offset table by section: q, k, v adjacent, and the k and v caches
if [Layout.column(k) - Layout.column("q") for k in "qkv"] != [0, 1, 2] or \
        Layout.column("vc") - Layout.column("kc") != 1:
    raise ImportError("opcodes.qkv_span needs Layout.TENSORS to list q, k, v and kc, vc next to each other")
from .qkv import SECTIONS, QKV


def span_pairs(lay: Layout) -> int:
    """RoPE pairs per block: ``Tiling.row_bytes`` (or ``ROW_BYTES``) of whole bf16 rows, two rows a
    pair, a power of two that divides ``hd/2``."""
    per = max(1, (lay.tiling.row_bytes or ROW_BYTES) // (2 * 2 * next_pow2(lay.cfg.d)))
    return min(1 << (per.bit_length() - 1), lay.cfg.hd // 2)


def blocks_per_head(lay: Layout) -> int:
    return (lay.cfg.hd // 2) // span_pairs(lay)


def blocks_per_group(lay: Layout) -> int:
    """Blocks of one KV group: its query heads', then its K head's and its V head's."""
    return (lay.cfg.group + 2) * blocks_per_head(lay)


def spans(lay: Layout) -> list[list[tuple[int, int]]]:
    """Per KV group, its instructions' ``(b0, nb)``: ``Tiling.qkv_span`` instructions in all, the first
    ``qkv_span % n_kv`` groups one more than the others, each group's blocks in contiguous shares
    that differ by at most one block."""
    n, nkv, nb = lay.tiling.qkv_span, lay.cfg.n_kv, blocks_per_group(lay)
    out = []
    for g in range(nkv):
        m = n // nkv + (g < n % nkv)
        out.append([(i * nb // m, (i + 1) * nb // m - i * nb // m) for i in range(m)])
    return out


def check_span(lay: Layout) -> list[str]:
    """Problems with ``Tiling.qkv_span`` for this layout ('' list when fine or off)."""
    n = lay.tiling.qkv_span
    if not n:
        return []
    lo, hi = lay.cfg.n_kv, lay.cfg.n_kv * blocks_per_group(lay)
    if not lo <= n <= hi:
        return [f"Tiling.qkv_span = {n} must be 0 (QKV tiles) or in [{lo}, {hi}]: at least one instruction a KV "
                f"group (n_kv = {lo}), at most one a block ({hi} blocks of {span_pairs(lay)} RoPE pairs)"]
    return []


@triton.jit
def _span_store(o1, o2, dims, layer, sec, head, pos, wtab_ptr, kc_ptr, vc_ptr, q_ptr,
                NQ: tl.constexpr, HD: tl.constexpr, MAX_SEQ: tl.constexpr, INTERP: tl.constexpr):
    # q (sec 0) to the fp32 scratch, k / v to the cache row pos (bf16): masked stores, no branch in the loop
    isq = sec == 0
    qb = q_ptr + layer * (NQ * HD) + head * HD + dims
    tl.store(qb, o1, mask=isq)
    tl.store(qb + HD // 2, o2, mask=isq)
    # the layer's K or V cache: the kernel's layer-0 pointer and the offset table's column (k and v adjacent)
    cb = tl.where(sec == 1, kc_ptr, vc_ptr) + tab_offset(wtab_ptr, layer, T_KC + tl.maximum(sec, 1) - 1)
    cb = cb + head * (MAX_SEQ * HD) + pos * HD + dims
    tl.store(cb, to_bf16(o1, INTERP), mask=~isq)
    tl.store(cb + HD // 2, to_bf16(o2, INTERP), mask=~isq)


@triton.jit
def _span_x(src, x1_ptr, dpart_ptr, layer, cols, live, D: tl.constexpr, DOWN_CHUNKS: tl.constexpr,
            FOLDED: tl.constexpr, INTERP: tl.constexpr):
    # the layer's input in fp32: bf16 at src, or (FOLDED) the previous layer's x1 + down partials, rounded
    # to bf16 as RESIDUAL rounds them (opcodes.common.layer_rows, without its branch on the layer)
    if FOLDED:
        y = tl.load(x1_ptr + (layer - 1) * D + cols, mask=live, other=0.0, cache_modifier=".cg")
        for kc in tl.static_range(DOWN_CHUNKS):
            y += tl.load(dpart_ptr + ((layer - 1) * DOWN_CHUNKS + kc) * D + cols, mask=live, other=0.0,
                         cache_modifier=".cg")
        v = to_bf16(y, INTERP).to(tl.float32)
    else:
        v = tl.load(src + cols, mask=live, other=0.0, cache_modifier=".cg").to(tl.float32)
    return v


@triton.jit
def _span_loop(layer, g, b0, nb, pos, src, x1_ptr, dpart_ptr, wtab_ptr, n1_ptr, wq_ptr, wk_ptr, wv_ptr, kc_ptr,
               vc_ptr, cos_ptr, sin_ptr, q_ptr,
               D: tl.constexpr, DP: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr,
               MAX_SEQ: tl.constexpr, EPS: tl.constexpr, SPAN_PAIRS: tl.constexpr, STAGES: tl.constexpr,
               DOWN_CHUNKS: tl.constexpr, FOLDED: tl.constexpr, INTERP: tl.constexpr):
    GROUP: tl.constexpr = NQ // NKV
    BPH: tl.constexpr = (HD // 2) // SPAN_PAIRS
    EVEN: tl.constexpr = D == DP
    cols = tl.arange(0, DP)
    pr = tl.arange(0, SPAN_PAIRS)
    nw_ptr = n1_ptr + tab_offset(wtab_ptr, layer, T_N1)
    for b in tl.range(b0, b0 + nb, num_stages=STAGES):
        # the input vector and the norm weight are read in the loop with the block's weights: a mask on the
        # loop variable keeps them from being hoisted before it, so the pipeliner issues them with the
        # weights' prologue instead of ahead of it (an L2 round trip and a reduction less before the first
        # weight load); the norm's sum is taken again per block (a few us of a block's ~1 us)
        live = (cols < D) & (b >= 0)
        xv = _span_x(src, x1_ptr, dpart_ptr, layer, cols, live, D, DOWN_CHUNKS, FOLDED, INTERP)
        rstd = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=0) / D + EPS)
        hv = xv * tl.load(nw_ptr + cols, mask=live, other=0.0).to(tl.float32)
        slot = b // BPH                                 # 0 .. GROUP-1: query heads, GROUP: K, GROUP+1: V
        sec = tl.where(slot < GROUP, 0, slot - GROUP + 1)
        head = tl.where(slot < GROUP, g * GROUP + slot, g)
        # the block's matrix: the kernel's layer-0 pointer and the offset table's column (q, k, v adjacent),
        # chosen per block, so the loop carries no pointer of its own (the kernel is at its register limit)
        w_ptr = tl.where(sec == 0, wq_ptr, tl.where(sec == 1, wk_ptr, wv_ptr)) + tab_offset(wtab_ptr, layer, T_WQ + sec)
        dims = (b % BPH) * SPAN_PAIRS + pr
        rows1 = head * HD + dims
        ok = rows1 >= 0
        y1 = rows_dot(w_ptr, rows1, ok, hv, 0, D, D, DP, EVEN) * rstd
        y2 = rows_dot(w_ptr, rows1 + HD // 2, ok, hv, 0, D, D, DP, EVEN) * rstd
        rot = sec < 2
        c = tl.where(rot, tl.load(cos_ptr + pos * (HD // 2) + dims), 1.0)
        s = tl.where(rot, tl.load(sin_ptr + pos * (HD // 2) + dims), 0.0)
        _span_store(y1 * c - y2 * s, y2 * c + y1 * s, dims, layer, sec, head, pos, wtab_ptr, kc_ptr, vc_ptr, q_ptr,
                    NQ, HD, MAX_SEQ, INTERP)


@triton.jit
def qkv_span_device(layer, g, b0, nb, pos, x_ptr, xout_ptr, x1_ptr, dpart_ptr, wtab_ptr, n1_ptr, wq_ptr, wk_ptr,
                    wv_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, q_ptr,
                    D: tl.constexpr, DP: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr,
                    MAX_SEQ: tl.constexpr, EPS: tl.constexpr, SPAN_PAIRS: tl.constexpr, STAGES: tl.constexpr,
                    DOWN_CHUNKS: tl.constexpr, RES_FOLD: tl.constexpr, INTERP: tl.constexpr):
    # one loop per kind of input, so the loop itself has no branch on the layer (loads under a branch
    # are not pipelined)
    if RES_FOLD and layer > 0:
        _span_loop(layer, g, b0, nb, pos, x_ptr, x1_ptr, dpart_ptr, wtab_ptr, n1_ptr, wq_ptr, wk_ptr, wv_ptr, kc_ptr,
                   vc_ptr, cos_ptr, sin_ptr, q_ptr, D, DP, NQ, NKV, HD, MAX_SEQ, EPS, SPAN_PAIRS, STAGES, DOWN_CHUNKS,
                   True, INTERP)
    else:
        _span_loop(layer, g, b0, nb, pos, layer_input(x_ptr, xout_ptr, layer, D), x1_ptr, dpart_ptr, wtab_ptr, n1_ptr,
                   wq_ptr, wk_ptr, wv_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, q_ptr, D, DP, NQ, NKV, HD, MAX_SEQ, EPS,
                   SPAN_PAIRS, STAGES, DOWN_CHUNKS, False, INTERP)


@register
@dataclass(frozen=True)
class QKVSpan(Instruction):
    layer: int
    g: int        # KV group
    b0: int       # first block of the group's (:func:`blocks_per_group`)
    nb: int       # blocks

    NAME = "qkv_span"
    STAGE = 0
    ARGS = ("pos", "x_ptr", "xout_ptr", "x1_ptr", "dpart_ptr", "wtab_ptr", "n1_ptr", "wq_ptr", "wk_ptr", "wv_ptr",
            "kc_ptr", "vc_ptr", "cos_ptr", "sin_ptr", "q_ptr",
            "D", "DP", "NQ", "NKV", "HD", "MAX_SEQ", "EPS", "SPAN_PAIRS", "STAGES", "DOWN_CHUNKS", "RES_FOLD", "INTERP")
    CONSTEXPRS = {"SPAN_PAIRS": span_pairs}
    # only in the kernels of tapes that hold it (Tiling.qkv_span): the default kernels are unchanged
    IN_EVERY_KERNEL = False
    TABLES = QKV.TABLES
    VIRTUAL = QKV.VIRTUAL
    SCRATCH = QKV.SCRATCH
    device = qkv_span_device

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return QKV.scratch_shapes(lay)

    @classmethod
    def tables(cls, lay: Layout, device) -> dict:
        return QKV.tables(lay, device)

    @classmethod
    def stream_rows(cls, lay: Layout) -> int:
        return 2 * span_pairs(lay)

    @classmethod
    def stream_width(cls, lay: Layout) -> int:
        return next_pow2(lay.cfg.d)

    def check_operands(self, lay: Layout) -> list[str]:
        nb = blocks_per_group(lay)
        bad = in_range("layer", self.layer, lay.cfg.layers) + in_range("g", self.g, lay.cfg.n_kv)
        bad += in_range("b0", self.b0, nb)
        if not 1 <= self.nb <= nb - max(0, self.b0):
            bad.append(f"nb {self.nb} not in [1, {nb - max(0, self.b0)}] (blocks {self.b0}.. of {nb})")
        return bad

    def blocks(self, lay: Layout) -> list[tuple[int, int, int, int]]:
        """Per block: (sec, head, first dim, last dim + 1) of its pairs in the head's first half."""
        c, bph, pb = lay.cfg, blocks_per_head(lay), span_pairs(lay)
        out = []
        for b in range(self.b0, self.b0 + self.nb):
            slot, d0 = divmod(b, bph)
            sec = 0 if slot < c.group else slot - c.group + 1
            head = self.g * c.group + slot if sec == 0 else self.g
            out.append((sec, head, d0 * pb, (d0 + 1) * pb))
        return out

    def writes(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        out = []
        for sec, head, lo, hi in self.blocks(lay):
            buf = ("q", "kv_new_k", "kv_new_v")[sec]
            base = self.layer * (c.q_dim if sec == 0 else c.kv_dim) + head * c.hd
            out += [Region(buf, base + lo, base + hi), Region(buf, base + c.hd // 2 + lo, base + c.hd // 2 + hi)]
        return out

    def reads(self, lay: Layout) -> list[Region]:
        return lay.input_regions(self.layer, 0, lay.cfg.d)

    def cost(self, lay: Layout) -> Cost:
        d, rows = lay.cfg.d, 2 * span_pairs(lay) * self.nb
        return Cost(hbm_bytes=2 * rows * d, l2_bytes=2 * 2 * d + 4 * rows, flops=2 * rows * d)

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        x = st.layer_input(self.layer).float()
        nw = st.weights[self.layer]["in_norm"].float()
        h = x * nw
        rstd = torch.rsqrt((x * x).sum() / c.d + c.eps)
        for sec, head, lo, hi in self.blocks(lay):
            w = st.weights[self.layer][SECTIONS[sec]]
            rows1 = head * c.hd + torch.arange(lo, hi)
            y1 = (w[rows1].float() @ h) * rstd
            y2 = (w[rows1 + c.hd // 2].float() @ h) * rstd
            if sec < 2:
                cos, sin = st.tables["cos_ptr"][st.pos, lo:hi], st.tables["sin_ptr"][st.pos, lo:hi]
                y1, y2 = y1 * cos - y2 * sin, y2 * cos + y1 * sin
            if sec == 0:
                q = st.buf["q"].view(c.layers, c.n_q, c.hd)
                q[self.layer, head, lo:hi] = y1
                q[self.layer, head, c.hd // 2 + lo: c.hd // 2 + hi] = y2
            else:
                cache = st.kv[self.layer][sec - 1]
                cache[0, head, st.pos, lo:hi] = y1.to(torch.bfloat16)
                cache[0, head, st.pos, c.hd // 2 + lo: c.hd // 2 + hi] = y2.to(torch.bfloat16)
