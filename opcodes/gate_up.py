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
from .common import T_N2, T_WG, T_WU, gemv_stream, norm_row_vec, rows_dot, tab_offset


@triton.jit
def _gu_rows(row0, g_ptr, u_ptr, nw_ptr, xin, act_out,
             D: tl.constexpr, DP: tl.constexpr, FFN: tl.constexpr, EPS: tl.constexpr, GU_ROWS: tl.constexpr,
             GU_RB: tl.constexpr, STAGES: tl.constexpr):
    # whole rows, GU_RB of gate and of up per pipeline stage (Tiling.row_bytes)
    hv, rstd = norm_row_vec(xin, nw_ptr, D, DP, EPS)
    EVEN: tl.constexpr = (D == DP) and (FFN % GU_ROWS == 0)
    for b in tl.range(0, GU_ROWS // GU_RB, num_stages=STAGES):
        rows = row0 + b * GU_RB + tl.arange(0, GU_RB)
        rm = rows < FFN
        gv = rows_dot(g_ptr, rows, rm, hv, 0, D, D, DP, EVEN) * rstd
        uv = rows_dot(u_ptr, rows, rm, hv, 0, D, D, DP, EVEN) * rstd
        tl.store(act_out + rows, gv / (1.0 + tl.exp(-gv)) * uv, mask=rm)


@triton.jit
def gate_up_device(layer, row0, wtab_ptr, n2_ptr, wg_ptr, wu_ptr, x1_ptr, act_ptr,
                   D: tl.constexpr, DP: tl.constexpr, FFN: tl.constexpr, EPS: tl.constexpr, GU_ROWS: tl.constexpr,
                   GU_RB: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
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
        _gu_rows(row0, g_ptr, u_ptr, nw_ptr, xin, act_ptr + layer * FFN, D, DP, FFN, EPS, GU_ROWS,
                 GU_RB, STAGES)


@register
@dataclass(frozen=True)
class GateUp(Instruction):
    layer: int
    row0: int

    NAME = "gate_up"
    STAGE = 4
    ARGS = ("wtab_ptr", "n2_ptr", "wg_ptr", "wu_ptr", "x1_ptr", "act_ptr", "D", "DP", "FFN", "EPS", "GU_ROWS", "GU_RB",
            "BK", "STAGES")
    CONSTEXPRS = {"GU_ROWS": lambda lay: lay.tiling.gu_rows,
                  "GU_RB": lambda lay: lay.tiling.rows_per_block(lay.cfg.d, 2, lay.tiling.gu_rows)}
    device = gate_up_device

    SCRATCH = {"act": "fp32"}

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"act": (lay.cfg.layers, lay.cfg.ffn)}

    @classmethod
    def stream_rows(cls, lay: Layout) -> int:
        return 2 * lay.tiling.gu_rows           # gate and up

    def check_operands(self, lay: Layout) -> list[str]:
        return (in_range("layer", self.layer, lay.cfg.layers)
                + tile_start("row0", self.row0, lay.tiling.gu_rows, lay.cfg.ffn))

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.row0, min(self.row0 + lay.tiling.gu_rows, lay.cfg.ffn)

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
