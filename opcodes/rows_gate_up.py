"""GATE_UP_R: one tile of the gate and up projections over every row, with the post-attention RMSNorm
and SiLU (opcodes/rows.py).

    h[:, n]   = x1[:, n] * post_norm,  rstd[n] = rsqrt(mean(x1[:, n]^2) + eps)
    act[r, n] = bf16(silu(g) * u),  g = (Wg[r, :] . bf16(h[:, n])) * rstd[n],  u likewise with Wu

``bf16(h)`` and the parts of ``sum(x1^2)`` come built by the O projection's tiles (``hn2_r``, ``ss2_r``:
``common_rows.store_normed``). Rows r in [r0, r0 + GU_ROWS) of gate and of up; ``act_r`` bf16 ``[L, ffn, ROWS]`` (the down projection's
operand, rounded as the oracle's bf16 product).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import Cost, Layout, Region, register, tile_start
from .common import T_WG, T_WU, tab_offset, to_bf16
from .common_rows import col_rstd, rows_stream
from .gate_up import GateUp
from .rows import RowsInstruction, bf16_dot, bregion, bview, check_n0, col_rstd_r


@triton.jit
def gate_up_r_device(r0, layer, n0, hn2_r_ptr, ss2_r_ptr, act_r_ptr, wtab_ptr, wg_ptr, wu_ptr,
                     D: tl.constexpr, FFN: tl.constexpr, EPS: tl.constexpr, GU_ROWS: tl.constexpr, BK: tl.constexpr,
                     STAGES: tl.constexpr, SS2_P: tl.constexpr, SS2_PP: tl.constexpr, ROWS: tl.constexpr,
                     NT: tl.constexpr, INTERP: tl.constexpr):
    if NT == ROWS:
        n0 = 0
    wg = wg_ptr + tab_offset(wtab_ptr, layer, T_WG)
    wu = wu_ptr + tab_offset(wtab_ptr, layer, T_WU)
    rows = r0 + tl.arange(0, GU_ROWS)
    rm = rows < FFN
    acc1, acc2 = rows_stream(wg, rows, wu, rows, rm, hn2_r_ptr + layer * (D * ROWS) + n0 * D, 0, NT, NT, D, D,
                             GU_ROWS, NT, BK, STAGES, TWO=True,
                             EVEN=(D % BK == 0) & (FFN % GU_ROWS == 0), INTERP=INTERP)
    rstd = col_rstd(ss2_r_ptr + layer * (SS2_P * ROWS) + n0 * SS2_P, SS2_P, SS2_PP, D, EPS, NT)
    g = acc1 * rstd[None, :]
    u = acc2 * rstd[None, :]
    act = g / (1.0 + tl.exp(-g)) * u
    n = tl.arange(0, NT)
    tl.store(act_r_ptr + layer * (FFN * ROWS) + n0 * FFN + rows[:, None] * NT + n[None, :], to_bf16(act, INTERP),
             mask=rm[:, None])


@register
@dataclass(frozen=True)
class GateUpR(RowsInstruction):
    r0: int
    layer: int
    n0: int = 0       # the column block (opcodes.rows)

    NAME = "gate_up_r"
    STAGE = 3
    ARGS = ("hn2_r_ptr", "ss2_r_ptr", "act_r_ptr", "wtab_ptr", "wg_ptr", "wu_ptr",
            "D", "FFN", "EPS", "GU_ROWS", "BK", "STAGES", "SS2_P", "SS2_PP", "ROWS", "NT", "INTERP")
    CONSTEXPRS = {"GU_ROWS": GateUp.CONSTEXPRS["GU_ROWS"]}
    SCRATCH = {"act_r": "bf16"}
    device = gate_up_r_device

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"act_r": (lay.cfg.layers, lay.cfg.ffn, lay.rows)}

    @classmethod
    def stream_rows(cls, lay: Layout) -> int:
        return 2 * lay.tiling.gu_rows

    def check_operands(self, lay: Layout) -> list[str]:
        bad = tile_start("r0", self.r0, lay.tiling.gu_rows, lay.cfg.ffn) + check_n0(self.n0, lay)
        return bad + ([] if 0 <= self.layer < lay.cfg.layers else [f"layer {self.layer} not in [0, {lay.cfg.layers})"])

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.r0, min(self.r0 + lay.tiling.gu_rows, lay.cfg.ffn)

    def reads(self, lay: Layout) -> list[Region]:
        d, l, p = lay.cfg.d, self.layer, lay.ss_parts[2]
        return [bregion("hn2_r", lay, d, l, 0, d, self.n0), bregion("ss2_r", lay, p, l, 0, p, self.n0)]

    def writes(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        return [bregion("act_r", lay, lay.cfg.ffn, self.layer, lo, hi, self.n0)]

    def cost(self, lay: Layout) -> Cost:
        d, R = lay.cfg.d, lay.n_tile
        lo, hi = self._rows(lay)
        return Cost(hbm_bytes=2 * 2 * (hi - lo) * d, l2_bytes=2 * d * R + 2 * (hi - lo) * R,
                    flops=4 * (hi - lo) * d * R)

    def run_torch(self, lay: Layout, st) -> None:
        c, b, p = lay.cfg, self.n0 // lay.n_tile, lay.ss_parts[2]
        lo, hi = self._rows(lay)
        lw = st.weights[self.layer]
        xb = bview(st.buf["hn2_r"], lay, c.d, c.layers)[self.layer, b]
        rstd = col_rstd_r(bview(st.buf["ss2_r"], lay, p, c.layers)[self.layer, b], p, c.d, c.eps)
        g = bf16_dot(lw["gate"][lo:hi], xb) * rstd[None, :]
        u = bf16_dot(lw["up"][lo:hi], xb) * rstd[None, :]
        act = torch.nn.functional.silu(g) * u
        bview(st.buf["act_r"], lay, c.ffn, c.layers)[self.layer, b, lo:hi] = act.to(torch.bfloat16)
