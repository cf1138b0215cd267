"""OPROJ: one (row tile, K chunk) of the output projection.

    y[r] = Wo[r, K_oc] . attn[K_oc]          K_oc = [oc*O_K, (oc+1)*O_K) of n_q*hd

With one K chunk (``O_K = n_q*hd``), outside tensor parallelism (``Layout.o_partial``), the tile
adds the residual and writes ``x1[r] = x[r] + y[r]``.
With several, it writes the partial ``opart[oc, r]`` and O_REDUCE adds the chunks and the
residual: then a chunk's tiles wait only for the attention of the query heads in that chunk,
not for the whole attention, so the O projection streams while later KV groups still attend.
Streams ``O_ROWS * O_K * 2`` bytes of Wo; attn (fp32) comes from L2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import Cost, Instruction, Layout, Region, cdiv, in_range, register, tile_start
from .common import T_WO, gemv_stream, layer_rows, tab_offset


@triton.jit
def _o_store(y, rows, rm, layer, oc, x_ptr, xout_ptr, x1_ptr, opart_ptr, dpart_ptr,
             D: tl.constexpr, O_CHUNKS: tl.constexpr, O_PART: tl.constexpr, DOWN_CHUNKS: tl.constexpr,
             RES_FOLD: tl.constexpr, INTERP: tl.constexpr):
    if O_PART == 0:
        xr = layer_rows(x_ptr, xout_ptr, x1_ptr, dpart_ptr, layer, rows, rm, D, DOWN_CHUNKS, RES_FOLD, INTERP)
        tl.store(x1_ptr + layer * D + rows, xr + y, mask=rm)
    else:
        tl.store(opart_ptr + (layer * O_CHUNKS + oc) * D + rows, y, mask=rm)


@triton.jit
def merge_stream(w_ptr, rows, row_mask, part_o_ptr, part_ml_ptr, layer, pos,
                 NQ: tl.constexpr, HD: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                 PART_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLITS: tl.constexpr,
                 MIN_CHUNK: tl.constexpr, EVEN: tl.constexpr):
    """The O tile's streaming loop under ``Tiling.o_merge``: each ``BK``-column block of Wo is dotted
    with the attention output of its ``BK / HD`` heads, merged in the loop from their partials
    (ATTN_REDUCE's arithmetic: ``M = max m_s``, ``sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s``) over
    the splits that hold keys at ``pos`` (the prefix splits below ``cdiv(pos, chunk)`` and the last),
    so the partials' loads are pipelined with the weights'. Returns the fp32 ``[ROWS, BK]`` accumulators."""
    QD: tl.constexpr = NQ * HD
    NH: tl.constexpr = BK // HD
    chunk = tl.maximum((pos + SPLITS - 2) // (SPLITS - 1), MIN_CHUNK)
    active = (pos + chunk - 1) // chunk
    sp = tl.arange(0, SPLITS_PAD)
    smask = (sp < active) | (sp == SPLITS - 1)
    hh = tl.arange(0, NH)
    dd = tl.arange(0, HD)
    acc = tl.zeros([ROWS, BK], dtype=tl.float32)
    wrow = w_ptr + rows[:, None] * QD
    for kk in tl.range(0, QD, BK, num_stages=STAGES):
        prow = (layer * NQ + kk // HD + hh)[None, :] * PART_SPLITS + sp[:, None]       # [SPLITS_PAD, NH]
        m = tl.load(part_ml_ptr + prow * 2, mask=smask[:, None], other=float("-inf"), cache_modifier=".cg")
        l = tl.load(part_ml_ptr + prow * 2 + 1, mask=smask[:, None], other=0.0, cache_modifier=".cg")
        o = tl.load(part_o_ptr + prow[:, :, None] * HD + dd[None, None, :], mask=smask[:, None, None], other=0.0,
                    cache_modifier=".cg")                                             # [SPLITS_PAD, NH, HD]
        cols = kk + tl.arange(0, BK)
        if EVEN:
            w = tl.load(wrow + cols[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(wrow + cols[None, :], mask=row_mask[:, None], other=0.0)
        mx = tl.max(m, axis=0)
        wt = tl.where(smask[:, None], tl.exp2(m - mx[None, :]), 0.0)
        a = tl.sum(o * wt[:, :, None], axis=0) / tl.sum(wt * l, axis=0)[:, None]       # [NH, HD]
        acc += w.to(tl.float32) * tl.reshape(a, [BK])[None, :]
    return acc


@triton.jit
def oproj_device(layer, row0, oc, pos, x_ptr, xout_ptr, wtab_ptr, wo_ptr, attn_ptr, part_o_ptr, part_ml_ptr, x1_ptr,
                 opart_ptr, dpart_ptr,
                 D: tl.constexpr, NQ: tl.constexpr, HD: tl.constexpr, O_ROWS: tl.constexpr, O_K: tl.constexpr,
                 O_CHUNKS: tl.constexpr, O_PART: tl.constexpr, O_BK: tl.constexpr, STAGES: tl.constexpr,
                 DOWN_CHUNKS: tl.constexpr, RES_FOLD: tl.constexpr, INTERP: tl.constexpr, O_MERGE: tl.constexpr,
                 PART_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr):
    QD: tl.constexpr = NQ * HD
    w_ptr = wo_ptr + tab_offset(wtab_ptr, layer, T_WO)
    rows = row0 + tl.arange(0, O_ROWS)
    rm = rows < D
    if O_MERGE:
        acc = merge_stream(w_ptr, rows, rm, part_o_ptr, part_ml_ptr, layer, pos, NQ, HD, O_ROWS, O_BK, STAGES,
                           PART_SPLITS, SPLITS_PAD, SPLITS, MIN_CHUNK, EVEN=D % O_ROWS == 0)
    else:
        acc, _, _ = gemv_stream(w_ptr, rows, w_ptr, rows, rm, attn_ptr + layer * QD, attn_ptr, oc * O_K, QD, O_K,
                                O_ROWS, O_BK, STAGES, TWO=False, NORM=False,
                                EVEN=(QD % O_K == 0) and (O_K % O_BK == 0) and (D % O_ROWS == 0))
    _o_store(tl.sum(acc, axis=1), rows, rm, layer, oc, x_ptr, xout_ptr, x1_ptr, opart_ptr, dpart_ptr, D, O_CHUNKS,
             O_PART, DOWN_CHUNKS, RES_FOLD, INTERP)


@register
@dataclass(frozen=True)
class OProj(Instruction):
    layer: int
    row0: int
    oc: int       # K chunk of n_q*hd (0 when the projection is not split)

    NAME = "oproj"
    STAGE = 3
    ARGS = ("pos", "x_ptr", "xout_ptr", "wtab_ptr", "wo_ptr", "attn_ptr", "part_o_ptr", "part_ml_ptr", "x1_ptr",
            "opart_ptr", "dpart_ptr", "D", "NQ", "HD", "O_ROWS", "O_K", "O_CHUNKS", "O_PART", "O_BK", "STAGES",
            "DOWN_CHUNKS", "RES_FOLD", "INTERP", "O_MERGE", "PART_SPLITS", "SPLITS_PAD", "SPLITS", "MIN_CHUNK")
    CONSTEXPRS = {"O_ROWS": lambda lay: lay.tiling.o_rows, "O_K": lambda lay: lay.o_k,
                  "O_CHUNKS": lambda lay: lay.n_o_k, "O_PART": lambda lay: int(lay.o_partial),
                  "O_BK": lambda lay: lay.tiling.o_bk or lay.tiling.bk, "O_MERGE": lambda lay: lay.tiling.o_merge}
    device = oproj_device

    # x1 = x + attn . Wo^T (written here, or by O_REDUCE from the per-chunk partials ``opart``)
    SCRATCH = {"x1": "fp32", "opart": "fp32"}

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        c = lay.cfg
        return {"x1": (c.layers, c.d), "opart": (c.layers, lay.n_o_k if lay.o_partial else 0, c.d)}

    @classmethod
    def stream_rows(cls, lay: Layout) -> int:
        return lay.tiling.o_rows

    @classmethod
    def stream_width(cls, lay: Layout) -> int:
        return cls.CONSTEXPRS["O_BK"](lay)

    def check_operands(self, lay: Layout) -> list[str]:
        return (in_range("layer", self.layer, lay.cfg.layers)
                + tile_start("row0", self.row0, lay.tiling.o_rows, lay.cfg.d)
                + in_range("oc", self.oc, lay.n_o_k))

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.row0, min(self.row0 + lay.tiling.o_rows, lay.cfg.d)

    def _ks(self, lay: Layout) -> tuple[int, int]:
        k = lay.o_k
        return self.oc * k, min((self.oc + 1) * k, lay.cfg.q_dim)

    @classmethod
    def args(cls, lay: Layout) -> tuple[str, ...]:
        """ARGS less the buffers it does not read under ``lay``: the merged attention (``attn``) or,
        without ``Tiling.o_merge``, the partials."""
        skip = ("attn_ptr",) if lay.tiling.o_merge else ("part_o_ptr", "part_ml_ptr")
        return tuple(a for a in cls.ARGS if a not in skip)

    def reads(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        k0, k1 = self._ks(lay)
        if lay.tiling.o_merge:                  # the partials of every head in its columns (all of them)
            ns = lay.attn_instr_splits
            r0, r1 = (self.layer * c.n_q + k0 // c.hd) * ns, (self.layer * c.n_q + k1 // c.hd) * ns
            out = [Region("part_o", r0 * c.hd, r1 * c.hd), Region("part_ml", r0 * 2, r1 * 2)]
        else:
            out = [Region("attn", self.layer * c.q_dim + k0, self.layer * c.q_dim + k1)]
        if not lay.o_partial:
            out += lay.input_regions(self.layer, *self._rows(lay))
        return out

    def writes(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        if not lay.o_partial:
            base = self.layer * lay.cfg.d
            return [Region("x1", base + lo, base + hi)]
        base = (self.layer * lay.n_o_k + self.oc) * lay.cfg.d
        return [Region("opart", base + lo, base + hi)]

    def cost(self, lay: Layout) -> Cost:
        lo, hi = self._rows(lay)
        k0, k1 = self._ks(lay)
        vec = 4 * (k1 - k0)
        if lay.tiling.o_merge:                  # the partials of the splits that hold keys at max_seq - 1
            active = cdiv(lay.max_seq - 1, lay.split_chunk(lay.max_seq - 1)) if lay.max_seq > 1 else 0
            vec *= (active + 1) * (lay.cfg.hd + 2) / lay.cfg.hd
        return Cost(hbm_bytes=2 * (hi - lo) * (k1 - k0), l2_bytes=int(vec) + 6 * (hi - lo),
                    flops=2 * (hi - lo) * (k1 - k0))

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        lo, hi = self._rows(lay)
        k0, k1 = self._ks(lay)
        if lay.tiling.o_merge:
            a = merge_partials(lay, st, self.layer)[k0:k1]
        else:
            a = st.buf["attn"].view(c.layers, c.q_dim)[self.layer, k0:k1]
        y = st.weights[self.layer]["o"][lo:hi, k0:k1].float() @ a
        if not lay.o_partial:
            x = st.layer_input(self.layer)[lo:hi].float()
            st.buf["x1"].view(c.layers, c.d)[self.layer, lo:hi] = x + y
        else:
            st.buf["opart"].view(c.layers, lay.n_o_k, c.d)[self.layer, self.oc, lo:hi] = y


def merge_partials(lay: Layout, st, layer: int):
    """The attention output of ``layer`` (``[n_q * hd]`` fp32) merged from the partials of the splits
    that hold keys at ``st.pos``, as :func:`merge_stream` merges them (``Tiling.o_merge``)."""
    c, ns = lay.cfg, lay.attn_instr_splits
    po = st.buf["part_o"].view(c.layers, c.n_q, ns, c.hd)[layer]
    pml = st.buf["part_ml"].view(c.layers, c.n_q, ns, 2)[layer]
    chunk = lay.split_chunk(st.pos)
    live = [s for s in range(ns) if s == ns - 1 or (chunk and s < cdiv(st.pos, chunk))]
    po, m, l = po[:, live], pml[:, live, 0], pml[:, live, 1]
    w = torch.exp2(m - m.max(dim=1, keepdim=True).values)
    return ((po * w[..., None]).sum(dim=1) / (w * l).sum(dim=1, keepdim=True)).reshape(-1)


def n_tiles(lay: Layout) -> int:
    return cdiv(lay.cfg.d, lay.tiling.o_rows) * lay.n_o_k
