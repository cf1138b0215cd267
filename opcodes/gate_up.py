"""GATE_UP: one row tile of the SwiGLU input projections, with the post-attention RMSNorm.

    h      = x1 * rsqrt(mean(x1^2) + eps) * post_norm
    act[r] = silu(Wgate[r] . h) * (Wup[r] . h)       for the tile's GU_ROWS rows r

The (1, ffn) activation is produced a block at a time; the down projection consumes each
block as soon as the tiles of its K range are done. Streams ``2 * GU_ROWS * d * 2`` bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import Cost, Instruction, Layout, Region, in_range, register, tile_start
from .tiling import cdiv
from .common import T_N2, T_WG, T_WU, gemv_stream, row_loop_dot, row_loop_store, row_loop_vec, tab_offset


@triton.jit
def _gu_rows(row0, nrows, g_ptr, u_ptr, nw_ptr, xin, act_out,
             D: tl.constexpr, DP: tl.constexpr, FFN: tl.constexpr, EPS: tl.constexpr, GU_ROWS: tl.constexpr,
             GU_RB: tl.constexpr, STAGES: tl.constexpr, GU_SPAN: tl.constexpr, WARP_ROWS: tl.constexpr,
             INTERP: tl.constexpr):
    # whole rows, GU_RB of gate and of up per pipeline stage (Tiling.row_bytes); GU_SPAN: the tile's
    # rows are its operand ``nrows`` (a multiple of GU_RB, Tiling.gu_tiles), else GU_ROWS. WARP_ROWS:
    # each row summed inside one warp (Tiling.warp_rows)
    hv, rstd = row_loop_vec(xin, nw_ptr, D, DP, EPS, WARP_ROWS)
    EVEN: tl.constexpr = (D == DP) and (FFN % GU_ROWS == 0) and not GU_SPAN
    if GU_SPAN:
        nb = nrows // GU_RB
    else:
        nb = GU_ROWS // GU_RB
    for b in tl.range(0, nb, num_stages=STAGES):
        rows = row0 + b * GU_RB + tl.arange(0, GU_RB)
        rm = rows < FFN
        gv = row_loop_dot(g_ptr, rows, rm, hv, D, DP, EVEN, WARP_ROWS) * rstd
        uv = row_loop_dot(u_ptr, rows, rm, hv, D, DP, EVEN, WARP_ROWS) * rstd
        row_loop_store(act_out + rows, gv / (1.0 + tl.exp(-gv)) * uv, rm, WARP_ROWS, INTERP)


@triton.jit
def gate_up_device(layer, row0, nrows, wtab_ptr, n2_ptr, wg_ptr, wu_ptr, x1_ptr, act_ptr,
                   D: tl.constexpr, DP: tl.constexpr, FFN: tl.constexpr, EPS: tl.constexpr, GU_ROWS: tl.constexpr,
                   GU_RB: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, GU_SPAN: tl.constexpr,
                   WARP_ROWS: tl.constexpr, INTERP: tl.constexpr):
    g_ptr = wg_ptr + tab_offset(wtab_ptr, layer, T_WG)
    u_ptr = wu_ptr + tab_offset(wtab_ptr, layer, T_WU)
    nw_ptr = n2_ptr + tab_offset(wtab_ptr, layer, T_N2)
    xin = x1_ptr + layer * D
    if GU_RB == 0:
        rows = row0 + tl.arange(0, GU_ROWS)
        rm = rows < FFN
        accg, accu, ss = gemv_stream(g_ptr, rows, u_ptr, rows, rm, xin, nw_ptr, 0, D, D, GU_ROWS, BK, STAGES,
                                     TWO=True, NORM=True, EVEN=(D % BK == 0) and (FFN % GU_ROWS == 0))
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / D + EPS)
        gv = tl.sum(accg, axis=1) * rstd
        uv = tl.sum(accu, axis=1) * rstd
        act = gv / (1.0 + tl.exp(-gv)) * uv
        tl.store(act_ptr + layer * FFN + rows, act, mask=rm)
    else:
        _gu_rows(row0, nrows, g_ptr, u_ptr, nw_ptr, xin, act_ptr + layer * FFN, D, DP, FFN, EPS, GU_ROWS,
                 GU_RB, STAGES, GU_SPAN, WARP_ROWS, INTERP)


@register
@dataclass(frozen=True)
class GateUp(Instruction):
    layer: int
    row0: int
    rows: int = 0     # rows of gate and of up (0: Tiling.gu_rows; > 0 only with Tiling.gu_tiles)

    NAME = "gate_up"
    STAGE = 4
    ARGS = ("wtab_ptr", "n2_ptr", "wg_ptr", "wu_ptr", "x1_ptr", "act_ptr", "D", "DP", "FFN", "EPS", "GU_ROWS", "GU_RB",
            "BK", "STAGES", "GU_SPAN", "WARP_ROWS", "INTERP")
    CONSTEXPRS = {"GU_ROWS": lambda lay: lay.tiling.gu_rows,
                  "GU_RB": lambda lay: lay.tiling.rows_per_block(lay.cfg.d, 2, lay.tiling.gu_rows),
                  "GU_SPAN": lambda lay: int(lay.tiling.gu_tiles > 0)}
    device = gate_up_device

    SCRATCH = {"act": "fp32"}

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"act": (lay.cfg.layers, lay.cfg.ffn)}

    @classmethod
    def stream_rows(cls, lay: Layout) -> int:
        return 2 * lay.tiling.gu_rows           # gate and up

    @staticmethod
    def tile_bounds(cfg, tiling) -> tuple[int, int] | str:
        """The fewest and most tiles ``Tiling.gu_tiles`` may ask for (tiles of at most ``gu_rows`` rows,
        at least one stage of the row loop each), or why it cannot ask for any."""
        ffn = cfg.ffn
        rb = tiling.rows_per_block(cfg.d, 2, tiling.gu_rows)
        if not rb or ffn % rb:
            return (f"Tiling.gu_tiles needs the row loop (row_bytes > 0) over whole stages of rows: ffn = {ffn}, "
                    f"{rb} rows a stage")
        if tiling.down_k < ffn:
            return (f"Tiling.gu_tiles needs one down K chunk (down_k >= ffn = {ffn}), got down_k = {tiling.down_k}: "
                    "a gate/up tile signals the counter of one chunk")
        return cdiv(ffn, tiling.gu_rows), ffn // rb

    @classmethod
    def spans(cls, lay: Layout) -> list[tuple[int, int]]:
        """The layer's tiles as (row0, rows) operands: ``ffn / gu_rows`` tiles of ``gu_rows`` rows (rows
        0), or with ``Tiling.gu_tiles`` = N, N tiles of whole pipeline stages (``GU_RB`` rows), the
        larger ones first, at most ``gu_rows`` rows each."""
        t, ffn = lay.tiling, lay.cfg.ffn
        if not t.gu_tiles:
            return [(r, 0) for r in range(0, ffn, t.gu_rows)]
        bounds, n = cls.tile_bounds(lay.cfg, t), t.gu_tiles
        if isinstance(bounds, str):
            raise ValueError(bounds)
        least, units = bounds
        rb = cls.CONSTEXPRS["GU_RB"](lay)
        if not least <= n <= units:
            raise ValueError(f"Tiling.gu_tiles = {n} must be in [{least}, {units}]: tiles of at most gu_rows = "
                             f"{t.gu_rows} rows, at least one stage of {rb} rows each")
        q, extra = divmod(units, n)
        out, r = [], 0
        for i in range(n):
            k = (q + (i < extra)) * rb
            out.append((r, k))
            r += k
        return out

    def check_operands(self, lay: Layout) -> list[str]:
        bad = in_range("layer", self.layer, lay.cfg.layers)
        if not self.rows:
            return bad + tile_start("row0", self.row0, lay.tiling.gu_rows, lay.cfg.ffn)
        rb = self.CONSTEXPRS["GU_RB"](lay)
        if not lay.tiling.gu_tiles or not rb:
            return bad + [f"rows {self.rows}: a gate/up tile's own row count needs Tiling.gu_tiles and the row loop"]
        bad += tile_start("row0", self.row0, rb, lay.cfg.ffn)
        if not (0 < self.rows <= lay.tiling.gu_rows and self.rows % rb == 0 and self.row0 + self.rows <= lay.cfg.ffn):
            bad.append(f"rows {self.rows} not a multiple of {rb} in (0, {lay.tiling.gu_rows}] ending by ffn "
                       f"{lay.cfg.ffn}")
        return bad

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.row0, min(self.row0 + (self.rows or lay.tiling.gu_rows), lay.cfg.ffn)

    def reads(self, lay: Layout) -> list[Region]:
        d = lay.cfg.d
        return [Region("x1", self.layer * d, (self.layer + 1) * d)]

    def writes(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        base = self.layer * lay.cfg.ffn
        return [Region("act", base + lo, base + hi)]

    def cost(self, lay: Layout) -> Cost:
        d = lay.cfg.d
        lo, hi = self._rows(lay)
        return Cost(hbm_bytes=2 * 2 * (hi - lo) * d, l2_bytes=4 * d + 2 * d + 4 * (hi - lo),
                    flops=4 * (hi - lo) * d)

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        lo, hi = self._rows(lay)
        x = st.buf["x1"].view(c.layers, c.d)[self.layer]
        nw = st.weights[self.layer]["post_norm"].float()
        rstd = torch.rsqrt((x * x).sum() / c.d + c.eps)
        h = x * nw
        g = (st.weights[self.layer]["gate"][lo:hi].float() @ h) * rstd
        u = (st.weights[self.layer]["up"][lo:hi].float() @ h) * rstd
        st.buf["act"].view(c.layers, c.ffn)[self.layer, lo:hi] = torch.nn.functional.silu(g) * u
