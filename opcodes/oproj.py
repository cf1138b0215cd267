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

import triton
import triton.language as tl

from .base import Cost, Instruction, Layout, Region, in_range, register, tile_start
from .tiling import cdiv
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
def oproj_device(layer, row0, oc, x_ptr, xout_ptr, wtab_ptr, wo_ptr, attn_ptr, x1_ptr, opart_ptr, dpart_ptr,
                 D: tl.constexpr, NQ: tl.constexpr, HD: tl.constexpr, O_ROWS: tl.constexpr, O_K: tl.constexpr,
                 O_CHUNKS: tl.constexpr, O_PART: tl.constexpr, O_BK: tl.constexpr, STAGES: tl.constexpr,
                 DOWN_CHUNKS: tl.constexpr, RES_FOLD: tl.constexpr, INTERP: tl.constexpr):
    QD: tl.constexpr = NQ * HD
    w_ptr = wo_ptr + tab_offset(wtab_ptr, layer, T_WO)
    rows = row0 + tl.arange(0, O_ROWS)
    rm = rows < D
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
    ARGS = ("x_ptr", "xout_ptr", "wtab_ptr", "wo_ptr", "attn_ptr", "x1_ptr", "opart_ptr", "dpart_ptr",
            "D", "NQ", "HD", "O_ROWS", "O_K", "O_CHUNKS", "O_PART", "O_BK", "STAGES", "DOWN_CHUNKS", "RES_FOLD", "INTERP")
    CONSTEXPRS = {"O_ROWS": lambda lay: lay.tiling.o_rows, "O_K": lambda lay: lay.o_k,
                  "O_CHUNKS": lambda lay: lay.n_o_k, "O_PART": lambda lay: int(lay.o_partial),
                  "O_BK": lambda lay: lay.tiling.o_bk or lay.tiling.bk}
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

    def reads(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        k0, k1 = self._ks(lay)
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
        return Cost(hbm_bytes=2 * (hi - lo) * (k1 - k0), l2_bytes=4 * (k1 - k0) + 6 * (hi - lo),
                    flops=2 * (hi - lo) * (k1 - k0))

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        lo, hi = self._rows(lay)
        k0, k1 = self._ks(lay)
        a = st.buf["attn"].view(c.layers, c.q_dim)[self.layer, k0:k1]
        y = st.weights[self.layer]["o"][lo:hi, k0:k1].float() @ a
        if not lay.o_partial:
            x = st.layer_input(self.layer)[lo:hi].float()
            st.buf["x1"].view(c.layers, c.d)[self.layer, lo:hi] = x + y
        else:
            st.buf["opart"].view(c.layers, lay.n_o_k, c.d)[self.layer, self.oc, lo:hi] = y


def n_tiles(lay: Layout) -> int:
    return cdiv(lay.cfg.d, lay.tiling.o_rows) * lay.n_o_k
